package bench

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/workermon/workermon/loadgen"
	"github.com/workermon/workermon/sim"
)

// The scale-out scenario (issue 35 item 22, after Llumnix's): a fleet of
// GoodputWorkers − 1 workers under a load sized for GoodputWorkers, and
// the last worker joins empty a third of the way in. It measures what the
// rescheduler (contract §12) gives users: `thresholds` is the row without
// it, `resched` the same thresholds with it on.

// ScenarioScaleOut is the scale-out scenario's name.
const ScenarioScaleOut = "scaleout"

// PolicyResched is `thresholds` with the rescheduler on and the routers
// continuing cut streams.
const PolicyResched = "resched"

// ScaleOutRate is the scale-out scenario's offered rate, as a fraction of
// the capacity of the whole fleet: 85 % of four workers is 113 % of the
// three that start.
const ScaleOutRate = 0.85

// ReschedInterval is the `resched` policy's --rescheduling-interval: the
// interval docs/rescheduler.md recommends, with the planner's defaults.
const ReschedInterval = 200 * time.Millisecond

// ReschedMigrationLimit is the `resched` policy's routers'
// --migration-limit: how many times a cut stream may continue.
const ReschedMigrationLimit = 8

// ScaleOutPolicies are the policies the scale-out scenario runs: without
// admission, with thresholds, and with thresholds and the rescheduler.
var ScaleOutPolicies = []string{PolicyNone, PolicyThresholds, PolicyResched}

// scaleOutScenario is the scale-out scenario: chat at ScaleOutRate of the
// capacity, the last worker joining at a third of the length.
func scaleOutScenario() Scenario {
	return Scenario{Name: ScenarioScaleOut,
		Rate:     func(time.Duration, time.Duration) float64 { return ScaleOutRate },
		Workload: func(time.Duration, time.Duration) loadgen.Workload { return loadgen.WorkloadChat },
		Join:     func(length time.Duration) time.Duration { return length / 3 },
		Policies: ScaleOutPolicies,
	}
}

// reschedPolicy is the `resched` policy: the `thresholds` monitor with the
// rescheduler on, routers that continue cut streams; only on scaleout.
func reschedPolicy(thresholds MonitorSpec) Policy {
	spec := thresholds
	spec.Rescheduling = ReschedInterval
	return Policy{Name: PolicyResched, Routers: []int{1}, Monitor: spec,
		Router: RouterSpec{MigrationLimit: ReschedMigrationLimit}, OnlyOn: []string{ScenarioScaleOut}}
}

// runsOn reports whether p runs on sc: the policy's OnlyOn and the
// scenario's Policies, when set, both allow it.
func runsOn(p Policy, sc Scenario) bool {
	return (len(p.OnlyOn) == 0 || slices.Contains(p.OnlyOn, sc.Name)) &&
		(len(sc.Policies) == 0 || slices.Contains(sc.Policies, p.Name))
}

// startWorkers is how many workers a run starts with: one fewer when one
// joins later.
func startWorkers(join time.Duration) int {
	if join > 0 {
		return GoodputWorkers - 1
	}
	return GoodputWorkers
}

// joiner starts the fleet's last worker at a time into the load, and owns
// the goroutine that does.
type joiner struct {
	done  chan struct{}
	fleet *sim.Fleet // set before done closes
	err   error
}

// startJoiner starts, after at, one worker with the next id on natsURL,
// unless ctx ends first; progress is told when it has joined.
func startJoiner(ctx context.Context, natsURL string, at time.Duration, log *slog.Logger, progress func(string)) *joiner {
	j := &joiner{done: make(chan struct{})}
	go func() {
		defer close(j.done)
		t := time.NewTimer(at)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		cfg := fleetConfig(natsURL)
		cfg.Workers, cfg.BaseWorkerID = 1, sim.DefaultBaseWorkerID+GoodputWorkers-1
		j.fleet, j.err = sim.NewFleet(ctx, cfg, log)
		if j.err == nil {
			progress(fmt.Sprintf("worker %d joined at %v", cfg.BaseWorkerID, at))
		}
	}()
	return j
}

// wait waits for the joiner's goroutine and returns the worker's fleet
// (nil when it never started) and why it could not start.
func (j *joiner) wait() (*sim.Fleet, error) {
	<-j.done
	if j.err != nil {
		return nil, fmt.Errorf("bench: goodput: the joining worker: %w", j.err)
	}
	return j.fleet, nil
}

// fleets is the fleets of a run, the joining one added once it has
// started: their preemptions are the row's.
type fleets struct {
	mu sync.Mutex
	fs []*sim.Fleet
}

func (f *fleets) add(x *sim.Fleet) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fs = append(f.fs, x)
}

func (f *fleets) preemptions() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var n uint64
	for _, x := range f.fs {
		for _, w := range x.Stats() {
			for _, r := range w.Ranks {
				n += r.Preemptions
			}
		}
	}
	return n
}
