// Package monitor keeps the load state of every worker, rank and source,
// applies the busy rules, and hands each model's busy set to a Sink whenever
// it changes. One goroutine, Run, owns all state; messages and commands reach
// it over channels. The package does not import NATS: the caller subscribes
// and hands the loop its subscriptions' channel (RunFrom) or calls Submit,
// and a busylist.Writer is the usual Sink.
package monitor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

// Defaults of Config.
const (
	// DefaultStaleAfter is how long a state counts after it was last heard.
	DefaultStaleAfter = 10 * time.Second
	// DefaultGoneAfter is how long a silent worker is kept before removal,
	// and how long a goodbye's tombstone lasts.
	DefaultGoneAfter = 60 * time.Second
	// DefaultMaxModels bounds the number of models tracked.
	DefaultMaxModels = 1024
	// DefaultMaxWorkersPerModel bounds the workers tracked per model.
	DefaultMaxWorkersPerModel = 4096
	// DefaultMaxSourcesPerWorker bounds the sources tracked per worker.
	DefaultMaxSourcesPerWorker = 16
	// DefaultMaxRanksPerWorker bounds the dp_size a report may declare.
	DefaultMaxRanksPerWorker = 1024
	// DefaultQueueSize is the number of messages buffered between Submit and
	// the loop; Submit blocks when it is full.
	DefaultQueueSize = 8192
	// DefaultShedFraction places the amber level (contract §15): a check
	// holds at amber above this fraction of its threshold.
	DefaultShedFraction = 0.8
	// DefaultCriticalFraction places the hard level (contract §15): a check
	// holds at hard above this fraction of its threshold, the decode check
	// capped at the whole cache.
	DefaultCriticalFraction = 1.1
	// maxBatch is how many queued messages the loop applies before it hands
	// the changed records to the Sink.
	maxBatch = 256
)

// Errors.
var (
	ErrInvalidConfig = errors.New("invalid monitor config")
	ErrStopped       = errors.New("monitor stopped")
	ErrRunning       = errors.New("monitor already running")
	// ErrWrongPartition: a report arrived on a mapped subject
	// (<prefix>.part.<p>...) whose p is not its model's partition among
	// Config.Partitions: a NATS server maps with another partition count.
	ErrWrongPartition = errors.New("subject's partition is not the model's")
)

// Config configures a Monitor.
type Config struct {
	// SubjectPrefix is the first token(s) of the subjects submitted.
	SubjectPrefix string
	// Defaults are the thresholds of models without an override.
	Defaults            events.Thresholds
	StaleAfter          time.Duration
	GoneAfter           time.Duration
	MaxModels           int
	MaxWorkersPerModel  int
	MaxSourcesPerWorker int
	MaxRanksPerWorker   int
	// MaxRoutersPerModel bounds the routers whose queues (contract §22) a
	// model keeps; a report of one more is refused (too_many_sources).
	MaxRoutersPerModel int
	QueueSize          int
	// ReleaseMargin m in [0, 1) is the hysteresis of the busy rules
	// (contract §12): a busy rank becomes free only when every check that
	// made it busy is at or below (1 − m) × its threshold. 0: exactly §5.
	ReleaseMargin float64
	// ShedFraction f in (0, 1] places the amber level of priority classes
	// (contract §15): a rank is amber when a check holds at f × its
	// threshold. 1 puts amber at busy: no worker is listed amber.
	ShedFraction float64
	// CriticalFraction c, finite and ≥ 1, places the hard level: a busy rank is
	// hard when a check holds at c × its threshold, the decode check capped
	// at the whole cache. 1 puts hard at busy: every busy worker is hard.
	CriticalFraction float64
	// RateWindow is how much monitor-clock time the prefill and preemption
	// rates are measured over (contract §21, --rate-window); > 0.
	RateWindow time.Duration
	// Partitions is the partition count P of the deployment (contract §10),
	// 0 when the subjects are not checked against one. A report or goodbye
	// on a mapped subject, <prefix>.part.<p>..., whose p is not its model's
	// partition among P came through a NATS server mapped with another P:
	// it is rejected (reason wrong_partition) and logged at most every 10 s.
	Partitions int
	Logger     *slog.Logger
	// Registerer receives the monitor's metrics; nil registers nothing.
	Registerer prometheus.Registerer
}

// DefaultConfig returns a Config with every default set and no thresholds.
func DefaultConfig() Config {
	return Config{
		SubjectPrefix:       events.DefaultSubjectPrefix,
		StaleAfter:          DefaultStaleAfter,
		GoneAfter:           DefaultGoneAfter,
		MaxModels:           DefaultMaxModels,
		MaxWorkersPerModel:  DefaultMaxWorkersPerModel,
		MaxSourcesPerWorker: DefaultMaxSourcesPerWorker,
		MaxRanksPerWorker:   DefaultMaxRanksPerWorker,
		MaxRoutersPerModel:  DefaultMaxRoutersPerModel,
		QueueSize:           DefaultQueueSize,
		ShedFraction:        DefaultShedFraction,
		CriticalFraction:    DefaultCriticalFraction,
		RateWindow:          DefaultRateWindow,
	}
}

// fractions returns the levels' fractions of the thresholds.
func (c Config) fractions() Fractions {
	return Fractions{Shed: c.ShedFraction, Critical: c.CriticalFraction}
}

// Validate reports every problem of the configuration at once.
func (c Config) Validate() error {
	var errs []error
	if err := events.ValidatePrefix(c.SubjectPrefix); err != nil {
		errs = append(errs, err)
	}
	if err := c.Defaults.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.StaleAfter <= 0 {
		errs = append(errs, fmt.Errorf("stale-after %v must be positive", c.StaleAfter))
	}
	if c.GoneAfter < c.StaleAfter {
		errs = append(errs, fmt.Errorf("gone-after %v must be at least stale-after %v", c.GoneAfter, c.StaleAfter))
	}
	if c.RateWindow <= 0 {
		errs = append(errs, fmt.Errorf("rate-window %v must be positive", c.RateWindow))
	}
	if c.Partitions < 0 {
		errs = append(errs, fmt.Errorf("partitions %d must not be negative", c.Partitions))
	}
	if !(c.ReleaseMargin >= 0 && c.ReleaseMargin < 1) {
		errs = append(errs, fmt.Errorf("release-margin %v must be in [0, 1)", c.ReleaseMargin))
	}
	if !(c.ShedFraction > 0 && c.ShedFraction <= 1) {
		errs = append(errs, fmt.Errorf("shed-fraction %v must be in (0, 1]", c.ShedFraction))
	}
	if !(c.CriticalFraction >= 1 && !math.IsInf(c.CriticalFraction, 1)) {
		errs = append(errs, fmt.Errorf("critical-fraction %v must be a finite number ≥ 1", c.CriticalFraction))
	}
	for _, l := range []struct {
		name string
		v    int
	}{
		{"max-models", c.MaxModels}, {"max-workers-per-model", c.MaxWorkersPerModel},
		{"max-sources-per-worker", c.MaxSourcesPerWorker}, {"max-ranks-per-worker", c.MaxRanksPerWorker},
		{"max-routers-per-model", c.MaxRoutersPerModel},
		{"queue-size", c.QueueSize},
	} {
		if l.v <= 0 {
			errs = append(errs, fmt.Errorf("%s %d must be positive", l.name, l.v))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("monitor: %w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// message is a NATS message on its way to the loop.
// message is one received message, decoded and checked by Submit.
type message struct {
	subject string // as received, for the reject log
	kind    events.Kind
	report  events.LoadReport    // kind KindLoad or KindEst
	bye     events.Goodbye       // kind KindBye or KindEstBye
	lat     events.LatencyReport // kind KindLat or KindLatr
	rq      events.RouterQueue   // kind KindRq
	err     error                // parse, decode or check error: rejected
	// unchecked: a load report whose subject has not been checked against
	// it yet; the state checks it unless its rank was last heard on the
	// same subject (state.checkSubject).
	unchecked bool
}

// Monitor is the busy-set engine. Create it with New, run it with Run.
type Monitor struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	sink    Sink
	in      chan message
	cmds    chan command
	done    chan struct{} // closed when Run returns
	kick    chan struct{} // capacity 1: a PendingSink took its records
	started atomic.Bool
	// sourceLen is the length of RunFrom's source channel, for the queue
	// gauge; nil before RunFrom.
	sourceLen atomic.Pointer[func() int]
	// decoders are the events.Decoders of Submit's callers, one per caller
	// at a time (a decoder interns the names it reads).
	decoders sync.Pool
}

// New returns a Monitor that reports to sink.
func New(cfg Config, sink Sink) (*Monitor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if sink == nil {
		return nil, fmt.Errorf("monitor: %w: nil sink", ErrInvalidConfig)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Monitor{
		cfg:      cfg,
		log:      log,
		sink:     sink,
		in:       make(chan message, cfg.QueueSize),
		cmds:     make(chan command),
		done:     make(chan struct{}),
		kick:     make(chan struct{}, 1),
		decoders: sync.Pool{New: func() any { return events.NewDecoder() }},
	}
	var err error
	if m.metrics, err = newMetrics(cfg.Registerer, m.queued); err != nil {
		return nil, err
	}
	return m, nil
}

// queued is the number of messages waiting for the loop.
func (m *Monitor) queued() float64 {
	n := len(m.in)
	if l := m.sourceLen.Load(); l != nil {
		n += (*l)()
	}
	return float64(n)
}

// Kick tells the monitor that its PendingSink has taken its pending
// records: the records it deferred are built and handed over. It never
// blocks and is safe for concurrent use.
func (m *Monitor) Kick() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// Submit decodes and checks a message received on subject, in the
// caller's goroutine (a NATS subscription's), and queues it for the loop,
// which only applies it. It blocks while the queue is full, so that NATS's
// own buffering applies back-pressure, and drops the message once the
// monitor has stopped. data is not kept. Safe for concurrent use.
func (m *Monitor) Submit(subject string, data []byte) {
	dec := m.decoders.Get().(*events.Decoder)
	msg := decodeMessage(m.cfg.SubjectPrefix, m.cfg.Partitions, dec, subject, data)
	m.decoders.Put(dec)
	select {
	case m.in <- msg:
	case <-m.done:
	}
}

// SetOverride sets (or with nil clears) a model's threshold override. The
// model's records are recomputed and handed to the Sink at once.
func (m *Monitor) SetOverride(ctx context.Context, model string, t *events.Thresholds) error {
	if t != nil {
		if err := t.Validate(); err != nil {
			return fmt.Errorf("monitor: set override of %q: %w", model, err)
		}
	}
	return m.do(ctx, func(s *state) { s.setOverride(model, t) })
}

// Seed tells the monitor of the workers listed in records a previous
// monitor wrote. Each one it has not heard from yet is kept as stale —
// neither busy nor free — and removed after gone-after unless it reports,
// so that after the warm-up the records show this monitor's view instead of
// keeping a dead monitor's lists. Limits apply as to reports.
func (m *Monitor) Seed(ctx context.Context, records []events.BusySet) error {
	return m.do(ctx, func(s *state) { s.seed(records, time.Now()) })
}

// SetCordon cordons (on) or uncordons a worker of a model (contract §12):
// while cordoned and fresh it is listed busy with reason "cordoned", never
// free. The worker need not be known yet. The model's record is recomputed
// at once.
func (m *Monitor) SetCordon(ctx context.Context, model string, worker uint64, on bool) error {
	if err := events.ValidateModel(model); err != nil {
		return fmt.Errorf("monitor: cordon: %w", err)
	}
	return m.do(ctx, func(s *state) { s.setCordon(model, worker, on, time.Now()) })
}

// command is fn to run on the loop; done is closed once it ran and the
// records it changed reached the Sink.
type command struct {
	fn   func(*state)
	done chan struct{}
}

// do runs fn on the loop goroutine and waits until it ran and the records
// it changed were handed to the Sink.
func (m *Monitor) do(ctx context.Context, fn func(*state)) error {
	ran := make(chan struct{})
	select {
	case m.cmds <- command{fn: fn, done: ran}:
	case <-m.done:
		return ErrStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-ran:
		return nil
	case <-m.done:
		return ErrStopped
	}
}

// Run owns the state until ctx ends; it returns ctx's cause. A second call
// (of Run or RunFrom) returns ErrRunning.
func (m *Monitor) Run(ctx context.Context) error {
	return RunFrom(ctx, m, Source[struct{}]{})
}
