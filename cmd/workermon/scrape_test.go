package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
)

// scrapeEngine serves a page of scrape/testdata at /metrics, or an error
// status while down.
type scrapeEngine struct {
	srv  *httptest.Server
	mu   sync.Mutex
	page []byte
	down bool
}

func newScrapeEngine(t *testing.T, page []byte) *scrapeEngine {
	t.Helper()
	e := &scrapeEngine{page: page}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		page, down := e.page, e.down
		e.mu.Unlock()
		if down || r.URL.Path != "/metrics" {
			http.Error(w, "engine down", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write(page)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *scrapeEngine) set(page []byte, down bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if page != nil {
		e.page = page
	}
	e.down = down
}

// waitBusySet polls the model's record until cond holds.
func waitBusySet(t *testing.T, kv jetstream.KeyValue, model, what string, cond func(events.BusySet) bool) events.BusySet {
	t.Helper()
	var b events.BusySet
	natstest.WaitFor(t, 15*time.Second, what, func() bool {
		var ok bool
		b, ok = record(t, kv, model)
		return ok && cond(b)
	})
	return b
}

// TestScrapeAgainstMonitor runs `workermon scrape` against a fake vLLM
// serving the recorded page, and a real monitor: the worker is free at 25 %
// of its KV cache, busy at 95 %, stale (never free) while the engine does
// not answer, free again when it does, and gone after the sidecar's
// goodbye.
func TestScrapeAgainstMonitor(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) {
		o.monitor.StaleAfter = time.Second
	})
	_, kv := connect(t, svc.natsURL)
	const model = "Qwen/Qwen3-0.6B"
	page, err := os.ReadFile(filepath.Join("..", "..", "scrape", "testdata", "vllm-v1.metrics"))
	if err != nil {
		t.Fatal(err)
	}
	usage := `vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} `
	if !bytes.Contains(page, []byte(usage+"0.2533\n")) {
		t.Fatal("the fixture's usage line changed; update the test")
	}
	busyPage := bytes.Replace(page, []byte(usage+"0.2533\n"), []byte(usage+"0.95\n"), 1)
	eng := newScrapeEngine(t, page)

	o := defaultScrapeOptions()
	o.engine, o.metricsURL, o.model = "vllm", eng.srv.URL+"/metrics", model
	id := uint64(42)
	o.workerID = &id
	o.endpoint = "http://10.0.0.9:8000"
	o.interval = 50 * time.Millisecond
	o.httpAddr = "127.0.0.1:0"
	o.natsURL = svc.natsURL
	reg := newRegistry()
	sc, err := startScrape(t.Context(), o, slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = sc.close(context.Background())
		}
	})

	free := func(b events.BusySet) bool { return slices.Contains(b.Free, id) }
	waitBusySet(t, kv, model, "the worker free at 25 %", free)
	eng.set(busyPage, false)
	b := waitBusySet(t, kv, model, "the worker busy at 95 %", func(b events.BusySet) bool { return slices.Contains(b.Busy, id) })
	if b.Reasons["42"] != "kv" || !b.AllBusy {
		t.Errorf("record %+v: want worker 42 busy for kv, all busy", b)
	}
	eng.set(page, false)
	waitBusySet(t, kv, model, "the worker free again", free)

	eng.set(nil, true)
	b = waitBusySet(t, kv, model, "the silent engine's worker stale", func(b events.BusySet) bool {
		return slices.Contains(b.Stale, id)
	})
	if slices.Contains(b.Free, id) || slices.Contains(b.Busy, id) {
		t.Errorf("record %+v lists the silent worker as free or busy", b)
	}
	// The monitor may call the worker stale (its --stale-after) before the
	// adapter's own silence (2 × interval + 1 s) begins: wait for that too.
	natstest.WaitFor(t, 10*time.Second, "the adapter silent", func() bool {
		v, _ := promtest.Value(t, reg, "workermon_scrape_silent", nil)
		return v == 1
	})
	health := get(t, "http://"+sc.http.addr+"/healthz")
	if !strings.Contains(health, "silent true") || !strings.Contains(health, "nats_server_version ") {
		t.Errorf("/healthz while silent:\n%s", health)
	}

	eng.set(nil, false)
	waitBusySet(t, kv, model, "the worker free after the engine answers again", free)
	if m := get(t, "http://"+sc.http.addr+"/metrics"); !strings.Contains(m, `workermon_scrape_failures_total{reason="status"}`) {
		t.Errorf("/metrics has no failures by reason:\n%s", m)
	}

	if err := sc.close(t.Context()); err != nil {
		t.Fatalf("close: %v", err)
	}
	closed = true
	waitBusySet(t, kv, model, "the worker gone after the goodbye", func(b events.BusySet) bool {
		return !slices.Contains(b.Free, id) && !slices.Contains(b.Stale, id) && !slices.Contains(b.Busy, id)
	})
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s\n%s", url, resp.Status, body)
	}
	return string(body)
}

func TestScrapeFlags(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		want string // in the error; "" for none
	}{
		{"no engine", []string{"--metrics-url", "http://h/metrics", "--model", "m", "--worker-id", "1"}, "--engine is required"},
		{"unknown engine", []string{"--engine", "tgi", "--metrics-url", "http://h/metrics", "--model", "m", "--worker-id", "1"}, "unknown engine"},
		{"no worker id", []string{"--engine", "vllm", "--metrics-url", "http://h/metrics", "--model", "m"}, "--worker-id is required"},
		{"no URL", []string{"--engine", "sglang", "--model", "m", "--worker-id", "1"}, "metrics URL"},
		{"no model", []string{"--engine", "vllm", "--metrics-url", "http://h/metrics", "--worker-id", "1"}, "model"},
		{"zero interval", []string{"--engine", "vllm", "--metrics-url", "http://h/metrics", "--model", "m", "--worker-id", "1", "--interval", "0s"}, "interval"},
		{"endpoint with /v1", []string{"--engine", "vllm", "--metrics-url", "http://h/metrics", "--model", "m", "--worker-id", "1", "--endpoint", "http://h:8000/v1"}, "/v1"},
		{"good", []string{"--engine", "vllm", "--metrics-url", "http://h/metrics", "--model", "m", "--worker-id", "0"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			o := defaultScrapeOptions()
			if _, _, err := parseCommand("scrape", tt.args, io.Discard, natsURLEnv, o.flags, &o.log); err != nil {
				t.Fatal(err)
			}
			_, err := o.adapterConfig()
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("adapterConfig: %v", err)
			case tt.want != "" && (err == nil || !errors.Is(err, errUsage) || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("adapterConfig = %v, want a usage error about %q", err, tt.want)
			}
		})
	}
}

// The command's defaults are the contract's (§9, §13).
func TestScrapeDefaults(t *testing.T) {
	t.Parallel()
	o := defaultScrapeOptions()
	if o.interval != 100*time.Millisecond || o.prefix != events.DefaultSubjectPrefix {
		t.Errorf("defaults %+v", o)
	}
}
