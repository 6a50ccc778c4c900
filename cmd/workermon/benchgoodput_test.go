package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	wmbench "github.com/workermon/workermon/bench"
	"github.com/workermon/workermon/internal/syncbuf"
)

// TestBenchGoodputPlumbing runs a tiny goodput benchmark with the real
// monitor, fleet and router (2 s of the ramp, the capacity given) and checks
// the rows, the JSON document of contract §16, the table and the report. No
// figure is asserted: the machine is shared.
func TestBenchGoodputPlumbing(t *testing.T) {
	t.Parallel()
	var progress syncbuf.Buffer
	res, err := wmbench.Goodput(t.Context(), wmbench.GoodputConfig{
		Stack:     goodputStack{log: slog.New(slog.DiscardHandler)},
		Quick:     true,
		Timings:   wmbench.Timings{Warmup: time.Second, Measure: time.Second, Scenario: 2 * time.Second},
		Capacity:  3,
		MaxDrain:  500 * time.Millisecond,
		Scenarios: wmbench.Scenarios()[:1], // ramp
		// The policies of the run, and one over three routers (as queue
		// and slo will run).
		Policies: append(wmbench.Policies(true), wmbench.Policy{Name: "three-routers", Routers: []int{3},
			Monitor: wmbench.Policies(true)[1].Monitor}),
		Seed:     7,
		Progress: func(s string) { _, _ = progress.Write([]byte(s + "\n")) },
	})
	if err != nil {
		t.Fatalf("goodput: %v\nprogress:\n%s", err, progress.String())
	}
	var policies []string
	for _, r := range res.Results {
		policies = append(policies, r.Policy)
		if want := map[bool]int{true: 3, false: 1}[r.Policy == "three-routers"]; r.Scenario != wmbench.ScenarioRamp || r.Routers != want {
			t.Errorf("row %+v: want scenario ramp, %d router(s)", r, want)
		}
		if len(r.Series) != 2 {
			t.Errorf("row %s: %d points, want one a second of 2 s", r.Policy, len(r.Series))
		}
	}
	if want := []string{"none", "thresholds", "thresholds-best", "three-routers"}; !slices.Equal(policies, want) {
		t.Errorf("policies %v, want %v (queue and slo not measured yet)", policies, want)
	}
	if !strings.Contains(progress.String(), "decode 0.6") || !strings.Contains(progress.String(), "decode 0.9") {
		t.Errorf("thresholds-best did not sweep 0.6 … 0.9:\n%s", progress.String())
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
	if got, want := keys(doc), []string{"capacity_rps", "results", "slo"}; !slices.Equal(got, want) {
		t.Errorf("document keys %v, want %v", got, want)
	}
	if got, want := keys(doc["slo"].(map[string]any)), []string{"itl_ms", "ttft_ms"}; !slices.Equal(got, want) {
		t.Errorf("slo keys %v, want %v", got, want)
	}
	rows := doc["results"].([]any)
	if len(rows) != 4 {
		t.Fatalf("%d results, want 4", len(rows))
	}
	want := []string{"cpu_pct", "goodput_pct", "goodput_rps", "itl_p99_ms", "policy", "preemptions", "queue_wait_p99_ms",
		"rejected_pct", "routers", "scenario", "ttft_p50_ms", "ttft_p99_ms"}
	for _, r := range rows {
		row := r.(map[string]any)
		if got := keys(row); !slices.Equal(got, want) {
			t.Errorf("row keys %v, want %v", got, want)
		}
		if row["queue_wait_p99_ms"] != nil {
			t.Errorf("queue_wait_p99_ms %v without a queue, want null", row["queue_wait_p99_ms"])
		}
	}

	var table bytes.Buffer
	wmbench.PrintGoodput(&table, res)
	for _, s := range []string{"SLO (the profile's): TTFT ≤ 1000 ms, TPOT ≤ 50 ms", "capacity", "thresholds-best (",
		"not measured yet: queue", "not measured yet: slo"} {
		if !strings.Contains(table.String(), s) {
			t.Errorf("the table lacks %q:\n%s", s, table.String())
		}
	}
	path, err := wmbench.WriteReport(t.TempDir(), res)
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(page), "<svg"); n != 3 {
		t.Errorf("the report has %d charts, want 3 (one scenario)", n)
	}
}

// TestBenchGoodputReportInBrowser opens a report in headless Chromium: every
// scenario has its three charts with a line per policy and the offered load,
// nothing is fetched from elsewhere, and a screenshot is saved.
func TestBenchGoodputReportInBrowser(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM): "+
			"install it with `apt-get install -y chromium` (.ci/run does)", chromiumNames)
	}
	t.Parallel()
	res := wmbench.GoodputResult{CapacityRPS: 10, SLO: wmbench.SLOms{TTFT: 1000, ITL: 50}, Profile: "tiny", Workers: 4,
		Scenario: 30 * time.Second, Pending: wmbench.Policies(false)[3:]}
	for _, sc := range wmbench.Scenarios() {
		for i, policy := range []string{"none", "thresholds", "thresholds-best"} {
			row := wmbench.GoodputRow{Scenario: sc.Name, Policy: policy, Routers: 1, Decode: 0.75}
			for s := range 30 {
				at := time.Duration(s) * time.Second
				offered := 10 * sc.Rate(at, 30*time.Second)
				row.Series = append(row.Series, wmbench.Point{T: at, TargetRPS: offered, Offered: int(offered),
					Good: int(min(offered, 10-float64(i))), Rejected: int(max(0, offered-10)) * i, TTFTp99: 200 + 400*float64(i)*offered})
			}
			res.Results = append(res.Results, row)
		}
	}
	path, err := wmbench.WriteReport(t.TempDir(), res)
	if err != nil {
		t.Fatal(err)
	}
	b := openBrowser(t, chrome, "file://"+filepath.ToSlash(path))
	b.poll("nine charts are drawn", `document.querySelectorAll('section.scenario svg.chart').length === 9`, 10*time.Second)
	b.poll("each chart has its lines", `[...document.querySelectorAll('svg.chart')].every(s =>
		s.querySelectorAll('path.series').length >= 3 && s.getBoundingClientRect().width > 100)`, 5*time.Second)
	b.poll("the requests/s charts show the offered load and 3 policies", `[...document.querySelectorAll('section.scenario')].every(s =>
		s.querySelector('svg.chart').querySelectorAll('path.series').length === 4)`, 5*time.Second)
	b.poll("nothing is loaded from elsewhere", `performance.getEntriesByType('resource').length === 0 &&
		document.querySelectorAll('script, link, img, [src]').length === 0`, 5*time.Second)
	if got := b.text("body"); !strings.Contains(got, "Not measured yet: queue") {
		t.Errorf("the page does not say queue is not measured yet: %.300q", got)
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
