package busylist

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/internal/retry"
)

// This file holds the KV watch loop that every watcher of the package
// shares: the Watcher (busy bucket), the Registry (workers bucket) and the
// ThresholdWatcher (thresholds bucket).
//
// The loop (watchLoop) runs on one goroutine. It opens the bucket (creating
// it when missing), watches every key and feeds the entries to a watchSink:
// the Watcher and the Registry apply them to a copy-on-write map and publish
// immutable snapshots through an atomic.Pointer, the ThresholdWatcher hands
// them to its OnChange callback. It re-watches:
//
//   - at once, resuming after the last revision seen, on every reconnect of
//     the NATS connection (a KV watcher otherwise stalls for 10–20 s after a
//     server restart), and when asked to (ThresholdWatcher.Rewatch);
//   - with capped, jittered backoff when the watcher's channel closes or the
//     bucket cannot be opened;
//   - from scratch (a full re-watch: the sink replaces its whole state when
//     the initial values are in) when a probe, or the opening of the next
//     watch, finds the bucket deleted, or deleted and recreated (another
//     stream creation time, or a last sequence below the last revision
//     seen);
//   - resuming, when a probe finds the stream ahead of the watcher on two
//     probes in a row without progress (a silent stall).
//
// Entries at or below the last revision seen are ignored, so overlapping
// re-watches never apply an entry twice or go back in time.

const (
	// watchHealthyAfter is how long a watch must have lasted for the retry.Backoff
	// to start again from its minimum.
	watchHealthyAfter = 10 * time.Second
	// watchBatchMax is the most queued entries applied before one publish.
	watchBatchMax = 256
	// watchSweepEvery is how often entries past the bucket's TTL are dropped
	// (bucket TTL expiries reach watchers only when the bucket has limit
	// markers).
	watchSweepEvery = time.Second
)

// watchSink receives a watched bucket's entries. Only the loop's goroutine
// calls it.
type watchSink interface {
	// watchReset begins a full sync: the entries up to the next
	// watchPublish are the bucket's whole content and replace everything the
	// sink had.
	watchReset()
	// watchApply applies one entry (put, delete or purge); now is the
	// loop's clock at receipt. A returned error means a bad record: the loop
	// logs it (rate-limited) and counts it, and the sink has already dealt
	// with the key.
	watchApply(e jetstream.KeyValueEntry, now time.Time) error
	// watchPublish ends a batch of entries that together form a complete
	// state: the loop calls it when a watch's initial values are in (which
	// ends a full sync) and after each later batch. It returns the number of
	// keys.
	watchPublish() int
}

// watchSweeper is a watchSink that drops entries on its own when the bucket
// has a TTL; the loop calls watchSweep every watchSweepEvery.
type watchSweeper interface {
	// watchSweep drops entries received more than ttl ago; a watchPublish
	// follows.
	watchSweep(now time.Time, ttl time.Duration)
}

// watchStats is where a loop counts what happens to its watch. Each owner
// maps it onto its own metrics.
type watchStats interface {
	// rewatched counts a watch that ended, and why (never watchEndStopped).
	rewatched(why watchEnd)
	// badRecord counts an entry the sink rejected.
	badRecord(reason string)
	// published reports the sink's keys after a publish; the first call
	// means the initial values are in.
	published(keys int)
}

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
	watchEndManual             // a re-watch was asked for: resume
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
	case watchEndManual:
		return "manual"
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

// watchLoopConfig is what a watchLoop needs besides its sink and stats.
type watchLoopConfig struct {
	js       jetstream.JetStream
	bucket   string
	replicas int // of the bucket when the loop creates it
	log      *slog.Logger
	// errLevel is the level failures to watch are logged at.
	errLevel slog.Level
	now      func() time.Time
	// opTimeout bounds every single request to the server: opening the
	// bucket, its status, each probe.
	opTimeout  time.Duration
	probeEvery time.Duration
	// retryMin and retryMax bound the backoff between failed watches.
	retryMin, retryMax time.Duration
}

// watchLoop watches one bucket for one sink; see the top of this file.
type watchLoop struct {
	watchLoopConfig // log carries the bucket
	sink            watchSink
	sweeper         watchSweeper // the sink, when it sweeps; else nil
	stats           watchStats
	sweepEvery      time.Duration

	rewatchCh chan struct{} // capacity 1: a re-watch was asked for
	readyCh   chan struct{} // closed when the initial values are in
	readyOnce sync.Once
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
	backoff retry.Backoff
	errLog  *retry.ErrLog
	badLog  *retry.ErrLog
}

func newWatchLoop(cfg watchLoopConfig, sink watchSink, stats watchStats) *watchLoop {
	cfg.log = cfg.log.With("bucket", cfg.bucket)
	sweeper, _ := sink.(watchSweeper)
	return &watchLoop{
		watchLoopConfig: cfg,
		sink:            sink,
		sweeper:         sweeper,
		stats:           stats,
		sweepEvery:      watchSweepEvery,
		rewatchCh:       make(chan struct{}, 1),
		readyCh:         make(chan struct{}),
		done:            make(chan struct{}),
		backoff:         retry.NewBackoff(cfg.retryMin, cfg.retryMax),
		errLog:          retry.NewErrLog(cfg.log, cfg.errLevel, "busylist: watch bucket"),
		badLog:          retry.NewErrLog(cfg.log, slog.LevelWarn, "busylist: decode records"),
	}
}

// start runs the loop on a goroutine of its own, until close.
func (l *watchLoop) start() {
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	go func() {
		defer close(l.done)
		l.run(ctx)
	}()
}

// close stops a loop begun with start and waits for it. It is idempotent.
func (l *watchLoop) close() {
	l.closeOnce.Do(l.cancel)
	<-l.done
}

// waitReady waits for the initial values of a loop begun with start.
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

// rewatch asks the loop to re-create its watch, resuming after the last
// revision seen. It never blocks.
func (l *watchLoop) rewatch() {
	select {
	case l.rewatchCh <- struct{}{}:
	default:
	}
}

// run watches until ctx is done.
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
			l.backoff.Reset()
		}
		l.stats.rewatched(end)
		switch end {
		case watchEndReconnect, watchEndManual, watchEndStalled, watchEndGone, watchEndRecreated:
			l.log.Debug("busylist: re-watching", "reason", end.String(), "revision", l.lastRev)
			continue
		}
		if err == nil {
			err = fmt.Errorf("busylist: watch of bucket %s ended: %s", l.bucket, end)
		}
		l.errLog.Fail(err, "revision", l.lastRev)
		if !l.sleep(ctx, status, l.backoff.Next()) {
			return
		}
	}
}

// sleep waits d, or less when the connection reconnects or a re-watch is
// asked for, and reports whether ctx is still live.
func (l *watchLoop) sleep(ctx context.Context, status <-chan nats.Status, d time.Duration) bool {
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
func (l *watchLoop) watchOnce(ctx context.Context, status <-chan nats.Status) (watchEnd, error) {
	octx, cancel := context.WithTimeout(ctx, l.opTimeout)
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
		l.sink.watchReset()
		l.synced, l.lastRev, l.created, l.lag = false, 0, created, watchLag{}
	} else {
		opts = append(opts, jetstream.ResumeFromRevision(l.lastRev+1))
	}
	l.lag.behind = false
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
		return watchEndError, fmt.Errorf("busylist: watch bucket %s: %w", l.bucket, err)
	}
	defer stopWatch(w, wcancel)

	probe := time.NewTicker(l.probeEvery)
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
			return watchEndStopped, nil
		case <-status:
			return watchEndReconnect, nil
		case <-l.rewatchCh:
			return watchEndManual, nil
		case e, ok := <-updates:
			for n := 0; ok; n++ {
				if e == nil {
					// The initial values are in: publish them, then say so.
					initial = false
					l.synced = true
					l.markReady(l.publish())
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
				return watchEndClosed, nil
			}
		case <-probe.C:
			if end := l.probe(ctx, kv); end != watchEndNone {
				return end, nil
			}
		case <-sweepC:
			if l.synced && l.ttl > 0 {
				l.sweeper.watchSweep(l.now(), l.ttl)
				l.publish()
			}
		}
	}
}

// publish has the sink publish what it applied, and returns its keys.
func (l *watchLoop) publish() int {
	n := l.sink.watchPublish()
	l.stats.published(n)
	return n
}

// apply hands one entry to the sink unless it was applied before.
func (l *watchLoop) apply(e jetstream.KeyValueEntry, initial bool) {
	rev := e.Revision()
	// A full watch's initial values come one per key; later entries are
	// filtered by revision, so that a resumed watch never applies one twice.
	if !initial && rev <= l.lastRev {
		return
	}
	l.lastRev = max(l.lastRev, rev)
	if err := l.sink.watchApply(e, l.now()); err != nil {
		reason := "other"
		if re, ok := errors.AsType[*watchRecordError](err); ok {
			reason = re.reason
		}
		l.stats.badRecord(reason)
		l.badLog.Fail(err, "key", e.Key(), "revision", rev, "reason", reason)
	}
}

// markReady ends a run of failures and, the first time, closes readyCh.
func (l *watchLoop) markReady(keys int) {
	l.errLog.OK()
	l.readyOnce.Do(func() {
		l.log.Info("busylist: bucket loaded", "keys", keys, "revision", l.lastRev)
		close(l.readyCh)
	})
}

// probe asks the server about the bucket and tells whether the watch must be
// replaced. A failed request is no reason: the reconnect signal, or a later
// probe, acts when the server is back.
func (l *watchLoop) probe(ctx context.Context, kv jetstream.KeyValue) watchEnd {
	pctx, cancel := context.WithTimeout(ctx, l.opTimeout)
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
