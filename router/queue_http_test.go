package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// queueEnv is a router with flow control on (wait up to maxWait), one
// registered worker, and a record listing it busy.
func queueEnv(t *testing.T, maxWait time.Duration, maxRequests int, watch ...busylist.WatchOption) (*testEnv, *engine) {
	t.Helper()
	env := newTestEnv(t, envOptions{config: func(c *Config) {
		c.QueueMaxWait = maxWait
		if maxRequests > 0 {
			c.QueueMaxRequests = maxRequests
		}
	}, watch: watch})
	e := jsonEngine(t, "1")
	env.putWorker(t, model, 1, e.srv.URL)
	env.putRecord(t, model, nil, []uint64{1}, time.Now())
	return env, e
}

// postWith sends a completion request with extra headers through the
// router, with ctx.
func (e *testEnv) postWith(ctx context.Context, t *testing.T, body string, header map[string]string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.front.URL+PathCompletions, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	return e.front.Client().Do(req)
}

// queued returns the depth of model's queue.
func (e *testEnv) queued() int64 {
	if e.rt.queue == nil {
		return 0
	}
	mq := e.rt.queue.lookup(model)
	if mq == nil {
		return 0
	}
	return mq.depth.Load()
}

func (e *testEnv) waitQueued(t *testing.T, n int64) {
	t.Helper()
	natstest.WaitFor(t, 10*time.Second, fmt.Sprintf("%d queued", n), func() bool { return e.queued() == n })
}

type answer struct {
	resp *http.Response
	body []byte
	err  error
}

// send sends a request in the background; its answer arrives on the
// returned channel.
func (e *testEnv) send(t *testing.T, ctx context.Context, body string, header map[string]string) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		resp, err := e.postWith(ctx, t, body, header)
		if err != nil {
			ch <- answer{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		ch <- answer{resp: resp, body: b, err: err}
	}()
	return ch
}

const queueBody = `{"model":"` + model + `","prompt":"hi"}`

// TestQueueWaitsThenDispatches: a request whose class has no candidate
// waits, shows in GET /queues and the depth gauge, and is sent once the
// record frees a worker, its answer carrying X-Workermon-Queued.
func TestQueueWaitsThenDispatches(t *testing.T) {
	t.Parallel()
	env, e := queueEnv(t, 30*time.Second, 0)
	ch := env.send(t, t.Context(), queueBody, map[string]string{TenantHeader: "team-a"})
	env.waitQueued(t, 1)
	if got := env.metric(t, "workermon_router_queue_depth", map[string]string{"model": model, "class": "standard"}); got != 1 {
		t.Errorf("queue depth gauge %v, want 1", got)
	}
	resp := env.get(t, PathQueues)
	var qa queuesAnswer
	if err := json.Unmarshal(readAll(t, resp), &qa); err != nil {
		t.Fatal(err)
	}
	if !qa.Enabled || len(qa.Models) != 1 || qa.Models[0].Model != model || qa.Models[0].Depth != 1 ||
		qa.Models[0].Classes["standard"].Tenants["team-a"] != 1 {
		t.Errorf("GET /queues = %+v, want one standard request of team-a for %s", qa, model)
	}
	if e.hits.Load() != 0 {
		t.Fatal("a queued request reached the engine")
	}
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	a := <-ch
	if a.err != nil || a.resp.StatusCode != http.StatusOK {
		t.Fatalf("answer %v %s, want 200", a.err, a.body)
	}
	if q := a.resp.Header.Get(QueuedHeader); q == "" {
		t.Error("no X-Workermon-Queued on the answer of a request that waited")
	} else if _, err := strconv.ParseUint(q, 10, 64); err != nil {
		t.Errorf("X-Workermon-Queued %q is not an integer", q)
	}
	if got := env.metric(t, "workermon_router_queue_wait_seconds", map[string]string{"class": "standard", "outcome": "dispatched"}); got != 1 {
		t.Errorf("wait{dispatched} count %v, want 1", got)
	}
	if got := env.metric(t, "workermon_router_queue_depth", map[string]string{"model": model, "class": "standard"}); got != 0 {
		t.Errorf("queue depth gauge %v after dispatch, want 0", got)
	}
	// A request that did not wait has no X-Workermon-Queued.
	direct := env.post(t, PathCompletions, queueBody)
	readAll(t, direct)
	if direct.StatusCode != http.StatusOK || direct.Header.Get(QueuedHeader) != "" {
		t.Errorf("direct request: %d, X-Workermon-Queued %q; want 200 and none", direct.StatusCode, direct.Header.Get(QueuedHeader))
	}
}

// get sends a GET through the router.
func (e *testEnv) get(t *testing.T, path string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, e.front.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// TestQueueExpiry: a request whose wait runs out gets the shed status with
// the §17 message, Retry-After and X-Workermon-Queued; a streamed one gets it
// as a plain JSON response. X-Workermon-Max-Wait shortens the wait.
func TestQueueExpiry(t *testing.T) {
	t.Parallel()
	env, e := queueEnv(t, 30*time.Second, 0)
	msg := regexp.MustCompile(`^Request waited (\d+) ms in the queue for model "` + regexp.QuoteMeta(model) +
		`": all workers stayed busy, please retry later$`)
	for _, body := range []string{queueBody, `{"model":"` + model + `","prompt":"hi","stream":true}`} {
		start := time.Now()
		resp, err := env.postWith(t.Context(), t, body, map[string]string{MaxWaitHeader: "150"})
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(t, resp)
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("status %d %s, want 429", resp.StatusCode, b)
		}
		if time.Since(start) < 150*time.Millisecond {
			t.Errorf("answered after %v, before the wait of 150 ms ran out", time.Since(start))
		}
		eb := errorBodyOf(t, b)
		m := msg.FindStringSubmatch(eb.Message)
		if m == nil || eb.Type != "service_unavailable" || eb.Code != 429 {
			t.Fatalf("body %s, want the expiry message", b)
		}
		if n, _ := strconv.Atoi(m[1]); n < 150 {
			t.Errorf("message says %d ms, want at least 150", n)
		}
		if q := resp.Header.Get(QueuedHeader); q != m[1] {
			t.Errorf("X-Workermon-Queued %q, the message says %s ms", q, m[1])
		}
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("Content-Type %q, want application/json", ct)
		}
		if resp.Header.Get("Retry-After") == "" || resp.Header.Get(QueuedHeader) == "" {
			t.Errorf("headers %v: want Retry-After and X-Workermon-Queued", resp.Header)
		}
	}
	if e.hits.Load() != 0 {
		t.Error("an expired request reached the engine")
	}
	if got := env.metric(t, "workermon_router_queue_wait_seconds", map[string]string{"class": "standard", "outcome": "expired"}); got != 2 {
		t.Errorf("wait{expired} count %v, want 2", got)
	}
}

// TestQueueStreamWritesNothingUntilDispatch: a streamed request that waits
// gets no byte, not even the headers, before it is sent.
func TestQueueStreamWritesNothingUntilDispatch(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.QueueMaxWait = 30 * time.Second }})
	e := newEngine(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, sseEvent(completionChunk("c", "hello", "stop", nil))+"data: [DONE]\n\n")
	})
	env.putWorker(t, model, 1, e.srv.URL)
	env.putRecord(t, model, nil, []uint64{1}, time.Now())
	headers := make(chan *http.Response, 1)
	go func() {
		resp, err := env.postWith(t.Context(), t, `{"model":"`+model+`","prompt":"hi","stream":true}`, nil)
		if err != nil {
			headers <- nil
			return
		}
		headers <- resp
	}()
	env.waitQueued(t, 1)
	select {
	case resp := <-headers:
		t.Fatalf("the client got an answer while queued: %v", resp)
	case <-time.After(100 * time.Millisecond):
	}
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	resp := <-headers
	if resp == nil {
		t.Fatal("request failed")
	}
	res := parseStream(t, readAll(t, resp))
	if resp.StatusCode != http.StatusOK || res.text != "hello" || resp.Header.Get(QueuedHeader) == "" {
		t.Fatalf("stream %d %q, X-Workermon-Queued %q", resp.StatusCode, res.raw, resp.Header.Get(QueuedHeader))
	}
}

// TestQueueNotWaiting: with X-Workermon-Max-Wait: 0, or flow control off,
// a request meets the all-busy 503 at once.
func TestQueueNotWaiting(t *testing.T) {
	t.Parallel()
	env, _ := queueEnv(t, 30*time.Second, 0)
	resp, err := env.postWith(t.Context(), t, queueBody, map[string]string{MaxWaitHeader: "0"})
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable || string(b) != string(admission.RejectBody(503)) ||
		resp.Header.Get(QueuedHeader) != "" {
		t.Errorf("max wait 0: %d %s queued=%q, want the all-busy 503 without X-Workermon-Queued", resp.StatusCode, b, resp.Header.Get(QueuedHeader))
	}
	off, _ := queueEnv(t, 0, 0)
	resp, err = off.postWith(t.Context(), t, queueBody, map[string]string{MaxWaitHeader: "5000"})
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("flow control off: %d %s, want 503", resp.StatusCode, b)
	}
}

// TestQueueMaxWaitZeroDoesNotOvertake: while the model's queue holds a
// request, a newcomer of the same priority never goes ahead of it (contract
// §17), whatever its X-Workermon-Max-Wait: with 0 it may not wait, so it
// gets the 429 of a wait that ran out, after 0 ms, and does not take the
// worker the queued request waits for. A newcomer of higher priority still
// goes ahead.
func TestQueueMaxWaitZeroDoesNotOvertake(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) {
		c.QueueMaxWait = 2 * time.Second
		c.QueuePace = time.Hour // the dispatcher's first turn comes after the test
	}})
	e := jsonEngine(t, "1")
	env.putWorker(t, model, 1, e.srv.URL)
	env.putRecord(t, model, nil, []uint64{1}, time.Now())

	queued := env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)
	env.putRecord(t, model, []uint64{1}, nil, time.Now()) // the worker frees

	resp, err := env.postWith(t.Context(), t, queueBody, map[string]string{MaxWaitHeader: "0"})
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp)
	want := `Request waited 0 ms in the queue for model "` + model + `": all workers stayed busy, please retry later`
	if resp.StatusCode != http.StatusTooManyRequests || errorBodyOf(t, b).Message != want ||
		resp.Header.Get(QueuedHeader) != "0" || resp.Header.Get("Retry-After") == "" {
		t.Errorf("a newcomer with %s: 0 behind a queued request: %d %s, %s %q; want 429 %q",
			MaxWaitHeader, resp.StatusCode, b, QueuedHeader, resp.Header.Get(QueuedHeader), want)
	}
	if n := e.hits.Load(); n != 0 {
		t.Errorf("%d requests reached the engine ahead of the queued one", n)
	}
	if got := env.metric(t, "workermon_router_queue_wait_seconds", map[string]string{"class": "standard", "outcome": "expired"}); got != 1 {
		t.Errorf("wait{expired} count %v, want 1", got)
	}

	resp, err = env.postWith(t.Context(), t, queueBody, map[string]string{MaxWaitHeader: "0", admission.PriorityHeader: "1"})
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK || e.hits.Load() != 1 {
		t.Errorf("a newcomer of higher priority with %s: 0: %d %s, want it sent ahead of the queue", MaxWaitHeader, resp.StatusCode, b)
	}
	<-queued
}

// TestQueueHeaders400: a malformed X-Workermon-Max-Wait or
// X-Workermon-Tenant is 400, also with flow control off.
func TestQueueHeaders400(t *testing.T) {
	t.Parallel()
	for _, maxWait := range []time.Duration{0, 30 * time.Second} {
		env, e := queueEnv(t, maxWait, 0)
		env.putRecord(t, model, []uint64{1}, nil, time.Now())
		for _, h := range []map[string]string{
			{MaxWaitHeader: "abc"}, {MaxWaitHeader: "-5"}, {MaxWaitHeader: "1.5"}, {MaxWaitHeader: "+3"}, {MaxWaitHeader: ""},
			{TenantHeader: strings.Repeat("t", 65)}, {TenantHeader: "a b"}, {TenantHeader: "é"}, {TenantHeader: "a\tb"},
		} {
			resp, err := env.postWith(t.Context(), t, queueBody, h)
			if err != nil {
				t.Fatal(err)
			}
			b := readAll(t, resp)
			if resp.StatusCode != http.StatusBadRequest {
				t.Errorf("max wait %v, headers %q: %d %s, want 400", maxWait, h, resp.StatusCode, b)
				continue
			}
			if eb := errorBodyOf(t, b); eb.Type != "invalid_request_error" {
				t.Errorf("type %q", eb.Type)
			}
		}
		for _, h := range []map[string]string{{MaxWaitHeader: "0"}, {MaxWaitHeader: "99999999999999999999999"},
			{TenantHeader: strings.Repeat("t", 64)}, {TenantHeader: "org-1/team~x"}} {
			resp, err := env.postWith(t.Context(), t, queueBody, h)
			if err != nil {
				t.Fatal(err)
			}
			if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
				t.Errorf("max wait %v, headers %q: %d %s, want 200", maxWait, h, resp.StatusCode, b)
			}
		}
		if e.hits.Load() != 4 {
			t.Errorf("engine hits %d, want 4", e.hits.Load())
		}
	}
	// Given twice.
	env, _ := queueEnv(t, 0, 0)
	for _, name := range []string{MaxWaitHeader, TenantHeader} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.front.URL+PathCompletions, strings.NewReader(queueBody))
		req.Header.Add(name, "1")
		req.Header.Add(name, "2")
		resp, err := env.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s twice: %d %s, want 400", name, resp.StatusCode, b)
		}
	}
}

// TestQueueFullHTTP: a full queue turns away a newcomer of equal priority
// with the §17 message at once, and a newcomer of higher priority evicts the
// newest request of the lowest priority, which gets that 429.
func TestQueueFullHTTP(t *testing.T) {
	t.Parallel()
	env, _ := queueEnv(t, 30*time.Second, 1)
	// Worker 1 busy and hard: no class has a candidate.
	env.putSet(t, events.BusySet{Model: model, Busy: []uint64{1}, Hard: []uint64{1}, AllBusy: true, UpdatedAt: time.Now().UnixNano()})
	const fullMsg = `The queue for model "` + model + `" is full, please retry later`
	first := env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)
	resp, err := env.postWith(t.Context(), t, queueBody, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp)
	if eb := errorBodyOf(t, b); resp.StatusCode != 429 || eb.Message != fullMsg || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("newcomer of equal priority: %d %s, want 429 %q", resp.StatusCode, b, fullMsg)
	}
	high := env.send(t, t.Context(), queueBody, map[string]string{admission.PriorityHeader: "1"})
	a := <-first
	if a.err != nil || a.resp.StatusCode != 429 || errorBodyOf(t, a.body).Message != fullMsg || a.resp.Header.Get(QueuedHeader) == "" {
		t.Fatalf("evicted request: %v %s, want 429 %q with X-Workermon-Queued", a.err, a.body, fullMsg)
	}
	env.waitQueued(t, 1)
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	if a := <-high; a.err != nil || a.resp.StatusCode != 200 {
		t.Fatalf("the request of higher priority: %v %s, want 200", a.err, a.body)
	}
	if got := env.metric(t, "workermon_router_queue_wait_seconds", map[string]string{"class": "standard", "outcome": "evicted"}); got != 2 {
		t.Errorf("wait{standard,evicted} count %v, want 2 (the refused and the evicted)", got)
	}
}

// TestQueueFullTenants: a full queue does not let one tenant keep the
// others out (issue 35 item 7): a newcomer of equal priority from a tenant
// that holds fewer queued requests than the largest tenant pushes out that
// tenant's newest, which gets the queue-full 429; a newcomer of the
// largest tenant is turned away.
func TestQueueFullTenants(t *testing.T) {
	t.Parallel()
	env, e := queueEnv(t, 30*time.Second, 2)
	const fullMsg = `The queue for model "` + model + `" is full, please retry later`
	a1 := env.send(t, t.Context(), queueBody, map[string]string{TenantHeader: "a"})
	env.waitQueued(t, 1)
	a2 := env.send(t, t.Context(), queueBody, map[string]string{TenantHeader: "a"})
	env.waitQueued(t, 2)
	resp, err := env.postWith(t.Context(), t, queueBody, map[string]string{TenantHeader: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != 429 || errorBodyOf(t, b).Message != fullMsg {
		t.Fatalf("a third request of the tenant that fills the queue: %d %s, want 429 %q", resp.StatusCode, b, fullMsg)
	}
	b1 := env.send(t, t.Context(), queueBody, map[string]string{TenantHeader: "b"})
	a := <-a2
	if a.err != nil || a.resp.StatusCode != 429 || errorBodyOf(t, a.body).Message != fullMsg || a.resp.Header.Get(QueuedHeader) == "" {
		t.Fatalf("tenant a's newest, once b arrives: %v %d %s, want 429 %q with %s", a.err, a.resp.StatusCode, a.body, fullMsg, QueuedHeader)
	}
	env.waitQueued(t, 2)
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	for name, ch := range map[string]<-chan answer{"a1": a1, "b1": b1} {
		if a := <-ch; a.err != nil || a.resp.StatusCode != http.StatusOK {
			t.Errorf("%s: %v %s, want 200", name, a.err, a.body)
		}
	}
	if n := e.hits.Load(); n != 2 {
		t.Errorf("engine hits %d, want 2", n)
	}
	if got := env.metric(t, "workermon_router_queue_wait_seconds", map[string]string{"class": "standard", "outcome": "evicted"}); got != 2 {
		t.Errorf("wait{standard,evicted} count %v, want 2 (the refused and the pushed out)", got)
	}
}

// TestQueueMaxBytes: the requests queued for every model together hold at
// most QueueMaxBytes of bodies (issue 35 item 6): past it a newcomer gets
// the queue-full 429, or pushes out the newest request of a lower
// priority; workermon_router_queue_bytes and GET /queues show the bytes
// held.
func TestQueueMaxBytes(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) {
		c.QueueMaxWait = 30 * time.Second
		c.MaxBodyBytes, c.QueueMaxBytes = 1000, 2000
	}})
	e := jsonEngine(t, "1")
	const other = "other/model"
	for _, m := range []string{model, other} {
		env.putWorker(t, m, 1, e.srv.URL)
		env.putSet(t, events.BusySet{Model: m, Busy: []uint64{1}, Hard: []uint64{1}, AllBusy: true, UpdatedAt: time.Now().UnixNano()})
	}
	body := func(m string) string { // 700 bytes
		b := `{"model":"` + m + `","prompt":"`
		return b + strings.Repeat("x", 700-len(b)-2) + `"}`
	}
	bytesQueued := func() float64 { return env.metric(t, "workermon_router_queue_bytes", nil) }
	const fullMsg = `The queue for model "` + model + `" is full, please retry later`

	first := env.send(t, t.Context(), body(model), nil)
	env.waitQueued(t, 1)
	second := env.send(t, t.Context(), body(other), nil) // another model's, the same budget
	natstest.WaitFor(t, 10*time.Second, "1400 bytes queued", func() bool { return bytesQueued() == 1400 })
	resp, err := env.postWith(t.Context(), t, body(model), nil)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != 429 || errorBodyOf(t, b).Message != fullMsg {
		t.Fatalf("a request past the bytes of the queues: %d %s, want 429 %q", resp.StatusCode, b, fullMsg)
	}
	var qa queuesAnswer
	if err := json.Unmarshal(readAll(t, env.get(t, PathQueues)), &qa); err != nil {
		t.Fatal(err)
	}
	if qa.MaxBytes != 2000 || qa.Bytes != 1400 || len(qa.Models) != 2 || qa.Models[0].Bytes != 700 {
		t.Errorf("GET /queues = %+v, want 1400 of 2000 bytes, 700 a model", qa)
	}
	// Of higher priority: pushes out the model's own request of priority 0.
	high := env.send(t, t.Context(), body(model), map[string]string{admission.PriorityHeader: "1"})
	if a := <-first; a.err != nil || a.resp.StatusCode != 429 || errorBodyOf(t, a.body).Message != fullMsg {
		t.Fatalf("pushed out: %v %s, want 429 %q", a.err, a.body, fullMsg)
	}
	for _, m := range []string{model, other} {
		env.putRecord(t, m, []uint64{1}, nil, time.Now())
	}
	for _, ch := range []<-chan answer{high, second} {
		if a := <-ch; a.err != nil || a.resp.StatusCode != http.StatusOK {
			t.Fatalf("queued request: %v %s, want 200", a.err, a.body)
		}
	}
	if got := bytesQueued(); got != 0 {
		t.Errorf("workermon_router_queue_bytes %v once the queues are empty, want 0", got)
	}
}

// TestQueueStaleRejectionAnsweredAtOnce: with fail-open off, a request
// rejected because the record is stale never joins the queue (issue 35 item
// 8), even while the queue holds requests the dispatcher has not released
// yet: it gets the all-busy 503 at once, without X-Workermon-Queued.
func TestQueueStaleRejectionAnsweredAtOnce(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) {
		c.QueueMaxWait = 30 * time.Second
		c.QueuePace = time.Hour // the dispatcher does not release the queue during the test
	}, watch: []busylist.WatchOption{busylist.WithFailOpen(false)}})
	e := jsonEngine(t, "1")
	env.putWorker(t, model, 1, e.srv.URL)
	env.putRecord(t, model, nil, []uint64{1}, time.Now())
	_ = env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)
	env.putRecord(t, model, nil, []uint64{1}, time.Now().Add(-time.Hour)) // stale on arrival
	natstest.WaitFor(t, 10*time.Second, "a stale record", func() bool {
		return env.watcher.DecideClass(model, admission.ClassStandard).Reason == admission.ReasonStale
	})
	start := time.Now()
	resp, err := env.postWith(t.Context(), t, queueBody, map[string]string{MaxWaitHeader: "3000"})
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable || string(b) != string(admission.RejectBody(503)) || resp.Header.Get(QueuedHeader) != "" {
		t.Errorf("a stale record's rejection behind a queue: %d %s, %s %q after %v; want the all-busy 503 at once, without %s",
			resp.StatusCode, b, QueuedHeader, resp.Header.Get(QueuedHeader), time.Since(start), QueuedHeader)
	}
	if n := env.queued(); n != 1 {
		t.Errorf("%d queued, want 1 (the request queued before)", n)
	}
}

// TestQueueFailOpen: a record that turns stale releases every queued
// request at once: admitted when failing open, the all-busy 503 when not.
func TestQueueFailOpen(t *testing.T) {
	t.Parallel()
	for _, open := range []bool{true, false} {
		t.Run(fmt.Sprint("open=", open), func(t *testing.T) {
			t.Parallel()
			env, e := queueEnv(t, 30*time.Second, 0, busylist.WithFailOpen(open))
			var chs []<-chan answer
			for range 5 {
				chs = append(chs, env.send(t, t.Context(), queueBody, nil))
			}
			env.waitQueued(t, 5)
			env.putRecord(t, model, nil, []uint64{1}, time.Now().Add(-time.Hour)) // stale on arrival
			for _, ch := range chs {
				a := <-ch
				if a.err != nil {
					t.Fatal(a.err)
				}
				want := http.StatusOK
				if !open {
					want = http.StatusServiceUnavailable
				}
				if a.resp.StatusCode != want || a.resp.Header.Get(QueuedHeader) == "" {
					t.Errorf("released request: %d %s, X-Workermon-Queued %q; want %d with the header", a.resp.StatusCode, a.body,
						a.resp.Header.Get(QueuedHeader), want)
				}
				if !open && string(a.body) != string(admission.RejectBody(503)) {
					t.Errorf("fail closed: body %s, want the all-busy body", a.body)
				}
			}
			if open && e.hits.Load() != 5 {
				t.Errorf("engine hits %d, want 5", e.hits.Load())
			}
		})
	}
}

// TestQueueRecordDeleted: a record that goes away releases the queue (the
// model is unknown: admitted).
func TestQueueRecordDeleted(t *testing.T) {
	t.Parallel()
	env, _ := queueEnv(t, 30*time.Second, 0)
	ch := env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)
	if err := env.busy.Delete(t.Context(), events.ModelKey(model)); err != nil {
		t.Fatal(err)
	}
	if a := <-ch; a.err != nil || a.resp.StatusCode != http.StatusOK {
		t.Fatalf("released request: %v %s, want 200", a.err, a.body)
	}
}

// dispatchers returns how many queue dispatchers run in the process.
func dispatchers() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), "router.(*modelQueue).run(")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// TestRouterCloseStopsDispatchers: Close ends the queues' dispatchers and
// returns once they have; a request still queued is released and decided
// again as if it never queued (here the all-busy 503), and a request that
// arrives later does not queue. Not parallel: it counts every dispatcher of
// the process.
func TestRouterCloseStopsDispatchers(t *testing.T) {
	env := newTestEnv(t, envOptions{config: func(c *Config) {
		c.QueueMaxWait = time.Hour
		c.QueuePace = time.Hour // the dispatcher sleeps through the test
	}})
	e := jsonEngine(t, "1")
	env.putWorker(t, model, 1, e.srv.URL)
	env.putRecord(t, model, nil, []uint64{1}, time.Now())
	queued := env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)
	if n := dispatchers(); n != 1 {
		t.Fatalf("%d dispatchers with one model's queue holding a request, want 1", n)
	}

	if err := env.rt.Close(); err != nil {
		t.Fatal(err)
	}
	if n := dispatchers(); n != 0 {
		t.Errorf("%d dispatchers left after Close", n)
	}
	var a answer
	select {
	case a = <-queued:
	case <-time.After(10 * time.Second):
		t.Fatal("the queued request was not answered after Close")
	}
	if a.err != nil || a.resp.StatusCode != http.StatusServiceUnavailable || string(a.body) != string(admission.RejectBody(503)) ||
		a.resp.Header.Get(QueuedHeader) == "" {
		t.Errorf("queued request at Close: %v %s, want the all-busy 503 with %s", a.err, a.body, QueuedHeader)
	}

	resp, err := env.postWith(t.Context(), t, queueBody, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get(QueuedHeader) != "" {
		t.Errorf("request after Close: %d %s, %s %q; want the all-busy 503 at once", resp.StatusCode, b, QueuedHeader, resp.Header.Get(QueuedHeader))
	}
	if n := dispatchers(); n != 0 || env.queued() != 0 {
		t.Errorf("%d dispatchers and %d queued after a request that arrived after Close", n, env.queued())
	}
	if e.hits.Load() != 0 {
		t.Error("a request reached the busy worker")
	}
}

// TestQueueDisconnects: thousands of queued requests whose clients go away
// leave the queue at once, and the goroutines and memory they held come
// back: a second round of them leaves the heap where the first left it.
func TestQueueDisconnects(t *testing.T) {
	// The record must not go stale while 2000 clients connect (tens of
	// seconds under the race detector on a loaded machine): a stale record
	// fails open and the queue is released to the engine.
	env, e := queueEnv(t, time.Hour, 5000, busylist.WithStaleListAfter(time.Hour))
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	defer client.CloseIdleConnections()
	baseline := runtime.NumGoroutine()
	const n = 2000
	var afterRound [2]uint64
	for round := range 2 {
		ctx, cancel := context.WithCancel(t.Context())
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, env.front.URL+PathCompletions, strings.NewReader(queueBody))
				if resp, err := client.Do(req); err == nil {
					_ = resp.Body.Close()
					t.Errorf("a queued request was answered %d", resp.StatusCode)
				}
			})
		}
		natstest.WaitFor(t, 60*time.Second, "all queued", func() bool { return env.queued() == n })
		runtime.GC()
		var peak runtime.MemStats
		runtime.ReadMemStats(&peak)
		cancel()
		natstest.WaitFor(t, 10*time.Second, "queue empty", func() bool { return env.queued() == 0 })
		wg.Wait()
		client.CloseIdleConnections()
		natstest.WaitFor(t, 10*time.Second, "goroutines back", func() bool { return runtime.NumGoroutine() <= baseline+5 })
		runtime.GC()
		runtime.GC() // the second empties the pools
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		afterRound[round] = after.HeapInuse
		t.Logf("round %d: heap in use %d with %d queued, %d after", round, peak.HeapInuse, n, after.HeapInuse)
		if round == 1 {
			if grew := int64(afterRound[1]) - int64(afterRound[0]); grew > int64(peak.HeapInuse-afterRound[1])/10 {
				t.Errorf("heap in use grew by %d bytes in a second round of %d queued requests (%d held while queued)",
					grew, n, peak.HeapInuse-afterRound[1])
			}
		}
	}
	if got := env.metric(t, "workermon_router_queue_wait_seconds", map[string]string{"class": "standard", "outcome": "gone"}); got != 2*n {
		t.Errorf("wait{gone} count %v, want %d", got, 2*n)
	}
	if e.hits.Load() != 0 {
		t.Error("a cancelled request reached the engine")
	}
	mq := env.rt.queue.lookup(model)
	mq.mu.Lock()
	defer mq.mu.Unlock()
	if n, b := mq.fq.Len(), env.rt.queue.budget.Used(); n != 0 || b != 0 {
		t.Errorf("%d requests and %d bytes left in an empty queue", n, b)
	}
}

// TestQueuePacingAcrossRouters: routers that share one record hand its
// free worker queued requests at most once per pace × the record's routers
// each, so three routers together hand it about one per pace (contract
// §17); with routers 1 each would hand it one per pace.
func TestQueuePacingAcrossRouters(t *testing.T) {
	t.Parallel()
	const pace = 20 * time.Millisecond
	env, e := queueEnv(t, time.Minute, 0)
	busy := events.BusySet{Model: model, Busy: []uint64{1}, Hard: []uint64{1}, AllBusy: true, Routers: 3}
	busy.UpdatedAt = time.Now().UnixNano()
	env.putSet(t, busy)
	var routers []*Router
	var fronts []string
	for range 3 {
		cfg := DefaultConfig()
		cfg.BusyList, cfg.Registry = env.watcher, env.registry
		cfg.QueueMaxWait, cfg.QueuePace = time.Minute, pace
		rt, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(rt)
		t.Cleanup(srv.Close)
		routers, fronts = append(routers, rt), append(fronts, srv.URL)
	}
	depth := func() (n int64) {
		for _, rt := range routers {
			if mq := rt.queue.lookup(model); mq != nil {
				n += mq.depth.Load()
			}
		}
		return n
	}
	const perRouter = 40
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for _, front := range fronts {
		for range perRouter {
			wg.Go(func() {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, front+PathCompletions, strings.NewReader(queueBody))
				if resp, err := http.DefaultClient.Do(req); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
				}
			})
		}
	}
	natstest.WaitFor(t, 20*time.Second, "all queued", func() bool { return depth() == 3*perRouter })

	start := time.Now()
	free := events.BusySet{Model: model, Free: []uint64{1}, Routers: 3, UpdatedAt: time.Now().UnixNano()}
	env.putSet(t, free)
	natstest.WaitFor(t, 20*time.Second, "9 dispatches", func() bool { return e.hits.Load() >= 9 })
	busy.UpdatedAt = time.Now().UnixNano()
	env.putSet(t, busy)
	took := time.Since(start)
	sent := int64(3*perRouter) - depth()
	// Each router: at most one per 3 paces, plus the first.
	if limit := 3 * (int64(took/(3*pace)) + 1); sent > limit {
		t.Errorf("%d queued requests sent in %v by 3 routers, want at most %d (each one per %v)", sent, took, limit, 3*pace)
	}
	t.Logf("%d queued requests sent in %v", sent, took)
	cancel()
}

// TestQueueDispatchedFallsBackOnItsDecision: a request queued while every
// worker was busy is dispatched to a worker that cannot be reached; the
// record by then lists the other worker neither free nor busy, so the
// dispatcher's decision lets it go there (§7: registered workers the record
// does not list busy). The fallback must follow that decision, not the
// all-busy rejection the request queued on (which answered 503).
func TestQueueDispatchedFallsBackOnItsDecision(t *testing.T) {
	t.Parallel()
	env, _ := queueEnv(t, 30*time.Second, 0)
	good := jsonEngine(t, "good")
	env.putWorker(t, model, 1, closedEndpoint(t))
	env.putWorker(t, model, 2, good.srv.URL)
	env.putRecord(t, model, nil, []uint64{1, 2}, time.Now())
	ch := env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	a := <-ch
	if a.err != nil {
		t.Fatal(a.err)
	}
	if a.resp.StatusCode != http.StatusOK || a.resp.Header.Get("X-Engine") != "good" {
		t.Fatalf("answer %d %s (engine %q), want 200 from worker 2", a.resp.StatusCode, a.body, a.resp.Header.Get("X-Engine"))
	}
}
