package router

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
)

// putClassRecord writes a record with amber and hard lists and waits until
// the router has it.
func (e *testEnv) putClassRecord(t *testing.T, free, amber, busy, hard []uint64) {
	t.Helper()
	e.putSet(t, events.BusySet{Model: model, Free: free, Amber: amber, Busy: busy, Hard: hard,
		AllBusy: len(free) == 0 && len(busy) > 0, UpdatedAt: time.Now().UnixNano()})
}

// postPriority sends a completion with the priority header (none when "").
func (e *testEnv) postPriority(t *testing.T, priority string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.front.URL+PathCompletions,
		strings.NewReader(`{"model":"`+model+`","prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if priority != "" {
		req.Header.Set(admission.PriorityHeader, priority)
	}
	resp, err := e.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// TestPriorityClasses: where each class lands with amber and hard workers,
// and what it is rejected with (contract §15).
func TestPriorityClasses(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.RetryAfter = 2 * time.Second }})
	engines := map[uint64]*engine{}
	for _, id := range []uint64{1, 2, 3, 4} {
		engines[id] = jsonEngine(t, string(rune('0'+id)))
		env.putWorker(t, model, id, engines[id].srv.URL)
	}
	// landsOn sends n requests of a priority and returns the engines that
	// answered.
	landsOn := func(priority string, n int) map[string]int {
		t.Helper()
		got := map[string]int{}
		for range n {
			resp := env.postPriority(t, priority)
			if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
				t.Fatalf("priority %q: status %d: %s", priority, resp.StatusCode, b)
			}
			got[resp.Header.Get("X-Engine")]++
		}
		return got
	}
	only := func(priority string, got map[string]int, want ...string) {
		t.Helper()
		for name := range got {
			if !strings.Contains(strings.Join(want, ","), name) {
				t.Errorf("priority %q reached engine %s; want only %v (%v)", priority, name, want, got)
			}
		}
	}

	// free 1 2 (2 amber), busy 3 4 (4 hard).
	env.putClassRecord(t, []uint64{1, 2}, []uint64{2}, []uint64{3, 4}, []uint64{4})
	only("-1", landsOn("-1", 20), "1")
	only("0", landsOn("0", 20), "1", "2")
	only("", landsOn("", 20), "1", "2")
	only("7", landsOn("7", 20), "1", "2")

	// Every free worker amber: sheddable requests get the 429 of §15.
	env.putClassRecord(t, []uint64{1, 2}, []uint64{1, 2}, []uint64{3, 4}, []uint64{4})
	resp := env.postPriority(t, "-3")
	body := readAll(t, resp)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("shed: %d, Content-Type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	checkRetryHeaders(t, resp.Header, 2*time.Second)
	const exact = `{"message":"Service temporarily unavailable for low-priority requests: workers are near capacity, please retry later","type":"service_unavailable","code":429,"error":{"message":"Service temporarily unavailable for low-priority requests: workers are near capacity, please retry later","type":"service_unavailable","param":null,"code":429}}`
	if string(body) != exact {
		t.Errorf("shed body %s\nwant %s", body, exact)
	}
	only("0", landsOn("0", 10), "1", "2")

	// Every worker busy: sheddable and standard get the all-busy 503;
	// critical requests go to the busy worker that is not hard.
	env.putClassRecord(t, nil, nil, []uint64{1, 2, 3, 4}, []uint64{1, 2, 4})
	for _, p := range []string{"-1", "0"} {
		resp := env.postPriority(t, p)
		if b := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable || !bytes.Equal(b, admission.RejectBody(503)) {
			t.Errorf("priority %s, all busy: %d %s", p, resp.StatusCode, b)
		}
		checkRetryHeaders(t, resp.Header, 2*time.Second)
	}
	only("1", landsOn("1", 10), "3")

	// Every worker hard: critical requests get the all-busy 503 too.
	env.putClassRecord(t, nil, nil, []uint64{1, 2, 3, 4}, []uint64{1, 2, 3, 4})
	resp = env.postPriority(t, "1")
	if b := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable || !bytes.Equal(b, admission.RejectBody(503)) {
		t.Errorf("critical, all hard: %d %s", resp.StatusCode, b)
	}

	// Not a number: 400 with the routers' error body.
	resp = env.postPriority(t, "urgent")
	if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"type":"invalid_request_error"`) ||
		!strings.Contains(string(b), admission.PriorityHeader) || !strings.Contains(string(b), `"error":{`) {
		t.Errorf("priority urgent: %d %s", resp.StatusCode, b)
	}

	// Metrics by class.
	for _, c := range []struct {
		class, decision string
		want            float64
	}{
		{"sheddable", "admitted", 20}, {"sheddable", "rejected", 2},
		{"standard", "admitted", 50}, {"standard", "rejected", 1},
		{"critical", "admitted", 30}, {"critical", "rejected", 1},
	} {
		if got := env.metric(t, "workermon_router_class_decisions_total", map[string]string{"class": c.class, "decision": c.decision}); got != c.want {
			t.Errorf("class_decisions{%s,%s} = %v, want %v", c.class, c.decision, got, c.want)
		}
	}
	if got := env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": admission.OutcomeShed}); got != 1 {
		t.Errorf("admissions{shed} = %v, want 1", got)
	}
}

// TestShedStatus: --shed-status sets the status of the shed rejection.
func TestShedStatus(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.ShedStatus = 529 }})
	env.putWorker(t, model, 1, jsonEngine(t, "1").srv.URL)
	env.putClassRecord(t, []uint64{1}, []uint64{1}, nil, nil)
	resp := env.postPriority(t, "-1")
	if b := readAll(t, resp); resp.StatusCode != 529 || !bytes.Equal(b, admission.ShedBody(529)) {
		t.Errorf("shed: %d %s", resp.StatusCode, b)
	}
}

// TestNoRegisteredCandidate checks contract §15 for a record whose
// candidates for the request's class are not registered (issue 22, item
// 15): a sheddable request whose registered workers are all amber gets the
// shed rejection, a critical one whose registered workers are all hard the
// all-busy 503, never "no workers available"; and the admission is counted
// only with a candidate.
func TestNoRegisteredCandidate(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	for _, id := range []uint64{1, 3} {
		env.putWorker(t, model, id, jsonEngine(t, string(rune('0'+id))).srv.URL)
	}
	admitted := func() float64 {
		return env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": admission.OutcomeAdmitted})
	}
	expect := func(what, priority string, status int, body []byte) {
		t.Helper()
		resp := env.postPriority(t, priority)
		if b := readAll(t, resp); resp.StatusCode != status || !bytes.Equal(b, body) || resp.Header.Get("Retry-After") == "" {
			t.Errorf("%s: %d %s, want %d %s", what, resp.StatusCode, b, status, body)
		}
	}

	// Free 1 (amber) and 2 (not registered); busy 3 and 4.
	env.putClassRecord(t, []uint64{1, 2}, []uint64{1}, []uint64{3, 4}, []uint64{3})
	expect("sheddable, registered workers amber or busy", "-1", http.StatusTooManyRequests, admission.ShedBody(429))
	if got := admitted(); got != 0 {
		t.Errorf("admissions{admitted} = %v after a shed request, want 0", got)
	}
	resp := env.postPriority(t, "0")
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK || resp.Header.Get("X-Engine") != "1" {
		t.Errorf("standard: %d %s, want 200 from engine 1", resp.StatusCode, b)
	}
	if got := admitted(); got != 1 {
		t.Errorf("admissions{admitted} = %v, want 1", got)
	}

	// Free 2 (not registered); busy 1 and 3, both hard.
	env.putClassRecord(t, []uint64{2}, nil, []uint64{1, 3}, []uint64{1, 3})
	expect("critical, registered workers hard", "1", http.StatusServiceUnavailable, admission.RejectBody(503))
	expect("standard, registered workers busy", "0", http.StatusServiceUnavailable, admission.RejectBody(503))
	expect("sheddable, registered workers busy", "-1", http.StatusServiceUnavailable, admission.RejectBody(503))

	if got := admitted(); got != 1 {
		t.Errorf("admissions{admitted} = %v, want 1: a request without a candidate is not admitted", got)
	}
	for _, c := range []struct {
		outcome string
		want    float64
	}{{admission.OutcomeShed, 1}, {admission.OutcomeRejected, 3}} {
		if got := env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": c.outcome}); got != c.want {
			t.Errorf("admissions{%s} = %v, want %v", c.outcome, got, c.want)
		}
	}
	for _, c := range []struct {
		class, decision string
		want            float64
	}{
		{"sheddable", "admitted", 0}, {"sheddable", "rejected", 2},
		{"standard", "admitted", 1}, {"standard", "rejected", 1},
		{"critical", "admitted", 0}, {"critical", "rejected", 1},
	} {
		if got := env.metric(t, "workermon_router_class_decisions_total", map[string]string{"class": c.class, "decision": c.decision}); got != c.want {
			t.Errorf("class_decisions{%s,%s} = %v, want %v", c.class, c.decision, got, c.want)
		}
	}
	if got := env.metric(t, "workermon_router_no_workers_total", nil); got != 0 {
		t.Errorf("no_workers = %v, want 0: workers are registered", got)
	}
}
