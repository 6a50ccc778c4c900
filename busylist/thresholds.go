package busylist

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

// threshMergeAttempts bounds the compare-and-set attempts of Merge.
const threshMergeAttempts = 16

// ThresholdStoreConfig configures a ThresholdStore.
type ThresholdStoreConfig struct {
	// JetStream is the connection's JetStream context. Required.
	JetStream jetstream.JetStream
	// Bucket is the overrides bucket, events.ThresholdsBucket by default.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist; 0 means 1.
	Replicas int
	// Timeout bounds each method call, on top of the caller's ctx. Must be > 0.
	Timeout time.Duration
}

// DefaultThresholdStoreConfig returns a ThresholdStoreConfig with every
// default set; the caller must still set JetStream.
func DefaultThresholdStoreConfig() ThresholdStoreConfig {
	return ThresholdStoreConfig{Bucket: events.ThresholdsBucket, Replicas: 1, Timeout: DefaultWriteTimeout}
}

// Validate reports every problem of the configuration, joined.
func (c ThresholdStoreConfig) Validate() error {
	errs := validateBucket("threshold store", c.JetStream, c.Bucket, c.Replicas)
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("busylist: threshold store: timeout %v is not positive", c.Timeout))
	}
	return errors.Join(errs...)
}

// ThresholdStore reads and writes the per-model threshold overrides of the
// thresholds bucket (contract §8): key model_key, value a JSON object of
// events.Thresholds where absent or null means inherit the default.
//
// The store holds overrides only; the effective thresholds are the
// defaults merged with them, which is the caller's business. Set replaces a
// model's whole override, Merge sets only the fields given. The bucket is
// opened (created if missing) on first use, so a store made while NATS is
// away works once it is back. Safe for concurrent use.
type ThresholdStore struct {
	cfg ThresholdStoreConfig

	mu sync.Mutex
	kv jetstream.KeyValue
}

// NewThresholdStore checks cfg and returns a store. It does no I/O.
func NewThresholdStore(cfg ThresholdStoreConfig) (*ThresholdStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &ThresholdStore{cfg: cfg}, nil
}

// bucket returns the bucket, opening it the first time.
func (s *ThresholdStore) bucket(ctx context.Context) (jetstream.KeyValue, error) {
	s.mu.Lock()
	kv := s.kv
	s.mu.Unlock()
	if kv != nil {
		return kv, nil
	}
	kv, err := OpenBucket(ctx, s.cfg.JetStream, s.cfg.Bucket, s.cfg.Replicas)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.kv == nil {
		s.kv = kv
	}
	return s.kv, nil
}

// Get returns a model's override and whether it has one. A stored value
// that is not a valid override is an error wrapping ErrBadOverride.
func (s *ThresholdStore) Get(ctx context.Context, model string) (events.Thresholds, bool, error) {
	if err := events.ValidateModel(model); err != nil {
		return events.Thresholds{}, false, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	t, _, found, err := s.get(ctx, model)
	return t, found, err
}

// get returns a model's override with its revision (0 when absent).
func (s *ThresholdStore) get(ctx context.Context, model string) (events.Thresholds, uint64, bool, error) {
	kv, err := s.bucket(ctx)
	if err != nil {
		return events.Thresholds{}, 0, false, err
	}
	e, err := kv.Get(ctx, events.ModelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return events.Thresholds{}, 0, false, nil
	}
	if err != nil {
		return events.Thresholds{}, 0, false, fmt.Errorf("busylist: get thresholds of %q: %w", model, err)
	}
	t, err := threshDecode(e.Value())
	if err != nil {
		return events.Thresholds{}, e.Revision(), true, fmt.Errorf("busylist: get thresholds of %q: %w", model, err)
	}
	return t, e.Revision(), true, nil
}

// Set replaces a model's override with t (its nil fields inherit).
func (s *ThresholdStore) Set(ctx context.Context, model string, t events.Thresholds) error {
	data, err := threshEncode(model, t)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket(ctx)
	if err != nil {
		return err
	}
	if _, err := kv.Put(ctx, events.ModelKey(model), data); err != nil {
		return fmt.Errorf("busylist: set thresholds of %q: %w", model, err)
	}
	return nil
}

// Merge sets the fields patch sets in a model's override, keeping the
// others, with compare-and-set so that concurrent writers (several monitor
// replicas) lose no field, and returns the override now stored. A patch
// setting nothing is a Get and writes nothing. A stored value that is not a
// valid override is replaced. It gives up with ErrThresholdConflict when the
// key keeps changing.
func (s *ThresholdStore) Merge(ctx context.Context, model string, patch events.Thresholds) (events.Thresholds, error) {
	if _, err := threshEncode(model, patch); err != nil {
		return events.Thresholds{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	for attempt := range threshMergeAttempts {
		if attempt > 0 && !sleepCtx(ctx, rand.N(time.Duration(attempt)*2*time.Millisecond)) {
			return events.Thresholds{}, fmt.Errorf("busylist: merge thresholds of %q: %w", model, ctx.Err())
		}
		cur, rev, _, err := s.get(ctx, model)
		if err != nil && !errors.Is(err, ErrBadOverride) {
			return events.Thresholds{}, err
		}
		if patch.IsZero() {
			return cur, nil
		}
		next := cur.Merge(patch)
		data, err := threshEncode(model, next)
		if err != nil {
			return events.Thresholds{}, err
		}
		kv, err := s.bucket(ctx)
		if err != nil {
			return events.Thresholds{}, err
		}
		key := events.ModelKey(model)
		if rev == 0 {
			_, err = kv.Create(ctx, key, data)
		} else {
			_, err = kv.Update(ctx, key, data, rev)
		}
		switch {
		case err == nil:
			return next, nil
		case errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyRevisionMismatch):
			continue // someone else wrote it: read again after a jittered pause
		default:
			return events.Thresholds{}, fmt.Errorf("busylist: merge thresholds of %q: %w", model, err)
		}
	}
	return events.Thresholds{}, fmt.Errorf("busylist: merge thresholds of %q: %w", model, ErrThresholdConflict)
}

// Delete drops a model's override: it inherits every default again.
func (s *ThresholdStore) Delete(ctx context.Context, model string) error {
	if err := events.ValidateModel(model); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket(ctx)
	if err != nil {
		return err
	}
	if err := kv.Delete(ctx, events.ModelKey(model)); err != nil {
		return fmt.Errorf("busylist: delete thresholds of %q: %w", model, err)
	}
	return nil
}

// List returns every override in the bucket by model. Keys that are not
// model keys and values that are not valid overrides are left out.
func (s *ThresholdStore) List(ctx context.Context) (map[string]events.Thresholds, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]events.Thresholds)
	err = readBucket(ctx, kv, func(e jetstream.KeyValueEntry) {
		model, err := events.ParseModelKey(e.Key())
		if err != nil {
			return
		}
		if t, err := threshDecode(e.Value()); err == nil {
			out[model] = t
		}
	})
	if err != nil {
		return nil, fmt.Errorf("busylist: list thresholds: %w", err)
	}
	return out, nil
}

// threshEncode checks a model and an override and encodes the override.
func threshEncode(model string, t events.Thresholds) ([]byte, error) {
	if err := events.ValidateModel(model); err != nil {
		return nil, err
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	data, err := json.Marshal(t)
	if err != nil {
		return nil, fmt.Errorf("busylist: encode thresholds of %q: %w", model, err)
	}
	return data, nil
}

// threshDecode decodes and checks a stored override. Unknown fields are
// ignored; JSON null is the empty override.
func threshDecode(data []byte) (events.Thresholds, error) {
	var t events.Thresholds
	if err := json.Unmarshal(data, &t); err != nil {
		return events.Thresholds{}, fmt.Errorf("%w: %v", ErrBadOverride, err)
	}
	if err := t.Validate(); err != nil {
		return events.Thresholds{}, fmt.Errorf("%w: %w", ErrBadOverride, err)
	}
	return t, nil
}

// ThresholdWatcherConfig configures a ThresholdWatcher.
type ThresholdWatcherConfig struct {
	// JetStream is the connection's JetStream context. Required. When its
	// connection reconnects, the watch is re-created at once.
	JetStream jetstream.JetStream
	// Bucket is the overrides bucket, events.ThresholdsBucket by default.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist; 0 means 1.
	Replicas int
	// OnChange receives every change of an override, in revision order, on
	// the watcher's goroutine: the model, its override, and whether the
	// override was deleted (t is then empty). It must not block for long:
	// entries queue behind it. Required.
	OnChange func(model string, t events.Thresholds, deleted bool)
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

// DefaultThresholdWatcherConfig returns a ThresholdWatcherConfig with every
// default set; the caller must still set JetStream and OnChange.
func DefaultThresholdWatcherConfig() ThresholdWatcherConfig {
	return ThresholdWatcherConfig{
		Bucket:   events.ThresholdsBucket,
		Replicas: 1,
		Timeout:  DefaultWriteTimeout,
		RetryMin: DefaultRetryMin,
		RetryMax: DefaultRetryMax,
	}
}

// Validate reports every problem of the configuration, joined.
func (c ThresholdWatcherConfig) Validate() error {
	errs := validateBucket("threshold watcher", c.JetStream, c.Bucket, c.Replicas)
	if c.OnChange == nil {
		errs = append(errs, errors.New("busylist: threshold watcher: OnChange is nil"))
	}
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("busylist: threshold watcher: timeout %v is not positive", c.Timeout))
	}
	errs = append(errs, validateRetry("threshold watcher", c.RetryMin, c.RetryMax)...)
	return errors.Join(errs...)
}

// ThresholdWatcher follows the thresholds bucket and hands every change to
// OnChange. Run owns the watch: it opens the bucket (creating it if needed,
// retrying while NATS is away), delivers the overrides already there, closes
// Synced, then delivers each put, delete and purge.
//
// It runs the watch loop of the Watcher and the Registry (watchloop.go). A
// KV watch stalls silently for 10–20 s after a NATS server restart, and fails
// by closing its channel or going silent. So the watcher keeps the last
// revision it saw and re-creates the watch from the next one whenever its
// channel closes, its connection reconnects, a probe finds it stalled, or
// Rewatch is called; entries at or below the last revision are ignored. When
// the bucket was deleted, or re-created (its last revision is below the one
// seen, or its stream is another), it reads the bucket from the start and
// reports the overrides gone from it as deleted.
type ThresholdWatcher struct {
	loop    *watchLoop
	started atomic.Bool
}

// NewThresholdWatcher checks cfg and returns a watcher, with its metrics
// registered.
func NewThresholdWatcher(cfg ThresholdWatcherConfig) (*ThresholdWatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newThreshMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	sink := &threshSink{onChange: cfg.OnChange, metrics: m, known: make(map[string]struct{})}
	lcfg := watchLoopConfig{
		js:         cfg.JetStream,
		bucket:     cfg.Bucket,
		replicas:   cfg.Replicas,
		log:        log,
		errLevel:   slog.LevelError,
		now:        time.Now,
		opTimeout:  cfg.Timeout,
		probeEvery: DefaultProbeInterval,
		retryMin:   cfg.RetryMin,
		retryMax:   cfg.RetryMax,
	}
	return &ThresholdWatcher{loop: newWatchLoop(lcfg, sink, m)}, nil
}

// Synced is closed once the overrides that were in the bucket when the
// watch started have all been passed to OnChange.
func (w *ThresholdWatcher) Synced() <-chan struct{} { return w.loop.readyCh }

// Rewatch asks Run to re-create the watch from the last revision seen. It
// never blocks; Run already does it on every reconnect of the JetStream
// connection, so calling it from a nats.ReconnectHandler is optional.
func (w *ThresholdWatcher) Rewatch() { w.loop.rewatch() }

// Run watches until ctx is done and returns nil. It returns
// ErrThresholdWatcherRunning when called a second time.
func (w *ThresholdWatcher) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return ErrThresholdWatcherRunning
	}
	w.loop.run(ctx)
	return nil
}

// threshSink turns the entries of the thresholds bucket into OnChange calls.
// Only the loop's goroutine uses it.
type threshSink struct {
	onChange func(model string, t events.Thresholds, deleted bool)
	metrics  threshMetrics
	known    map[string]struct{} // models with an override, as delivered
	seen     map[string]struct{} // during a full sync, the models met; else nil
}

var _ watchSink = (*threshSink)(nil)

// watchReset begins a full sync: the overrides delivered before and not met
// in it are reported deleted when it ends.
func (s *threshSink) watchReset() { s.seen = make(map[string]struct{}) }

// watchApply passes one entry to OnChange. A delete met during a full sync
// is passed on only for a model whose override was delivered.
func (s *threshSink) watchApply(e jetstream.KeyValueEntry, _ time.Time) error {
	model, err := events.ParseModelKey(e.Key())
	if err != nil {
		return &watchRecordError{reason: "bad_key", err: fmt.Errorf("busylist: threshold key %q: %w", e.Key(), err)}
	}
	if s.seen != nil {
		s.seen[model] = struct{}{}
	}
	if e.Operation() != jetstream.KeyValuePut {
		if _, ok := s.known[model]; ok || s.seen == nil {
			s.deleted(model)
		}
		return nil
	}
	t, err := threshDecode(e.Value())
	if err != nil {
		// The override in force, if any, stays.
		return &watchRecordError{reason: "malformed", err: fmt.Errorf("busylist: thresholds of %q: %w", model, err)}
	}
	s.known[model] = struct{}{}
	s.metrics.updates.WithLabelValues("put").Inc()
	s.onChange(model, t, false)
	return nil
}

// watchPublish ends a full sync, if one is under way, reporting the
// overrides it did not meet as deleted.
func (s *threshSink) watchPublish() int {
	if s.seen != nil {
		for model := range s.known {
			if _, ok := s.seen[model]; !ok {
				s.deleted(model)
			}
		}
		s.seen = nil
	}
	return len(s.known)
}

func (s *threshSink) deleted(model string) {
	delete(s.known, model)
	s.metrics.updates.WithLabelValues("delete").Inc()
	s.onChange(model, events.Thresholds{}, true)
}

// threshMetrics are the ThresholdWatcher's Prometheus metrics.
type threshMetrics struct {
	updates   *prometheus.CounterVec
	invalid   prometheus.Counter
	errors    prometheus.Counter
	rewatches *prometheus.CounterVec
}

var _ watchStats = threshMetrics{}

func newThreshMetrics(reg prometheus.Registerer) (threshMetrics, error) {
	m := threshMetrics{
		updates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_threshold_watcher_updates_total",
			Help: "Threshold override changes delivered from the thresholds bucket, by op: put or delete (deletes and purges).",
		}, []string{"op"}),
		invalid: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_threshold_watcher_invalid_total",
			Help: "Entries of the thresholds bucket ignored because the key is not a model key or the value not a valid override.",
		}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_threshold_watcher_errors_total",
			Help: "Failed attempts to open the thresholds bucket or start its watch; each is retried.",
		}),
		rewatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_threshold_watcher_rewatches_total",
			Help: "Watches of the thresholds bucket re-created, by reason: reconnect, closed, manual, gone, recreated or stalled.",
		}, []string{"reason"}),
	}
	m.updates.WithLabelValues("put")
	m.updates.WithLabelValues("delete")
	for _, why := range []watchEnd{watchEndReconnect, watchEndClosed, watchEndManual, watchEndGone, watchEndRecreated, watchEndStalled} {
		m.rewatches.WithLabelValues(why.String())
	}
	return m, writerRegister(reg, m.updates, m.invalid, m.errors, m.rewatches)
}

// rewatched counts a failed attempt to watch as an error, any other end of
// a watch as a re-watch.
func (m threshMetrics) rewatched(why watchEnd) {
	if why == watchEndError {
		m.errors.Inc()
		return
	}
	m.rewatches.WithLabelValues(why.String()).Inc()
}

func (m threshMetrics) badRecord(string) { m.invalid.Inc() }

func (m threshMetrics) published(int) {}
