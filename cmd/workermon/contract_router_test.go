package main_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/vmihailenco/msgpack/v5"
)

// startNATS runs a JetStream NATS server in the test process.
func startNATS(t testing.TB) string {
	t.Helper()
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats server not ready")
	}
	t.Cleanup(s.Shutdown)
	return s.ClientURL()
}

// ensureKV creates a bucket (history 1, ttl) unless it exists.
func ensureKV(t testing.TB, c *natsClient, bucket string, ttl time.Duration) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	kv, err := c.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1, TTL: ttl})
	if errors.Is(err, jetstream.ErrBucketExists) {
		return c.kv(t, bucket)
	}
	if err != nil {
		t.Fatalf("create %s: %v", bucket, err)
	}
	return kv
}

// routerNATS starts a NATS server with the buckets a router reads: its URL,
// workermon-busy and workermon-workers (30s TTL).
func routerNATS(t testing.TB) (natsURL string, bkv, wkv jetstream.KeyValue) {
	t.Helper()
	natsURL = startNATS(t)
	c := connect(t, natsURL)
	return natsURL, ensureKV(t, c, busyBucket, 0), ensureKV(t, c, workersBucket, 30*time.Second)
}

// router is one `workermon router` process.
type router struct {
	*proc
	base string
}

func startRouter(t testing.TB, natsURL string, flags ...string) *router {
	t.Helper()
	for attempt := 1; ; attempt++ {
		addr := freeAddr(t)
		args := append([]string{"router", "--nats-url", natsURL, "--http-addr", addr, "--stale-list-after", "1s"}, flags...)
		p := startProc(t, "router", args...)
		r := &router{proc: p, base: "http://" + addr}
		err := waitHTTPErr(p, r.base+"/readyz", 15*time.Second)
		if err == nil {
			return r
		}
		if attempt < 4 && addrInUse(err, p) {
			t.Logf("port taken, retrying: %v", err)
			continue
		}
		t.Fatal(err)
	}
}

// engine is a fake OpenAI-compatible engine.
type engine struct {
	id   uint64
	srv  *httptest.Server
	hits atomic.Int64
	mu   sync.Mutex
	reqs []engineReq
}

type engineReq struct {
	path string
	body []byte
}

func (e *engine) requests() []engineReq {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]engineReq(nil), e.reqs...)
}

// newEngine starts an engine; handler nil answers {"engine": id} as JSON.
func newEngine(t testing.TB, id uint64, handler func(e *engine, w http.ResponseWriter, r *http.Request, body []byte)) *engine {
	t.Helper()
	e := &engine{id: id}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		e.hits.Add(1)
		e.mu.Lock()
		e.reqs = append(e.reqs, engineReq{path: r.URL.Path, body: body})
		e.mu.Unlock()
		if handler != nil {
			handler(e, w, r, body)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"engine":%d,"path":%q}`, id, r.URL.Path)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func register(t testing.TB, wkv jetstream.KeyValue, model string, id uint64, endpoint string) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": model, "worker_id": id, "endpoint": endpoint, "dp_start": 0, "dp_size": 1,
		"boot_id": uint64(12345), "registered_at": time.Now().UnixNano()})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := wkv.Put(ctx, fmt.Sprintf("%s.%d", modelKey(model), id), b); err != nil {
		t.Fatal(err)
	}
}

// registerEngines registers each engine as worker e.id of model.
func registerEngines(t testing.TB, wkv jetstream.KeyValue, model string, es ...*engine) {
	t.Helper()
	for _, e := range es {
		register(t, wkv, model, e.id, e.srv.URL)
	}
}

// recordBytes encodes a BusySet record.
func recordBytes(model string, busy, free []uint64, updatedAt time.Time, seq uint64) []byte {
	rec := map[string]any{"v": 1, "model": model, "busy": nz(busy), "free": nz(free), "stale": []uint64{},
		"all_busy": len(free) == 0 && len(busy) > 0, "reasons": reasonsOf(busy),
		"thresholds": map[string]any{"active_prefill_tokens_threshold": uint64(100)},
		"updated_at": updatedAt.UnixNano(), "monitor_id": "contract-test", "epoch": uint64(1), "seq": seq}
	b, err := msgpack.Marshal(rec)
	if err != nil {
		panic(err)
	}
	return b
}

// putRecord writes a BusySet record by hand.
func putRecord(t testing.TB, bkv jetstream.KeyValue, model string, busy, free []uint64, updatedAt time.Time, seq uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := bkv.Put(ctx, modelKey(model), recordBytes(model, busy, free, updatedAt, seq)); err != nil {
		t.Fatal(err)
	}
}

// liveRecord re-puts a record every 200ms (a live monitor's heartbeat)
// until stop; set changes what is put.
type liveRecord struct {
	mu         sync.Mutex
	busy, free []uint64
	stop       func()
}

func keepRecord(t testing.TB, bkv jetstream.KeyValue, model string, busy, free []uint64) *liveRecord {
	lr := &liveRecord{busy: busy, free: free}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var seq uint64 = 1
	putRecord(t, bkv, model, busy, free, time.Now(), seq)
	go func() {
		defer close(done)
		tk := time.NewTicker(200 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
				lr.mu.Lock()
				b, f := lr.busy, lr.free
				lr.mu.Unlock()
				seq++
				pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
				_, _ = bkv.Put(pctx, modelKey(model), recordBytes(model, b, f, time.Now(), seq))
				pcancel()
			}
		}
	}()
	var once sync.Once
	lr.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(lr.stop)
	return lr
}

// set changes the lists; the next put carries them.
func (lr *liveRecord) set(busy, free []uint64) {
	lr.mu.Lock()
	lr.busy, lr.free = busy, free
	lr.mu.Unlock()
}

func nz(v []uint64) []uint64 {
	if v == nil {
		return []uint64{}
	}
	return v
}

func reasonsOf(busy []uint64) map[string]string {
	r := map[string]string{}
	for _, id := range busy {
		r[strconv.FormatUint(id, 10)] = "prefill"
	}
	return r
}

// completion posts a non-streamed completion for model.
func completion(t testing.TB, base, path, model string) httpResp {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":5}`, model)
	return doHTTP(t, "POST", base+path, "application/json", []byte(body))
}

// engineOf returns the engine id that answered.
func engineOf(h httpResp) uint64 {
	var m struct {
		Engine uint64 `json:"engine"`
	}
	_ = json.Unmarshal(h.body, &m)
	return m.Engine
}

// checkRouterError checks a router error: status, JSON {"message","type","code"} with code = status.
func checkRouterError(t testing.TB, what string, h httpResp, status int) map[string]any {
	t.Helper()
	if h.code != status {
		t.Errorf("%s: status %d, want %d; body %s", what, h.code, status, h.body)
	}
	mt, _, _ := mime.ParseMediaType(h.header.Get("Content-Type"))
	if mt != "application/json" {
		t.Errorf("%s: Content-Type %q", what, h.header.Get("Content-Type"))
	}
	var m map[string]any
	if err := json.Unmarshal(h.body, &m); err != nil {
		t.Errorf("%s: body not JSON: %s", what, h.body)
		return nil
	}
	for _, k := range []string{"message", "type", "code"} {
		if _, ok := m[k]; !ok {
			t.Errorf("%s: body lacks %q: %s", what, k, h.body)
		}
	}
	if c, _ := m["code"].(float64); int(c) != h.code {
		t.Errorf("%s: code %v != status %d", what, m["code"], h.code)
	}
	return m
}

// checkNoWorkers checks the router error for a model without a registered
// worker: 503 whose message says "no workers available" (DESIGN §7c).
func checkNoWorkers(t testing.TB, what string, h httpResp) {
	t.Helper()
	m := checkRouterError(t, what, h, 503)
	if s, _ := m["message"].(string); !strings.Contains(s, "no workers available") {
		t.Errorf("%s: message %q lacks \"no workers available\"", what, s)
	}
}

// checkAllBusy checks the exact rejection of DESIGN §7.
func checkAllBusy(t testing.TB, what string, h httpResp, status int) {
	t.Helper()
	want := strings.ReplaceAll(allBusyBody, `"code":503`, fmt.Sprintf(`"code":%d`, status))
	if h.code != status || string(h.body) != want {
		t.Errorf("%s: got %d %q, want %d %q", what, h.code, h.body, status, want)
	}
	if ct := h.header.Get("Content-Type"); ct != "application/json" {
		mt, _, _ := mime.ParseMediaType(ct)
		if mt != "application/json" {
			t.Errorf("%s: Content-Type %q", what, ct)
		} else {
			t.Logf("%s: Content-Type %q (not exactly application/json)", what, ct)
		}
	}
	ra := h.header.Get("Retry-After")
	n, err := strconv.Atoi(ra)
	if err != nil || n < 1 || strconv.Itoa(n) != ra {
		t.Errorf("%s: Retry-After %q, want whole seconds >= 1", what, ra)
	}
	// retry-after-ms (contract §23): the same wait in milliseconds, which
	// Retry-After rounds.
	rams := h.header.Get("Retry-After-Ms")
	ms, err := strconv.Atoi(rams)
	if err != nil || ms < 1 || strconv.Itoa(ms) != rams || n*1000-ms >= 1000 || ms-n*1000 > 500 {
		t.Errorf("%s: retry-after-ms %q with Retry-After %q, want the same wait in milliseconds", what, rams, ra)
	}
}

// waitStatus repeats a completion until its status is want.
func waitStatus(t testing.TB, base, path, model string, want int, within time.Duration) httpResp {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		h := completion(t, base, path, model)
		if h.code == want {
			return h
		}
		if time.Now().After(deadline) {
			t.Fatalf("model %q: status %d (%s), want %d within %v", model, h.code, h.body, want, within)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// waitAllBusy repeats a completion until the router answers with the exact
// all-busy rejection (it has seen the record and the registrations).
func waitAllBusy(t testing.TB, base, path, model string, status int) httpResp {
	t.Helper()
	want := strings.ReplaceAll(allBusyBody, `"code":503`, fmt.Sprintf(`"code":%d`, status))
	deadline := time.Now().Add(5 * time.Second)
	for {
		h := completion(t, base, path, model)
		if h.code == status && string(h.body) == want {
			return h
		}
		if time.Now().After(deadline) {
			t.Fatalf("model %q: got %d %s, want the all-busy rejection %d %s", model, h.code, h.body, status, want)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// waitRoutedTo repeats a completion until 8 in a row are answered by ids
// (the router has caught up with the buckets).
func waitRoutedTo(t testing.TB, base, model string, ids ...uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	streak := 0
	for {
		h := completion(t, base, "/v1/completions", model)
		ok := false
		if h.code == 200 {
			for _, id := range ids {
				ok = ok || engineOf(h) == id
			}
		}
		if ok {
			streak++
			if streak >= 8 {
				return
			}
			continue
		}
		streak = 0
		if time.Now().After(deadline) {
			t.Fatalf("model %q: not routed to %v within 5s: %d %s", model, ids, h.code, h.body)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// checkOnlyRoutedTo sends n completions: engine id must answer each with 200,
// and none may reach the engines in not (why they must not: "busy", ...).
func checkOnlyRoutedTo(t testing.TB, base, model string, n int, id uint64, why string, not ...*engine) {
	t.Helper()
	before := make([]int64, len(not))
	for i, e := range not {
		before[i] = e.hits.Load()
	}
	for i := 0; i < n; i++ {
		if h := completion(t, base, "/v1/completions", model); h.code != 200 || engineOf(h) != id {
			t.Errorf("request %d: %d from %d: %s", i, h.code, engineOf(h), h.body)
		}
	}
	for i, e := range not {
		if got := e.hits.Load() - before[i]; got != 0 {
			t.Errorf("%s worker %d got %d of %d requests", why, e.id, got, n)
		}
	}
}

func TestContractRouter(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	r := startRouter(t, natsURL)

	t.Run("no_record_admits", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newEngine(t, 1, nil)
		register(t, wkv, model, 1, e.srv.URL)
		waitRoutedTo(t, r.base, model, 1)
		req := e.requests()[0]
		if req.path != "/v1/completions" {
			t.Errorf("engine got path %q", req.path)
		}
	})
	t.Run("all_busy_503_exact", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e1, e2 := newEngine(t, 1, nil), newEngine(t, 2, nil)
		registerEngines(t, wkv, model, e1, e2)
		keepRecord(t, bkv, model, u64s(1, 2), nil)
		time.Sleep(300 * time.Millisecond)
		h := waitAllBusy(t, r.base, "/v1/completions", model, 503)
		checkAllBusy(t, "completions", h, 503)
		base := e1.hits.Load() + e2.hits.Load()
		h = completion(t, r.base, "/v1/chat/completions", model)
		checkAllBusy(t, "chat completions", h, 503)
		for i := 0; i < 10; i++ {
			checkAllBusy(t, "completions", completion(t, r.base, "/v1/completions", model), 503)
		}
		if n := e1.hits.Load() + e2.hits.Load() - base; n != 0 {
			t.Errorf("busy engines got %d requests", n)
		}
	})
	t.Run("routes_only_to_free_registered", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		es := map[uint64]*engine{}
		for _, id := range []uint64{1, 2, 3} {
			es[id] = newEngine(t, id, nil)
			register(t, wkv, model, id, es[id].srv.URL)
		}
		lr := keepRecord(t, bkv, model, u64s(3), u64s(1, 2))
		// wait until the router has the record and all registrations
		time.Sleep(300 * time.Millisecond)
		waitRoutedTo(t, r.base, model, 1, 2)
		base3 := es[3].hits.Load()
		for i := 0; i < 30; i++ {
			h := completion(t, r.base, "/v1/completions", model)
			if h.code != 200 {
				t.Fatalf("request %d: %d %s", i, h.code, h.body)
			}
		}
		if n := es[3].hits.Load() - base3; n != 0 {
			t.Errorf("busy worker 3 got %d of 30 requests", n)
		}
		// the list changes: now only 3 is free
		lr.set(u64s(1, 2), u64s(3))
		waitRoutedTo(t, r.base, model, 3)
		checkOnlyRoutedTo(t, r.base, model, 20, 3, "busy", es[1], es[2])
	})
	t.Run("free_but_unregistered_falls_back_to_registered_not_busy", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e3, e6 := newEngine(t, 3, nil), newEngine(t, 6, nil)
		registerEngines(t, wkv, model, e3, e6)
		keepRecord(t, bkv, model, u64s(3), u64s(5))
		time.Sleep(300 * time.Millisecond)
		waitRoutedTo(t, r.base, model, 6)
		checkOnlyRoutedTo(t, r.base, model, 10, 6, "busy", e3)
	})
	t.Run("only_busy_registered_worker_never_used", func(t *testing.T) {
		t.Parallel()
		// free [5] is not registered; the only registered worker (3) is busy:
		// not all_busy, yet no candidate: the busy worker gets nothing.
		model := newModel(t)
		e3 := newEngine(t, 3, nil)
		register(t, wkv, model, 3, e3.srv.URL)
		keepRecord(t, bkv, model, u64s(3), u64s(5))
		waitStatus(t, r.base, "/v1/completions", model, 503, 5*time.Second)
		base := e3.hits.Load()
		for i := 0; i < 5; i++ {
			h := completion(t, r.base, "/v1/completions", model)
			if h.code == 200 {
				t.Errorf("request %d admitted to %d", i, engineOf(h))
			}
		}
		if n := e3.hits.Load() - base; n != 0 {
			t.Errorf("busy worker 3 got %d requests", n)
		}
	})
	t.Run("stale_updated_at_fails_open", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newEngine(t, 1, nil)
		register(t, wkv, model, 1, e.srv.URL)
		putRecord(t, bkv, model, u64s(1), nil, time.Now().Add(-time.Minute), 1)
		waitRoutedTo(t, r.base, model, 1)
	})
	t.Run("no_puts_fails_open", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newEngine(t, 1, nil)
		register(t, wkv, model, 1, e.srv.URL)
		lr := keepRecord(t, bkv, model, u64s(1), nil)
		h := waitAllBusy(t, r.base, "/v1/completions", model, 503)
		checkAllBusy(t, "while fresh", h, 503)
		lr.stop() // the monitor died: no more puts
		stopped := time.Now()
		waitRoutedTo(t, r.base, model, 1)
		if el := time.Since(stopped); el < 700*time.Millisecond {
			t.Errorf("failed open %v after the last put, before stale-list-after 1s", el)
		}
		// a live list again: rejections again
		keepRecord(t, bkv, model, u64s(1), nil)
		waitAllBusy(t, r.base, "/v1/completions", model, 503)
	})
	t.Run("no_registered_worker_503", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		h := completion(t, r.base, "/v1/completions", model)
		checkNoWorkers(t, "no record, no worker", h)
		if string(h.body) == allBusyBody {
			t.Errorf("all-busy body for a model without workers")
		}
		// a record listing a free worker that is not registered
		model2 := newModel(t)
		keepRecord(t, bkv, model2, nil, u64s(1))
		time.Sleep(300 * time.Millisecond)
		h = completion(t, r.base, "/v1/completions", model2)
		checkNoWorkers(t, "record, no registered worker", h)
	})
	t.Run("no_registered_worker_with_all_busy_record_503", func(t *testing.T) {
		t.Parallel()
		// DESIGN §7c: "Model with no registered worker: 503 with a message saying
		// `no workers available`, never the all-busy body."
		model := newModel(t)
		keepRecord(t, bkv, model, u64s(1, 2), nil)
		time.Sleep(300 * time.Millisecond)
		h := completion(t, r.base, "/v1/completions", model)
		checkNoWorkers(t, "all_busy record, no registered worker", h)
		if string(h.body) == allBusyBody {
			t.Errorf("the all-busy body for a model without a registered worker")
		}
	})
	t.Run("chat_completions_forwarded_intact", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newEngine(t, 1, nil)
		register(t, wkv, model, 1, e.srv.URL)
		keepRecord(t, bkv, model, nil, u64s(1))
		time.Sleep(300 * time.Millisecond)
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"héllo"}],"max_tokens":3,"extra":{"a":[1,2]}}`, model)
		h := doHTTP(t, "POST", r.base+"/v1/chat/completions", "application/json", []byte(body))
		if h.code != 200 || engineOf(h) != 1 {
			t.Fatalf("%d %s", h.code, h.body)
		}
		reqs := e.requests()
		got := reqs[len(reqs)-1]
		if got.path != "/v1/chat/completions" {
			t.Errorf("path %q", got.path)
		}
		var a, b any
		_ = json.Unmarshal(got.body, &a)
		_ = json.Unmarshal([]byte(body), &b)
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Errorf("engine got body %s, want %s", got.body, body)
		}
	})
	t.Run("engine_status_passed_through", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newEngine(t, 1, func(e *engine, w http.ResponseWriter, r *http.Request, body []byte) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Engine", "1")
			w.WriteHeader(400)
			io.WriteString(w, `{"error":"bad prompt"}`)
		})
		register(t, wkv, model, 1, e.srv.URL)
		deadline := time.Now().Add(5 * time.Second)
		var h httpResp
		for time.Now().Before(deadline) {
			h = completion(t, r.base, "/v1/completions", model)
			if h.code == 400 {
				break
			}
			time.Sleep(25 * time.Millisecond)
		}
		if h.code != 400 || string(h.body) != `{"error":"bad prompt"}` {
			t.Errorf("engine's 400 not passed through: %d %s", h.code, h.body)
		}
	})
	t.Run("streams_as_it_arrives", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		release := make(chan struct{})
		e := newEngine(t, 1, func(e *engine, w http.ResponseWriter, r *http.Request, body []byte) {
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "data: {\"choices\":[{\"text\":\"one\",\"index\":0,\"finish_reason\":null}]}\n\n")
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
			io.WriteString(w, "data: {\"choices\":[{\"text\":\"two\",\"index\":0,\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n")
		})
		register(t, wkv, model, 1, e.srv.URL)
		keepRecord(t, bkv, model, nil, u64s(1))
		time.Sleep(300 * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", r.base+"/v1/completions",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"x","stream":true}`, model)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
			t.Errorf("Content-Type %q", ct)
		}
		br := bufio.NewReader(resp.Body)
		first := make(chan string, 1)
		go func() { l, _ := br.ReadString('\n'); first <- l }()
		select {
		case l := <-first:
			if !strings.Contains(l, "one") {
				t.Errorf("first line %q", l)
			}
		case <-time.After(3 * time.Second):
			close(release)
			t.Fatalf("first SSE chunk not streamed before the engine finished")
		}
		close(release)
		rest, _ := io.ReadAll(br)
		if !strings.Contains(string(rest), "two") || !strings.Contains(string(rest), "[DONE]") {
			t.Errorf("rest of stream: %q", rest)
		}
	})
	t.Run("client_cancel_reaches_engine", func(t *testing.T) {
		t.Parallel()
		for _, afterHeaders := range []bool{true, false} {
			model := newModel(t)
			canceled := make(chan struct{})
			started := make(chan struct{})
			e := newEngine(t, 1, func(e *engine, w http.ResponseWriter, r *http.Request, body []byte) {
				if afterHeaders {
					w.Header().Set("Content-Type", "text/event-stream")
					io.WriteString(w, "data: {\"choices\":[{\"text\":\"a\",\"index\":0,\"finish_reason\":null}]}\n\n")
					w.(http.Flusher).Flush()
				}
				close(started)
				select {
				case <-r.Context().Done():
					close(canceled)
				case <-time.After(20 * time.Second):
				}
			})
			register(t, wkv, model, 1, e.srv.URL)
			keepRecord(t, bkv, model, nil, u64s(1))
			time.Sleep(300 * time.Millisecond)
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, "POST", r.base+"/v1/completions",
				strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"x","stream":true}`, model)))
			req.Header.Set("Content-Type", "application/json")
			go func() {
				resp, err := http.DefaultClient.Do(req)
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}()
			select {
			case <-started:
			case <-time.After(5 * time.Second):
				cancel()
				t.Fatalf("request never reached the engine")
			}
			time.Sleep(100 * time.Millisecond)
			cancel()
			select {
			case <-canceled:
			case <-time.After(2 * time.Second):
				t.Errorf("afterHeaders=%v: the client's cancellation did not reach the engine within 2s", afterHeaders)
			}
		}
	})
	t.Run("unreachable_worker_retried_elsewhere", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		dead := "http://" + freeAddr(t)
		e := newEngine(t, 2, nil)
		register(t, wkv, model, 1, dead)
		register(t, wkv, model, 2, e.srv.URL)
		keepRecord(t, bkv, model, nil, u64s(1, 2))
		time.Sleep(300 * time.Millisecond)
		waitRoutedTo(t, r.base, model, 2)
		checkOnlyRoutedTo(t, r.base, model, 10, 2, "")
	})
	t.Run("all_unreachable_502", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		register(t, wkv, model, 1, "http://"+freeAddr(t))
		register(t, wkv, model, 2, "http://"+freeAddr(t))
		keepRecord(t, bkv, model, nil, u64s(1, 2))
		time.Sleep(300 * time.Millisecond)
		h := waitStatus(t, r.base, "/v1/completions", model, 502, 5*time.Second)
		checkRouterError(t, "all unreachable", h, 502)
	})
	t.Run("bad_requests_router_error_shape", func(t *testing.T) {
		t.Parallel()
		for _, body := range []string{`not json`, `{"prompt":"x"}`, `{"model":5}`, ``} {
			h := doHTTP(t, "POST", r.base+"/v1/completions", "application/json", []byte(body))
			if h.code < 400 || h.code > 499 {
				t.Errorf("body %q: status %d %s", body, h.code, h.body)
				continue
			}
			checkRouterError(t, fmt.Sprintf("body %q", body), h, h.code)
		}
	})
	if !r.alive() {
		t.Errorf("router died")
	}
}

func TestContractRouterRejectStatus(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	for _, status := range []int{429, 529} {
		r := startRouter(t, natsURL, "--reject-status", strconv.Itoa(status), "--retry-after", "2500ms")
		model := newModel(t)
		e := newEngine(t, 1, nil)
		register(t, wkv, model, 1, e.srv.URL)
		keepRecord(t, bkv, model, u64s(1), nil)
		h := waitAllBusy(t, r.base, "/v1/completions", model, status)
		checkAllBusy(t, fmt.Sprintf("reject-status %d", status), h, status)
		if ra := h.header.Get("Retry-After"); ra != "3" {
			t.Errorf("Retry-After %q for 2.5s, want 3 (rounded up)", ra)
		}
	}
}

// sseChunk is one streamed completion chunk.
func sseChunk(text string, finish any, usage any) string {
	m := map[string]any{"id": "cmpl-x", "object": "text_completion", "choices": []any{map[string]any{"index": 0, "text": text, "finish_reason": finish}}}
	if usage != nil {
		m["usage"] = usage
	}
	b, _ := json.Marshal(m)
	return "data: " + string(b) + "\n\n"
}

func TestContractRouterMigration(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	r := startRouter(t, natsURL, "--migration-limit", "1")

	type call struct {
		engine uint64
		body   map[string]any
	}
	run := func(t *testing.T, cut func(n int64, w http.ResponseWriter), usage bool) ([]call, string) {
		model := newModel(t)
		var n atomic.Int64
		var mu sync.Mutex
		var calls []call
		h := func(e *engine, w http.ResponseWriter, r *http.Request, body []byte) {
			var m map[string]any
			_ = json.Unmarshal(body, &m)
			mu.Lock()
			calls = append(calls, call{e.id, m})
			mu.Unlock()
			k := n.Add(1)
			w.Header().Set("Content-Type", "text/event-stream")
			cut(k, w)
		}
		e1, e2 := newEngine(t, 1, h), newEngine(t, 2, h)
		registerEngines(t, wkv, model, e1, e2)
		keepRecord(t, bkv, model, nil, u64s(1, 2))
		time.Sleep(400 * time.Millisecond)
		body := fmt.Sprintf(`{"model":%q,"prompt":"Say:","max_tokens":10,"stream":true}`, model)
		resp := doHTTP(t, "POST", r.base+"/v1/completions", "application/json", []byte(body))
		if resp.code != 200 {
			t.Fatalf("%d %s", resp.code, resp.body)
		}
		mu.Lock()
		defer mu.Unlock()
		return append([]call(nil), calls...), string(resp.body)
	}

	t.Run("cut_without_done_continues_elsewhere", func(t *testing.T) {
		calls, out := run(t, func(k int64, w http.ResponseWriter) {
			if k == 1 {
				io.WriteString(w, sseChunk("Hello", nil, nil))
				io.WriteString(w, sseChunk(" world", nil, nil))
				return // ends without [DONE] or finish reason
			}
			io.WriteString(w, sseChunk("!", "length", nil))
			io.WriteString(w, "data: [DONE]\n\n")
		}, false)
		if len(calls) != 2 {
			t.Fatalf("%d engine calls, want 2; stream %q", len(calls), out)
		}
		if calls[0].engine == calls[1].engine {
			t.Errorf("continued on the same worker %d", calls[0].engine)
		}
		if p := calls[1].body["prompt"]; p != "Say:Hello world" {
			t.Errorf("continuation prompt %q, want %q", p, "Say:Hello world")
		}
		if mt := fmt.Sprint(calls[1].body["max_tokens"]); mt != "8" {
			t.Errorf("continuation max_tokens %s, want 8 (10 - one per chunk)", mt)
		}
		for _, s := range []string{"Hello", " world", "!", "[DONE]"} {
			if !strings.Contains(out, s) {
				t.Errorf("client stream lacks %q: %q", s, out)
			}
		}
	})
	t.Run("usage_counts_tokens", func(t *testing.T) {
		calls, out := run(t, func(k int64, w http.ResponseWriter) {
			if k == 1 {
				io.WriteString(w, sseChunk("Hello world", nil, map[string]any{"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}))
				// a read error: abort the connection mid-stream
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler)
			}
			io.WriteString(w, sseChunk("!", "stop", nil))
			io.WriteString(w, "data: [DONE]\n\n")
		}, true)
		if len(calls) != 2 {
			t.Fatalf("%d engine calls, want 2; stream %q", len(calls), out)
		}
		if mt := fmt.Sprint(calls[1].body["max_tokens"]); mt != "7" {
			t.Errorf("continuation max_tokens %s, want 7 (10 - usage 3)", mt)
		}
		if p := calls[1].body["prompt"]; p != "Say:Hello world" {
			t.Errorf("continuation prompt %q", p)
		}
	})
	t.Run("cannot_continue_ends_with_sse_error", func(t *testing.T) {
		calls, out := run(t, func(k int64, w http.ResponseWriter) {
			io.WriteString(w, sseChunk("x", nil, nil))
		}, false)
		if len(calls) != 2 {
			t.Errorf("%d engine calls, want 2 (limit 1)", len(calls))
		}
		if !strings.Contains(strings.ToLower(out), "error") {
			t.Errorf("stream does not end with an SSE error event: %q", out)
		}
	})
}

// TestContractRouterWithMonitor: the real monitor feeds the router.
func TestContractRouterWithMonitor(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{flags: []string{"--active-prefill-tokens-threshold", "100"}})
	c := m.client(t)
	wkv := ensureKV(t, c, workersBucket, 30*time.Second)
	r := startRouter(t, m.natsURL)
	model := "Qwen/Qwen3-0.6B"
	e1, e2 := newEngine(t, 1, nil), newEngine(t, 2, nil)
	registerEngines(t, wkv, model, e1, e2)
	p1, p2 := newPub(t, c, model, 1), newPub(t, c, model, 2)
	stop1 := p1.keepAlive(hotLoad)
	defer stop1()
	stop2 := p2.keepAlive(coldLoad)
	waitLists(t, c.busyKV(t), model, lists{busy: u64s(1), free: u64s(2)})
	waitRoutedTo(t, r.base, model, 2)
	checkOnlyRoutedTo(t, r.base, model, 10, 2, "busy", e1)
	stop2()
	p2.keepAlive(hotLoad)
	waitLists(t, c.busyKV(t), model, lists{busy: u64s(1, 2)})
	h := waitAllBusy(t, r.base, "/v1/completions", model, 503)
	checkAllBusy(t, "all busy via the monitor", h, 503)
	// the monitor (and its NATS) dies: the list goes stale and the router fails open
	m.kill()
	killed := time.Now()
	deadline := time.Now().Add(6 * time.Second)
	for {
		h = completion(t, r.base, "/v1/completions", model)
		if h.code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("router did not fail open after the monitor died: %d %s", h.code, h.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if el := time.Since(killed); el < 800*time.Millisecond {
		t.Errorf("failed open %v after the monitor died, before stale-list-after 1s", el)
	}
}
