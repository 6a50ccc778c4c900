package busylist

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// writerErrLogEvery is how often a loop that keeps failing logs its error.
const writerErrLogEvery = 10 * time.Second

// writerBackoff is a capped exponential backoff with ±20% jitter. It belongs
// to one goroutine.
type writerBackoff struct {
	min, max, cur time.Duration
}

func newWriterBackoff(lo, hi time.Duration) writerBackoff {
	return writerBackoff{min: lo, max: hi, cur: lo}
}

// next returns the delay before the next attempt and doubles the following
// one, up to max.
func (b *writerBackoff) next() time.Duration {
	d := b.cur
	b.cur = min(2*b.cur, b.max)
	jitter := time.Duration(float64(d) * 0.4 * (rand.Float64() - 0.5))
	return max(d+jitter, time.Millisecond)
}

func (b *writerBackoff) reset() { b.cur = b.min }

// writerErrLog logs the errors of a retried operation at a limited rate and
// its recovery once. It belongs to one goroutine.
type writerErrLog struct {
	log        *slog.Logger
	what       string // "write busy-set records", "watch threshold overrides", …
	failing    bool
	since      time.Time
	failures   int
	lastLogged time.Time
	suppressed int
}

// fail records a failure and logs it unless one was logged within
// writerErrLogEvery.
func (l *writerErrLog) fail(err error, attrs ...any) {
	now := time.Now()
	if !l.failing {
		l.failing, l.since, l.failures, l.suppressed = true, now, 0, 0
		l.lastLogged = time.Time{}
	}
	l.failures++
	if !l.lastLogged.IsZero() && now.Sub(l.lastLogged) < writerErrLogEvery {
		l.suppressed++
		return
	}
	attrs = append(attrs, "err", err, "failures", l.failures, "suppressed", l.suppressed)
	l.log.Error("busylist: cannot "+l.what+", retrying", attrs...)
	l.lastLogged, l.suppressed = now, 0
}

// ok ends a run of failures, logging the recovery once.
func (l *writerErrLog) ok() {
	if !l.failing {
		return
	}
	l.log.Info("busylist: "+l.what+" recovered", "failures", l.failures,
		"outage", time.Since(l.since).Round(time.Millisecond))
	l.failing = false
}

// writerSleep waits d or until ctx is done, and reports whether ctx is still
// live.
func writerSleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// writerOpenBucket opens (creating if needed) a bucket, retrying with
// backoff and rate-limited error logs until it succeeds or ctx is done. Each
// attempt is bounded by timeout. It returns ctx's error when ctx ends first.
func writerOpenBucket(ctx context.Context, js jetstream.JetStream, bucket string, replicas int,
	timeout time.Duration, bo *writerBackoff, elog *writerErrLog, onErr func(error),
) (jetstream.KeyValue, error) {
	for {
		octx, cancel := context.WithTimeout(ctx, timeout)
		kv, err := OpenBucket(octx, js, bucket, replicas)
		cancel()
		if err == nil {
			elog.ok()
			return kv, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if onErr != nil {
			onErr(err)
		}
		elog.fail(err, "bucket", bucket)
		if !writerSleep(ctx, bo.next()) {
			return nil, ctx.Err()
		}
	}
}

// writerStopWatch ends a KV watch by cancelling the context it was started
// with, then drains its channel until nats.go closes it, so that the
// subscription's delivery goroutine, which may be blocked on the full
// channel, can finish. The drain is bounded. Cancelling rather than calling
// Stop leaves the consumer deletion, a JetStream request that waits its full
// timeout while NATS is away, to nats.go's own goroutine.
func writerStopWatch(w jetstream.KeyWatcher, cancel context.CancelFunc) {
	cancel()
	if w == nil {
		return
	}
	t := time.NewTimer(2 * time.Second)
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
