package monitor

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/resched"
)

// fakeSink remembers the last record of each model and every call.
type fakeSink struct {
	mu      sync.Mutex
	records map[string]events.BusySet
	sets    int
	deletes []string
}

var _ Sink = (*fakeSink)(nil)

func newFakeSink() *fakeSink { return &fakeSink{records: map[string]events.BusySet{}} }

func (f *fakeSink) Set(b events.BusySet) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.records[b.Model] = b
	f.sets++
}

func (f *fakeSink) Delete(model string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.records, model)
	f.deletes = append(f.deletes, model)
}

func (f *fakeSink) record(model string) (events.BusySet, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, ok := f.records[model]
	return b, ok
}

func (f *fakeSink) setCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sets
}

const testModel = "Qwen/Qwen3-0.6B"

// harness runs a Monitor inside a synctest bubble.
type harness struct {
	t    *testing.T
	m    *Monitor
	sink *fakeSink
	reg  *prometheus.Registry
	seq  uint64
}

func startHarness(t *testing.T, mutate func(*Config)) *harness {
	t.Helper()
	sink := newFakeSink()
	return startHarnessOn(t, sink, sink, mutate)
}

// startHarnessOn is startHarness writing to sink, whose records fake
// keeps.
func startHarnessOn(t *testing.T, sink Sink, fake *fakeSink, mutate func(*Config)) *harness {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](1000)}
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	if mutate != nil {
		mutate(&cfg)
	}
	m, err := New(cfg, sink)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = m.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return &harness{t: t, m: m, sink: fake, reg: reg}
}

// report builds a valid report of testModel; the caller adjusts it.
func (h *harness) report(worker uint64, rank uint32, decode, total uint64) events.LoadReport {
	h.seq++
	return events.LoadReport{
		Model: testModel, WorkerID: worker, DPRank: rank, DPSize: 1, Source: events.SourceEngine,
		ActiveDecodeBlocks: events.Some(decode), KVTotalBlocks: events.Some(total),
		BootID: 1, Seq: h.seq, SentAt: time.Now().UnixNano(),
	}
}

func (h *harness) send(r events.LoadReport) {
	h.t.Helper()
	b, err := events.MarshalLoadReport(&r)
	if err != nil {
		h.t.Fatal(err)
	}
	subject := events.LoadSubject
	if events.IsRouterSource(r.Source) {
		subject = events.EstSubject // routers speak only on est subjects (contract §11)
	}
	h.m.Submit(subject(events.DefaultSubjectPrefix, r.Model, r.WorkerID, r.DPRank), b)
	synctest.Wait()
}

func (h *harness) bye(g events.Goodbye) {
	h.t.Helper()
	b, err := events.MarshalGoodbye(&g)
	if err != nil {
		h.t.Fatal(err)
	}
	subject := events.ByeSubject
	if events.IsRouterSource(g.Source) {
		subject = events.EstByeSubject
	}
	h.m.Submit(subject(events.DefaultSubjectPrefix, g.Model, g.WorkerID), b)
	synctest.Wait()
}

func (h *harness) raw(subject string, data []byte) {
	h.m.Submit(subject, data)
	synctest.Wait()
}

// expect checks the lists of the model's record.
func (h *harness) expect(busy, free, stale []uint64) events.BusySet {
	h.t.Helper()
	rec, ok := h.sink.record(testModel)
	if !ok {
		h.t.Fatalf("no record for %s", testModel)
	}
	norm := func(s []uint64) []uint64 {
		if s == nil {
			return []uint64{}
		}
		return s
	}
	if !slices.Equal(norm(rec.Busy), norm(busy)) || !slices.Equal(norm(rec.Free), norm(free)) ||
		!slices.Equal(norm(rec.Stale), norm(stale)) {
		h.t.Fatalf("record busy=%v free=%v stale=%v, want busy=%v free=%v stale=%v",
			rec.Busy, rec.Free, rec.Stale, busy, free, stale)
	}
	if want := len(free) == 0 && len(busy) > 0; rec.AllBusy != want {
		h.t.Fatalf("all_busy = %v, want %v", rec.AllBusy, want)
	}
	return rec
}

func (h *harness) rejected(reason string) float64 {
	return testutil.ToFloat64(h.m.metrics.rejected.WithLabelValues(reason))
}

func TestBusySetFollowsReports(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(3, 0, 10, 100))
		h.send(h.report(1, 0, 10, 100))
		h.expect(nil, []uint64{1, 3}, nil)

		h.send(h.report(3, 0, 81, 100))
		rec := h.expect([]uint64{3}, []uint64{1}, nil)
		if rec.Reasons["3"] != "kv" || len(rec.Reasons) != 1 {
			t.Fatalf("reasons = %v", rec.Reasons)
		}
		if rec.Thresholds.ActiveDecodeBlocks == nil || *rec.Thresholds.ActiveDecodeBlocks != 0.8 {
			t.Fatalf("thresholds in force not in record: %+v", rec.Thresholds)
		}

		r := h.report(1, 0, 10, 100)
		r.ActivePrefillTokens = events.Some(1001)
		h.send(r)
		rec = h.expect([]uint64{1, 3}, nil, nil)
		if rec.Reasons["1"] != "prefill" {
			t.Fatalf("reasons = %v", rec.Reasons)
		}

		// An absent field keeps its value: decode stays 10 of 100, prefill drops.
		r = h.report(1, 0, 0, 0)
		r.ActiveDecodeBlocks, r.KVTotalBlocks, r.ActivePrefillTokens = events.Optional{}, events.Optional{}, events.Some(0)
		h.send(r)
		h.expect([]uint64{3}, []uint64{1}, nil)
	})
}

func TestUnchangedReportsDoNotRewrite(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100))
		n := h.sink.setCount()
		for range 10 {
			h.send(h.report(1, 0, 20, 100))
		}
		if got := h.sink.setCount(); got != n {
			t.Fatalf("%d records for reports that changed nothing", got-n)
		}
	})
}

func TestDataParallelRanks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		rank := func(rank uint32, decode uint64) events.LoadReport {
			r := h.report(7, rank, decode, 100)
			r.DPStart, r.DPSize = 0, 2
			return r
		}
		h.send(rank(0, 90))
		h.expect(nil, []uint64{7}, nil) // rank 1 declared, never heard: free
		h.send(rank(1, 90))
		h.expect([]uint64{7}, nil, nil)
		h.send(rank(1, 10))
		h.expect(nil, []uint64{7}, nil)
		h.send(rank(1, 95))
		h.expect([]uint64{7}, nil, nil)
		// Rank 1 falls silent while rank 0 keeps reporting: stale rank is free.
		for range 12 {
			time.Sleep(time.Second)
			h.send(rank(0, 90))
		}
		h.expect(nil, []uint64{7}, nil)
	})
}

func TestStaleThenGone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 90, 100))
		h.send(h.report(2, 0, 10, 100))
		time.Sleep(5 * time.Second)
		h.send(h.report(2, 0, 10, 100))
		time.Sleep(5*time.Second + time.Millisecond)
		synctest.Wait()
		// Worker 1 is stale: one free worker left, not all busy.
		h.expect(nil, []uint64{2}, []uint64{1})
		time.Sleep(45 * time.Second)
		synctest.Wait()
		h.expect(nil, nil, []uint64{1, 2})
		time.Sleep(5 * time.Second)
		synctest.Wait()
		h.expect(nil, nil, []uint64{2})
		time.Sleep(5 * time.Second)
		synctest.Wait()
		if _, ok := h.sink.record(testModel); ok {
			t.Fatal("record of a model with no worker left was not deleted")
		}
		// The model comes back with its next report.
		h.send(h.report(2, 0, 10, 100))
		h.expect(nil, []uint64{2}, nil)
	})
}

func TestStaleWorkersAreNotFree(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		for id := range uint64(5) {
			h.send(h.report(id+10, 0, 10, 100))
		}
		time.Sleep(9 * time.Second)
		h.send(h.report(1, 0, 90, 100))
		time.Sleep(2 * time.Second)
		synctest.Wait()
		h.expect([]uint64{1}, nil, []uint64{10, 11, 12, 13, 14})
	})
}

func TestDedupeAndBoots(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		r := h.report(1, 0, 90, 100)
		r.Seq = 10
		h.send(r)
		h.expect([]uint64{1}, nil, nil)

		dup := r
		dup.ActiveDecodeBlocks = events.Some(0)
		h.send(dup) // same seq
		dup.Seq = 9
		h.send(dup) // older seq
		h.expect([]uint64{1}, nil, nil)
		if got := h.rejected(rejectDuplicate); got != 2 {
			t.Fatalf("duplicates counted %v, want 2", got)
		}

		time.Sleep(time.Millisecond)
		late := dup
		late.BootID, late.Seq, late.SentAt = 99, 100, r.SentAt-1 // a dead boot's late message
		h.send(late)
		h.expect([]uint64{1}, nil, nil)
		if got := h.rejected(rejectDeadBoot); got != 1 {
			t.Fatalf("dead boot counted %v, want 1", got)
		}

		restart := dup
		restart.BootID, restart.Seq, restart.SentAt = 2, 1, time.Now().UnixNano()
		restart.KVTotalBlocks = events.Optional{} // the new boot's state starts empty
		h.send(restart)
		h.expect(nil, []uint64{1}, nil)
	})
}

func TestGoodbye(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 90, 100))
		r := h.report(2, 0, 90, 100)
		h.send(r)
		router := h.report(2, 0, 0, 100)
		router.Source, router.BootID = "router/a", 5
		h.send(router)
		h.expect([]uint64{1, 2}, nil, nil)

		h.bye(events.Goodbye{Model: testModel, WorkerID: 2, Source: events.SourceEngine, BootID: 1, Seq: h.seq + 1, SentAt: time.Now().UnixNano()})
		h.expect([]uint64{1}, nil, nil)

		late := h.report(2, 0, 10, 100)
		h.send(late)
		h.expect([]uint64{1}, nil, nil)
		if got := h.rejected(rejectAfterGoodbye); got != 1 {
			t.Fatalf("after-goodbye rejections %v, want 1", got)
		}

		time.Sleep(time.Millisecond)
		reborn := h.report(2, 0, 10, 100)
		reborn.BootID, reborn.Seq, reborn.SentAt = 3, 1, time.Now().UnixNano()
		h.send(reborn)
		h.expect([]uint64{1}, []uint64{2}, nil)

		// A router's goodbye only removes the router's state.
		h.send(router)
		rb := events.Goodbye{Model: testModel, WorkerID: 1, Source: "router/a", BootID: 5, Seq: 1000, SentAt: time.Now().UnixNano()}
		h.bye(rb)
		h.expect([]uint64{1}, []uint64{2}, nil)
	})
}

func TestRejectsHostileInput(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		good := h.report(1, 0, 10, 100)
		b, _ := events.MarshalLoadReport(&good)
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.8.0", b)     // another worker's subject
		h.raw("workermon.load.Qwen/Qwen3-0=2e6B.1.0", b)     // non-canonical key
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.1.0", b[:5]) // truncated
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.1.0", []byte(`{"v":1}`))
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.1.0", nil)
		h.raw("workermon.load.x", b)
		if _, ok := h.sink.record(testModel); ok {
			t.Fatal("a rejected message made a record")
		}
		for reason, want := range map[string]float64{"mismatch": 2, "malformed": 1, "not_map": 1, "empty": 1, "invalid_subject": 1} {
			if got := h.rejected(reason); got != want {
				t.Errorf("rejected{%s} = %v, want %v", reason, got, want)
			}
		}
		h.send(good)
		h.expect(nil, []uint64{1}, nil)

		// The rank is now known on its subject: a report of it on any other
		// subject is still parsed and matched, and rejected.
		busy := h.report(1, 0, 90, 100)
		b, _ = events.MarshalLoadReport(&busy)
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.8.0", b) // another worker's
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.1.1", b) // another rank's
		h.raw("workermon.load.other.1.0", b)             // another model's
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.1.0.x", b)
		if got := h.rejected("mismatch"); got != 5 {
			t.Errorf("rejected{mismatch} = %v after reports on foreign subjects, want 5", got)
		}
		if got := h.rejected("invalid_subject"); got != 2 {
			t.Errorf("rejected{invalid_subject} = %v, want 2", got)
		}
		h.expect(nil, []uint64{1}, nil)
		h.raw("workermon.load.Qwen/Qwen3-0=2E6B.1.0", b) // its own
		h.expect([]uint64{1}, nil, nil)
	})
}

func TestCardinalityLimits(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) {
			c.MaxModels, c.MaxWorkersPerModel, c.MaxSourcesPerWorker, c.MaxRanksPerWorker = 2, 3, 2, 4
		})
		for id := range uint64(5) {
			h.send(h.report(id, 0, 10, 100))
		}
		h.expect(nil, []uint64{0, 1, 2}, nil)
		if got := h.rejected(rejectWorkers); got != 2 {
			t.Fatalf("too_many_workers = %v", got)
		}
		for _, m := range []string{"a", "b"} {
			r := h.report(1, 0, 1, 1)
			r.Model = m
			h.send(r)
		}
		if got := h.rejected(rejectModels); got != 1 {
			t.Fatalf("too_many_models = %v", got)
		}
		for _, s := range []string{"router/1", "router/2"} {
			r := h.report(1, 0, 1, 1)
			r.Source = s
			h.send(r)
		}
		if got := h.rejected(rejectSources); got != 1 {
			t.Fatalf("too_many_sources = %v", got)
		}
		r := h.report(1, 0, 1, 1)
		r.DPSize = 5
		h.send(r)
		if got := h.rejected(rejectRanks); got != 1 {
			t.Fatalf("too_many_ranks = %v", got)
		}
	})
}

func TestOverrideAppliesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 50, 100))
		h.expect(nil, []uint64{1}, nil)
		ctx := context.Background()
		if err := h.m.SetOverride(ctx, testModel, &events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.4)}); err != nil {
			t.Fatal(err)
		}
		rec := h.expect([]uint64{1}, nil, nil)
		if *rec.Thresholds.ActiveDecodeBlocks != 0.4 || *rec.Thresholds.ActivePrefillTokens != 1000 {
			t.Fatalf("thresholds = %+v", rec.Thresholds)
		}
		if err := h.m.SetOverride(ctx, testModel, nil); err != nil {
			t.Fatal(err)
		}
		h.expect(nil, []uint64{1}, nil)
		if err := h.m.SetOverride(ctx, testModel, &events.Thresholds{ActiveDecodeBlocks: events.Ptr(2.0)}); err == nil {
			t.Fatal("out-of-range override accepted")
		}
	})
}

func TestMetrics(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 90, 100))
		h.send(h.report(2, 0, 10, 100))
		if got := testutil.ToFloat64(h.m.metrics.accepted.WithLabelValues("load")); got != 2 {
			t.Fatalf("accepted = %v", got)
		}
		if got := testutil.ToFloat64(h.m.metrics.workers.WithLabelValues(testModel, "busy")); got != 1 {
			t.Fatalf("busy workers = %v", got)
		}
		n, err := testutil.GatherAndCount(h.reg, "workermon_recompute_seconds", "workermon_report_lag_seconds")
		if err != nil || n != 2 {
			t.Fatalf("histograms gathered %d, %v", n, err)
		}
		// A model seeded from a record without workers never has a record:
		// it must not leave series behind.
		if err := h.m.Seed(context.Background(), []events.BusySet{{Model: "ghost/model"}}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if n := testutil.CollectAndCount(h.m.metrics.workers); n != 5 {
			t.Errorf("workermon_workers has %d series after seeding an empty record, want the 5 of %s", n, testModel)
		}
	})
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	cfg.StaleAfter, cfg.MaxModels, cfg.SubjectPrefix = 0, -1, "a..b"
	cfg.Defaults.ActiveDecodeBlocks = events.Ptr(1.5)
	err := cfg.Validate()
	if err == nil {
		t.Fatal("bad config accepted")
	}
	for _, want := range []string{"stale-after", "max-models", "prefix", "active_decode_blocks_threshold"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
	if _, err := New(DefaultConfig(), nil); err == nil {
		t.Fatal("nil sink accepted")
	}
}

func TestQueries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		ctx := context.Background()
		r := h.report(2, 1, 90, 100)
		r.DPStart, r.DPSize = 0, 2
		h.send(r)
		r = h.report(2, 0, 95, 100)
		r.DPStart, r.DPSize = 0, 2
		h.send(r)
		est := h.report(2, 0, 10, 50)
		est.Source, est.DPSize, est.BootID = "router/x", 2, 9
		h.send(est)
		h.send(h.report(1, 0, 10, 100))

		loads, err := h.m.Loads(ctx, testModel)
		if err != nil {
			t.Fatal(err)
		}
		if len(loads) != 3 || loads[0].WorkerID != 1 || loads[1].WorkerID != 2 || loads[1].DPRank != 0 || loads[2].DPRank != 1 {
			t.Fatalf("rows not sorted by worker and rank: %+v", loads)
		}
		row := loads[1]
		// Max over sources for load, smallest positive capacity.
		if row.ActiveDecodeBlocks != 95 || row.KVTotalBlocks != 50 || !row.Busy || row.Reason != "kv" || len(row.Sources) != 2 {
			t.Fatalf("row = %+v", row)
		}
		if v := row.Sources["router/x"].ActiveDecodeBlocks; v == nil || *v != 10 {
			t.Fatalf("router source = %+v", row.Sources["router/x"])
		}
		workers, err := h.m.Workers(ctx, "")
		if err != nil || len(workers) != 2 || workers[1].State != "busy" || !slices.Equal(workers[1].Sources, []string{"engine", "router/x"}) {
			t.Fatalf("workers = %+v, %v", workers, err)
		}
		recs, err := h.m.Records(ctx, "")
		if err != nil || len(recs) != 1 || !slices.Equal(recs[0].Busy, []uint64{2}) {
			t.Fatalf("records = %+v, %v", recs, err)
		}
		if ok, _ := h.m.Known(ctx, testModel); !ok {
			t.Fatal("model not known")
		}
		if ok, _ := h.m.Known(ctx, "other"); ok {
			t.Fatal("unknown model known")
		}
		_ = h.m.SetOverride(ctx, "other", &events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](5)})
		th, err := h.m.Thresholds(ctx)
		if err != nil || len(th) != 2 || *th["other"].ActivePrefillTokens != 5 || *th["other"].ActiveDecodeBlocks != 0.8 {
			t.Fatalf("thresholds = %+v, %v", th, err)
		}
	})
}

func TestRecordDeletedWhenLastWorkerLeft(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100))
		h.expect(nil, []uint64{1}, nil)
		h.bye(events.Goodbye{Model: testModel, WorkerID: 1, Source: events.SourceEngine, BootID: 1, Seq: h.seq + 1, SentAt: time.Now().UnixNano()})
		h.expect(nil, nil, nil)

		// The tombstone expires: no worker is left, so the key goes.
		time.Sleep(DefaultGoneAfter)
		synctest.Wait()
		if _, ok := h.sink.record(testModel); ok {
			t.Fatal("record of a model whose last worker said goodbye was not deleted")
		}
		recs, err := h.m.Records(t.Context(), "")
		if err != nil || len(recs) != 0 {
			t.Fatalf("records = %+v, %v; want none", recs, err)
		}
	})
}

func TestSeedFromPreviousRecords(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		prev := []events.BusySet{
			{Model: testModel, Busy: []uint64{1}, Free: []uint64{2}, AllBusy: false},
			{Model: "\xff bad", Busy: []uint64{9}},
		}
		if err := h.m.Seed(context.Background(), prev); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		// Not heard from: neither busy nor free.
		h.expect(nil, nil, []uint64{1, 2})
		if n, _ := h.m.Records(context.Background(), ""); len(n) != 1 {
			t.Fatalf("records = %+v, want only the valid model", n)
		}
		h.send(h.report(2, 0, 10, 100))
		h.expect(nil, []uint64{2}, []uint64{1})
		// A seeded worker that never reports is removed after gone-after.
		time.Sleep(DefaultGoneAfter - time.Second)
		h.send(h.report(2, 0, 10, 100))
		h.expect(nil, []uint64{2}, []uint64{1})
		time.Sleep(2 * time.Second)
		synctest.Wait()
		h.expect(nil, []uint64{2}, nil)
	})
}

func TestLastSourceGoodbyeLeavesWorkerStaleUntilGone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		r := h.report(4, 0, 10, 100)
		r.Source = "sidecar" // not the engine: its goodbye drops only its own state
		h.send(r)
		h.expect(nil, []uint64{4}, nil)
		h.bye(events.Goodbye{Model: testModel, WorkerID: 4, Source: "sidecar", BootID: 1, Seq: h.seq + 1, SentAt: time.Now().UnixNano()})
		h.expect(nil, nil, []uint64{4})
		// Past stale-after the worker is still listed stale, not dropped early.
		time.Sleep(DefaultStaleAfter + time.Second)
		synctest.Wait()
		h.expect(nil, nil, []uint64{4})
		time.Sleep(DefaultGoneAfter - DefaultStaleAfter)
		synctest.Wait()
		if _, ok := h.sink.record(testModel); ok {
			t.Fatal("worker with nothing left was not removed after gone-after")
		}
	})
}

// TestCordon: a cordoned fresh worker is listed busy with reason
// "cordoned", never free, whatever its load; a stale one stays stale; a
// cordon may name a worker not seen yet; uncordon restores its place.
func TestCordon(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		ctx := context.Background()
		h.send(h.report(1, 0, 10, 100))
		h.send(h.report(2, 0, 10, 100))
		h.cordon(2, true)
		rec := h.expect([]uint64{2}, []uint64{1}, nil)
		if rec.Reasons["2"] != "cordoned" {
			t.Fatalf("reasons = %v, want 2: cordoned", rec.Reasons)
		}
		// Busy by load too: still "cordoned".
		h.send(h.report(2, 0, 90, 100))
		if rec = h.expect([]uint64{2}, []uint64{1}, nil); rec.Reasons["2"] != "cordoned" {
			t.Fatalf("reasons = %v", rec.Reasons)
		}
		// Cordoning every free worker makes the model all busy.
		h.cordon(1, true)
		h.expect([]uint64{1, 2}, nil, nil)
		if n := testutil.ToFloat64(h.m.metrics.allBusyChanges.WithLabelValues(testModel)); n != 1 {
			t.Errorf("all_busy changes = %v, want 1", n)
		}
		// A worker not seen yet: cordoned when it first reports.
		h.cordon(3, true)
		h.send(h.report(3, 0, 0, 100))
		h.expect([]uint64{1, 2, 3}, nil, nil)
		// Uncordon: back to what its load says.
		for _, id := range []uint64{1, 2, 3} {
			h.cordon(id, false)
		}
		rec = h.expect([]uint64{2}, []uint64{1, 3}, nil)
		if n := testutil.ToFloat64(h.m.metrics.allBusyChanges.WithLabelValues(testModel)); n != 2 {
			t.Errorf("all_busy changes = %v, want 2", n)
		}
		if rec.Reasons["2"] != "kv" {
			t.Fatalf("reasons = %v, want 2: kv", rec.Reasons)
		}
		// A stale cordoned worker is stale, not busy.
		h.cordon(1, true)
		time.Sleep(DefaultStaleAfter + time.Second)
		h.send(h.report(2, 0, 10, 100))
		h.send(h.report(3, 0, 10, 100))
		h.expect(nil, []uint64{2, 3}, []uint64{1})
		if err := h.m.SetCordon(ctx, "\xff bad", 1, true); err == nil {
			t.Error("cordon of an invalid model name accepted")
		}
	})
}

// TestReleaseMargin: with a margin a busy worker stays busy until its load
// falls to the release level; a new monitor seeded from a record starts a
// busy worker latched.
func TestReleaseMargin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.ReleaseMargin = 0.1 })
		h.send(h.report(1, 0, 10, 100))
		h.send(h.report(2, 0, 75, 100)) // between release (72) and threshold (80): free
		h.expect(nil, []uint64{1, 2}, nil)
		h.send(h.report(2, 0, 81, 100))
		h.expect([]uint64{2}, []uint64{1}, nil)
		h.send(h.report(2, 0, 75, 100)) // latched
		h.expect([]uint64{2}, []uint64{1}, nil)
		h.send(h.report(2, 0, 73, 100))
		h.expect([]uint64{2}, []uint64{1}, nil)
		h.send(h.report(2, 0, 72, 100)) // at release: free
		h.expect(nil, []uint64{1, 2}, nil)
		h.send(h.report(2, 0, 75, 100)) // below threshold again: stays free
		h.expect(nil, []uint64{1, 2}, nil)
	})
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.ReleaseMargin = 0.1 })
		prev := []events.BusySet{{Model: testModel, Busy: []uint64{1}, Free: []uint64{2}, Reasons: map[string]string{"1": "kv"}}}
		if err := h.m.Seed(context.Background(), prev); err != nil {
			t.Fatal(err)
		}
		h.send(h.report(1, 0, 75, 100)) // latched by the record: busy
		h.send(h.report(2, 0, 75, 100)) // not latched: free
		h.expect([]uint64{1}, []uint64{2}, nil)
		h.send(h.report(1, 0, 72, 100))
		h.expect(nil, []uint64{1, 2}, nil)
	})
	// Every rank of a worker listed busy starts latched, not only the first
	// to report after the takeover (the second started unlatched, and the
	// worker turned free at once); a rank released while the others have
	// not reported yet is not latched again.
	for _, released := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			h := startHarness(t, func(c *Config) { c.ReleaseMargin = 0.1 })
			prev := []events.BusySet{{Model: testModel, Busy: []uint64{1}, Free: []uint64{}, Reasons: map[string]string{"1": "kv"}}}
			if err := h.m.Seed(context.Background(), prev); err != nil {
				t.Fatal(err)
			}
			rank := func(r uint32, blocks uint64) events.LoadReport {
				rep := h.report(1, r, blocks, 100)
				rep.DPSize = 3
				return rep
			}
			h.send(rank(0, 75))
			if released {
				h.send(rank(1, 50)) // below every level's release (amber too): nothing latched
			}
			h.send(rank(1, 75)) // seeded: latched; released before: stays free
			h.send(rank(2, 75))
			if !released {
				h.expect([]uint64{1}, nil, nil) // every rank latched by the record
				return
			}
			h.expect(nil, []uint64{1}, nil)
			h.send(rank(1, 81))
			h.expect([]uint64{1}, nil, nil) // ranks 0 and 2 still latched
			h.send(rank(0, 72))
			h.expect(nil, []uint64{1}, nil)
		})
	}
}

// cordon cordons or uncordons a worker of testModel and waits for the
// record.
func (h *harness) cordon(worker uint64, on bool) {
	h.t.Helper()
	if err := h.m.SetCordon(context.Background(), testModel, worker, on); err != nil {
		h.t.Fatal(err)
	}
	synctest.Wait()
}

// TestRescheduleSnapshot: usage is the mean over fresh ranks; stale
// workers are not fresh; free and cordoned follow the record.
func TestRescheduleSnapshot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		r := h.report(1, 0, 10, 100)
		r.DPSize = 2
		h.send(r)
		r = h.report(1, 1, 30, 100)
		r.DPRank, r.DPSize = 1, 2
		h.send(r)
		h.send(h.report(2, 0, 90, 100))
		h.send(h.report(3, 0, 50, 100))
		h.cordon(3, true)
		time.Sleep(DefaultStaleAfter - time.Second)
		h.send(h.report(2, 0, 90, 100))
		h.send(h.report(3, 0, 50, 100))
		time.Sleep(2 * time.Second) // worker 1 goes stale
		synctest.Wait()
		snap, err := h.m.RescheduleSnapshot(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(snap.Models) != 1 || snap.Models[0].Name != testModel {
			t.Fatalf("models %+v", snap.Models)
		}
		want := []resched.Worker{{ID: 1},
			{ID: 2, Usage: 0.9, HasUsage: true, TotalBlocks: 100, Fresh: true},
			{ID: 3, Usage: 0.5, HasUsage: true, TotalBlocks: 100, Fresh: true, Cordoned: true}}
		if got := snap.Models[0].Workers; !slices.Equal(got, want) {
			t.Errorf("workers\n%+v\nwant\n%+v", got, want)
		}
		// Fresh again: the mean over both ranks.
		r = h.report(1, 0, 10, 100)
		r.DPSize = 2
		h.send(r)
		r = h.report(1, 1, 30, 100)
		r.DPRank, r.DPSize = 1, 2
		h.send(r)
		snap, _ = h.m.RescheduleSnapshot(context.Background())
		if w := snap.Models[0].Workers[0]; !w.Fresh || !w.Free || !w.HasUsage || w.Usage < 0.1999 || w.Usage > 0.2001 || w.TotalBlocks != 200 {
			t.Errorf("worker 1 = %+v, want fresh, free, usage 0.2, 200 blocks", w)
		}
	})
}

// TestRescheduleSnapshotCommitted: a worker whose ranks all send
// kv_committed_blocks and request counts carries its committed usage (the
// mean over ranks, contract §21) and its running and waiting requests, so
// the planner balances on projected usage and sizes its pairs; a worker
// without them carries neither.
func TestRescheduleSnapshotCommitted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		for rank, committed := range []uint64{60, 100} {
			r := h.report(1, uint32(rank), 10, 100)
			r.DPRank, r.DPSize = uint32(rank), 2
			r.KVCommittedBlocks = events.Some(committed)
			r.RunningRequests, r.WaitingRequests = events.Some(uint64(3)), events.Some(uint64(2))
			h.send(r)
		}
		h.send(h.report(2, 0, 40, 100))
		synctest.Wait()
		snap, err := h.m.RescheduleSnapshot(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		ws := snap.Models[0].Workers
		if w := ws[0]; !w.HasCommitted || w.Committed < 0.7999 || w.Committed > 0.8001 || w.Requests != 10 {
			t.Errorf("worker 1 = %+v, want committed usage 0.8 over 10 requests (running and waiting)", w)
		}
		if w := ws[1]; w.HasCommitted || w.Requests != 0 || !w.HasUsage {
			t.Errorf("worker 2 = %+v, want usage only", w)
		}
	})
}

// TestRouterEstimatesCombine: a rank's load per signal is the larger of the
// engine's value and the sum over fresh router/* sources (contract §3, §11);
// a router's low estimate never hides the engine's high truth, a stale
// router stops counting, and routers speak only on est subjects.
func TestRouterEstimatesCombine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil) // prefill threshold 1000 tokens
		prefill := func(source string, boot, tokens uint64) events.LoadReport {
			r := h.report(1, 0, 0, 0)
			r.ActiveDecodeBlocks, r.KVTotalBlocks = events.Optional{}, events.Optional{}
			r.Source, r.BootID, r.ActivePrefillTokens = source, boot, events.Some(tokens)
			return r
		}
		h.send(prefill(events.SourceEngine, 1, 400))
		h.send(h.report(2, 0, 10, 100))
		h.expect(nil, []uint64{1, 2}, nil)

		// Two routers, each below the threshold, together above it.
		h.send(prefill("router/a", 2, 600))
		h.expect(nil, []uint64{1, 2}, nil)
		h.send(prefill("router/b", 3, 500))
		rec := h.expect([]uint64{1}, []uint64{2}, nil)
		if rec.Reasons["1"] != "prefill" {
			t.Fatalf("reasons = %v, want prefill for worker 1", rec.Reasons)
		}
		// The engine catches up above the routers' sum: still busy on its own.
		h.send(prefill(events.SourceEngine, 1, 1500))
		h.send(prefill("router/a", 2, 0))
		h.send(prefill("router/b", 3, 0))
		h.expect([]uint64{1}, []uint64{2}, nil)
		h.send(prefill(events.SourceEngine, 1, 100))
		h.expect(nil, []uint64{1, 2}, nil)

		// A router's estimate on a load subject is refused, and so is an
		// engine's report on an est subject.
		bad := prefill("router/a", 2, 5000)
		b, err := events.MarshalLoadReport(&bad)
		if err != nil {
			t.Fatal(err)
		}
		h.raw(events.LoadSubject(events.DefaultSubjectPrefix, testModel, 1, 0), b)
		eng := prefill(events.SourceEngine, 1, 5000)
		if b, err = events.MarshalLoadReport(&eng); err != nil {
			t.Fatal(err)
		}
		h.raw(events.EstSubject(events.DefaultSubjectPrefix, testModel, 1, 0), b)
		if got := h.rejected("source_not_allowed"); got != 2 {
			t.Fatalf("source_not_allowed = %v, want 2", got)
		}
		h.expect(nil, []uint64{1, 2}, nil)

		// A router goodbye drops that router's share only; a stale router
		// stops counting.
		h.send(prefill("router/a", 2, 700))
		h.send(prefill("router/b", 3, 700))
		h.expect([]uint64{1}, []uint64{2}, nil)
		h.seq++
		h.bye(events.Goodbye{Model: testModel, WorkerID: 1, Source: "router/a", BootID: 2, Seq: h.seq, SentAt: time.Now().UnixNano()})
		h.expect(nil, []uint64{1, 2}, nil)
		h.send(prefill("router/a", 4, 700))
		h.expect([]uint64{1}, []uint64{2}, nil)
		for range int(DefaultStaleAfter/time.Second) + 1 {
			time.Sleep(time.Second)
			h.send(prefill(events.SourceEngine, 1, 100))
			h.send(h.report(2, 0, 10, 100))
			h.send(prefill("router/b", 3, 700))
		}
		h.expect(nil, []uint64{1, 2}, nil) // router/a is stale: 700 alone is below

		// Estimates add load, never liveness: with the engine silent, worker
		// 1 goes stale though router/b keeps estimating it; a worker only
		// routers speak of is in no list.
		for range int(DefaultStaleAfter/time.Second) + 1 {
			time.Sleep(time.Second)
			h.send(h.report(2, 0, 10, 100))
			h.send(prefill("router/b", 3, 700))
			est := prefill("router/b", 3, 5000)
			est.WorkerID = 9
			h.send(est)
		}
		h.expect(nil, []uint64{2}, []uint64{1})
		// A cordon does not list a worker only routers speak of.
		h.cordon(9, true)
		h.expect(nil, []uint64{2}, []uint64{1})
	})
}

// pendingSink is a fakeSink that holds records untaken while hold is set.
type pendingSink struct {
	*fakeSink
	hold atomic.Bool
}

func (p *pendingSink) Pending(string) bool { return p.hold.Load() }

var _ PendingSink = (*pendingSink)(nil)

// TestPendingSinkDefersBuilds: while a PendingSink still holds a model's
// record, the monitor builds no new one for that model however many
// reports change it; after Kick it builds one, the latest. A command does
// not wait for the sink.
func TestPendingSinkDefersBuilds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sink := &pendingSink{fakeSink: newFakeSink()}
		h := startHarnessOn(t, sink, sink.fakeSink, func(cfg *Config) {
			cfg.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
		})
		m := h.m
		h.send(h.report(1, 0, 10, 100))
		h.expect(nil, []uint64{1}, nil)
		sets := func() int {
			sink.mu.Lock()
			defer sink.mu.Unlock()
			return sink.sets
		}
		before := sets()

		sink.hold.Store(true)
		for i := range 20 {
			h.send(h.report(1, 0, uint64(10+80*(i%2)), 100)) // flips busy, free, busy...
		}
		h.send(h.report(1, 0, 90, 100)) // ends busy
		if got := sets(); got != before {
			t.Fatalf("%d records built while the sink held the last one", got-before)
		}
		sink.hold.Store(false)
		m.Kick()
		synctest.Wait()
		if got := sets(); got != before+1 {
			t.Fatalf("%d records after Kick, want 1", got-before)
		}
		h.expect([]uint64{1}, nil, nil)

		// A command hands its records over even while the sink holds.
		sink.hold.Store(true)
		if err := m.SetOverride(context.Background(), testModel, &events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.95)}); err != nil {
			t.Fatal(err)
		}
		h.expect(nil, []uint64{1}, nil)
	})
}

// TestMappedSubjects: with partitions every report arrives on a mapped
// subject (contract §10); it is accepted, and once its rank is known there
// a report on any other mapped subject is still parsed, matched and
// rejected.
func TestMappedSubjects(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		const own = "workermon.part.3.load.Qwen/Qwen3-0=2E6B.1.0"
		good := h.report(1, 0, 10, 100)
		b, _ := events.MarshalLoadReport(&good)
		h.raw(own, b)
		h.expect(nil, []uint64{1}, nil)

		busy := h.report(1, 0, 90, 100)
		b, _ = events.MarshalLoadReport(&busy)
		h.raw("workermon.part.3.load.Qwen/Qwen3-0=2E6B.8.0", b) // another worker's
		h.raw("workermon.part.3.load.Qwen/Qwen3-0=2E6B.1.1", b) // another rank's
		h.raw("workermon.part.3.load.other.1.0", b)             // another model's
		h.raw("workermon.part.x.load.Qwen/Qwen3-0=2E6B.1.0", b) // a bad partition
		h.raw("workermon.part.3.est.Qwen/Qwen3-0=2E6B.1.0", b)  // an engine on an est subject
		if got := h.rejected("mismatch"); got != 3 {
			t.Errorf("rejected{mismatch} = %v, want 3", got)
		}
		if got := h.rejected("invalid_subject"); got != 1 {
			t.Errorf("rejected{invalid_subject} = %v, want 1", got)
		}
		if got := h.rejected("source_not_allowed"); got != 1 {
			t.Errorf("rejected{source_not_allowed} = %v, want 1", got)
		}
		h.expect(nil, []uint64{1}, nil)
		h.raw(own, b)
		h.expect([]uint64{1}, nil, nil)
	})
}

func TestIsLoadSubject(t *testing.T) {
	t.Parallel()
	for subject, want := range map[string]bool{
		"workermon.load.m.1.0":        true,
		"workermon.part.0.load.m.1.0": true,
		"workermon.part.x.load.m.1.0": true, // shape checked by events.ParseSubject
		"workermon.load.":             false,
		"workermon.part.0.load.":      false,
		"workermon.part.0":            false,
		"workermon.part.0.bye.m.1":    false,
		"workermon.bye.m.1":           false,
		"workermon.est.m.1.0":         false,
		"other.load.m.1.0":            false,
		"workermonx.load.m.1.0":       false,
	} {
		if got := isLoadSubject(events.DefaultSubjectPrefix, subject); got != want {
			t.Errorf("isLoadSubject(%q) = %v, want %v", subject, got, want)
		}
	}
}

// TestSteadyReportAllocatesNothing: the report path (decode, subject
// check, state update, busy rules) allocates nothing for a report that
// changes no record, on a plain subject and on a mapped one.
func TestSteadyReportAllocatesNothing(t *testing.T) { // not parallel: AllocsPerRun
	for _, subject := range []string{
		events.LoadSubject(events.DefaultSubjectPrefix, testModel, 1, 0),
		"workermon.part.3.load.Qwen/Qwen3-0=2E6B.1.0",
	} {
		t.Run(subject, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Defaults.ActiveDecodeBlocks = events.Ptr(0.8)
			m, err := newMetrics(nil, func() float64 { return 0 })
			if err != nil {
				t.Fatal(err)
			}
			s := newState(cfg, nopSink{}, m, slog.New(slog.DiscardHandler))
			dec := events.NewDecoder()
			now := time.Now()
			r := events.LoadReport{Model: testModel, WorkerID: 1, DPSize: 1, Source: events.SourceEngine,
				ActiveDecodeBlocks: events.Some(10), KVTotalBlocks: events.Some(100), BootID: 1, SentAt: 1}
			const runs = 100
			msgs := make([][]byte, runs+2) // AllocsPerRun runs once more to warm up
			for i := range msgs {
				r.Seq = uint64(i + 1)
				if msgs[i], err = events.MarshalLoadReport(&r); err != nil {
					t.Fatal(err)
				}
			}
			i := 0
			handle := func() {
				msg := decodeMessage(events.DefaultSubjectPrefix, 0, dec, subject, msgs[i])
				i++
				s.handle(&msg, now)
				s.flush(now)
			}
			handle()
			if got := testutil.ToFloat64(m.acceptedLoad); got != 1 {
				t.Fatalf("accepted %v reports, want the first", got)
			}
			if n := testing.AllocsPerRun(runs, handle); n != 0 {
				t.Errorf("%v allocations per report", n)
			}
			if got := testutil.ToFloat64(m.acceptedLoad); got != runs+2 {
				t.Errorf("accepted %v reports, want %d", got, runs+2)
			}
		})
	}
}

// TestWrongPartition: with --partitions P, a report or goodbye on a mapped
// subject whose partition is not its model's among P came through a NATS
// server mapped with another P (contract §10). It is rejected and counted
// (wrong_partition), and logged at most every 10 s; reports on the right
// partition are applied.
func TestWrongPartition(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const parts = 8
		var logs syncbuf.Buffer
		h := startHarness(t, func(c *Config) {
			c.Partitions = parts
			c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		})
		key := events.ModelKey(testModel)
		p := events.PartitionOfKey(key, parts)
		subject := func(p int, worker uint64) string {
			return fmt.Sprintf("workermon.part.%d.load.%s.%d.0", p, key, worker)
		}
		good := h.report(1, 0, 10, 100)
		b, _ := events.MarshalLoadReport(&good)
		h.raw(subject(p, 1), b)
		h.expect(nil, []uint64{1}, nil)

		// Another P's partition: rejected, the record unchanged.
		wrong := (p + 1) % parts
		for range 3 {
			r := h.report(2, 0, 90, 100)
			b, _ = events.MarshalLoadReport(&r)
			h.raw(subject(wrong, 2), b)
		}
		bye, _ := events.MarshalGoodbye(&events.Goodbye{Model: testModel, WorkerID: 1, Source: events.SourceEngine,
			BootID: 1, SentAt: time.Now().UnixNano()})
		h.raw(fmt.Sprintf("workermon.part.%d.bye.%s.1", wrong, key), bye)
		if got := h.rejected("wrong_partition"); got != 4 {
			t.Errorf("rejected{wrong_partition} = %v, want 4", got)
		}
		h.expect(nil, []uint64{1}, nil)
		if n := strings.Count(logs.String(), "mapped with another partition count"); n != 1 {
			t.Errorf("logged %d times within 10 s, want once:\n%s", n, logs.String())
		}
		time.Sleep(11 * time.Second) // the bubble's clock
		r := h.report(2, 0, 90, 100)
		b, _ = events.MarshalLoadReport(&r)
		h.raw(subject(wrong, 2), b)
		if n := strings.Count(logs.String(), "mapped with another partition count"); n != 2 {
			t.Errorf("logged %d times after 10 s, want twice", n)
		}
	})
}

// TestFutureSentAtRefused checks contract §3: a message whose sent_at is
// more than --stale-after ahead of the monitor's clock is refused and
// counted, so that a new boot_id with a far-future sent_at cannot lock the
// worker's real reports out as a dead boot.
func TestFutureSentAtRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		stale := DefaultConfig().StaleAfter
		h.send(h.report(1, 0, 90, 100))
		h.expect([]uint64{1}, nil, nil)

		forged := h.report(1, 0, 0, 100)
		forged.BootID, forged.Seq, forged.SentAt = 99, 1, math.MaxInt64
		h.send(forged)
		if got := h.rejected(rejectFuture); got != 1 {
			t.Fatalf("future sent_at counted %v, want 1", got)
		}
		h.expect([]uint64{1}, nil, nil)
		bye := events.Goodbye{Model: testModel, WorkerID: 1, Source: events.SourceEngine, BootID: 98, Seq: 1,
			SentAt: time.Now().Add(stale + time.Nanosecond).UnixNano()}
		h.bye(bye)
		if got := h.rejected(rejectFuture); got != 2 {
			t.Fatalf("future goodbye counted %v, want 2", got)
		}

		// The real boot goes on.
		time.Sleep(time.Second)
		h.send(h.report(1, 0, 10, 100))
		h.expect(nil, []uint64{1}, nil)
		if got := h.rejected(rejectDeadBoot); got != 0 {
			t.Fatalf("dead boot counted %v, want 0", got)
		}

		// Exactly --stale-after ahead is still accepted (a clock skew).
		ahead := h.report(1, 0, 90, 100)
		ahead.BootID, ahead.Seq, ahead.SentAt = 7, 1, time.Now().Add(stale).UnixNano()
		h.send(ahead)
		h.expect([]uint64{1}, nil, nil)
		if got := h.rejected(rejectFuture); got != 2 {
			t.Fatalf("future sent_at counted %v, want still 2", got)
		}
	})
}

// TestBusyFractionMetric: workermon_model_busy_fraction is busy ÷ (busy +
// free) of each model's record, read through the registry.
func TestBusyFractionMetric(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 90, 100))
		h.send(h.report(2, 0, 10, 100))
		h.send(h.report(3, 0, 10, 100))
		h.expect([]uint64{1}, []uint64{2, 3}, nil)
		want := func(v string) {
			t.Helper()
			exp := "# HELP workermon_model_busy_fraction Busy workers of each model over its listed workers (busy + free; stale ones are not listed as either), 0 with none: a scaling signal.\n" +
				"# TYPE workermon_model_busy_fraction gauge\n" +
				"workermon_model_busy_fraction{model=\"" + testModel + "\"} " + v + "\n"
			if err := testutil.GatherAndCompare(h.reg, strings.NewReader(exp), "workermon_model_busy_fraction"); err != nil {
				t.Error(err)
			}
		}
		want("0.3333333333333333")
		h.send(h.report(2, 0, 95, 100))
		h.expect([]uint64{1, 2}, []uint64{3}, nil)
		want("0.6666666666666666")
	})
}

func TestBusyFraction(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		busy, free int
		want       float64
	}{{0, 0, 0}, {0, 3, 0}, {3, 0, 1}, {1, 3, 0.25}} {
		if got := BusyFraction(tt.busy, tt.free); got != tt.want {
			t.Errorf("BusyFraction(%d, %d) = %v, want %v", tt.busy, tt.free, got, tt.want)
		}
	}
}

// TestRecordCountsRouters: the record's routers (contract §17) is the
// number of router/* sources with a fresh estimate for the model, counted
// once however many workers they estimate, and it falls when one goes
// stale.
func TestRecordCountsRouters(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		est := func(source string, boot, worker uint64) events.LoadReport {
			r := h.report(worker, 0, 0, 0)
			r.ActiveDecodeBlocks, r.KVTotalBlocks = events.Optional{}, events.Optional{}
			r.Source, r.BootID, r.ActivePrefillTokens = source, boot, events.Some(10)
			return r
		}
		h.send(h.report(1, 0, 10, 100))
		h.send(h.report(2, 0, 10, 100))
		if rec := h.expect(nil, []uint64{1, 2}, nil); rec.Routers != 0 {
			t.Fatalf("routers = %d with no router, want 0", rec.Routers)
		}
		for _, src := range []string{"router/a", "router/b", "router/c"} {
			h.send(est(src, 7, 1))
			h.send(est(src, 7, 2))
		}
		if rec := h.expect(nil, []uint64{1, 2}, nil); rec.Routers != 3 {
			t.Fatalf("routers = %d with three, want 3", rec.Routers)
		}
		// router/c falls silent: it stops counting once stale.
		for range int(DefaultStaleAfter/time.Second) + 1 {
			time.Sleep(time.Second)
			h.send(h.report(1, 0, 10, 100))
			h.send(h.report(2, 0, 10, 100))
			h.send(est("router/a", 7, 1))
			h.send(est("router/b", 7, 2))
		}
		if rec := h.expect(nil, []uint64{1, 2}, nil); rec.Routers != 2 {
			t.Fatalf("routers = %d after router/c went stale, want 2", rec.Routers)
		}
	})
}
