package monitor

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/slo"
)

func (h *harness) latency(r events.LatencyReport) {
	h.t.Helper()
	if r.SentAt == 0 {
		r.SentAt = time.Now().UnixNano()
	}
	if r.WindowMs == 0 {
		r.WindowMs = 1000
	}
	b, err := events.MarshalLatencyReport(&r)
	if err != nil {
		h.t.Fatal(err)
	}
	subject := events.LatSubject
	if events.IsRouterSource(r.Source) {
		subject = events.LatrSubject
	}
	h.raw(subject(events.DefaultSubjectPrefix, r.Model, r.WorkerID), b)
}

// TestLatencyWindowsMerge: per worker the routers' windows when any router
// reported for it, else the engine's, never both; a router's rejections
// count once per window whatever the number of workers; a drain starts new
// windows; a router window on an engine subject is rejected.
func TestLatencyWindowsMerge(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		sent := time.Now().UnixNano() // one window of each router: fresh (not older than --stale-after)
		itl := func(k uint8, n uint64) []events.LatencyBucket { return []events.LatencyBucket{{K: k, N: n}} }
		// Worker 1: engine and two routers; worker 2: engine only.
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 1, Source: events.SourceEngine, ITL: itl(10, 100)})
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/a", ITL: itl(20, 5), Rejected: 3, Queued: 1, SentAt: sent})
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/b", ITL: itl(20, 7), Rejected: 2, SentAt: sent})
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 2, Source: "router/a", Rejected: 3, Queued: 1, SentAt: sent})
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 3, Source: events.SourceEngine, TTFT: itl(40, 9)})
		ws, err := h.m.DrainLatency(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		w := ws[testModel]
		if w == nil {
			t.Fatal("no window")
		}
		if w.ITL[20] != 12 || w.ITL[10] != 0 || w.TTFT[40] != 9 {
			t.Errorf("ITL[20]=%d ITL[10]=%d TTFT[40]=%d, want 12, 0 (the engine's hidden by the routers'), 9",
				w.ITL[20], w.ITL[10], w.TTFT[40])
		}
		if w.Rejected != 5 || w.Queued != 1 {
			t.Errorf("rejected %d queued %d, want 5 and 1", w.Rejected, w.Queued)
		}
		ws, _ = h.m.DrainLatency(context.Background())
		if len(ws) != 0 {
			t.Errorf("second drain: %v, want nothing", ws)
		}
		// A router's window on the engine's subject.
		r := events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/a", WindowMs: 1000, SentAt: time.Now().UnixNano()}
		b, _ := events.MarshalLatencyReport(&r)
		h.raw(events.LatSubject(events.DefaultSubjectPrefix, testModel, 1), b)
		if got := h.rejected("source_not_allowed"); got != 1 {
			t.Errorf("source_not_allowed = %v, want 1", got)
		}
		if got := testutil.ToFloat64(h.m.metrics.accepted.WithLabelValues("latency")); got != 5 {
			t.Errorf("accepted latency = %v, want 5", got)
		}
	})
}

// TestLatencyRouterSourcesCapped: a router window past the cap of router
// sources per model is rejected whole — its samples and rejections count
// nowhere (its samples reached the controller before).
func TestLatencyRouterSourcesCapped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		sent := time.Now().UnixNano()
		for i := range maxLatencySources { // one router source per worker
			h.latency(events.LatencyReport{Model: testModel, WorkerID: uint64(i + 1), Source: fmt.Sprintf("router/r%d", i),
				ITL: []events.LatencyBucket{{K: 10, N: 1}}, SentAt: sent})
		}
		h.latency(events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/one-too-many",
			ITL: []events.LatencyBucket{{K: 90, N: 1000}}, Rejected: 50, SentAt: sent})
		if got := h.rejected(rejectSources); got != 1 {
			t.Errorf("%s = %v, want 1", rejectSources, got)
		}
		ws, err := h.m.DrainLatency(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		w := ws[testModel]
		if w == nil || w.ITL[10] != maxLatencySources || w.ITL[90] != 0 || w.Rejected != 0 {
			t.Fatalf("window %+v: want %d samples in bucket 10 and nothing of the rejected report", w, maxLatencySources)
		}
	})
}

// TestControlledThresholds: controlled thresholds replace the defaults and
// the override at once (frac off), and dropping them brings the override
// back.
func TestControlledThresholds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) {
			c.Defaults.ActivePrefillTokensFrac = events.Ptr(0.5)
		})
		ctx := context.Background()
		h.send(h.report(1, 0, 50, 100))
		h.expect(nil, []uint64{1}, nil)
		if err := h.m.SetOverride(ctx, testModel, &events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.7)}); err != nil {
			t.Fatal(err)
		}
		if err := h.m.SetControlled(ctx, testModel, &slo.Thresholds{Decode: 0.4, Prefill: 2048}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		rec := h.expect([]uint64{1}, nil, nil)
		if *rec.Thresholds.ActiveDecodeBlocks != 0.4 || *rec.Thresholds.ActivePrefillTokens != 2048 || rec.Thresholds.ActivePrefillTokensFrac != nil {
			t.Fatalf("controlled thresholds in the record: %+v", rec.Thresholds)
		}
		base, err := h.m.BaseThresholds(ctx, testModel)
		if err != nil || *base.ActiveDecodeBlocks != 0.7 {
			t.Fatalf("BaseThresholds = %+v, %v", base, err)
		}
		if err := h.m.SetControlled(ctx, testModel, nil); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		rec = h.expect(nil, []uint64{1}, nil)
		if *rec.Thresholds.ActiveDecodeBlocks != 0.7 || rec.Thresholds.ActivePrefillTokensFrac == nil {
			t.Fatalf("override not back: %+v", rec.Thresholds)
		}
		if err := h.m.SetControlled(ctx, testModel, &slo.Thresholds{Decode: 2}); err == nil {
			t.Fatal("out-of-range controlled threshold accepted")
		}
	})
}

// mallocs returns the heap allocations of one call of f. The count is the
// whole process's, so f runs on a single P, as testing.AllocsPerRun does
// (which cannot measure one call: it warms up with a first one): another
// goroutine (a timer of an earlier test, the runtime's own) cannot run and
// allocate while f, which does not block, runs.
func mallocs(f func()) uint64 {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	var a, b runtime.MemStats
	runtime.ReadMemStats(&a)
	f()
	runtime.ReadMemStats(&b)
	return b.Mallocs - a.Mallocs
}

// TestLatencyApplyNoAllocAfterDrain: a latency window of a (model, worker,
// source) heard in the previous interval allocates nothing, a drain
// notwithstanding (the windows are reset in place); one not heard for a
// whole interval is forgotten.
func TestLatencyApplyNoAllocAfterDrain(t *testing.T) { // not parallel: counts allocations
	cfg := DefaultConfig()
	s := newState(cfg, nil, nil, nil)
	now := time.Unix(1000, 0)
	r := events.LatencyReport{Model: testModel, WorkerID: 1, Source: "router/a", WindowMs: 1000, SentAt: now.UnixNano(),
		ITL: []events.LatencyBucket{{K: 20, N: 3}}, Rejected: 1}
	if reason := s.applyLatency(&r, now); reason != "" {
		t.Fatal(reason)
	}
	for i := range 3 {
		if ws := s.drainAllLatency(); ws[testModel] == nil || ws[testModel].ITL[20] != 3 || ws[testModel].Rejected != 1 {
			t.Fatalf("drain %d: %+v, want the window of one report", i, ws[testModel])
		}
		r.SentAt++
		if n := mallocs(func() { s.applyLatency(&r, now) }); n != 0 {
			t.Errorf("after drain %d: %d allocs, want 0", i, n)
		}
	}
	s.drainAllLatency()
	if ws := s.drainAllLatency(); len(ws) != 0 || len(s.lat) != 0 || s.latEntries != 0 {
		t.Errorf("after an interval without reports: %v, %d models, %d entries; want none", ws, len(s.lat), s.latEntries)
	}
}
