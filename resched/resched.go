// Package resched is the rescheduler's planner (contract §12, after
// Llumnix's): over a snapshot of the monitor's view of every model's
// workers, it proposes migrations of running requests, pairs src → dst,
// that even out the load or move work off cordoned workers.
//
// A round runs four stages per model, for each policy in order:
//
//  1. policy: the policy computes its metric and ranks the workers that
//     should give work (sources, most urgent first) and those that may take
//     it (destinations, best first);
//  2. filters: the planner drops stale workers, workers resting after a
//     migration (the cooldown), destinations that are not free or are
//     cordoned, and workers already paired this round;
//  3. pair selection: each source in turn takes the first destination left,
//     so a source whose best destination was taken moves on to the next;
//  4. validation: every pair is checked once more against the rules of a
//     round: a worker in at most one pair, hence no A → B beside B → A,
//     never a worker with itself.
//
// It is pure: no NATS, no clock of its own (the snapshot carries the time).
// The monitor builds the snapshot; the dispatcher around it sends the
// requests.
package resched

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"
)

// Policy names, the reason of a pair.
const (
	PolicyDecodeLoad = "decode_load"
	PolicyFailover   = "failover"
)

// Defaults of Config.
const (
	// DefaultBalanceGap is how far from a model's mean usage a worker must
	// be to give or take work (--balance-gap).
	DefaultBalanceGap = 0.1
	// DefaultCooldown is how long a worker rests after a migration
	// (--rescheduling-cooldown).
	DefaultCooldown = 10 * time.Second
)

// Config configures a Planner.
type Config struct {
	// BalanceGap is a fraction in [0, 1): decode_load moves work from
	// workers above the model's mean usage + gap to workers below mean − gap.
	BalanceGap float64
	// Cooldown is how long a worker that took part in a migration rests.
	// Must not be negative.
	Cooldown time.Duration
	// Policies run in this order; nil means decode_load then failover.
	Policies []Policy
}

// DefaultConfig returns the defaults: both policies, gap 0.1, cooldown 10s.
func DefaultConfig() Config {
	return Config{BalanceGap: DefaultBalanceGap, Cooldown: DefaultCooldown}
}

// Validate reports every problem of the configuration, joined.
func (c Config) Validate() error {
	var errs []error
	if c.BalanceGap < 0 || c.BalanceGap >= 1 || c.BalanceGap != c.BalanceGap {
		errs = append(errs, fmt.Errorf("resched: balance gap %v not in [0, 1)", c.BalanceGap))
	}
	if c.Cooldown < 0 {
		errs = append(errs, fmt.Errorf("resched: cooldown %v is negative", c.Cooldown))
	}
	return errors.Join(errs...)
}

// Worker is one worker of a model as the monitor sees it.
type Worker struct {
	ID uint64
	// Usage is the mean over the worker's fresh ranks of KV blocks in use
	// over total blocks; meaningful when HasUsage.
	Usage    float64
	HasUsage bool
	// Fresh: the worker has fresh state (not stale). Only fresh workers
	// take part.
	Fresh bool
	// Free: listed free in the model's record (not busy, not cordoned).
	Free bool
	// Cordoned: an operator cordoned it; its work should move off.
	Cordoned bool
}

// Model is one model's workers.
type Model struct {
	Name    string
	Workers []Worker
}

// Snapshot is the view one round plans on.
type Snapshot struct {
	Now    time.Time
	Models []Model
}

// Pair is one proposed migration.
type Pair struct {
	Model  string `json:"model"`
	Src    uint64 `json:"src"`
	Dst    uint64 `json:"dst"`
	Reason string `json:"reason"` // the policy
}

// Policy ranks one model's workers for one kind of migration. The planner
// filters what it returns, selects the pairs and validates them.
type Policy interface {
	Name() string
	// Candidates returns the workers that should give work, most urgent
	// first, and those that may take it, best first.
	Candidates(m Model, gap float64) (srcs, dsts []Worker)
}

// Planner plans rounds. It keeps when each worker last took part in a
// migration, for the cooldown. It belongs to one goroutine.
type Planner struct {
	cfg    Config
	rested map[workerKey]time.Time // when the worker may take part again
}

type workerKey struct {
	model string
	id    uint64
}

// New checks cfg and returns a Planner.
func New(cfg Config) (*Planner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Policies == nil {
		cfg.Policies = []Policy{DecodeLoad{}, Failover{}}
	}
	return &Planner{cfg: cfg, rested: make(map[workerKey]time.Time)}, nil
}

// Plan runs one round over s and returns the valid pairs, policy by
// policy. The workers of the pairs start their cooldown at s.Now.
func (p *Planner) Plan(s Snapshot) []Pair {
	var out []Pair
	for _, m := range s.Models {
		used := make(map[uint64]bool)
		for _, pol := range p.cfg.Policies {
			srcs, dsts := pol.Candidates(m, p.cfg.BalanceGap)
			srcs = p.filter(srcs, m.Name, used, s.Now, false)
			dsts = p.filter(dsts, m.Name, used, s.Now, true)
			for _, pair := range selectPairs(m.Name, pol.Name(), srcs, dsts) {
				if validPair(pair, used) {
					used[pair.Src], used[pair.Dst] = true, true
					out = append(out, pair)
				}
			}
		}
	}
	for _, pair := range out {
		until := s.Now.Add(p.cfg.Cooldown)
		p.rested[workerKey{pair.Model, pair.Src}] = until
		p.rested[workerKey{pair.Model, pair.Dst}] = until
	}
	p.forget(s.Now)
	return out
}

// filter keeps the workers that may take part in a pair of this round:
// fresh, not resting, not yet paired and, for a destination, free and not
// cordoned. It keeps their order.
func (p *Planner) filter(ws []Worker, model string, used map[uint64]bool, now time.Time, dst bool) []Worker {
	kept := ws[:0:0]
	for _, w := range ws {
		switch {
		case !w.Fresh, used[w.ID], now.Before(p.rested[workerKey{model, w.ID}]):
		case dst && (!w.Free || w.Cordoned):
		default:
			kept = append(kept, w)
		}
	}
	return kept
}

// selectPairs gives each source in turn the first destination no earlier
// source took, never itself.
func selectPairs(model, reason string, srcs, dsts []Worker) []Pair {
	var out []Pair
	taken := make(map[uint64]bool)
	for _, src := range srcs {
		if taken[src.ID] {
			continue // already a destination
		}
		for _, dst := range dsts {
			if dst.ID == src.ID || taken[dst.ID] {
				continue
			}
			taken[src.ID], taken[dst.ID] = true, true
			out = append(out, Pair{Model: model, Src: src.ID, Dst: dst.ID, Reason: reason})
			break
		}
	}
	return out
}

// validPair checks a selected pair against the rules of a round, given the
// workers already paired: never a worker with itself, a worker in at most
// one pair (hence no B → A beside A → B).
func validPair(pair Pair, used map[uint64]bool) bool {
	return pair.Src != pair.Dst && !used[pair.Src] && !used[pair.Dst]
}

// forget drops cooldowns that are over.
func (p *Planner) forget(now time.Time) {
	for k, until := range p.rested {
		if !now.Before(until) {
			delete(p.rested, k)
		}
	}
}

// DecodeLoad balances KV usage within a model: sources above the mean +
// gap, destinations below the mean − gap, paired highest with lowest.
type DecodeLoad struct{}

// Name is "decode_load".
func (DecodeLoad) Name() string { return PolicyDecodeLoad }

// Candidates ranks the workers above the model's mean usage + gap, most
// loaded first, and the free ones below the mean − gap, least loaded first.
func (DecodeLoad) Candidates(m Model, gap float64) (srcs, dsts []Worker) {
	var ws []Worker
	var sum float64
	for _, w := range m.Workers {
		if w.Fresh && w.HasUsage {
			ws = append(ws, w)
			sum += w.Usage
		}
	}
	if len(ws) < 2 {
		return nil, nil
	}
	mean := sum / float64(len(ws))
	for _, w := range ws {
		switch {
		case w.Usage > mean+gap:
			srcs = append(srcs, w)
		case w.Usage < mean-gap && w.Free:
			dsts = append(dsts, w)
		}
	}
	slices.SortFunc(srcs, func(a, b Worker) int { return cmp.Or(cmp.Compare(b.Usage, a.Usage), cmp.Compare(a.ID, b.ID)) })
	slices.SortFunc(dsts, byUsage)
	return srcs, dsts
}

// Failover moves work off cordoned workers onto the least used free ones.
type Failover struct{}

// Name is "failover".
func (Failover) Name() string { return PolicyFailover }

// Candidates ranks the fresh cordoned workers by id and the free ones,
// least used first.
func (Failover) Candidates(m Model, _ float64) (srcs, dsts []Worker) {
	for _, w := range m.Workers {
		switch {
		case !w.Fresh:
		case w.Cordoned:
			srcs = append(srcs, w)
		case w.Free:
			dsts = append(dsts, w)
		}
	}
	slices.SortFunc(srcs, func(a, b Worker) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(dsts, byUsage)
	return srcs, dsts
}

// byUsage orders workers by usage, unknown usage last, then by id.
func byUsage(a, b Worker) int {
	if a.HasUsage != b.HasUsage {
		if a.HasUsage {
			return -1
		}
		return 1
	}
	return cmp.Or(cmp.Compare(a.Usage, b.Usage), cmp.Compare(a.ID, b.ID))
}
