package busylist

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

// This file holds the router side's Watcher of the busy bucket, the options
// it shares with the Registry (registry.go), the copy-on-write state both
// publish their snapshots from, and their metrics. The watch loop itself is
// in watchloop.go.

// Defaults of the watch options.
const (
	// DefaultStaleListAfter is how long a busy-set record stays fresh for the
	// router: a record with no put received within this time, or with an
	// updated_at older than this by the router's clock, is stale (contract §7,
	// --stale-list-after).
	DefaultStaleListAfter = 10 * time.Second
	// DefaultProbeInterval is how often a watcher asks the server about its
	// bucket, to notice a deleted or recreated bucket and a stalled watcher.
	DefaultProbeInterval = 5 * time.Second
	// DefaultFailOpen is whether a Watcher admits requests when it cannot
	// trust its list (stale record, initial values not loaded yet).
	DefaultFailOpen = true
)

const (
	// watchBackoffMin is the first delay before re-watching after a failure.
	watchBackoffMin = 50 * time.Millisecond
	// watchBackoffMax caps the delay between re-watch attempts.
	watchBackoffMax = 5 * time.Second
	// watchOpTimeout bounds every single request to the server: opening the
	// bucket and each probe.
	watchOpTimeout = 5 * time.Second
)

// WatchOption configures a Watcher or a Registry.
type WatchOption func(*watchOptions) error

type watchOptions struct {
	log        *slog.Logger
	reg        prometheus.Registerer
	now        func() time.Time
	staleAfter time.Duration
	failOpen   bool
	probeEvery time.Duration
	replicas   int
	// watcherOnly names the Watcher-only options given, which a Registry
	// rejects.
	watcherOnly []string
}

func watchApplyOptions(opts []WatchOption) (watchOptions, error) {
	o := watchOptions{
		log:        slog.New(slog.DiscardHandler),
		now:        time.Now,
		staleAfter: DefaultStaleListAfter,
		failOpen:   DefaultFailOpen,
		probeEvery: DefaultProbeInterval,
		replicas:   1,
	}
	var errs []error
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&o); err != nil {
			errs = append(errs, err)
		}
	}
	return o, errors.Join(errs...)
}

// loopConfig is the configuration of the watch loop of a bucket.
func (o *watchOptions) loopConfig(js jetstream.JetStream, bucket string) watchLoopConfig {
	return watchLoopConfig{
		js:         js,
		bucket:     bucket,
		replicas:   o.replicas,
		log:        o.log,
		errLevel:   slog.LevelWarn,
		now:        o.now,
		opTimeout:  watchOpTimeout,
		probeEvery: o.probeEvery,
		retryMin:   watchBackoffMin,
		retryMax:   watchBackoffMax,
	}
}

// WithLogger sets the logger (default: discard).
func WithLogger(l *slog.Logger) WatchOption {
	return func(o *watchOptions) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = l
		return nil
	}
}

// WithRegisterer registers the metrics on reg (default: not registered).
// Collectors already registered there by another Watcher or Registry are
// shared.
func WithRegisterer(reg prometheus.Registerer) WatchOption {
	return func(o *watchOptions) error {
		o.reg = reg
		return nil
	}
}

// WithClock sets the clock (default time.Now) used for receive times and for
// staleness.
func WithClock(now func() time.Time) WatchOption {
	return func(o *watchOptions) error {
		if now == nil {
			return fmt.Errorf("%w: nil clock", ErrInvalidOption)
		}
		o.now = now
		return nil
	}
}

// WithStaleListAfter sets how long a record stays fresh (default
// DefaultStaleListAfter). Watcher only.
func WithStaleListAfter(d time.Duration) WatchOption {
	return func(o *watchOptions) error {
		o.watcherOnly = append(o.watcherOnly, "WithStaleListAfter")
		if d <= 0 {
			return fmt.Errorf("%w: stale-list-after %v is not positive", ErrInvalidOption, d)
		}
		o.staleAfter = d
		return nil
	}
}

// WithFailOpen sets whether requests are admitted when the list cannot be
// trusted: a stale record, or no initial values yet (default true). Watcher
// only.
func WithFailOpen(open bool) WatchOption {
	return func(o *watchOptions) error {
		o.watcherOnly = append(o.watcherOnly, "WithFailOpen")
		o.failOpen = open
		return nil
	}
}

// WithProbeInterval sets how often the bucket is probed for deletion,
// recreation and a stalled watcher (default DefaultProbeInterval).
func WithProbeInterval(d time.Duration) WatchOption {
	return func(o *watchOptions) error {
		if d <= 0 {
			return fmt.Errorf("%w: probe interval %v is not positive", ErrInvalidOption, d)
		}
		o.probeEvery = d
		return nil
	}
}

// WithBucketReplicas sets the replica count the bucket is created with when
// the watcher finds it missing (default 1). An existing bucket is left alone.
func WithBucketReplicas(n int) WatchOption {
	return func(o *watchOptions) error {
		if n < 1 || n > maxReplicas {
			return fmt.Errorf("%w: replicas %d not in [1, %d]", ErrInvalidOption, n, maxReplicas)
		}
		o.replicas = n
		return nil
	}
}

// Watcher keeps the busy sets of every model (bucket workermon-busy) in
// memory and answers admission decisions from them (see Decide).
//
// It owns one goroutine, started by NewWatcher and stopped by Close. Readers
// (Decide, Record, Ready) take no lock: they load an immutable snapshot,
// replaced as a whole on every change. Until the bucket's initial values have
// arrived there is no snapshot (Ready is false).
//
// A record that cannot be decoded, whose model does not match its key, or
// whose all_busy disagrees with its lists, is logged (rate-limited), counted
// in workermon_router_watch_bad_records_total, and removes the model from the
// snapshot, as a delete or a purge of the key does.
type Watcher struct {
	state      watchState[*busyEntry]
	staleAfter time.Duration
	failOpen   bool
	now        func() time.Time
	loop       *watchLoop
}

// busyEntry is one model's record as the router keeps it.
type busyEntry struct {
	rec events.BusySet
	// received is the router's clock when the put was received.
	received time.Time
}

// NewWatcher starts watching the busy bucket through js. It does not wait
// for the server: the bucket is opened (created when missing) and watched in
// the background, with retries. Use WaitReady to wait for the initial values.
func NewWatcher(js jetstream.JetStream, opts ...WatchOption) (*Watcher, error) {
	if js == nil {
		return nil, fmt.Errorf("busylist: new watcher: %w: nil JetStream", ErrInvalidOption)
	}
	o, err := watchApplyOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("busylist: new watcher: %w", err)
	}
	m, err := newWatchMetrics(o.reg)
	if err != nil {
		return nil, fmt.Errorf("busylist: new watcher: %w", err)
	}
	w := &Watcher{staleAfter: o.staleAfter, failOpen: o.failOpen, now: o.now}
	w.loop = newWatchLoop(o.loopConfig(js, events.BusyBucket), w, m.forBucket(events.BusyBucket))
	w.loop.start()
	return w, nil
}

// Ready reports whether the initial values have arrived.
func (w *Watcher) Ready() bool { return w.state.cur.Load() != nil }

// WaitReady waits until the initial values have arrived, ctx is done
// (returning its error) or the Watcher is closed (ErrWatcherClosed).
func (w *Watcher) WaitReady(ctx context.Context) error { return w.loop.waitReady(ctx) }

// Close stops the watch and waits for its goroutine, which ends within a few
// seconds at most (each server request has a timeout). It is idempotent and
// always returns nil. The last snapshot stays readable: Decide keeps
// answering from it (records turn stale as time passes).
func (w *Watcher) Close() error {
	w.loop.close()
	return nil
}

// Record returns a model's last record, when the router has one, and the
// router's clock when it was received. The record's slices and map are
// shared: do not modify them.
func (w *Watcher) Record(model string) (rec events.BusySet, received time.Time, ok bool) {
	e := w.state.load()[model]
	if e == nil {
		return events.BusySet{}, time.Time{}, false
	}
	return e.rec, e.received, true
}

// Models returns the models that have a record, sorted.
func (w *Watcher) Models() []string {
	return slices.Sorted(maps.Keys(w.state.load()))
}

// watchReset, watchApply, watchSweep and watchPublish make the Watcher a
// watchSink and a watchSweeper; only the loop's goroutine calls them.

func (w *Watcher) watchReset() { w.state.reset() }

func (w *Watcher) watchPublish() int { return w.state.publish() }

func (w *Watcher) watchApply(e jetstream.KeyValueEntry, now time.Time) error {
	model, err := events.ParseModelKey(e.Key())
	if err != nil {
		return &watchRecordError{reason: "bad_key", err: err}
	}
	if e.Operation() != jetstream.KeyValuePut {
		w.state.remove(model)
		return nil
	}
	rec, err := events.DecodeBusySet(e.Value())
	if err == nil {
		err = watchCheckBusySet(model, &rec)
	}
	if err != nil {
		w.state.remove(model)
		if re, ok := errors.AsType[*watchRecordError](err); ok {
			return re
		}
		return &watchRecordError{reason: events.Reason(err), err: err}
	}
	w.state.edit()[model] = &busyEntry{rec: rec, received: now}
	return nil
}

// watchCheckBusySet checks what the router relies on and sorts the worker
// lists if a writer left them unsorted.
func watchCheckBusySet(model string, rec *events.BusySet) error {
	if rec.Model != model {
		return &watchRecordError{reason: "mismatch",
			err: fmt.Errorf("busylist: record of model %q under the key of %q", rec.Model, model)}
	}
	if rec.AllBusy != (len(rec.Free) == 0 && len(rec.Busy) > 0) {
		return &watchRecordError{reason: "inconsistent",
			err: fmt.Errorf("busylist: record of %q: all_busy=%v with %d free and %d busy workers",
				model, rec.AllBusy, len(rec.Free), len(rec.Busy))}
	}
	for _, s := range [][]uint64{rec.Busy, rec.Free, rec.Stale} {
		if !slices.IsSorted(s) {
			slices.Sort(s)
		}
	}
	return nil
}

// watchSweep drops records older than the bucket's TTL, if it has one.
func (w *Watcher) watchSweep(now time.Time, ttl time.Duration) {
	for model, e := range w.state.load() {
		if now.Sub(e.received) > ttl {
			w.state.remove(model)
		}
	}
}

// watchState is the copy-on-write state of a watched bucket: the published,
// immutable map behind an atomic pointer (nil until the initial values are
// in), and the pending copy the loop's goroutine applies changes to.
type watchState[V any] struct {
	cur     atomic.Pointer[map[string]V]
	pending map[string]V // owned by the loop's goroutine
}

// load returns the published map (nil before the first publish).
func (s *watchState[V]) load() map[string]V {
	if p := s.cur.Load(); p != nil {
		return *p
	}
	return nil
}

// view returns the loop's current view: pending changes if any, else the
// published map.
func (s *watchState[V]) view() map[string]V {
	if s.pending != nil {
		return s.pending
	}
	return s.load()
}

// reset starts a full re-watch: changes now build a new map from nothing.
func (s *watchState[V]) reset() {
	s.pending = make(map[string]V)
}

// edit returns the pending map, copying the published one on the first
// change since the last publish.
func (s *watchState[V]) edit() map[string]V {
	if s.pending == nil {
		s.pending = maps.Clone(s.load())
		if s.pending == nil {
			s.pending = make(map[string]V)
		}
	}
	return s.pending
}

// remove deletes k, copying the published map only when k is in it.
func (s *watchState[V]) remove(k string) {
	if _, ok := s.view()[k]; ok {
		delete(s.edit(), k)
	}
}

// publish makes the pending changes visible in one store and returns the
// number of keys published.
func (s *watchState[V]) publish() int {
	if s.pending != nil {
		m := s.pending
		s.pending = nil
		s.cur.Store(&m)
	}
	return len(s.load())
}

var (
	_ watchSink    = (*Watcher)(nil)
	_ watchSweeper = (*Watcher)(nil)
	_ watchSink    = (*Registry)(nil)
	_ watchSweeper = (*Registry)(nil)
	_ watchStats   = (*routerWatchStats)(nil)
)

// watchMetrics are the metrics of both watchers, labelled by bucket.
type watchMetrics struct {
	rewatches  *prometheus.CounterVec
	badRecords *prometheus.CounterVec
	ready      *prometheus.GaugeVec
	keys       *prometheus.GaugeVec
}

func newWatchMetrics(reg prometheus.Registerer) (*watchMetrics, error) {
	m := &watchMetrics{
		rewatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_watch_rewatches_total",
			Help: "Re-watches of a KV bucket by the router, by reason: reconnect, closed, error, gone, recreated, stalled.",
		}, []string{"bucket", "reason"}),
		badRecords: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_watch_bad_records_total",
			Help: "KV entries the router ignored because they could not be decoded or did not match their key, by reason.",
		}, []string{"bucket", "reason"}),
		ready: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_router_watch_ready",
			Help: "1 once the router has loaded the bucket's initial values.",
		}, []string{"bucket"}),
		keys: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_router_watch_keys",
			Help: "Keys in the router's snapshot of the bucket: models of the busy bucket, models with registered workers of the workers bucket.",
		}, []string{"bucket"}),
	}
	if err := errors.Join(RegisterShared(reg, &m.rewatches), RegisterShared(reg, &m.badRecords),
		RegisterShared(reg, &m.ready), RegisterShared(reg, &m.keys)); err != nil {
		return nil, err
	}
	return m, nil
}

// forBucket returns the metrics of one bucket's watch.
func (m *watchMetrics) forBucket(bucket string) *routerWatchStats {
	return &routerWatchStats{
		rewatches:  m.rewatches.MustCurryWith(prometheus.Labels{"bucket": bucket}),
		badRecords: m.badRecords.MustCurryWith(prometheus.Labels{"bucket": bucket}),
		ready:      m.ready.WithLabelValues(bucket),
		keys:       m.keys.WithLabelValues(bucket),
	}
}

// routerWatchStats counts one bucket's watch in the router's metrics.
type routerWatchStats struct {
	rewatches  *prometheus.CounterVec // curried with the bucket
	badRecords *prometheus.CounterVec // curried with the bucket
	ready      prometheus.Gauge
	keys       prometheus.Gauge
}

func (s *routerWatchStats) rewatched(why watchEnd) { s.rewatches.WithLabelValues(why.String()).Inc() }

func (s *routerWatchStats) badRecord(reason string) { s.badRecords.WithLabelValues(reason).Inc() }

func (s *routerWatchStats) published(keys int) {
	s.ready.Set(1)
	s.keys.Set(float64(keys))
}

// RegisterShared registers the collector *c on reg. When an equal collector
// is already registered there (by another Watcher, Registry or user of the
// same registry), *c becomes that one, so that they share it. A nil reg
// registers nothing.
func RegisterShared[C prometheus.Collector](reg prometheus.Registerer, c *C) error {
	if reg == nil {
		return nil
	}
	if err := reg.Register(*c); err != nil {
		if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
			if existing, ok := are.ExistingCollector.(C); ok {
				*c = existing
				return nil
			}
		}
		return fmt.Errorf("busylist: register metrics: %w", err)
	}
	return nil
}
