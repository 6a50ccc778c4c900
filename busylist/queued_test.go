package busylist

import (
	"testing"
	"time"

	"github.com/workermon/workermon/internal/natstest"
)

// TestWatcherQueuedByOthers (contract §22): what the other routers hold
// queued, by the record's queued_by less the asking router's own entry:
// their requests in all, the highest priority, those at a priority; nothing
// from a record received or updated 3 s ago or more, from a record without
// queues, or once the queues are gone from every record.
func TestWatcherQueuedByOthers(t *testing.T) {
	t.Parallel()
	e := watchTestStart(t)
	kv := e.bucket(t, "workermon-busy")
	clock := newWatchTestClock()
	w := watchTestNew(t, e.js, WithClock(clock.now))
	watchTestWaitReady(t, w)
	if o := w.QueuedByOthers("m", "router/me", 0); o != (QueuedOthers{}) {
		t.Fatalf("without a record: %+v", o)
	}
	var seq uint64
	put := func(model string, updated int64, by map[string]map[int64]uint64) {
		t.Helper()
		set := watchTestSet(model, updated, []uint64{1}, nil)
		set.QueuedBy = by
		seq++
		set.Seq = seq
		watchTestPut(t, kv, set)
		natstest.WaitFor(t, 5*time.Second, "record", func() bool { r, _, ok := w.Record(model); return ok && r.Seq == set.Seq })
	}
	put("m", clock.at(0), map[string]map[int64]uint64{
		"router/me": {5: 9},
		"router/a":  {0: 3, -1: 2},
		"router/b":  {1: 1, 0: 4},
		"router/c":  {}, // empty: not listed
	})
	for _, tc := range []struct {
		own  string
		p    int64
		want QueuedOthers
	}{
		{"router/me", 0, QueuedOthers{Known: true, N: 10, Top: 1, AtP: 7}},
		{"router/me", -1, QueuedOthers{Known: true, N: 10, Top: 1, AtP: 2}},
		{"router/b", 0, QueuedOthers{Known: true, N: 14, Top: 5, AtP: 3}},
		{"", 5, QueuedOthers{Known: true, N: 19, Top: 5, AtP: 9}},
	} {
		if o := w.QueuedByOthers("m", tc.own, tc.p); o != tc.want {
			t.Errorf("QueuedByOthers(%s, %d) = %+v, want %+v", tc.own, tc.p, o, tc.want)
		}
	}
	if got := w.OthersQueued("m", "router/me"); len(got) != 2 || got[0].Source != "router/a" || got[0].Levels[0].Priority != 0 ||
		got[1].Source != "router/b" || got[1].Levels[0].Priority != 1 {
		t.Errorf("OthersQueued = %+v", got)
	}
	// Only its own entry: nothing known.
	put("m", clock.at(0), map[string]map[int64]uint64{"router/me": {0: 1}})
	if o := w.QueuedByOthers("m", "router/me", 0); o != (QueuedOthers{}) {
		t.Errorf("only its own entry: %+v", o)
	}
	// Received 3 s ago: nothing; updated 3 s ago: nothing.
	put("m", clock.at(0), map[string]map[int64]uint64{"router/a": {0: 1}})
	clock.add(QueuedFreshFor - time.Nanosecond)
	if o := w.QueuedByOthers("m", "router/me", 0); !o.Known {
		t.Error("a record received just under 3 s ago is not counted")
	}
	clock.add(time.Nanosecond)
	if o := w.QueuedByOthers("m", "router/me", 0); o.Known {
		t.Errorf("a record received 3 s ago counts: %+v", o)
	}
	put("m", clock.at(-QueuedFreshFor), map[string]map[int64]uint64{"router/a": {0: 1}})
	if o := w.QueuedByOthers("m", "router/me", 0); o.Known || w.OthersQueued("m", "router/me") != nil {
		t.Errorf("a record updated 3 s ago counts: %+v", o)
	}
	// No record lists a queue any more: the look is one atomic load.
	if !w.anyQueued.Load() {
		t.Fatal("anyQueued unset while a record lists a queue")
	}
	put("m", clock.at(0), nil)
	if w.anyQueued.Load() {
		t.Fatal("anyQueued set while no record lists a queue")
	}
}
