package busylist

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

// This file holds the router side's watch machinery: the Watcher of the busy
// bucket and the KV-watch loop it shares with the Registry (registry.go).
//
// The loop (watchLoop) owns one goroutine. It opens the bucket (creating it
// when missing), watches every key and feeds the entries to a watchHandler,
// which applies them to a copy-on-write map and publishes immutable snapshots
// through an atomic.Pointer. It re-watches:
//
//   - at once, resuming after the last revision seen, on every reconnect of
//     the NATS connection (a KV watcher otherwise stalls for 10–20 s after a
//     server restart);
//   - with capped, jittered backoff when the watcher's channel closes or the
//     bucket cannot be opened;
//   - from scratch (a full re-watch whose result replaces the snapshot in one
//     store) when a probe finds the bucket deleted, or deleted and recreated
//     (another stream creation time, or a last sequence below the last
//     revision seen);
//   - resuming, when a probe finds the stream ahead of the watcher on two
//     probes in a row without progress (a silent stall).
//
// Entries at or below the last revision seen are ignored, so overlapping
// re-watches never apply an entry twice or go back in time.

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
	// watchHealthyAfter is how long a watch must have lasted for the backoff
	// to start again from watchBackoffMin.
	watchHealthyAfter = 10 * time.Second
	// watchOpTimeout bounds every single request to the server: opening the
	// bucket and each probe.
	watchOpTimeout = 5 * time.Second
	// watchDrainTimeout bounds the draining of a stopped watcher's channel.
	watchDrainTimeout = 2 * time.Second
	// watchLogEvery is how often a failing loop, or a run of bad records,
	// logs.
	watchLogEvery = 10 * time.Second
	// watchBatchMax is the most queued entries applied before one publish.
	watchBatchMax = 256
	// watchSweepEvery is how often entries past the bucket's TTL are dropped
	// (bucket TTL expiries reach watchers only when the bucket has limit
	// markers).
	watchSweepEvery = time.Second
)

// Sentinel errors of the router side.
var (
	// ErrWatcherClosed is returned by WaitReady when the Watcher or Registry
	// was closed before its initial values arrived.
	ErrWatcherClosed = errors.New("busylist: watcher closed")
	// ErrInvalidOption is wrapped by the constructors when an option is out
	// of range or does not apply.
	ErrInvalidOption = errors.New("busylist: invalid option")
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
		if n < 1 || n > 5 {
			return fmt.Errorf("%w: replicas %d not in [1, 5]", ErrInvalidOption, n)
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
	w.loop = newWatchLoop(js, events.BusyBucket, w, o, m)
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
// watchHandler; only the loop's goroutine calls them.

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

// watchHandler receives a watched bucket's entries. The loop calls it from
// its goroutine only.
type watchHandler interface {
	// watchReset starts a full re-watch: the entries up to the next publish
	// replace everything.
	watchReset()
	// watchApply applies one entry (put, delete or purge) to the pending
	// state; now is the router's clock at receipt. A returned error means a
	// bad record: it is logged and counted, and the handler has already
	// removed the key.
	watchApply(e jetstream.KeyValueEntry, now time.Time) error
	// watchSweep drops entries received more than ttl ago.
	watchSweep(now time.Time, ttl time.Duration)
	// watchPublish makes pending changes visible and returns the number of
	// keys.
	watchPublish() int
}

var (
	_ watchHandler = (*Watcher)(nil)
	_ watchHandler = (*Registry)(nil)
)

// watchRecordError is a bad record, with the reason label it is counted
// under.
type watchRecordError struct {
	reason string
	err    error
}

func (e *watchRecordError) Error() string { return e.err.Error() }
func (e *watchRecordError) Unwrap() error { return e.err }

// watchEnd is why one watch ended.
type watchEnd uint8

const (
	watchEndNone      watchEnd = iota
	watchEndStopped            // the loop's context ended
	watchEndReconnect          // the connection reconnected: resume
	watchEndClosed             // the watcher's channel closed: back off, resume
	watchEndError              // the bucket could not be opened or watched: back off
	watchEndGone               // the bucket was deleted: full re-watch
	watchEndRecreated          // the bucket was deleted and recreated: full re-watch
	watchEndStalled            // the watcher fell behind without progress: resume
)

func (e watchEnd) String() string {
	switch e {
	case watchEndStopped:
		return "stopped"
	case watchEndReconnect:
		return "reconnect"
	case watchEndClosed:
		return "closed"
	case watchEndError:
		return "error"
	case watchEndGone:
		return "gone"
	case watchEndRecreated:
		return "recreated"
	case watchEndStalled:
		return "stalled"
	}
	return "none"
}

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
	var err error
	if m.rewatches, err = watchRegisterCollector(reg, m.rewatches); err != nil {
		return nil, err
	}
	if m.badRecords, err = watchRegisterCollector(reg, m.badRecords); err != nil {
		return nil, err
	}
	if m.ready, err = watchRegisterCollector(reg, m.ready); err != nil {
		return nil, err
	}
	if m.keys, err = watchRegisterCollector(reg, m.keys); err != nil {
		return nil, err
	}
	return m, nil
}

// watchRegisterCollector registers c on reg (when not nil) and returns it,
// or the equal collector already registered there.
func watchRegisterCollector[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	if reg == nil {
		return c, nil
	}
	if err := reg.Register(c); err != nil {
		if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing, nil
			}
		}
		return c, fmt.Errorf("busylist: register metrics: %w", err)
	}
	return c, nil
}

// watchLoop watches one bucket for one handler; see the top of this file.
type watchLoop struct {
	js         jetstream.JetStream
	bucket     string
	replicas   int
	h          watchHandler
	log        *slog.Logger
	now        func() time.Time
	probeEvery time.Duration
	sweepEvery time.Duration

	rewatches  *prometheus.CounterVec // curried with the bucket
	badRecords *prometheus.CounterVec // curried with the bucket
	readyGauge prometheus.Gauge
	keysGauge  prometheus.Gauge

	cancel    context.CancelFunc
	done      chan struct{}
	readyCh   chan struct{}
	readyOnce sync.Once
	closeOnce sync.Once

	// Owned by the loop's goroutine.
	lastRev uint64    // highest revision applied
	created time.Time // creation time of the bucket's stream being watched
	synced  bool      // the current state is complete (a full watch's initial values are in)
	ttl     time.Duration
	lag     watchLag
	backoff watchBackoff
	errLog  watchErrLog
	badLog  watchErrLog
}

func newWatchLoop(js jetstream.JetStream, bucket string, h watchHandler, o watchOptions, m *watchMetrics) *watchLoop {
	log := o.log.With("bucket", bucket)
	return &watchLoop{
		js:         js,
		bucket:     bucket,
		replicas:   o.replicas,
		h:          h,
		log:        log,
		now:        o.now,
		probeEvery: o.probeEvery,
		sweepEvery: watchSweepEvery,
		rewatches:  m.rewatches.MustCurryWith(prometheus.Labels{"bucket": bucket}),
		badRecords: m.badRecords.MustCurryWith(prometheus.Labels{"bucket": bucket}),
		readyGauge: m.ready.WithLabelValues(bucket),
		keysGauge:  m.keys.WithLabelValues(bucket),
		done:       make(chan struct{}),
		readyCh:    make(chan struct{}),
		backoff:    watchBackoff{cur: watchBackoffMin},
		errLog:     watchErrLog{log: log, what: "watch bucket"},
		badLog:     watchErrLog{log: log, what: "decode records"},
	}
}

func (l *watchLoop) start() {
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	go func() {
		defer close(l.done)
		l.run(ctx)
	}()
}

func (l *watchLoop) close() {
	l.closeOnce.Do(l.cancel)
	<-l.done
}

func (l *watchLoop) waitReady(ctx context.Context) error {
	select {
	case <-l.readyCh:
		return nil
	default:
	}
	select {
	case <-l.readyCh:
		return nil
	case <-l.done:
		return ErrWatcherClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (l *watchLoop) run(ctx context.Context) {
	var status chan nats.Status
	if nc := l.js.Conn(); nc != nil {
		// Registered before the first watch so that no reconnect is missed.
		status = nc.StatusChanged(nats.CONNECTED)
		defer nc.RemoveStatusListener(status)
	}
	for {
		started := time.Now()
		end, err := l.watchOnce(ctx, status)
		if ctx.Err() != nil {
			return
		}
		if time.Since(started) >= watchHealthyAfter {
			// A watch that lasted is no run of failures.
			l.backoff.reset()
		}
		l.rewatches.WithLabelValues(end.String()).Inc()
		switch end {
		case watchEndReconnect, watchEndStalled, watchEndGone, watchEndRecreated:
			l.log.Debug("busylist: re-watching", "reason", end.String(), "revision", l.lastRev)
			continue
		}
		if err == nil {
			err = fmt.Errorf("busylist: watch of bucket %s ended: %s", l.bucket, end)
		}
		l.errLog.fail(err, "revision", l.lastRev)
		if !watchSleep(ctx, status, l.backoff.next()) {
			return
		}
	}
}

// watchSleep waits d, or less when the connection reconnects, and reports
// whether ctx is still live.
func watchSleep(ctx context.Context, status <-chan nats.Status, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-status:
	}
	return true
}

// watchOnce opens the bucket, watches it (resuming after lastRev when the
// state is complete and the bucket is the same, from scratch otherwise) and
// returns when the watch must be replaced.
func (l *watchLoop) watchOnce(ctx context.Context, status <-chan nats.Status) (watchEnd, error) {
	octx, cancel := context.WithTimeout(ctx, watchOpTimeout)
	kv, err := OpenBucket(octx, l.js, l.bucket, l.replicas)
	var st jetstream.KeyValueStatus
	if err == nil {
		if st, err = kv.Status(octx); err != nil {
			err = fmt.Errorf("busylist: status of bucket %s: %w", l.bucket, err)
		}
	}
	cancel()
	if err != nil {
		return watchEndError, err
	}
	created, lastSeq, known := watchStreamState(st)
	l.ttl = st.TTL()
	full := !l.synced || known && (!created.Equal(l.created) || lastSeq < l.lastRev)
	var opts []jetstream.WatchOpt
	if full {
		if l.synced {
			l.log.Info("busylist: reloading the bucket from scratch", "revision", l.lastRev, "last_seq", lastSeq)
		}
		l.h.watchReset()
		l.synced, l.lastRev, l.created, l.lag = false, 0, created, watchLag{}
	} else {
		opts = append(opts, jetstream.ResumeFromRevision(l.lastRev+1))
	}
	l.lag.behind = false
	// Reconnects signalled before this watch need no other one.
	for len(status) > 0 {
		<-status
	}

	// wctx is the watcher's lifetime: cancelling it unsubscribes.
	wctx, wcancel := context.WithCancel(ctx)
	w, err := kv.WatchAll(wctx, opts...)
	if err != nil {
		wcancel()
		return watchEndError, fmt.Errorf("busylist: watch bucket %s: %w", l.bucket, err)
	}
	defer watchStop(wcancel, w)

	probe := time.NewTicker(l.probeEvery)
	defer probe.Stop()
	sweep := time.NewTicker(l.sweepEvery)
	defer sweep.Stop()
	updates := w.Updates()
	initial := full // applying a full watch's initial values
	for {
		select {
		case <-ctx.Done():
			return watchEndStopped, nil
		case <-status:
			return watchEndReconnect, nil
		case e, ok := <-updates:
			for n := 0; ok; n++ {
				if e == nil {
					// The initial values are in: publish them, then say so.
					initial = false
					l.synced = true
					l.keysGauge.Set(float64(l.h.watchPublish()))
					l.markReady()
				} else {
					l.apply(e, initial)
				}
				if n >= watchBatchMax || len(updates) == 0 {
					break
				}
				e, ok = <-updates
			}
			if l.synced {
				l.keysGauge.Set(float64(l.h.watchPublish()))
			}
			if !ok {
				return watchEndClosed, nil
			}
		case <-probe.C:
			if end := l.probe(ctx, kv); end != watchEndNone {
				return end, nil
			}
		case <-sweep.C:
			if l.synced && l.ttl > 0 {
				l.h.watchSweep(l.now(), l.ttl)
				l.keysGauge.Set(float64(l.h.watchPublish()))
			}
		}
	}
}

// apply hands one entry to the handler unless it was applied before.
func (l *watchLoop) apply(e jetstream.KeyValueEntry, initial bool) {
	rev := e.Revision()
	// A full watch's initial values come one per key; later entries are
	// filtered by revision, so that a resumed watch never applies one twice.
	if !initial && rev <= l.lastRev {
		return
	}
	l.lastRev = max(l.lastRev, rev)
	if err := l.h.watchApply(e, l.now()); err != nil {
		reason := "other"
		if re, ok := errors.AsType[*watchRecordError](err); ok {
			reason = re.reason
		}
		l.badRecords.WithLabelValues(reason).Inc()
		l.badLog.fail(err, "key", e.Key(), "revision", rev, "reason", reason)
	}
}

func (l *watchLoop) markReady() {
	l.errLog.ok()
	l.readyOnce.Do(func() {
		l.readyGauge.Set(1)
		close(l.readyCh)
	})
}

// probe asks the server about the bucket and tells whether the watch must be
// replaced. A failed request is no reason: the reconnect signal, or a later
// probe, acts when the server is back.
func (l *watchLoop) probe(ctx context.Context, kv jetstream.KeyValue) watchEnd {
	pctx, cancel := context.WithTimeout(ctx, watchOpTimeout)
	st, err := kv.Status(pctx)
	cancel()
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrBucketNotFound):
		l.log.Warn("busylist: bucket deleted, reopening it")
		return watchEndGone
	case err != nil:
		l.log.Debug("busylist: probe failed", "err", err)
		return watchEndNone
	}
	created, lastSeq, known := watchStreamState(st)
	l.ttl = st.TTL()
	if !known {
		return watchEndNone
	}
	if !created.Equal(l.created) || lastSeq < l.lastRev {
		l.log.Warn("busylist: bucket recreated, reloading it", "revision", l.lastRev, "last_seq", lastSeq)
		return watchEndRecreated
	}
	if l.synced && l.lag.stalled(lastSeq, l.lastRev) {
		l.log.Warn("busylist: watcher behind the bucket without progress, re-watching",
			"revision", l.lastRev, "last_seq", lastSeq)
		return watchEndStalled
	}
	return watchEndNone
}

// watchStreamState returns the creation time and last sequence of a bucket's
// stream; known is false when the status does not carry them.
func watchStreamState(st jetstream.KeyValueStatus) (created time.Time, lastSeq uint64, known bool) {
	if s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo }); ok {
		if info := s.StreamInfo(); info != nil {
			return info.Created, info.State.LastSeq, true
		}
	}
	return time.Time{}, 0, false
}

// watchStop stops a KV watcher by cancelling its context, and drains its
// channel until nats.go closes it, so that the subscription's delivery
// goroutine, which may be blocked on the full channel, can finish. The drain
// is bounded. (KeyWatcher.Stop is not called: it also deletes the consumer,
// a request that waits out the JetStream timeout when the server is down;
// on a cancelled context nats.go does that on a goroutine of its own.)
func watchStop(cancel context.CancelFunc, w jetstream.KeyWatcher) {
	cancel()
	t := time.NewTimer(watchDrainTimeout)
	defer t.Stop()
	for {
		select {
		case _, ok := <-w.Updates():
			if !ok {
				return
			}
		case <-t.C:
			return
		}
	}
}

// watchLag tells a stalled watcher: the stream's last sequence ahead of the
// last revision applied, with no progress, on two probes in a row. It fires
// once per last sequence, so that messages removed before delivery (expired,
// or purged delete markers) do not cause endless re-watches.
type watchLag struct {
	behind bool
	rev    uint64 // last revision at the previous probe that found a lag
	fired  uint64 // last sequence a stall was reported for
}

func (g *watchLag) stalled(lastSeq, lastRev uint64) bool {
	if lastSeq <= lastRev || lastSeq == g.fired {
		g.behind = false
		return false
	}
	if g.behind && g.rev == lastRev {
		g.behind, g.fired = false, lastSeq
		return true
	}
	g.behind, g.rev = true, lastRev
	return false
}

// watchBackoff is a capped exponential backoff with ±20% jitter.
type watchBackoff struct{ cur time.Duration }

func (b *watchBackoff) next() time.Duration {
	d := b.cur
	b.cur = min(2*b.cur, watchBackoffMax)
	return d + time.Duration(float64(d)*0.4*(rand.Float64()-0.5))
}

func (b *watchBackoff) reset() { b.cur = watchBackoffMin }

// watchErrLog logs a run of failures at most every watchLogEvery and the
// recovery once.
type watchErrLog struct {
	log        *slog.Logger
	what       string
	failing    bool
	since      time.Time
	failures   int
	suppressed int
	lastLogged time.Time
}

func (l *watchErrLog) fail(err error, attrs ...any) {
	now := time.Now()
	if !l.failing {
		// lastLogged is kept: a flapping watch still logs at most every
		// watchLogEvery.
		l.failing, l.since, l.failures = true, now, 0
	}
	l.failures++
	if !l.lastLogged.IsZero() && now.Sub(l.lastLogged) < watchLogEvery {
		l.suppressed++
		return
	}
	attrs = append(attrs, "err", err, "failures", l.failures, "suppressed", l.suppressed)
	l.log.Warn("busylist: cannot "+l.what, attrs...)
	l.lastLogged, l.suppressed = now, 0
}

func (l *watchErrLog) ok() {
	if !l.failing {
		return
	}
	l.failing = false
	l.log.Info("busylist: "+l.what+" recovered", "failures", l.failures,
		"outage", time.Since(l.since).Round(time.Millisecond))
}
