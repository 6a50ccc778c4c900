// Package kvwatch is the KV watch loop that every watcher of a workermon
// bucket shares: the busy-set Watcher (busylist), the registry Watcher
// (registry) and the ThresholdWatcher (overrides).
//
// A Loop runs on one goroutine. It opens the bucket (creating it when
// missing), watches every key and feeds the entries to a Sink: the watchers
// apply them to a copy-on-write State and publish immutable snapshots
// through an atomic.Pointer, the ThresholdWatcher hands them to its callback.
// It re-watches:
//
//   - at once, resuming after the last revision seen, on every reconnect of
//     the NATS connection (a KV watcher otherwise stalls for 10–20 s after a
//     server restart), and when asked to (Rewatch);
//   - with capped, jittered backoff when the watcher's channel closes or the
//     bucket cannot be opened;
//   - from scratch (a full re-watch: the sink replaces its whole state when
//     the initial values are in) when a probe, or the opening of the next
//     watch, finds the bucket deleted, or deleted and recreated (another
//     stream creation time, or a last sequence below the last revision
//     seen);
//   - resuming, when a probe finds the stream ahead of the watcher on two
//     probes in a row without progress (a silent stall);
//   - resuming, when a probe answers again after a failed one (the watch
//     may have missed entries meanwhile).
//
// Entries at or below the last revision seen are ignored, so overlapping
// re-watches never apply an entry twice or go back in time.
//
// The watch is live (Live) while it is current: a watch's initial values
// are in (a resumed watch's too: it has caught up with the stream), the
// connection is up and the last probe answered. It stops being live when the
// watch ends, when the connection drops and when a probe fails. A Sweeper's
// expiry counts only live time: the loop sweeps only while the watch is live,
// and entries received before the watch last became live are kept until one
// TTL after that moment (a fresh grace), so that an outage of NATS, however
// long, never empties the sink of entries that their writers would have
// refreshed.
package kvwatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/retry"
)

// ErrClosed is returned by WaitReady when the loop was closed before its
// initial values arrived.
var ErrClosed = errors.New("kvwatch: watcher closed")

const (
	// watchHealthyAfter is how long a watch must have lasted for the
	// retry.Backoff to start again from its minimum.
	watchHealthyAfter = 10 * time.Second
	// watchBatchMax is the most queued entries applied before one publish.
	watchBatchMax = 256
	// watchSweepEvery is how often entries past the bucket's TTL are dropped
	// (bucket TTL expiries reach watchers only when the bucket has limit
	// markers), and how often the connection is checked for the sweep.
	watchSweepEvery = time.Second
)

// Sink receives a watched bucket's entries. Only the loop's goroutine calls
// it.
type Sink interface {
	// Reset begins a full sync: the entries up to the next Publish are the
	// bucket's whole content and replace everything the sink had.
	Reset()
	// Apply applies one entry (put, delete or purge); now is the loop's
	// clock at receipt. A returned error means a bad record: the loop logs
	// it (rate-limited) and counts it (under RecordError's reason, else
	// "other"), and the sink has already dealt with the key.
	Apply(e jetstream.KeyValueEntry, now time.Time) error
	// Publish ends a batch of entries that together form a complete state:
	// the loop calls it when a watch's initial values are in (which ends a
	// full sync) and after each later batch. It returns the number of keys.
	Publish() int
}

// Sweeper is a Sink that drops entries on its own when the bucket has a
// TTL; the loop calls Sweep every second while the watch is live and has
// been for more than the TTL (see the top of this file).
type Sweeper interface {
	// Sweep drops entries received more than ttl ago; a Publish follows.
	Sweep(now time.Time, ttl time.Duration)
}

// Stats is where a loop counts what happens to its watch. Each owner maps it
// onto its own metrics.
type Stats interface {
	// Rewatched counts a watch that ended, and why: reconnect, manual,
	// closed, error, gone, recreated or stalled.
	Rewatched(reason string)
	// BadRecord counts an entry the sink rejected.
	BadRecord(reason string)
	// Published reports the sink's keys after a publish; the first call
	// means the initial values are in.
	Published(keys int)
}

// RecordError is a bad record, with the reason label it is counted under.
type RecordError struct {
	Reason string
	Err    error
}

func (e *RecordError) Error() string { return e.Err.Error() }
func (e *RecordError) Unwrap() error { return e.Err }

// End is why one watch ended.
type End uint8

const (
	EndNone      End = iota
	EndStopped       // the loop's context ended
	EndReconnect     // the connection reconnected: resume
	EndManual        // a re-watch was asked for: resume
	EndClosed        // the watcher's channel closed: back off, resume
	EndError         // the bucket could not be opened or watched: back off
	EndGone          // the bucket was deleted: full re-watch
	EndRecreated     // the bucket was deleted and recreated: full re-watch
	EndStalled       // the watcher fell behind without progress: resume
	EndRecovered     // a probe answered again after failing: resume
)

func (e End) String() string {
	switch e {
	case EndStopped:
		return "stopped"
	case EndReconnect:
		return "reconnect"
	case EndManual:
		return "manual"
	case EndClosed:
		return "closed"
	case EndError:
		return "error"
	case EndGone:
		return "gone"
	case EndRecreated:
		return "recreated"
	case EndStalled:
		return "stalled"
	case EndRecovered:
		return "recovered"
	}
	return "none"
}

// Config is what a Loop needs besides its sink and stats.
type Config struct {
	JS       jetstream.JetStream
	Bucket   string
	Replicas int // of the bucket when the loop creates it
	Log      *slog.Logger
	// ErrLevel is the level failures to watch are logged at.
	ErrLevel slog.Level
	Now      func() time.Time
	// OpTimeout bounds every single request to the server: opening the
	// bucket, its status, each probe.
	OpTimeout  time.Duration
	ProbeEvery time.Duration
	// RetryMin and RetryMax bound the backoff between failed watches.
	RetryMin, RetryMax time.Duration
}

// Loop watches one bucket for one sink; see the top of this file.
type Loop struct {
	cfg        Config     // Log carries the bucket
	nc         *nats.Conn // of cfg.JS; nil for a JetStream without one
	sink       Sink
	sweeper    Sweeper // the sink, when it sweeps; else nil
	stats      Stats
	sweepEvery time.Duration

	rewatchCh chan struct{} // capacity 1: a re-watch was asked for
	readyCh   chan struct{} // closed when the initial values are in
	readyOnce sync.Once
	live      atomic.Bool // the watch is live; see Live
	// Set by start, for the owners that run the loop in the background.
	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once

	// Owned by the loop's goroutine.
	lastRev uint64    // highest revision applied
	created time.Time // creation time of the bucket's stream being watched
	synced  bool      // the current state is complete (a full watch's initial values are in)
	ttl     time.Duration
	lag     watchLag
	// liveSince is cfg.Now when the watch last became live; zero while it
	// is not. Sweeps wait until one TTL has passed since.
	liveSince time.Time
	// downSince is when a live watch stopped being live (the real clock,
	// for the log); zero while live or before the first time.
	downSince   time.Time
	probeFailed bool // the last probe of this watch failed
	backoff     retry.Backoff
	errLog      *retry.ErrLog
	badLog      *retry.ErrLog
}

// New returns a loop that watches cfg.Bucket for sink and counts in stats.
// Run it with Start (in the background, until Close) or with Run.
func New(cfg Config, sink Sink, stats Stats) *Loop {
	cfg.Log = cfg.Log.With("bucket", cfg.Bucket)
	sweeper, _ := sink.(Sweeper)
	var nc *nats.Conn
	if cfg.JS != nil {
		nc = cfg.JS.Conn()
	}
	return &Loop{
		cfg:        cfg,
		nc:         nc,
		sink:       sink,
		sweeper:    sweeper,
		stats:      stats,
		sweepEvery: watchSweepEvery,
		rewatchCh:  make(chan struct{}, 1),
		readyCh:    make(chan struct{}),
		done:       make(chan struct{}),
		backoff:    retry.NewBackoff(cfg.RetryMin, cfg.RetryMax),
		errLog:     retry.NewErrLog(cfg.Log, cfg.ErrLevel, "kvwatch: watch bucket"),
		badLog:     retry.NewErrLog(cfg.Log, slog.LevelWarn, "kvwatch: decode records"),
	}
}

// Start runs the loop on a goroutine of its own, until Close.
func (l *Loop) Start() {
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	go func() {
		defer close(l.done)
		l.Run(ctx)
	}()
}

// Close stops a loop begun with Start and waits for it. It is idempotent.
func (l *Loop) Close() {
	l.closeOnce.Do(l.cancel)
	<-l.done
}

// WaitReady waits for the initial values of a loop begun with Start, until
// ctx is done (returning its error) or the loop is closed (ErrClosed).
func (l *Loop) WaitReady(ctx context.Context) error {
	select {
	case <-l.readyCh:
		return nil
	default:
	}
	select {
	case <-l.readyCh:
		return nil
	case <-l.done:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Ready is closed when the initial values are in.
func (l *Loop) Ready() <-chan struct{} { return l.readyCh }

// Live reports whether the watch is live: its values are in and current,
// the connection is up, and the server answered the last probe. While it is
// not, what the sink holds may be out of date, and a Sweeper's entries do
// not expire. It takes no lock of the loop's and may be called from any
// goroutine.
func (l *Loop) Live() bool {
	return l.live.Load() && (l.nc == nil || l.nc.IsConnected())
}

// Rewatch asks the loop to re-create its watch, resuming after the last
// revision seen. It never blocks.
func (l *Loop) Rewatch() {
	select {
	case l.rewatchCh <- struct{}{}:
	default:
	}
}

// Run watches until ctx is done, on the caller's goroutine (for owners that
// run the loop themselves; Start runs it in the background).
func (l *Loop) Run(ctx context.Context) {
	var status chan nats.Status
	if l.nc != nil {
		// Registered before the first watch so that no reconnect is missed.
		status = l.nc.StatusChanged(nats.CONNECTED)
		defer l.nc.RemoveStatusListener(status)
	}
	for {
		started := time.Now()
		end, err := l.watchOnce(ctx, status)
		if ctx.Err() != nil {
			return
		}
		if end == EndClosed || end == EndError {
			l.lost("the watch ended: "+end.String(), err)
		} else {
			// Replaced at once: live again when the next watch has caught
			// up, with no news in the log.
			l.live.Store(false)
			l.liveSince = time.Time{}
		}
		if time.Since(started) >= watchHealthyAfter {
			// A watch that lasted is no run of failures.
			l.backoff.Reset()
		}
		l.stats.Rewatched(end.String())
		switch end {
		case EndReconnect, EndManual, EndStalled, EndGone, EndRecreated, EndRecovered:
			l.cfg.Log.Debug("kvwatch: re-watching", "reason", end.String(), "revision", l.lastRev)
			continue
		}
		if err == nil {
			err = fmt.Errorf("kvwatch: watch of bucket %s ended: %s", l.cfg.Bucket, end)
		}
		l.errLog.Fail(err, "revision", l.lastRev)
		if !l.sleep(ctx, status, l.backoff.Next()) {
			return
		}
	}
}

// sleep waits d, or less when the connection reconnects or a re-watch is
// asked for, and reports whether ctx is still live.
func (l *Loop) sleep(ctx context.Context, status <-chan nats.Status, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-status:
	case <-l.rewatchCh:
	}
	return true
}

// watchOnce opens the bucket, watches it (resuming after lastRev when the
// state is complete and the bucket is the same, from scratch otherwise) and
// returns when the watch must be replaced.
func (l *Loop) watchOnce(ctx context.Context, status <-chan nats.Status) (End, error) {
	octx, cancel := context.WithTimeout(ctx, l.cfg.OpTimeout)
	kv, err := kvbucket.Open(octx, l.cfg.JS, l.cfg.Bucket, l.cfg.Replicas)
	var st jetstream.KeyValueStatus
	if err == nil {
		if st, err = kv.Status(octx); err != nil {
			err = fmt.Errorf("kvwatch: status of bucket %s: %w", l.cfg.Bucket, err)
		}
	}
	cancel()
	if err != nil {
		return EndError, err
	}
	created, lastSeq, known := watchStreamState(st)
	l.ttl = st.TTL()
	full := !l.synced || known && (!created.Equal(l.created) || lastSeq < l.lastRev)
	var opts []jetstream.WatchOpt
	if full {
		if l.synced {
			l.cfg.Log.Info("kvwatch: reloading the bucket from scratch", "revision", l.lastRev, "last_seq", lastSeq)
		}
		l.sink.Reset()
		l.synced, l.lastRev, l.created, l.lag = false, 0, created, watchLag{}
	} else {
		opts = append(opts, jetstream.ResumeFromRevision(l.lastRev+1))
	}
	l.lag.behind = false
	l.probeFailed = false
	// Reconnects signalled, and re-watches asked for, before this watch need
	// no other one.
	for len(status) > 0 {
		<-status
	}
	select {
	case <-l.rewatchCh:
	default:
	}

	// wctx is the watcher's lifetime: cancelling it unsubscribes.
	wctx, wcancel := context.WithCancel(ctx)
	w, err := kv.WatchAll(wctx, opts...)
	if err != nil {
		wcancel()
		return EndError, fmt.Errorf("kvwatch: watch bucket %s: %w", l.cfg.Bucket, err)
	}
	defer kvbucket.StopWatch(w, wcancel)

	probe := time.NewTicker(l.cfg.ProbeEvery)
	defer probe.Stop()
	var sweepC <-chan time.Time
	if l.sweeper != nil {
		sweep := time.NewTicker(l.sweepEvery)
		defer sweep.Stop()
		sweepC = sweep.C
	}
	updates := w.Updates()
	initial := full // applying a full watch's initial values
	for {
		select {
		case <-ctx.Done():
			return EndStopped, nil
		case <-status:
			return EndReconnect, nil
		case <-l.rewatchCh:
			return EndManual, nil
		case e, ok := <-updates:
			for n := 0; ok; n++ {
				if e == nil {
					// The initial values are in (or, resuming, the watch
					// has caught up): publish them, then say so.
					initial = false
					l.synced = true
					l.markReady(l.publish())
					l.current()
				} else {
					l.apply(e, initial)
				}
				if n >= watchBatchMax || len(updates) == 0 {
					break
				}
				e, ok = <-updates
			}
			if l.synced {
				l.publish()
			}
			if !ok {
				return EndClosed, nil
			}
		case <-probe.C:
			if end := l.probe(ctx, kv); end != EndNone {
				return end, nil
			}
		case <-sweepC:
			l.sweep()
		}
	}
}

// sweep has the sweeper drop what is past the TTL, when the watch is live
// and has been for more than the TTL; entries received before it became
// live get one TTL from that moment.
func (l *Loop) sweep() {
	now := l.cfg.Now()
	if l.nc != nil && !l.nc.IsConnected() {
		l.lost("disconnected from NATS", nil)
	}
	if !l.live.Load() || !l.synced || l.ttl <= 0 || now.Sub(l.liveSince) <= l.ttl {
		return
	}
	l.sweeper.Sweep(now, l.ttl)
	l.publish()
}

// current marks the watch live, if the connection is up and no probe of
// this watch has failed, and logs a recovery.
func (l *Loop) current() {
	if l.live.Load() || l.probeFailed || l.nc != nil && !l.nc.IsConnected() {
		return
	}
	l.liveSince = l.cfg.Now()
	l.live.Store(true)
	if !l.downSince.IsZero() {
		attrs := []any{"down_for", time.Since(l.downSince).Round(time.Millisecond), "revision", l.lastRev}
		if l.sweeper != nil && l.ttl > 0 {
			attrs = append(attrs, "expiry", "resumed: entries not refreshed within "+l.ttl.String()+" from now expire")
		}
		l.cfg.Log.Info("kvwatch: bucket readable again", attrs...)
		l.downSince = time.Time{}
	}
}

// lost marks the watch not live, and logs it when it was.
func (l *Loop) lost(why string, err error) {
	l.liveSince = time.Time{}
	if !l.live.Swap(false) {
		return
	}
	l.downSince = time.Now()
	attrs := []any{"reason", why, "revision", l.lastRev}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	if l.sweeper != nil && l.ttl > 0 {
		attrs = append(attrs, "expiry", "paused: entries are kept until the bucket is read again")
	}
	l.cfg.Log.Log(context.Background(), l.cfg.ErrLevel, "kvwatch: bucket cannot be read", attrs...)
}

// publish has the sink publish what it applied, and returns its keys.
func (l *Loop) publish() int {
	n := l.sink.Publish()
	l.stats.Published(n)
	return n
}

// apply hands one entry to the sink unless it was applied before.
func (l *Loop) apply(e jetstream.KeyValueEntry, initial bool) {
	rev := e.Revision()
	// A full watch's initial values come one per key; later entries are
	// filtered by revision, so that a resumed watch never applies one twice.
	if !initial && rev <= l.lastRev {
		return
	}
	l.lastRev = max(l.lastRev, rev)
	if err := l.sink.Apply(e, l.cfg.Now()); err != nil {
		reason := "other"
		if re, ok := errors.AsType[*RecordError](err); ok {
			reason = re.Reason
		}
		l.stats.BadRecord(reason)
		l.badLog.Fail(err, "key", e.Key(), "revision", rev, "reason", reason)
	}
}

// markReady ends a run of failures and, the first time, closes readyCh.
func (l *Loop) markReady(keys int) {
	l.errLog.OK()
	l.readyOnce.Do(func() {
		l.cfg.Log.Info("kvwatch: bucket loaded", "keys", keys, "revision", l.lastRev)
		close(l.readyCh)
	})
}

// probe asks the server about the bucket and tells whether the watch must be
// replaced. A failed request makes the watch not live (its entries stop
// expiring) but keeps it: the reconnect signal, or the next probe that
// answers (EndRecovered), replaces it when the server is back.
func (l *Loop) probe(ctx context.Context, kv jetstream.KeyValue) End {
	pctx, cancel := context.WithTimeout(ctx, l.cfg.OpTimeout)
	st, err := kv.Status(pctx)
	cancel()
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrBucketNotFound):
		l.cfg.Log.Warn("kvwatch: bucket deleted, reopening it")
		return EndGone
	case err != nil:
		l.cfg.Log.Debug("kvwatch: probe failed", "err", err)
		l.probeFailed = true
		l.lost("the server did not answer about the bucket", err)
		return EndNone
	case l.probeFailed:
		l.cfg.Log.Debug("kvwatch: probe answered again, re-watching")
		return EndRecovered
	}
	created, lastSeq, known := watchStreamState(st)
	l.ttl = st.TTL()
	if !known {
		return EndNone
	}
	if !created.Equal(l.created) || lastSeq < l.lastRev {
		l.cfg.Log.Warn("kvwatch: bucket recreated, reloading it", "revision", l.lastRev, "last_seq", lastSeq)
		return EndRecreated
	}
	if l.synced && l.lag.stalled(lastSeq, l.lastRev) {
		l.cfg.Log.Warn("kvwatch: watcher behind the bucket without progress, re-watching",
			"revision", l.lastRev, "last_seq", lastSeq)
		return EndStalled
	}
	if l.synced && lastSeq <= l.lastRev {
		// Nothing to catch up with, even if the watch has not said so.
		l.current()
	}
	return EndNone
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
