package router

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/internal/watchmetrics"
	"github.com/workermon/workermon/registry"
)

// testEnv is a router in front of fake engines, fed by a real in-process
// NATS server whose buckets the test writes directly.
type testEnv struct {
	natsURL       string
	srv           *server.Server  // the NATS server
	natsOpts      *server.Options // its options, to bring it back after a stop
	busy, workers jetstream.KeyValue
	watcher       *busylist.Watcher
	registry      *registry.Watcher
	reg           *prometheus.Registry
	rt            *Router
	front         *httptest.Server
	seq           atomic.Uint64
}

type envOptions struct {
	config   func(*Config)
	watch    []busylist.WatchOption
	registry []registry.Option
}

func newTestEnv(t testing.TB, o envOptions) *testEnv {
	t.Helper()
	natsOpts := natstest.Options(t)
	srv := natstest.Start(t, natsOpts)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	e := &testEnv{reg: prometheus.NewRegistry(), natsURL: srv.ClientURL(), srv: srv, natsOpts: natsOpts}
	if e.busy, err = kvbucket.Open(ctx, js, events.BusyBucket, 1); err != nil {
		t.Fatal(err)
	}
	if e.workers, err = kvbucket.Open(ctx, js, events.WorkersBucket, 1); err != nil {
		t.Fatal(err)
	}
	if e.watcher, err = busylist.NewWatcher(js, append([]busylist.WatchOption{busylist.WithRegisterer(e.reg)}, o.watch...)...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.watcher.Close() })
	watchStats, err := watchmetrics.New(e.reg)
	if err != nil {
		t.Fatal(err)
	}
	if e.registry, err = registry.NewWatcher(js, append([]registry.Option{registry.WithStats(watchStats.Bucket(events.WorkersBucket))},
		o.registry...)...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.registry.Close() })
	for _, w := range []interface{ WaitReady(context.Context) error }{e.watcher, e.registry} {
		if err := w.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	cfg := DefaultConfig()
	cfg.BusyList, cfg.Registry, cfg.Registerer = e.watcher, e.registry, e.reg
	cfg.ConnectTimeout = time.Second
	if o.config != nil {
		o.config(&cfg)
	}
	if e.rt, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	e.front = httptest.NewServer(e.rt)
	t.Cleanup(func() {
		e.front.Close()
		_ = e.rt.Close()
	})
	return e
}

// putRecord writes a fresh (or dated) busy-set record and waits until the
// router has it.
func (e *testEnv) putRecord(t testing.TB, model string, free, busy []uint64, updated time.Time) {
	t.Helper()
	e.putSet(t, events.BusySet{Model: model, Free: free, Busy: busy, AllBusy: len(free) == 0 && len(busy) > 0,
		UpdatedAt: updated.UnixNano()})
}

// putSet writes set as the test monitor's next record (it sets MonitorID,
// Epoch and Seq) and waits until the router has it.
func (e *testEnv) putSet(t testing.TB, set events.BusySet) {
	t.Helper()
	seq := e.seq.Add(1)
	set.MonitorID, set.Epoch, set.Seq = "test", 1, seq
	data, err := events.MarshalBusySet(&set)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.busy.Put(t.Context(), events.ModelKey(set.Model), data); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "record seen by the router", func() bool {
		rec, _, ok := e.watcher.Record(set.Model)
		return ok && rec.Seq == seq
	})
}

// putWorker registers a worker and waits until the router has it.
func (e *testEnv) putWorker(t testing.TB, model string, id uint64, endpoint string) {
	t.Helper()
	data, err := json.Marshal(events.WorkerEntry{Model: model, WorkerID: id, Endpoint: endpoint, DPSize: 1,
		BootID: 7, RegisteredAt: time.Now().UnixNano()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.workers.Put(t.Context(), events.RegistryKey(model, id), data); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "worker seen by the router", func() bool {
		w, ok := e.registry.Lookup(model, id)
		return ok && w.Endpoint == endpoint
	})
}

// post sends a JSON body to path through the router.
func (e *testEnv) post(t *testing.T, path, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.front.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// readAll reads and closes a response body.
func readAll(t *testing.T, resp *http.Response) []byte {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// metric returns a counter's or gauge's value, a histogram's count, or -1
// when there is no such series.
func (e *testEnv) metric(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	if v, ok := promtest.Value(t, e.reg, name, labels); ok {
		return v
	}
	return -1
}

// engine is a fake OpenAI-compatible engine.
type engine struct {
	srv  *httptest.Server
	hits atomic.Int64
	mu   sync.Mutex
	reqs []engineRequest
}

type engineRequest struct {
	path, query string
	header      http.Header
	body        map[string]any
}

func newEngine(t *testing.T, h func(w http.ResponseWriter, r *http.Request, body map[string]any)) *engine {
	t.Helper()
	e := &engine{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		raw, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		var body map[string]any
		_ = json.Unmarshal(raw, &body)
		e.mu.Lock()
		e.reqs = append(e.reqs, engineRequest{path: r.URL.Path, query: r.URL.RawQuery, header: r.Header.Clone(), body: body})
		e.mu.Unlock()
		h(w, r, body)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *engine) requests() []engineRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]engineRequest(nil), e.reqs...)
}

// jsonEngine answers every request with a JSON completion naming name.
func jsonEngine(t *testing.T, name string) *engine {
	return newEngine(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Engine", name)
		fmt.Fprintf(w, `{"id":"cmpl-%s","object":"text_completion","choices":[{"index":0,"text":"hi from %s","finish_reason":"stop"}]}`, name, name)
	})
}

// closedEndpoint returns the URL of a loopback port nobody listens on.
func closedEndpoint(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

// sseEvent renders one event of a completion stream.
func sseEvent(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return "data: " + string(b) + "\n\n"
}

// completionChunk is a streamed completion chunk; finish may be "" (null)
// and usage nil.
func completionChunk(id, text, finish string, usage map[string]int) map[string]any {
	var fr any
	if finish != "" {
		fr = finish
	}
	c := map[string]any{"id": id, "object": "text_completion", "created": 1, "model": "m",
		"choices": []any{map[string]any{"index": 0, "text": text, "logprobs": nil, "finish_reason": fr}}}
	if usage != nil {
		c["usage"] = usage
	}
	return c
}

// streamResult is a client's reading of a relayed stream.
type streamResult struct {
	text   string
	ids    []string
	done   int
	errors []map[string]any
	usage  []map[string]any
	finish []string
	raw    string
}

// parseStream reads a relayed completion stream.
func parseStream(t *testing.T, raw []byte) streamResult {
	t.Helper()
	res := streamResult{raw: string(raw)}
	for ev := range strings.SplitSeq(string(raw), "\n\n") {
		data, ok := strings.CutPrefix(strings.TrimSpace(ev), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			res.done++
			continue
		}
		var c map[string]any
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("bad event %q: %v", data, err)
		}
		if e, ok := c["error"].(map[string]any); ok {
			res.errors = append(res.errors, e)
			continue
		}
		if id, ok := c["id"].(string); ok {
			res.ids = append(res.ids, id)
		}
		if u, ok := c["usage"].(map[string]any); ok {
			res.usage = append(res.usage, u)
		}
		for _, ch := range c["choices"].([]any) {
			ch := ch.(map[string]any)
			res.text += ch["text"].(string)
			if f, ok := ch["finish_reason"].(string); ok {
				res.finish = append(res.finish, f)
			}
		}
	}
	if res.done > 0 && !bytes.HasSuffix(raw, []byte("data: [DONE]\n\n")) {
		t.Errorf("stream does not end with [DONE]: %q", raw)
	}
	return res
}

// errorBody is the shape of the router's error bodies (contract §7c).
type errorBody struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    int    `json:"code"`
	Error   struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	} `json:"error"`
}

// errorBodyOf decodes a router error body, checking its shape.
func errorBodyOf(t *testing.T, b []byte) errorBody {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("error body %q: %v", b, err)
	}
	if len(m) != 4 {
		t.Errorf("error body %s: want exactly message, type, code and error", b)
	}
	var e errorBody
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatal(err)
	}
	// OpenAI's error object repeats the top level (contract §7c).
	if inner, _ := m["error"].(map[string]any); len(inner) != 4 || inner["param"] != nil ||
		e.Error.Message != e.Message || e.Error.Type != e.Type || e.Error.Code != e.Code {
		t.Errorf("error body %s: the error object does not repeat message, type and code with param null", b)
	}
	return e
}
