package admission

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

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
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: candidates %v, want %v", c.name, got, c.want)
		}
	}
	buf := make([]events.WorkerEntry, 0, 8)
	d := Decision{Admit: true, Reason: ReasonFree, Free: []uint64{2, 3}}
	if n := testing.AllocsPerRun(100, func() { buf = d.Candidates(buf[:0], registered) }); n != 0 {
		t.Errorf("Candidates into a buffer: %v allocs", n)
	}
}

func TestPolicyDecide(t *testing.T) { // not parallel: AllocsPerRun
	start := time.Unix(1_700_000_000, 0)
	limit := testStaleAfter
	free := testSet("m", start.UnixNano(), []uint64{1, 3}, []uint64{2})
	busy := testSet("m", start.UnixNano(), nil, []uint64{1, 2})
	for _, c := range []struct {
		name     string
		failOpen bool
		rec      *events.BusySet
		received time.Time
		now      time.Time
		admit    bool
		reason   Reason
	}{
		{"no record", false, nil, start, start, true, ReasonUnknownModel},
		{"free", false, &free, start, start, true, ReasonFree},
		{"all busy", true, &busy, start, start, false, ReasonAllBusy},
		{"received at the limit: fresh", false, &busy, start, start.Add(limit), false, ReasonAllBusy},
		{"received past the limit: stale, open", true, &busy, start, start.Add(limit + 1), true, ReasonStale},
		{"received past the limit: stale, closed", false, &free, start, start.Add(limit + 1), false, ReasonStale},
		{"updated_at past the limit", true, &busy, start.Add(limit), start.Add(limit + 1), true, ReasonStale},
	} {
		p := Policy{StaleAfter: limit, FailOpen: c.failOpen}
		d := p.Decide(c.rec, c.received, c.now)
		if d.Admit != c.admit || d.Reason != c.reason {
			t.Errorf("%s: Decide = %+v, want admit=%v reason=%v", c.name, d, c.admit, c.reason)
		}
		if c.reason == ReasonFree || c.reason == ReasonAllBusy {
			if !slices.Equal(d.Free, c.rec.Free) || !slices.Equal(d.Busy, c.rec.Busy) {
				t.Errorf("%s: lists %v %v, want the record's", c.name, d.Free, d.Busy)
			}
		}
		if n := testing.AllocsPerRun(100, func() { d = p.Decide(c.rec, c.received, c.now) }); n != 0 {
			t.Errorf("%s: %v allocs/op, want 0", c.name, n)
		}
	}
	for _, failOpen := range []bool{true, false} {
		d := Policy{StaleAfter: limit, FailOpen: failOpen}.NotReady()
		if d.Admit != failOpen || d.Reason != ReasonNotReady || d.Outcome() != OutcomeNotReady {
			t.Errorf("failOpen=%v: NotReady = %+v (%s)", failOpen, d, d.Outcome())
		}
	}
}

// testStaleAfter is the stale-list-after of the tests.
const testStaleAfter = 10 * time.Second

func testSet(model string, now int64, free, busy []uint64) events.BusySet {
	return events.BusySet{
		Model:     model,
		Free:      free,
		Busy:      busy,
		AllBusy:   len(free) == 0 && len(busy) > 0,
		UpdatedAt: now,
		MonitorID: "test",
		Epoch:     1,
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

func TestMetrics(t *testing.T) { // not parallel: AllocsPerRun
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg, 2)
	if err != nil {
		t.Fatal(err)
	}
	// A second set on the same registry shares the collectors.
	m2, err := NewMetrics(reg, 2)
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

	wantSeries(t, reg, "workermon_router_requests_rejected_total", nil, "model", map[string]float64{"a": 3, "b": 1, "other": 3})
	for _, model := range []string{"c", "d"} {
		if v := metricValue(t, reg, "workermon_router_requests_rejected_total", map[string]string{"model": model}); v != -1 {
			t.Errorf("model %q got a label of its own beyond the cap", model)
		}
	}
	wantSeries(t, reg, "workermon_router_admissions_total", nil, "outcome", map[string]float64{OutcomeRejected: 6, OutcomeAdmitted: 1, OutcomeStaleOpen: 1,
		OutcomeStaleClosed: 1, OutcomeNoModel: 1, OutcomeUnknownModel: 0, OutcomeNotReady: 0})
	if _, err := NewMetrics(reg, 0); !errors.Is(err, ErrInvalidOption) {
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
