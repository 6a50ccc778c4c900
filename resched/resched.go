// Package resched is the rescheduler's planner (contract §12, after
// Llumnix's): over a snapshot of the monitor's view of every model's
// workers, it proposes migrations of running requests, pairs src → dst
// with how many requests each moves, that even out the load or move work
// off cordoned workers.
//
// A round runs four stages per model, for each policy in order:
//
//  1. policy: the policy computes its metric and ranks the workers that
//     should give work (sources, most urgent first, each with the KV blocks
//     it should give) and those that may take it (destinations, best first,
//     each with the blocks it may take);
//  2. filters: the planner drops stale workers, workers resting after a
//     migration (the cooldown), destinations that are not free or are
//     cordoned, and workers already paired by an earlier policy;
//  3. pair selection: each source in turn is paired with the first
//     destination that still has room, and moves the blocks that close the
//     smaller of the two gaps, in requests: blocks ÷ the source's mean
//     blocks per request, rounded, at most MaxRequests (no pair when that
//     is less than half a request; 1 when the size is unknown). A destination
//     keeps taking from further sources while it stays below the light
//     mark (decode_load), so every loaded source gets a destination in
//     every round that has one, not one pair per model;
//  4. validation: every pair is checked once more against the rules of a
//     round: never a worker with itself, a source in one pair, no worker
//     both a source and a destination (hence no A → B beside B → A).
//
// It is pure: no NATS, no clock of its own (the snapshot carries the time).
// The monitor builds the snapshot; the dispatcher around it sends the
// requests.
package resched

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
)

// Policy names, the reason of a pair.
const (
	PolicyDecodeLoad = "decode_load"
	PolicyFailover   = "failover"
)

// Defaults of Config: contract §12's, so that a monitor turned on without
// more flags moves work as slowly as the contract promises.
const (
	// DefaultBalanceGap is how far from a model's mean load a worker must
	// be to give or take work (--balance-gap).
	DefaultBalanceGap = 0.1
	// DefaultCooldown is how long a worker rests after a migration
	// (--rescheduling-cooldown).
	DefaultCooldown = 10 * time.Second
	// DefaultMaxRequests caps the requests one pair moves
	// (--rescheduling-max-requests).
	DefaultMaxRequests = 1
)

// Recommended values, chosen by measurement for a round every 100–250 ms
// (docs/rescheduler.md, "Choosing the values"): the contract's defaults
// move one request per model per 10 s, which no operator can see.
const (
	// RecommendedBalanceGap: 0.1 left a worker that joined short of its
	// share; 0.02 migrated almost three times as often for little more.
	RecommendedBalanceGap = 0.05
	// RecommendedCooldown is long enough for the cut and the continuation's
	// prefill to show in the reports, short enough that a worker takes part
	// every third round at 200 ms. On the scale-out case 300 ms moved 36–42
	// requests for the same result as 500 ms's 24.
	RecommendedCooldown = 500 * time.Millisecond
	// RecommendedMaxRequests caps a pair; the planner sizes each pair below
	// it from the gap and the source's mean blocks per request.
	RecommendedMaxRequests = 4
)

// Config configures a Planner.
type Config struct {
	// BalanceGap is a fraction in [0, 1): decode_load moves work from
	// workers above the model's mean load + gap to workers below mean − gap.
	BalanceGap float64
	// Cooldown is how long a worker that took part in a migration rests.
	// Must not be negative.
	Cooldown time.Duration
	// MaxRequests caps the requests of one pair; at least 1. A failover
	// pair moves this many; a decode_load pair as many as close the gap.
	MaxRequests uint64
	// Policies run in this order; nil means decode_load then failover.
	Policies []Policy
}

// DefaultConfig returns contract §12's defaults: both policies, gap 0.1,
// cooldown 10s, 1 request a pair.
func DefaultConfig() Config {
	return Config{BalanceGap: DefaultBalanceGap, Cooldown: DefaultCooldown, MaxRequests: DefaultMaxRequests}
}

// RecommendedConfig returns the values docs/rescheduler.md recommends with
// a round every 200 ms: gap 0.05, cooldown 500ms, at most 4 requests a pair.
func RecommendedConfig() Config {
	return Config{BalanceGap: RecommendedBalanceGap, Cooldown: RecommendedCooldown, MaxRequests: RecommendedMaxRequests}
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
	if c.MaxRequests == 0 {
		errs = append(errs, errors.New("resched: max requests is 0"))
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
	// Committed is the projected usage (contract §21): the mean over the
	// worker's fresh ranks of kv_committed_blocks over total blocks;
	// meaningful when HasCommitted. decode_load balances on it when every
	// worker it compares has it, on Usage otherwise.
	Committed    float64
	HasCommitted bool
	// TotalBlocks is the KV blocks of the worker's fresh ranks together
	// (0: unknown, taken as equal to the other workers').
	TotalBlocks uint64
	// Requests is how many requests the load counts over the worker's
	// fresh ranks: running ones for Usage, running and waiting ones for
	// Committed (0: unknown). The mean blocks per request is the load's
	// blocks over it; unknown, a decode_load pair moves 1 request.
	Requests uint64
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
	// Requests is how many running requests the source is asked to cut.
	Requests uint64 `json:"requests"`
}

// Candidate is a worker a policy ranks, with how much it should give (a
// source) or may take (a destination).
type Candidate struct {
	Worker
	// Blocks is, for a source, the KV blocks it should give; for a
	// destination, those it may take this round. +Inf: no bound (the
	// pair moves MaxRequests).
	Blocks float64
	// PerRequest is a source's mean blocks per request (0: unknown).
	PerRequest float64
	// Keep is, for a destination, the room it keeps: once what it may
	// still take is at or below Keep, it takes no further pair this round.
	// +Inf: one pair a round.
	Keep float64
}

// Policy ranks one model's workers for one kind of migration. The planner
// filters what it returns, selects and sizes the pairs and validates them.
type Policy interface {
	Name() string
	// Candidates returns the workers that should give work, most urgent
	// first, and those that may take it, best first.
	Candidates(m Model, gap float64) (srcs, dsts []Candidate)
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

// role is what a worker is in a round.
type role uint8

const (
	roleNone role = iota
	roleSrc
	roleDst
)

// Plan runs one round over s and returns the valid pairs, policy by
// policy. The workers of the pairs start their cooldown at s.Now.
func (p *Planner) Plan(s Snapshot) []Pair {
	var out []Pair
	for _, m := range s.Models {
		roles := make(map[uint64]role)
		for _, pol := range p.cfg.Policies {
			srcs, dsts := pol.Candidates(m, p.cfg.BalanceGap)
			srcs = p.filter(srcs, m.Name, roles, s.Now, false)
			dsts = p.filter(dsts, m.Name, roles, s.Now, true)
			var round []Pair
			for _, pair := range p.selectPairs(m.Name, pol.Name(), srcs, dsts) {
				if validPair(pair, roles) {
					roles[pair.Src], roles[pair.Dst] = roleSrc, roleDst
					round = append(round, pair)
				}
			}
			out = append(out, round...)
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

// filter keeps the workers that may take part in a pair of this policy:
// fresh, not resting, not paired by an earlier policy and, for a
// destination, free and not cordoned. It keeps their order.
func (p *Planner) filter(cs []Candidate, model string, roles map[uint64]role, now time.Time, dst bool) []Candidate {
	kept := cs[:0:0]
	for _, c := range cs {
		switch {
		case !c.Fresh, roles[c.ID] != roleNone, now.Before(p.rested[workerKey{model, c.ID}]):
		case dst && (!c.Free || c.Cordoned):
		default:
			kept = append(kept, c)
		}
	}
	return kept
}

// selectPairs gives each source in turn the first destination that still
// has room and is not a source, never itself, and sizes the pair: the
// smaller of what the source should give and the destination may take, in
// requests of the source's mean size (requests). The destination's room
// shrinks by the blocks moved.
func (p *Planner) selectPairs(model, reason string, srcs, dsts []Candidate) []Pair {
	var out []Pair
	isSrc := make(map[uint64]bool, len(srcs))
	for _, s := range srcs {
		isSrc[s.ID] = true
	}
	room := make([]float64, len(dsts))
	for i, d := range dsts {
		room[i] = d.Blocks
	}
	open := func(i int) bool {
		d := dsts[i]
		return !isSrc[d.ID] && room[i] > 0 && (room[i] == d.Blocks || room[i] > d.Keep)
	}
	for _, src := range srcs {
		for i, dst := range dsts {
			if dst.ID == src.ID || !open(i) {
				continue
			}
			moved := min(src.Blocks, room[i])
			n := p.requests(moved, src.PerRequest)
			if n == 0 {
				break // less than half a request: moving one would overshoot
			}
			room[i] -= moved
			if math.IsInf(moved, 1) {
				room[i] = 0 // an unbounded destination takes one pair
			}
			out = append(out, Pair{Model: model, Src: src.ID, Dst: dst.ID, Reason: reason, Requests: n})
			break
		}
	}
	return out
}

// requests is how many requests of perRequest blocks move blocks: rounded
// to the nearest, at most MaxRequests, 0 when that is less than half a
// request (moving one would leave the source further below the mean than
// it is above it); MaxRequests when blocks is unbounded, 1 when the size
// of a request is unknown.
func (p *Planner) requests(blocks, perRequest float64) uint64 {
	switch {
	case math.IsInf(blocks, 1):
		return p.cfg.MaxRequests
	case !(perRequest > 0):
		return 1
	}
	n := math.Round(blocks / perRequest)
	if n >= float64(p.cfg.MaxRequests) {
		return p.cfg.MaxRequests
	}
	return uint64(n)
}

// validPair checks a selected pair against the rules of a round, given the
// roles of the workers already paired: never a worker with itself, a
// source in one pair, no worker both a source and a destination (hence no
// B → A beside A → B); a destination may take several pairs.
func validPair(pair Pair, roles map[uint64]role) bool {
	return pair.Src != pair.Dst && roles[pair.Src] == roleNone && roles[pair.Dst] != roleSrc
}

// forget drops cooldowns that are over.
func (p *Planner) forget(now time.Time) {
	for k, until := range p.rested {
		if !now.Before(until) {
			delete(p.rested, k)
		}
	}
}

// DecodeLoad balances the projected KV usage within a model (Llumnix's
// kv_cache_usage_ratio_projected) over its uncordoned workers (failover
// drains the cordoned ones): each worker's load is its committed
// usage when every compared worker reports it (contract §21), else its
// usage. Sources are the workers above the mean + gap, most loaded first,
// each to give the blocks above the mean; destinations the free ones below
// the mean − gap, least loaded first, each to take the blocks up to the
// mean while it stays below mean − gap.
type DecodeLoad struct{}

// Name is "decode_load".
func (DecodeLoad) Name() string { return PolicyDecodeLoad }

// Candidates ranks the workers above the model's mean load + gap, most
// loaded first, and the free ones below the mean − gap, least loaded
// first, with the blocks each should give or may take.
func (DecodeLoad) Candidates(m Model, gap float64) (srcs, dsts []Candidate) {
	var ws []Worker
	committed := true
	for _, w := range m.Workers {
		if w.Fresh && w.HasUsage && !w.Cordoned {
			ws = append(ws, w)
			committed = committed && w.HasCommitted
		}
	}
	if len(ws) < 2 {
		return nil, nil
	}
	load := func(w Worker) float64 {
		if committed {
			return w.Committed
		}
		return w.Usage
	}
	// Blocks in a worker's own size; a worker of unknown size counts as
	// the mean of the known ones (or 1 when none is known).
	var known, sumTotal float64
	var sum float64
	for _, w := range ws {
		sum += load(w)
		if w.TotalBlocks > 0 {
			known++
			sumTotal += float64(w.TotalBlocks)
		}
	}
	unit := 1.0
	if known > 0 {
		unit = sumTotal / known
	}
	total := func(w Worker) float64 {
		if w.TotalBlocks > 0 {
			return float64(w.TotalBlocks)
		}
		return unit
	}
	mean := sum / float64(len(ws))
	for _, w := range ws {
		l := load(w)
		switch {
		case l > mean+gap:
			c := Candidate{Worker: w, Blocks: (l - mean) * total(w)}
			if w.Requests > 0 {
				c.PerRequest = l * total(w) / float64(w.Requests)
			}
			srcs = append(srcs, c)
		case l < mean-gap && w.Free:
			dsts = append(dsts, Candidate{Worker: w, Blocks: (mean - l) * total(w), Keep: gap * total(w)})
		}
	}
	slices.SortFunc(srcs, func(a, b Candidate) int {
		return cmp.Or(cmp.Compare(load(b.Worker), load(a.Worker)), cmp.Compare(a.ID, b.ID))
	})
	slices.SortFunc(dsts, func(a, b Candidate) int {
		return cmp.Or(cmp.Compare(load(a.Worker), load(b.Worker)), cmp.Compare(a.ID, b.ID))
	})
	return srcs, dsts
}

// Failover moves work off cordoned workers onto the least used free ones,
// MaxRequests a pair, one pair a destination.
type Failover struct{}

// Name is "failover".
func (Failover) Name() string { return PolicyFailover }

// Candidates ranks the fresh cordoned workers by id and the free ones,
// least used first, all unbounded.
func (Failover) Candidates(m Model, _ float64) (srcs, dsts []Candidate) {
	for _, w := range m.Workers {
		switch {
		case !w.Fresh:
		case w.Cordoned:
			srcs = append(srcs, Candidate{Worker: w, Blocks: math.Inf(1)})
		case w.Free:
			dsts = append(dsts, Candidate{Worker: w, Blocks: math.Inf(1), Keep: math.Inf(1)})
		}
	}
	slices.SortFunc(srcs, func(a, b Candidate) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(dsts, func(a, b Candidate) int { return byUsage(a.Worker, b.Worker) })
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
