package bench

import (
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/workermon/workermon/loadgen"
	"github.com/workermon/workermon/sim/stepengine"
)

// TestScenarioShapes pins contract §16's load shapes, as fractions of the
// capacity.
func TestScenarioShapes(t *testing.T) {
	t.Parallel()
	const length = 30 * time.Second
	by := map[string]Scenario{}
	for _, sc := range Scenarios() {
		by[sc.Name] = sc
	}
	ramp, burst, shift, spike := by[ScenarioRamp], by[ScenarioBurst], by[ScenarioShift], by[ScenarioSpike]
	for _, c := range []struct {
		sc   Scenario
		at   time.Duration
		want float64
	}{
		{ramp, 0, 0.5}, {ramp, length / 4, 1.5}, {ramp, length / 2, 2.5}, {ramp, 3 * length / 4, 1.5}, {ramp, length, 0.5},
		{burst, 0, 0.7}, {burst, 5 * time.Second, 7}, {burst, 6900 * time.Millisecond, 7}, {burst, 7 * time.Second, 0.7},
		{burst, 15 * time.Second, 7}, {burst, 25 * time.Second, 7}, {burst, 29 * time.Second, 0.7},
		{shift, 0, 0.7}, {shift, 29 * time.Second, 0.7},
		// 40 %, 200 % in the first second of every 10 s from second 5.
		{spike, 0, 0.4}, {spike, 4999 * time.Millisecond, 0.4}, {spike, 5 * time.Second, 2}, {spike, 5999 * time.Millisecond, 2},
		{spike, 6 * time.Second, 0.4}, {spike, 15500 * time.Millisecond, 2}, {spike, 16 * time.Second, 0.4}, {spike, 25 * time.Second, 2},
	} {
		if got := c.sc.Rate(c.at, length); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("%s at %v: rate %v × capacity, want %v", c.sc.Name, c.at, got, c.want)
		}
	}
	if ramp.Workload(20*time.Second, length) != loadgen.WorkloadChat || burst.Workload(0, length) != loadgen.WorkloadChat {
		t.Error("ramp and burst are not chat")
	}
	if shift.Workload(14*time.Second, length) != loadgen.WorkloadChat || shift.Workload(15*time.Second, length) != loadgen.WorkloadDocuments {
		t.Error("shift is not chat for the first half, documents for the second")
	}
	if spike.Workload(5*time.Second, length) != loadgen.WorkloadChat || spike.Workload(29*time.Second, length) != loadgen.WorkloadChat {
		t.Error("spike is not chat")
	}
	// Contract §23: burst and spike with clients that retry twice, the
	// others with clients that give up; queue waits up to 2 s on spike.
	for _, sc := range Scenarios() {
		retries := 0
		if sc.Name == ScenarioBurst || sc.Name == ScenarioSpike {
			retries = 2
		}
		wait := time.Duration(0)
		if sc.Name == ScenarioSpike {
			wait = 2 * time.Second
		}
		if sc.Retries != retries || sc.QueueMaxWait != wait {
			t.Errorf("%s: clients retry %d times, queue wait %v; want %d, %v", sc.Name, sc.Retries, sc.QueueMaxWait, retries, wait)
		}
	}
}

// TestPlan: every scenario runs every policy but thresholds-best on spike;
// queue's routers wait 2 s on spike and QueueMaxWait elsewhere, other
// policies never queue; a sweep is a job per value, each seed a job.
func TestPlan(t *testing.T) {
	t.Parallel()
	g := &goodput{cfg: GoodputConfig{Scenarios: Scenarios(), Policies: Policies(false), Seeds: 2, Seed: 5}}
	jobs, groups := g.plan()
	rows := map[string]int{}
	for _, grp := range groups {
		rows[grp.p.Name]++
	}
	// 5 scenarios, of which scaleout runs none, thresholds and resched
	// only; thresholds-best on 3; queue and slo with 1 and 3 routers.
	if rows[PolicyNone] != 5 || rows[PolicyThresholds] != 5 || rows[PolicyThresholdsBest] != 3 || rows[PolicyQueue] != 8 || rows[PolicySLO] != 8 ||
		rows[PolicyCommitted] != 4 || rows[PolicyResched] != 1 {
		t.Errorf("rows per policy %v", rows)
	}
	// Each configuration is measured apart: committed has no decode or
	// prefill threshold, like none, and must not share none's rows.
	keys := map[string]string{}
	for _, j := range jobs {
		if p, ok := keys[j.key]; ok && p != j.p.Name {
			t.Errorf("%s and %s share the configuration %s", p, j.p.Name, j.key)
		}
		keys[j.key] = j.p.Name
	}
	seeds := map[uint64]int{}
	for _, j := range jobs {
		seeds[j.seed]++
		if j.sc.Name == ScenarioSpike && j.p.Name == PolicyThresholdsBest {
			t.Errorf("thresholds-best runs on spike: %s", j.label)
		}
		want := time.Duration(0)
		if j.p.Name == PolicyQueue {
			want = QueueMaxWait
			if j.sc.Name == ScenarioSpike {
				want = SpikeQueueMaxWait
			}
		}
		if j.router.QueueMaxWait != want {
			t.Errorf("%s: routers wait %v, want %v", j.label, j.router.QueueMaxWait, want)
		}
	}
	// Per seed: 4 × (none, thresholds, queue ×2, slo ×2, committed) + 3 ×
	// the sweep's 3 + scaleout's none, thresholds and resched.
	if seeds[5] != 40 || seeds[6] != 40 || len(seeds) != 2 {
		t.Errorf("jobs per seed %v, want 40 for seeds 5 and 6", seeds)
	}
}

// TestLoadConfig: a row's load generator offers the scenario's shape with
// its clients' retries, Poisson arrivals from the row's seed, streamed,
// with the profile's SLO, each request with max_tokens the top of its
// range and its drawn length in sim_output_tokens (contract §21).
func TestLoadConfig(t *testing.T) {
	t.Parallel()
	g := &goodput{slo: loadgen.SLO{TTFT: time.Second, ITL: 50 * time.Millisecond}}
	for _, retries := range []int{0, 2} {
		lc := g.loadConfig("http://127.0.0.1:1", 9, loadShape{rate: func(time.Duration) float64 { return 3 },
			workload: func(time.Duration) loadgen.Workload { return loadgen.WorkloadDocuments }, length: 7 * time.Second, retries: retries})
		if err := lc.Validate(); err != nil {
			t.Fatal(err)
		}
		if lc.Retries != retries || lc.Seed != 9 || lc.Arrivals != loadgen.ArrivalsPoisson || !lc.Stream || lc.Duration != 7*time.Second ||
			lc.RateAt(time.Second) != 3 || lc.WorkloadAt(0) != loadgen.WorkloadDocuments || lc.SLO != g.slo || lc.CancelFraction != 0 ||
			!lc.SimOutputTokens {
			t.Errorf("retries %d: config %+v", retries, lc)
		}
	}
}

// TestPolicies: the fixed and swept values of contract §16, 1 router each;
// queue and slo with 1 and 3 routers, measured (none pending), queue with
// the thresholds values and a wait within the TTFT target, slo with the
// profile's targets; --quick runs thresholds-best on ramp and shift only.
func TestPolicies(t *testing.T) {
	t.Parallel()
	full, quick := Policies(false), Policies(true)
	names := []string{PolicyNone, PolicyThresholds, PolicyThresholdsBest, PolicyQueue, PolicySLO, PolicyCommitted, PolicyResched}
	if len(full) != len(names) {
		t.Fatalf("%d policies, want %d", len(full), len(names))
	}
	for i, p := range full {
		if p.Name != names[i] {
			t.Fatalf("policy %d is %s, want %s", i, p.Name, names[i])
		}
		if p.Pending != "" {
			t.Errorf("%s is pending: %s", p.Name, p.Pending)
		}
	}
	if th := full[1].Monitor.Thresholds; th.ActiveDecodeBlocks == nil || *th.ActiveDecodeBlocks != 0.85 || th.ActivePrefillTokens != nil {
		t.Errorf("thresholds: %+v, want decode 0.85, prefill unset", th)
	}
	if th := full[0].Monitor.Thresholds; th.ActiveDecodeBlocks != nil || th.ActivePrefillTokens != nil || th.ActivePrefillTokensFrac != nil {
		t.Errorf("none has thresholds %+v", th)
	}
	if s, on := full[2].Sweep, full[2].OnlyOn; len(s) != 3 || s[0] != 0.6 || s[1] != 0.75 || s[2] != 0.9 ||
		!slices.Equal(on, []string{ScenarioRamp, ScenarioBurst, ScenarioShift}) {
		t.Errorf("thresholds-best: sweep %v on %v; want 0.6, 0.75, 0.9 on every scenario but spike", s, on)
	}
	if on := quick[2].OnlyOn; len(on) != 2 || on[0] != ScenarioRamp || on[1] != ScenarioShift {
		t.Errorf("--quick thresholds-best on %v, want ramp and shift", on)
	}
	for _, p := range full[3:5] {
		if len(p.Routers) != 2 || p.Routers[0] != 1 || p.Routers[1] != 3 || p.Sweep != nil || p.OnlyOn != nil {
			t.Errorf("%s: routers %v, sweep %v, only on %v; want 1 and 3 routers on every scenario", p.Name, p.Routers, p.Sweep, p.OnlyOn)
		}
	}
	prof, err := stepengine.LookupProfile(GoodputProfile)
	if err != nil {
		t.Fatal(err)
	}
	queue, sloP := full[3], full[4]
	if th := queue.Monitor.Thresholds; th.ActiveDecodeBlocks == nil || *th.ActiveDecodeBlocks != ThresholdsDecode || th.ActivePrefillTokens != nil || queue.Monitor.SLO != nil {
		t.Errorf("queue's monitor %+v: want the thresholds values, no SLO", queue.Monitor)
	}
	// A request is good only with its first token within the TTFT target of
	// its send, queue wait included: a longer wait only keeps capacity busy.
	if w := queue.Router.QueueMaxWait; w <= 0 || w >= prof.SLO.TTFT {
		t.Errorf("queue's --queue-max-wait %v: want positive and under the TTFT target %v", w, prof.SLO.TTFT)
	}
	for _, p := range full[:3] {
		if p.Router.QueueMaxWait != 0 || p.Monitor.SLO != nil {
			t.Errorf("%s has a queue (%v) or an SLO (%+v)", p.Name, p.Router.QueueMaxWait, p.Monitor.SLO)
		}
	}
	if s := sloP.Monitor.SLO; s == nil || s.TTFT != prof.SLO.TTFT || s.ITL != prof.SLO.ITL || s.Percentile <= 0 || s.Percentile >= 1 {
		t.Errorf("slo's SLO %+v: want the profile's targets %+v and a percentile in (0, 1)", s, prof.SLO)
	}
	if sloP.Monitor.SLOInterval <= 0 || sloP.Router.QueueMaxWait != 0 {
		t.Errorf("slo: interval %v, queue %v", sloP.Monitor.SLOInterval, sloP.Router.QueueMaxWait)
	}
	// Contract §21: committed runs kv_committed_threshold 1.0 and
	// queue_delay_threshold_ms half the TTFT target, no KV or prefill
	// check, 1 router, no queue or SLO.
	c := full[5]
	th := c.Monitor.Thresholds
	if th.KVCommitted == nil || *th.KVCommitted != 1 || th.QueueDelayMs == nil || *th.QueueDelayMs != uint64(prof.SLO.TTFT.Milliseconds()/2) ||
		th.ActiveDecodeBlocks != nil || th.ActivePrefillTokens != nil || th.ActivePrefillTokensFrac != nil {
		t.Errorf("committed's thresholds %s; want kv committed 1, queue delay %d ms, nothing else", thresholdsText(th), prof.SLO.TTFT.Milliseconds()/2)
	}
	if !slices.Equal(c.Routers, []int{1}) || c.Monitor.SLO != nil || c.Router.QueueMaxWait != 0 || c.OnlyOn != nil || c.Sweep != nil {
		t.Errorf("committed: %+v; want 1 router on every scenario, no queue, no SLO", c)
	}
	if got := PolicySettings(c); got != "serve --kv-committed-threshold 1 --queue-delay-threshold-ms 500 (no KV or prefill check)" {
		t.Errorf("committed's settings %q", got)
	}
}

// TestCeiling: a scenario's ceiling is the mean of min(offered, the
// capacity for the workload offered), so the sum over its phases; the
// documents capacity's first guess scales the chat capacity by the mean
// tokens of a request.
func TestCeiling(t *testing.T) {
	t.Parallel()
	const length = 30 * time.Second
	caps := capacities{chat: 10, docs: 1}
	by := map[string]Scenario{}
	for _, sc := range Scenarios() {
		by[sc.Name] = sc
	}
	for _, c := range []struct {
		name string
		want float64
	}{
		// 50 % → 250 % → 50 %: under the capacity for the first and last
		// eighth (mean 75 %), at it the rest.
		{ScenarioRamp, 10 * (0.25*0.75 + 0.75)},
		// 70 % for 8 s of 10, capped at 100 % for the 2 s of 700 %.
		{ScenarioBurst, 0.8*7 + 0.2*10},
		// 70 % of chat for the first half, the documents capacity (1 < 7)
		// for the second.
		{ScenarioShift, (7 + 1) / 2.0},
		// 40 % for 9 s of 10, capped at 100 % for the 1 s of 200 %.
		{ScenarioSpike, 0.9*4 + 0.1*10},
	} {
		if got := caps.ceiling(by[c.name], length, 0, length); math.Abs(got-c.want) > 0.01 {
			t.Errorf("%s: ceiling %v, want %v", c.name, got, c.want)
		}
	}
	if got := caps.ceiling(by[ScenarioSpike], length, 5*time.Second, 6*time.Second); math.Abs(got-10) > 1e-9 {
		t.Errorf("spike's ceiling over its spike second: %v, want the capacity 10", got)
	}
	if got := caps.ceiling(by[ScenarioShift], length, 20*time.Second, 21*time.Second); math.Abs(got-1) > 1e-9 {
		t.Errorf("shift's ceiling in its documents half: %v, want 1", got)
	}
	if !needsDocuments([]Scenario{by[ScenarioRamp], by[ScenarioShift]}, length) ||
		needsDocuments([]Scenario{by[ScenarioRamp], by[ScenarioBurst], by[ScenarioSpike]}, length) {
		t.Error("needsDocuments: want true exactly with shift")
	}
	// chat: 320 + 160 tokens on average; documents: 4096 + 160.
	if got, want := DocumentsGuess(12.5), 12.5*480/4256; math.Abs(got-want) > 1e-9 {
		t.Errorf("DocumentsGuess(12.5) = %v, want %v", got, want)
	}
}

// TestSelect: --policies and --scenarios keep the order of the results and
// refuse an unknown name.
func TestSelect(t *testing.T) {
	t.Parallel()
	ps, err := SelectPolicies(true, []string{PolicySLO, PolicyThresholdsBest})
	if err != nil || len(ps) != 2 || ps[0].Name != PolicyThresholdsBest || ps[1].Name != PolicySLO {
		t.Errorf("select slo, thresholds-best: %v %v", ps, err)
	}
	if all, err := SelectPolicies(false, nil); err != nil || len(all) != 7 {
		t.Errorf("select nothing: %d policies, %v; want all 7", len(all), err)
	}
	if _, err := SelectPolicies(false, []string{"queue", "fifo"}); err == nil || !strings.Contains(err.Error(), `"fifo"`) {
		t.Errorf("an unknown policy: %v", err)
	}
	scs, err := SelectScenarios([]string{ScenarioShift, ScenarioRamp})
	if err != nil || len(scs) != 2 || scs[0].Name != ScenarioRamp || scs[1].Name != ScenarioShift {
		t.Errorf("select shift, ramp: %v", err)
	}
	if _, err := SelectScenarios([]string{"storm"}); err == nil {
		t.Error("an unknown scenario was accepted")
	}
}

// TestSummarize computes a row from samples: goodput of the window over
// its length, rejections of the offered, percentiles of the successful,
// queue wait null without a queued answer.
func TestSummarize(t *testing.T) {
	t.Parallel()
	ok := func(at, ttft time.Duration, good bool) loadgen.Sample {
		return loadgen.Sample{Offered: at, OK: true, Good: good,
			Result: loadgen.Result{Status: 200, Stream: true, Complete: true, Finished: true, Tokens: 11, TTFT: ttft, E2E: ttft + 10*20*time.Millisecond}}
	}
	samples := []loadgen.Sample{
		ok(0, 100*time.Millisecond, true), ok(time.Second, 200*time.Millisecond, true), ok(1500*time.Millisecond, 3*time.Second, false),
		{Offered: 1600 * time.Millisecond, Result: loadgen.Result{Status: 503}, Failed: true},
		{Offered: 1700 * time.Millisecond, Dropped: true},
		ok(5*time.Second, time.Millisecond, true), // outside the window
	}
	row := summarize(samples, 0, 2*time.Second, 2)
	if row.GoodputRPS != 1 || row.GoodputPct != 50 || row.RejectedPct != 25 {
		t.Errorf("goodput %v/s (%v %%), rejected %v %%; want 1/s, 50 %%, 25 %% (1 of the 4 sent)", row.GoodputRPS, row.GoodputPct, row.RejectedPct)
	}
	if row.TTFTp50 == nil || *row.TTFTp50 != 200 || *row.TTFTp99 != 3000 || *row.ITLp99 != 20 || row.QueueWaitP99 != nil {
		t.Errorf("ttft %v/%v itl %v queue %v", row.TTFTp50, row.TTFTp99, row.ITLp99, row.QueueWaitP99)
	}
	data, err := json.Marshal(row)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), `"queue_wait_p99_ms":null`) || strings.Contains(string(data), "Series") {
		t.Errorf("row JSON %s", data)
	}
	pts := series(samples, 2*time.Second, func(time.Duration) float64 { return 4 })
	if len(pts) != 2 || pts[0].Offered != 1 || pts[1].Offered != 4 || pts[1].Good != 1 || pts[1].Rejected != 1 || pts[1].TTFTp99 != 3000 || pts[0].TargetRPS != 4 {
		t.Errorf("series %+v", pts)
	}
	if row.FailedPct != 40 || row.AttemptsPerRequest != 1 {
		t.Errorf("failed %v %%, %v attempts a request; want 40 %% (the 503 and the dropped one), 1", row.FailedPct, row.AttemptsPerRequest)
	}
}

// TestSummarizeRetries: with clients that retry, rejected is the share of
// attempts answered 503 or 429, failed the share of requests whose last
// attempt got no 200, attempts a request over the requests sent; the
// series counts attempts, and rejections, in the second they were sent.
func TestSummarizeRetries(t *testing.T) {
	t.Parallel()
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	served := loadgen.Result{Status: 200, Stream: true, Complete: true, Finished: true, Tokens: 2, TTFT: ms(900), E2E: ms(950)}
	samples := []loadgen.Sample{
		// Rejected, retried 700 ms later, served: good.
		{Offered: ms(500), OK: true, Good: true, Result: served, Attempts: 2, Tries: []loadgen.Try{{At: 0, Status: 503}, {At: ms(700), Status: 200}}},
		// Rejected three times: failed.
		{Offered: ms(800), Result: loadgen.Result{Status: 429}, Attempts: 3, Failed: true,
			Tries: []loadgen.Try{{At: 0, Status: 503}, {At: ms(100), Status: 429}, {At: ms(1300), Status: 429}}},
		// Served at once.
		{Offered: ms(1200), OK: true, Good: true, Result: served, Attempts: 1, Tries: []loadgen.Try{{At: 0, Status: 200}}},
		// Dropped at the client's cap: failed, never sent.
		{Offered: ms(1900), Dropped: true},
	}
	row := summarize(samples, 0, 2*time.Second, 1)
	if row.GoodputRPS != 1 || math.Abs(row.RejectedPct-400.0/6) > 1e-9 || row.FailedPct != 50 || row.AttemptsPerRequest != 2 {
		t.Errorf("goodput %v/s, rejected %v %%, failed %v %%, %v attempts a request; want 1/s, 66.7 %% (4 of 6 attempts), 50 %%, 2",
			row.GoodputRPS, row.RejectedPct, row.FailedPct, row.AttemptsPerRequest)
	}
	pts := series(samples, 3*time.Second, func(time.Duration) float64 { return 2 })
	// Sent at 0.5 (503), 0.8 (503), 0.9 s (429); 1.2, 1.2 s (200s); 2.1 s (429).
	for i, want := range []struct{ offered, attempts, rejected int }{{2, 3, 3}, {2, 2, 0}, {0, 1, 1}} {
		if p := pts[i]; p.Offered != want.offered || p.Attempts != want.attempts || p.Rejected != want.rejected {
			t.Errorf("second %d: offered %d, attempts %d, rejected %d; want %d, %d, %d", i, p.Offered, p.Attempts, p.Rejected,
				want.offered, want.attempts, want.rejected)
		}
	}
}

// TestMedian takes each figure's median over the seeds.
func TestMedian(t *testing.T) {
	t.Parallel()
	f := func(v float64) *float64 { return &v }
	rows := []GoodputRow{
		{Policy: "none", GoodputRPS: 1, TTFTp99: f(30), Preemptions: 9},
		{Policy: "none", GoodputRPS: 3, TTFTp99: f(10), Preemptions: 1},
		{Policy: "none", GoodputRPS: 2, TTFTp99: nil, Preemptions: 5},
	}
	m := median(rows)
	if m.GoodputRPS != 2 || m.Preemptions != 5 || m.TTFTp99 == nil || *m.TTFTp99 != 20 || m.Policy != "none" {
		t.Errorf("median %+v (ttft p99 %v)", m, m.TTFTp99)
	}
}

// TestReportHTML: one section per scenario with three charts, a line per
// policy and the offered load, no script and no outside asset.
func TestReportHTML(t *testing.T) {
	t.Parallel()
	r := GoodputResult{CapacityRPS: 5, SLO: SLOms{TTFT: 1000, ITL: 50}, Pending: []Policy{{Name: "queue", Pending: "not built"}}}
	for _, sc := range []string{"ramp", "shift"} {
		for _, p := range []string{"none", "thresholds"} {
			r.Results = append(r.Results, GoodputRow{Scenario: sc, Policy: p, Routers: 1,
				Series: []Point{{T: 0, TargetRPS: 2, Good: 2, TTFTp99: 50}, {T: time.Second, TargetRPS: 4, Good: 3, Rejected: 1, TTFTp99: math.NaN()}}})
		}
	}
	page := ReportHTML(r)
	if n := strings.Count(page, `<section class="scenario"`); n != 2 {
		t.Errorf("%d scenario sections, want 2", n)
	}
	if n := strings.Count(page, `class="chart"`); n != 6 {
		t.Errorf("%d charts, want 6", n)
	}
	// Per scenario: offered + 2 goodput lines, 2 TTFT lines, 2 rejection lines.
	if n := strings.Count(page, `class="series `); n != 14 {
		t.Errorf("%d lines, want 14", n)
	}
	for _, bad := range []string{"<script", "<link", "src=", "http://", "https://"} {
		if strings.Contains(strings.ReplaceAll(page, `xmlns="http://www.w3.org/2000/svg"`, ""), bad) {
			t.Errorf("the page has %q: not self-contained", bad)
		}
	}
	if !strings.Contains(page, "Not measured yet: <code>queue</code>") {
		t.Error("the page does not say queue is not measured yet")
	}
	r.Pending, r.Policies = nil, Policies(false)
	page = ReportHTML(r)
	if !strings.Contains(page, "<code>queue</code>: router --queue-max-wait 800ms") || !strings.Contains(page, "<code>slo</code>: SLO TTFT ≤ 1000 ms, ITL ≤ 50 ms") {
		t.Error("the page does not give the queue and slo policies' settings")
	}
	if !strings.Contains(page, "<th>host CPU</th>") || strings.Contains(page, "<th>CPU</th>") {
		t.Error("the page's tables do not label the CPU column host CPU")
	}
}

// pathRe matches a line of a chart: its class, name, points and style.
var pathRe = regexp.MustCompile(`<path class="series ([a-z]+)" data-series="([^"]*)" d="([^"]*)" fill="none" stroke="([^"]*)" stroke-width="[^"]*"(?: stroke-dasharray="([^"]*)")?/>`)

// svgPaths returns the lines of the first chart of page whose caption
// starts with caption, by name: their points' y coordinates, their M
// commands, their stroke and dash.
type svgPath struct {
	class, color, dash string
	ys                 []float64
	moves              int
}

func chartPaths(t *testing.T, page, caption string) map[string]svgPath {
	t.Helper()
	out := map[string]svgPath{}
	svg := chartSVG(t, page, caption)
	for _, m := range pathRe.FindAllStringSubmatch(svg, -1) {
		p := svgPath{class: m[1], color: m[4], dash: m[5], moves: strings.Count(m[3], "M")}
		for _, pt := range regexp.MustCompile(`[ML]([0-9.]+) ([0-9.]+)`).FindAllStringSubmatch(m[3], -1) {
			y, _ := strconv.ParseFloat(pt[2], 64)
			p.ys = append(p.ys, y)
		}
		out[m[2]] = p
	}
	return out
}

// chartSVG returns the first chart of page whose caption starts with
// caption.
func chartSVG(t *testing.T, page, caption string) string {
	t.Helper()
	i := strings.Index(page, `aria-label="`+caption)
	if i < 0 {
		t.Fatalf("no chart %q", caption)
	}
	return page[i : i+strings.Index(page[i:], "</svg>")]
}

// TestReportLines (issue 35): the offered line is the measured arrivals,
// not the scenario's target, so goodput is never drawn above it; every
// policy of 8 has a colour and a dash of its own, the same in every
// scenario; a TTFT line runs on through a second without a successful
// request, carrying the last value and marking it; each scenario names its
// winner.
func TestReportLines(t *testing.T) {
	t.Parallel()
	names := []struct {
		policy  string
		routers int
	}{{"none", 1}, {"thresholds", 1}, {"thresholds-best", 1}, {"queue", 1}, {"queue", 3}, {"slo", 1}, {"slo", 3}, {"committed", 1}}
	var r GoodputResult
	for _, sc := range []string{"ramp", "spike"} {
		for i, n := range names {
			row := GoodputRow{Scenario: sc, Policy: n.policy, Routers: n.routers, Decode: 0.9, GoodputRPS: float64(10 + i), Preemptions: uint64(20 - i)}
			for s := range 6 {
				// The target is far above what arrived: the old report drew
				// it, and the goodput of the first seconds above the line.
				p := Point{T: time.Duration(s) * time.Second, TargetRPS: 40, Offered: 2 + s, Good: 2 + s - i%2, TTFTp99: float64(100 + 10*i)}
				if s == 2 || s == 3 {
					p.TTFTp99 = math.NaN() // no successful request
				}
				row.Series = append(row.Series, p)
			}
			r.Results = append(r.Results, row)
		}
	}
	for i := range r.Results {
		r.Results[i].CeilingRPS = 5
		for j := range r.Results[i].Series {
			r.Results[i].Series[j].CeilingRPS = 5
		}
	}
	page := ReportHTML(r)
	lines := chartPaths(t, page, "requests/s")
	if c, ok := lines["ceiling"]; !ok || c.class != "ceiling" || c.dash == "" || len(c.ys) != 6 || c.ys[0] != c.ys[5] {
		t.Errorf("the ceiling line: %+v; want a dotted level line over the 6 seconds", c)
	}
	offered, ok := lines["offered (measured arrivals)"]
	if !ok || offered.class != "offered" {
		t.Fatalf("no offered line in %v", lines)
	}
	// y grows downwards: the offered line is at or above (smaller y) every
	// goodput line at each second, and it tops the chart (y of 10 s at the
	// 1..10 scale), not the target of 40.
	for name, l := range lines {
		if l.class != "policy" {
			continue
		}
		for i, y := range l.ys {
			if y < offered.ys[i]-0.05 {
				t.Errorf("%s: goodput drawn above the offered line at second %d (y %v < %v)", name, i, y, offered.ys[i])
			}
		}
	}
	if svg := chartSVG(t, page, "requests/s"); !strings.Contains(svg, ">10</text>") || strings.Contains(svg, ">40</text>") || strings.Contains(svg, ">50</text>") {
		t.Error("the requests/s axis is scaled to the target, not to the measured arrivals")
	}
	// Distinct colour and dash per policy, the same in both scenarios.
	colors, dashes := map[string]string{}, map[string]string{}
	for _, caption := range []string{"requests/s", "TTFT p99", "rejections/s"} {
		for name, l := range chartPaths(t, page, caption) {
			if l.class != "policy" {
				continue
			}
			if c, ok := colors[name]; ok && (c != l.color || dashes[name] != l.dash) {
				t.Errorf("%s: style %s %q in one chart, %s %q in another", name, c, dashes[name], l.color, l.dash)
			}
			colors[name], dashes[name] = l.color, l.dash
		}
	}
	if len(colors) != len(names) {
		t.Fatalf("%d policies styled, want %d: %v", len(colors), len(names), colors)
	}
	seenC, seenD := map[string]string{}, map[string]string{}
	for name := range colors {
		if o, dup := seenC[colors[name]]; dup {
			t.Errorf("%s and %s share the colour %s", name, o, colors[name])
		}
		if o, dup := seenD[dashes[name]]; dup {
			t.Errorf("%s and %s share the dash %q", name, o, dashes[name])
		}
		seenC[colors[name]], seenD[dashes[name]] = name, name
	}
	// TTFT: one unbroken line per policy over 6 seconds, two carried
	// seconds marked, at the value before them.
	for name, l := range chartPaths(t, page, "TTFT p99") {
		if l.moves != 1 || len(l.ys) != 6 || l.ys[2] != l.ys[1] || l.ys[3] != l.ys[1] {
			t.Errorf("TTFT of %s: %d pieces, points %v; want one line of 6, seconds 2 and 3 at second 1's value", name, l.moves, l.ys)
		}
	}
	if n := strings.Count(page, `<circle class="carried"`); n != 2*2*len(names) {
		t.Errorf("%d carried markers, want %d (2 seconds × %d policies × 2 scenarios)", n, 4*len(names), len(names))
	}
	// The winner: committed, with the most goodput.
	if n := strings.Count(page, `<p class="verdict">Winner: committed, with 17.00 good requests/s`); n != 2 {
		t.Errorf("%d winner sentences naming committed, want 2", n)
	}
}

// TestVerdict names the winner by goodput, its margin, and why from the
// figures; a margin under CloseMargin is called a tie.
func TestVerdict(t *testing.T) {
	t.Parallel()
	f := func(v float64) *float64 { return &v }
	rows := []GoodputRow{
		{Policy: "none", Routers: 1, GoodputRPS: 5.33, GoodputPct: 43, Preemptions: 99, TTFTp99: f(8648)},
		{Policy: "thresholds-best", Routers: 1, Decode: 0.9, GoodputRPS: 11.0, GoodputPct: 88, Preemptions: 14, TTFTp99: f(605), RejectedPct: 35, FailedPct: 35},
		{Policy: "queue", Routers: 3, GoodputRPS: 12.17, GoodputPct: 97, Preemptions: 7, TTFTp99: f(937), RejectedPct: 30, FailedPct: 20},
	}
	got := Verdict(rows)
	for _, want := range []string{
		"Winner: queue, 3 routers, with 12.17 good requests/s (97 % of capacity), 1.17/s ahead of thresholds-best (0.9) (11.00/s).",
		"fewer preemptions (7 against 14)", "fewer failed requests (20.0 % against 35.0 %)", "fewer rejected attempts (30.0 % against 35.0 %)",
		"Last: none, 5.33/s, with 99 preemptions and a TTFT p99 of 8648 ms",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("verdict %q\nlacks %q", got, want)
		}
	}
	if strings.Contains(got, "TTFT p99 (937") || strings.Contains(got, "tie") {
		t.Errorf("verdict %q: names a figure the winner lost on, or a tie", got)
	}
	rows[1].GoodputRPS = 12.0
	if got := Verdict(rows); !strings.Contains(got, "within what one seed moves") {
		t.Errorf("a 1.4 %% margin: %q; want it called a tie", got)
	}
	// The runner-up is the best row of another policy, not the winner's
	// own with another router count.
	rows = append(rows, GoodputRow{Policy: "queue", Routers: 1, GoodputRPS: 12.1})
	if got := Verdict(rows); !strings.Contains(got, "ahead of thresholds-best (0.9) (12.00/s)") {
		t.Errorf("verdict %q: want thresholds-best as the runner-up", got)
	}
	// Every row alike: no winner.
	same := []GoodputRow{{Policy: "none", GoodputRPS: 8, GoodputPct: 56}, {Policy: "queue", GoodputRPS: 8, GoodputPct: 56}}
	if got := Verdict(same); got != "No winner: all 2 rows reached 8.00 good requests/s (56 % of capacity): this load never made admission matter." {
		t.Errorf("verdict of a tie %q", got)
	}
}

// TestBisect: the capacity found is within CapacityTolerance below the
// true one, and never above it (the loop stopped at a bracket of 10 % and
// took its low end: up to 9 % low), from a first guess on either side.
func TestBisect(t *testing.T) {
	t.Parallel()
	for _, truth := range []float64{0.7, 3, 9.99, 10, 10.01, 12.5, 31, 200} {
		for _, guess := range []float64{1, 10, 100} {
			trials := 0
			got, err := bisect(func(rate float64) (bool, error) { trials++; return rate <= truth, nil }, guess)
			if err != nil {
				t.Fatalf("truth %v, guess %v: %v", truth, guess, err)
			}
			if got > truth || got < truth/(1+CapacityTolerance) {
				t.Errorf("truth %v, guess %v: found %v after %d trials, want within %v %% below", truth, guess, got, trials, 100*CapacityTolerance)
			}
		}
	}
	if _, err := bisect(func(float64) (bool, error) { return false, nil }, 10); err == nil {
		t.Error("no rate holds: want an error")
	}
}

// TestSpread: with shares 60/30/10 each of 3 routers gets exactly its
// share of the attempts (smooth weighted round-robin), without shares
// they take turns; each router's figures are of what it answered: the p90
// of the waits it reported, the share of its attempts it rejected.
func TestSpread(t *testing.T) {
	t.Parallel()
	var urls []string
	counts := make([]atomic.Int64, 3)
	for i := range 3 {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := counts[i].Add(1)
			switch i {
			case 0: // every other attempt waited 100 ms × its number and expired
				if n%2 == 0 {
					w.Header().Set("X-Workermon-Queued", strconv.FormatInt(100*n, 10))
					w.WriteHeader(http.StatusTooManyRequests)
				}
			case 1: // each waited 5 ms and was served
				w.Header().Set("X-Workermon-Queued", "5")
			case 2: // all rejected at once
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL)
	}
	send := func(s *spread, n int) {
		t.Helper()
		c := &http.Client{Transport: s}
		for range n {
			resp, err := c.Get(urls[0] + "/v1/completions")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
	}
	s := newSpread(urls, []float64{60, 30, 10})
	defer s.CloseIdleConnections()
	send(s, 100)
	if a, b, c := counts[0].Load(), counts[1].Load(), counts[2].Load(); a != 60 || b != 30 || c != 10 {
		t.Fatalf("attempts per router %d, %d, %d; want 60, 30, 10", a, b, c)
	}
	got := s.byRouter()
	// Router 0: 30 waits of 200 … 6000 ms, p90 the 27th: 5400 ms.
	if len(got) != 3 || got[0].Share != 0.6 || got[0].QueueWaitP90 == nil || *got[0].QueueWaitP90 != 5400 || got[0].RejectedPct != 50 ||
		got[1].Share != 0.3 || got[1].QueueWaitP90 == nil || *got[1].QueueWaitP90 != 5 || got[1].RejectedPct != 0 ||
		math.Abs(got[2].Share-0.1) > 1e-9 || got[2].QueueWaitP90 != nil || got[2].RejectedPct != 100 {
		t.Errorf("by router %+v", got)
	}
	for i := range counts {
		counts[i].Store(0)
	}
	even := newSpread(urls, nil)
	defer even.CloseIdleConnections()
	send(even, 9)
	if a, b, c := counts[0].Load(), counts[1].Load(), counts[2].Load(); a != 3 || b != 3 || c != 3 {
		t.Errorf("even: attempts per router %d, %d, %d; want 3 each", a, b, c)
	}
	if !UnevenShares([]float64{60, 30, 10}) || UnevenShares([]float64{1, 1, 1}) || UnevenShares(nil) {
		t.Error("UnevenShares")
	}
}

// TestMedianByRouter takes each router's figures' medians over the seeds;
// the table and the report print them.
func TestMedianByRouter(t *testing.T) {
	t.Parallel()
	f := func(v float64) *float64 { return &v }
	row := func(w0, r0 float64) GoodputRow {
		return GoodputRow{Scenario: "burst", Policy: "queue", Routers: 3, ByRouter: []RouterRow{
			{Share: 0.6, QueueWaitP90: f(w0), RejectedPct: r0}, {Share: 0.3, RejectedPct: 1}, {Share: 0.1, QueueWaitP90: f(7), RejectedPct: 2}}}
	}
	m := rounded(median([]GoodputRow{row(800, 50), row(100, 70), row(500, 10)}))
	if len(m.ByRouter) != 3 || *m.ByRouter[0].QueueWaitP90 != 500 || m.ByRouter[0].RejectedPct != 50 || m.ByRouter[1].QueueWaitP90 != nil ||
		m.ByRouter[2].RejectedPct != 2 || m.ByRouter[0].Share != 0.6 {
		t.Errorf("median by router %+v", m.ByRouter)
	}
	lines := ByRouterLines([]GoodputRow{m, {Scenario: "burst", Policy: "none", Routers: 1}})
	if len(lines) != 1 || lines[0] != "burst queue, 3 routers: 60 %: 500 ms, 50.0 %; 30 %: -, 1.0 %; 10 %: 7 ms, 2.0 %" {
		t.Errorf("lines %q", lines)
	}
	page := ReportHTML(GoodputResult{RouterShares: []float64{60, 30, 10}, Results: []GoodputRow{m}})
	if !strings.Contains(page, "load split 60/30/10") || !strings.Contains(page, "<li>burst queue, 3 routers: 60 %: 500 ms, 50.0 %;") {
		t.Error("the report lacks the figures by router")
	}
	data, _ := json.Marshal(m)
	if !strings.Contains(string(data), `"by_router":[{"share":0.6,"queue_wait_p90_ms":500,"rejected_pct":50},{"share":0.3,"queue_wait_p90_ms":null,"rejected_pct":1}`) {
		t.Errorf("JSON %s", data)
	}
	if data, _ := json.Marshal(GoodputRow{}); strings.Contains(string(data), "by_router") {
		t.Errorf("a row without figures by router has by_router: %s", data)
	}
}
