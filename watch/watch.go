// Package watch follows the busy-set bucket (workermon-busy) for people at
// a terminal, as `nats kv watch` would but readable: `workermon watch`.
//
// Two renderings: Lines writes one line per change of a record's content
// (its lists, reasons, all_busy or thresholds; a heartbeat re-put that
// changes nothing writes nothing) and one when a record is deleted, for
// logs and pipes; Screen redraws every model and its workers in place, with
// colours, for a terminal.
//
// With Config.Loads set (`--monitor-url`) the watch also reads the
// monitor's GET /loads every LoadsEvery and shows each worker's leading
// values of contract §21: the predicted queue delay, the prefill rate and
// the preemption rate; the bucket alone does not carry them.
//
// The watch is internal/kvwatch's loop (reconnects, stalls, a recreated
// bucket), with a sink that decodes each record and diffs what it publishes
// against what it had.
package watch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvwatch"
	"github.com/workermon/workermon/monitor"
)

// Mode is how the watch renders.
type Mode uint8

// Modes.
const (
	// Lines writes one line per change: for files, pipes and logs.
	Lines Mode = iota
	// Screen redraws the whole view in place with ANSI escapes: for a
	// terminal.
	Screen
)

// Defaults of Config.
const (
	// DefaultRedraw is the shortest time between two redraws of the screen.
	DefaultRedraw = 100 * time.Millisecond
	// DefaultStaleAfter is the age of a record past which the screen marks
	// it stale, as a router would (contract §7: its stale-list-after).
	DefaultStaleAfter = 10 * time.Second
	// DefaultWidth and DefaultHeight are the screen's size when Size gives
	// none.
	DefaultWidth  = 100
	DefaultHeight = 40
	// DefaultLoadsEvery is the time between two readings of the monitor's
	// loads: the screen's refresh, which redraws the ages every second.
	DefaultLoadsEvery = refresh
	// DefaultLoadsTimeout bounds one reading of the monitor's loads.
	DefaultLoadsTimeout = 2 * time.Second
)

const (
	// refresh is how often the screen is redrawn when nothing changes.
	refresh = time.Second
	// opTimeout bounds every request of the watch to the server.
	opTimeout = 5 * time.Second
	// probeEvery is how often the watch checks its bucket for a stall.
	probeEvery = 5 * time.Second
	// retryMin and retryMax bound the backoff between failed watches.
	retryMin, retryMax = 50 * time.Millisecond, 5 * time.Second
)

// Sentinel errors.
var (
	// ErrInvalidConfig wraps every problem Config.Validate finds.
	ErrInvalidConfig = errors.New("invalid watch config")
)

// Config configures a watch.
type Config struct {
	// JetStream reaches the bucket. Required.
	JetStream jetstream.JetStream
	// Out receives the lines or the screen. Required.
	Out io.Writer
	// Mode is Lines or Screen.
	Mode Mode
	// Model, when not empty, shows only this model.
	Model string
	// Color colours the screen (Screen only).
	Color bool
	// Redraw is the shortest time between two redraws (Screen). > 0.
	Redraw time.Duration
	// StaleAfter is the age past which a record is shown stale (Screen). > 0.
	StaleAfter time.Duration
	// Size returns the terminal's columns and rows (Screen); nil, or a
	// value ≤ 0, means DefaultWidth × DefaultHeight.
	Size func() (cols, rows int)
	// Header names what is watched in the screen's first line (e.g. the
	// NATS URL).
	Header string
	// Loads, when set, reads the monitor's GET /loads for model (every
	// model when empty), as api.Client.Loads does: the workers' leading
	// values (contract §21) are then shown on the screen and on every line.
	// nil: the bucket alone.
	Loads func(ctx context.Context, model string) ([]monitor.LoadRow, error)
	// LoadsFrom names where Loads reads (credentials redacted), for the
	// screen's status line and the logs.
	LoadsFrom string
	// LoadsEvery is the time between two readings of Loads. > 0.
	LoadsEvery time.Duration
	// LoadsTimeout bounds one reading of Loads. > 0.
	LoadsTimeout time.Duration
	// Hint, shown under the screen's header when Loads is nil, says how to
	// get the leading values (the flag that sets Loads).
	Hint string
	// Logger receives the watch loop's errors; nil discards.
	Logger *slog.Logger
	// Now is the clock of the lines' times and of the records' ages; nil
	// means time.Now.
	Now func() time.Time
}

// DefaultConfig returns a Config with every default set; the caller sets
// JetStream and Out.
func DefaultConfig() Config {
	return Config{Redraw: DefaultRedraw, StaleAfter: DefaultStaleAfter, LoadsEvery: DefaultLoadsEvery,
		LoadsTimeout: DefaultLoadsTimeout}
}

// Validate reports every problem of the configuration at once.
func (c Config) Validate() error {
	var errs []error
	if c.JetStream == nil {
		errs = append(errs, errors.New("JetStream is nil"))
	}
	if c.Out == nil {
		errs = append(errs, errors.New("output is nil"))
	}
	if c.Mode != Lines && c.Mode != Screen {
		errs = append(errs, fmt.Errorf("mode %d is neither Lines nor Screen", c.Mode))
	}
	if c.Model != "" {
		if err := events.ValidateModel(c.Model); err != nil {
			errs = append(errs, err)
		}
	}
	if c.Redraw <= 0 {
		errs = append(errs, fmt.Errorf("redraw interval %v must be positive", c.Redraw))
	}
	if c.StaleAfter <= 0 {
		errs = append(errs, fmt.Errorf("stale-after %v must be positive", c.StaleAfter))
	}
	if c.LoadsEvery <= 0 {
		errs = append(errs, fmt.Errorf("loads interval %v must be positive", c.LoadsEvery))
	}
	if c.LoadsTimeout <= 0 {
		errs = append(errs, fmt.Errorf("loads timeout %v must be positive", c.LoadsTimeout))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("watch: %w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// Run watches the bucket and renders it until ctx ends; it returns nil
// then, or the error that stopped it (writing to Out failed). The screen
// is restored before it returns.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s := &sink{model: cfg.Model, changed: make(chan struct{}, 1)}
	var loads *poller
	if cfg.Loads != nil {
		loads = newPoller(cfg, log, s.changed)
	}
	if cfg.Mode == Lines {
		lw := &lineWriter{w: cfg.Out}
		s.onChange = func(changes []Change) {
			if loads != nil {
				l := loads.cur.Load()
				for i := range changes {
					changes[i].Loads = l
				}
			}
			if err := lw.write(changes); err != nil {
				cancel(fmt.Errorf("watch: write: %w", err))
			}
		}
	}
	loop := kvwatch.New(kvwatch.Config{
		JS: cfg.JetStream, Bucket: events.BusyBucket, Replicas: 1, Log: log, ErrLevel: slog.LevelWarn,
		Now: cfg.Now, OpTimeout: opTimeout, ProbeEvery: probeEvery, RetryMin: retryMin, RetryMax: retryMax,
	}, s, noStats{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		loop.Run(ctx)
	}()
	loadsDone := make(chan struct{})
	if loads != nil {
		go func() {
			defer close(loadsDone)
			loads.run(ctx)
		}()
	} else {
		close(loadsDone)
	}
	var err error
	if cfg.Mode == Screen {
		err = runScreen(ctx, cfg, s, loads)
		cancel(err)
	}
	<-done
	<-loadsDone
	if err != nil {
		return err
	}
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// Record is a model's record as the watch holds it, with the watch's clock
// when it was received.
type Record struct {
	events.BusySet
	Received time.Time
}

// Change is a change of one model's record: Record is nil when the record
// was deleted (or became unreadable). Loads, when the watch reads the
// monitor's loads, is its last reading at the change.
type Change struct {
	Model  string
	Record *Record
	At     time.Time
	Loads  *Loads
}

// sink is the watch loop's Sink: it decodes every record into a
// copy-on-write state and, on every publish, tells what changed.
type sink struct {
	model    string // only this one, when not empty
	state    kvwatch.State[*Record]
	onChange func([]Change) // Lines: called on the loop's goroutine
	changed  chan struct{}  // capacity 1: the screen must be redrawn
	last     time.Time      // the loop's clock at the last Apply
}

var _ kvwatch.Sink = (*sink)(nil)

func (s *sink) Reset() { s.state.Reset() }

func (s *sink) Apply(e jetstream.KeyValueEntry, now time.Time) error {
	s.last = now
	model, err := events.ParseModelKey(e.Key())
	if err != nil {
		return &kvwatch.RecordError{Reason: "bad_key", Err: err}
	}
	if s.model != "" && model != s.model {
		return nil
	}
	if e.Operation() != jetstream.KeyValuePut {
		s.state.Remove(model)
		return nil
	}
	rec, err := events.DecodeBusySet(e.Value())
	if err == nil && rec.Model != model {
		err = fmt.Errorf("watch: record of model %q under the key of %q", rec.Model, model)
	}
	if err != nil {
		s.state.Remove(model)
		return &kvwatch.RecordError{Reason: events.Reason(err), Err: err}
	}
	s.state.Edit()[model] = &Record{BusySet: rec, Received: now}
	return nil
}

// Publish diffs the pending state against the published one, publishes
// it, and reports the changes of content.
func (s *sink) Publish() int {
	old, next := s.state.Load(), s.state.View()
	var changes []Change
	if !sameMap(old, next) {
		for _, model := range unionKeys(old, next) {
			a, b := old[model], next[model]
			switch {
			case b == nil && a != nil:
				changes = append(changes, Change{Model: model, At: s.last})
			case b != nil && (a == nil || !sameContent(&a.BusySet, &b.BusySet)):
				changes = append(changes, Change{Model: model, Record: b, At: b.Received})
			}
		}
	}
	n := s.state.Publish()
	if len(changes) > 0 && s.onChange != nil {
		s.onChange(changes)
	}
	// The screen shows ages too: every publish (heartbeats included) is
	// worth a redraw.
	select {
	case s.changed <- struct{}{}:
	default:
	}
	return n
}

// records returns the published records, sorted by model; nil before the
// initial values are in.
func (s *sink) records() []*Record {
	m := s.state.Load()
	if m == nil {
		return nil
	}
	out := make([]*Record, 0, len(m))
	for _, model := range slices.Sorted(maps.Keys(m)) {
		out = append(out, m[model])
	}
	return out
}

// sameMap reports whether two states hold the same pointers (no edit).
func sameMap(a, b map[string]*Record) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func unionKeys(a, b map[string]*Record) []string {
	keys := make([]string, 0, len(b)+1)
	for k := range a {
		keys = append(keys, k)
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	return keys
}

// sameContent reports whether two records say the same: the lists,
// reasons, all_busy and thresholds; not the writer's fields.
func sameContent(a, b *events.BusySet) bool {
	return a.Model == b.Model && a.AllBusy == b.AllBusy &&
		slices.Equal(a.Busy, b.Busy) && slices.Equal(a.Free, b.Free) && slices.Equal(a.Stale, b.Stale) &&
		slices.Equal(a.Amber, b.Amber) && slices.Equal(a.Hard, b.Hard) &&
		maps.Equal(a.Reasons, b.Reasons) && a.Thresholds.Equal(b.Thresholds)
}

// noStats counts nothing: the watch has no metrics.
type noStats struct{}

func (noStats) Rewatched(string) {}
func (noStats) BadRecord(string) {}
func (noStats) Published(int)    {}
