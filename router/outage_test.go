package router

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/registry"
)

// logBuf is a log sink tests can read while the router writes to it.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// outageClock is the registry's settable clock; it counts its reads.
type outageClock struct{ ns, reads atomic.Int64 }

func (c *outageClock) now() time.Time {
	c.reads.Add(1)
	return time.Unix(0, c.ns.Load())
}

// waitReads waits until the registry has read the clock n more times (it
// does at each of its sweeps, every second).
func (c *outageClock) waitReads(t *testing.T, n int64) {
	t.Helper()
	want := c.reads.Load() + n
	natstest.WaitFor(t, 10*time.Second, "the registry reading its clock", func() bool { return c.reads.Load() >= want })
}

// TestNATSOutageLongerThanRegistryTTL is the outage an operator meets: NATS
// goes away for longer than the registry's TTL (by the registry's clock).
// The router keeps routing to the workers it knows; a model it knows no
// worker of is answered 503 saying that the registry cannot be read, not
// that no worker is registered, and the router logs it. Once NATS is back
// the usual answer returns.
func TestNATSOutageLongerThanRegistryTTL(t *testing.T) {
	t.Parallel()
	clock := &outageClock{}
	clock.ns.Store(time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC).UnixNano())
	logs := &logBuf{}
	env := newTestEnv(t, envOptions{
		registry: []registry.Option{registry.WithClock(clock.now)},
		config:   func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(logs, nil)) },
	})
	eng := jsonEngine(t, "a")
	env.putWorker(t, model, 1, eng.srv.URL)
	env.putRecord(t, model, []uint64{1}, nil, time.Now())
	post := func(m string) (int, string) {
		t.Helper()
		resp := env.post(t, PathCompletions, `{"model":"`+m+`","prompt":"hi"}`)
		return resp.StatusCode, string(readAll(t, resp))
	}
	if code, body := post(model); code != http.StatusOK {
		t.Fatalf("before the outage: %d %s", code, body)
	}

	opts := natstest.Stop(t, env.srv, env.natsOpts)
	natstest.WaitFor(t, 10*time.Second, "the registry not live", func() bool { return !env.registry.Live() })
	clock.ns.Add(int64(2 * registry.TTL))
	clock.waitReads(t, 3)
	if code, body := post(model); code != http.StatusOK || !strings.Contains(body, "hi from a") {
		t.Errorf("during an outage of 2 TTLs, the known worker's model: %d %s; want 200 from the worker", code, body)
	}
	code, body := post("other-model")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "no workers available") ||
		!strings.Contains(body, "cannot be read") || strings.Contains(body, "no worker is registered") {
		t.Errorf("during the outage, a model without known workers: %d %s; want 503 saying the registry cannot be read", code, body)
	}
	if l := logs.String(); !strings.Contains(l, "worker registry cannot be read") || !strings.Contains(l, "model=other-model") ||
		!strings.Contains(l, "bucket="+events.WorkersBucket) {
		t.Errorf("router log %q; want a warning that the registry cannot be read", l)
	}

	env.srv = natstest.Start(t, opts)
	natstest.WaitFor(t, 10*time.Second, "the registry live again", env.registry.Live)
	if code, body := post(model); code != http.StatusOK {
		t.Errorf("after the outage: %d %s", code, body)
	}
	if code, body := post("other-model"); code != http.StatusServiceUnavailable || !strings.Contains(body, "no worker is registered") {
		t.Errorf("after the outage, a model without workers: %d %s; want 503 no worker is registered", code, body)
	}
}

// liveRegistry is a loaded registry with no workers whose liveness the test
// sets.
type liveRegistry struct {
	notReady
	live atomic.Bool
}

func (*liveRegistry) Ready() bool                           { return true }
func (*liveRegistry) Endpoints(string) []events.WorkerEntry { return nil }
func (r *liveRegistry) Live() bool                          { return r.live.Load() }

// TestRegistryNotLiveMessage: a model without workers is "no worker is
// registered" only while the registry is read; otherwise the answer and the
// log say that it cannot be read.
func TestRegistryNotLiveMessage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		live            bool
		want, dont, log string
	}{
		{live: true, want: "no worker is registered", dont: "cannot be read"},
		{live: false, want: "cannot be read now (NATS down or not answering)", dont: "no worker is registered",
			log: "worker registry cannot be read"},
	} {
		logs := &logBuf{}
		reg := &liveRegistry{}
		reg.live.Store(tc.live)
		cfg := DefaultConfig()
		cfg.BusyList, cfg.Registry, cfg.Logger = notReady{}, reg, slog.New(slog.NewTextHandler(logs, nil))
		rt, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		rt.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, PathCompletions, strings.NewReader(`{"model":"m","prompt":"hi"}`)))
		body := rec.Body.String()
		if rec.Code != http.StatusServiceUnavailable || !strings.Contains(body, "no workers available") ||
			!strings.Contains(body, tc.want) || strings.Contains(body, tc.dont) {
			t.Errorf("live=%v: %d %s; want 503 with %q", tc.live, rec.Code, body, tc.want)
		}
		if l := logs.String(); tc.log != "" && !strings.Contains(l, tc.log) || tc.log == "" && l != "" {
			t.Errorf("live=%v: log %q, want %q", tc.live, l, tc.log)
		}
	}
}
