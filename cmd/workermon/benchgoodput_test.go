package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/workermon/workermon/api"
	wmbench "github.com/workermon/workermon/bench"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/syncbuf"
)

// TestBenchGoodputPlumbing runs a tiny goodput benchmark with the real
// monitor, fleet and routers (2 s of the ramp and of the spike at rates that
// overload the fleet, the capacity given), every policy, and checks the
// rows, the JSON document of contract §16, the table and the report: the
// queue rows ran routers with the queue on (waiting 2 s on spike) and
// report a queue wait, the slo rows a monitor controlling the model under
// the profile's SLO, thresholds-best did not run on spike, whose clients
// retry. No goodput figure is asserted: the machine is shared.
func TestBenchGoodputPlumbing(t *testing.T) {
	t.Parallel()
	var progress syncbuf.Buffer
	// The queue rows run with a decode threshold so low that one request
	// makes a worker busy, so that requests queue however slowly a loaded
	// machine runs the fleet (with the policy's 0.85, a 3-router row was
	// seen without a queued request under -race); the rest is the
	// benchmark's own.
	policies := wmbench.Policies(true)
	for i, p := range policies {
		if p.Name == wmbench.PolicyQueue {
			policies[i].Monitor.Thresholds.ActiveDecodeBlocks = events.Ptr(0.02)
		}
	}
	stack := &inspectingStack{goodputStack: goodputStack{log: slog.New(slog.DiscardHandler)}}
	res, err := wmbench.Goodput(t.Context(), wmbench.GoodputConfig{
		Stack:     stack,
		Quick:     true,
		Timings:   wmbench.Timings{Warmup: time.Second, Measure: time.Second, Scenario: 2 * time.Second},
		Capacity:  40, // 20 to 100 requests/s: far over what 4 tiny ranks serve
		MaxDrain:  500 * time.Millisecond,
		Scenarios: scenarios(t, wmbench.ScenarioRamp, wmbench.ScenarioSpike),
		Policies:  policies,
		Seed:      7,
		// Uneven: the queue rows with 3 routers give figures per router.
		RouterShares: []float64{60, 30, 10},
		Progress:     func(s string) { _, _ = progress.Write([]byte(s + "\n")) },
	})
	if err != nil {
		t.Fatalf("goodput: %v\nprogress:\n%s", err, progress.String())
	}
	if len(res.Pending) != 0 {
		t.Errorf("pending policies %v", res.Pending)
	}
	type rowID struct {
		scenario, policy string
		routers          int
	}
	var ids []rowID
	for _, r := range res.Results {
		ids = append(ids, rowID{r.Scenario, r.Policy, r.Routers})
		if byRouter := r.Policy == wmbench.PolicyQueue && r.Routers == 3; byRouter != (len(r.ByRouter) == 3) ||
			byRouter && (r.ByRouter[0].Share != 0.6 || r.ByRouter[1].Share != 0.3 || r.ByRouter[2].Share != 0.1) {
			t.Errorf("row %s %s, %d routers: by router %+v; want shares 0.6, 0.3, 0.1 on the queue rows with 3 routers only", r.Scenario, r.Policy, r.Routers, r.ByRouter)
		}
		if r.AttemptsPerRequest < 1 || r.FailedPct < 0 || r.FailedPct > 100 || (r.Retries == 2) != (r.Scenario == wmbench.ScenarioSpike) {
			t.Errorf("row %s %s: %v attempts a request, failed %v %%, clients retry %d times", r.Scenario, r.Policy, r.AttemptsPerRequest, r.FailedPct, r.Retries)
		}
		if len(r.Series) != 2 {
			t.Errorf("row %s: %d points, want one a second of 2 s", r.Policy, len(r.Series))
		}
		if queued := r.QueueWaitP99 != nil; queued != (r.Policy == wmbench.PolicyQueue) {
			t.Errorf("row %s, %d router(s): queue wait p99 %v; want one exactly for queue", r.Policy, r.Routers, r.QueueWaitP99)
		}
	}
	want := []rowID{{"ramp", "none", 1}, {"ramp", "thresholds", 1}, {"ramp", "thresholds-best", 1}, {"ramp", "queue", 1}, {"ramp", "queue", 3},
		{"ramp", "slo", 1}, {"ramp", "slo", 3}, {"ramp", "committed", 1},
		{"spike", "none", 1}, {"spike", "thresholds", 1}, {"spike", "queue", 1}, {"spike", "queue", 3}, {"spike", "slo", 1}, {"spike", "slo", 3},
		{"spike", "committed", 1}}
	if !slices.Equal(ids, want) {
		t.Errorf("rows %v, want %v", ids, want)
	}
	if !strings.Contains(progress.String(), "decode 0.6") || !strings.Contains(progress.String(), "decode 0.9") {
		t.Errorf("thresholds-best did not sweep 0.6 … 0.9:\n%s", progress.String())
	}
	// What the monitors and routers of each row ran with.
	stack.mu.Lock()
	defer stack.mu.Unlock()
	sloMonitors, queueRouters, committedMonitors := 0, 0, 0
	for _, m := range stack.monitors {
		if m.spec.Thresholds.KVCommitted != nil {
			// committed: the monitor runs the leading thresholds alone.
			committedMonitors++
			th := m.thresholds
			if th.KVCommitted == nil || *th.KVCommitted != 1 || th.QueueDelayMs == nil || *th.QueueDelayMs != 500 || th.ActiveDecodeBlocks != nil {
				t.Errorf("a committed monitor's thresholds: %+v; want kv_committed 1, queue delay 500 ms, no decode threshold", th)
			}
		}
		if m.spec.SLO == nil {
			if m.sloStatus != http.StatusNotFound {
				t.Errorf("a monitor without an SLO answered GET /slo?model= with %d, want 404", m.sloStatus)
			}
			continue
		}
		sloMonitors++
		r := m.slo
		if m.sloStatus != http.StatusOK || r.Mode != "enforce" || r.TTFTms == nil || *r.TTFTms != 1000 || r.ITLms == nil || *r.ITLms != 50 {
			t.Errorf("an slo monitor's SLO: %d %+v; want enforce, TTFT 1000 ms, ITL 50 ms (the profile's)", m.sloStatus, r)
		}
		if r.Applied == nil || r.Applied.Decode < 0.3 || r.Applied.Decode > 0.98 {
			t.Errorf("an slo monitor's controller applied %+v: want thresholds within its ranges", r.Applied)
		}
	}
	waits := map[float64]int{}
	for _, q := range stack.routers {
		if q.spec.QueueMaxWait > 0 {
			queueRouters++
			waits[q.queues.MaxWaitMs]++
			if !q.queues.Enabled || q.queues.MaxWaitMs != float64(q.spec.QueueMaxWait.Milliseconds()) {
				t.Errorf("a queue router's /queues: %+v; want enabled, max wait %v", q.queues, q.spec.QueueMaxWait)
			}
		} else if q.queues.Enabled {
			t.Errorf("a router of another policy has its queue on")
		}
	}
	if committedMonitors != 2 {
		t.Errorf("%d monitors with the committed thresholds, want 2", committedMonitors)
	}
	if sloMonitors != 4 || queueRouters != 8 {
		t.Errorf("%d monitors with an SLO, %d routers with a queue; want 4 (slo, 1 and 3 routers, 2 scenarios) and 8 (queue: 1 + 3, twice)", sloMonitors, queueRouters)
	}
	if waits[float64(wmbench.QueueMaxWait.Milliseconds())] != 4 || waits[2000] != 4 {
		t.Errorf("queue routers by their max wait (ms): %v; want 4 of %v (ramp) and 4 of 2 s (spike)", waits, wmbench.QueueMaxWait)
	}

	data, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	keys := func(m map[string]any) []string {
		var k []string
		for key := range m {
			k = append(k, key)
		}
		slices.Sort(k)
		return k
	}
	if got, want := keys(doc), []string{"capacity_documents_rps", "capacity_rps", "results", "slo"}; !slices.Equal(got, want) {
		t.Errorf("document keys %v, want %v", got, want)
	}
	if got, want := keys(doc["slo"].(map[string]any)), []string{"itl_ms", "ttft_ms"}; !slices.Equal(got, want) {
		t.Errorf("slo keys %v, want %v", got, want)
	}
	rows := doc["results"].([]any)
	if len(rows) != 15 {
		t.Fatalf("%d results, want 15", len(rows))
	}
	keysWant := []string{"attempts_per_request", "ceiling_pct", "ceiling_rps", "cpu_pct", "failed_pct", "goodput_pct", "goodput_rps", "itl_p99_ms", "policy", "preemptions", "queue_wait_p99_ms",
		"rejected_pct", "routers", "scenario", "ttft_p50_ms", "ttft_p99_ms"}
	for _, r := range rows {
		row := r.(map[string]any)
		if br, ok := row["by_router"].([]any); ok && len(br) == 3 {
			if got, want := keys(br[0].(map[string]any)), []string{"queue_wait_p90_ms", "rejected_pct", "share"}; !slices.Equal(got, want) {
				t.Errorf("by_router keys %v, want %v", got, want)
			}
			delete(row, "by_router")
		}
		if got := keys(row); !slices.Equal(got, keysWant) {
			t.Errorf("row keys %v, want %v", got, keysWant)
		}
		// Ramp's ceiling at a chat capacity of 40: 50 % → 250 % → 50 %,
		// under the capacity for its first and last eighth: 37.5; spike's
		// at 40 % of it, 200 % in its first 2 s: 16.
		if c := row["ceiling_rps"]; !(row["scenario"] == "ramp" && c == 37.5 || row["scenario"] == "spike" && c == 16.0) {
			t.Errorf("%s: ceiling %v", row["scenario"], c)
		}
		if _, isNum := row["queue_wait_p99_ms"].(float64); isNum != (row["policy"] == wmbench.PolicyQueue) {
			t.Errorf("%s: queue_wait_p99_ms %v, want a number for queue only, else null", row["policy"], row["queue_wait_p99_ms"])
		}
	}

	var table bytes.Buffer
	wmbench.PrintGoodput(&table, res)
	for _, s := range []string{"SLO (the profile's): TTFT ≤ 1000 ms, TPOT ≤ 50 ms", "capacity", "thresholds-best (",
		"queue: ", "slo: ", "by router, load split 60/30/10", "ramp queue, 3 routers: 60 %: ", "committed: serve --kv-committed-threshold 1 --queue-delay-threshold-ms 500", "ceilings", "ramp 37.50/s", "ramp: Winner: ", "spike: Winner: ", "% of ceil.", "host CPU"} {
		if !strings.Contains(table.String(), s) {
			t.Errorf("the table lacks %q:\n%s", s, table.String())
		}
	}
	if strings.Contains(table.String(), "not measured yet") {
		t.Errorf("the table lists a policy not measured:\n%s", table.String())
	}
	path, err := wmbench.WriteReport(t.TempDir(), res)
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// 3 charts for ramp, 4 for spike (attempts/s: its clients retry).
	if n := strings.Count(string(page), `class="chart"`); n != 7 {
		t.Errorf("the report has %d charts, want 7", n)
	}
}

// scenarios returns the benchmark's scenarios of those names.
func scenarios(t *testing.T, names ...string) []wmbench.Scenario {
	t.Helper()
	scs, err := wmbench.SelectScenarios(names)
	if err != nil {
		t.Fatal(err)
	}
	return scs
}

// TestBenchGoodputReportInBrowser opens a report in headless Chromium: every
// scenario has its three charts (four where clients retry: attempts/s) with
// a line per policy and the offered load, each policy drawn with its own
// dash, a sentence naming the winner, nothing fetched from elsewhere, and a
// screenshot is saved.
func TestBenchGoodputReportInBrowser(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM): "+
			"install it with `apt-get install -y chromium` (.ci/run does)", chromiumNames)
	}
	t.Parallel()
	res := wmbench.GoodputResult{CapacityRPS: 10, SLO: wmbench.SLOms{TTFT: 1000, ITL: 50}, Profile: "tiny", Workers: 4,
		Scenario: 30 * time.Second, Pending: []wmbench.Policy{{Name: "queue", Pending: "not built"}}}
	for _, sc := range wmbench.Scenarios() {
		for i, policy := range []string{"none", "thresholds", "thresholds-best"} {
			row := wmbench.GoodputRow{Scenario: sc.Name, Policy: policy, Routers: 1, Decode: 0.75, Retries: sc.Retries,
				GoodputRPS: 8 - float64(i), CeilingRPS: 9}
			for s := range 30 {
				at := time.Duration(s) * time.Second
				offered := 10 * sc.Rate(at, 30*time.Second)
				pt := wmbench.Point{T: at, TargetRPS: offered, Offered: int(offered), CeilingRPS: min(offered, 10), Attempts: int(offered) + int(max(0, offered-10))*i,
					Good: int(min(offered, 10-float64(i))), Rejected: int(max(0, offered-10)) * i, TTFTp99: 200 + 400*float64(i)*offered}
				if s%7 == 3 {
					pt.TTFTp99 = math.NaN()
				}
				row.Series = append(row.Series, pt)
			}
			res.Results = append(res.Results, row)
		}
	}
	path, err := wmbench.WriteReport(t.TempDir(), res)
	if err != nil {
		t.Fatal(err)
	}
	b := openBrowser(t, chrome, "file://"+filepath.ToSlash(path))
	b.poll("17 charts are drawn (5 scenarios × 3, and attempts/s for the 2 that retry)", `document.querySelectorAll('section.scenario svg.chart').length === 17`, 10*time.Second)
	b.poll("each chart has its lines", `[...document.querySelectorAll('svg.chart')].every(s =>
		s.querySelectorAll('path.series').length >= 3 && s.getBoundingClientRect().width > 100)`, 5*time.Second)
	b.poll("the requests/s charts show the offered load, the ceiling and 3 policies", `[...document.querySelectorAll('section.scenario')].every(s =>
		s.querySelector('svg.chart').querySelectorAll('path.series').length === 5 && s.querySelector('svg.chart path.series.ceiling'))`, 5*time.Second)
	b.poll("each policy has its own dash", `[...document.querySelectorAll('svg.chart')].every(s =>
		new Set([...s.querySelectorAll('path.series.policy')].map(p => p.getAttribute('stroke-dasharray') || 'solid')).size === 3)`, 5*time.Second)
	b.poll("the TTFT lines carry through seconds without a value, marked", `[...document.querySelectorAll('section.scenario')].every(s =>
		s.querySelectorAll('circle.carried').length > 0)`, 5*time.Second)
	b.poll("the scenarios with retries plot attempts", `document.querySelectorAll('svg.chart[aria-label^="attempts/s"]').length === 2`, 5*time.Second)
	b.poll("nothing is loaded from elsewhere", `performance.getEntriesByType('resource').length === 0 &&
		document.querySelectorAll('script, link, img, [src]').length === 0`, 5*time.Second)
	if got := b.text("body"); !strings.Contains(got, "Not measured yet: queue") || strings.Count(got, "Winner: none, with 8.00 good requests/s") != 5 {
		t.Errorf("the page does not say queue is not measured yet, or does not name the winner of each scenario: %.300q", got)
	}
	shot, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	if len(shot) < 10_000 {
		t.Errorf("screenshot of %d bytes: empty page?", len(shot))
	}
	out := filepath.Join(screenshotDir(t), "goodput-report.png")
	if err := os.WriteFile(out, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", out, len(shot))
	b.checkErrors()
}

// inspectingStack is goodputStack that asks each monitor for the
// benchmark model's SLO (GET /slo?model=) and each router for its queues
// (GET /queues) just before it closes them.
type inspectingStack struct {
	goodputStack
	mu       sync.Mutex
	monitors []*inspectedMonitor
	routers  []*inspectedRouter
}

type inspectedMonitor struct {
	*goodputMonitor
	stack      *inspectingStack
	spec       wmbench.MonitorSpec
	sloStatus  int
	slo        api.SLOReply
	thresholds events.Thresholds // the model's, as the monitor states them
}

type inspectedRouter struct {
	goodputRouter
	stack  *inspectingStack
	spec   wmbench.RouterSpec
	queues struct {
		Enabled   bool    `json:"enabled"`
		MaxWaitMs float64 `json:"max_wait_ms"`
	}
}

func (s *inspectingStack) StartMonitor(ctx context.Context, spec wmbench.MonitorSpec) (wmbench.Monitor, error) {
	m, err := s.goodputStack.StartMonitor(ctx, spec)
	if err != nil {
		return nil, err
	}
	return &inspectedMonitor{goodputMonitor: m.(*goodputMonitor), stack: s, spec: spec}, nil
}

func (s *inspectingStack) StartRouter(ctx context.Context, spec wmbench.RouterSpec) (wmbench.Router, error) {
	r, err := s.goodputStack.StartRouter(ctx, spec)
	if err != nil {
		return nil, err
	}
	return &inspectedRouter{goodputRouter: r.(goodputRouter), stack: s, spec: spec}, nil
}

func (m *inspectedMonitor) Close(ctx context.Context) error {
	resp, err := http.Get("http://" + m.svc.httpAddr + "/slo?model=" + url.QueryEscape(wmbench.GoodputModel))
	if err == nil {
		m.sloStatus = resp.StatusCode
		err = json.NewDecoder(resp.Body).Decode(&m.slo)
		resp.Body.Close()
	}
	if c, cerr := api.NewClient("http://"+m.svc.httpAddr, "", nil); cerr != nil {
		err = errors.Join(err, cerr)
	} else if th, terr := c.ThresholdsOf(ctx, wmbench.GoodputModel); terr != nil {
		err = errors.Join(err, terr)
	} else {
		m.thresholds = th.Thresholds
	}
	m.stack.mu.Lock()
	m.stack.monitors = append(m.stack.monitors, m)
	m.stack.mu.Unlock()
	return errors.Join(err, m.goodputMonitor.Close(ctx))
}

func (r *inspectedRouter) Close(ctx context.Context) error {
	resp, err := http.Get(r.URL() + "/queues")
	if err == nil {
		err = json.NewDecoder(resp.Body).Decode(&r.queues)
		resp.Body.Close()
	}
	r.stack.mu.Lock()
	r.stack.routers = append(r.stack.routers, r)
	r.stack.mu.Unlock()
	return errors.Join(err, r.goodputRouter.Close(ctx))
}
