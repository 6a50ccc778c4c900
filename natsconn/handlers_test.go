package natsconn

import (
	"errors"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"github.com/nats-io/nats.go"
)

func TestReconnectFailuresRateLimited(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		logs := newCapture(slog.LevelDebug)
		h := newHandlers(logs.logger())
		const msg = "nats: connection attempt failed; retrying"
		refused := errors.New("connection refused")

		h.disconnected(nil, errors.New("EOF"))
		// One attempt a second for 100 s: logged at 0, 30, 60 and 90 s.
		for range 100 {
			h.reconnectFailed(nil, refused)
			time.Sleep(time.Second)
		}
		recs := logs.records(slog.LevelWarn, msg)
		if len(recs) != 4 {
			t.Fatalf("logged %d failures, want 4", len(recs))
		}
		if got := recs[3].Attrs["failed_attempts"]; got != "91" {
			t.Errorf("fourth log failed_attempts = %s, want 91", got)
		}
		if got := recs[3].Attrs["down_for"]; got != "1m30s" {
			t.Errorf("fourth log down_for = %s, want 1m30s", got)
		}

		h.reconnected(nil)
		rec := logs.records(slog.LevelInfo, "nats: reconnected")
		if len(rec) != 1 || rec[0].Attrs["failed_attempts"] != "100" || rec[0].Attrs["down_for"] != "1m40s" {
			t.Fatalf("reconnected logs = %v", rec)
		}

		// A new outage logs its first failure at once.
		h.reconnectFailed(nil, refused)
		if n := len(logs.records(slog.LevelWarn, msg)); n != 5 {
			t.Errorf("after a new outage: %d failure logs, want 5", n)
		}
	})
}

func TestAsyncErrorsRateLimited(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		logs := newCapture(slog.LevelDebug)
		h := newHandlers(logs.logger())
		const msg = "nats: asynchronous error"
		sub := &nats.Subscription{Subject: "workermon.load.>"}

		for range 10 {
			h.asyncError(nil, sub, nats.ErrSlowConsumer)
		}
		h.asyncError(nil, nil, nats.ErrPermissionViolation)
		if n := len(logs.records(slog.LevelError, msg)); n != 2 {
			t.Fatalf("logged %d async errors, want 2", n)
		}
		time.Sleep(ReconnectErrorLogInterval)
		h.asyncError(nil, nil, nats.ErrPermissionViolation)
		h.asyncError(nil, nil, nats.ErrPermissionViolation)
		time.Sleep(ReconnectErrorLogInterval)
		h.asyncError(nil, nil, nats.ErrPermissionViolation)
		recs := logs.records(slog.LevelError, msg)
		if len(recs) != 4 {
			t.Fatalf("logged %d async errors, want 4", len(recs))
		}
		if recs[0].Attrs["subject"] != "workermon.load.>" {
			t.Errorf("first log attrs = %v", recs[0].Attrs)
		}
		if recs[3].Attrs["repeats"] != "1" {
			t.Errorf("last log attrs = %v, want repeats=1", recs[3].Attrs)
		}
	})
}
