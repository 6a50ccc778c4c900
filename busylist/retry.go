package busylist

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// This file holds what the package's loops use beside internal/retry:
// checked backoff bounds, cancellable sleeps and the stopping of a KV watch.

// stopWatchDrainTimeout bounds the draining of a stopped watch's channel.
const stopWatchDrainTimeout = 2 * time.Second

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
