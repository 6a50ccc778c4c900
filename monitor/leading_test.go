package monitor

import (
	"context"
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/events"
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

func TestRateWindow(t *testing.T) {
	t.Parallel()
	const window = 5 * time.Second
	var rw rateWindow
	if _, ok := rw.rate(window); ok {
		t.Fatal("an empty window has a rate")
	}
	for range 10 {
		rw.add(time.Second, 1000, window)
	}
	if r, ok := rw.rate(window); !ok || !near(r, 1000) {
		t.Fatalf("rate = %v, %v; want 1000", r, ok)
	}
	// Only the last window counts.
	for range 5 {
		rw.add(time.Second, 2000, window)
	}
	if r, _ := rw.rate(window); !near(r, 2000) {
		t.Fatalf("rate after the window moved = %v, want 2000", r)
	}
	// The oldest span counts in proportion to its part inside the window:
	// 4 s with 1000 then 2 s with 4000 over 5 s: 3/4 of 1000 + 4000.
	rw.reset()
	rw.add(4*time.Second, 1000, window)
	rw.add(2*time.Second, 4000, window)
	if r, _ := rw.rate(window); !near(r, 4750.0/5) {
		t.Fatalf("rate = %v, want %v", r, 4750.0/5)
	}
	// Less time than the window: over the time there is.
	rw.reset()
	rw.add(500*time.Millisecond, 100, window)
	if r, _ := rw.rate(window); !near(r, 200) {
		t.Fatalf("rate over half a second = %v, want 200", r)
	}
	// Frequent samples stay a bounded number of spans.
	rw.reset()
	for range 100_000 {
		rw.add(time.Millisecond, 1, window)
	}
	if n := len(rw.spans); n > rateSpans+2 {
		t.Fatalf("%d spans kept, want at most %d", n, rateSpans+2)
	}
	if r, _ := rw.rate(window); !near(r, 1000) {
		t.Fatalf("rate of 1 per ms = %v, want 1000", r)
	}
	// A span of no time adds its increase.
	rw.reset()
	rw.add(time.Second, 100, window)
	rw.add(0, 100, window)
	if r, _ := rw.rate(window); !near(r, 200) {
		t.Fatalf("rate = %v, want 200", r)
	}
}

// TestRankLeading: the prefill rate counts only the time in which prefill
// tokens were active, however long ago; it is unknown until a token is
// measured; a gap longer than maxGap counts for nothing; the queue delay is
// active ÷ rate.
func TestRankLeading(t *testing.T) {
	t.Parallel()
	const window, maxGap = 5 * time.Second, 10 * time.Second
	t0 := time.Unix(1_000_000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	smp := func(prefilled, preempt, active uint64) leadingSample {
		return leadingSample{prefilled: events.Some(prefilled), preemptions: events.Some(preempt), activePrefill: active}
	}
	var d rankLeading
	d.observe(at(0), smp(0, 0, 0), window, maxGap)
	if _, ok := d.prefillRate(window); ok {
		t.Fatal("rate known after one sample")
	}
	// Idle: time passes, nothing active: still unknown.
	d.observe(at(time.Second), smp(0, 0, 0), window, maxGap)
	if _, ok := d.queueDelay(0, window); ok {
		t.Fatal("rate known after idle time")
	}
	// Active but nothing computed yet: still unknown (nothing measured).
	d.observe(at(2*time.Second), smp(0, 0, 4000), window, maxGap)
	d.observe(at(2500*time.Millisecond), smp(0, 0, 4000), window, maxGap)
	if _, ok := d.prefillRate(window); ok {
		t.Fatal("rate known before a prefilled token")
	}
	// 0.5 s more active with 2000 tokens: 2000 over 1 s of active time.
	d.observe(at(3*time.Second), smp(2000, 0, 2000), window, maxGap)
	if r, ok := d.prefillRate(window); !ok || !near(r, 2000) {
		t.Fatalf("rate = %v, %v; want 2000", r, ok)
	}
	if ms, ok := d.queueDelay(2000, window); !ok || !near(ms, 1000) {
		t.Fatalf("queue delay = %v, %v; want 1000 ms", ms, ok)
	}
	// The work ends; an hour idle (heartbeats every second, nothing
	// active) keeps the rate.
	d.observe(at(4*time.Second), smp(4000, 0, 0), window, maxGap)
	for s := 5; s < 3600; s++ {
		d.observe(at(time.Duration(s)*time.Second), smp(4000, 0, 0), window, maxGap)
	}
	if r, ok := d.prefillRate(window); !ok || !near(r, 4000.0/2) {
		t.Fatalf("rate after an idle hour = %v, %v; want 2000", r, ok)
	}
	// Tokens computed while the held value said idle are not counted.
	d.observe(at(3600*time.Second), smp(9000, 0, 0), window, maxGap)
	if r, _ := d.prefillRate(window); !near(r, 2000) {
		t.Fatalf("rate = %v, want 2000", r)
	}
	// A gap longer than maxGap (the rank was stale) counts for nothing.
	d.observe(at(3601*time.Second), smp(9000, 0, 100), window, maxGap)
	d.observe(at(3700*time.Second), smp(100_000, 0, 100), window, maxGap)
	if r, _ := d.prefillRate(window); !near(r, 2000) {
		t.Fatalf("rate after a gap = %v, want 2000", r)
	}
	// Newer active time replaces older: 10 s at 500 tokens/s.
	for s := 3701; s <= 3710; s++ {
		d.observe(at(time.Duration(s)*time.Second), smp(100_000+uint64(s-3700)*500, 0, 100), window, maxGap)
	}
	if r, _ := d.prefillRate(window); !near(r, 500) {
		t.Fatalf("rate = %v, want 500", r)
	}
	if ms, _ := d.queueDelay(100, window); !near(ms, 200) {
		t.Fatalf("queue delay = %v, want 200 ms", ms)
	}

	// Preemptions: per second over the last window of all time.
	var p rankLeading
	if _, ok := p.preemptionRate(window); ok {
		t.Fatal("preemption rate known before any sample")
	}
	for s := range 11 {
		p.observe(at(time.Duration(s)*time.Second), smp(0, uint64(s)*3, 0), window, maxGap)
	}
	if r, ok := p.preemptionRate(window); !ok || !near(r, 3) {
		t.Fatalf("preemption rate = %v, %v; want 3", r, ok)
	}
	for s := 11; s < 20; s++ {
		p.observe(at(time.Duration(s)*time.Second), smp(0, 30, 0), window, maxGap)
	}
	if r, _ := p.preemptionRate(window); r != 0 {
		t.Fatalf("preemption rate after quiet = %v, want 0", r)
	}
}

func TestRankSaturation(t *testing.T) {
	t.Parallel()
	all := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5), ActivePrefillTokens: events.Ptr[uint64](1000),
		ActivePrefillTokensFrac: events.Ptr(0.5), KVCommitted: events.Ptr(2.0), QueueDelayMs: events.Ptr[uint64](500)}
	tests := []struct {
		name string
		t    events.Thresholds
		l    RankLoad
		want float64
	}{
		{"no thresholds", events.Thresholds{}, RankLoad{ActiveDecodeBlocks: 100, KVTotalBlocks: 100}, 0},
		{"decode", all, RankLoad{ActiveDecodeBlocks: 25, KVTotalBlocks: 100}, 0.5},
		{"decode without total: prefill", all, RankLoad{ActiveDecodeBlocks: 25, ActivePrefillTokens: 100}, 0.1},
		{"frac with capacity", all, RankLoad{ActivePrefillTokens: 300, MaxNumBatchedTokens: 1000}, 0.6},
		{"committed", all, RankLoad{KVTotalBlocks: 100, KVCommittedBlocks: 300}, 1.5},
		{"committed without total", all, RankLoad{KVCommittedBlocks: 300}, 0},
		{"delay known", all, RankLoad{QueueDelayMs: 750, QueueDelayKnown: true}, 1.5},
		{"delay unknown", all, RankLoad{QueueDelayMs: 750}, 0},
		{"capped at 4", all, RankLoad{KVTotalBlocks: 100, KVCommittedBlocks: 10_000}, 4},
		{"limit 0, value 0", events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](0)}, RankLoad{}, 0},
		{"limit 0, value 1", events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](0)}, RankLoad{ActivePrefillTokens: 1}, 4},
		{"frac truncates to 0", events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.0001)}, RankLoad{ActivePrefillTokens: 1, MaxNumBatchedTokens: 10}, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := RankSaturation(tt.t, tt.l); !near(got, tt.want) {
				t.Fatalf("RankSaturation = %v, want %v", got, tt.want)
			}
		})
	}
}

// loadsOf returns the rows of worker id of testModel, by rank.
func (h *harness) loadsOf(id uint64) map[uint32]LoadRow {
	h.t.Helper()
	rows, err := h.m.Loads(context.Background(), testModel)
	if err != nil {
		h.t.Fatal(err)
	}
	out := map[uint32]LoadRow{}
	for _, r := range rows {
		if r.WorkerID == id {
			out[r.DPRank] = r
		}
	}
	return out
}

// leadingReport is an engine report of the §21 fields.
func (h *harness) leadingReport(worker, boot, prefilled, active, preempt uint64) events.LoadReport {
	r := h.report(worker, 0, 10, 100)
	r.BootID = boot
	r.PrefilledTokens, r.ActivePrefillTokens, r.Preemptions = events.Some(prefilled), events.Some(active), events.Some(preempt)
	r.WaitingRequests, r.RunningRequests = events.Some(2), events.Some(5)
	return r
}

// TestLeadingValuesFromReports: the monitor derives the prefill rate, the
// queue delay and the preemption rate of a rank from its engine's reports
// on its own clock; a counter that goes down within a boot is dropped from
// that report and counted while the rest applies; a new boot makes the
// rate unknown again; a router's counters are not taken, its committed
// blocks are summed with other routers' and max'd with the engine's.
func TestLeadingValuesFromReports(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.leadingReport(1, 1, 0, 0, 0))
		if row := h.loadsOf(1)[0]; row.PrefillRate != nil || row.QueueDelayMs != nil {
			t.Fatalf("rate %v delay %v before any measure", row.PrefillRate, row.QueueDelayMs)
		}
		// 4000 tokens active; 500 computed every 100 ms: 5000 tokens/s.
		var prefilled uint64
		for range 20 {
			h.send(h.leadingReport(1, 1, prefilled, 4000, 7))
			time.Sleep(100 * time.Millisecond)
			prefilled += 500
		}
		h.send(h.leadingReport(1, 1, prefilled, 4000, 9))
		row := h.loadsOf(1)[0]
		if row.PrefillRate == nil || !near(*row.PrefillRate, 5000) {
			t.Fatalf("prefill rate %v, want 5000", fmtF(row.PrefillRate))
		}
		if row.QueueDelayMs == nil || !near(*row.QueueDelayMs, 800) {
			t.Fatalf("queue delay %v, want 800 ms", fmtF(row.QueueDelayMs))
		}
		if row.PreemptionRate == nil || !near(*row.PreemptionRate, 9.0/2) {
			t.Fatalf("preemption rate %v, want 4.5/s (9 over the 2 s measured)", fmtF(row.PreemptionRate))
		}
		if *row.WaitingRequests != 2 || *row.RunningRequests != 5 || *row.Preemptions != 9 || *row.PrefilledTokens != prefilled {
			t.Fatalf("row %+v", row)
		}

		// A counter that goes down within the boot: dropped and counted;
		// the rest of the report (the decode blocks) applies.
		down := h.leadingReport(1, 1, prefilled-1, 4000, 9)
		down.ActiveDecodeBlocks = events.Some(77)
		h.send(down)
		row = h.loadsOf(1)[0]
		if *row.PrefilledTokens != prefilled || row.ActiveDecodeBlocks != 77 {
			t.Fatalf("after a decrease: prefilled %d (want %d kept), decode %d (want 77)", *row.PrefilledTokens, prefilled, row.ActiveDecodeBlocks)
		}
		if got := testutil.ToFloat64(h.m.metrics.counterDecreases[sigPrefilled]); got != 1 {
			t.Fatalf("counter decreases = %v, want 1", got)
		}
		if got := testutil.ToFloat64(h.m.metrics.counterDecreases[sigPreemptions]); got != 0 {
			t.Fatalf("preemptions decreases = %v, want 0", got)
		}

		// A new boot: the counters start again, and the rate is unknown.
		time.Sleep(100 * time.Millisecond)
		h.send(h.leadingReport(1, 2, 10, 4000, 0))
		row = h.loadsOf(1)[0]
		if row.PrefillRate != nil || row.QueueDelayMs != nil || row.PreemptionRate != nil {
			t.Fatalf("after a new boot: rate %v delay %v preemptions %v, want unknown",
				fmtF(row.PrefillRate), fmtF(row.QueueDelayMs), fmtF(row.PreemptionRate))
		}
		if got := testutil.ToFloat64(h.m.metrics.counterDecreases[sigPrefilled]); got != 1 {
			t.Fatalf("a new boot counted as a decrease: %v", got)
		}

		// Routers: their counters and request counts are not taken;
		// their committed blocks sum, max'd with the engine's.
		eng := h.leadingReport(1, 2, 10, 4000, 0)
		eng.KVCommittedBlocks = events.Some(100)
		h.send(eng)
		for i, src := range []string{"router/a", "router/b"} {
			r := h.report(1, 0, 0, 100)
			r.Source, r.BootID = src, uint64(10+i)
			r.KVCommittedBlocks, r.Preemptions, r.WaitingRequests = events.Some(70), events.Some(1000), events.Some(99)
			h.send(r)
		}
		row = h.loadsOf(1)[0]
		if row.KVCommittedBlocks == nil || *row.KVCommittedBlocks != 140 || *row.Preemptions != 0 || *row.WaitingRequests != 2 {
			t.Fatalf("merged: committed %v preemptions %d waiting %d; want 140, 0, 2", row.KVCommittedBlocks, *row.Preemptions, *row.WaitingRequests)
		}
		if src := row.Sources["router/a"]; src.Preemptions != nil || src.KVCommittedBlocks == nil {
			t.Fatalf("router/a's state %+v: want committed kept, preemptions not", src)
		}
	})
}

func fmtF(p *float64) any {
	if p == nil {
		return "null"
	}
	return *p
}

// TestLeadingThresholdsInRecord: kv_committed and queue_delay make workers
// busy from reports (contract §21), with their reasons joined in order; no
// queue-delay check while the prefill rate is unknown; the record carries
// both thresholds.
func TestLeadingThresholdsInRecord(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) {
			c.Defaults = events.Thresholds{KVCommitted: events.Ptr(1.0), QueueDelayMs: events.Ptr[uint64](500)}
		})
		// Worker 1: 4000 tokens waiting, never measured: huge load, no
		// rate, not busy. Worker 2: committed 101 of 100 blocks.
		h.send(h.leadingReport(1, 1, 0, 4000, 0))
		r := h.report(2, 0, 10, 100)
		r.KVCommittedBlocks = events.Some(101)
		h.send(r)
		rec := h.expect([]uint64{2}, []uint64{1}, nil)
		if rec.Reasons["2"] != "kv_committed" {
			t.Fatalf("reasons %v, want kv_committed for 2", rec.Reasons)
		}
		if !rec.Thresholds.Equal(events.Thresholds{KVCommitted: events.Ptr(1.0), QueueDelayMs: events.Ptr[uint64](500)}) {
			t.Fatalf("record thresholds %+v", rec.Thresholds)
		}
		// Worker 1 prefills 500 tokens every 100 ms: 5000 tokens/s, so
		// 4000 tokens are 800 ms: busy for queue_delay.
		var prefilled uint64
		for range 10 {
			time.Sleep(100 * time.Millisecond)
			prefilled += 500
			h.send(h.leadingReport(1, 1, prefilled, 4000, 0))
		}
		rec = h.expect([]uint64{1, 2}, nil, nil)
		if rec.Reasons["1"] != "queue_delay" {
			t.Fatalf("reasons %v, want queue_delay for 1", rec.Reasons)
		}
		// Both checks on one worker: joined in the contract's order.
		both := h.leadingReport(1, 1, prefilled, 4000, 0)
		both.KVCommittedBlocks = events.Some(500)
		h.send(both)
		if rec = h.expect([]uint64{1, 2}, nil, nil); rec.Reasons["1"] != "kv_committed+queue_delay" {
			t.Fatalf("reasons %v, want kv_committed+queue_delay for 1", rec.Reasons)
		}
		// 2000 tokens at 5000/s are 400 ms: free (the rate is kept).
		free := h.leadingReport(1, 1, prefilled, 2000, 0)
		free.KVCommittedBlocks = events.Some(0)
		h.send(free)
		h.expect([]uint64{2}, []uint64{1}, nil)
	})
}
