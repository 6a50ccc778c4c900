// Package monitor keeps the load state of every worker, rank and source,
// applies the busy rules, and hands each model's busy set to a Sink whenever
// it changes. One goroutine, Run, owns all state; messages and commands reach
// it over channels. The package does not import NATS: the caller subscribes
// and calls Submit, and a busylist.Writer is the usual Sink.
package monitor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	// maxBatch is how many queued messages the loop applies before it hands
	// the changed records to the Sink.
	maxBatch = 256
)

// Errors.
var (
	ErrInvalidConfig = errors.New("invalid monitor config")
	ErrStopped       = errors.New("monitor stopped")
	ErrRunning       = errors.New("monitor already running")
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
	QueueSize           int
	Logger              *slog.Logger
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
		QueueSize:           DefaultQueueSize,
	}
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
	for _, l := range []struct {
		name string
		v    int
	}{
		{"max-models", c.MaxModels}, {"max-workers-per-model", c.MaxWorkersPerModel},
		{"max-sources-per-worker", c.MaxSourcesPerWorker}, {"max-ranks-per-worker", c.MaxRanksPerWorker},
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
type message struct {
	subject string
	data    []byte
}

// Monitor is the busy-set engine. Create it with New, run it with Run.
type Monitor struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	sink    Sink
	in      chan message
	cmds    chan func(*state)
	done    chan struct{} // closed when Run returns
	started atomic.Bool
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
		cfg:  cfg,
		log:  log,
		sink: sink,
		in:   make(chan message, cfg.QueueSize),
		cmds: make(chan func(*state)),
		done: make(chan struct{}),
	}
	var err error
	if m.metrics, err = newMetrics(cfg.Registerer, func() float64 { return float64(len(m.in)) }); err != nil {
		return nil, err
	}
	return m, nil
}

// Submit queues a message received on subject for the loop. It blocks while
// the queue is full, so that NATS's own buffering applies back-pressure, and
// drops the message once the monitor has stopped. data must not be modified
// afterwards.
func (m *Monitor) Submit(subject string, data []byte) {
	select {
	case m.in <- message{subject, data}:
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

// do runs fn on the loop goroutine and waits for it.
func (m *Monitor) do(ctx context.Context, fn func(*state)) error {
	ran := make(chan struct{})
	select {
	case m.cmds <- func(s *state) { fn(s); close(ran) }:
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
// returns ErrRunning.
func (m *Monitor) Run(ctx context.Context) error {
	if !m.started.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer close(m.done)
	s := newState(m.cfg, m.sink, m.metrics, m.log)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var armed time.Time
	batch := 0
	for {
		select {
		case <-ctx.Done():
			s.flush()
			return context.Cause(ctx)
		case msg := <-m.in:
			s.handle(msg, time.Now())
			if batch++; batch >= maxBatch || len(m.in) == 0 {
				s.flush()
				batch = 0
			}
		case fn := <-m.cmds:
			fn(s)
			s.flush()
		case <-timer.C:
			armed = time.Time{}
			s.expire(time.Now())
			s.flush()
		}
		if next, ok := s.nextDeadline(); ok && !next.Equal(armed) {
			armed = next
			timer.Reset(time.Until(next))
		}
	}
}
