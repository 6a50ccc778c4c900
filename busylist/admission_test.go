package busylist

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

// admitTestWatcher returns a Watcher with a fixed snapshot and no loop: every
// record received at the clock's current time.
func admitTestWatcher(failOpen bool, now func() time.Time, recs ...events.BusySet) *Watcher {
	w := &Watcher{staleAfter: DefaultStaleListAfter, failOpen: failOpen, now: now}
	m := make(map[string]*busyEntry, len(recs))
	for _, r := range recs {
		m[r.Model] = &busyEntry{rec: r, received: now()}
	}
	w.state.cur.Store(&m)
	return w
}

func TestDecisionCandidates(t *testing.T) { // not parallel: AllocsPerRun
	var registered []events.WorkerEntry
	for _, id := range []uint64{1, 2, 3, 4} {
		registered = append(registered, events.WorkerEntry{Model: "m", WorkerID: id, Endpoint: fmt.Sprint("http://w", id)})
	}
	ids := func(es []events.WorkerEntry) []uint64 {
		var out []uint64
		for _, e := range es {
			out = append(out, e.WorkerID)
		}
		return out
	}
	for _, c := range []struct {
		name string
		d    Decision
		want []uint64
	}{
		{"free and registered", Decision{Admit: true, Reason: ReasonFree, Free: []uint64{2, 4, 9}, Busy: []uint64{1}}, []uint64{2, 4}},
		{"free not registered: not busy", Decision{Admit: true, Reason: ReasonFree, Free: []uint64{9}, Busy: []uint64{1, 3}}, []uint64{2, 4}},
		{"no free, only stale workers", Decision{Admit: true, Reason: ReasonFree, Free: []uint64{}, Busy: []uint64{}}, []uint64{1, 2, 3, 4}},
		{"stale record", Decision{Admit: true, Reason: ReasonStale}, []uint64{1, 2, 3, 4}},
		{"unknown model", Decision{Admit: true, Reason: ReasonUnknownModel}, []uint64{1, 2, 3, 4}},
		{"rejected", Decision{Reason: ReasonAllBusy, Busy: []uint64{1, 2, 3, 4}}, nil},
		{"all registered busy", Decision{Admit: true, Reason: ReasonFree, Free: []uint64{9}, Busy: []uint64{1, 2, 3, 4}}, nil},
	} {
		got := ids(c.d.Candidates(nil, registered))
		if !watchTestEqualIDs(got, c.want) {
			t.Errorf("%s: candidates %v, want %v", c.name, got, c.want)
		}
	}
	buf := make([]events.WorkerEntry, 0, 8)
	d := Decision{Admit: true, Reason: ReasonFree, Free: []uint64{2, 3}}
	if n := testing.AllocsPerRun(100, func() { buf = d.Candidates(buf[:0], registered) }); n != 0 {
		t.Errorf("Candidates into a buffer: %v allocs", n)
	}
}

func TestDecideNotReady(t *testing.T) {
	t.Parallel()
	for _, failOpen := range []bool{true, false} {
		w := &Watcher{staleAfter: DefaultStaleListAfter, failOpen: failOpen, now: time.Now}
		d := w.Decide("m")
		if d.Admit != failOpen || d.Reason != ReasonNotReady {
			t.Errorf("failOpen=%v: Decide = %+v", failOpen, d)
		}
		wantOutcome := OutcomeNotReady
		if d.Outcome() != wantOutcome {
			t.Errorf("outcome %q", d.Outcome())
		}
	}
}

func TestDecisionHelpers(t *testing.T) {
	t.Parallel()
	d := Decision{Admit: true, Reason: ReasonFree, Free: []uint64{1, 5, 9}, Busy: []uint64{2, 3}}
	for id, want := range map[uint64][2]bool{1: {true, false}, 2: {false, true}, 4: {false, false}, 9: {true, false}} {
		if d.IsFree(id) != want[0] || d.IsBusy(id) != want[1] {
			t.Errorf("worker %d: free=%v busy=%v", id, d.IsFree(id), d.IsBusy(id))
		}
	}
	for _, c := range []struct {
		d    Decision
		want string
	}{
		{Decision{Admit: true, Reason: ReasonFree}, OutcomeAdmitted},
		{Decision{Reason: ReasonAllBusy}, OutcomeRejected},
		{Decision{Admit: true, Reason: ReasonStale}, OutcomeStaleOpen},
		{Decision{Reason: ReasonStale}, OutcomeStaleClosed},
		{Decision{Admit: true, Reason: ReasonUnknownModel}, OutcomeUnknownModel},
		{Decision{Admit: true, Reason: ReasonNotReady}, OutcomeNotReady},
	} {
		if got := c.d.Outcome(); got != c.want {
			t.Errorf("%+v: outcome %q, want %q", c.d, got, c.want)
		}
	}
	for r, want := range map[Reason]string{ReasonFree: "free", ReasonAllBusy: "all_busy",
		ReasonUnknownModel: "unknown_model", ReasonStale: "stale", ReasonNotReady: "not_ready"} {
		if r.String() != want {
			t.Errorf("%d.String() = %q", r, r.String())
		}
	}
}

// admitTestModels is a bucket's worth of records for the allocation test and
// the benchmark.
func admitTestModels(now time.Time) []events.BusySet {
	var recs []events.BusySet
	for i := range 50 {
		recs = append(recs, watchTestSet(fmt.Sprintf("org/model-%d.5B", i), now.UnixNano(),
			[]uint64{uint64(i), uint64(i + 100)}, []uint64{uint64(i + 200)}))
	}
	recs = append(recs, watchTestSet("busy/model", now.UnixNano(), nil, []uint64{1, 2}))
	return recs
}

func TestDecideAllocatesNothing(t *testing.T) { // not parallel: AllocsPerRun
	start := time.Now()
	clock := func() time.Time { return start }
	w := admitTestWatcher(true, clock, admitTestModels(start)...)
	stale := admitTestWatcher(true, func() time.Time { return start.Add(time.Minute) }, admitTestModels(start)...)
	for _, c := range []struct {
		w      *Watcher
		model  string
		reason Reason
	}{
		{w, "org/model-7.5B", ReasonFree},
		{w, "busy/model", ReasonAllBusy},
		{w, "not/there", ReasonUnknownModel},
		{stale, "org/model-7.5B", ReasonStale},
		{&Watcher{failOpen: true, now: clock}, "org/model-7.5B", ReasonNotReady},
	} {
		if d := c.w.Decide(c.model); d.Reason != c.reason {
			t.Fatalf("Decide(%q) = %+v, want %v", c.model, d, c.reason)
		}
		var sink Decision
		if n := testing.AllocsPerRun(1000, func() { sink = c.w.Decide(c.model) }); n != 0 {
			t.Errorf("Decide(%q) (%v): %v allocs/op, want 0", c.model, c.reason, n)
		}
		_ = sink
	}
}

func BenchmarkDecide(b *testing.B) {
	now := time.Now()
	w := admitTestWatcher(true, time.Now, admitTestModels(now)...)
	b.Run("free", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if d := w.Decide("org/model-7.5B"); !d.Admit {
				b.Fatal("rejected")
			}
		}
	})
	b.Run("all_busy", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if d := w.Decide("busy/model"); d.Admit {
				b.Fatal("admitted")
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				_ = w.Decide("org/model-7.5B")
			}
		})
	})
}

func TestAdmissionMetrics(t *testing.T) { // not parallel: AllocsPerRun
	reg := prometheus.NewRegistry()
	m, err := NewAdmissionMetrics(reg, 2)
	if err != nil {
		t.Fatal(err)
	}
	// A second set on the same registry shares the collectors.
	m2, err := NewAdmissionMetrics(reg, 2)
	if err != nil {
		t.Fatal(err)
	}
	reject := Decision{Reason: ReasonAllBusy}
	for _, model := range []string{"a", "b", "a", "c", "d", "\xff invalid"} {
		m.Observe(model, reject)
	}
	m.Observe("a", Decision{Admit: true, Reason: ReasonFree})
	m.Observe("a", Decision{Admit: true, Reason: ReasonStale})
	m2.Observe("a", Decision{Reason: ReasonStale})
	m.ObserveNoModel()

	watchTestWantSeries(t, reg, "workermon_router_requests_rejected_total", nil, "model", map[string]float64{"a": 3, "b": 1, "other": 3})
	for _, model := range []string{"c", "d"} {
		if v := watchTestMetric(t, reg, "workermon_router_requests_rejected_total", map[string]string{"model": model}); v != -1 {
			t.Errorf("model %q got a label of its own beyond the cap", model)
		}
	}
	watchTestWantSeries(t, reg, "workermon_router_admissions_total", nil, "outcome", map[string]float64{OutcomeRejected: 6, OutcomeAdmitted: 1, OutcomeStaleOpen: 1,
		OutcomeStaleClosed: 1, OutcomeNoModel: 1, OutcomeUnknownModel: 0, OutcomeNotReady: 0})
	if _, err := NewAdmissionMetrics(reg, 0); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("cap 0: %v", err)
	}
	// Counting an admitted decision allocates nothing.
	if n := testing.AllocsPerRun(100, func() { m.Observe("a", Decision{Admit: true, Reason: ReasonFree}) }); n != 0 {
		t.Errorf("Observe admitted: %v allocs", n)
	}
	if n := testing.AllocsPerRun(100, func() { m.Observe("a", reject) }); n != 0 {
		t.Errorf("Observe rejected, known model: %v allocs", n)
	}
}
