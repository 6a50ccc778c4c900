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
// announces the same monitor id while this one is starting, or when a
// running monitor stands down for the process that replaced it.
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
	// OnRelease is called before a partition's lease is deleted: the final
	// write of its records, and the end of its intake. It runs on the
	// partition's goroutine, after its OnAcquire has returned; the lease
	// is renewed meanwhile. Required.
	OnRelease func(ctx context.Context, p int)
	// OnLose is called when this monitor stops holding a partition without
	// a final write: its lease was taken by another monitor, its key went,
	// the Writer abandoned it (Abandon), the monitor gave it back (GiveBack)
	// or stands down. Intake and writer stop (writes already stopped, as
	// Valid turned false). It runs after the partition's OnAcquire has
	// returned, on the partition's goroutine. Required.
	OnLose func(p int)
	// HoldUntil, when not nil, holds the leases back until it is closed:
	// no announce, no lease taken or renewed. The monitor passes the
	// channel that holds its Writer back (overrides and cordons not loaded
	// yet): a monitor that cannot write must not keep the others from its
	// partitions.
	HoldUntil <-chan struct{}
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
// Renewals run on a goroutine of their own, each lease's renewal on its
// own: nothing else the Leaser does (the announce, the read of the busy
// bucket when it takes partitions, a release's final write, the callbacks)
// delays them. Callbacks run on one goroutine per partition, in order.
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
	// readyAt is when the watch's initial values were in (zero before);
	// under mu.
	readyAt time.Time

	// validUntil[p] is the clock, in ns since base, until which p may be
	// written; 0 when not held.
	validUntil []atomic.Int64
	// epochs[p] is the epoch of p's lease while held (0 otherwise).
	epochs []atomic.Uint64

	loop     *kvwatch.Loop
	abandon  chan int      // partitions the Writer gave up, for Run
	giveBack chan int      // partitions the monitor cannot hear, for Run
	settled  chan struct{} // closed after the first round that may take, once its OnAcquire calls returned
	settle   sync.Once
	// calls runs the callbacks of each partition in order, off Run's
	// goroutine; Run waits for them before it returns.
	calls partitionCalls

	// hmu guards held and the fields its leases keep under it: Run's
	// goroutine, the renewals and the partitions' goroutines share them.
	hmu  sync.Mutex
	held map[int]*heldLease

	// Owned by Run's goroutine.
	others       map[string]*twin // other processes seen announcing this monitor's id, by instance
	lastForeign  string           // the foreign lease key seen at the last round
	unheldAt     time.Time        // when HoldUntil was first seen closed (zero without HoldUntil)
	retake       map[int]*retake  // partitions given back, not taken again before a backoff
	started      time.Time
	lastAnnounce time.Time
	announceFail time.Time
	live         int
	overSince    time.Time
	lastRelease  time.Time
	kv, busy     jetstream.KeyValue
}

// twin is another process seen announcing this monitor's id.
type twin struct {
	first, last time.Time // observer's clock: first and last announce seen
	ann         Announce
}

// retake is the backoff of a partition given back (GiveBack).
type retake struct {
	at    time.Time     // of the last give-back
	until time.Time     // not taken before
	wait  time.Duration // the last backoff
}

// partitionCalls runs the callbacks of each partition on goroutines of their
// own, one partition's in the order given. Safe from any goroutine.
type partitionCalls struct {
	mu   sync.Mutex
	wg   sync.WaitGroup
	last map[int]chan struct{} // per partition: closed when its last call has returned
}

// do runs fn after the calls of partition p given before it.
func (c *partitionCalls) do(p int, fn func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
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
	c.mu.Lock()
	defer c.mu.Unlock()
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
	c.mu.Lock()
	defer c.mu.Unlock()
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
	c.mu.Lock()
	done := c.last[p]
	c.mu.Unlock()
	if done != nil {
		<-done
	}
}

// heldLease is a partition this monitor holds.
type heldLease struct {
	// op is held while a request on the lease key is in flight: a renewal
	// (with its read-back) or the delete that gives the lease back.
	op sync.Mutex

	// Under Leaser.hmu.
	rev       uint64
	val       LeaseValue
	lastSend  time.Time // of the last renewal attempt
	goodSend  time.Time // when the last renewal that succeeded was sent
	fenced    bool      // its validity lapsed, counted; until a renewal succeeds
	renewing  bool      // a renewal is in flight
	releasing bool      // its release (final write, delete) has begun
	stopped   bool      // not written nor renewed any more (Abandon, GiveBack)
	gone      bool      // no longer held: a renewal in flight leaves it alone
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
		held: make(map[int]*heldLease), others: make(map[string]*twin), retake: make(map[int]*retake),
		abandon: make(chan int, cfg.Partitions), giveBack: make(chan int, cfg.Partitions),
		settled: make(chan struct{})}
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
// this monitor holds nothing and takes nothing. Safe from any goroutine.
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

// Holds reports whether this monitor holds partition p: taken, and not
// lost, abandoned, given back or released since (it may be fenced for the
// moment). Safe from any goroutine.
func (l *Leaser) Holds(p int) bool {
	return p >= 0 && p < len(l.validUntil) && l.validUntil[p].Load() != 0
}

// opTimeout bounds each KV request: well inside a renewal period.
func (l *Leaser) opTimeout() time.Duration {
	return max(min(l.cfg.TTL/3, 2*time.Second), 50*time.Millisecond)
}

// heldBack reports whether HoldUntil is set and not closed yet.
func (l *Leaser) heldBack() bool {
	if l.cfg.HoldUntil == nil {
		return false
	}
	select {
	case <-l.cfg.HoldUntil:
		return false
	default:
		return true
	}
}

// Run takes and keeps leases until ctx is done, then releases what it
// holds (final writes through OnRelease, then a compare-and-set delete of
// each lease) and deletes its announce.
//
// It returns ErrDuplicateMonitor, having taken nothing, when another live
// process announces the same id while this one is starting (before its
// first round that may take). A monitor past that point that sees another
// process announce its id logs a warning and counts
// workermon_lease_duplicate_monitors_total; a newcomer refuses within its
// first TTL. If the other process is still announcing 2 TTLs after it was
// first seen, it passed its own start, so this one was not live then
// (paused, or cut off): of the two, the one that started first stands down.
// It gives back what it holds without writing, and Run returns
// ErrDuplicateMonitor.
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
	// Renewals until everything is given back (the final writes need them).
	rctx, stopRenewals := context.WithCancel(context.WithoutCancel(ctx))
	renewals := make(chan struct{})
	go func() {
		defer close(renewals)
		l.renewLoop(rctx)
	}()
	defer func() {
		stopRenewals()
		<-renewals
	}()
	tick := time.NewTicker(max(l.cfg.TTL/6, 10*time.Millisecond))
	defer tick.Stop()
	for {
		if err := l.step(cctx); err != nil {
			// Refused at start (nothing is held), or standing down: what is
			// held is given back without a write, and the announce is the
			// other process's to keep.
			cancel()
			l.surrenderAll(context.WithoutCancel(ctx), "this monitor stands down for another process with its id")
			return err
		}
		select {
		case <-ctx.Done():
			l.drain(context.WithoutCancel(ctx), l.now())
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

// step is one round of Run: abandoned and given back partitions, announce,
// the other processes with this id, a foreign lease, then take or release.
// Renewals run beside it (renewLoop).
func (l *Leaser) step(ctx context.Context) error {
	now := l.now()
	l.drain(ctx, now)
	if l.heldBack() {
		return nil // nothing announced, taken or renewed: the others take the partitions
	}
	if l.cfg.HoldUntil != nil && l.unheldAt.IsZero() {
		l.unheldAt = now
	}
	l.announce(ctx, now)

	l.mu.Lock()
	readyAt := l.readyAt
	dupe, foreign := l.book.takeDupe(), l.book.foreignKey()
	live := l.book.live(now, l.cfg.TTL)
	l.mu.Unlock()
	// Starting: nothing is taken until the initial values are in (and the
	// Writer is no longer held back) and one TTL has passed since. Every
	// lease and announce seen by then is judged by its own age, and a live
	// process with this monitor's id has re-announced itself (every
	// TTL/3).
	starting := readyAt.IsZero() || now.Sub(laterOf(readyAt, l.unheldAt)) < l.cfg.TTL
	if err := l.twins(ctx, now, dupe, starting); err != nil {
		return err
	}
	if foreign == "" {
		l.metrics.foreign.Set(0)
		if l.lastForeign != "" {
			l.log.Info("busylist: no lease of another partition count is left in the bucket; taking partitions",
				"gone", l.lastForeign, "partitions", l.cfg.Partitions)
		}
	} else {
		l.metrics.foreign.Set(1) // the sighting is logged by the sink
		if held := l.heldList(); len(held) > 0 {
			// Both monitors may have taken partitions before either saw the
			// other's lease: neither writes on, and neither keeps the other
			// from what it holds.
			l.metrics.foreignStops.Inc()
			l.log.Error("busylist: a lease of another partition count is in the bucket: stopping writing and giving back every partition held; every monitor of a deployment needs the same --partitions",
				"key", foreign, "partitions", l.cfg.Partitions, "held", held)
			for _, p := range held {
				l.surrender(ctx, p, "a lease of another partition count is in the bucket", true)
			}
		}
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
	held := l.heldList()
	switch {
	case len(held) < share:
		l.overSince = time.Time{}
		l.take(ctx, now, share-len(held))
	case len(held) > share:
		if l.overSince.IsZero() {
			l.overSince = now
		}
		if now.Sub(l.overSince) >= 2*l.cfg.TTL && now.Sub(l.lastRelease) >= l.cfg.TTL {
			// The highest partition whose OnAcquire is over and that is
			// not being released already.
			for _, p := range slices.Backward(held) {
				if !l.calls.busy(p) && l.release(ctx, p) {
					l.lastRelease = now
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
		l.calls.whenDone(l.heldList(), func() { close(l.settled) })
	})
	return nil
}

// laterOf returns the later of two times.
func laterOf(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// drain gives up the partitions the Writer abandoned and those the monitor
// gave back.
func (l *Leaser) drain(ctx context.Context, now time.Time) {
	for {
		select {
		case p := <-l.abandon:
			if l.surrender(ctx, p, "a record with a higher epoch was found", false) {
				l.metrics.losses.Inc()
			}
		case p := <-l.giveBack:
			if !l.surrender(ctx, p, "the monitor cannot hear the partition", true) {
				continue
			}
			l.metrics.releases.Inc()
			// Taken again after a backoff that doubles while give-backs
			// follow each other, from one TTL to a minute.
			r := l.retake[p]
			if r == nil || now.Sub(r.at) > 2*time.Minute {
				r = &retake{wait: l.cfg.TTL / 2}
				l.retake[p] = r
			}
			r.wait = min(2*r.wait, max(time.Minute, l.cfg.TTL))
			r.at, r.until = now, now.Add(r.wait)
		default:
			return
		}
	}
}

// twins handles another process seen announcing this monitor's id (see
// Run): refused when starting, counted and logged when running, and
// standing down for a newer one that is still announcing 2 TTLs after it
// was first seen.
func (l *Leaser) twins(ctx context.Context, now time.Time, dupe *Announce, starting bool) error {
	if dupe != nil {
		if starting {
			return fmt.Errorf("%w: %q is announced by instance %s, which is running; this one (instance %s) refuses to start",
				ErrDuplicateMonitor, l.cfg.MonitorID, dupe.Instance, l.instance)
		}
		o := l.others[dupe.Instance]
		if o == nil {
			o = &twin{first: now}
			l.others[dupe.Instance] = o
			l.metrics.dupes.Inc()
			l.log.Warn("busylist: another process announces this monitor's id; a newcomer refuses to start, a replacement that passed its start makes the older of the two stand down",
				"monitor_id", l.cfg.MonitorID, "other_instance", dupe.Instance, "instance", l.instance)
		}
		o.last, o.ann = now, *dupe
	}
	for inst, o := range l.others {
		if now.Sub(o.last) > l.cfg.TTL {
			delete(l.others, inst) // gone (refused, or stopped)
			continue
		}
		newer := o.ann.StartedAt > l.started.UnixNano() ||
			o.ann.StartedAt == l.started.UnixNano() && o.ann.Instance > l.instance
		if newer && now.Sub(o.first) >= 2*l.cfg.TTL {
			l.log.Error("busylist: another process with this monitor's id passed its start beside this one (this one was paused or cut off meanwhile); standing down: giving back every partition without writing, and stopping",
				"monitor_id", l.cfg.MonitorID, "other_instance", inst, "instance", l.instance, "held", l.heldList())
			return fmt.Errorf("%w: %q is announced by instance %s, which started after this one and runs beside it; this one (instance %s) stands down",
				ErrDuplicateMonitor, l.cfg.MonitorID, inst, l.instance)
		}
	}
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

// heldList returns the partitions held (released or not), sorted.
func (l *Leaser) heldList() []int {
	l.hmu.Lock()
	defer l.hmu.Unlock()
	return slices.Sorted(maps.Keys(l.held))
}

// renewLoop renews the held leases until ctx is done: each lease every
// TTL/3, on a goroutine of its own, so that a slow request delays no other.
func (l *Leaser) renewLoop(ctx context.Context) {
	tick := time.NewTicker(max(l.cfg.TTL/12, 5*time.Millisecond))
	defer tick.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		l.renewDue(ctx, l.now(), &wg)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// renew renews every held lease due at now and waits for the renewals.
func (l *Leaser) renew(ctx context.Context, now time.Time) {
	var wg sync.WaitGroup
	l.renewDue(ctx, now, &wg)
	wg.Wait()
}

// renewDue counts the leases whose validity has lapsed, and starts the
// renewal of each held lease due at now on a goroutine added to wg. No
// lease is renewed while the Leaser is held back, nor one not written any
// more.
func (l *Leaser) renewDue(ctx context.Context, now time.Time, wg *sync.WaitGroup) {
	l.hmu.Lock()
	defer l.hmu.Unlock()
	for p, h := range l.held {
		l.noteFenceLocked(p, h, now)
	}
	if l.heldBack() {
		return
	}
	for p, h := range l.held {
		if h.renewing || h.stopped || now.Sub(h.lastSend) < l.cfg.TTL/3 {
			continue
		}
		h.renewing, h.lastSend = true, now
		rev, val := h.rev, h.val
		wg.Go(func() { l.renewOne(ctx, p, h, rev, val, now) })
	}
}

// renewOne renews partition p's lease h, held at rev, by a compare-and-set
// sent at sent.
func (l *Leaser) renewOne(ctx context.Context, p int, h *heldLease, rev uint64, val LeaseValue, sent time.Time) {
	h.op.Lock()
	defer h.op.Unlock()
	defer func() {
		l.hmu.Lock()
		h.renewing = false
		l.hmu.Unlock()
	}()
	l.hmu.Lock()
	gone := h.gone
	l.hmu.Unlock()
	if gone {
		return
	}
	data, _ := json.Marshal(val)
	key := LeaseKey(l.cfg.Partitions, p)
	octx, cancel := context.WithTimeout(ctx, l.opTimeout())
	newRev, err := l.kv.Update(octx, key, data, rev)
	cancel()
	if err == nil {
		l.hmu.Lock()
		if !h.gone {
			l.renewedLocked(p, h, newRev, sent)
		}
		l.hmu.Unlock()
		return
	}
	// A timeout, or a compare-and-set that failed: the renewal may have
	// landed, another monitor may hold the key now, or the key may be gone.
	// Read it back.
	octx, cancel = context.WithTimeout(ctx, l.opTimeout())
	e, gerr := l.kv.Get(octx, key)
	cancel()
	switch {
	case errors.Is(gerr, jetstream.ErrKeyNotFound):
		// Gone: the bucket's max age passed (an outage longer than it),
		// a purge, a recreated bucket. Nobody holds the partition; it is
		// given up at once and taken again by a create under a higher
		// epoch, by this monitor or another. No watch may report the key
		// gone (the max age removes it without a marker): the book forgets
		// it now.
		l.mu.Lock()
		l.book.forget(p, rev)
		l.mu.Unlock()
		l.drop(p, h, "its lease key is gone")
	case gerr != nil:
		// Nothing is known: try again next time. A lease that is really
		// gone or taken fails the next compare-and-set too.
		l.log.Warn("busylist: cannot renew a lease", "partition", p, "err", err, "read_back", gerr)
	default:
		// Still ours: an earlier renewal landed although its answer was
		// lost. Its revision is adopted, but not as a renewal: when it was
		// sent is not known, so the validity is not extended (the next
		// renewal, due at once, extends it). Another's: lost.
		var v LeaseValue
		if json.Unmarshal(e.Value(), &v) != nil || v.Instance != l.instance {
			l.drop(p, h, "the lease changed under it")
			return
		}
		l.hmu.Lock()
		if !h.gone {
			h.rev = e.Revision()
			h.lastSend = time.Time{}
		}
		l.hmu.Unlock()
	}
}

// validLocked records that partition p's lease h is at rev, renewed (or
// taken) by a request sent at sent.
func (l *Leaser) validLocked(p int, h *heldLease, rev uint64, sent time.Time) {
	h.rev, h.goodSend = rev, sent
	l.epochs[p].Store(h.val.Epoch)
	l.validUntil[p].Store(int64(sent.Add(l.cfg.TTL).Sub(l.base)))
}

// renewedLocked records a renewal sent at sent that succeeded. A validity
// that lapsed before it came back is counted as a fence first.
func (l *Leaser) renewedLocked(p int, h *heldLease, rev uint64, sent time.Time) {
	l.noteFenceLocked(p, h, l.now())
	if h.stopped {
		h.rev = rev
		return
	}
	l.validLocked(p, h, rev, sent)
	if h.fenced {
		h.fenced = false
		l.log.Info("busylist: lease renewed again, writing resumes", "partition", p, "epoch", h.val.Epoch)
	}
}

// noteFenceLocked counts and logs partition p, held as h, when its
// validity has lapsed at at, once per lapse: every fence is counted,
// whether it ends with a late renewal, a loss or nothing.
func (l *Leaser) noteFenceLocked(p int, h *heldLease, at time.Time) {
	if h.fenced || h.stopped || int64(at.Sub(l.base)) < l.validUntil[p].Load() {
		return
	}
	h.fenced = true
	l.metrics.fenced.Inc()
	l.log.Warn("busylist: lease not renewed within its TTL, no longer writing the partition",
		"partition", p, "epoch", h.val.Epoch)
}

// take takes up to n free or expired partitions.
func (l *Leaser) take(ctx context.Context, now time.Time, n int) {
	skip := make(map[int]bool)
	for _, p := range l.heldList() {
		skip[p] = true
	}
	for p, r := range l.retake {
		if now.Before(r.until) {
			skip[p] = true
		}
	}
	l.mu.Lock()
	cands := l.book.free(now, l.cfg.TTL, func(p int) bool { return skip[p] })
	l.mu.Unlock()
	if len(cands) == 0 {
		return
	}
	// One read of the busy bucket for every candidate; the renewals of the
	// leases held go on meanwhile.
	recEpochs, err := l.recordEpochs(ctx)
	if err != nil {
		l.log.Warn("busylist: cannot read the busy bucket's records; taking no partition now", "err", err)
		return
	}
	for _, c := range cands {
		if n == 0 || ctx.Err() != nil {
			return
		}
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
			if c.rev != 0 && errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
				l.forgetIfGone(ctx, c.p, c.rev)
			}
			continue
		}
		n--
		h := &heldLease{val: v, lastSend: sent}
		l.hmu.Lock()
		l.held[c.p] = h
		l.validLocked(c.p, h, rev, sent)
		l.metrics.held.Set(float64(len(l.held)))
		l.hmu.Unlock()
		l.metrics.gains.Inc()
		l.log.Info("busylist: partition taken", "partition", c.p, "epoch", v.Epoch,
			"expired_holder", c.rev != 0)
		// Off this goroutine: claiming the records of a large partition, or
		// on a slow server, must not delay the rounds.
		p, epoch := c.p, v.Epoch
		l.calls.do(p, func() { l.cfg.OnAcquire(ctx, p, epoch) })
	}
}

// forgetIfGone reads partition p's lease key, whose expired lease was seen
// at rev, after a compare-and-set on it failed: a key that is gone (removed
// by the bucket's max age, which no watch reports) is forgotten, so that
// the next round creates it.
func (l *Leaser) forgetIfGone(ctx context.Context, p int, rev uint64) {
	octx, cancel := context.WithTimeout(ctx, l.opTimeout())
	_, err := l.kv.Get(octx, LeaseKey(l.cfg.Partitions, p))
	cancel()
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		l.mu.Lock()
		l.book.forget(p, rev)
		l.mu.Unlock()
	}
}

// recordEpochs returns, for each partition this monitor does not hold,
// the highest epoch among its records and delete markers in the busy
// bucket. Only the bucket's headers are listed (partitionEpochs); each
// batch of the listing, not the whole, is bounded by the KV timeout, so a
// large bucket or a slow server still gives an answer.
func (l *Leaser) recordEpochs(ctx context.Context) ([]uint64, error) {
	return partitionEpochs(ctx, l.cfg.JetStream, l.busy, l.cfg.Partitions,
		func(p int) bool { return l.validUntil[p].Load() == 0 }, l.opTimeout())
}

// unholdLocked stops holding partition p, held as h, at now: no write, no
// renewal from now on. It reports false when h is no longer p's lease.
func (l *Leaser) unholdLocked(p int, h *heldLease, now time.Time) bool {
	if h == nil || l.held[p] != h {
		return false
	}
	l.noteFenceLocked(p, h, now)
	l.validUntil[p].Store(0)
	delete(l.held, p)
	h.gone = true
	l.metrics.held.Set(float64(len(l.held)))
	return true
}

// drop forgets partition p, held as h, whose lease another monitor holds
// now or whose key is gone: nothing is written or deleted.
func (l *Leaser) drop(p int, h *heldLease, why string) {
	l.hmu.Lock()
	ok := l.unholdLocked(p, h, l.now())
	l.hmu.Unlock()
	if !ok {
		return
	}
	l.metrics.losses.Inc()
	l.log.Warn("busylist: partition lost", "partition", p, "why", why)
	l.calls.do(p, func() { l.cfg.OnLose(p) })
}

// surrender stops holding partition p without a final write (OnLose) and,
// with del, deletes its lease by compare-and-set so that another monitor
// can take it at once. It reports false when p was not held.
func (l *Leaser) surrender(ctx context.Context, p int, why string, del bool) bool {
	l.hmu.Lock()
	h := l.held[p]
	ok := l.unholdLocked(p, h, l.now())
	l.hmu.Unlock()
	if !ok {
		return false
	}
	l.log.Warn("busylist: partition given up without a final write", "partition", p, "why", why, "lease_deleted", del)
	l.calls.do(p, func() { l.cfg.OnLose(p) })
	if del {
		if err := l.deleteLease(ctx, p, h); err != nil {
			l.log.Warn("busylist: cannot delete a lease given up; it expires", "partition", p, "err", err)
		}
	}
	return true
}

// surrenderAll gives up every partition held without a final write and
// deletes their leases, then waits for their callbacks.
func (l *Leaser) surrenderAll(ctx context.Context, why string) {
	held := l.heldList()
	for _, p := range held {
		if l.surrender(ctx, p, why, true) {
			l.metrics.releases.Inc()
		}
	}
	for _, p := range held {
		l.calls.wait(p)
	}
}

// Abandon forgets partition p without writing or deleting anything: its
// Writer found a record with a higher epoch. The lease expires for the
// others; it is never renewed again by this monitor. Safe from any
// goroutine: writes stop at once, OnLose follows at Run's next round.
func (l *Leaser) Abandon(p int) {
	if l.stopWriting(p) {
		select {
		case l.abandon <- p:
		default: // full: P abandons are queued already
		}
	}
}

// GiveBack gives partition p up without a final write, and deletes its
// lease so that another monitor can take it at once: the monitor cannot
// hear the partition (its subscription failed), and a monitor never renews
// a partition it does not hear. This monitor takes it again after a
// backoff. Safe from any goroutine (OnAcquire calls it): writes and
// renewals stop at once, OnLose and the delete follow at Run's next round.
func (l *Leaser) GiveBack(p int) {
	if l.stopWriting(p) {
		select {
		case l.giveBack <- p:
		default:
		}
	}
}

// stopWriting makes partition p unwritable and stops its renewals, until
// Run gives it up. It reports false when p is out of range.
func (l *Leaser) stopWriting(p int) bool {
	if p < 0 || p >= len(l.validUntil) {
		return false
	}
	l.hmu.Lock()
	defer l.hmu.Unlock()
	l.validUntil[p].Store(0) // no write from now on
	if h := l.held[p]; h != nil {
		h.stopped = true
	}
	return true
}

// release gives partition p back on its own goroutine: its final write
// (OnRelease, once its OnAcquire has returned; the lease is renewed
// meanwhile), then a compare-and-set delete of its lease. It reports false
// when p is not held or already being released. A shutdown meanwhile does
// not cut the release short (OnRelease bounds its final write).
func (l *Leaser) release(ctx context.Context, p int) bool {
	ctx = context.WithoutCancel(ctx)
	l.hmu.Lock()
	h := l.held[p]
	if h == nil || h.releasing || h.stopped {
		l.hmu.Unlock()
		return false
	}
	h.releasing = true
	l.hmu.Unlock()
	l.calls.do(p, func() {
		l.cfg.OnRelease(ctx, p)
		l.hmu.Lock()
		ok := l.unholdLocked(p, h, l.now())
		l.hmu.Unlock()
		if !ok {
			return // lost meanwhile
		}
		err := l.deleteLease(ctx, p, h)
		l.metrics.releases.Inc()
		if err != nil {
			l.log.Warn("busylist: cannot delete a released lease; it expires", "partition", p, "err", err)
			return
		}
		l.log.Info("busylist: partition released", "partition", p, "epoch", h.val.Epoch)
	})
	return true
}

// deleteLease deletes partition p's lease h, no longer held, by
// compare-and-set, once a renewal in flight has returned.
func (l *Leaser) deleteLease(ctx context.Context, p int, h *heldLease) error {
	h.op.Lock()
	defer h.op.Unlock()
	l.hmu.Lock()
	rev := h.rev
	l.hmu.Unlock()
	key := LeaseKey(l.cfg.Partitions, p)
	octx, cancel := context.WithTimeout(ctx, l.opTimeout())
	defer cancel()
	err := l.kv.Delete(octx, key, jetstream.LastRevision(rev))
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) {
		// A renewal whose answer was lost may have landed: the lease is
		// still ours under a newer revision.
		err = l.deleteIfOurs(octx, key, err)
	}
	return err
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

// releaseAll releases every held partition and waits until they are
// given back.
func (l *Leaser) releaseAll(ctx context.Context) {
	if l.kv == nil {
		return
	}
	held := l.heldList()
	for _, p := range held {
		l.release(ctx, p)
	}
	for _, p := range held {
		l.calls.wait(p)
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
		s.log.Error("busylist: a lease of another partition count is in the bucket; holding and taking nothing until it is gone",
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
	gains, losses, releases, fenced, dupes, foreignStops prometheus.Counter
	held, live, foreign                                  prometheus.Gauge
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
		dupes:    c("workermon_lease_duplicate_monitors_total", "Other processes seen announcing this monitor's id after it had started (a newcomer refuses to start; beside a replacement that passed its start, the older of the two stands down)."),
		foreignStops: c("workermon_lease_foreign_stops_total",
			"Times this monitor stopped writing and gave back every partition it held on seeing a lease of another --partitions."),
		held:    g("workermon_lease_partitions_held", "Partitions this monitor holds."),
		live:    g("workermon_lease_live_monitors", "Monitors seen alive (announce changed within the lease TTL), this one included."),
		foreign: g("workermon_lease_partitions_mismatch", "1 when the leases bucket holds leases of another --partitions: this monitor holds and takes nothing."),
	}
	if err := promreg.All(reg, m.gains, m.losses, m.releases, m.fenced, m.dupes, m.foreignStops, m.held, m.live, m.foreign); err != nil {
		return m, fmt.Errorf("busylist: leaser: %w", err)
	}
	return m, nil
}
