// Package dispatch runs the rescheduler (contract §12): every interval it
// takes a snapshot of the monitor's view, has the planner (package resched)
// pick migration pairs, and sends each pair's source engine a NATS request
// on <prefix>.migrate.<model_key>.<src>, counting the answers. No responders
// and timeouts are counted, not retried. It keeps the recent rounds for
// GET /rescheduler.
package dispatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/resched"
)

// Defaults of Config.
const (
	// DefaultMaxRequests is how many running requests one migration asks
	// the source to cut (--rescheduling-max-requests).
	DefaultMaxRequests = 1
	// DefaultTimeout bounds the wait for an engine's answer
	// (--rescheduling-timeout).
	DefaultTimeout = time.Second
	// DefaultHistory is how many rounds GET /rescheduler lists.
	DefaultHistory = 32
)

// Answers of a migrate request, the `result` label.
const (
	ResultOK           = "ok"
	ResultNoResponders = "no_responders"
	ResultTimeout      = "timeout"
	ResultError        = "error"
)

// Source gives the planner its view: a snapshot of every model's workers,
// and the epoch under which this monitor writes a model's record (0: it
// does not write it, and proposes nothing for it).
type Source interface {
	Snapshot(ctx context.Context) (resched.Snapshot, error)
	Epoch(model string) uint64
}

// Config configures a Dispatcher.
type Config struct {
	// Conn is the monitor's NATS connection. Required.
	Conn *nats.Conn
	// Prefix is the subject prefix.
	Prefix string
	// Interval between rounds; must be > 0 (the caller does not run a
	// Dispatcher when rescheduling is off).
	Interval time.Duration
	// MaxRequests caps each request's max_requests: a pair asks for the
	// requests the planner sized it to (this many when it did not size
	// it), never more. Timeout bounds the wait for each answer.
	MaxRequests uint64
	Timeout     time.Duration
	// Planner plans the rounds. Required.
	Planner *resched.Planner
	// Source is the monitor's view. Required.
	Source Source
	// Endpoint returns a worker's endpoint for dst_endpoint ("" unknown).
	Endpoint func(model string, worker uint64) string
	// History is how many rounds are kept for Rounds.
	History int
	// Logger and Registerer: nil for none.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Validate reports every problem of the configuration, joined.
func (c Config) Validate() error {
	var errs []error
	if c.Conn == nil {
		errs = append(errs, errors.New("dispatch: nil connection"))
	}
	if err := events.ValidatePrefix(c.Prefix); err != nil {
		errs = append(errs, err)
	}
	if c.Interval <= 0 {
		errs = append(errs, fmt.Errorf("dispatch: interval %v is not positive", c.Interval))
	}
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("dispatch: timeout %v is not positive", c.Timeout))
	}
	if c.MaxRequests == 0 {
		errs = append(errs, errors.New("dispatch: max requests is 0"))
	}
	if c.Planner == nil || c.Source == nil {
		errs = append(errs, errors.New("dispatch: Planner and Source are required"))
	}
	return errors.Join(errs...)
}

// Round is one round as GET /rescheduler shows it.
type Round struct {
	At    time.Time `json:"at"`
	Pairs []Sent    `json:"pairs"`
}

// Sent is one pair of a round and what became of its request.
type Sent struct {
	resched.Pair
	Epoch    uint64 `json:"epoch"`
	Result   string `json:"result"`
	Migrated uint64 `json:"migrated"`
	Error    string `json:"error,omitempty"`
}

// Dispatcher runs rounds until its context ends.
type Dispatcher struct {
	cfg     Config
	log     *slog.Logger
	metrics metrics

	mu     sync.Mutex
	rounds []Round // newest last
}

// New checks cfg and returns a Dispatcher, with its metrics registered.
func New(cfg Config) (*Dispatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.History <= 0 {
		cfg.History = DefaultHistory
	}
	if cfg.Endpoint == nil {
		cfg.Endpoint = func(string, uint64) string { return "" }
	}
	d := &Dispatcher{cfg: cfg, log: cfg.Logger}
	if d.log == nil {
		d.log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	d.metrics = m
	return d, nil
}

// Run plans and dispatches a round every interval until ctx is done.
func (d *Dispatcher) Run(ctx context.Context) error {
	t := time.NewTicker(d.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if err := d.Round(ctx); err != nil && ctx.Err() == nil {
				d.log.Warn("dispatch: round skipped", "err", err)
			}
		}
	}
}

// Round runs one round now: it plans, sends every pair's request at once
// and waits for their answers.
func (d *Dispatcher) Round(ctx context.Context) error {
	snap, err := d.cfg.Source.Snapshot(ctx)
	if err != nil {
		return err
	}
	// Only the models whose records this monitor writes, under the epoch
	// read here: read again later, a lease lost meanwhile would send
	// epoch 0.
	models := snap.Models[:0:0]
	epochs := make(map[string]uint64, len(snap.Models))
	for _, m := range snap.Models {
		if e := d.cfg.Source.Epoch(m.Name); e > 0 {
			models = append(models, m)
			epochs[m.Name] = e
		}
	}
	snap.Models = models
	pairs := d.cfg.Planner.Plan(snap)
	sent := make([]Sent, len(pairs))
	var wg sync.WaitGroup
	for i, p := range pairs {
		sent[i] = Sent{Pair: p, Epoch: epochs[p.Model]}
		d.metrics.pairs.WithLabelValues(p.Reason).Inc()
		wg.Go(func() { d.send(ctx, &sent[i]) })
	}
	wg.Wait()
	if len(sent) > 0 {
		d.mu.Lock()
		d.rounds = append(d.rounds, Round{At: snap.Now, Pairs: sent})
		if len(d.rounds) > d.cfg.History {
			d.rounds = d.rounds[len(d.rounds)-d.cfg.History:]
		}
		d.mu.Unlock()
	}
	return nil
}

// send sends one pair's request and records the answer.
func (d *Dispatcher) send(ctx context.Context, s *Sent) {
	n := d.cfg.MaxRequests
	if s.Requests > 0 {
		n = min(s.Requests, n)
	}
	req := events.MigrateRequest{Model: s.Model, Src: s.Src, Dst: s.Dst, DstEndpoint: d.cfg.Endpoint(s.Model, s.Dst),
		MaxRequests: n, Reason: s.Reason, Epoch: s.Epoch}
	data, err := events.MarshalMigrateRequest(req)
	if err == nil {
		rctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
		var msg *nats.Msg
		msg, err = d.cfg.Conn.RequestWithContext(rctx, events.MigrateSubject(d.cfg.Prefix, s.Model, s.Src), data)
		cancel()
		if err == nil {
			var reply events.MigrateReply
			if reply, err = events.DecodeMigrateReply(msg.Data); err == nil {
				// An engine's count is not trusted past what was asked.
				s.Result, s.Migrated = ResultOK, min(reply.Migrated, req.MaxRequests)
			}
		}
	}
	switch {
	case err == nil:
	case errors.Is(err, nats.ErrNoResponders):
		s.Result = ResultNoResponders
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout):
		s.Result = ResultTimeout
	default:
		s.Result = ResultError
	}
	if err != nil {
		s.Error = err.Error()
	}
	d.metrics.answers.WithLabelValues(s.Reason, s.Result).Inc()
	d.metrics.migrated.WithLabelValues(s.Reason).Add(float64(s.Migrated))
	d.log.Info("dispatch: migration", "model", s.Model, "src", s.Src, "dst", s.Dst, "reason", s.Reason,
		"result", s.Result, "migrated", s.Migrated)
}

// Rounds returns the recent rounds that had pairs, newest last.
func (d *Dispatcher) Rounds() []Round {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Round(nil), d.rounds...)
}

type metrics struct {
	pairs, migrated *prometheus.CounterVec
	answers         *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (metrics, error) {
	m := metrics{
		pairs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_rescheduler_pairs_total",
			Help: "Migration pairs the rescheduler chose, by policy (decode_load, failover).",
		}, []string{"policy"}),
		answers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_rescheduler_answers_total",
			Help: "Answers to migrate requests by policy and result: ok, no_responders, timeout, error.",
		}, []string{"policy", "result"}),
		migrated: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_rescheduler_migrated_requests_total",
			Help: "Running requests engines said they cut for migration, by policy.",
		}, []string{"policy"}),
	}
	for _, p := range []string{resched.PolicyDecodeLoad, resched.PolicyFailover} {
		m.pairs.WithLabelValues(p)
		m.migrated.WithLabelValues(p)
	}
	if err := promreg.All(reg, m.pairs, m.answers, m.migrated); err != nil {
		return m, fmt.Errorf("dispatch: %w", err)
	}
	return m, nil
}
