package adapter_test

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/scrape"
	"github.com/workermon/workermon/scrape/adapter"
)

// waitTimeout bounds every wait for something to arrive over the network.
const waitTimeout = 10 * time.Second

// fixture reads a page of ../testdata.
func fixture(t testing.TB, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// engine is a fake engine's /metrics: it serves body, or answers status
// when status is not 0, or hangs until the request is cancelled when hang
// is set.
type engine struct {
	srv    *httptest.Server
	mu     sync.Mutex
	body   []byte
	status int
	hang   bool
	hits   atomic.Int64
}

func newEngine(t testing.TB, body []byte) *engine {
	t.Helper()
	e := &engine{body: body}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		e.mu.Lock()
		body, status, hang := e.body, e.status, e.hang
		e.mu.Unlock()
		switch {
		case hang:
			<-r.Context().Done()
		case status != 0:
			http.Error(w, "engine says no", status)
		default:
			w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
			_, _ = w.Write(body)
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *engine) url() string { return e.srv.URL + "/metrics" }

func (e *engine) set(body []byte, status int, hang bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.body, e.status, e.hang = body, status, hang
}

// env is a NATS server, the adapter's connection and an observer's.
type env struct {
	nc  *nats.Conn // the adapter's
	obs *nats.Conn
}

func newEnv(t testing.TB) *env {
	t.Helper()
	s := natstest.Start(t, nil)
	return &env{nc: natstest.Connect(t, s), obs: natstest.Connect(t, s)}
}

// config returns a configuration polling url every 20 ms, with heartbeats
// every 100 ms.
func (e *env) config(m scrape.Mapping, url string) adapter.Config {
	c := adapter.DefaultConfig()
	c.Conn, c.Mapping, c.MetricsURL = e.nc, m, url
	c.Model, c.WorkerID = "Qwen/Qwen3-0.6B", 7
	c.Interval = 20 * time.Millisecond
	c.Timeout = 200 * time.Millisecond
	c.PublisherOptions = []publisher.Option{publisher.WithHeartbeat(100 * time.Millisecond)}
	return c
}

func start(t testing.TB, c adapter.Config) *adapter.Adapter {
	t.Helper()
	a, err := adapter.Start(c)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = a.Close(context.Background()) })
	return a
}

// inbox holds the reports and goodbyes under the default prefix, and the
// markers the test publishes on its own subject.
type inbox struct{ ch chan *nats.Msg }

const markerSubject = "test.marker"

func subscribe(t testing.TB, nc *nats.Conn) *inbox {
	t.Helper()
	in := &inbox{ch: make(chan *nats.Msg, 1<<14)}
	for _, subj := range []string{events.DefaultSubjectPrefix + ".>", markerSubject} {
		sub, err := nc.ChanSubscribe(subj, in.ch)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return in
}

// message is a decoded report, goodbye or marker.
type message struct {
	report *events.LoadReport
	bye    bool
	marker string
}

func (in *inbox) next(t testing.TB) message {
	t.Helper()
	for {
		if m, ok := in.nextMsg(t); ok {
			return m
		}
	}
}

// nextMsg is next, false for a latency window (TestLatencyWindows reads
// those itself).
func (in *inbox) nextMsg(t testing.TB) (message, bool) {
	t.Helper()
	select {
	case m := <-in.ch:
		if m.Subject == markerSubject {
			return message{marker: string(m.Data)}, true
		}
		s, err := events.ParseSubject(events.DefaultSubjectPrefix, m.Subject)
		if err != nil {
			t.Fatalf("subject %s: %v", m.Subject, err)
		}
		if s.Kind == events.KindLat {
			return message{}, false
		}
		if s.Kind == events.KindBye {
			return message{bye: true}, true
		}
		r, err := events.DecodeLoadReport(m.Data)
		if err != nil {
			t.Fatalf("decode %s: %v", m.Subject, err)
		}
		return message{report: &r}, true
	case <-time.After(waitTimeout):
		t.Fatalf("nothing arrived within %v", waitTimeout)
		return message{}, true
	}
}

// waitReport returns the first report for which ok holds.
func (in *inbox) waitReport(t testing.TB, ok func(events.LoadReport) bool) events.LoadReport {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		m := in.next(t)
		if m.report != nil && ok(*m.report) {
			return *m.report
		}
	}
	t.Fatalf("no matching report within %v", waitTimeout)
	return events.LoadReport{}
}

// mark publishes a marker on nc: everything nc published before it arrives
// before it.
func mark(t testing.TB, nc *nats.Conn, name string) {
	t.Helper()
	if err := nc.Publish(markerSubject, []byte(name)); err != nil {
		t.Fatal(err)
	}
}

// untilMarker returns the messages before the marker name.
func (in *inbox) untilMarker(t testing.TB, name string) []message {
	t.Helper()
	var out []message
	for {
		m := in.next(t)
		if m.marker == name {
			return out
		}
		out = append(out, m)
	}
}

func some(v uint64) events.Optional { return events.Some(v) }

// Every fixture is published as its ranks' load, with the declared ranks of
// the first scrape and the engine's block size in the registry entry.
func TestFixturesArePublished(t *testing.T) {
	t.Parallel()
	type want struct {
		rank        uint32
		used, total uint64
	}
	tests := []struct {
		file      string
		mapping   scrape.Mapping
		ranks     []want
		blockSize uint32
	}{
		{"vllm-v1.metrics", scrape.VLLM{}, []want{{0, 6906, 27264}}, 16},
		{"vllm-v1-dp2.metrics", scrape.VLLM{}, []want{{0, 13248, 18432}, {1, 867, 18432}}, 16},
		{"sglang.metrics", scrape.SGLang{}, []want{{0, 123859, 463616}}, 1},
		{"sglang-dp2-tp4.metrics", scrape.SGLang{}, []want{{0, 52310, 262144}, {1, 201344, 262144}}, 1},
		{"vllm-v0.metrics", scrape.VLLM{}, []want{{0, 16405, 26880}}, 16},
		{"vllm-v1-openmetrics.metrics", scrape.VLLM{}, []want{{0, 8520, 27264}}, 16},
		{"sglang-2024-name-label.metrics", scrape.SGLang{}, []want{{0, 67923, 161721}}, 1},
		{"sglang-2025-no-total.metrics", scrape.SGLang{}, []want{{0, 171233, 407698}}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			in := subscribe(t, e.obs)
			eng := newEngine(t, fixture(t, tt.file))
			c := e.config(tt.mapping, eng.url())
			c.Endpoint = "http://10.0.0.7:8000"
			reg := prometheus.NewRegistry()
			c.Registerer = reg
			a := start(t, c)

			seen := map[uint32]events.LoadReport{}
			for len(seen) < len(tt.ranks) {
				r := in.waitReport(t, func(events.LoadReport) bool { return true })
				seen[r.DPRank] = r
			}
			for _, w := range tt.ranks {
				r := seen[w.rank]
				if r.ActiveDecodeBlocks != some(w.used) || r.KVTotalBlocks != some(w.total) {
					t.Errorf("rank %d: used %+v of %+v, want %d of %d", w.rank, r.ActiveDecodeBlocks, r.KVTotalBlocks, w.used, w.total)
				}
				if r.ActivePrefillTokens.Set || r.MaxNumBatchedTokens.Set {
					t.Errorf("rank %d: prefill fields set (%+v, %+v); the engine exposes none", w.rank,
						r.ActivePrefillTokens, r.MaxNumBatchedTokens)
				}
				if r.DPStart != 0 || r.DPSize != uint32(len(tt.ranks)) {
					t.Errorf("rank %d: declared [%d, +%d), want [0, +%d)", w.rank, r.DPStart, r.DPSize, len(tt.ranks))
				}
				if r.Source != events.SourceEngine || r.Model != c.Model || r.WorkerID != c.WorkerID {
					t.Errorf("report %+v: wrong source, model or worker", r)
				}
			}

			entry := waitEntry(t, e.obs, c.Model, c.WorkerID)
			if entry.BlockSize != tt.blockSize || entry.DPSize != uint32(len(tt.ranks)) || entry.Endpoint != c.Endpoint {
				t.Errorf("registry entry %+v, want block size %d, %d ranks, endpoint %s", entry, tt.blockSize, len(tt.ranks), c.Endpoint)
			}
			if st := a.Status(); st.Ranks != len(tt.ranks) || st.LastGood.IsZero() || st.Silent || st.BootID != entry.BootID {
				t.Errorf("status %+v", st)
			}
			if v, _ := promtest.Value(t, reg, "workermon_scrapes_total", map[string]string{"result": "ok"}); v < 1 {
				t.Errorf("workermon_scrapes_total{result=ok} = %v, want ≥ 1", v)
			}
			if v, _ := promtest.Value(t, reg, "workermon_scrape_ranks", nil); v != float64(len(tt.ranks)) {
				t.Errorf("workermon_scrape_ranks = %v, want %d", v, len(tt.ranks))
			}
		})
	}
}

// The engines serve /metrics with prometheus_client, which picks the
// format from the Accept header (OpenMetrics only when the client names
// application/openmetrics-text) and gzips the page when the client accepts
// it. The adapter asks for the classic text format and reads a gzipped
// page: the engine below answers as prometheus_client does, with pages of
// different loads per format, so the published load shows which one was
// read.
func TestContentNegotiation(t *testing.T) {
	t.Parallel()
	text, om := fixture(t, "vllm-v1.metrics"), fixture(t, "vllm-v1-openmetrics.metrics")
	var mu sync.Mutex
	var accepts, encodings []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		accepts, encodings = append(accepts, r.Header.Get("Accept")), append(encodings, r.Header.Get("Accept-Encoding"))
		mu.Unlock()
		body, ctype := text, "text/plain; version=0.0.4; charset=utf-8"
		for part := range strings.SplitSeq(r.Header.Get("Accept"), ",") {
			if mt, _, _ := strings.Cut(part, ";"); strings.TrimSpace(mt) == "application/openmetrics-text" {
				body, ctype = om, "application/openmetrics-text; version=1.0.0; charset=utf-8"
			}
		}
		w.Header().Set("Content-Type", ctype)
		if strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			w.Header().Set("Content-Encoding", "gzip")
			gz := gzip.NewWriter(w)
			_, _ = gz.Write(body)
			_ = gz.Close()
			return
		}
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)

	e := newEnv(t)
	in := subscribe(t, e.obs)
	start(t, e.config(scrape.VLLM{}, srv.URL+"/metrics"))
	r := in.waitReport(t, func(events.LoadReport) bool { return true })
	// vllm-v1.metrics: 6906 of 27264 (the OpenMetrics page says 8520).
	if r.ActiveDecodeBlocks != some(6906) || r.KVTotalBlocks != some(27264) {
		t.Errorf("published %+v of %+v, want 6906 of 27264 (the text page)", r.ActiveDecodeBlocks, r.KVTotalBlocks)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, a := range accepts {
		if strings.Contains(a, "openmetrics") || !strings.Contains(a, "text/plain;version=0.0.4") {
			t.Errorf("request %d: Accept %q, want the text format 0.0.4 and no OpenMetrics", i, a)
		}
		if !strings.Contains(encodings[i], "gzip") {
			t.Errorf("request %d: Accept-Encoding %q, want gzip", i, encodings[i])
		}
	}
}

// waitEntry returns the worker's registry entry once it is there.
func waitEntry(t testing.TB, nc *nats.Conn, model string, worker uint64) events.WorkerEntry {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var entry events.WorkerEntry
	natstest.WaitFor(t, waitTimeout, "the registry entry", func() bool {
		kv, err := js.KeyValue(context.Background(), events.WorkersBucket)
		if err != nil {
			return false
		}
		got, err := kv.Get(context.Background(), events.RegistryKey(model, worker))
		if err != nil {
			return false
		}
		return json.Unmarshal(got.Value(), &entry) == nil
	})
	return entry
}

// An engine that stops answering (an error status, a hang past the
// timeout, a closed port) makes the adapter stop publishing after 2 ×
// interval + 1 s, without a goodbye; the next good scrape resumes the same
// boot. Close says goodbye.
func TestSilentEnginePausesAndResumes(t *testing.T) {
	t.Parallel()
	page := fixture(t, "vllm-v1-dp2.metrics")
	tests := []struct {
		name string
		fail func(e *engine)
	}{
		{"error status", func(e *engine) { e.set(page, http.StatusServiceUnavailable, false) }},
		{"hang past the timeout", func(e *engine) { e.set(page, 0, true) }},
		{"not an exposition", func(e *engine) { e.set([]byte("<html>oops</html>\n"), 0, false) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			in := subscribe(t, e.obs)
			eng := newEngine(t, page)
			reg := prometheus.NewRegistry()
			c := e.config(scrape.VLLM{}, eng.url())
			c.Registerer = reg
			a := start(t, c)
			first := in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })

			tt.fail(eng)
			natstest.WaitFor(t, waitTimeout, "the adapter to go silent", func() bool { return a.Status().Silent })
			if st := a.Status(); st.LastError == nil || !errors.Is(st.LastError, adapter.ErrScrape) {
				t.Errorf("status while silent: last error %v, want an ErrScrape", st.LastError)
			}
			if v, _ := promtest.Value(t, reg, "workermon_scrape_silent", nil); v != 1 {
				t.Errorf("workermon_scrape_silent = %v, want 1", v)
			}
			// Everything published before the pause arrives before marker
			// a; between a and b, while 10 more scrapes fail, nothing.
			mark(t, e.nc, "a")
			for _, m := range in.untilMarker(t, "a") {
				if m.bye {
					t.Fatal("goodbye while the engine is silent")
				}
			}
			failed := func() float64 {
				v, _ := promtest.Value(t, reg, "workermon_scrapes_total", map[string]string{"result": "failed"})
				return v
			}
			before := failed()
			natstest.WaitFor(t, waitTimeout, "10 more failed scrapes", func() bool { return failed() >= before+10 })
			mark(t, e.nc, "b")
			if msgs := in.untilMarker(t, "b"); len(msgs) > 0 {
				t.Fatalf("%d messages published while silent, first %+v", len(msgs), msgs[0])
			}

			eng.set(page, 0, false)
			r := in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 0 })
			in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })
			if r.BootID != first.BootID || r.Seq <= first.Seq {
				t.Errorf("after resuming: boot %d seq %d, want the same boot %d and a later seq than %d",
					r.BootID, r.Seq, first.BootID, first.Seq)
			}
			natstest.WaitFor(t, waitTimeout, "the adapter to resume", func() bool { return !a.Status().Silent })

			if err := a.Close(t.Context()); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if !saidGoodbye(t, e, in) {
				t.Error("no goodbye on Close")
			}
		})
	}
}

// Close with a context that has already ended still closes the publisher:
// the goodbye goes out (it was lost, and the publisher's goroutines kept
// running, when Close gave up waiting for the polling to stop).
func TestCloseAfterContextEnded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	eng := newEngine(t, fixture(t, "vllm-v1-dp2.metrics"))
	a := start(t, e.config(scrape.VLLM{}, eng.url()))
	in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_ = a.Close(ctx) // may say the polling had not stopped yet
	if !saidGoodbye(t, e, in) {
		t.Error("no goodbye from a Close whose context had ended")
	}
}

// saidGoodbye reports whether a goodbye reached in before a marker sent
// now.
func saidGoodbye(t *testing.T, e *env, in *inbox) bool {
	t.Helper()
	mark(t, e.nc, "goodbye?")
	for _, m := range in.untilMarker(t, "goodbye?") {
		if m.bye {
			return true
		}
	}
	return false
}

// A declared rank that a good scrape no longer names is paused alone; the
// other keeps being published.
func TestMissingRankIsPaused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	both := fixture(t, "vllm-v1-dp2.metrics")
	var only0 []byte
	for line := range strings.Lines(string(both)) {
		if !strings.Contains(line, `engine="1"`) {
			only0 = append(only0, line...)
		}
	}
	eng := newEngine(t, both)
	a := start(t, e.config(scrape.VLLM{}, eng.url()))
	in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })

	eng.set(only0, 0, false)
	// Once a scrape of the new page is done, rank 1 is paused: after the
	// marker, rank 0's heartbeats go on and rank 1 says nothing.
	hits := eng.hits.Load()
	natstest.WaitFor(t, waitTimeout, "two scrapes of the new page", func() bool { return eng.hits.Load() >= hits+3 })
	mark(t, e.nc, "a")
	in.untilMarker(t, "a")
	for range 3 {
		r := in.waitReport(t, func(events.LoadReport) bool { return true })
		if r.DPRank != 0 {
			t.Fatalf("report of rank %d, which the page no longer names", r.DPRank)
		}
	}
	if st := a.Status(); st.Silent || st.Ranks != 1 || st.DPSize != 2 {
		t.Errorf("status %+v, want 1 rank found of 2 declared, not silent", st)
	}

	eng.set(both, 0, false)
	in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })
}

// Each way a scrape can fail is counted under its reason, and a worker is
// published only once a scrape is good.
func TestFailureReasons(t *testing.T) {
	t.Parallel()
	big := make([]byte, 2048)
	for i := range big {
		big[i] = '#'
	}
	tests := []struct {
		reason string
		serve  func(e *engine)
		url    func(e *engine) string
		max    int64
	}{
		{adapter.ReasonStatus, func(e *engine) { e.set(nil, http.StatusNotFound, false) }, nil, 0},
		{adapter.ReasonParse, func(e *engine) { e.set([]byte("vllm:kv_cache_usage_perc{engine=\"0\" 1\n"), 0, false) }, nil, 0},
		{adapter.ReasonNoRanks, func(e *engine) { e.set([]byte("# TYPE up gauge\nup 1\n"), 0, false) }, nil, 0},
		{adapter.ReasonBody, func(e *engine) { e.set(big, 0, false) }, nil, 1024},
		{adapter.ReasonRequest, func(e *engine) {}, func(e *engine) string {
			e.srv.Close()
			return e.url()
		}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.reason, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			in := subscribe(t, e.obs)
			eng := newEngine(t, nil)
			tt.serve(eng)
			url := eng.url()
			if tt.url != nil {
				url = tt.url(eng)
			}
			c := e.config(scrape.VLLM{}, url)
			if tt.max > 0 {
				c.MaxBodyBytes = tt.max
			}
			reg := prometheus.NewRegistry()
			c.Registerer = reg
			a := start(t, c)
			natstest.WaitFor(t, waitTimeout, "failures counted as "+tt.reason, func() bool {
				v, _ := promtest.Value(t, reg, "workermon_scrape_failures_total", map[string]string{"reason": tt.reason})
				return v >= 3
			})
			if st := a.Status(); st.DPSize != 0 || st.BootID != 0 || !errors.Is(st.LastError, adapter.ErrScrape) {
				t.Errorf("status %+v: want nothing declared and an ErrScrape", st)
			}
			if v, _ := promtest.Value(t, reg, "workermon_scrapes_total", map[string]string{"result": "ok"}); v != 0 {
				t.Errorf("workermon_scrapes_total{result=ok} = %v, want 0", v)
			}
			mark(t, e.nc, "a")
			if msgs := in.untilMarker(t, "a"); len(msgs) > 0 {
				t.Errorf("%d messages published before any good scrape", len(msgs))
			}
		})
	}
}

// TestScrapeErrorHidesCredentials: a metrics URL's token (given as the
// user, which net/http's error shows) is in neither the status's error nor
// the logs of a failing scrape.
func TestScrapeErrorHidesCredentials(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	eng := newEngine(t, nil)
	eng.srv.Close()
	var logs syncbuf.Buffer
	c := e.config(scrape.VLLM{}, strings.Replace(eng.url(), "http://", "http://s3cr3t@", 1))
	c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	reg := prometheus.NewRegistry()
	c.Registerer = reg
	a := start(t, c)
	natstest.WaitFor(t, waitTimeout, "a failed scrape", func() bool {
		v, _ := promtest.Value(t, reg, "workermon_scrape_failures_total", map[string]string{"reason": adapter.ReasonRequest})
		return v >= 1
	})
	st := a.Status()
	if st.LastError == nil || strings.Contains(st.LastError.Error(), "s3cr3t") {
		t.Errorf("status error %v: want one without the token", st.LastError)
	}
	if err := a.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(logs.String(), "s3cr3t") {
		t.Errorf("logs show the token:\n%s", logs.String())
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	good := e.config(scrape.VLLM{}, "http://127.0.0.1:8000/metrics")
	tests := []struct {
		name   string
		mutate func(*adapter.Config)
		ok     bool
	}{
		{"good", func(*adapter.Config) {}, true},
		{"no connection", func(c *adapter.Config) { c.Conn = nil }, false},
		{"no mapping", func(c *adapter.Config) { c.Mapping = nil }, false},
		{"no URL", func(c *adapter.Config) { c.MetricsURL = "" }, false},
		{"relative URL", func(c *adapter.Config) { c.MetricsURL = "/metrics" }, false},
		{"ftp URL", func(c *adapter.Config) { c.MetricsURL = "ftp://h/metrics" }, false},
		{"no model", func(c *adapter.Config) { c.Model = "" }, false},
		{"endpoint with /v1", func(c *adapter.Config) { c.Endpoint = "http://h:8000/v1" }, false},
		{"zero interval", func(c *adapter.Config) { c.Interval = 0 }, false},
		{"negative timeout", func(c *adapter.Config) { c.Timeout = -time.Second }, false},
		{"zero body bound", func(c *adapter.Config) { c.MaxBodyBytes = 0 }, false},
		{"bad prefix", func(c *adapter.Config) { c.SubjectPrefix = "a..b" }, false},
		{"URL with a password, bad port", func(c *adapter.Config) { c.MetricsURL = "http://u:s3cr3t@h:80x0/metrics" }, false},
		{"URL with a token, no host", func(c *adapter.Config) { c.MetricsURL = "http://s3cr3t@/metrics" }, false},
		{"endpoint with credentials", func(c *adapter.Config) { c.Endpoint = "http://u:s3cr3t@h:8000" }, false},
		{"endpoint with a password, bad port", func(c *adapter.Config) { c.Endpoint = "http://u:s3cr3t@h:80x0" }, false},
	}
	for _, tt := range tests {
		c := good
		tt.mutate(&c)
		err := c.Validate()
		if tt.ok != (err == nil) {
			t.Errorf("%s: Validate = %v", tt.name, err)
		}
		if err != nil && strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("%s: Validate = %v: shows the secret", tt.name, err)
		}
		if err != nil && !errors.Is(err, adapter.ErrInvalidConfig) && !errors.Is(err, publisher.ErrInvalidConfig) {
			t.Errorf("%s: %v does not wrap ErrInvalidConfig", tt.name, err)
		}
	}
	if got := adapter.SilenceAfter(100 * time.Millisecond); got != 1200*time.Millisecond {
		t.Errorf("SilenceAfter(100ms) = %v, want 1.2s", got)
	}
}
