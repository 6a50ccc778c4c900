package overrides

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/kvwatch"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/internal/retry"
)

// This file holds what the watchers of the package share: their settings,
// the watch (internal/kvwatch's loop), the sink that turns a bucket's
// entries into change calls, and their metrics.

// WatchSettings are the settings every watcher of the package has.
type WatchSettings struct {
	// JetStream is the connection's JetStream context. Required. When its
	// connection reconnects, the watch is re-created at once.
	JetStream jetstream.JetStream
	// Bucket is the bucket watched.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist; 0 means 1.
	Replicas int
	// Timeout bounds each KV operation but the watch itself. Must be > 0.
	Timeout time.Duration
	// RetryMin and RetryMax bound the backoff between failed attempts to
	// (re)start the watch. Both > 0, RetryMin ≤ RetryMax.
	RetryMin, RetryMax time.Duration
	// Logger receives the watcher's logs; nil discards them.
	Logger *slog.Logger
	// Registerer receives the watcher's metrics; nil registers nowhere.
	Registerer prometheus.Registerer
}

func defaultWatchSettings(bucket string) WatchSettings {
	return WatchSettings{Bucket: bucket, Replicas: 1, Timeout: DefaultTimeout, RetryMin: DefaultRetryMin, RetryMax: DefaultRetryMax}
}

// check reports the problems of the settings; who names the watcher.
func (c WatchSettings) check(who string) []error {
	errs := kvbucket.Check(who, c.JetStream, c.Bucket, c.Replicas)
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("%s: timeout %v is not positive", who, c.Timeout))
	}
	return append(errs, retry.CheckBounds(who, c.RetryMin, c.RetryMax)...)
}

// bucketWatcher follows a bucket and hands every change to its sink. Run
// owns the watch. It runs the watch loop of busylist.Watcher and
// registry.Watcher (internal/kvwatch): a KV watch stalls silently for
// 10–20 s after a NATS server restart, and fails by closing its channel or
// going silent, so the loop keeps the last revision it saw and re-creates
// the watch from the next one whenever its channel closes, its connection
// reconnects, a probe finds it stalled, or Rewatch is called; entries at or
// below the last revision are ignored. When the bucket was deleted, or
// re-created, it reads the bucket from the start and reports the keys gone
// from it as deleted.
type bucketWatcher struct {
	loop       *kvwatch.Loop
	started    atomic.Bool
	errRunning error
}

// newBucketWatcher returns a watcher of s.Bucket feeding funcs, with its
// metrics workermon_<kind>_watcher_* registered.
func newBucketWatcher[V any](s WatchSettings, kind string, errRunning error, funcs sinkFuncs[V]) (*bucketWatcher, error) {
	log := s.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newWatcherMetrics(s.Registerer, kind, s.Bucket)
	if err != nil {
		return nil, err
	}
	sink := &changeSink[V]{sinkFuncs: funcs, metrics: m, known: make(map[string]struct{})}
	lcfg := kvwatch.Config{
		JS:         s.JetStream,
		Bucket:     s.Bucket,
		Replicas:   s.Replicas,
		Log:        log,
		ErrLevel:   slog.LevelError,
		Now:        time.Now,
		OpTimeout:  s.Timeout,
		ProbeEvery: DefaultProbeInterval,
		RetryMin:   s.RetryMin,
		RetryMax:   s.RetryMax,
	}
	return &bucketWatcher{loop: kvwatch.New(lcfg, sink, m), errRunning: errRunning}, nil
}

// Synced is closed once the entries that were in the bucket when the watch
// started have all been handed over.
func (w *bucketWatcher) Synced() <-chan struct{} { return w.loop.Ready() }

// Rewatch asks Run to re-create the watch from the last revision seen. It
// never blocks; Run already does it on every reconnect of the JetStream
// connection, so calling it from a nats.ReconnectHandler is optional.
func (w *bucketWatcher) Rewatch() { w.loop.Rewatch() }

// Run watches until ctx is done and returns nil. It returns the watcher's
// "already started" error when called a second time.
func (w *bucketWatcher) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return w.errRunning
	}
	w.loop.Run(ctx)
	return nil
}

// sinkFuncs say how one bucket's entries become changes.
type sinkFuncs[V any] struct {
	// parseKey checks a key; an error is a bad key.
	parseKey func(key string) error
	// decode decodes a put's value; an error is a malformed value.
	decode func(key string, value []byte) (V, error)
	// onChange receives a put (deleted false) or the deletion of a key that
	// had a value (deleted true, v zero).
	onChange func(key string, v V, deleted bool)
}

// changeSink turns a bucket's entries into change calls. Only the loop's
// goroutine uses it.
type changeSink[V any] struct {
	sinkFuncs[V]
	metrics watcherMetrics
	known   map[string]struct{} // keys with a value, as delivered
	seen    map[string]struct{} // during a full sync, the keys met; else nil
}

// Reset begins a full sync: the keys delivered before and not met in it are
// reported deleted when it ends.
func (s *changeSink[V]) Reset() { s.seen = make(map[string]struct{}) }

// Apply passes one entry on. A delete met during a full sync is passed on
// only for a key whose value was delivered.
func (s *changeSink[V]) Apply(e jetstream.KeyValueEntry, _ time.Time) error {
	key := e.Key()
	if err := s.parseKey(key); err != nil {
		return &kvwatch.RecordError{Reason: "bad_key", Err: err}
	}
	if s.seen != nil {
		s.seen[key] = struct{}{}
	}
	if e.Operation() != jetstream.KeyValuePut {
		if _, ok := s.known[key]; ok || s.seen == nil {
			s.deleted(key)
		}
		return nil
	}
	v, err := s.decode(key, e.Value())
	if err != nil {
		// The value in force, if any, stays.
		return &kvwatch.RecordError{Reason: "malformed", Err: err}
	}
	s.known[key] = struct{}{}
	s.metrics.updates.WithLabelValues("put").Inc()
	s.onChange(key, v, false)
	return nil
}

// Publish ends a full sync, if one is under way, reporting the keys it did
// not meet as deleted.
func (s *changeSink[V]) Publish() int {
	if s.seen != nil {
		for key := range s.known {
			if _, ok := s.seen[key]; !ok {
				s.deleted(key)
			}
		}
		s.seen = nil
	}
	return len(s.known)
}

func (s *changeSink[V]) deleted(key string) {
	delete(s.known, key)
	s.metrics.updates.WithLabelValues("delete").Inc()
	var zero V
	s.onChange(key, zero, true)
}

// watcherMetrics are a watcher's Prometheus metrics.
type watcherMetrics struct {
	updates   *prometheus.CounterVec
	invalid   prometheus.Counter
	errors    prometheus.Counter
	rewatches *prometheus.CounterVec
}

var _ kvwatch.Stats = watcherMetrics{}

func newWatcherMetrics(reg prometheus.Registerer, kind, bucket string) (watcherMetrics, error) {
	prefix := "workermon_" + kind + "_watcher_"
	m := watcherMetrics{
		updates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: prefix + "updates_total",
			Help: "Changes delivered from the " + bucket + " bucket, by op: put or delete (deletes and purges).",
		}, []string{"op"}),
		invalid: prometheus.NewCounter(prometheus.CounterOpts{
			Name: prefix + "invalid_total",
			Help: "Entries of the " + bucket + " bucket ignored because the key or the value is not valid.",
		}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: prefix + "errors_total",
			Help: "Failed attempts to open the " + bucket + " bucket or start its watch; each is retried.",
		}),
		rewatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: prefix + "rewatches_total",
			Help: "Watches of the " + bucket + " bucket re-created, by reason: reconnect, closed, manual, gone, recreated, stalled or recovered.",
		}, []string{"reason"}),
	}
	m.updates.WithLabelValues("put")
	m.updates.WithLabelValues("delete")
	for _, why := range []kvwatch.End{kvwatch.EndReconnect, kvwatch.EndClosed, kvwatch.EndManual, kvwatch.EndGone, kvwatch.EndRecreated, kvwatch.EndStalled} {
		m.rewatches.WithLabelValues(why.String())
	}
	if err := promreg.All(reg, m.updates, m.invalid, m.errors, m.rewatches); err != nil {
		return m, fmt.Errorf("overrides: %s watcher: %w", kind, err)
	}
	return m, nil
}

// Rewatched counts a failed attempt to watch as an error, any other end of
// a watch as a re-watch.
func (m watcherMetrics) Rewatched(why string) {
	if why == kvwatch.EndError.String() {
		m.errors.Inc()
		return
	}
	m.rewatches.WithLabelValues(why).Inc()
}

func (m watcherMetrics) BadRecord(string) { m.invalid.Inc() }

func (m watcherMetrics) Published(int) {}
