package bench

import (
	"slices"
	"testing"
	"time"

	"github.com/workermon/workermon/loadgen"
)

// TestScaleOutScenario: the scale-out scenario offers chat at 85 % of the
// capacity throughout, starts one worker short and has it join a third of
// the way in; it runs none, thresholds and resched only, and resched runs
// only on it.
func TestScaleOutScenario(t *testing.T) {
	t.Parallel()
	const length = 30 * time.Second
	i := slices.IndexFunc(Scenarios(), func(sc Scenario) bool { return sc.Name == ScenarioScaleOut })
	if i < 0 {
		t.Fatal("no scaleout scenario")
	}
	sc := Scenarios()[i]
	for _, at := range []time.Duration{0, length / 2, length} {
		if got := sc.Rate(at, length); got != ScaleOutRate || sc.Workload(at, length) != loadgen.WorkloadChat {
			t.Errorf("at %v: rate %v, workload %v; want %v, chat", at, got, sc.Workload(at, length), ScaleOutRate)
		}
	}
	if sc.Join == nil || sc.Join(length) != 10*time.Second {
		t.Errorf("the last worker does not join at 10 s of 30")
	}
	if startWorkers(sc.Join(length)) != GoodputWorkers-1 || startWorkers(0) != GoodputWorkers {
		t.Errorf("starts %d workers with a join, %d without", startWorkers(sc.Join(length)), startWorkers(0))
	}
	for _, sc := range Scenarios() {
		if sc.Name != ScenarioScaleOut && (sc.Join != nil || sc.Policies != nil) {
			t.Errorf("%s has a join or a list of policies", sc.Name)
		}
	}
	var ran []string
	for _, p := range Policies(false) {
		if runsOn(p, sc) {
			ran = append(ran, p.Name)
		}
		for _, other := range Scenarios() {
			// thresholds-best does not run on spike (contract §23).
			want := p.Name != PolicyResched && (p.Name != PolicyThresholdsBest || other.Name != ScenarioSpike)
			if other.Name != ScenarioScaleOut && runsOn(p, other) != want {
				t.Errorf("%s on %s: runs %v", p.Name, other.Name, runsOn(p, other))
			}
		}
	}
	if want := []string{PolicyNone, PolicyThresholds, PolicyResched}; !slices.Equal(ran, want) {
		t.Errorf("scaleout runs %v, want %v", ran, want)
	}
}

// TestReschedPolicy: resched is thresholds with the rescheduler on at the
// recommended interval and routers that continue cut streams, 1 router;
// no other policy reschedules or migrates.
func TestReschedPolicy(t *testing.T) {
	t.Parallel()
	byName := map[string]Policy{}
	for _, p := range Policies(false) {
		byName[p.Name] = p
	}
	r, th := byName[PolicyResched], byName[PolicyThresholds]
	if r.Monitor.Rescheduling != ReschedInterval || r.Router.MigrationLimit != ReschedMigrationLimit ||
		!slices.Equal(r.Routers, []int{1}) || r.Sweep != nil || r.Monitor.SLO != nil {
		t.Errorf("resched: %+v", r)
	}
	spec := r.Monitor
	spec.Rescheduling = 0
	if thresholdsText(spec.Thresholds) != thresholdsText(th.Monitor.Thresholds) {
		t.Errorf("resched's thresholds %s, thresholds' %s", thresholdsText(spec.Thresholds), thresholdsText(th.Monitor.Thresholds))
	}
	for name, p := range byName {
		if name != PolicyResched && (p.Monitor.Rescheduling != 0 || p.Router.MigrationLimit != 0) {
			t.Errorf("%s reschedules (%v) or migrates (%d)", name, p.Monitor.Rescheduling, p.Router.MigrationLimit)
		}
	}
}
