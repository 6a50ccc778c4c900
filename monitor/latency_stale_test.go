package monitor

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/workermon/workermon/events"
)

// TestLatencyStaleWindowDropped: a window sent more than --stale-after ago
// (a router's NATS connection buffered it while disconnected, and the
// reconnect delivered the burst) is dropped whole, its samples and its
// rejections, and counted as stale_window; one sent just within
// --stale-after counts.
func TestLatencyStaleWindowDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		now := time.Now()
		itl := []events.LatencyBucket{{K: 20, N: 50}}
		old := now.Add(-DefaultStaleAfter - time.Second).UnixNano()
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/a", ITL: itl, Rejected: 40, Queued: 7, SentAt: old})
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 2, Source: events.SourceEngine, ITL: itl, SentAt: old})
		if got := h.rejected("stale_window"); got != 2 {
			t.Errorf("stale_window = %v, want 2", got)
		}
		fresh := now.Add(-DefaultStaleAfter + time.Second).UnixNano()
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/a", ITL: itl, Rejected: 3, SentAt: fresh})
		ws, err := h.m.DrainLatency(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		w := ws[testModel]
		if w == nil {
			t.Fatal("no window")
		}
		if w.ITL.Total() != 50 || w.Rejected != 3 || w.Queued != 0 {
			t.Errorf("window of %d ITL samples, %d rejected, %d queued; want the fresh one's 50, 3, 0",
				w.ITL.Total(), w.Rejected, w.Queued)
		}
	})
}
