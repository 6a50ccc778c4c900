package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/loadgen"
	"github.com/workermon/workermon/sim"
)

// This file lints the exposition of every command that serves /metrics
// with client_golang's promlint, the rules of `promtool check metrics`, so
// that a new metric cannot break the check again. A labelled family is
// only gathered once it has a series, so each command is exercised first
// and the test waits for the labelled families it must have by then.

// lintGathered fails the test for every problem promlint finds in g, and
// for every family of want that g does not gather (with at least one
// series): then the command was not exercised enough for the lint to see
// it.
func lintGathered(t *testing.T, what string, g prometheus.Gatherer, want ...string) {
	t.Helper()
	problems, err := testutil.GatherAndLint(g)
	if err != nil {
		t.Fatalf("%s: lint: %v", what, err)
	}
	reportProblems(t, what, problems)
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("%s: gather: %v", what, err)
	}
	var have []string
	for _, mf := range mfs {
		if len(mf.GetMetric()) > 0 {
			have = append(have, mf.GetName())
		}
	}
	for _, name := range want {
		if !slices.Contains(have, name) {
			t.Errorf("%s: %s has no series: exercise it before the lint", what, name)
		}
	}
	t.Logf("%s: %d families linted", what, len(have))
}

func reportProblems(t *testing.T, what string, problems []promlint.Problem) {
	t.Helper()
	for _, p := range problems {
		t.Errorf("%s: promlint: %s: %s", what, p.Metric, p.Text)
	}
}

// missing returns the families of names that g does not gather with at
// least one series.
func missing(g prometheus.Gatherer, names ...string) []string {
	mfs, err := g.Gather()
	if err != nil {
		return names
	}
	have := map[string]bool{}
	for _, mf := range mfs {
		have[mf.GetName()] = len(mf.GetMetric()) > 0
	}
	var out []string
	for _, name := range names {
		if !have[name] {
			out = append(out, name)
		}
	}
	return out
}

// postJSON posts body as JSON and returns the status and the body.
func postJSON(t *testing.T, url, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// watchBoard opens the board's event stream at base and reads it up to the
// first snapshot.
func watchBoard(t *testing.T, base string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/board/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "event: snapshot") {
			return
		}
	}
	t.Fatalf("%s/board/events: no snapshot (%v)", base, sc.Err())
}

// TestMetricsLintServeRouter runs the demo's monitor (`serve`), fleet and
// router under a load that makes every worker busy, with the rescheduler,
// a threshold override, a cordon and a board viewer, and lints both
// registries: the monitor's and the router's.
func TestMetricsLintServeRouter(t *testing.T) {
	t.Parallel()
	o := defaultDemoOptions()
	o.serve.embedded.Addr = "127.0.0.1:0"
	o.serve.httpAddr, o.router.httpAddr = "127.0.0.1:0", "127.0.0.1:0"
	o.serve.writer.Warmup = 0
	o.serve.writer.Heartbeat = 500 * time.Millisecond
	o.serve.resched.interval, o.serve.resched.timeout = 500*time.Millisecond, 250*time.Millisecond
	o.serve.resched.planner.Cooldown = 500 * time.Millisecond
	o.fleet.Workers, o.fleet.Ranks = 2, 1
	o.fleet.Engine.KVBlocks = 64
	o.serve.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
	d, err := startDemo(t.Context(), o, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, d.Close)
	routerReg := d.routerReg
	monitor, router := "http://"+d.monitor.httpAddr, "http://"+d.router.httpAddr
	natstest.WaitFor(t, 15*time.Second, "router sees both workers", func() bool {
		rec, _, ok := d.router.watcher.Record(o.fleet.Model)
		return ok && len(rec.Free)+len(rec.Busy) == 2
	})

	// Operator state: an override (the threshold in force) and a cordon of
	// a worker that does not exist, so the load still has both; and a
	// board viewer.
	for _, c := range []struct{ path, body string }{
		{"/busy_threshold", `{"model":"` + o.fleet.Model + `","active_decode_blocks_threshold":0.5}`},
		{"/cordon", `{"model":"` + o.fleet.Model + `","worker_id":99}`},
	} {
		if status, body := postJSON(t, monitor+c.path, c.body); status != http.StatusOK {
			t.Fatalf("POST %s: %d %s", c.path, status, body)
		}
	}
	for _, base := range []string{monitor, router} {
		watchBoard(t, base)
		slotsTestDo(t, "GET", base+"/metrics", "")
		slotsTestDo(t, "GET", base+"/nowhere", "")
	}
	complete(t, router, "unknown-model")

	cfg := loadgen.DefaultConfig()
	cfg.Target, cfg.Models, cfg.RPS, cfg.CancelFraction = router, []string{o.fleet.Model}, 80, 0.1
	cfg.PriorityMix, err = loadgen.ParsePriorityMix(DefaultDemoPriorityMix)
	if err != nil {
		t.Fatal(err)
	}
	gen, err := loadgen.New(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, stopLoad := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = gen.Run(ctx) }()
	t.Cleanup(func() { stopLoad(); <-done })

	monitorWant := []string{
		"workermon_reports_accepted_total", "workermon_workers", "workermon_all_busy_changes_total",
		"workermon_busy_writer_writes_total", "workermon_threshold_watcher_updates_total",
		"workermon_cordon_watcher_updates_total", "workermon_rescheduler_pairs_total",
		"workermon_lease_partitions_held", "workermon_lease_gains_total", "workermon_board_updates_total",
	}
	routerWant := []string{
		"workermon_router_admissions_total", "workermon_router_requests_rejected_total",
		"workermon_router_class_decisions_total", "workermon_router_request_duration_seconds",
		"workermon_router_cancellations_total", "workermon_router_watch_keys", "workermon_board_clients",
	}
	var last string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last: %s", last)
		}
	})
	natstest.WaitFor(t, 60*time.Second, "503s and 429s, and the families of both registries", func() bool {
		s := gen.Stats().Total
		gone := append(missing(d.monitor.reg, monitorWant...), missing(routerReg, routerWant...)...)
		last = fmt.Sprintf("load %+v, families without series %v", s, gone)
		return s.Unavailable > 0 && s.TooMany > 0 && len(gone) == 0
	})
	stopLoad()
	<-done
	lintGathered(t, "serve", d.monitor.reg, monitorWant...)
	lintGathered(t, "router", routerReg, routerWant...)
}

// TestMetricsLintSlots: the slot tracker, fed from the worker registry
// too, after registrations, requests, refusals of its caps and expiries.
func TestMetricsLintSlots(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	clock := &slotsTestClock{t: time.Unix(1_800_000_000, 0)}
	o := defaultSlotsOptions()
	o.httpAddr = "127.0.0.1:0"
	o.fromRegistry, o.natsURL = true, srv.ClientURL()
	o.tracker.Now = clock.now
	o.tracker.MaxWorkers, o.tracker.MaxTotalRanks, o.tracker.MaxHashesPerRequest, o.tracker.MaxBlocks = 2, 3, 3, 4
	reg := newRegistry()
	svc, err := startSlots(t.Context(), o, slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, svc.close)
	base := "http://" + svc.http.addr
	for _, step := range []struct{ path, body string }{
		{"/register", `{"worker_id":7,"model_name":"m","block_size":16,"dp_size":2}`},
		{"/register", `{"worker_id":8,"model_name":"m","block_size":16,"dp_size":2}`},
		{"/add", `{"model_name":"m","request_id":"a","worker_id":7,"sequence_hashes":[1,2,3]}`},
		{"/add", `{"model_name":"m","request_id":"b","worker_id":7,"sequence_hashes":[1,2,3,4]}`},
		{"/potential_loads", `{"model_name":"m","sequence_hashes":[1,2]}`},
	} {
		postJSON(t, base+step.path, step.body)
	}
	slotsTestDo(t, "GET", base+"/loads", "")
	clock.add(o.tracker.RequestTTL)
	lintGathered(t, "slots", reg, "workermon_slots_workers", "workermon_slots_rejected_total", "workermon_slots_expired_total",
		"workermon_nats_server_info")
}

// TestMetricsLintScrape: `workermon scrape` after good scrapes of the
// recorded vLLM page and failed ones.
func TestMetricsLintScrape(t *testing.T) {
	t.Parallel()
	svc := testService(t, nil)
	page, err := os.ReadFile(filepath.Join("..", "..", "scrape", "testdata", "vllm-v1.metrics"))
	if err != nil {
		t.Fatal(err)
	}
	eng := newScrapeEngine(t, page)
	o := defaultScrapeOptions()
	o.engine, o.metricsURL, o.model = "vllm", eng.srv.URL+"/metrics", "Qwen/Qwen3-0.6B"
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
	closeAtCleanup(t, sc.close)
	natstest.WaitFor(t, 15*time.Second, "a good scrape", func() bool {
		v, _ := promtest.Value(t, reg, "workermon_scrapes_total", map[string]string{"result": "ok"})
		return v > 0
	})
	eng.set(nil, true)
	natstest.WaitFor(t, 15*time.Second, "a failed scrape", func() bool {
		v, _ := promtest.Value(t, reg, "workermon_scrapes_total", map[string]string{"result": "failed"})
		return v > 0
	})
	lintGathered(t, "scrape", reg, "workermon_scrapes_total", "workermon_scrape_failures_total", "workermon_scrape_duration_seconds")
}

// TestMetricsLintSim: `workermon sim`'s own /metrics, read over HTTP, and
// the vLLM-shaped /metrics page of one of its workers after a completion.
func TestMetricsLintSim(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	ctx, cancel := context.WithCancel(t.Context())
	var stdout, stderr syncbuf.Buffer
	done := make(chan error, 1)
	go func() {
		done <- runSim(ctx, []string{"--nats-url", srv.ClientURL(), "--workers", "1", "--port-base", "0"}, &stdout, &stderr)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runSim: %v", err)
		}
	})
	var base, worker string
	natstest.WaitFor(t, 15*time.Second, "the sim's and its worker's HTTP addresses on stdout", func() bool {
		for line := range strings.Lines(stdout.String()) {
			if rest, ok := strings.CutPrefix(line, "workermon sim: http://"); ok {
				addr, _, _ := strings.Cut(rest, " ")
				base = "http://" + addr
			}
			if _, rest, ok := strings.Cut(line, ": http://"); ok && strings.HasPrefix(line, "worker ") {
				addr, _, _ := strings.Cut(rest, " ")
				worker = "http://" + addr
			}
		}
		return base != "" && worker != ""
	})
	complete(t, worker, sim.DefaultModel)
	for _, url := range []string{base + "/metrics", worker + "/metrics"} {
		status, _, body := slotsTestDo(t, "GET", url, "")
		if status != http.StatusOK {
			t.Fatalf("GET %s: %d", url, status)
		}
		problems, err := promlint.New(strings.NewReader(body)).Lint()
		if err != nil {
			t.Fatalf("GET %s: lint: %v", url, err)
		}
		// A worker's page is vLLM's, whose names have a colon (vllm:...):
		// scrape reads them so, and a real engine's page has them too.
		problems = slices.DeleteFunc(problems, func(p promlint.Problem) bool {
			return url == worker+"/metrics" && strings.HasPrefix(p.Metric, "vllm:") && strings.Contains(p.Text, "should not contain ':'")
		})
		reportProblems(t, url, problems)
		if !strings.Contains(body, "# TYPE ") {
			t.Errorf("GET %s: no metric families:\n%s", url, body)
		}
	}
}
