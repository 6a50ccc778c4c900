package busylist

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
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

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/kvwatch"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/internal/retry"
)

// Defaults of LeaserConfig.
const (
	// DefaultLeaseTTL is how long a lease lasts without a renewal
	// (--lease-ttl): a holder renews every third of it.
	DefaultLeaseTTL = 3 * time.Second
	// DefaultPartitions is the number of partitions (--partitions).
	DefaultPartitions = 1
)

// ErrDuplicateMonitor is returned by Leaser.Run when another live process
// announces the same monitor id while this one is starting.
var ErrDuplicateMonitor = errors.New("busylist: another live monitor has the same id")

// LeaserConfig configures a Leaser.
type LeaserConfig struct {
	// JetStream is the connection's JetStream context. Required.
	JetStream jetstream.JetStream
	// Bucket is the leases bucket (events.LeasesBucket); BusyBucket the
	// busy bucket, read for the epochs of a partition's records.
	Bucket, BusyBucket string
	// Replicas is the replica count the buckets are created with when
	// missing; 0 means 1.
	Replicas int
	// MonitorID is this monitor's id, a KV key token. Required.
	MonitorID string
	// Partitions is the number of partitions P, the same on every monitor
	// of a deployment. Must be ≥ 1.
	Partitions int
	// TTL is how long a lease lasts without a renewal. Must be > 0.
	TTL time.Duration
	// Logger and Registerer receive the logs and metrics; nil for none.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// Now is the clock of observations and renewals; nil means time.Now
	// (whose monotonic reading is what counts).
	Now func() time.Time

	// OnAcquire is called when this monitor has taken partition p under
	// epoch: it claims the partition's records and starts its intake
	// (Writer.Acquire, a subscription). It runs on a goroutine of its own,
	// not on Run's, so that a partition with many records or a slow server
	// does not hold up the renewals of the others; ctx ends when Run does.
	// Required.
	OnAcquire func(ctx context.Context, p int, epoch uint64)
	// OnRelease is called from Run before a partition's lease is deleted:
	// the final write of its records, and the end of its intake. It runs
	// after the partition's OnAcquire has returned. Required.
	OnRelease func(ctx context.Context, p int)
	// OnLose is called when a partition's lease was taken by another
	// monitor: intake and writer stop (writes already stopped, as Valid
	// turned false). It runs after the partition's OnAcquire has returned,
	// on the same goroutine as it. Required.
	OnLose func(p int)
}

// DefaultLeaserConfig returns a LeaserConfig with every default set; the
// caller must still set JetStream, MonitorID and the callbacks.
func DefaultLeaserConfig() LeaserConfig {
	return LeaserConfig{Bucket: events.LeasesBucket, BusyBucket: events.BusyBucket, Replicas: 1,
		Partitions: DefaultPartitions, TTL: DefaultLeaseTTL}
}

// Validate reports every problem of the configuration, joined.
func (c LeaserConfig) Validate() error {
	errs := kvbucket.Check("busylist: leaser", c.JetStream, c.Bucket, c.Replicas)
	if c.BusyBucket == "" {
		errs = append(errs, errors.New("busylist: leaser: busy bucket name is empty"))
	}
	if err := ValidateMonitorID(c.MonitorID); err != nil {
		errs = append(errs, err)
	}
	if c.Partitions < 1 || c.Partitions > 1024 {
		errs = append(errs, fmt.Errorf("busylist: leaser: partitions %d not in [1, 1024]", c.Partitions))
	}
	if c.TTL <= 0 {
		errs = append(errs, fmt.Errorf("busylist: leaser: lease TTL %v is not positive", c.TTL))
	}
	if c.OnAcquire == nil || c.OnRelease == nil || c.OnLose == nil {
		errs = append(errs, errors.New("busylist: leaser: OnAcquire, OnRelease and OnLose are required"))
	}
	return errors.Join(errs...)
}

// ValidateMonitorID checks that id can be a KV key token.
func ValidateMonitorID(id string) error {
	if id == "" {
		return errors.New("busylist: monitor id is empty")
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("busylist: monitor id %q: byte %q is not one of [A-Za-z0-9_-]", id, c)
		}
	}
	return nil
}

// Leaser takes, keeps and gives back the partition leases of one monitor
// (contract §10). It watches the leases bucket and treats a lease whose key
// has not changed for the TTL as expired; it takes free and expired
// partitions by create or compare-and-set, up to its fair share of the live
// monitors, renews what it holds every TTL/3 by compare-and-set, releases
// one partition at a time when it holds more than its share, and everything
// on a clean shutdown.
//
// Self-fencing: Valid(p) turns false once the TTL has passed since the last
// renewal that succeeded was sent; the Writer asks it before every write.
type Leaser struct {
	cfg      LeaserConfig
	log      *slog.Logger
	now      func() time.Time
	base     time.Time // for validUntil
	instance string
	metrics  leaserMetrics

	mu   sync.Mutex
	book *leaseBook

	// validUntil[p] is the clock, in ns since base, until which p may be
	// written; 0 when not held.
	validUntil []atomic.Int64
	// epochs[p] is the epoch of p's lease while held (0 otherwise).
	epochs []atomic.Uint64

	loop    *kvwatch.Loop
	abandon chan int      // partitions the Writer gave up, for Run
	settled chan struct{} // closed after the first round that may take, once its OnAcquire calls returned
	settle  sync.Once
	// readyAt is when the watch's initial values were in (zero before);
	// under mu.
	readyAt time.Time
	// calls runs the callbacks of each partition in order, off Run's
	// goroutine; Run waits for them before it returns.
	calls partitionCalls

	// Owned by Run's goroutine.
	lastDupe     string // the other instance last warned about
	lastForeign  string // the foreign lease key seen at the last round
	held         map[int]*heldLease
	started      time.Time
	lastAnnounce time.Time
	announceFail time.Time
	live         int
	overSince    time.Time
	lastRelease  time.Time
	kv, busy     jetstream.KeyValue
}

// partitionCalls runs the OnAcquire and OnLose of each partition on
// goroutines of their own, one partition's in the order given. Only Run's
// goroutine calls its methods.
type partitionCalls struct {
	wg   sync.WaitGroup
	last map[int]chan struct{} // per partition: closed when its last call has returned
}

// do runs fn after the calls of partition p given before it.
func (c *partitionCalls) do(p int, fn func()) {
	if c.last == nil {
		c.last = make(map[int]chan struct{})
	}
	prev, done := c.last[p], make(chan struct{})
	c.last[p] = done
	c.wg.Go(func() {
		defer close(done)
		if prev != nil {
			<-prev
		}
		fn()
	})
}

// busy reports whether a call of partition p has not returned yet.
func (c *partitionCalls) busy(p int) bool {
	done := c.last[p]
	if done == nil {
		return false
	}
	select {
	case <-done:
		delete(c.last, p)
		return false
	default:
		return true
	}
}

// whenDone runs fn on a goroutine of its own once the calls given so far
// of every partition in ps have returned.
func (c *partitionCalls) whenDone(ps []int, fn func()) {
	var waits []chan struct{}
	for _, p := range ps {
		if done := c.last[p]; done != nil {
			waits = append(waits, done)
		}
	}
	c.wg.Go(func() {
		for _, done := range waits {
			<-done
		}
		fn()
	})
}

// wait waits until the calls of partition p given so far have returned.
func (c *partitionCalls) wait(p int) {
	if done := c.last[p]; done != nil {
		<-done
		delete(c.last, p)
	}
}

// heldLease is a partition this monitor holds.
type heldLease struct {
	rev      uint64
	val      LeaseValue
	lastSend time.Time // of the last renewal attempt
	goodSend time.Time // when the last renewal that succeeded was sent
	fenced   bool
}

// NewLeaser checks cfg and returns a Leaser.
func NewLeaser(cfg LeaserConfig) (*Leaser, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var nonce [8]byte
	_, _ = rand.Read(nonce[:])
	l := &Leaser{cfg: cfg, log: cfg.Logger, now: cfg.Now, instance: hex.EncodeToString(nonce[:]),
		validUntil: make([]atomic.Int64, cfg.Partitions), epochs: make([]atomic.Uint64, cfg.Partitions),
		held:    make(map[int]*heldLease),
		abandon: make(chan int, cfg.Partitions), settled: make(chan struct{})}
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	if l.now == nil {
		l.now = time.Now
	}
	l.base = l.now()
	l.book = newLeaseBook(cfg.Partitions, cfg.MonitorID, l.instance)
	m, err := newLeaserMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	l.metrics = m
	l.loop = kvwatch.New(kvwatch.Config{
		JS: cfg.JetStream, Bucket: cfg.Bucket, Replicas: cfg.Replicas, Log: l.log, ErrLevel: slog.LevelWarn,
		Now: l.now, OpTimeout: l.opTimeout(), ProbeEvery: max(cfg.TTL, time.Second),
		RetryMin: 50 * time.Millisecond, RetryMax: max(cfg.TTL/3, 100*time.Millisecond),
	}, (*leaserSink)(l), noWatchStats{})
	return l, nil
}

// Settled is closed after the first round that could take partitions: one
// TTL after the bucket's initial values were in (and no lease of another
// partition count is in the bucket). From then on the monitor holds what it
// will hold, or is a standby.
func (l *Leaser) Settled() <-chan struct{} { return l.settled }

// Foreign returns a lease key of another partition count that is in the
// bucket now, as observed, or "" when there is none: while there is one
// this monitor takes nothing. Safe from any goroutine.
func (l *Leaser) Foreign() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.book.foreignKey()
}

// Epoch is the epoch of partition p while it may be written (Valid), 0
// otherwise. Safe from any goroutine.
func (l *Leaser) Epoch(p int) uint64 {
	if !l.Valid(p) {
		return 0
	}
	return l.epochs[p].Load()
}

// Instance is this process's nonce in the leases.
func (l *Leaser) Instance() string { return l.instance }

// Valid reports whether partition p may be written now: held, and renewed
// within the TTL (measured from when the renewal was sent).
func (l *Leaser) Valid(p int) bool {
	if p < 0 || p >= len(l.validUntil) {
		return false
	}
	return int64(l.now().Sub(l.base)) < l.validUntil[p].Load()
}

// opTimeout bounds each KV request: well inside a renewal period.
func (l *Leaser) opTimeout() time.Duration {
	return max(min(l.cfg.TTL/3, 2*time.Second), 50*time.Millisecond)
}

// Run takes and keeps leases until ctx is done, then releases what it
// holds (final writes through OnRelease, then a compare-and-set delete of
// each lease) and deletes its announce. It returns ErrDuplicateMonitor,
// having taken nothing, when another live process announces the same id
// while this one is starting (before its first round that may take); a
// monitor past that point keeps running, logs a warning and counts
// workermon_lease_duplicate_monitors_total (the newcomer refuses).
func (l *Leaser) Run(ctx context.Context) error {
	l.loop.Start()
	defer l.loop.Close()
	l.started = l.now()
	// The callbacks get a context that ends with Run's; Run waits for them.
	cctx, cancel := context.WithCancel(ctx)
	defer l.calls.wg.Wait()
	defer cancel()
	if err := l.open(ctx); err != nil {
		return nil // ctx ended first
	}
	tick := time.NewTicker(max(l.cfg.TTL/6, 10*time.Millisecond))
	defer tick.Stop()
	for {
		if err := l.step(cctx); err != nil {
			// Refused at start: nothing was taken, and the announce is the
			// other process's to keep.
			cancel()
			l.releaseAll(context.WithoutCancel(ctx))
			return err
		}
		select {
		case <-ctx.Done():
			l.releaseAll(context.WithoutCancel(ctx))
			l.unannounce(context.WithoutCancel(ctx))
			return nil
		case <-tick.C:
		}
	}
}

// open opens the two buckets, retrying until ctx is done.
func (l *Leaser) open(ctx context.Context) error {
	bo := retry.NewBackoff(50*time.Millisecond, 2*time.Second)
	elog := retry.NewErrLog(l.log, slog.LevelError, "busylist: open the leases bucket")
	for {
		octx, cancel := context.WithTimeout(ctx, l.opTimeout()*3)
		kv, err := kvbucket.Open(octx, l.cfg.JetStream, l.cfg.Bucket, l.cfg.Replicas)
		var busy jetstream.KeyValue
		if err == nil {
			busy, err = kvbucket.Open(octx, l.cfg.JetStream, l.cfg.BusyBucket, l.cfg.Replicas)
		}
		cancel()
		if err == nil {
			elog.OK()
			l.kv, l.busy = kv, busy
			return nil
		}
		elog.Fail(err)
		if !retry.Sleep(ctx, bo.Next()) {
			return ctx.Err()
		}
	}
}

// step is one round: announce, renew, fence, then take or release.
func (l *Leaser) step(ctx context.Context) error {
	now := l.now()
	for len(l.abandon) > 0 {
		p := <-l.abandon
		if l.held[p] != nil {
			delete(l.held, p)
			l.metrics.losses.Inc()
			l.metrics.held.Set(float64(len(l.held)))
			l.log.Warn("busylist: partition abandoned: a record with a higher epoch was found", "partition", p)
		}
	}
	l.announce(ctx, now)
	l.renew(ctx, now)
	l.fence(now)

	l.mu.Lock()
	readyAt := l.readyAt
	dupe, foreign := l.book.takeDupe(), l.book.foreignKey()
	live := l.book.live(now, l.cfg.TTL)
	l.mu.Unlock()
	// Starting: nothing is taken until the initial values are in and one
	// TTL has passed since. Every lease and announce seen by then is judged
	// by its own age, and a live process with this monitor's id has
	// re-announced itself (every TTL/3).
	starting := readyAt.IsZero() || now.Sub(readyAt) < l.cfg.TTL
	if dupe != "" {
		if starting {
			return fmt.Errorf("%w: %q is announced by instance %s, which is running; this one (instance %s) refuses to start",
				ErrDuplicateMonitor, l.cfg.MonitorID, dupe, l.instance)
		}
		if dupe != l.lastDupe {
			l.lastDupe = dupe
			l.metrics.dupes.Inc()
			l.log.Warn("busylist: another process announces this monitor's id; it refuses to start, this one keeps running",
				"monitor_id", l.cfg.MonitorID, "other_instance", dupe, "instance", l.instance)
		}
	}
	if foreign == "" {
		l.metrics.foreign.Set(0)
		if l.lastForeign != "" {
			l.log.Info("busylist: no lease of another partition count is left in the bucket; taking partitions",
				"gone", l.lastForeign, "partitions", l.cfg.Partitions)
		}
	} else {
		l.metrics.foreign.Set(1) // logged by the sink
	}
	l.lastForeign = foreign
	if starting || foreign != "" {
		return nil
	}
	if now.Sub(l.announceFail) >= l.cfg.TTL || l.live == 0 {
		l.live = live
	}
	l.metrics.live.Set(float64(l.live))
	share := fairShare(l.cfg.Partitions, l.live)
	switch {
	case len(l.held) < share:
		l.overSince = time.Time{}
		l.take(ctx, now, share-len(l.held))
	case len(l.held) > share:
		if l.overSince.IsZero() {
			l.overSince = now
		}
		if now.Sub(l.overSince) >= 2*l.cfg.TTL && now.Sub(l.lastRelease) >= l.cfg.TTL {
			// The highest partition whose OnAcquire is over: waiting for
			// one would hold up the renewals.
			for _, p := range slices.Backward(slices.Sorted(maps.Keys(l.held))) {
				if !l.calls.busy(p) {
					l.lastRelease = now
					l.release(ctx, p)
					break
				}
			}
		}
	default:
		l.overSince = time.Time{}
	}
	l.settle.Do(func() {
		// Once the partitions of this round are subscribed: a monitor that
		// says it is settled (its /readyz) hears every report from then on.
		l.calls.whenDone(slices.Collect(maps.Keys(l.held)), func() { close(l.settled) })
	})
	return nil
}

// announce refreshes this monitor's presence every TTL/3.
func (l *Leaser) announce(ctx context.Context, now time.Time) {
	if now.Sub(l.lastAnnounce) < l.cfg.TTL/3 {
		return
	}
	l.lastAnnounce = now
	a := Announce{MonitorID: l.cfg.MonitorID, Instance: l.instance, Partitions: l.Held(),
		StartedAt: l.started.UnixNano()}
	data, _ := json.Marshal(a)
	octx, cancel := context.WithTimeout(ctx, l.opTimeout())
	_, err := l.kv.Put(octx, AnnounceKey(l.cfg.MonitorID), data)
	cancel()
	if err != nil {
		l.announceFail = now
		l.log.Warn("busylist: cannot announce this monitor", "err", err)
	}
}

// renew renews every held lease due, by compare-and-set.
func (l *Leaser) renew(ctx context.Context, now time.Time) {
	for p, h := range l.held {
		if now.Sub(h.lastSend) < l.cfg.TTL/3 {
			continue
		}
		h.lastSend = now
		data, _ := json.Marshal(h.val)
		key := LeaseKey(l.cfg.Partitions, p)
		octx, cancel := context.WithTimeout(ctx, l.opTimeout())
		rev, err := l.kv.Update(octx, key, data, h.rev)
		cancel()
		switch {
		case err == nil:
			l.renewed(p, h, rev, now)
		default:
			// A timeout, or a compare-and-set that failed: the renewal may
			// have landed, or another monitor may hold the key now. Read it
			// back.
			octx, cancel := context.WithTimeout(ctx, l.opTimeout())
			e, gerr := l.kv.Get(octx, key)
			cancel()
			if gerr != nil {
				// Nothing is known (a server restarting may answer "not
				// found" for a while): try again next round. A lease that is
				// really gone fails the next compare-and-set.
				l.log.Warn("busylist: cannot renew a lease", "partition", p, "err", err, "read_back", gerr)
				continue
			}
			// Still ours: an earlier renewal landed although its answer
			// was lost. Its revision is adopted, but not as a renewal: when
			// it was sent is not known, so the validity is not extended
			// (the next round's renewal extends it). Another's: lost.
			var v LeaseValue
			if json.Unmarshal(e.Value(), &v) != nil || v.Instance != l.instance {
				l.lose(p, "the lease changed under it")
			} else {
				h.rev = e.Revision()
				h.lastSend = time.Time{} // renew again next round
			}
		}
	}
}

// renewed records a renewal sent at sent that succeeded.
func (l *Leaser) renewed(p int, h *heldLease, rev uint64, sent time.Time) {
	h.rev, h.goodSend = rev, sent
	l.epochs[p].Store(h.val.Epoch)
	l.validUntil[p].Store(int64(sent.Add(l.cfg.TTL).Sub(l.base)))
	if h.fenced {
		h.fenced = false
		l.log.Info("busylist: lease renewed again, writing resumes", "partition", p, "epoch", h.val.Epoch)
	}
}

// fence counts and logs each held partition that has just become unwritable
// for want of a renewal.
func (l *Leaser) fence(now time.Time) {
	for p, h := range l.held {
		if !h.fenced && now.Sub(h.goodSend) >= l.cfg.TTL {
			h.fenced = true
			l.metrics.fenced.Inc()
			l.log.Warn("busylist: lease not renewed within its TTL, no longer writing the partition",
				"partition", p, "epoch", h.val.Epoch)
		}
	}
}

// take takes up to n free or expired partitions.
func (l *Leaser) take(ctx context.Context, now time.Time, n int) {
	l.mu.Lock()
	cands := l.book.free(now, l.cfg.TTL, func(p int) bool { return l.held[p] != nil })
	l.mu.Unlock()
	if len(cands) == 0 {
		return
	}
	// One read of the busy bucket for every candidate: on a large bucket it
	// takes a while, and the held leases due for renewal go right after it.
	recEpochs, err := l.recordEpochs(ctx)
	if err != nil {
		l.log.Warn("busylist: cannot read the busy bucket's records; taking no partition now", "err", err)
		return
	}
	for _, c := range cands {
		if n == 0 || ctx.Err() != nil {
			return
		}
		l.renew(ctx, l.now())
		l.fence(l.now())
		v := LeaseValue{MonitorID: l.cfg.MonitorID, Instance: l.instance, Epoch: 1 + max(c.epoch, recEpochs[c.p]),
			AcquiredAt: now.UnixNano()}
		data, _ := json.Marshal(v)
		key := LeaseKey(l.cfg.Partitions, c.p)
		sent := l.now()
		octx, cancel := context.WithTimeout(ctx, l.opTimeout())
		var rev uint64
		if c.rev == 0 {
			rev, err = l.kv.Create(octx, key, data)
		} else {
			rev, err = l.kv.Update(octx, key, data, c.rev)
		}
		cancel()
		if err != nil {
			l.log.Debug("busylist: lease not taken", "partition", c.p, "err", err)
			continue
		}
		n--
		h := &heldLease{rev: rev, val: v, lastSend: sent}
		l.held[c.p] = h
		l.renewed(c.p, h, rev, sent)
		l.metrics.gains.Inc()
		l.metrics.held.Set(float64(len(l.held)))
		l.log.Info("busylist: partition taken", "partition", c.p, "epoch", v.Epoch,
			"expired_holder", c.rev != 0)
		// Off this goroutine: claiming the records of a large partition, or
		// on a slow server, must not delay the renewals of the others.
		p, epoch := c.p, v.Epoch
		l.calls.do(p, func() { l.cfg.OnAcquire(ctx, p, epoch) })
	}
}

// recordEpochs returns, for each partition, the highest epoch among its
// records in the busy bucket.
func (l *Leaser) recordEpochs(ctx context.Context) ([]uint64, error) {
	octx, cancel := context.WithTimeout(ctx, 3*l.opTimeout())
	defer cancel()
	top := make([]uint64, l.cfg.Partitions)
	err := kvbucket.ReadAll(octx, l.busy, func(e jetstream.KeyValueEntry) {
		model, err := events.ParseModelKey(e.Key())
		if err != nil {
			return
		}
		if epoch, err := RecordEpoch(e.Value()); err == nil {
			p := events.Partition(model, l.cfg.Partitions)
			top[p] = max(top[p], epoch)
		}
	})
	return top, err
}

// lose forgets a partition whose lease another monitor holds now.
func (l *Leaser) lose(p int, why string) {
	l.validUntil[p].Store(0)
	delete(l.held, p)
	l.metrics.losses.Inc()
	l.metrics.held.Set(float64(len(l.held)))
	l.log.Warn("busylist: partition lost", "partition", p, "why", why)
	l.calls.do(p, func() { l.cfg.OnLose(p) })
}

// Abandon forgets partition p without writing or deleting anything: its
// Writer found a record with a higher epoch. The lease expires for the
// others; it is never renewed again by this monitor. Safe from any
// goroutine: it takes effect at Run's next round.
func (l *Leaser) Abandon(p int) {
	if p < 0 || p >= len(l.validUntil) {
		return
	}
	l.validUntil[p].Store(0) // no write from now on
	select {
	case l.abandon <- p:
	default: // full: P abandons are queued already
	}
}

// release gives partition p back: its final write, then a compare-and-set
// delete of its lease.
func (l *Leaser) release(ctx context.Context, p int) {
	h := l.held[p]
	if h == nil {
		return
	}
	l.calls.wait(p) // its OnAcquire first
	l.cfg.OnRelease(ctx, p)
	l.validUntil[p].Store(0)
	delete(l.held, p)
	key := LeaseKey(l.cfg.Partitions, p)
	octx, cancel := context.WithTimeout(ctx, l.opTimeout())
	err := l.kv.Delete(octx, key, jetstream.LastRevision(h.rev))
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) {
		// A renewal cut short (a shutdown cancels it) may have landed: the
		// lease is still ours under a newer revision.
		err = l.deleteIfOurs(octx, key, err)
	}
	cancel()
	l.metrics.releases.Inc()
	l.metrics.held.Set(float64(len(l.held)))
	if err != nil {
		l.log.Warn("busylist: cannot delete a released lease; it expires", "partition", p, "err", err)
		return
	}
	l.log.Info("busylist: partition released", "partition", p, "epoch", h.val.Epoch)
}

// deleteIfOurs deletes a lease or announce key when its value is this
// instance's, at the revision read; otherwise it returns cause.
func (l *Leaser) deleteIfOurs(ctx context.Context, key string, cause error) error {
	e, err := l.kv.Get(ctx, key)
	if err != nil {
		return cause
	}
	var v struct {
		Instance string `json:"instance"`
	}
	if json.Unmarshal(e.Value(), &v) != nil || v.Instance != l.instance {
		return cause // another process's now
	}
	return l.kv.Delete(ctx, key, jetstream.LastRevision(e.Revision()))
}

// releaseAll releases every held partition.
func (l *Leaser) releaseAll(ctx context.Context) {
	if l.kv == nil {
		return
	}
	for _, p := range slices.Sorted(maps.Keys(l.held)) {
		l.release(ctx, p)
	}
}

// unannounce deletes this monitor's announce, unless another process with
// the same id wrote it last.
func (l *Leaser) unannounce(ctx context.Context) {
	if l.kv == nil {
		return
	}
	octx, cancel := context.WithTimeout(ctx, l.opTimeout())
	defer cancel()
	if err := l.deleteIfOurs(octx, AnnounceKey(l.cfg.MonitorID), nil); err != nil {
		l.log.Debug("busylist: announce not deleted; it expires", "err", err)
	}
}

// Held returns the partitions held, sorted. Safe from any goroutine.
func (l *Leaser) Held() []int {
	var out []int
	for p := range l.validUntil {
		if l.validUntil[p].Load() != 0 {
			out = append(out, p)
		}
	}
	return out
}

// PartitionInfo is one partition as a monitor sees it.
type PartitionInfo struct {
	Partition int    `json:"partition"`
	MonitorID string `json:"monitor_id,omitempty"`
	Instance  string `json:"instance,omitempty"`
	Epoch     uint64 `json:"epoch,omitempty"`
	// Mine is true for a partition this monitor holds; Writable when it may
	// write it now (renewed within the TTL).
	Mine     bool `json:"mine"`
	Writable bool `json:"writable"`
	// AgeSeconds is how long ago the lease key last changed, as observed.
	AgeSeconds float64 `json:"age_seconds"`
	// Expired is true when the lease has not changed for the TTL.
	Expired bool `json:"expired"`
	Free    bool `json:"free"`
}

// Partitions returns every partition with its observed holder. Safe from
// any goroutine.
func (l *Leaser) Partitions() []PartitionInfo {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]PartitionInfo, l.cfg.Partitions)
	for p := range out {
		info := PartitionInfo{Partition: p, Mine: l.validUntil[p].Load() != 0, Writable: l.Valid(p)}
		if s := l.book.leases[p]; s != nil {
			info.MonitorID, info.Instance, info.Epoch = s.lease.MonitorID, s.lease.Instance, s.lease.Epoch
			info.AgeSeconds = now.Sub(s.seen).Seconds()
			info.Expired = now.Sub(s.seen) >= l.cfg.TTL
		} else {
			info.Free = true
		}
		out[p] = info
	}
	return out
}

// leaserSink feeds the watched bucket into the book.
type leaserSink Leaser

var _ kvwatch.Sweeper = (*leaserSink)(nil)

func (s *leaserSink) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.book.reset()
}

func (s *leaserSink) Apply(e jetstream.KeyValueEntry, now time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	foreign := len(s.book.foreign)
	err := s.book.apply(e, now)
	if foreign == 0 && len(s.book.foreign) > 0 {
		s.log.Error("busylist: a lease of another partition count is in the bucket; taking nothing until it is gone",
			"key", s.book.foreignKey(), "partitions", s.cfg.Partitions)
	}
	return err
}

func (s *leaserSink) Publish() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.book.publish()
	if s.readyAt.IsZero() {
		// The first publish: the initial values are in.
		s.readyAt = s.now()
	}
	return len(s.book.leases) + len(s.book.monitors) + len(s.book.foreign)
}

// Sweep forgets the keys the bucket's max age has removed: the server
// deletes them without a marker a watch would see.
func (s *leaserSink) Sweep(now time.Time, maxAge time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.book.sweep(now, maxAge)
}

// noWatchStats counts nothing: the leaser's own metrics say what matters.
type noWatchStats struct{}

func (noWatchStats) Rewatched(string) {}
func (noWatchStats) BadRecord(string) {}
func (noWatchStats) Published(int)    {}

// leaserMetrics are the Leaser's Prometheus metrics.
type leaserMetrics struct {
	gains, losses, releases, fenced, dupes prometheus.Counter
	held, live, foreign                    prometheus.Gauge
}

func newLeaserMetrics(reg prometheus.Registerer) (leaserMetrics, error) {
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	g := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	m := leaserMetrics{
		gains:    c("workermon_lease_gains_total", "Partition leases this monitor took (free or expired)."),
		losses:   c("workermon_lease_losses_total", "Partition leases this monitor lost to another monitor."),
		releases: c("workermon_lease_releases_total", "Partition leases this monitor gave back (fair share, shutdown)."),
		fenced:   c("workermon_lease_self_fenced_total", "Times a held partition stopped being written because its lease was not renewed within the TTL."),
		dupes:    c("workermon_lease_duplicate_monitors_total", "Other processes seen announcing this monitor's id after it had started (each refuses to start; this one keeps running)."),
		held:     g("workermon_lease_partitions_held", "Partitions this monitor holds."),
		live:     g("workermon_lease_live_monitors", "Monitors seen alive (announce changed within the lease TTL), this one included."),
		foreign:  g("workermon_lease_partitions_mismatch", "1 when the leases bucket holds leases of another --partitions: this monitor takes nothing."),
	}
	if err := promreg.All(reg, m.gains, m.losses, m.releases, m.fenced, m.dupes, m.held, m.live, m.foreign); err != nil {
		return m, fmt.Errorf("busylist: leaser: %w", err)
	}
	return m, nil
}
