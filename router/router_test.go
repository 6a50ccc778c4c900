package router

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

const model = "Qwen/Qwen3-0.6B"

func TestRoutesOnlyToFreeWorkers(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	engines := map[uint64]*engine{1: jsonEngine(t, "1"), 2: jsonEngine(t, "2"), 3: jsonEngine(t, "3")}
	for id, e := range engines {
		env.putWorker(t, model, id, e.srv.URL)
	}
	env.putRecord(t, model, []uint64{1, 2}, []uint64{3}, time.Now())

	const n = 60
	for range n {
		resp := env.post(t, PathCompletions, `{"model":"`+model+`","prompt":"hi"}`)
		if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	if h := engines[3].hits.Load(); h != 0 {
		t.Errorf("busy worker 3 got %d requests", h)
	}
	if h1, h2 := engines[1].hits.Load(), engines[2].hits.Load(); h1 == 0 || h2 == 0 || h1+h2 != n {
		t.Errorf("free workers got %d and %d requests, want both some, %d in all", h1, h2, n)
	}
	if got := env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": admission.OutcomeAdmitted}); got != n {
		t.Errorf("admitted = %v, want %d", got, n)
	}
	// The duration is observed after the last byte went out.
	natstest.WaitFor(t, 5*time.Second, "every duration observed", func() bool {
		return env.metric(t, "workermon_router_request_duration_seconds", map[string]string{"route": routeCompletions, "code": "200"}) == n
	})

	// A free worker that is not registered is no candidate; with no free
	// worker registered, the registered ones not busy are.
	env.putRecord(t, model, []uint64{9}, []uint64{1, 2}, time.Now())
	resp := env.post(t, PathCompletions, `{"model":"`+model+`"}`)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK || resp.Header.Get("X-Engine") != "3" {
		t.Errorf("status %d from %q: %s; want 200 from the only worker not busy, 3", resp.StatusCode, resp.Header.Get("X-Engine"), b)
	}
}

func TestRejectAllBusy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		status     int
		retryAfter time.Duration
	}{
		{"default 503", 0, 0},
		{"429", http.StatusTooManyRequests, 1500 * time.Millisecond},
		{"529", 529, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, envOptions{config: func(c *Config) {
				if tc.status != 0 {
					c.RejectStatus = tc.status
				}
				if tc.retryAfter != 0 {
					c.RetryAfter = tc.retryAfter
				}
			}})
			e := jsonEngine(t, "1")
			env.putWorker(t, model, 1, e.srv.URL)
			env.putRecord(t, model, nil, []uint64{1}, time.Now())
			resp := env.post(t, PathChatCompletions, `{"model":"`+model+`","messages":[]}`)
			body := readAll(t, resp)
			want := tc.status
			if want == 0 {
				want = http.StatusServiceUnavailable
			}
			if resp.StatusCode != want {
				t.Errorf("status %d, want %d", resp.StatusCode, want)
			}
			if ct := resp.Header.Values("Content-Type"); len(ct) != 1 || ct[0] != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
			checkRetryHeaders(t, resp.Header, cmp.Or(tc.retryAfter, DefaultRetryAfter))
			if !bytes.Equal(body, admission.RejectBody(want)) {
				t.Errorf("body %s\nwant %s", body, admission.RejectBody(want))
			}
			if want == http.StatusServiceUnavailable {
				const exact = `{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503,"error":{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","param":null,"code":503}}`
				if string(body) != exact {
					t.Errorf("body %s\nwant %s", body, exact)
				}
			}
			if e.hits.Load() != 0 {
				t.Error("a rejected request reached the engine")
			}
			if got := env.metric(t, "workermon_router_requests_rejected_total", map[string]string{"model": model}); got != 1 {
				t.Errorf("rejected{model} = %v, want 1", got)
			}
		})
	}
}

func TestStaleList(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		failOpen bool
	}{{"fail open", true}, {"fail closed", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, envOptions{watch: []busylist.WatchOption{
				busylist.WithStaleListAfter(time.Second), busylist.WithFailOpen(tc.failOpen)}})
			e := jsonEngine(t, "1")
			env.putWorker(t, model, 1, e.srv.URL)
			// An all-busy record from a monitor that stopped a minute ago.
			env.putRecord(t, model, nil, []uint64{1}, time.Now().Add(-time.Minute))
			resp := env.post(t, PathCompletions, `{"model":"`+model+`"}`)
			body := readAll(t, resp)
			if tc.failOpen {
				if resp.StatusCode != http.StatusOK || e.hits.Load() != 1 {
					t.Errorf("status %d, engine hits %d: want the stale list ignored", resp.StatusCode, e.hits.Load())
				}
				if got := env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": admission.OutcomeStaleOpen}); got != 1 {
					t.Errorf("stale_open = %v, want 1", got)
				}
				return
			}
			if resp.StatusCode != http.StatusServiceUnavailable || !bytes.Equal(body, admission.RejectBody(503)) {
				t.Errorf("status %d body %s: want the rejection", resp.StatusCode, body)
			}
			if got := env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": admission.OutcomeStaleClosed}); got != 1 {
				t.Errorf("stale_closed = %v, want 1", got)
			}
		})
	}
}

func TestNoRegisteredWorkers(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	for _, m := range []string{model, "never-heard-of"} {
		resp := env.post(t, PathCompletions, `{"model":"`+m+`"}`)
		body := readAll(t, resp)
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("%s: status %d", m, resp.StatusCode)
		}
		if bytes.Equal(body, admission.RejectBody(503)) {
			t.Errorf("%s: the all-busy body for a model without workers", m)
		}
		eb := errorBodyOf(t, body)
		if !strings.Contains(eb.Message, "no workers available") || eb.Type != "service_unavailable" || eb.Code != 503 {
			t.Errorf("%s: body %s", m, body)
		}
		if resp.Header.Get("Content-Type") != "application/json" {
			t.Errorf("%s: headers %v", m, resp.Header)
		}
		checkRetryHeaders(t, resp.Header, DefaultRetryAfter)
	}
	if got := env.metric(t, "workermon_router_no_workers_total", nil); got != 2 {
		t.Errorf("no_workers = %v, want 2", got)
	}
}

func TestUnknownModelAdmitted(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	a, b := jsonEngine(t, "a"), jsonEngine(t, "b")
	const unknown = "meta-llama/Llama-3.1-8B-Instruct"
	env.putWorker(t, unknown, 1, a.srv.URL)
	env.putWorker(t, unknown, 2, b.srv.URL+"/")
	for range 20 {
		resp := env.post(t, PathCompletions, `{"model":"`+unknown+`","prompt":"x"}`)
		if body := readAll(t, resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
	}
	if a.hits.Load() == 0 || b.hits.Load() == 0 {
		t.Errorf("hits a=%d b=%d: want both registered workers used", a.hits.Load(), b.hits.Load())
	}
	for _, r := range b.requests() {
		if r.path != PathCompletions {
			t.Errorf("endpoint with a trailing slash: path %q", r.path)
		}
	}
	if got := env.metric(t, "workermon_router_admissions_total", map[string]string{"outcome": admission.OutcomeUnknownModel}); got != 20 {
		t.Errorf("unknown_model = %v, want 20", got)
	}
}

func TestClientCancellationReachesEngine(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	started, cancelled := make(chan struct{}), make(chan struct{})
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		close(started)
		select {
		case <-r.Context().Done():
			close(cancelled)
		case <-time.After(20 * time.Second):
		}
	})
	env.putWorker(t, model, 1, e.srv.URL)
	env.putRecord(t, model, []uint64{1}, nil, time.Now())

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, env.front.URL+PathCompletions,
		strings.NewReader(`{"model":"`+model+`","prompt":"long"}`))
	errc := make(chan error, 1)
	go func() {
		resp, err := env.front.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("the request did not reach the engine")
	}
	cancel()
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the engine did not see its request cancelled")
	}
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Errorf("client error %v", err)
	}
	natstest.WaitFor(t, 5*time.Second, "cancellation counted", func() bool {
		return env.metric(t, "workermon_router_cancellations_total", map[string]string{"route": routeCompletions}) == 1
	})
	natstest.WaitFor(t, 5*time.Second, "code 499 recorded", func() bool {
		return env.metric(t, "workermon_router_request_duration_seconds", map[string]string{"code": "499"}) == 1
	})
}

func TestClientCancellationMidStream(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	cancelled := make(chan struct{})
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, sseEvent(completionChunk("c", "first", "", nil)))
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
			close(cancelled)
		case <-time.After(20 * time.Second):
		}
	})
	env.putWorker(t, model, 1, e.srv.URL)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, env.front.URL+PathCompletions,
		strings.NewReader(`{"model":"`+model+`","prompt":"p","stream":true}`))
	resp, err := env.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(line, "first") {
		t.Fatalf("first line %q, %v", line, err)
	}
	cancel()
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the engine did not see its stream cancelled")
	}
	natstest.WaitFor(t, 5*time.Second, "cancellation counted", func() bool {
		return env.metric(t, "workermon_router_cancellations_total", map[string]string{"route": routeCompletions}) == 1
	})
}

func TestRetryOnUnreachableWorker(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	good := jsonEngine(t, "good")
	env.putWorker(t, model, 1, closedEndpoint(t))
	env.putWorker(t, model, 2, good.srv.URL)
	env.putRecord(t, model, []uint64{1, 2}, nil, time.Now())
	const n = 20
	for range n {
		resp := env.post(t, PathCompletions, `{"model":"`+model+`"}`)
		if body := readAll(t, resp); resp.StatusCode != http.StatusOK || resp.Header.Get("X-Engine") != "good" {
			t.Fatalf("status %d from %q: %s", resp.StatusCode, resp.Header.Get("X-Engine"), body)
		}
	}
	if good.hits.Load() != n {
		t.Errorf("good worker hits %d, want %d", good.hits.Load(), n)
	}
	retries := env.metric(t, "workermon_router_upstream_retries_total", nil)
	connect := env.metric(t, "workermon_router_upstream_errors_total", map[string]string{"kind": upstreamConnect})
	if retries < 1 || retries != connect {
		t.Errorf("retries %v, connect errors %v: want equal and at least 1", retries, connect)
	}

	// None answers: 502 with the shared error shape.
	env.putWorker(t, "other", 1, closedEndpoint(t))
	env.putWorker(t, "other", 2, closedEndpoint(t))
	env.putWorker(t, "other", 3, "not a url")
	resp := env.post(t, PathCompletions, `{"model":"other"}`)
	body := readAll(t, resp)
	eb := errorBodyOf(t, body)
	if resp.StatusCode != http.StatusBadGateway || eb.Code != 502 || eb.Type != typeUpstream || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("status %d body %s", resp.StatusCode, body)
	}
}

func TestMaxRetries(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.MaxRetries = 1 }})
	for id := range uint64(4) {
		env.putWorker(t, model, id, closedEndpoint(t))
	}
	resp := env.post(t, PathCompletions, `{"model":"`+model+`"}`)
	if body := readAll(t, resp); resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if got := env.metric(t, "workermon_router_upstream_errors_total", map[string]string{"kind": upstreamConnect}); got != 2 {
		t.Errorf("connect errors %v, want 2 (one try and one retry)", got)
	}
}

func TestUpstreamHeaderTimeout(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.UpstreamTimeout = 200 * time.Millisecond }})
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		select {
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	})
	env.putWorker(t, model, 1, e.srv.URL)
	env.putWorker(t, model, 2, e.srv.URL)
	resp := env.post(t, PathCompletions, `{"model":"`+model+`"}`)
	body := readAll(t, resp)
	if eb := errorBodyOf(t, body); resp.StatusCode != http.StatusGatewayTimeout || eb.Code != 504 {
		t.Errorf("status %d body %s", resp.StatusCode, body)
	}
	if e.hits.Load() != 1 {
		t.Errorf("engine hits %d: a timeout must not be retried", e.hits.Load())
	}
}

func TestNonStreamingPassThrough(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	const answer = `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}`
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		if body["model"] == "bad" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprint(w, `{"object":"error","message":"bad","code":400}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Request-Id", "abc")
		w.Header().Set("Connection", "X-Secret")
		w.Header().Set("X-Secret", "hop")
		fmt.Fprint(w, answer)
	})
	env.putWorker(t, model, 1, e.srv.URL)
	env.putWorker(t, "bad", 1, e.srv.URL)

	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.front.URL+PathChatCompletions+"?trace=1",
		strings.NewReader(`{"model":"`+model+`","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer k")
	req.Header.Set("Content-Type", "application/json")
	resp, err := env.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp)
	if resp.StatusCode != http.StatusOK || string(body) != answer {
		t.Errorf("status %d body %s", resp.StatusCode, body)
	}
	if resp.Header.Get("X-Request-Id") != "abc" || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("headers not copied: %v", resp.Header)
	}
	if resp.Header.Get("X-Secret") != "" {
		t.Error("a header named by Connection was forwarded")
	}
	got := e.requests()[0]
	if got.path != PathChatCompletions || got.query != "trace=1" || got.header.Get("Authorization") != "Bearer k" ||
		got.header.Get("X-Forwarded-For") != "127.0.0.1" {
		t.Errorf("engine got %+v", got)
	}

	resp = env.post(t, PathCompletions, `{"model":"bad"}`)
	if body := readAll(t, resp); resp.StatusCode != http.StatusBadRequest || string(body) != `{"object":"error","message":"bad","code":400}` {
		t.Errorf("engine error: status %d body %s", resp.StatusCode, body)
	}
}

func TestBadRequests(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.MaxBodyBytes = 1024 }})
	e := jsonEngine(t, "1")
	env.putWorker(t, model, 1, e.srv.URL)
	big := `{"model":"` + model + `","prompt":"` + strings.Repeat("x", 2048) + `"}`
	for _, tc := range []struct {
		name, body string
		chunked    bool
		status     int
	}{
		{"bad JSON", `{"model":`, false, 400},
		{"not an object", `["model"]`, false, 400},
		{"no model", `{"prompt":"x"}`, false, 400},
		{"null model", `{"model":null}`, false, 400},
		{"model not a string", `{"model":42}`, false, 400},
		{"model only in another case", `{"Model":"` + model + `"}`, false, 400},
		{"empty model", `{"model":""}`, false, 400},
		{"empty body", ``, false, 400},
		{"too large", big, false, 413},
		{"too large, chunked", big, true, 413},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rd io.Reader = strings.NewReader(tc.body)
			if tc.chunked {
				rd = io.MultiReader(rd) // hides the length: sent chunked
			}
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.front.URL+PathCompletions, rd)
			resp, err := env.front.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body := readAll(t, resp)
			eb := errorBodyOf(t, body)
			if resp.StatusCode != tc.status || eb.Code != tc.status || eb.Type != typeInvalidRequest || eb.Message == "" {
				t.Errorf("status %d body %s", resp.StatusCode, body)
			}
		})
	}
	if e.hits.Load() != 0 {
		t.Errorf("engine hits %d", e.hits.Load())
	}
}

// TestModelKeyExactCase: the router decides on the model the engine
// serves — the last top-level key "model" exactly, as Python's json reads
// it. encoding/json also matched "Model", so {"model":busy,"Model":free}
// was admitted for a free model's workers and served as the busy one.
func TestModelKeyExactCase(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	e := jsonEngine(t, "1")
	env.putWorker(t, model, 1, e.srv.URL)
	env.putWorker(t, "free/model", 2, e.srv.URL)
	env.putRecord(t, model, nil, []uint64{1}, time.Now())        // busy
	env.putRecord(t, "free/model", []uint64{2}, nil, time.Now()) // free
	for _, body := range []string{
		`{"model":"` + model + `","Model":"free/model","prompt":"x"}`,
		`{"MODEL":"free/model","model":"` + model + `","prompt":"x"}`,
		`{"model":"free/model","model":"` + model + `","prompt":"x"}`,
	} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.front.URL+PathCompletions, strings.NewReader(body))
		resp, err := env.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if b := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("%s: %d %s, want the 503 of %s, whose workers are all busy", body, resp.StatusCode, b, model)
		}
	}
	if e.hits.Load() != 0 {
		t.Errorf("engine hits %d", e.hits.Load())
	}
}

func TestOtherRoutes(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	env.putWorker(t, "b-model", 1, "http://127.0.0.1:1")
	env.putRecord(t, "a-model", []uint64{1}, nil, time.Now())
	env.putRecord(t, "b-model", []uint64{1}, nil, time.Now())

	get := func(path string) (*http.Response, []byte) {
		t.Helper()
		resp, err := env.front.Client().Get(env.front.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		return resp, readAll(t, resp)
	}
	resp, body := get(PathModels)
	var list modelList
	if err := json.Unmarshal(body, &list); err != nil || resp.StatusCode != 200 {
		t.Fatalf("models: %d %s", resp.StatusCode, body)
	}
	if list.Object != "list" || len(list.Data) != 2 || list.Data[0].ID != "a-model" || list.Data[1].ID != "b-model" ||
		list.Data[0].Object != "model" {
		t.Errorf("models %s", body)
	}
	if resp, body := get("/healthz"); resp.StatusCode != 200 {
		t.Errorf("healthz %d %s", resp.StatusCode, body)
	}
	if resp, body := get("/readyz"); resp.StatusCode != 200 {
		t.Errorf("readyz %d %s", resp.StatusCode, body)
	}
	resp, body = get(PathCompletions)
	if eb := errorBodyOf(t, body); resp.StatusCode != http.StatusMethodNotAllowed || eb.Code != 405 || resp.Header.Get("Allow") != "POST" {
		t.Errorf("GET completions: %d %s", resp.StatusCode, body)
	}
	resp, body = get("/v2/nothing")
	if eb := errorBodyOf(t, body); resp.StatusCode != http.StatusNotFound || eb.Code != 404 {
		t.Errorf("unknown path: %d %s", resp.StatusCode, body)
	}
}

// notReady is a busy list and registry that never load.
type notReady struct{}

func (notReady) Decide(string) admission.Decision {
	return admission.Decision{Admit: true, Reason: admission.ReasonNotReady}
}
func (notReady) DecideClass(_ string, c admission.Class) admission.Decision {
	return admission.Decision{Admit: true, Reason: admission.ReasonNotReady, Class: c}
}
func (notReady) Models() []string { return nil }
func (notReady) Ready() bool      { return false }

type notReadyRegistry struct{ notReady }

func (notReadyRegistry) Endpoints(string) []events.WorkerEntry { return nil }
func (notReadyRegistry) Live() bool                            { return false }

func TestReadyz(t *testing.T) {
	t.Parallel()
	rt, err := New(Config{BusyList: notReady{}, Registry: notReadyRegistry{}, RejectStatus: 503, ShedStatus: 429, RetryAfter: time.Second,
		MaxBodyBytes: 1, UpstreamTimeout: time.Second, ConnectTimeout: time.Second,
		ReadyCheck: func() error { return errors.New("NATS not connected") }})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	rt.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	body := rec.Body.String()
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(body, "NATS not connected") ||
		!strings.Contains(body, "busy list not loaded") || !strings.Contains(body, "registry not loaded") {
		t.Errorf("readyz %d %q", rec.Code, body)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	ok := DefaultConfig()
	ok.BusyList, ok.Registry = notReady{}, notReadyRegistry{}
	if err := ok.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
	}{
		{"nil busy list", func(c *Config) { c.BusyList = nil }},
		{"nil registry", func(c *Config) { c.Registry = nil }},
		{"reject status 500", func(c *Config) { c.RejectStatus = 500 }},
		{"shed status 200", func(c *Config) { c.ShedStatus = 200 }},
		{"zero retry-after", func(c *Config) { c.RetryAfter = 0 }},
		{"zero body", func(c *Config) { c.MaxBodyBytes = 0 }},
		{"negative timeout", func(c *Config) { c.UpstreamTimeout = -time.Second }},
		{"zero connect timeout", func(c *Config) { c.ConnectTimeout = 0 }},
		{"negative retries", func(c *Config) { c.MaxRetries = -1 }},
		{"negative migration limit", func(c *Config) { c.MigrationLimit = -1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := ok
			tc.mutate(&c)
			if err := c.Validate(); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("Validate() = %v", err)
			}
			if _, err := New(c); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("New() = %v", err)
			}
		})
	}
}

// TestRegistryNotRead: while the registry has not been read, a request is
// answered "no workers available" saying so, not "no worker is registered"
// (an operator would look for a missing engine).
func TestRegistryNotRead(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	cfg.BusyList, cfg.Registry = notReady{}, notReadyRegistry{}
	rt, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	rt.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, PathCompletions, strings.NewReader(`{"model":"m","prompt":"hi"}`)))
	body := rec.Body.String()
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(body, "no workers available") ||
		!strings.Contains(body, "has not been read yet") || strings.Contains(body, "no worker is registered") {
		t.Errorf("got %d %s; want 503 saying the registry has not been read", rec.Code, body)
	}
}

// TestMigratableHeader: only a request whose stream the router can
// continue is marked migratable; a client cannot mark one itself.
func TestMigratableHeader(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		limit int
		body  string
		want  string
	}{
		{"streamed completion, migration on", 2, `{"model":"m","prompt":"hi","stream":true}`, "1"},
		{"streamed completion, migration off", 0, `{"model":"m","prompt":"hi","stream":true}`, ""},
		{"not streamed", 2, `{"model":"m","prompt":"hi"}`, ""},
		{"prompt list", 2, `{"model":"m","prompt":["a","b"],"stream":true}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, envOptions{config: func(c *Config) { c.MigrationLimit = tc.limit }})
			e := jsonEngine(t, "a")
			env.putWorker(t, "m", 1, e.srv.URL)
			env.putRecord(t, "m", []uint64{1}, nil, time.Now())
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, env.front.URL+PathCompletions, strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set(events.MigratableHeader, "1") // the client's own: never passed on
			resp, err := env.front.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			reqs := e.requests()
			if len(reqs) != 1 {
				t.Fatalf("engine saw %d requests (status %d)", len(reqs), resp.StatusCode)
			}
			if got := reqs[0].header.Get(events.MigratableHeader); got != tc.want {
				t.Errorf("%s = %q, want %q", events.MigratableHeader, got, tc.want)
			}
		})
	}
}

// TestUnreachableFreeWorkerOthersBusy: the only worker a request may use
// cannot be reached (an engine just killed, still listed free) and the
// record lists the model's other workers busy. The router answers as it
// would have had the dead worker already gone stale: the rejection of the
// request's class (503 all busy; 429 for a sheddable one), with
// Retry-After, never a 502 (contract §20: a live router answers 200, 429
// or 503). A critical request goes on to the busy worker. Found by the
// chaos run (docs/ha.md).
func TestUnreachableFreeWorkerOthersBusy(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	good := jsonEngine(t, "good")
	env.putWorker(t, model, 1, closedEndpoint(t))
	env.putWorker(t, model, 2, good.srv.URL)
	env.putRecord(t, model, []uint64{1}, []uint64{2}, time.Now())
	for _, c := range []struct {
		priority string
		status   int
		typ      string
	}{
		{"0", http.StatusServiceUnavailable, "service_unavailable"},
		{"-1", http.StatusTooManyRequests, "service_unavailable"},
		{"1", http.StatusOK, ""},
	} {
		resp := env.postPriority(t, c.priority)
		body := readAll(t, resp)
		if resp.StatusCode != c.status {
			t.Errorf("priority %s: status %d, want %d: %s", c.priority, resp.StatusCode, c.status, body)
			continue
		}
		if c.status == http.StatusOK {
			if resp.Header.Get("X-Engine") != "good" {
				t.Errorf("priority %s: served by %q, want the busy worker", c.priority, resp.Header.Get("X-Engine"))
			}
			continue
		}
		if eb := errorBodyOf(t, body); eb.Code != c.status || eb.Type != c.typ || resp.Header.Get("Retry-After") == "" {
			t.Errorf("priority %s: body %s, Retry-After %q", c.priority, body, resp.Header.Get("Retry-After"))
		}
	}
	if got := good.hits.Load(); got != 1 {
		t.Errorf("the busy worker got %d requests, want only the critical one", got)
	}
}
