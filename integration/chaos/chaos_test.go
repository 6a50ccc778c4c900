package main

import (
	"math"
	"net/http/httptest"
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/sim/stepengine"
)

var topo = chaosConfig("242").topology()

func TestScheduleReplaysFromTheSeed(t *testing.T) {
	for _, d := range []time.Duration{3 * time.Minute, 10 * time.Minute} {
		a, b := Schedule(42, d, topo), Schedule(42, d, topo)
		if !reflect.DeepEqual(a, b) {
			t.Errorf("%v: the same seed gave two schedules:\n%s\n%s", d, scheduleString(a), scheduleString(b))
		}
		if c := Schedule(43, d, topo); reflect.DeepEqual(a, c) {
			t.Errorf("%v: seeds 42 and 43 gave the same schedule", d)
		}
	}
}

func TestShortRunInjectsEachKindOnce(t *testing.T) {
	for seed := uint64(1); seed < 50; seed++ {
		fs := Schedule(seed, 3*time.Minute, topo)
		seen := map[Kind]int{}
		for _, f := range fs {
			seen[f.Kind]++
			if f.Gap < 10*time.Second || f.Gap > 20*time.Second {
				t.Fatalf("seed %d: gap %v outside 10-20 s", seed, f.Gap)
			}
			checkFault(t, f)
		}
		if len(fs) != len(Kinds) || len(seen) != len(Kinds) {
			t.Fatalf("seed %d: %d faults of %d kinds, want each of %d once:\n%s", seed, len(fs), len(seen), len(Kinds), scheduleString(fs))
		}
	}
}

func TestLongRunFaultsEvery15To45s(t *testing.T) {
	fs := Schedule(9, 10*time.Minute, topo)
	var total time.Duration
	seen := map[Kind]bool{}
	for _, f := range fs {
		if f.Gap < 15*time.Second || f.Gap > 45*time.Second {
			t.Fatalf("gap %v outside 15-45 s", f.Gap)
		}
		checkFault(t, f)
		total += f.Gap + f.Down
		seen[f.Kind] = true
	}
	if total > 10*time.Minute || len(fs) < 10 {
		t.Errorf("%d faults taking %v in a 10-minute run", len(fs), total)
	}
	if len(seen) != len(Kinds) {
		t.Errorf("kinds %v: not every kind in %d faults", seen, len(fs))
	}
}

func checkFault(t *testing.T, f Fault) {
	t.Helper()
	if !strings.HasPrefix(f.Target, map[Kind]string{KillMonitor: "monitor-", PauseMonitor: "monitor-", CutMonitor: "monitor-",
		RestartNATS: "nats-", KillRouter: "router-", KillEngine: "sim-"}[f.Kind]) {
		t.Fatalf("%s: wrong target", f)
	}
	switch f.Kind {
	case PauseMonitor:
		if f.Down < 5*time.Second || f.Down > 20*time.Second {
			t.Fatalf("%s: a pause of 5-20 s", f)
		}
	case CutMonitor:
		if f.Down != 10*time.Second {
			t.Fatalf("%s: a cut of 10 s", f)
		}
	default:
		if f.Down != 5*time.Second {
			t.Fatalf("%s: restarted 5 s later", f)
		}
	}
}

func rec(epoch, seq uint64, updated time.Time) events.BusySet {
	return events.BusySet{Model: "m", Epoch: epoch, Seq: seq, UpdatedAt: updated.UnixNano(), MonitorID: "mon"}
}

func TestRecordsEpochAndSeq(t *testing.T) {
	t0 := time.Unix(1000, 0)
	r := newRecords(10 * time.Second)
	r.Observe("m", 1, rec(1, 1, t0), t0)
	r.Observe("m", 2, rec(1, 2, t0.Add(time.Second)), t0)
	r.Observe("m", 2, rec(1, 2, t0.Add(time.Second)), t0) // the same revision read again: fine
	r.Observe("m", 3, rec(2, 1, t0.Add(2*time.Second)), t0)
	if v, _ := r.Close(t0.Add(3 * time.Second)); len(v) != 0 {
		t.Fatalf("violations on a good history: %v", v)
	}
	r.Observe("m", 4, rec(2, 1, t0.Add(3*time.Second)), t0) // seq not rising
	r.Observe("m", 5, rec(1, 9, t0.Add(4*time.Second)), t0) // epoch down
	v, _ := r.Close(t0.Add(5 * time.Second))
	if len(v) != 2 || !strings.Contains(v[0].What, "seq did not rise") || !strings.Contains(v[1].What, "epoch went down") {
		t.Fatalf("violations %v, want seq then epoch", v)
	}
}

func TestRecordsFailOpenWindows(t *testing.T) {
	t0 := time.Unix(1000, 0)
	r := newRecords(10 * time.Second)
	for i := range 5 {
		at := t0.Add(time.Duration(i) * 2 * time.Second)
		r.Observe("m", uint64(i+1), rec(1, uint64(i+1), at), at)
	}
	// a claim keeps updated_at: not fresh
	r.Observe("m", 6, rec(2, 1, t0.Add(8*time.Second)), t0.Add(12*time.Second))
	// the next write 12.5 s after the last put: a window of 2.5 s
	r.Observe("m", 7, rec(2, 2, t0.Add(20500*time.Millisecond)), t0.Add(21*time.Second))
	_, w := r.Close(t0.Add(22 * time.Second))
	if len(w) != 1 || w[0].Len != 2500*time.Millisecond || !w[0].Start.Equal(t0.Add(18*time.Second)) {
		t.Fatalf("windows %+v, want one of 2.5 s from 18 s", w)
	}
	// a record stale at the end is a window still open
	_, w = r.Close(t0.Add(32 * time.Second))
	if len(w) != 2 || w[1].Len != 1500*time.Millisecond {
		t.Fatalf("windows %+v, want an open one of 1.5 s at the end", w)
	}
}

func TestGrowth(t *testing.T) {
	t0 := time.Unix(1000, 0)
	g := newGrowth()
	sample := func(at time.Duration, heap, gor float64) {
		g.Sample("monitor-1#0", t0, t0.Add(at), map[string]float64{"go_memstats_heap_alloc_bytes": heap, "go_goroutines": gor})
	}
	sample(10*time.Second, 100e6, 500) // first minute: ignored
	sample(65*time.Second, 10e6, 40)
	sample(85*time.Second, 14e6, 42) // baseline 14 MB, 42
	sample(95*time.Second, 30e6, 43) // one sample above: a late collection
	sample(100*time.Second, 12e6, 43)
	if v, _ := g.Close(); len(v) != 0 {
		t.Fatalf("violations from one high sample: %v", v)
	}
	for i := range growthSustain {
		sample(time.Duration(105+5*i)*time.Second, 12e6, 70)
	}
	v, rows := g.Close()
	if len(v) != 1 || !strings.Contains(v[0].What, "go_goroutines") {
		t.Fatalf("violations %v, want goroutines", v)
	}
	if len(rows) != 1 || rows[0].Base["go_goroutines"] != 42 || rows[0].Max["go_memstats_heap_alloc_bytes"] != 30e6 || rows[0].Missed != 0 {
		t.Fatalf("rows %+v", rows)
	}
	// A process the check could not read has a row that says so.
	g.Missed("sim-1#0", t0)
	g.Missed("sim-1#0", t0)
	g.Missed("monitor-1#0", t0)
	if _, rows := g.Close(); len(rows) != 2 || rows[0].Missed != 1 || rows[1].Process != "sim-1#0" || rows[1].Missed != 2 {
		t.Fatalf("rows after failed scrapes %+v", rows)
	}
}

func TestFleetCheck(t *testing.T) {
	t0 := time.Unix(1000, 0)
	f := newFleet(10*time.Second, t0)
	thr := decodeThreshold
	report := func(worker, blocks uint64, at time.Duration) {
		f.Report(events.LoadReport{Model: "m", WorkerID: worker, Source: "engine", ActiveDecodeBlocks: events.Some(blocks),
			KVTotalBlocks: events.Some(100)}, t0.Add(at))
	}
	record := func(busy, free, stale []uint64, at time.Duration) events.BusySet {
		return events.BusySet{Model: "m", Busy: busy, Free: free, Stale: stale, UpdatedAt: t0.Add(at).UnixNano(),
			Thresholds: events.Thresholds{ActiveDecodeBlocks: &thr}}
	}
	report(1, 90, 0)
	report(2, 10, 0)
	for at := time.Second; at <= 20*time.Second; at += time.Second {
		report(1, 90, at)
		report(2, 10, at)
	}
	now := t0.Add(20 * time.Second)
	if d := f.Check(record([]uint64{1}, []uint64{2}, nil, 20*time.Second), now); d != "" {
		t.Fatalf("a right record: %s", d)
	}
	// The saturation and the routers' queues are left out (contract §20).
	withTraffic := record([]uint64{1}, []uint64{2}, nil, 20*time.Second)
	withTraffic.Saturation = 3.5
	withTraffic.QueuedBy = map[string]map[int64]uint64{"router/r1": {0: 7}}
	withTraffic.Queued = map[int64]uint64{0: 7}
	if d := f.Check(withTraffic, now); d != "" {
		t.Fatalf("a right record with saturation and queues: %s", d)
	}
	if d := f.Check(record(nil, []uint64{1, 2}, nil, 20*time.Second), now); !strings.Contains(d, "worker 1 listed free") {
		t.Fatalf("worker 1 busy for 20 s, listed free: %q", d)
	}
	if d := f.Check(record([]uint64{1}, nil, []uint64{2}, 20*time.Second), now); !strings.Contains(d, "worker 2 reported") {
		t.Fatalf("worker 2 reporting, listed stale: %q", d)
	}
	if d := f.Check(record([]uint64{1}, []uint64{2, 3}, nil, 20*time.Second), now); !strings.Contains(d, "worker 3 is free but never reported") {
		t.Fatalf("phantom worker 3: %q", d)
	}
	// worker 2 goes silent: stale after stale-after
	for at := 21 * time.Second; at <= 35*time.Second; at += time.Second {
		report(1, 90, at)
	}
	now = t0.Add(35 * time.Second)
	if d := f.Check(record([]uint64{1}, []uint64{2}, nil, 35*time.Second), now); !strings.Contains(d, "worker 2 silent") {
		t.Fatalf("worker 2 silent for 15 s, listed free: %q", d)
	}
	if d := f.Check(record([]uint64{1}, nil, []uint64{2}, 35*time.Second), now); d != "" {
		t.Fatalf("worker 2 stale: %s", d)
	}
}

func TestFinal(t *testing.T) {
	t0 := time.Unix(1000, 0)
	thr := decodeThreshold
	f := newFleet(10*time.Second, t0.Add(-time.Minute))
	f.Report(events.LoadReport{Model: "chaos/alpha", WorkerID: 1, Source: "engine", KVTotalBlocks: events.Some(100)}, t0)
	s := Snapshot{Now: t0, Partitions: 8, LeaseTTL: 3 * time.Second, Heartbeat: 2 * time.Second,
		Leases: map[int]Lease{}, Announces: map[string]time.Duration{"a": time.Second, "b": time.Second, "c": 5 * time.Second},
		Held: map[string][]int{"a": {0, 1, 2, 3}, "b": {4, 5, 6, 7}, "c": {}}, Models: []string{"chaos/alpha"}, Fleet: f,
		Records: map[string]events.BusySet{"chaos/alpha": {Model: "chaos/alpha", Free: []uint64{1}, UpdatedAt: t0.UnixNano(),
			MonitorID: "b", Epoch: 3, Thresholds: events.Thresholds{ActiveDecodeBlocks: &thr}}}}
	for p := range 8 {
		s.Leases[p] = Lease{Monitor: map[bool]string{true: "a", false: "b"}[p < 4], Epoch: 3, Age: time.Second}
	}
	if events.Partition("chaos/alpha", 8) != 4 {
		t.Fatal("chaos/alpha is not in partition 4 any more: fix the test's holders")
	}
	if ok, why := s.Final(); !ok {
		t.Fatalf("final state refused: %s", why)
	}
	s.Announces["c"] = time.Second // c is live: 3 monitors, at most 3 partitions each
	if ok, why := s.Final(); ok || !strings.Contains(why, "holds 4 partitions, more than ceil(8/3) = 3") {
		t.Fatalf("got %v %q", ok, why)
	}
	s.Announces["c"] = 5 * time.Second
	s.Held["a"] = []int{0, 1, 2, 3, 4}
	if ok, why := s.Final(); ok || !strings.Contains(why, "partition 4 leased to b, held by [a b]") {
		t.Fatalf("two holders: got %v %q", ok, why)
	}
	s.Held["a"] = []int{0, 1, 2, 3}
	s.Monitors = []string{"a", "b", "c"} // c restarted: it must be live again
	if ok, why := s.Final(); ok || !strings.Contains(why, "c not live yet") {
		t.Fatalf("a monitor not back: got %v %q", ok, why)
	}
	s.Down = map[string]bool{"c": true} // c still down: not waited for
	if ok, why := s.Final(); !ok {
		t.Fatalf("final state refused while c is down: %s", why)
	}
	s.Now = t0.Add(5 * time.Second)
	if ok, why := s.Final(); ok || !strings.Contains(why, "record 5s old") {
		t.Fatalf("old record: got %v %q", ok, why)
	}
}

// TestLostFinal: between faults, a stretch without the final state is
// reported once, when it passes the limit, and a final state in between
// starts the count again.
func TestLostFinal(t *testing.T) {
	t0 := time.Unix(1000, 0)
	const limit = 20 * time.Second
	var l lostFinal
	steps := []struct {
		at   time.Duration
		why  string
		want bool
	}{
		{0, "", false},
		{1 * time.Second, "partition 3 has no lease", false},
		{21 * time.Second, "partition 3 has no lease", false}, // exactly the limit
		{22 * time.Second, "partition 3 has no lease", true},
		{30 * time.Second, "partition 3 has no lease", false}, // the same stretch: reported already
		{31 * time.Second, "", false},
		{32 * time.Second, "chaos/beta: record 5s old", false},
		{50 * time.Second, "chaos/beta: record 5s old", false},
		{51 * time.Second, "", false}, // final again before the limit: nothing
		{52 * time.Second, "read lease p.8.1: timeout", false},
		{73 * time.Second, "read lease p.8.1: timeout", true},
	}
	for _, st := range steps {
		if got := l.see(t0.Add(st.at), st.why, limit); got != st.want {
			t.Fatalf("at %v (%q): reported %v, want %v", st.at, st.why, got, st.want)
		}
	}
}

// TestResults: how a run's findings become its verdict (contract §20). A
// violation during a fault around which every CPU sample was above 90 % is
// inconclusive; one during a fault with a single quieter second is not,
// nor is one between faults, nor a fault's own recovery failure; a
// fail-open window while the checker could not read the bucket is
// inconclusive; the recovery percentiles are over the faults that
// recovered.
func TestResults(t *testing.T) {
	t0 := time.Unix(10000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	newDriver := func() *driver {
		cfg := chaosConfig("242")
		d := &driver{cfg: cfg, seed: 7, duration: 3 * time.Minute, growth: newGrowth(), cpu: &CPU{},
			ck: &Checker{records: newRecords(cfg.StaleListAfter)}}
		for s := range 60 { // 95 % every second of the first minute but one
			pct := 95.0
			if s == 45 {
				pct = 85
			}
			d.cpu.samples = append(d.cpu.samples, cpuSample{at: at(s), pct: pct})
		}
		// chaos/alpha's record: updated every 5 s but from 60 s to 85 s,
		// a fail-open window of 15 s from 70 s, while the checker was
		// blind for a second.
		rev := uint64(0)
		for s := 0; s <= 180; s += 5 {
			if s > 60 && s < 85 {
				continue
			}
			rev++
			d.ck.records.Observe("chaos.alpha", rev, events.BusySet{Epoch: 1, Seq: rev, UpdatedAt: at(s).UnixNano()}, at(s))
		}
		d.ck.blind = []Window{{Start: at(75), Len: time.Second}}
		return d
	}
	faults := func() []FaultResult {
		return []FaultResult{
			{Fault: Fault{N: 1, Kind: KillMonitor, Target: "monitor-1"}, Start: at(10), Healed: at(15), Judged: at(16), Recovery: time.Second},
			{Fault: Fault{N: 2, Kind: KillRouter, Target: "router-1"}, Start: at(40), Healed: at(45), Judged: at(47), Recovery: 2 * time.Second},
			{Fault: Fault{N: 3, Kind: KillMonitor, Target: "monitor-2"}, Start: at(100), Healed: at(105), Judged: at(125), Failed: "partition 3 has no lease"},
		}
	}

	d := newDriver()
	d.viol = []Violation{
		{At: at(12), Rule: RuleAnswer, What: "502 in fault 1"},
		{At: at(46), Rule: RuleAnswer, What: "502 in fault 2"},
		{At: at(125), Rule: RuleRecovery, Fault: 3, What: "no final state"},
		{At: at(80), Rule: RuleLost, What: "between faults"},
	}
	r := d.results(t0, at(180), faults(), &Load{RPS: 22.2})
	type row struct {
		Rule  string
		Fault int
	}
	rows := func(vs []Violation) []row {
		var out []row
		for _, v := range vs {
			out = append(out, row{v.Rule, v.Fault})
		}
		return out
	}
	if got, want := rows(r.Violations), []row{{RuleAnswer, 2}, {RuleLost, 0}, {RuleRecovery, 3}}; !reflect.DeepEqual(got, want) {
		t.Errorf("violations %v, want %v (by time): %+v", got, want, r.Violations)
	}
	if got, want := rows(r.Inconclusive), []row{{RuleAnswer, 1}, {RuleFailOpen, 0}}; !reflect.DeepEqual(got, want) {
		t.Errorf("inconclusive %v, want %v: %+v", got, want, r.Inconclusive)
	}
	if r.Pass {
		t.Error("a run with violations passed")
	}
	if !r.Faults[0].Inconclusive || r.Faults[1].Inconclusive || r.Faults[2].Inconclusive {
		t.Errorf("inconclusive faults: %v %v %v, want only the first", r.Faults[0].Inconclusive, r.Faults[1].Inconclusive, r.Faults[2].Inconclusive)
	}
	if r.Faults[0].CPU != 95 {
		t.Errorf("CPU around fault 1: %v, want 95", r.Faults[0].CPU)
	}
	if r.RecoveryP50MS == nil || *r.RecoveryP50MS != 1000 || *r.RecoveryP99MS != 2000 || *r.RecoveryMaxMS != 2000 {
		t.Errorf("recovery p50 %s p99 %s max %s, want 1000, 2000, 2000 ms (fault 3 did not recover)",
			msString(r.RecoveryP50MS), msString(r.RecoveryP99MS), msString(r.RecoveryMaxMS))
	}
	if len(r.FailOpen) != 1 || r.LongestOpenMS != 15000 || !r.FailOpen[0].Blind {
		t.Errorf("fail-open windows %+v, longest %v ms: want one of 15 s, blind", r.FailOpen, r.LongestOpenMS)
	}
	if r.FaultsByKind[KillMonitor] != 2 || r.FaultsByKind[KillRouter] != 1 {
		t.Errorf("faults by kind %v", r.FaultsByKind)
	}

	// Only what is inconclusive: the run passes.
	d = newDriver()
	d.viol = []Violation{{At: at(12), Rule: RuleAnswer, What: "502 in fault 1"}}
	if r := d.results(t0, at(180), faults()[:2], &Load{RPS: 22.2}); !r.Pass || len(r.Inconclusive) != 2 || len(r.Violations) != 0 {
		t.Errorf("pass %v, %d inconclusive, violations %+v: want a pass with two inconclusive", r.Pass, len(r.Inconclusive), r.Violations)
	}
}

func TestRatedCapacityOfTiny(t *testing.T) {
	p, err := stepengine.LookupProfile(stepengine.ProfileTiny)
	if err != nil {
		t.Fatal(err)
	}
	// docs/performance.md: 11.25-12.5 requests/s measured for 4 workers
	if r := ratedRPS(p.Config); r < 2.8 || r > 3.3 {
		t.Errorf("tiny rated at %.2f requests/s, want about 3", r)
	}
}

// The chaos stack's NATS configuration carries the mappings that
// `workermon nats-config --partitions 8` prints.
func TestNATSConfigHasTheMappings(t *testing.T) {
	data, err := os.ReadFile("../../deploy/chaos/nats.conf")
	if err != nil {
		t.Fatal(err)
	}
	got := regexp.MustCompile(`"([^"]+)": "([^"]+)"`).FindAllStringSubmatch(string(data), -1)
	want := events.PartitionMappings("workermon", chaosConfig("242").Partitions)
	if len(got) != len(want) {
		t.Fatalf("%d mappings in nats.conf, want %d", len(got), len(want))
	}
	for i, m := range want {
		if got[i][1] != m.From || got[i][2] != m.To {
			t.Errorf("mapping %d: %s → %s, want %s → %s", i, got[i][1], got[i][2], m.From, m.To)
		}
	}
}

// The chaos stack publishes on 127.0.0.1 every port the driver reads: the
// monitors', the routers' and the engines' (their /metrics, for the growth
// check).
func TestComposePublishesTheDriversPorts(t *testing.T) {
	data, err := os.ReadFile("../../deploy/chaos/compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	cfg := chaosConfig("242")
	for _, urls := range []map[string]string{cfg.Monitors, cfg.Routers, cfg.EngineHTTP} {
		for svc, u := range urls {
			port, ok := strings.CutPrefix(u[strings.LastIndex(u, ":")+1:], "242")
			if !ok {
				t.Fatalf("%s: %s is not on the prefix 242", svc, u)
			}
			if want := `"127.0.0.1:${WORKERMON_CHAOS_PORTS:-242}` + port + `:`; !strings.Contains(string(data), want) {
				t.Errorf("%s: compose.yml does not publish %s (%s)", svc, want, u)
			}
		}
	}
	if len(cfg.EngineHTTP) != len(cfg.Engines) {
		t.Errorf("%d engines, %d of them with a /metrics URL", len(cfg.Engines), len(cfg.EngineHTTP))
	}
}

// TestScrapeGrowth reads heap and goroutines off a real Prometheus page, as
// a monitor's or a router's /metrics serves them.
func TestScrapeGrowth(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector())
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	v, err := scrapeGrowth(t.Context(), srv.Client(), srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range growthMetrics {
		if v[name] <= 0 {
			t.Errorf("%s = %v, want a positive value (got %v)", name, v[name], v)
		}
	}
}

// TestCPUAround: a fault is inconclusive only when the CPU stayed above
// the bound (contract §20), so Around gives the lowest sample as well as
// the mean: 95, 95 and 85 average over 90 % but did not stay above it.
func TestCPUAround(t *testing.T) {
	t0 := time.Now()
	c := &CPU{}
	for i, pct := range []float64{20, 95, 95, 85, 10} {
		c.samples = append(c.samples, cpuSample{at: t0.Add(time.Duration(i) * time.Second), pct: pct})
	}
	mean, lowest, ok := c.Around(t0.Add(time.Second), t0.Add(3*time.Second))
	if !ok || math.Abs(mean-275.0/3) > 1e-9 || lowest != 85 {
		t.Fatalf("Around = %v, %v, %v; want mean 91.67, lowest 85", mean, lowest, ok)
	}
	if mean <= cpuInconclusive || lowest > cpuInconclusive {
		t.Fatalf("the example no longer separates the mean from the lowest sample")
	}
	if _, _, ok := c.Around(t0.Add(10*time.Second), t0.Add(20*time.Second)); ok {
		t.Fatal("Around found samples in a window without any")
	}
}
