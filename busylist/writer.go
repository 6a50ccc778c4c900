package busylist

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
	"github.com/workermon/workermon/monitor"
)

// Defaults of WriterConfig.
const (
	// DefaultHeartbeat is the longest an unchanged record goes without a put:
	// the Writer re-puts it with a fresh updated_at at least this often
	// (contract §6, --heartbeat).
	DefaultHeartbeat = 2 * time.Second
	// DefaultWarmup is how long a Writer waits, once the bucket is open,
	// before its first write (contract §6, --warmup).
	DefaultWarmup = 3 * time.Second
	// DefaultWriteTimeout bounds every single KV operation: opening the
	// bucket, reading it at start, each put and each delete.
	DefaultWriteTimeout = 2 * time.Second
	// DefaultOrphanAfter is how long after the bucket is open a record found
	// there at start, for a model the monitor never reported on since, is
	// deleted. It matches the monitor's default --gone-after.
	DefaultOrphanAfter = 60 * time.Second
	// DefaultRetryMin is the first delay before retrying a failed KV operation.
	DefaultRetryMin = 50 * time.Millisecond
	// DefaultRetryMax caps the delay between retries of a failed KV operation.
	DefaultRetryMax = 2 * time.Second
)

var _ monitor.Sink = (*Writer)(nil)

// WriterConfig configures a Writer.
type WriterConfig struct {
	// JetStream is the connection's JetStream context. Required.
	JetStream jetstream.JetStream
	// Bucket is the busy bucket, events.BusyBucket by default.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist; 0 means 1. An existing bucket is left as it is.
	Replicas int
	// MonitorID names this writer in the records' monitor_id. Required.
	MonitorID string
	// Heartbeat is the longest a record goes without a put. Must be > 0.
	Heartbeat time.Duration
	// Warmup is how long the Writer waits after opening the bucket before
	// its first write; records already in the bucket are left alone until
	// then. 0 means no warm-up; negative is rejected.
	Warmup time.Duration
	// HoldUntil, when not nil, holds the first write also until it is
	// closed: the monitor passes the threshold watcher's Synced channel, so
	// that no record is computed with defaults in place of overrides not
	// loaded yet. Heartbeats and shutdown writes wait for it too.
	HoldUntil <-chan struct{}
	// OnExisting, when not nil, is called once from Run after the bucket is
	// read, before the warm-up ends, with the records found there that
	// decode. The monitor seeds its state with them, so that after the
	// warm-up the workers it has not heard from are listed stale rather
	// than left in a dead monitor's record.
	OnExisting func([]events.BusySet)
	// WriteTimeout bounds every KV operation. Must be > 0.
	WriteTimeout time.Duration
	// OrphanAfter is how long after opening the bucket the Writer deletes
	// the records it found there at start for models it was never given
	// since (a model whose workers vanished while no monitor ran). Never
	// before the warm-up is over. Must be > 0.
	OrphanAfter time.Duration
	// RetryMin and RetryMax bound the capped exponential backoff between
	// attempts after a failure. Both > 0, RetryMin ≤ RetryMax.
	RetryMin, RetryMax time.Duration
	// Logger receives the Writer's logs; nil discards them.
	Logger *slog.Logger
	// Registerer receives the Writer's metrics; nil registers nowhere.
	Registerer prometheus.Registerer
	// Now is the clock the records' updated_at is read from; nil means
	// time.Now. Intervals are measured on the monotonic clock regardless.
	Now func() time.Time
}

// DefaultWriterConfig returns a WriterConfig with every default set. The
// caller must still set JetStream and MonitorID.
func DefaultWriterConfig() WriterConfig {
	return WriterConfig{
		Bucket:       events.BusyBucket,
		Replicas:     1,
		Heartbeat:    DefaultHeartbeat,
		Warmup:       DefaultWarmup,
		WriteTimeout: DefaultWriteTimeout,
		OrphanAfter:  DefaultOrphanAfter,
		RetryMin:     DefaultRetryMin,
		RetryMax:     DefaultRetryMax,
	}
}

// Validate reports every problem of the configuration, joined.
func (c WriterConfig) Validate() error {
	errs := validateBucket("writer", c.JetStream, c.Bucket, c.Replicas)
	if c.MonitorID == "" {
		errs = append(errs, errors.New("busylist: writer: monitor id is empty"))
	}
	if c.Heartbeat <= 0 {
		errs = append(errs, fmt.Errorf("busylist: writer: heartbeat %v is not positive", c.Heartbeat))
	}
	if c.Warmup < 0 {
		errs = append(errs, fmt.Errorf("busylist: writer: warm-up %v is negative", c.Warmup))
	}
	if c.WriteTimeout <= 0 {
		errs = append(errs, fmt.Errorf("busylist: writer: write timeout %v is not positive", c.WriteTimeout))
	}
	if c.OrphanAfter <= 0 {
		errs = append(errs, fmt.Errorf("busylist: writer: orphan-after %v is not positive", c.OrphanAfter))
	}
	errs = append(errs, validateRetry("writer", c.RetryMin, c.RetryMax)...)
	return errors.Join(errs...)
}

// Writer kinds, the `kind` label of the write metrics.
const (
	writerKindChange    = "put_change"
	writerKindHeartbeat = "put_heartbeat"
	writerKindDelete    = "delete"
	writerKindOpen      = "open"
)

// Writer writes the monitor's busy sets to the busy bucket (contract §6).
// It implements monitor.Sink: Set and Delete never block; they leave the
// latest value of each model for the Writer's goroutine, Run, to write.
//
// Run opens the bucket (retrying while NATS is away), takes as its epoch 1 +
// the highest epoch of the records there, waits the warm-up, then writes each
// model's record when its content changes, re-puts it at least every
// Heartbeat, and deletes it when the model goes. Failed writes are retried
// with capped backoff until they succeed; a record is never written with
// older content than the latest given.
//
// seq is one counter of the Writer shared by all keys: it increases with
// every put of each key, not necessarily by one.
type Writer struct {
	cfg     WriterConfig
	log     *slog.Logger
	now     func() time.Time
	metrics writerMetrics

	mu      sync.Mutex
	pending map[string]writerPending // latest Set/Delete per model, not yet taken by Run
	known   map[string]struct{}      // models with a record: found at start, or set since

	wake    chan struct{} // capacity 1: something is pending
	ready   chan struct{} // closed when the bucket is open and read
	started atomic.Bool
	epoch   atomic.Uint64
}

// writerPending is the latest call for a model.
type writerPending struct {
	set     events.BusySet
	deleted bool
}

// NewWriter checks cfg and returns a Writer, with its metrics registered.
func NewWriter(cfg WriterConfig) (*Writer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	w := &Writer{
		cfg:     cfg,
		log:     cfg.Logger,
		now:     cfg.Now,
		pending: make(map[string]writerPending),
		known:   make(map[string]struct{}),
		wake:    make(chan struct{}, 1),
		ready:   make(chan struct{}),
	}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	w.log = w.log.With("bucket", cfg.Bucket)
	if w.now == nil {
		w.now = time.Now
	}
	m, err := newWriterMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	w.metrics = m
	return w, nil
}

// Set records the latest busy set of a model, to be written when its content
// differs from the last written one. It never blocks. A set whose model is
// not a valid model name is logged and dropped.
func (w *Writer) Set(set events.BusySet) {
	if err := events.ValidateModel(set.Model); err != nil {
		w.log.Error("busylist: dropping the busy set of an invalid model", "err", err)
		return
	}
	w.mu.Lock()
	w.pending[set.Model] = writerPending{set: set}
	w.known[set.Model] = struct{}{}
	w.mu.Unlock()
	w.signal()
}

// Delete records that a model is gone: its key is deleted. It never blocks.
func (w *Writer) Delete(model string) {
	w.mu.Lock()
	w.pending[model] = writerPending{deleted: true}
	delete(w.known, model)
	w.mu.Unlock()
	w.signal()
}

func (w *Writer) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Models returns, sorted, the models that have or will have a record: those
// found in the bucket at start and those set since, less those deleted.
func (w *Writer) Models() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Sorted(maps.Keys(w.known))
}

// Ready is closed once Run has opened the bucket and read the records in it:
// Epoch and Models are then complete. The warm-up starts at that moment.
func (w *Writer) Ready() <-chan struct{} { return w.ready }

// Epoch returns the Writer's epoch, or 0 before Ready.
func (w *Writer) Epoch() uint64 { return w.epoch.Load() }

// Run writes until ctx is done, then writes the changes still pending (if
// the warm-up is over), bounded by WriteTimeout, and returns nil. It returns
// ErrWriterRunning when called a second time.
func (w *Writer) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return ErrWriterRunning
	}
	r := &writerRun{
		w:       w,
		records: make(map[string]*writerRecord),
		dirty:   make(map[string]struct{}),
		spare:   make(map[string]writerPending),
		bo:      retry.NewBackoff(w.cfg.RetryMin, w.cfg.RetryMax),
		elog:    retry.NewErrLog(w.log, slog.LevelError, "busylist: write busy-set records"),
	}
	if err := r.open(ctx); err != nil {
		return nil // ctx is done before NATS came
	}
	close(w.ready)
	r.loop(ctx)
	return nil
}

// writerRun is the state of Run, owned by its goroutine.
type writerRun struct {
	w        *Writer
	kv       jetstream.KeyValue
	epoch    uint64
	seq      uint64
	records  map[string]*writerRecord
	dirty    map[string]struct{}      // models with something to write: a change, a delete or a heartbeat
	spare    map[string]writerPending // swapped with Writer.pending
	changed  int                      // records with changed set
	warm     bool
	openedAt time.Time
	orphaned bool             // orphans have been dealt with
	found    []events.BusySet // records read at start, for OnExisting
	bo       retry.Backoff
	elog     *retry.ErrLog
}

// writerRecord is what the Writer knows of a model's key.
type writerRecord struct {
	content events.BusySet // latest content given; valid when hasContent
	has     bool           // content is set
	exists  bool           // the key may hold a record: found at start or put by us
	orphan  bool           // found at start, never given since
	del     bool           // the key must be deleted
	changed bool           // content or delete not yet written
	lastPut time.Time      // start of the last successful put, monotonic
}

// open opens the bucket and reads the records in it, retrying until it
// succeeds or ctx is done.
func (r *writerRun) open(ctx context.Context) error {
	w := r.w
	for {
		kv, err := writerOpenBucket(ctx, w.cfg.JetStream, w.cfg.Bucket, w.cfg.Replicas, w.cfg.WriteTimeout,
			&r.bo, r.elog, func(error) { w.metrics.errors.WithLabelValues(writerKindOpen).Inc() })
		if err != nil {
			return err
		}
		r.kv = kv
		n, maxEpoch, err := r.scan(ctx)
		if err == nil {
			r.epoch = maxEpoch + 1
			r.openedAt = time.Now()
			r.bo.Reset()
			r.elog.OK()
			w.epoch.Store(r.epoch)
			w.metrics.epoch.Set(float64(r.epoch))
			w.log.Info("busylist: writer started", "epoch", r.epoch, "records", n,
				"monitor_id", w.cfg.MonitorID, "warmup", w.cfg.Warmup)
			if w.cfg.OnExisting != nil {
				w.cfg.OnExisting(r.found)
			}
			r.found = nil
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		w.metrics.errors.WithLabelValues(writerKindOpen).Inc()
		r.elog.Fail(err)
		if !sleepCtx(ctx, r.bo.Next()) {
			return ctx.Err()
		}
	}
}

// writerOpenBucket opens (creating if needed) a bucket, retrying with
// backoff and rate-limited error logs until it succeeds or ctx is done. Each
// attempt is bounded by timeout. It returns ctx's error when ctx ends first.
func writerOpenBucket(ctx context.Context, js jetstream.JetStream, bucket string, replicas int,
	timeout time.Duration, bo *retry.Backoff, elog *retry.ErrLog, onErr func(error),
) (jetstream.KeyValue, error) {
	for {
		octx, cancel := context.WithTimeout(ctx, timeout)
		kv, err := OpenBucket(octx, js, bucket, replicas)
		cancel()
		if err == nil {
			elog.OK()
			return kv, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if onErr != nil {
			onErr(err)
		}
		elog.Fail(err, "bucket", bucket)
		if !sleepCtx(ctx, bo.Next()) {
			return nil, ctx.Err()
		}
	}
}

// scan reads the records in the bucket: their keys become orphans until
// set, and their highest epoch is returned.
func (r *writerRun) scan(ctx context.Context) (n int, maxEpoch uint64, err error) {
	w := r.w
	sctx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	defer cancel()
	found := make(map[string]struct{})
	r.found = r.found[:0]
	err = readBucket(sctx, r.kv, func(e jetstream.KeyValueEntry) {
		if epoch, ok := r.existing(e); ok {
			maxEpoch = max(maxEpoch, epoch)
		}
		if model, err := events.ParseModelKey(e.Key()); err == nil {
			found[model] = struct{}{}
			if rec, err := events.DecodeBusySet(e.Value()); err == nil && rec.Model == model {
				r.found = append(r.found, rec)
			}
		} else {
			w.log.Warn("busylist: ignoring a key that is not a model key", "key", e.Key(), "err", err)
		}
	})
	if err != nil {
		return 0, 0, fmt.Errorf("busylist: read bucket %s: %w", w.cfg.Bucket, err)
	}
	w.mu.Lock()
	for model := range found {
		w.known[model] = struct{}{}
		r.records[model] = &writerRecord{exists: true, orphan: true}
	}
	w.mu.Unlock()
	return len(found), maxEpoch, nil
}

// existing returns the epoch of a record found at start. Only the epoch is
// decoded, leniently, so that a record this version cannot fully decode
// still counts.
func (r *writerRun) existing(e jetstream.KeyValueEntry) (uint64, bool) {
	var rec struct {
		Epoch uint64 `msgpack:"epoch"`
	}
	if err := msgpack.Unmarshal(e.Value(), &rec); err != nil {
		r.w.metrics.badRecords.Inc()
		r.w.log.Warn("busylist: cannot read the epoch of a record", "key", e.Key(), "err", err)
		return 0, false
	}
	return rec.Epoch, true
}

// loop is Run's select loop once the bucket is open.
func (r *writerRun) loop(ctx context.Context) {
	w := r.w
	tick := max(w.cfg.Heartbeat/4, time.Millisecond)
	hb := time.NewTicker(tick)
	defer hb.Stop()
	var warmC <-chan time.Time
	timerDone := w.cfg.Warmup == 0
	if !timerDone {
		t := time.NewTimer(w.cfg.Warmup)
		defer t.Stop()
		warmC = t.C
	}
	holdC := w.cfg.HoldUntil
	held := holdC != nil
	r.warm = timerDone && !held
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	var retryC <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			r.shutdown(ctx)
			return
		case <-w.wake:
		case <-warmC:
			warmC, timerDone = nil, true
		case <-holdC:
			holdC, held = nil, false
		case now := <-hb.C:
			r.heartbeats(now, w.cfg.Heartbeat-tick)
			r.orphans(now)
		case <-retryC:
			retryC = nil
		}
		if !r.warm && timerDone && !held {
			r.warm = true
			w.log.Info("busylist: warm-up over, writing")
		}
		r.merge()
		if r.warm && retryC == nil && len(r.dirty) > 0 {
			if err := r.flush(ctx, false); err != nil && ctx.Err() == nil {
				retry.Reset(r.bo.Next())
				retryC = retry.C
			}
		}
		w.metrics.pending.Set(float64(r.changed))
	}
}

// merge takes the pending calls and marks what changed.
func (r *writerRun) merge() {
	w := r.w
	w.mu.Lock()
	p := w.pending
	w.pending = r.spare
	w.mu.Unlock()
	for model, op := range p {
		rec := r.records[model]
		if op.deleted {
			switch {
			case rec == nil:
			case !rec.exists:
				r.drop(model, rec)
			default:
				rec.del, rec.orphan = true, false
				r.markChanged(model, rec)
			}
			continue
		}
		if rec == nil {
			rec = &writerRecord{}
			r.records[model] = rec
		}
		if rec.has && !rec.del && !rec.orphan && writerSameContent(&rec.content, &op.set) {
			continue
		}
		rec.content, rec.has = op.set, true
		rec.del, rec.orphan = false, false
		r.markChanged(model, rec)
	}
	clear(p)
	r.spare = p
}

func (r *writerRun) markChanged(model string, rec *writerRecord) {
	if !rec.changed {
		rec.changed = true
		r.changed++
	}
	r.dirty[model] = struct{}{}
}

func (r *writerRun) clearChanged(rec *writerRecord) {
	if rec.changed {
		rec.changed = false
		r.changed--
	}
}

// drop forgets a model's key.
func (r *writerRun) drop(model string, rec *writerRecord) {
	r.clearChanged(rec)
	delete(r.records, model)
	delete(r.dirty, model)
}

// heartbeats marks for a re-put every record put more than due ago. With
// due = Heartbeat - tick, scanned every tick, no record goes longer than
// Heartbeat without a put while writes succeed.
func (r *writerRun) heartbeats(now time.Time, due time.Duration) {
	for model, rec := range r.records {
		if rec.orphan || rec.del || rec.changed || rec.lastPut.IsZero() {
			continue
		}
		if now.Sub(rec.lastPut) >= due {
			r.dirty[model] = struct{}{}
		}
	}
}

// orphans, once OrphanAfter has passed since the bucket opened, marks for
// deletion the records found at start for models never set since.
func (r *writerRun) orphans(now time.Time) {
	w := r.w
	if r.orphaned || now.Sub(r.openedAt) < w.cfg.OrphanAfter {
		return
	}
	r.orphaned = true
	w.mu.Lock()
	defer w.mu.Unlock()
	for model, rec := range r.records {
		if !rec.orphan {
			continue
		}
		if _, ok := w.pending[model]; ok {
			continue // set or deleted meanwhile: merge decides
		}
		rec.orphan, rec.del = false, true
		r.markChanged(model, rec)
		delete(w.known, model)
		w.log.Info("busylist: deleting a record no monitor wrote since start", "model", model)
	}
}

// flush writes the dirty records, one KV operation at a time, and stops at
// the first failure. With onlyChanged, heartbeats are left out.
func (r *writerRun) flush(ctx context.Context, onlyChanged bool) error {
	for model := range r.dirty {
		if err := ctx.Err(); err != nil {
			return err
		}
		rec := r.records[model]
		if rec == nil {
			delete(r.dirty, model)
			continue
		}
		if onlyChanged && !rec.changed {
			continue
		}
		var err error
		if rec.del {
			err = r.delete(ctx, model, rec)
		} else {
			err = r.put(ctx, model, rec)
		}
		if err != nil {
			return err
		}
		delete(r.dirty, model)
	}
	return nil
}

// put writes a model's record. A record that cannot be written at all (an
// invalid key, an encoding error) is logged and dropped, not retried.
func (r *writerRun) put(ctx context.Context, model string, rec *writerRecord) error {
	w := r.w
	kind := writerKindHeartbeat
	if rec.changed {
		kind = writerKindChange
	}
	r.seq++
	out := rec.content
	out.V = events.SchemaVersion
	out.UpdatedAt = w.now().UnixNano()
	out.MonitorID = w.cfg.MonitorID
	out.Epoch = r.epoch
	out.Seq = r.seq
	data, err := events.MarshalBusySet(&out)
	if err != nil {
		w.metrics.errors.WithLabelValues(kind).Inc()
		w.log.Error("busylist: cannot encode a busy set, dropping it", "model", model, "err", err)
		r.clearChanged(rec)
		return nil
	}
	rec.exists = true // a put that times out may still land
	octx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	start := time.Now()
	_, err = r.kv.Put(octx, events.ModelKey(model), data)
	cancel()
	w.metrics.duration.Observe(time.Since(start).Seconds())
	if err != nil {
		w.metrics.errors.WithLabelValues(kind).Inc()
		if errors.Is(err, jetstream.ErrInvalidKey) {
			w.log.Error("busylist: cannot write a model's record, dropping it", "model", model, "err", err)
			r.drop(model, rec)
			return nil
		}
		r.elog.Fail(err, "model", model, "kind", kind)
		return fmt.Errorf("busylist: put %s: %w", model, err)
	}
	w.metrics.writes.WithLabelValues(kind).Inc()
	rec.lastPut = start
	r.clearChanged(rec)
	r.bo.Reset()
	r.elog.OK()
	return nil
}

// delete deletes a model's key.
func (r *writerRun) delete(ctx context.Context, model string, rec *writerRecord) error {
	w := r.w
	octx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	start := time.Now()
	err := r.kv.Delete(octx, events.ModelKey(model))
	cancel()
	w.metrics.duration.Observe(time.Since(start).Seconds())
	if err != nil {
		w.metrics.errors.WithLabelValues(writerKindDelete).Inc()
		if errors.Is(err, jetstream.ErrInvalidKey) {
			r.drop(model, rec)
			return nil
		}
		r.elog.Fail(err, "model", model, "kind", writerKindDelete)
		return fmt.Errorf("busylist: delete %s: %w", model, err)
	}
	w.metrics.writes.WithLabelValues(writerKindDelete).Inc()
	r.drop(model, rec)
	r.bo.Reset()
	r.elog.OK()
	return nil
}

// shutdown writes the changes still pending, bounded by WriteTimeout. A
// Writer still warming up writes nothing: its view may be partial.
func (r *writerRun) shutdown(ctx context.Context) {
	w := r.w
	r.merge()
	defer func() { w.metrics.pending.Set(float64(r.changed)) }()
	if r.changed == 0 {
		return
	}
	if !r.warm {
		w.log.Info("busylist: stopping during warm-up, changes not written", "pending", r.changed)
		return
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.WriteTimeout)
	defer cancel()
	if err := r.flush(fctx, true); err != nil {
		w.log.Warn("busylist: stopping with changes not written", "pending", r.changed, "err", err)
	}
}

// writerSameContent reports whether two busy sets have the same content:
// everything but v, updated_at, monitor_id, epoch and seq. Nil and empty
// lists and maps are the same.
func writerSameContent(a, b *events.BusySet) bool {
	return a.Model == b.Model && a.AllBusy == b.AllBusy &&
		slices.Equal(a.Busy, b.Busy) && slices.Equal(a.Free, b.Free) && slices.Equal(a.Stale, b.Stale) &&
		maps.Equal(a.Reasons, b.Reasons) && a.Thresholds.Equal(b.Thresholds)
}
