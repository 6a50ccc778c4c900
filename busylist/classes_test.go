package busylist

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// classTestSet is a record with amber and hard workers.
func classTestSet(model string, now int64, free, amber, busy, hard []uint64) events.BusySet {
	rec := watchTestSet(model, now, free, busy)
	rec.Amber, rec.Hard = amber, hard
	return rec
}

// classTestModels are the records of TestDecideClass and BenchmarkDecide:
//
//	mixed:     free 1 2 3 4, amber 3 4, busy 5 6, hard 6
//	amber:     free 1 2 (both amber), busy 3 (hard)
//	spare:     busy 1 2, hard 2
//	hard:      busy 1 2, both hard
//	stale:     only stale workers
func classTestModels(now time.Time) []events.BusySet {
	n := now.UnixNano()
	stale := watchTestSet("stale/model", n, nil, nil)
	stale.Stale = []uint64{1}
	return []events.BusySet{
		classTestSet("mixed/model", n, []uint64{1, 2, 3, 4}, []uint64{3, 4}, []uint64{5, 6}, []uint64{6}),
		classTestSet("amber/model", n, []uint64{1, 2}, []uint64{1, 2}, []uint64{3}, []uint64{3}),
		classTestSet("spare/model", n, nil, nil, []uint64{1, 2}, []uint64{2}),
		classTestSet("hard/model", n, nil, nil, []uint64{1, 2}, []uint64{1, 2}),
		stale,
	}
}

// TestDecideClass: where each class may go, and what rejects it with which
// reason (contract §15).
func TestDecideClass(t *testing.T) { // not parallel: AllocsPerRun
	now := time.Now()
	w := admitTestWatcher(true, nil, classTestModels(now)...)
	var registered []events.WorkerEntry
	for id := range uint64(8) {
		registered = append(registered, events.WorkerEntry{WorkerID: id, Endpoint: fmt.Sprint("http://w", id)})
	}
	ids := func(d admission.Decision) []uint64 {
		var out []uint64
		for _, e := range d.Candidates(nil, registered) {
			out = append(out, e.WorkerID)
		}
		return out
	}
	const (
		shed     = admission.ClassSheddable
		standard = admission.ClassStandard
		critical = admission.ClassCritical
	)
	for _, c := range []struct {
		model  string
		class  admission.Class
		reason admission.Reason
		cands  []uint64
	}{
		{"mixed/model", shed, admission.ReasonFree, []uint64{1, 2}},
		{"mixed/model", standard, admission.ReasonFree, []uint64{1, 2, 3, 4}},
		{"mixed/model", critical, admission.ReasonFree, []uint64{1, 2, 3, 4}},
		// Every free worker amber: sheddable requests get the shed rejection.
		{"amber/model", shed, admission.ReasonShed, nil},
		{"amber/model", standard, admission.ReasonFree, []uint64{1, 2}},
		{"amber/model", critical, admission.ReasonFree, []uint64{1, 2}},
		// All busy: the all-busy rejection for sheddable and standard;
		// critical requests go to the busy workers that are not hard.
		{"spare/model", shed, admission.ReasonAllBusy, nil},
		{"spare/model", standard, admission.ReasonAllBusy, nil},
		{"spare/model", critical, admission.ReasonFree, []uint64{1}},
		{"hard/model", critical, admission.ReasonAllBusy, nil},
		// Only stale workers: every class admitted, to any registered worker.
		{"stale/model", shed, admission.ReasonFree, []uint64{0, 1, 2, 3, 4, 5, 6, 7}},
		{"stale/model", critical, admission.ReasonFree, []uint64{0, 1, 2, 3, 4, 5, 6, 7}},
		// No record: every class admitted.
		{"not/there", shed, admission.ReasonUnknownModel, []uint64{0, 1, 2, 3, 4, 5, 6, 7}},
		{"not/there", critical, admission.ReasonUnknownModel, []uint64{0, 1, 2, 3, 4, 5, 6, 7}},
	} {
		d := w.DecideClass(c.model, c.class)
		if d.Reason != c.reason || d.Class != c.class || d.Admit != (c.cands != nil) {
			t.Errorf("%s %v: %+v, want reason %v", c.model, c.class, d, c.reason)
		}
		if got := ids(d); !slices.Equal(got, c.cands) {
			t.Errorf("%s %v: candidates %v, want %v", c.model, c.class, got, c.cands)
		}
		if c.class == standard {
			if d0 := w.Decide(c.model); d0.Admit != d.Admit || d0.Reason != d.Reason {
				t.Errorf("%s: Decide %+v, DecideClass(standard) %+v", c.model, d0, d)
			}
		}
		var sink admission.Decision
		if n := testing.AllocsPerRun(1000, func() { sink = w.DecideClass(c.model, c.class) }); n != 0 {
			t.Errorf("DecideClass(%q, %v): %v allocs/op, want 0", c.model, c.class, n)
		}
		_ = sink
	}

	// A registered fallback skips amber workers for sheddable requests:
	// free 1 2 3 4 with 1 and 2 not registered, 3 and 4 amber.
	d := w.DecideClass("mixed/model", shed)
	var got []uint64
	for _, e := range d.Candidates(nil, registered[3:]) {
		got = append(got, e.WorkerID)
	}
	if want := []uint64{7}; !slices.Equal(got, want) {
		t.Errorf("sheddable fallback: %v, want %v (registered, listed neither busy nor amber)", got, want)
	}

	// A stale record admits every class when failing open, none when not.
	old := classTestSet("hard/model", now.Add(-time.Hour).UnixNano(), nil, nil, []uint64{1}, []uint64{1})
	for _, open := range []bool{true, false} {
		sw := admitTestWatcher(open, nil, old)
		for _, c := range admission.Classes() {
			if d := sw.DecideClass("hard/model", c); d.Reason != admission.ReasonStale || d.Admit != open {
				t.Errorf("stale record, fail open %v, %v: %+v", open, c, d)
			}
		}
	}
	// Not ready: as Decide.
	nr := &Watcher{policy: admission.Policy{StaleAfter: DefaultStaleListAfter, FailOpen: true}, now: time.Now}
	if d := nr.DecideClass("m", shed); d.Reason != admission.ReasonNotReady || !d.Admit || d.Class != shed {
		t.Errorf("not ready: %+v", d)
	}
}

// TestWatcherMiddlewareClasses runs the router side with priorities: a
// record with amber and hard workers in the bucket, a Watcher, admission's
// Middleware; 429 for a shed request, 503 for the others, 400 for a
// priority that is not a number.
func TestWatcherMiddlewareClasses(t *testing.T) {
	t.Parallel()
	kv, status := watchTestMiddleware(t)
	watchTestPut(t, kv, classTestSet("Qwen/Qwen3-0.6B", time.Now().UnixNano(), []uint64{1}, []uint64{1}, []uint64{2}, nil))
	natstest.WaitFor(t, 5*time.Second, "429 for sheddable requests", func() bool { s, _ := status("-1"); return s == 429 })
	if s, body := status("-1"); !strings.Contains(body, admission.ShedMessage) {
		t.Errorf("shed: %d %s", s, body)
	}
	for _, p := range []string{"", "0", "1"} {
		if s, _ := status(p); s != 200 {
			t.Errorf("priority %q: %d, want 200", p, s)
		}
	}
	if s, body := status("high"); s != 400 || !strings.Contains(body, admission.PriorityHeader) {
		t.Errorf("priority high: %d %s, want 400", s, body)
	}
	watchTestPut(t, kv, classTestSet("Qwen/Qwen3-0.6B", time.Now().UnixNano(), nil, nil, []uint64{1, 2}, []uint64{2}))
	natstest.WaitFor(t, 5*time.Second, "503 for standard requests", func() bool { s, _ := status("0"); return s == 503 })
	if s, _ := status("-5"); s != 503 {
		t.Errorf("sheddable, all busy: %d, want 503", s)
	}
	if s, _ := status("3"); s != 200 {
		t.Errorf("critical, a busy worker not hard: %d, want 200", s)
	}
}

// TestWriterSameContentLevels: a change of the amber or hard list alone is
// a change of the record (a worker crossing a level is written at once).
func TestWriterSameContentLevels(t *testing.T) {
	t.Parallel()
	base := classTestSet("m", 1, []uint64{1, 2}, []uint64{2}, []uint64{3}, nil)
	same := base
	same.UpdatedAt, same.Seq = 2, 9
	if !writerSameContent(&base, &same) {
		t.Error("records differing only by the writer's fields differ")
	}
	for name, change := range map[string]func(*events.BusySet){
		"amber":   func(r *events.BusySet) { r.Amber = []uint64{1, 2} },
		"hard":    func(r *events.BusySet) { r.Hard = []uint64{3} },
		"routers": func(r *events.BusySet) { r.Routers = 3 },
	} {
		other := base
		change(&other)
		if writerSameContent(&base, &other) {
			t.Errorf("a change of %s is not a change", name)
		}
	}
	empty := base
	empty.Hard = []uint64{}
	if !writerSameContent(&base, &empty) {
		t.Error("a nil and an empty hard list differ")
	}
}
