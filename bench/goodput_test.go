package bench

import (
	"encoding/json"
	"math"
	"strings"
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
	ramp, burst, shift := by[ScenarioRamp], by[ScenarioBurst], by[ScenarioShift]
	for _, c := range []struct {
		sc   Scenario
		at   time.Duration
		want float64
	}{
		{ramp, 0, 0.5}, {ramp, length / 4, 1.5}, {ramp, length / 2, 2.5}, {ramp, 3 * length / 4, 1.5}, {ramp, length, 0.5},
		{burst, 0, 0.7}, {burst, 5 * time.Second, 7}, {burst, 6900 * time.Millisecond, 7}, {burst, 7 * time.Second, 0.7},
		{burst, 15 * time.Second, 7}, {burst, 25 * time.Second, 7}, {burst, 29 * time.Second, 0.7},
		{shift, 0, 0.7}, {shift, 29 * time.Second, 0.7},
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
}

// TestPolicies: the fixed and swept values of contract §16, 1 router each;
// queue and slo with 1 and 3 routers, measured (none pending), queue with
// the thresholds values and a wait within the TTFT target, slo with the
// profile's targets; --quick runs thresholds-best on ramp and shift only.
func TestPolicies(t *testing.T) {
	t.Parallel()
	full, quick := Policies(false), Policies(true)
	names := []string{PolicyNone, PolicyThresholds, PolicyThresholdsBest, PolicyQueue, PolicySLO, PolicyResched}
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
	if s := full[2].Sweep; len(s) != 3 || s[0] != 0.6 || s[1] != 0.75 || s[2] != 0.9 || full[2].OnlyOn != nil {
		t.Errorf("thresholds-best: sweep %v on %v", s, full[2].OnlyOn)
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
}

// TestSelect: --policies and --scenarios keep the order of the results and
// refuse an unknown name.
func TestSelect(t *testing.T) {
	t.Parallel()
	ps, err := SelectPolicies(true, []string{PolicySLO, PolicyThresholdsBest})
	if err != nil || len(ps) != 2 || ps[0].Name != PolicyThresholdsBest || ps[1].Name != PolicySLO {
		t.Errorf("select slo, thresholds-best: %v %v", ps, err)
	}
	if all, err := SelectPolicies(false, nil); err != nil || len(all) != 6 {
		t.Errorf("select nothing: %d policies, %v; want all 6", len(all), err)
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
		{Offered: 1600 * time.Millisecond, Result: loadgen.Result{Status: 503}},
		{Offered: 1700 * time.Millisecond, Dropped: true},
		ok(5*time.Second, time.Millisecond, true), // outside the window
	}
	row := summarize(samples, 0, 2*time.Second, 2)
	if row.GoodputRPS != 1 || row.GoodputPct != 50 || row.RejectedPct != 20 {
		t.Errorf("goodput %v/s (%v %%), rejected %v %%; want 1/s, 50 %%, 20 %%", row.GoodputRPS, row.GoodputPct, row.RejectedPct)
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
	if n := strings.Count(page, "<svg"); n != 6 {
		t.Errorf("%d charts, want 6", n)
	}
	// Per scenario: offered + 2 goodput lines, 2 TTFT lines, 2 rejection lines.
	if n := strings.Count(page, `class="series"`); n != 14 {
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
