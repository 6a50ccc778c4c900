// Package retry holds what every workermon loop that talks to NATS uses
// when an operation fails: a capped exponential backoff, and an error log
// that says a failure at most every so often and its recovery once.
package retry

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"
)

// LogEvery is how often an operation that keeps failing is logged.
const LogEvery = 10 * time.Second

// Backoff is a capped exponential backoff with ±20% jitter. It belongs to
// one goroutine.
type Backoff struct {
	min, max, cur time.Duration
}

// NewBackoff returns a backoff from lo doubling up to hi.
func NewBackoff(lo, hi time.Duration) Backoff {
	return Backoff{min: lo, max: hi, cur: lo}
}

// Next returns the delay before the next attempt and doubles the following
// one, up to the maximum.
func (b *Backoff) Next() time.Duration {
	d := b.cur
	b.cur = min(2*b.cur, b.max)
	jitter := time.Duration(float64(d) * 0.4 * (rand.Float64() - 0.5))
	return max(d+jitter, time.Millisecond)
}

// Reset starts again from the minimum, after a success.
func (b *Backoff) Reset() { b.cur = b.min }

// ErrLog logs the failures of a retried operation at most every LogEvery,
// with the count of those it kept quiet, and the end of a run of failures
// once. An operation that keeps failing and recovering still logs its
// failures at most every LogEvery. It belongs to one goroutine.
type ErrLog struct {
	log        *slog.Logger
	level      slog.Level
	what       string // "busylist: write busy-set records", …
	now        func() time.Time
	failing    bool
	since      time.Time
	failures   int
	suppressed int
	lastLogged time.Time
}

// NewErrLog returns a log of failures of what, logged at level.
func NewErrLog(log *slog.Logger, level slog.Level, what string) *ErrLog {
	return &ErrLog{log: log, level: level, what: what, now: time.Now}
}

// Fail records a failure and logs it unless one was logged within LogEvery.
func (l *ErrLog) Fail(err error, attrs ...any) {
	now := l.now()
	if !l.failing {
		l.failing, l.since, l.failures = true, now, 0
	}
	l.failures++
	if !l.lastLogged.IsZero() && now.Sub(l.lastLogged) < LogEvery {
		l.suppressed++
		return
	}
	attrs = append(attrs, "err", err, "failures", l.failures, "suppressed", l.suppressed)
	l.log.Log(context.Background(), l.level, l.what+" failed", attrs...)
	l.lastLogged, l.suppressed = now, 0
}

// OK ends a run of failures, logging the recovery once.
func (l *ErrLog) OK() {
	if !l.failing {
		return
	}
	l.failing = false
	l.log.Info(l.what+" recovered", "failures", l.failures, "outage", l.now().Sub(l.since).Round(time.Millisecond))
}

// Result is Fail for an error and OK for nil.
func (l *ErrLog) Result(err error, attrs ...any) {
	if err != nil {
		l.Fail(err, attrs...)
		return
	}
	l.OK()
}

// CheckBounds checks a pair of backoff bounds; who names the configuration
// in the messages.
func CheckBounds(who string, lo, hi time.Duration) []error {
	var errs []error
	if lo <= 0 {
		errs = append(errs, fmt.Errorf("%s: retry minimum %v is not positive", who, lo))
	}
	if hi <= 0 {
		errs = append(errs, fmt.Errorf("%s: retry maximum %v is not positive", who, hi))
	}
	if lo > 0 && hi > 0 && lo > hi {
		errs = append(errs, fmt.Errorf("%s: retry minimum %v is above the maximum %v", who, lo, hi))
	}
	return errs
}

// Sleep waits d or until ctx is done, and reports whether ctx is still live.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
