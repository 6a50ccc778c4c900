package admission

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

func TestParsePriority(t *testing.T) { // not parallel: AllocsPerRun
	for _, c := range []struct {
		v    string
		want Class
		ok   bool
	}{
		{"", ClassStandard, true},
		{"0", ClassStandard, true},
		{"-0", ClassStandard, true},
		{"+0", ClassStandard, true},
		{"-1", ClassSheddable, true},
		{"-100", ClassSheddable, true},
		{"1", ClassCritical, true},
		{"+5", ClassCritical, true},
		{" 2 ", ClassCritical, true},
		{"99999999999999999999999", ClassCritical, true},
		{"-99999999999999999999999", ClassSheddable, true},
		{"high", ClassStandard, false},
		{"1.5", ClassStandard, false},
		{"0x10", ClassStandard, false},
		{"1e3", ClassStandard, false},
		{"-", ClassStandard, false},
		{"1 2", ClassStandard, false},
	} {
		got, err := ParsePriority(c.v)
		if got != c.want || (err == nil) != c.ok {
			t.Errorf("ParsePriority(%q) = %v, %v; want %v, ok=%v", c.v, got, err, c.want, c.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidPriority) {
			t.Errorf("ParsePriority(%q): %v does not wrap ErrInvalidPriority", c.v, err)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = ParsePriority("-1") }); n != 0 {
		t.Errorf("ParsePriority: %v allocs", n)
	}
	for c, want := range map[Class]string{ClassSheddable: "sheddable", ClassStandard: "standard", ClassCritical: "critical"} {
		if c.String() != want {
			t.Errorf("%d.String() = %q", c, c.String())
		}
	}
	_, err := ParsePriority("high")
	if msg := BadPriorityMessage(err); msg != `X-Workermon-Priority "high" is not an integer (higher is more important; default 0)` {
		t.Errorf("message %q", msg)
	}
}

// TestClassFromRequest: the priority header given more than once is
// refused, whatever its values (issue 23, item 25); its value is cut in the
// message.
func TestClassFromRequest(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		values []string
		want   Class
		ok     bool
	}{
		{nil, ClassStandard, true},
		{[]string{"-2"}, ClassSheddable, true},
		{[]string{"1"}, ClassCritical, true},
		{[]string{"1", "1"}, ClassStandard, false},
		{[]string{"-1", "5"}, ClassStandard, false},
		{[]string{"", ""}, ClassStandard, false},
	} {
		r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
		for _, v := range c.values {
			r.Header.Add(PriorityHeader, v)
		}
		got, err := ClassFromRequest(r)
		if got != c.want || (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrInvalidPriority)) {
			t.Errorf("ClassFromRequest(%q) = %v, %v; want %v, ok=%v", c.values, got, err, c.want, c.ok)
		}
	}
	_, err := ParsePriority(strings.Repeat("x", 1<<20))
	if msg := BadPriorityMessage(err); len(msg) > 200 {
		t.Errorf("message of a 1 MiB header is %d bytes", len(msg))
	}
}

// TestDecideClassRecord: each class's candidates and rejection over records
// with amber and hard workers (contract §15).
func TestDecideClassRecord(t *testing.T) { // not parallel: AllocsPerRun
	now := time.Now().UnixNano()
	rec := func(free, amber, busy, hard []uint64) *events.BusySet {
		r := testSet("m", now, free, busy)
		r.Amber, r.Hard = amber, hard
		return &r
	}
	p := Policy{StaleAfter: testStaleAfter, FailOpen: true}
	type want struct {
		admit  bool
		reason Reason
		free   []uint64
		spare  []uint64
		busy   []uint64
	}
	for _, c := range []struct {
		name  string
		rec   *events.BusySet
		class Class
		want  want
	}{
		{"mixed, sheddable", rec([]uint64{1, 2, 3}, []uint64{2}, []uint64{4, 5}, []uint64{5}), ClassSheddable,
			want{true, ReasonFree, []uint64{1, 3}, nil, []uint64{2, 4, 5}}},
		{"mixed, standard", rec([]uint64{1, 2, 3}, []uint64{2}, []uint64{4, 5}, []uint64{5}), ClassStandard,
			want{true, ReasonFree, []uint64{1, 2, 3}, nil, []uint64{4, 5}}},
		{"mixed, critical", rec([]uint64{1, 2, 3}, []uint64{2}, []uint64{4, 5}, []uint64{5}), ClassCritical,
			want{true, ReasonFree, []uint64{1, 2, 3}, []uint64{4}, []uint64{4, 5}}},
		{"all free amber, sheddable: shed", rec([]uint64{1, 2}, []uint64{1, 2}, []uint64{3}, nil), ClassSheddable,
			want{false, ReasonShed, []uint64{}, nil, []uint64{1, 2, 3}}},
		{"all free amber, no busy, sheddable: shed", rec([]uint64{1}, []uint64{1}, nil, nil), ClassSheddable,
			want{false, ReasonShed, []uint64{}, nil, []uint64{1}}},
		{"all busy, sheddable: all busy", rec(nil, nil, []uint64{1, 2}, []uint64{2}), ClassSheddable,
			want{false, ReasonAllBusy, nil, nil, []uint64{1, 2}}},
		{"all busy, standard", rec(nil, nil, []uint64{1, 2}, []uint64{2}), ClassStandard,
			want{false, ReasonAllBusy, nil, nil, []uint64{1, 2}}},
		{"all busy, critical: the one not hard", rec(nil, nil, []uint64{1, 2}, []uint64{2}), ClassCritical,
			want{true, ReasonFree, nil, []uint64{1}, []uint64{1, 2}}},
		{"all hard, critical", rec(nil, nil, []uint64{1, 2}, []uint64{1, 2}), ClassCritical,
			want{false, ReasonAllBusy, nil, []uint64{}, []uint64{1, 2}}},
		{"only stale, sheddable", rec(nil, nil, nil, nil), ClassSheddable, want{true, ReasonFree, nil, nil, nil}},
		{"only stale, critical", rec(nil, nil, nil, nil), ClassCritical, want{true, ReasonFree, nil, nil, nil}},
		{"older record without levels, sheddable", rec([]uint64{1}, nil, []uint64{2}, nil), ClassSheddable,
			want{true, ReasonFree, []uint64{1}, nil, []uint64{2}}},
	} {
		cl := PrepareClasses(c.rec)
		d := p.DecideClassRecord(c.rec, &cl, c.class, false)
		eq := func(a, b []uint64) bool { return len(a) == len(b) && (len(a) == 0 || slices.Equal(a, b)) }
		if d.Admit != c.want.admit || d.Reason != c.want.reason || d.Class != c.class ||
			!eq(d.Free, c.want.free) || !eq(d.Spare, c.want.spare) || !eq(d.Busy, c.want.busy) {
			t.Errorf("%s: %+v, want %+v", c.name, d, c.want)
		}
		if c.class == ClassStandard {
			if d0 := p.DecideRecord(c.rec, false); d0.Admit != d.Admit || d0.Reason != d.Reason {
				t.Errorf("%s: standard %+v differs from DecideRecord %+v", c.name, d, d0)
			}
		}
		if n := testing.AllocsPerRun(100, func() { d = p.DecideClassRecord(c.rec, &cl, c.class, false) }); n != 0 {
			t.Errorf("%s: %v allocs", c.name, n)
		}
	}
	// Stale: the Policy decides, whatever the class.
	r := rec(nil, nil, []uint64{1}, []uint64{1})
	cl := PrepareClasses(r)
	for _, open := range []bool{true, false} {
		for _, c := range Classes() {
			d := Policy{StaleAfter: testStaleAfter, FailOpen: open}.DecideClassRecord(r, &cl, c, true)
			if d.Admit != open || d.Reason != ReasonStale || d.Class != c {
				t.Errorf("stale, open %v, %v: %+v", open, c, d)
			}
		}
	}
	// Lists without change share the record's.
	r = rec([]uint64{1, 2}, nil, []uint64{3}, nil)
	if cl := PrepareClasses(r); &cl.shed[0] != &r.Free[0] || &cl.spare[0] != &r.Busy[0] || &cl.avoid[0] != &r.Busy[0] {
		t.Error("PrepareClasses copied lists it did not change")
	}
}

func TestCandidatesSpare(t *testing.T) {
	t.Parallel()
	var registered []events.WorkerEntry
	for _, id := range []uint64{1, 2, 3, 4} {
		registered = append(registered, events.WorkerEntry{WorkerID: id, Endpoint: fmt.Sprint("http://w", id)})
	}
	ids := func(d Decision) []uint64 {
		var out []uint64
		for _, e := range d.Candidates(nil, registered) {
			out = append(out, e.WorkerID)
		}
		return out
	}
	for _, c := range []struct {
		name string
		d    Decision
		want []uint64
	}{
		{"free first", Decision{Admit: true, Free: []uint64{2}, Spare: []uint64{3}, Busy: []uint64{3, 4}}, []uint64{2}},
		{"no free registered: spare", Decision{Admit: true, Free: []uint64{9}, Spare: []uint64{3}, Busy: []uint64{3, 4}}, []uint64{3}},
		{"no spare registered: not busy", Decision{Admit: true, Free: []uint64{9}, Spare: []uint64{8}, Busy: []uint64{3, 4, 8}}, []uint64{1, 2}},
	} {
		if got := ids(c.d); !slices.Equal(got, c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// admitTestClassDecider decides by class from a table.
type admitTestClassDecider map[Class]Decision

func (d admitTestClassDecider) Decide(string) Decision { return d[ClassStandard] }
func (d admitTestClassDecider) DecideClass(_ string, c Class) Decision {
	dec := d[c]
	dec.Class = c
	return dec
}

func TestMiddlewareClasses(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	metrics, err := NewMetrics(reg, 10)
	if err != nil {
		t.Fatal(err)
	}
	d := admitTestClassDecider{
		ClassSheddable: {Reason: ReasonShed},
		ClassStandard:  {Admit: true, Reason: ReasonFree},
		ClassCritical:  {Reason: ReasonAllBusy},
	}
	m, err := NewMiddleware(d, WithModelFunc(ModelFromHeader("X-Model")), WithRetryAfter(3*time.Second), WithMetrics(metrics))
	if err != nil {
		t.Fatal(err)
	}
	h := m.Wrap(admitTestNext)
	serve := func(model, priority string) (*http.Response, string) {
		req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
		if model != "" {
			req.Header.Set("X-Model", model)
		}
		if priority != "" {
			req.Header.Set(PriorityHeader, priority)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Result(), rec.Body.String()
	}
	resp, body := serve("m", "-1")
	if resp.StatusCode != 429 || body != string(ShedBody(429)) {
		t.Errorf("sheddable: %d %s", resp.StatusCode, body)
	}
	checkRetryHeaders(t, resp.Header, 3*time.Second)
	if resp, body = serve("m", "0"); resp.StatusCode != 200 {
		t.Errorf("standard: %d %s", resp.StatusCode, body)
	}
	if resp, body = serve("m", "2"); resp.StatusCode != 503 || body != string(RejectBody(503)) {
		t.Errorf("critical: %d %s", resp.StatusCode, body)
	}
	checkRetryHeaders(t, resp.Header, 3*time.Second)
	resp, body = serve("m", "soon")
	if resp.StatusCode != 400 || !strings.Contains(body, `"type":"invalid_request_error"`) || !strings.Contains(body, `"code":400`) {
		t.Errorf("bad priority: %d %s", resp.StatusCode, body)
	}
	// No model: through, whatever the header says.
	if resp, body = serve("", "soon"); resp.StatusCode != 200 {
		t.Errorf("no model: %d %s", resp.StatusCode, body)
	}
	for class, want := range map[string][2]float64{"sheddable": {0, 1}, "standard": {1, 0}, "critical": {0, 1}} {
		for i, decision := range []string{"admitted", "rejected"} {
			if got := metricValue(t, reg, "workermon_router_class_decisions_total", map[string]string{"class": class, "decision": decision}); got != want[i] {
				t.Errorf("%s %s = %v, want %v", class, decision, got, want[i])
			}
		}
	}
	if got := metricValue(t, reg, "workermon_router_admissions_total", map[string]string{"outcome": OutcomeShed}); got != 1 {
		t.Errorf("outcome shed = %v", got)
	}

	// A Decider without classes: every class decided as standard.
	plain, err := NewMiddleware(admitTestDecisions, WithModelFunc(ModelFromHeader("X-Model")))
	if err != nil {
		t.Fatal(err)
	}
	if d := plain.DecideClass("busy", ClassCritical); d.Admit || d.Class != ClassCritical {
		t.Errorf("plain Decider, critical: %+v", d)
	}

	// Shed status option.
	for _, s := range []int{429, 503, 529} {
		m, err := NewMiddleware(d, WithShedStatus(s))
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		m.RejectDecision(rec, Decision{Reason: ReasonShed})
		if rec.Code != s || rec.Body.String() != string(ShedBody(s)) || m.RejectStatus(Decision{Reason: ReasonShed}) != s {
			t.Errorf("shed status %d: %d %s", s, rec.Code, rec.Body.String())
		}
	}
	if _, err := NewMiddleware(d, WithShedStatus(500)); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("shed status 500: %v", err)
	}
}
