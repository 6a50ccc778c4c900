package busylist

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// This file holds what every loop that talks to NATS uses to retry: capped
// backoff, rate-limited error logs, cancellable sleeps and the stopping of a
// KV watch.

const (
	// errLogEvery is how often a loop that keeps failing, or a run of bad
	// records, logs.
	errLogEvery = 10 * time.Second
	// stopWatchDrainTimeout bounds the draining of a stopped watch's channel.
	stopWatchDrainTimeout = 2 * time.Second
)

// validateRetry checks a pair of backoff bounds.
func validateRetry(who string, lo, hi time.Duration) []error {
	var errs []error
	if lo <= 0 {
		errs = append(errs, fmt.Errorf("busylist: %s: retry minimum %v is not positive", who, lo))
	}
	if hi <= 0 {
		errs = append(errs, fmt.Errorf("busylist: %s: retry maximum %v is not positive", who, hi))
	}
	if lo > 0 && hi > 0 && lo > hi {
		errs = append(errs, fmt.Errorf("busylist: %s: retry minimum %v is above the maximum %v", who, lo, hi))
	}
	return errs
}

// backoff is a capped exponential backoff with ±20% jitter. It belongs to
// one goroutine.
type backoff struct {
	min, max, cur time.Duration
}

func newBackoff(lo, hi time.Duration) backoff {
	return backoff{min: lo, max: hi, cur: lo}
}

// next returns the delay before the next attempt and doubles the following
// one, up to max.
func (b *backoff) next() time.Duration {
	d := b.cur
	b.cur = min(2*b.cur, b.max)
	jitter := time.Duration(float64(d) * 0.4 * (rand.Float64() - 0.5))
	return max(d+jitter, time.Millisecond)
}

func (b *backoff) reset() { b.cur = b.min }

// errLog logs the failures of a retried operation at most every errLogEvery,
// with the count of those it kept quiet, and the end of a run of failures
// once. It belongs to one goroutine.
type errLog struct {
	log        *slog.Logger
	level      slog.Level
	what       string // "write busy-set records", "watch bucket", …
	failing    bool
	since      time.Time
	failures   int
	suppressed int
	lastLogged time.Time
}

func newErrLog(log *slog.Logger, level slog.Level, what string) *errLog {
	return &errLog{log: log, level: level, what: what}
}

// fail records a failure and logs it unless one was logged within
// errLogEvery.
func (l *errLog) fail(err error, attrs ...any) {
	now := time.Now()
	if !l.failing {
		// lastLogged is kept: an operation that keeps failing and recovering
		// still logs its failures at most every errLogEvery.
		l.failing, l.since, l.failures = true, now, 0
	}
	l.failures++
	if !l.lastLogged.IsZero() && now.Sub(l.lastLogged) < errLogEvery {
		l.suppressed++
		return
	}
	attrs = append(attrs, "err", err, "failures", l.failures, "suppressed", l.suppressed)
	l.log.Log(context.Background(), l.level, "busylist: cannot "+l.what, attrs...)
	l.lastLogged, l.suppressed = now, 0
}

// ok ends a run of failures, logging the recovery once.
func (l *errLog) ok() {
	if !l.failing {
		return
	}
	l.failing = false
	l.log.Info("busylist: "+l.what+" recovered", "failures", l.failures,
		"outage", time.Since(l.since).Round(time.Millisecond))
}

// sleepCtx waits d or until ctx is done, and reports whether ctx is still
// live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// stopWatch ends a KV watch by cancelling the context it was started with,
// then drains its channel until nats.go closes it, so that the
// subscription's delivery goroutine, which may be blocked on the full
// channel, can finish. The drain is bounded. (KeyWatcher.Stop is not
// called: it also deletes the consumer, a JetStream request that waits out
// its timeout while NATS is away; on a cancelled context nats.go does that
// on a goroutine of its own.)
func stopWatch(w jetstream.KeyWatcher, cancel context.CancelFunc) {
	cancel()
	if w == nil {
		return
	}
	t := time.NewTimer(stopWatchDrainTimeout)
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
