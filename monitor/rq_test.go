package monitor

import (
	"log/slog"
	"maps"
	"reflect"
	"testing"
	"testing/synctest"
	"time"

	"github.com/workermon/workermon/events"
)

// rq sends a router's queue report of testModel on its subject.
func (h *harness) rq(source string, boot, seq uint64, queued ...events.QueuedLevel) {
	h.t.Helper()
	h.rqOn(events.RqSubject(events.DefaultSubjectPrefix, testModel), events.RouterQueue{Model: testModel, Source: source,
		BootID: boot, Seq: seq, Queued: queued, SentAt: time.Now().UnixNano()})
}

func (h *harness) rqOn(subject string, r events.RouterQueue) {
	h.t.Helper()
	b, err := events.MarshalRouterQueue(&r)
	if err != nil {
		h.t.Fatal(err)
	}
	h.raw(subject, b)
}

func lvl(p int64, n uint64) events.QueuedLevel { return events.QueuedLevel{Priority: p, N: n} }

// expectQueued checks the queues of testModel's last record.
func (h *harness) expectQueued(by map[string]map[int64]uint64) events.BusySet {
	h.t.Helper()
	rec, ok := h.sink.record(testModel)
	if !ok {
		h.t.Fatal("no record")
	}
	sum := map[int64]uint64{}
	for _, q := range by {
		for p, n := range q {
			sum[p] += n
		}
	}
	if !maps.EqualFunc(rec.QueuedBy, by, maps.Equal) || !maps.Equal(rec.Queued, sum) {
		h.t.Fatalf("queued_by %v, queued %v; want %v, %v", rec.QueuedBy, rec.Queued, by, sum)
	}
	return rec
}

// TestRouterQueuesInRecord: a router's queue report (contract §22) is
// written in the record as queued_by and queued, the router counts in
// routers (once, estimating or not), and it is forgotten 3 s after it was
// received.
func TestRouterQueuesInRecord(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100))
		h.expectQueued(nil)

		h.rq("router/a", 1, 1, lvl(1, 2), lvl(0, 3))
		h.rq("router/b", 1, 1, lvl(0, 4))
		rec := h.expectQueued(map[string]map[int64]uint64{"router/a": {1: 2, 0: 3}, "router/b": {0: 4}})
		if rec.Routers != 2 {
			t.Fatalf("routers = %d, want 2", rec.Routers)
		}
		// router/a also estimates: still two routers.
		est := h.report(1, 0, 0, 0)
		est.Source, est.ActiveDecodeBlocks, est.KVTotalBlocks = "router/a", events.Optional{}, events.Optional{}
		h.send(est)
		if rec, _ := h.sink.record(testModel); rec.Routers != 2 {
			t.Fatalf("routers = %d with router/a estimating too, want 2", rec.Routers)
		}
		// router/b empties its queue: an empty entry is left out.
		h.rq("router/b", 1, 2)
		h.expectQueued(map[string]map[int64]uint64{"router/a": {1: 2, 0: 3}})

		// Nothing more from router/a's queue: gone 3 s after its report;
		// router/b stops counting among the routers then too.
		time.Sleep(RouterQueueKeep - time.Millisecond)
		synctest.Wait()
		h.expectQueued(map[string]map[int64]uint64{"router/a": {1: 2, 0: 3}})
		time.Sleep(time.Millisecond)
		synctest.Wait()
		h.send(h.report(1, 0, 10, 100))
		rec = h.expectQueued(nil)
		if rec.Routers != 1 { // router/a's estimate is still fresh
			t.Fatalf("routers = %d once the queues expired, want 1", rec.Routers)
		}
	})
}

// TestRouterQueueWriteRate: a change of which priorities hold requests is
// handed over at once; a change of counts alone at most once per 100 ms,
// and then without a further report.
func TestRouterQueueWriteRate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100))
		h.rq("router/a", 1, 1, lvl(0, 1))
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 1}})
		sets := h.sink.setCount()

		// Counts alone, within 100 ms of the last record: held.
		time.Sleep(10 * time.Millisecond)
		h.rq("router/a", 1, 2, lvl(0, 2))
		h.rq("router/a", 1, 3, lvl(0, 3))
		if got := h.sink.setCount(); got != sets {
			t.Fatalf("%d records for counts alone within 100 ms, want none", got-sets)
		}
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 1}})
		// 100 ms after the last record: the latest counts, once.
		time.Sleep(RouterQueueCountsEvery - 10*time.Millisecond)
		synctest.Wait()
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 3}})
		if got := h.sink.setCount(); got != sets+1 {
			t.Fatalf("%d records for held counts, want 1", got-sets)
		}
		sets++

		// A new priority: at once, counts of the others with it.
		time.Sleep(time.Millisecond)
		h.rq("router/a", 1, 4, lvl(1, 1), lvl(0, 5))
		h.expectQueued(map[string]map[int64]uint64{"router/a": {1: 1, 0: 5}})
		// The queue empties: at once.
		time.Sleep(time.Millisecond)
		h.rq("router/a", 1, 5)
		h.expectQueued(nil)
		if got := h.sink.setCount(); got != sets+2 {
			t.Fatalf("%d records for two changes of priorities, want 2", got-sets)
		}
		// Counts alone long after the last record: at once.
		h.rq("router/a", 1, 6, lvl(0, 1))
		time.Sleep(RouterQueueCountsEvery)
		h.rq("router/a", 1, 7, lvl(0, 2))
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 2}})
	})
}

// TestRouterQueueRefused: reports from a source that is not a router, on
// another model's subject, for a model without a worker, duplicates, late
// reports of a dead boot, and routers beyond the cap are refused and
// counted; a report on a mapped subject is taken.
func TestRouterQueueRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.MaxRoutersPerModel = 2 })
		h.rq("router/a", 1, 1, lvl(0, 1))
		if h.rejected(rejectNoWorkers) != 1 {
			t.Fatal("a queue of a model without workers is not refused")
		}
		h.send(h.report(1, 0, 10, 100))
		rq := events.RouterQueue{Model: testModel, Source: "engine", BootID: 1, Seq: 1, SentAt: time.Now().UnixNano(),
			Queued: []events.QueuedLevel{lvl(0, 1)}}
		h.rqOn(events.RqSubject(events.DefaultSubjectPrefix, testModel), rq)
		if h.rejected("source_not_allowed") != 1 {
			t.Fatal("a queue from an engine source is not refused")
		}
		rq.Source = "router/a"
		h.rqOn(events.RqSubject(events.DefaultSubjectPrefix, "other"), rq)
		if h.rejected("mismatch") != 1 {
			t.Fatal("a queue on another model's subject is not refused")
		}
		h.rqOn("workermon.part.5.rq."+events.ModelKey(testModel), rq)
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 1}})

		h.rq("router/a", 1, 1, lvl(0, 9))
		if h.rejected(rejectDuplicate) != 1 {
			t.Fatal("a duplicate is not refused")
		}
		// A new boot takes over; a late report of the old one is dead.
		time.Sleep(time.Second)
		h.rq("router/a", 2, 1, lvl(0, 2))
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 2}})
		late := events.RouterQueue{Model: testModel, Source: "router/a", BootID: 1, Seq: 5, SentAt: time.Now().Add(-time.Hour).UnixNano()}
		h.rqOn(events.RqSubject(events.DefaultSubjectPrefix, testModel), late)
		if h.rejected(rejectDeadBoot) != 1 {
			t.Fatal("a late report of a dead boot is not refused")
		}
		h.rq("router/b", 1, 1, lvl(0, 1))
		h.rq("router/c", 1, 1, lvl(0, 1))
		if h.rejected(rejectSources) != 1 {
			t.Fatal("a third router beyond the cap of 2 is not refused")
		}
		h.expectQueued(map[string]map[int64]uint64{"router/a": {0: 2}, "router/b": {0: 1}})
		if got := h.rejected(rejectFuture); got != 0 {
			t.Fatalf("%v refused from the future", got)
		}
		future := events.RouterQueue{Model: testModel, Source: "router/b", BootID: 1, Seq: 9,
			SentAt: time.Now().Add(2 * DefaultStaleAfter).UnixNano()}
		h.rqOn(events.RqSubject(events.DefaultSubjectPrefix, testModel), future)
		if h.rejected(rejectFuture) != 1 {
			t.Fatal("a report from the future is not refused")
		}
	})
}

// TestRouterQueueModelGone: a model whose last worker goes away takes its
// queues with it; its timers are off the loop's.
func TestRouterQueueModelGone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100))
		h.rq("router/a", 1, 1, lvl(0, 1))
		h.bye(events.Goodbye{Model: testModel, WorkerID: 1, Source: events.SourceEngine, BootID: 1, Seq: 100,
			SentAt: time.Now().UnixNano()})
		time.Sleep(DefaultGoneAfter + time.Second)
		synctest.Wait()
		if _, ok := h.sink.record(testModel); ok {
			t.Fatal("the record outlived its last worker")
		}
		// A new worker: a new model state, no queues.
		h.send(h.report(2, 0, 10, 100))
		rec := h.expectQueued(nil)
		if !reflect.DeepEqual(rec.Free, []uint64{2}) {
			t.Fatalf("free %v", rec.Free)
		}
	})
}

// TestRouterQueueCountsOneClock: the state stamps when a record carried
// the queues with the loop's clock, the one it receives reports by: with
// that clock far from the wall clock, a change of counts alone 200 ms
// after the last record is written at once.
func TestRouterQueueCountsOneClock(t *testing.T) {
	m, err := newMetrics(nil, func() float64 { return 0 })
	if err != nil {
		t.Fatal(err)
	}
	sink := newFakeSink()
	s := newState(DefaultConfig(), sink, m, slog.New(slog.DiscardHandler))
	dec := events.NewDecoder()
	now := time.Unix(1000, 0)
	send := func(subject string, data []byte, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		msg := decodeMessage(events.DefaultSubjectPrefix, 0, dec, subject, data)
		s.handle(&msg, now)
		s.flush(now)
	}
	load := events.LoadReport{Model: testModel, WorkerID: 1, DPSize: 1, Source: events.SourceEngine,
		ActiveDecodeBlocks: events.Some(10), KVTotalBlocks: events.Some(100), BootID: 1, Seq: 1, SentAt: now.UnixNano()}
	b, err := events.MarshalLoadReport(&load)
	send(events.LoadSubject(events.DefaultSubjectPrefix, testModel, 1, 0), b, err)
	rq := func(seq uint64, queued ...events.QueuedLevel) {
		t.Helper()
		r := events.RouterQueue{Model: testModel, Source: "router/a", BootID: 1, Seq: seq, Queued: queued, SentAt: now.UnixNano()}
		b, err := events.MarshalRouterQueue(&r)
		send(events.RqSubject(events.DefaultSubjectPrefix, testModel), b, err)
	}
	rq(1, lvl(0, 1))
	now = now.Add(2 * RouterQueueCountsEvery)
	rq(2, lvl(0, 2))
	if rec, _ := sink.record(testModel); rec.Queued[0] != 2 {
		t.Fatalf("queued %v %v after the last record, want the new count 2", rec.Queued, 2*RouterQueueCountsEvery)
	}
}
