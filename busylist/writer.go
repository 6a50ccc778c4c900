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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/retry"
)

// Defaults of WriterConfig.
const (
	// DefaultHeartbeat is the longest an unchanged record goes without a put:
	// the Writer re-puts it with a fresh updated_at at least this often
	// (contract §6, --heartbeat).
	DefaultHeartbeat = 2 * time.Second
	// DefaultWarmup is how long a Writer waits, once the bucket is open (or
	// a partition is taken over), before its first write (contract §6,
	// --warmup): two publisher heartbeats.
	DefaultWarmup = 2 * time.Second
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
	// OnExisting, when not nil, is called from Run with the records found
	// in the bucket that decode, before the warm-up ends: once after the
	// bucket is read, or, with Leased, after each partition is claimed, with
	// that partition's records. The monitor seeds its state with them, so
	// that after the warm-up the workers it has not heard from are listed
	// stale rather than left in a dead monitor's record.
	OnExisting func([]events.BusySet)
	// Partitions is the number of partitions P the models are split into
	// (contract §10; 0 means 1). A model's record belongs to partition
	// events.Partition(model, P).
	Partitions int
	// Leased, when true, writes a partition only between Acquire and
	// Release or Drop, under the epoch Acquire gives (a lease's). When
	// false, the Writer holds every partition from the start, under 1 + the
	// highest epoch found in the bucket (contract §6).
	Leased bool
	// WarmOnListen, with Leased, starts a partition's warm-up only when
	// Listening says that its intake is in place (after the claims), not
	// when Acquire takes it: claims or a subscription that take long do
	// not eat into the warm-up. Until then the partition is not written.
	WarmOnListen bool
	// Fence, when not nil, is asked before every write of a partition's
	// record whether the partition may still be written (its lease was
	// renewed within the TTL, contract §10 self-fencing).
	Fence func(partition int) bool
	// OnLost, when not nil, is called from Run, or from one of its
	// goroutines, when a write of a partition finds a record with a higher
	// epoch: the Writer has stopped writing that partition.
	OnLost func(partition int)
	// OnTaken, when not nil, is called from Run each time it has taken the
	// records given by Set and Delete for writing; it must not block. The
	// monitor's Kick: with Pending, the monitor builds a model's next record
	// only once the previous one was taken (monitor.PendingSink).
	OnTaken func()
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
	errs := kvbucket.Check("busylist: writer", c.JetStream, c.Bucket, c.Replicas)
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
	if c.Partitions < 0 {
		errs = append(errs, fmt.Errorf("busylist: writer: partitions %d is negative", c.Partitions))
	}
	if c.OrphanAfter <= 0 {
		errs = append(errs, fmt.Errorf("busylist: writer: orphan-after %v is not positive", c.OrphanAfter))
	}
	errs = append(errs, retry.CheckBounds("busylist: writer", c.RetryMin, c.RetryMax)...)
	return errors.Join(errs...)
}

// Writer kinds, the `kind` label of the write metrics.
const (
	writerKindChange    = "put_change"
	writerKindHeartbeat = "put_heartbeat"
	writerKindDelete    = "delete"
	writerKindOpen      = "open"
	writerKindClaim     = "claim"
)

// writerMaxInFlight is how many claims of a takeover are in flight at once.
const writerMaxInFlight = 32

// writerClaimAttempts bounds the compare-and-set attempts of claiming one
// record.
const writerClaimAttempts = 8

// Writer writes the monitor's busy sets to the busy bucket (contract §6).
// It implements monitor.Sink: Set and Delete never block.
//
// Run opens the bucket (retrying while NATS is away). Without Leased it
// takes as its epoch 1 + the highest epoch of the records there and holds
// every partition; with Leased it holds a partition from Acquire on, under
// the lease's epoch, first claiming the partition's records (a
// compare-and-set re-put of each as found, with this writer's monitor_id,
// the new epoch and seq 1). A partition's records are written once its
// warm-up is over: when their content changes, again at least every
// Heartbeat, and deleted when the model goes.
//
// Writes are pipelined per key: each key has at most one write in flight,
// and writes of different keys are in flight together. A Set or Delete of
// a key with no write in flight starts its write at once, on the caller's
// goroutine (a put is an asynchronous publish: nothing waits for its
// answer); one given while a write of the key is in flight is kept, and
// written, with the latest content given, as soon as that write completes.
// So a record is never written with older content than the latest given,
// and the final content is always written. A failed write is retried after
// a backoff of its own key.
//
// Every write is a compare-and-set on the revision this Writer last saw for
// the key (0 for a key it knows none of), so a late write of a deposed
// writer fails; records and delete markers carry the writer's epoch in
// headers, so that a create does not go over the marker of a later writer
// (writer_ops.go). A write that finds a record or marker with a higher
// epoch (or with leases its own epoch by another monitor) stops the
// writing of its partition (OnLost).
//
// Run's goroutine runs the partition commands (Acquire, Release, Drop); a
// goroutine of its own starts the heartbeats, retries and orphans' deletes,
// and each conflict is read on a goroutine of its own: a partition's
// takeover, release or conflict never holds up another's heartbeats.
//
// seq is one counter of the Writer shared by all keys: it increases with
// every put of each key, not necessarily by one.
type Writer struct {
	cfg     WriterConfig
	log     *slog.Logger
	now     func() time.Time
	metrics writerMetrics

	// givenMu serializes Set and Delete; given is the last set Set was
	// given for each model. Set compares a new set with it under givenMu
	// alone, so that the comparison, as long as the model's lists, does not
	// hold mu, which the completions of writes wait for.
	givenMu sync.Mutex
	given   map[string]events.BusySet

	// mu guards the state of every key and partition, which Set and Delete,
	// the completions of writes (on NATS's goroutines) and Run share.
	mu       sync.Mutex
	recs     map[string]*writerRecord // by model
	known    map[string]struct{}      // models with a record: found at start or claimed, or set since
	parts    []writerPart
	seq      uint64
	changed  int                     // records with changed set
	inflight int                     // writes in flight
	puts     map[*nats.Msg]*writerOp // asynchronous puts in flight
	kv       jetstream.KeyValue      // nil until Run has opened the bucket
	stream   jetstream.Stream        // the bucket's stream, for reading markers; nil for a mirror
	pub      jetstream.JetStream     // the asynchronous puts'; nil: every write waits on a goroutine of its own
	putPre   string                  // the subject of a key is putPre + key
	held     bool                    // HoldUntil is not closed yet
	stopped  bool                    // Run has returned, or is about to: no write starts
	elog     *retry.ErrLog
	// progress is closed, and replaced, when a write completes while
	// waiting is set (Release and the shutdown wait on it).
	progress chan struct{}
	waiting  bool

	wake    chan struct{}         // capacity 1: Run has work (a conflict to read, a retry to time)
	cmds    chan func(*writerRun) // partition commands, run by Run's goroutine
	ready   chan struct{}         // closed when the bucket is open (and read, without Leased)
	done    chan struct{}         // closed when Run returns
	started atomic.Bool
	epoch   atomic.Uint64
}

// writerPart is the Writer's view of one partition.
type writerPart struct {
	holds     bool
	claiming  bool // its records are being claimed: no write
	epoch     uint64
	warmUntil time.Time // monotonic: no write before
	warm      bool      // the warm-up is over (and logged)
	heard     bool      // with WarmOnListen: Listening was called, warmUntil counts from it
	orphansAt time.Time // monotonic: when the records found and never set are deleted
	orphaned  bool
}

// writerRecord is what the Writer knows of a model's key.
type writerRecord struct {
	model   string
	key     string
	part    int
	content events.BusySet // latest content given; valid when has
	has     bool           // content is set
	gen     uint64         // counts the Sets and Deletes that changed what is to be written
	pending bool           // a Set or Delete not yet taken by a write (monitor.PendingSink)
	rev     uint64         // revision last seen of the key; 0 = no record known
	orphan  bool           // found at start or claimed, never given since
	del     bool           // the key must be deleted
	changed bool           // content or delete not yet written
	hbDue   bool           // a heartbeat re-put is due
	writing bool           // a write is in flight
	// conflict: the last write failed its compare-and-set; the key is read
	// before the next (resolving while that read is in flight).
	conflict  bool
	resolving bool
	retryAt   time.Time     // no write before (the backoff after a failure)
	bo        retry.Backoff // of this key's failures
	lastPut   time.Time     // start of the last successful put, monotonic
}

// NewWriter checks cfg and returns a Writer, with its metrics registered.
func NewWriter(cfg WriterConfig) (*Writer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Partitions == 0 {
		cfg.Partitions = 1
	}
	w := &Writer{
		cfg:      cfg,
		log:      cfg.Logger,
		now:      cfg.Now,
		given:    make(map[string]events.BusySet),
		recs:     make(map[string]*writerRecord),
		known:    make(map[string]struct{}),
		parts:    make([]writerPart, cfg.Partitions),
		puts:     make(map[*nats.Msg]*writerOp),
		held:     cfg.HoldUntil != nil,
		progress: make(chan struct{}),
		wake:     make(chan struct{}, 1),
		cmds:     make(chan func(*writerRun)),
		ready:    make(chan struct{}),
		done:     make(chan struct{}),
	}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	w.log = w.log.With("bucket", cfg.Bucket)
	w.elog = retry.NewErrLog(w.log, slog.LevelError, "busylist: write busy-set records")
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
// differs from the last given. The write starts at once, on the caller's
// goroutine, when the key has none in flight and may be written; it never
// waits for NATS. A set whose model is not a valid model name is logged and
// dropped.
func (w *Writer) Set(set events.BusySet) {
	if err := events.ValidateModel(set.Model); err != nil {
		w.log.Error("busylist: dropping the busy set of an invalid model", "err", err)
		return
	}
	w.givenMu.Lock()
	defer w.givenMu.Unlock()
	last, ok := w.given[set.Model]
	same := ok && writerSameContent(&last, &set)
	w.given[set.Model] = set
	w.mu.Lock()
	w.known[set.Model] = struct{}{}
	rec := w.recordLocked(set.Model)
	// Only Set and SetSaturation write rec.content, so a record that has
	// content has the last set given.
	if same && rec.has && !rec.del && !rec.orphan {
		// A change of saturation alone is kept for the next write, never
		// written on its own (contract §21).
		rec.content.Saturation = set.Saturation
		w.mu.Unlock()
		return
	}
	rec.content, rec.has, rec.del, rec.orphan = set, true, false, false
	rec.gen++
	rec.pending = true
	w.markChangedLocked(rec)
	op := w.startLocked(rec, time.Now(), false)
	w.mu.Unlock()
	if op != nil {
		w.send(op)
	}
}

// SetSaturation records a new saturation of a model whose record is
// otherwise unchanged (monitor.SaturationSink): the record's next write,
// its heartbeat or the next change, carries it, and nothing is written for
// it now (contract §21). A model without a record given is ignored. It
// never blocks.
func (w *Writer) SetSaturation(model string, saturation float64) {
	w.givenMu.Lock()
	defer w.givenMu.Unlock()
	last, ok := w.given[model]
	if !ok {
		return
	}
	last.Saturation = saturation
	w.given[model] = last
	w.mu.Lock()
	if rec := w.recs[model]; rec != nil && rec.has && !rec.del {
		rec.content.Saturation = saturation
	}
	w.mu.Unlock()
}

// Pending reports whether a record of model given by Set or Delete has not
// been taken for writing yet (monitor.PendingSink). It never blocks for
// long.
//
// A record that cannot be written yet (its partition not held, claiming or
// warming up, or the Writer held back) is not reported pending: the monitor
// then replaces it on every change, so the first write after the warm-up
// carries the view the warm-up built, not the one it started from.
func (w *Writer) Pending(model string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	rec := w.recs[model]
	if rec == nil || !rec.pending {
		return false
	}
	pt := &w.parts[rec.part]
	return pt.holds && !pt.claiming && !w.held && !w.stopped && !time.Now().Before(pt.warmUntil) &&
		(pt.heard || !w.cfg.WarmOnListen)
}

// Delete records that a model is gone: its key is deleted. It never blocks.
func (w *Writer) Delete(model string) {
	w.givenMu.Lock()
	defer w.givenMu.Unlock()
	delete(w.given, model)
	w.mu.Lock()
	delete(w.known, model)
	rec := w.recs[model]
	if rec == nil {
		w.mu.Unlock()
		return
	}
	if rec.rev == 0 && !rec.writing {
		w.dropLocked(rec) // never written: nothing to delete
		w.mu.Unlock()
		return
	}
	rec.del, rec.orphan, rec.has = true, false, false
	rec.gen++
	rec.pending = true
	w.markChangedLocked(rec)
	op := w.startLocked(rec, time.Now(), false)
	w.mu.Unlock()
	if op != nil {
		w.send(op)
	}
}

// signal wakes Run.
func (w *Writer) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Models returns, sorted, the models that have or will have a record: those
// found in the bucket at start (or claimed) and those set since, less those
// deleted.
func (w *Writer) Models() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Sorted(maps.Keys(w.known))
}

// Ready is closed once Run has opened the bucket and, without Leased, read
// the records in it: Epoch and Models are then complete. The warm-up starts
// at that moment.
func (w *Writer) Ready() <-chan struct{} { return w.ready }

// Epoch returns the Writer's epoch: without Leased, 0 before Ready; with
// Leased, the highest epoch of the partitions it has held.
func (w *Writer) Epoch() uint64 { return w.epoch.Load() }

// Acquire makes the Writer claim partition p's records under epoch and,
// after the warm-up, write them (Leased only). It returns once the claim is
// done, or with ctx's error, or ErrWriterStopped.
func (w *Writer) Acquire(ctx context.Context, p int, epoch uint64) error {
	return w.do(ctx, func(r *writerRun) { r.acquire(ctx, p, epoch) })
}

// Release writes partition p's changed records one last time (if its
// warm-up is over and it may still be written) and stops writing it. It
// returns when done, or with ctx's error, or ErrWriterStopped.
func (w *Writer) Release(ctx context.Context, p int) error {
	return w.do(ctx, func(r *writerRun) { r.release(ctx, p) })
}

// Drop stops writing partition p at once, writing nothing more (its lease
// is lost). It returns when done, or with ctx's error, or ErrWriterStopped.
func (w *Writer) Drop(ctx context.Context, p int) error {
	return w.do(ctx, func(r *writerRun) { r.unhold(p, "dropped") })
}

// Listening starts partition p's warm-up now, with WarmOnListen: its
// records are claimed and its intake is in place, so the view built from
// now on is complete once the warm-up is over. It does nothing for a
// partition not held. It returns when done, or with ctx's error, or
// ErrWriterStopped.
func (w *Writer) Listening(ctx context.Context, p int) error {
	return w.do(ctx, func(*writerRun) {
		w.mu.Lock()
		defer w.mu.Unlock()
		if p >= 0 && p < len(w.parts) && w.parts[p].holds && !w.parts[p].heard {
			w.parts[p].heard = true
			w.parts[p].warmUntil = time.Now().Add(w.cfg.Warmup)
		}
	})
}

// do runs fn on Run's goroutine and waits for it.
func (w *Writer) do(ctx context.Context, fn func(*writerRun)) error {
	ran := make(chan struct{})
	select {
	case w.cmds <- func(r *writerRun) { fn(r); close(ran) }:
	case <-w.done:
		return ErrWriterStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-ran:
		return nil
	case <-w.done:
		return ErrWriterStopped
	}
}

// Run writes until ctx is done, then writes the changes still pending (of
// the partitions it may write), bounded by WriteTimeout, and returns nil. It
// returns ErrWriterRunning when called a second time.
func (w *Writer) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return ErrWriterRunning
	}
	defer close(w.done)
	r := &writerRun{w: w, bo: retry.NewBackoff(w.cfg.RetryMin, w.cfg.RetryMax),
		elog: retry.NewErrLog(w.log, slog.LevelError, "busylist: open the busy bucket")}
	if err := r.open(ctx); err != nil {
		w.mu.Lock()
		w.stopped = true
		w.mu.Unlock()
		return nil // ctx is done before NATS came
	}
	close(w.ready)
	r.loop(ctx)
	return nil
}

// writerRun is the state of Run that only its goroutine touches.
type writerRun struct {
	w *Writer
	// resolvers are the conflicts' reads in flight (resolveConflicts); Run
	// waits for them before it returns.
	resolvers sync.WaitGroup
	kv        jetstream.KeyValue // the bucket, for Run's own reads and claims
	found     []events.BusySet   // records read at start or claimed, for OnExisting
	bo        retry.Backoff      // of opening the bucket
	elog      *retry.ErrLog      // of opening the bucket
}

// loop is Run's select loop once the bucket is open: the partition
// commands (Acquire, Release, Drop) and HoldUntil. Writes are started by
// the pump, on a goroutine of its own, and conflicts read on goroutines of
// their own (resolveConflicts): a partition's claims, final writes or
// conflicts never hold up the heartbeats of the others.
func (r *writerRun) loop(ctx context.Context) {
	w := r.w
	pctx, stopPump := context.WithCancel(ctx)
	pumped := make(chan struct{})
	go func() {
		defer close(pumped)
		r.pump(pctx)
	}()
	holdC := w.cfg.HoldUntil
	for {
		select {
		case <-ctx.Done():
			stopPump()
			<-pumped
			r.shutdown(ctx)
			r.resolvers.Wait()
			return
		case fn := <-w.cmds:
			fn(r)
		case <-holdC:
			holdC = nil
			w.mu.Lock()
			w.held = false
			w.mu.Unlock()
		}
		w.signal()
	}
}

// pump starts the writes that are due until ctx is done: the heartbeats
// (scanned every tick), the retries once a key's backoff is over, the
// orphans' deletes, the conflicts' reads, and whatever Run's commands made
// writable. It never waits on NATS.
func (r *writerRun) pump(ctx context.Context) {
	w := r.w
	tick := max(min(w.cfg.Heartbeat/4, 100*time.Millisecond), time.Millisecond)
	hb := time.NewTicker(tick)
	defer hb.Stop()
	retryT := time.NewTimer(time.Hour)
	retryT.Stop()
	defer retryT.Stop()
	var retryAt time.Time
	for {
		// What was given before the bucket was open, at the first round.
		r.resolveConflicts(ctx, -1)
		if next := w.startAll(-1, false); !next.IsZero() && !next.Equal(retryAt) {
			retryAt = next
			retryT.Reset(time.Until(next))
		}
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		case now := <-hb.C:
			r.heartbeats(now, w.cfg.Heartbeat-tick)
			r.orphans(now)
		case <-retryT.C:
			retryAt = time.Time{}
		}
	}
}

// heartbeats (on the pump's goroutine) marks for a re-put every record put
// more than due ago. With
// due = Heartbeat - tick, scanned every tick, no record goes longer than
// Heartbeat without a put while writes succeed.
func (r *writerRun) heartbeats(now time.Time, due time.Duration) {
	w := r.w
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, rec := range w.recs {
		if rec.orphan || rec.del || rec.changed || rec.writing || rec.lastPut.IsZero() || !w.parts[rec.part].holds {
			continue
		}
		if now.Sub(rec.lastPut) >= due {
			rec.hbDue = true
		}
	}
}

// orphans (on the pump's goroutine), once OrphanAfter has passed since a
// partition was taken, marks
// for deletion the records found then for models never set since.
func (r *writerRun) orphans(now time.Time) {
	w := r.w
	w.mu.Lock()
	defer w.mu.Unlock()
	var due []int
	for p := range w.parts {
		pt := &w.parts[p]
		if pt.holds && !pt.orphaned && !now.Before(pt.orphansAt) {
			pt.orphaned = true
			due = append(due, p)
		}
	}
	if len(due) == 0 {
		return
	}
	for model, rec := range w.recs {
		if !rec.orphan || !slices.Contains(due, rec.part) {
			continue
		}
		rec.orphan, rec.del = false, true
		rec.gen++
		w.markChangedLocked(rec)
		delete(w.known, model)
		w.log.Info("busylist: deleting a record no monitor wrote since start", "model", model)
	}
}

// release writes partition p's changes once more and stops writing it.
func (r *writerRun) release(ctx context.Context, p int) {
	w := r.w
	w.mu.Lock()
	holds := p >= 0 && p < len(w.parts) && w.parts[p].holds
	w.mu.Unlock()
	if !holds {
		return
	}
	fctx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	if n := r.settle(fctx, p); n > 0 {
		w.log.Warn("busylist: releasing a partition with changes not written", "partition", p, "pending", n,
			"err", context.Cause(fctx))
	}
	cancel()
	r.unhold(p, "released")
}

// settle writes the changed records of partition p (every partition when p
// is negative) that may be written and waits for their writes, and for those
// of the same keys given meanwhile, until none is left or ctx is done. It
// returns how many changed records it leaves unwritten (those of
// partitions that may not be written included).
func (r *writerRun) settle(ctx context.Context, p int) int {
	w := r.w
	for {
		r.resolveConflicts(ctx, p)
		w.startAll(p, true)
		w.mu.Lock()
		busy, left := false, 0
		var retry time.Time
		now := time.Now()
		for _, rec := range w.recs {
			if p >= 0 && rec.part != p {
				continue
			}
			switch {
			case rec.writing || rec.resolving:
				busy = true
			case rec.changed && w.writableLocked(rec.part, now):
				busy, left = true, left+1
				if retry.IsZero() || rec.retryAt.Before(retry) {
					retry = rec.retryAt
				}
			case rec.changed:
				left++
			}
		}
		if !busy || ctx.Err() != nil {
			w.mu.Unlock()
			return left
		}
		w.waiting = true
		progress := w.progress
		w.mu.Unlock()
		var after <-chan time.Time
		var t *time.Timer
		if !retry.IsZero() {
			t = time.NewTimer(max(time.Until(retry), 0))
			after = t.C
		}
		select {
		case <-progress:
		case <-after:
		case <-ctx.Done():
		}
		if t != nil {
			t.Stop()
		}
	}
}

// shutdown writes the changes still pending, bounded by WriteTimeout, of the
// partitions that may be written, and waits for the writes in flight. A
// partition still warming up writes nothing: its view may be partial.
func (r *writerRun) shutdown(ctx context.Context) {
	w := r.w
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.WriteTimeout)
	defer cancel()
	if n := r.settle(fctx, -1); n > 0 {
		w.log.Warn("busylist: stopping with changes not written", "pending", n, "err", context.Cause(fctx))
	}
	w.mu.Lock()
	w.stopped = true
	for w.inflight > 0 && fctx.Err() == nil {
		w.waiting = true
		progress := w.progress
		w.mu.Unlock()
		select {
		case <-progress:
		case <-fctx.Done():
		}
		w.mu.Lock()
	}
	w.metrics.pending.Set(float64(w.changed))
	w.mu.Unlock()
}

// writableLocked reports whether partition p's records may be written now:
// held, claimed, warm, not held back by HoldUntil, and not fenced.
func (w *Writer) writableLocked(p int, now time.Time) bool {
	pt := &w.parts[p]
	if !pt.holds || pt.claiming || w.held || w.stopped || now.Before(pt.warmUntil) || w.cfg.WarmOnListen && !pt.heard {
		return false
	}
	if !pt.warm {
		pt.warm = true
		w.log.Info("busylist: warm-up over, writing", "partition", p, "epoch", pt.epoch)
	}
	return w.cfg.Fence == nil || w.cfg.Fence(p)
}

// writerSameContent reports whether two busy sets have the same content:
// everything but v, updated_at, monitor_id, epoch and seq (and saturation,
// kept apart: SetSaturation). Nil and empty lists and maps are the same.
func writerSameContent(a, b *events.BusySet) bool {
	return a.Model == b.Model && a.AllBusy == b.AllBusy &&
		slices.Equal(a.Busy, b.Busy) && slices.Equal(a.Free, b.Free) && slices.Equal(a.Stale, b.Stale) &&
		slices.Equal(a.Amber, b.Amber) && slices.Equal(a.Hard, b.Hard) &&
		maps.Equal(a.Reasons, b.Reasons) && a.Thresholds.Equal(b.Thresholds) && a.Routers == b.Routers &&
		maps.Equal(a.Queued, b.Queued) && maps.EqualFunc(a.QueuedBy, b.QueuedBy, maps.Equal)
}
