package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/loadgen"
	"github.com/workermon/workermon/sim"
	"github.com/workermon/workermon/sim/stepengine"
)

// Defaults of the goodput benchmark (contract §16).
const (
	// GoodputWorkers is the size of the simulated fleet.
	GoodputWorkers = 4
	// GoodputProfile is the engine profile of its workers.
	GoodputProfile = stepengine.ProfileTiny
	// GoodputModel is the model they serve.
	GoodputModel = "bench/goodput"
	// DefaultGoodputSeed is the first seed of the arrivals.
	DefaultGoodputSeed = 24
)

// Timings are the lengths of a goodput run's parts.
type Timings struct {
	// Warmup and Measure: a capacity trial counts the requests offered in
	// [Warmup, Warmup+Measure).
	Warmup, Measure time.Duration
	// Scenario is the length of each scenario.
	Scenario time.Duration
}

// FullTimings and QuickTimings are contract §16's.
var (
	FullTimings  = Timings{Warmup: 5 * time.Second, Measure: 20 * time.Second, Scenario: 30 * time.Second}
	QuickTimings = Timings{Warmup: 3 * time.Second, Measure: 8 * time.Second, Scenario: 12 * time.Second}
)

// DefaultParallel is how many rows a run measures at once: the benchmark's
// own CPU use is a small share of a core (the engines' steps are timers), so
// two rows at a time fit on 2 cores and halve the run.
const DefaultParallel = 2

// CapacityTolerance is the bisection's precision: the capacity found is
// at most 5 % below the true one.
const CapacityTolerance = 0.05

// CapacityGoodFraction is the share of good requests a rate must keep to
// be within capacity.
const CapacityGoodFraction = 0.99

// Stack starts the parts of a goodput run that cmd/workermon owns: the
// monitor (with its embedded NATS server) and the routers, each configured
// as a policy says.
type Stack interface {
	StartMonitor(ctx context.Context, spec MonitorSpec) (Monitor, error)
	StartRouter(ctx context.Context, spec RouterSpec) (Router, error)
}

// MonitorSpec is how a policy configures the monitor.
type MonitorSpec struct {
	// Thresholds are the monitor's defaults; all unset, nothing is ever
	// busy (contract §5) and the routers admit everything.
	Thresholds events.Thresholds
	// SLO, when not nil, is the SLO of the benchmark's model, set
	// (enforced) before the fleet starts (contract §18): the controller
	// then owns the model's thresholds, starting from Thresholds.
	SLO *SLOSpec
	// SLOInterval, when positive, is the monitor's --slo-interval.
	SLOInterval time.Duration
	// SLOPrefillMin and SLOPrefillMax, when positive, are the monitor's
	// --slo-prefill-range.
	SLOPrefillMin, SLOPrefillMax uint64
	// Rescheduling, when positive, is the monitor's
	// --rescheduling-interval, with the planner's defaults (contract §12).
	Rescheduling time.Duration
	// SLOCommittedMin and SLOCommittedMax, when positive, are the
	// monitor's --slo-committed-range; SLODelayMin and SLODelayMax (ms)
	// its --slo-delay-range (contract §21: the controller owns the leading
	// thresholds too). No policy sets them yet: the slo policy runs with
	// the ranges' defaults.
	SLOCommittedMin, SLOCommittedMax float64
	SLODelayMin, SLODelayMax         uint64
}

// SLOSpec is an SLO of contract §18: latency targets met by a share
// Percentile of the samples.
type SLOSpec struct {
	TTFT, ITL  time.Duration
	Percentile float64
}

// RouterSpec is how a policy configures one router.
type RouterSpec struct {
	// NATSURL is the monitor's NATS server.
	NATSURL string
	// ID names the router (bench-0, bench-1, ...).
	ID string
	// QueueMaxWait, when positive, turns the router's queue on (contract
	// §17: --queue-max-wait); QueueMaxRequests and QueuePace, when
	// positive, replace the defaults of --queue-max-requests and
	// --queue-pace.
	QueueMaxWait     time.Duration
	QueueMaxRequests int
	QueuePace        time.Duration
	// MigrationLimit, when positive, is the router's --migration-limit:
	// it continues streams the rescheduler cut.
	MigrationLimit int
}

// Monitor is a running monitor.
type Monitor interface {
	// NATSURL is the URL of its NATS server.
	NATSURL() string
	Close(ctx context.Context) error
}

// Router is a running router.
type Router interface {
	// URL is the base URL of its proxy (without /v1).
	URL() string
	Close(ctx context.Context) error
}

// Policy is an admission policy as the benchmark measures it: how the
// monitor and the routers are configured, and with how many routers. A
// policy of a later section (a router's queue, SLO-driven thresholds) adds
// its fields to MonitorSpec and RouterSpec and a row here.
type Policy struct {
	// Name is the policy's name in the results.
	Name string
	// Routers is the router counts it runs with (one row each).
	Routers []int
	// Monitor and Router configure the parts; Router's NATSURL and ID are
	// filled in.
	Monitor MonitorSpec
	Router  RouterSpec
	// Sweep, when set, makes the policy the best of a decode threshold
	// sweep: each value is measured, the row with the highest goodput is
	// kept.
	Sweep []float64
	// OnlyOn, when set, limits the policy to those scenarios.
	OnlyOn []string
	// Pending, when not empty, says why the policy is not measured yet
	// (the section that defines it is not built): it is listed, not run.
	Pending string
}

// Names of the policies.
const (
	PolicyNone           = "none"
	PolicyThresholds     = "thresholds"
	PolicyThresholdsBest = "thresholds-best"
	PolicyQueue          = "queue"
	PolicySLO            = "slo"
	PolicyCommitted      = "committed"
)

// CommittedKV is the committed policy's kv_committed_threshold (contract
// §21): busy once the blocks its requests would hold at their expected
// length exceed the cache, no overcommit.
const CommittedKV = 1.0

// CommittedQueueDelay is the committed policy's queue_delay_threshold_ms
// for a TTFT target: half of it, leaving the other half to the first
// token's own prefill and the steps around it.
func CommittedQueueDelay(ttft time.Duration) uint64 { return uint64(ttft.Milliseconds() / 2) }

// MultiRouters is the router count of the policies measured with several
// routers (queue, slo): --router-shares gives one share each.
const MultiRouters = 3

// ThresholdsDecode is the `thresholds` policy's KV-cache threshold
// (contract §16: named, not a version of Dynamo's default).
const ThresholdsDecode = 0.85

// ThresholdsSweep is the decode thresholds `thresholds-best` tries.
var ThresholdsSweep = []float64{0.6, 0.75, 0.9}

// The `queue` policy's router queue (contract §17), over the `thresholds`
// values. A request is good only when its first token comes within the
// TTFT target of its send (contract §16), and a queue wait is part of that
// time: a request that waited longer than the target less a first token's
// time on a loaded engine can no longer be good, and sending it would only
// take the place of one that can. So the wait is bounded by that, not by
// the target alone.
const (
	// QueueMaxWait is --queue-max-wait: the TTFT target (1 s for tiny) less
	// about the TTFT p99 of the thresholds policy's admitted requests.
	QueueMaxWait = 800 * time.Millisecond
	// QueuePace is --queue-pace.
	QueuePace = 20 * time.Millisecond
)

// SLOInterval is the `slo` policy's --slo-interval: a tiny request lasts 1
// to 10 s, and the routers publish their latency windows every second, so
// one window a move.
const SLOInterval = time.Second

// SLOPercentile is the `slo` policy's percentile: the controller's default.
const SLOPercentile = 0.9

// SLOPrefillMin and SLOPrefillMax are the `slo` policy's
// --slo-prefill-range, in tokens: up to one step's token budget of a tiny
// rank (--max-batched-tokens 2048). More prompt tokens than a step computes
// waiting on a rank means prompts queue behind each other there, which a
// chat load under its capacity never does, so the top costs it nothing;
// and a switch to long prompts meets a bound at once, not after the dozen
// moves (×1.24 to ×1.72 each) that the default range's 1048576 tokens
// would take to bind on a rank of this size. (With a top of 8192, the
// cache's size, `slo` made 97 % of `thresholds-best` on `shift`.)
const (
	SLOPrefillMin = 1024
	SLOPrefillMax = 2048
)

// Policies returns contract §16's policies, in the order of the results.
// thresholds-best does not run on spike (contract §23); quick runs it on
// ramp and shift only.
func Policies(quick bool) []Policy {
	best := Policy{Name: PolicyThresholdsBest, Routers: []int{1}, Sweep: ThresholdsSweep,
		OnlyOn: []string{ScenarioRamp, ScenarioBurst, ScenarioShift}}
	if quick {
		best.OnlyOn = []string{ScenarioRamp, ScenarioShift}
	}
	thresholds := MonitorSpec{Thresholds: events.Thresholds{ActiveDecodeBlocks: events.Ptr(ThresholdsDecode)}}
	sloSpec := thresholds
	sloSpec.SLO, sloSpec.SLOInterval = &SLOSpec{Percentile: SLOPercentile}, SLOInterval
	sloSpec.SLOPrefillMin, sloSpec.SLOPrefillMax = SLOPrefillMin, SLOPrefillMax
	committed := MonitorSpec{}
	if prof, err := stepengine.LookupProfile(GoodputProfile); err == nil {
		sloSpec.SLO.TTFT, sloSpec.SLO.ITL = prof.SLO.TTFT, prof.SLO.ITL
		committed.Thresholds = events.Thresholds{KVCommitted: events.Ptr(CommittedKV),
			QueueDelayMs: events.Ptr(CommittedQueueDelay(prof.SLO.TTFT))}
	}
	return []Policy{
		{Name: PolicyNone, Routers: []int{1}},
		{Name: PolicyThresholds, Routers: []int{1}, Monitor: thresholds},
		best,
		{Name: PolicyQueue, Routers: []int{1, MultiRouters}, Monitor: thresholds,
			Router: RouterSpec{QueueMaxWait: QueueMaxWait, QueuePace: QueuePace}},
		{Name: PolicySLO, Routers: []int{1, MultiRouters}, Monitor: sloSpec},
		{Name: PolicyCommitted, Routers: []int{1}, Monitor: committed},
		reschedPolicy(thresholds),
	}
}

// SelectPolicies returns the policies of Policies(quick) named in names,
// in the order of the results; every policy when names is empty.
func SelectPolicies(quick bool, names []string) ([]Policy, error) {
	return selectNamed("policy", Policies(quick), func(p Policy) string { return p.Name }, names)
}

// SelectScenarios returns the scenarios of Scenarios() named in names, in
// their order; every scenario when names is empty.
func SelectScenarios(names []string) ([]Scenario, error) {
	return selectNamed("scenario", Scenarios(), func(sc Scenario) string { return sc.Name }, names)
}

// selectNamed returns the items of all named in names, in all's order; all
// when names is empty. A name of no item is an error that lists the names.
func selectNamed[T any](kind string, all []T, name func(T) string, names []string) ([]T, error) {
	if len(names) == 0 {
		return all, nil
	}
	known := make([]string, len(all))
	for i, it := range all {
		known[i] = name(it)
	}
	for _, n := range names {
		if !slices.Contains(known, n) {
			return nil, fmt.Errorf("%w: no %s %q (known: %s)", ErrInvalidConfig, kind, n, strings.Join(known, ", "))
		}
	}
	return slices.DeleteFunc(slices.Clone(all), func(it T) bool { return !slices.Contains(names, name(it)) }), nil
}

// Names of the scenarios.
const (
	ScenarioRamp  = "ramp"
	ScenarioBurst = "burst"
	ScenarioShift = "shift"
	ScenarioSpike = "spike"
)

// ClientRetries is how many times the clients of burst and spike send a
// rejected request again: the official OpenAI SDKs' default (contract
// §23), with their waits (loadgen.Config.Retries).
const ClientRetries = 2

// SpikeQueueMaxWait is the queue policy's --queue-max-wait on spike
// (contract §23): a spike of 200 % for 1 s over 40 % is about 1.6 s of the
// fleet's work beyond what it serves, which a 2 s wait can hold; requests
// that wait that long may miss the TTFT target, and both goodput and
// failures are reported.
const SpikeQueueMaxWait = 2 * time.Second

// Scenario is a load shape relative to the capacity.
type Scenario struct {
	Name string
	// Rate is the offered rate at elapsed of length, as a fraction of the
	// capacity.
	Rate func(elapsed, length time.Duration) float64
	// Workload is the workload at elapsed of length.
	Workload func(elapsed, length time.Duration) loadgen.Workload
	// Join, when set, is when into length the fleet's last worker joins;
	// the run starts without it.
	Join func(length time.Duration) time.Duration
	// Policies, when set, are the only policies the scenario runs.
	Policies []string
	// Retries is how many times its clients send a request again after a
	// rejection (or another answer the OpenAI SDKs retry); 0: clients
	// that give up at once.
	Retries int
	// QueueMaxWait, when positive, replaces the --queue-max-wait of the
	// policies whose routers queue.
	QueueMaxWait time.Duration
}

// Scenarios returns contract §16's scenarios.
func Scenarios() []Scenario {
	chat := func(time.Duration, time.Duration) loadgen.Workload { return loadgen.WorkloadChat }
	return []Scenario{
		{Name: ScenarioRamp, Workload: chat, Rate: func(t, length time.Duration) float64 {
			// 50 % → 250 % → 50 %.
			x := float64(t) / float64(length)
			if x > 0.5 {
				x = 1 - x
			}
			return 0.5 + 2*2*max(0, x)
		}},
		{Name: ScenarioBurst, Workload: chat, Retries: ClientRetries, Rate: func(t, _ time.Duration) float64 {
			// 70 %, ×10 for 2 s every 10 s (from 5 s to 7 s of each).
			if p := t % (10 * time.Second); p >= 5*time.Second && p < 7*time.Second {
				return 7
			}
			return 0.7
		}},
		{Name: ScenarioShift, Rate: func(time.Duration, time.Duration) float64 { return 0.7 },
			Workload: func(t, length time.Duration) loadgen.Workload {
				if t < length/2 {
					return loadgen.WorkloadChat
				}
				return loadgen.WorkloadDocuments
			}},
		{Name: ScenarioSpike, Workload: chat, Retries: ClientRetries, QueueMaxWait: SpikeQueueMaxWait,
			Rate: func(t, _ time.Duration) float64 {
				// 40 %, 200 % in the first second of every 10 s from 5 s
				// (5 s to 6 s of each): 56 % on average, so a queue can
				// hold each spike.
				if p := t % (10 * time.Second); p >= 5*time.Second && p < 6*time.Second {
					return 2
				}
				return 0.4
			}},
		scaleOutScenario(),
	}
}

// GoodputConfig is one run of `workermon bench goodput`.
type GoodputConfig struct {
	// Stack starts the monitor and the routers.
	Stack Stack
	// Quick selects QuickTimings and the quick sweep.
	Quick bool
	// Timings, when not zero, replaces the timings Quick selects (tests).
	Timings Timings
	// Seeds is how many times each row runs (seeds Seed, Seed+1, ...); the
	// figures are the medians.
	Seeds int
	// Seed is the first seed of the arrivals and lengths.
	Seed uint64
	// Capacity, when positive, is taken as the capacity instead of
	// measuring it (--capacity: to repeat rows against a run's rates;
	// tests).
	Capacity float64
	// CapacityDocuments, when positive, is taken as the capacity for the
	// documents workload instead of measuring it (--capacity-documents).
	// It is measured only when a scenario of the run offers documents.
	CapacityDocuments float64
	// MaxDrain, when positive, bounds the wait for the requests still in
	// flight when the arrivals end (tests: those cut count as not good);
	// 0 waits up to the client's timeout.
	MaxDrain time.Duration
	// RouterShares, when set, splits the load of the rows with as many
	// routers between them in these proportions (--router-shares 60,30,10,
	// contract §22); nil: even. Each share is positive.
	RouterShares []float64
	// Parallel is how many rows are measured at once, each with its own
	// monitor, fleet and routers (0: DefaultParallel). The capacity's
	// trials run one at a time.
	Parallel int
	// Policies and Scenarios, when set, replace the defaults (--policies,
	// --scenarios; tests).
	Policies  []Policy
	Scenarios []Scenario
	// Log receives the parts' logs; nil discards them.
	Log *slog.Logger
	// Progress, when not nil, is told each step.
	Progress func(string)
}

// GoodputResult is contract §16's document.
type GoodputResult struct {
	CapacityRPS float64 `json:"capacity_rps"`
	// CapacityDocumentsRPS is the fleet's capacity for documents (contract
	// §21), 0 when no scenario of the run offers them.
	CapacityDocumentsRPS float64      `json:"capacity_documents_rps"`
	SLO                  SLOms        `json:"slo"`
	Results              []GoodputRow `json:"results"`
	// RouterShares is the split of the load between the routers of a row
	// with as many (nil: even).
	RouterShares []float64 `json:"-"`
	// Pending lists the policies not measured yet, with why.
	Pending []Policy `json:"-"`
	// Policies are the policies of the run, pending or not.
	Policies []Policy `json:"-"`
	// Profile, Workers, Seed and Seeds describe the run.
	Profile string        `json:"-"`
	Workers int           `json:"-"`
	Seed    uint64        `json:"-"`
	Seeds   int           `json:"-"`
	Took    time.Duration `json:"-"`
	// Scenario is its length.
	Scenario time.Duration `json:"-"`
}

// SLOms are the latency targets in milliseconds.
type SLOms struct {
	TTFT float64 `json:"ttft_ms"`
	ITL  float64 `json:"itl_ms"`
}

// GoodputRow is one scenario under one policy (contract §16). Times in
// milliseconds; a percentile of nothing is null.
type GoodputRow struct {
	Scenario   string  `json:"scenario"`
	Policy     string  `json:"policy"`
	Routers    int     `json:"routers"`
	GoodputRPS float64 `json:"goodput_rps"`
	GoodputPct float64 `json:"goodput_pct"`
	// CeilingRPS is the scenario's ceiling (capacities.ceiling): the most
	// goodput any policy could reach; CeilingPct the row's goodput as a
	// share of it.
	CeilingRPS float64  `json:"ceiling_rps"`
	CeilingPct float64  `json:"ceiling_pct"`
	TTFTp50    *float64 `json:"ttft_p50_ms"`
	TTFTp99    *float64 `json:"ttft_p99_ms"`
	ITLp99     *float64 `json:"itl_p99_ms"`
	// RejectedPct is the share of the attempts answered 503 or 429 (with
	// clients that give up, of the requests sent).
	RejectedPct float64 `json:"rejected_pct"`
	// FailedPct is the share of the offered requests that never got a 200:
	// their last attempt was rejected or failed (or they were never sent,
	// dropped at the client's cap).
	FailedPct float64 `json:"failed_pct"`
	// AttemptsPerRequest is the attempts over the requests sent (1 with
	// clients that give up).
	AttemptsPerRequest float64  `json:"attempts_per_request"`
	QueueWaitP99       *float64 `json:"queue_wait_p99_ms"`
	Preemptions        uint64   `json:"preemptions"`
	// CPUPct is the host's CPU use over the row: all cores, everything on
	// the machine, not the benchmark's alone.
	CPUPct float64 `json:"cpu_pct"`
	// ByRouter, on the rows of a policy whose routers queue when the load
	// is split unevenly (GoodputConfig.RouterShares), is each router's
	// figures, in the order of the shares (contract §22).
	ByRouter []RouterRow `json:"by_router,omitempty"`
	// Decode is the decode threshold of a thresholds row (the sweep's
	// best for thresholds-best), 0 without one.
	Decode float64 `json:"-"`
	// Retries is how many times the row's clients retried a request (its
	// scenario's).
	Retries int `json:"-"`
	// Series is the row's course over time, one point a second (of the
	// first seed), for the report.
	Series []Point `json:"-"`
}

// RouterRow is one router's figures in a row, over the attempts it
// answered (the row's drain included).
type RouterRow struct {
	// Share is the share of the load sent to it, of 1.
	Share float64 `json:"share"`
	// QueueWaitP90 is the p90 of the waits in its queue of the attempts
	// that waited (X-Workermon-Queued), in ms; null without one.
	QueueWaitP90 *float64 `json:"queue_wait_p90_ms"`
	// RejectedPct is the share of its attempts it answered 503 or 429:
	// rejected at once, or let go when their wait ran out.
	RejectedPct float64 `json:"rejected_pct"`
}

// UnevenShares reports whether shares split a load unevenly.
func UnevenShares(shares []float64) bool {
	for _, s := range shares {
		if s != shares[0] {
			return true
		}
	}
	return false
}

// Point is one second of a row, by the requests' arrival.
type Point struct {
	// T is the second's start since the scenario's.
	T time.Duration
	// TargetRPS is the offered rate the scenario asks for at T.
	TargetRPS float64
	// CeilingRPS is the ceiling over the second: the mean of min(offered
	// rate, the capacity for the workload offered).
	CeilingRPS float64
	// Offered and Good count the requests that arrived in the second:
	// offered (the measured arrivals), good.
	Offered, Good int
	// Attempts and Rejected count the attempts sent in the second (first
	// sends and retries): all, answered 503 or 429.
	Attempts, Rejected int
	// TTFTp99 is the TTFT p99 of the second's successful requests, in ms;
	// NaN without one.
	TTFTp99 float64
}

// Goodput runs the benchmark: the capacity, then every scenario under
// every policy.
func Goodput(ctx context.Context, cfg GoodputConfig) (GoodputResult, error) {
	start := time.Now()
	if cfg.Stack == nil {
		return GoodputResult{}, fmt.Errorf("%w: no stack", ErrInvalidConfig)
	}
	for _, sh := range cfg.RouterShares {
		if !(sh > 0) || math.IsInf(sh, 0) {
			return GoodputResult{}, fmt.Errorf("%w: router share %v is not a positive number", ErrInvalidConfig, sh)
		}
	}
	if cfg.Seeds < 1 {
		cfg.Seeds = 1
	}
	if cfg.Parallel < 1 {
		cfg.Parallel = DefaultParallel
	}
	if cfg.Timings == (Timings{}) {
		cfg.Timings = FullTimings
		if cfg.Quick {
			cfg.Timings = QuickTimings
		}
	}
	if cfg.Policies == nil {
		cfg.Policies = Policies(cfg.Quick)
	}
	if cfg.Scenarios == nil {
		cfg.Scenarios = Scenarios()
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Progress == nil {
		cfg.Progress = func(string) {}
	}
	prof, err := stepengine.LookupProfile(GoodputProfile)
	if err != nil {
		return GoodputResult{}, err
	}
	slo := loadgen.SLO{TTFT: prof.SLO.TTFT, ITL: prof.SLO.ITL}
	res := GoodputResult{SLO: SLOms{TTFT: ms(slo.TTFT), ITL: ms(slo.ITL)}, Profile: GoodputProfile,
		Workers: GoodputWorkers, Seed: cfg.Seed, Seeds: cfg.Seeds, Scenario: cfg.Timings.Scenario, Results: []GoodputRow{},
		RouterShares: cfg.RouterShares}
	g := &goodput{cfg: cfg, slo: slo}
	cfg.Progress(fmt.Sprintf("%d %s workers; SLO: TTFT ≤ %v, TPOT ≤ %v (the profile's)", GoodputWorkers, GoodputProfile, slo.TTFT, slo.ITL))
	if res.CapacityRPS = cfg.Capacity; res.CapacityRPS <= 0 {
		if res.CapacityRPS, err = g.capacity(ctx, loadgen.WorkloadChat, ChatGuess); err != nil {
			return res, err
		}
	}
	cfg.Progress(fmt.Sprintf("capacity: %.2f requests/s", res.CapacityRPS))
	caps := capacities{chat: res.CapacityRPS}
	if needsDocuments(cfg.Scenarios, cfg.Timings.Scenario) {
		if caps.docs = cfg.CapacityDocuments; caps.docs <= 0 {
			if caps.docs, err = g.capacity(ctx, loadgen.WorkloadDocuments, DocumentsGuess(res.CapacityRPS)); err != nil {
				return res, err
			}
		}
		res.CapacityDocumentsRPS = caps.docs
		cfg.Progress(fmt.Sprintf("capacity for documents: %.2f requests/s", caps.docs))
	}
	if res.Results, err = g.rows(ctx, caps); err != nil {
		return res, err
	}
	res.Policies = cfg.Policies
	for _, p := range cfg.Policies {
		if p.Pending != "" {
			res.Pending = append(res.Pending, p)
		}
	}
	res.Took = time.Since(start)
	return res, nil
}

type goodput struct {
	cfg GoodputConfig
	slo loadgen.SLO
}

// rowJob is one measurement: a scenario under one configuration of a
// policy with one seed.
type rowJob struct {
	sc      Scenario
	p       Policy
	spec    MonitorSpec
	router  RouterSpec
	routers int
	seed    uint64
	key     string
	label   string
	row     GoodputRow
}

// rowGroup is a row of the results: the configurations (keys) of its
// sweep, of which the best is kept.
type rowGroup struct {
	p    Policy
	keys []string
}

// plan lists the jobs of the run and the rows they make: every scenario
// under every policy that runs on it, each configuration (each value of a
// sweep) with each seed. A scenario's QueueMaxWait replaces the wait of a
// policy whose routers queue.
func (g *goodput) plan() (jobs []*rowJob, groups []rowGroup) {
	planned := map[string]bool{}
	for _, sc := range g.cfg.Scenarios {
		for _, p := range g.cfg.Policies {
			if p.Pending != "" || !runsOn(p, sc) {
				continue
			}
			decodes := []float64{0}
			if len(p.Sweep) > 0 {
				decodes = p.Sweep
			}
			rs := p.Router
			if rs.QueueMaxWait > 0 && sc.QueueMaxWait > 0 {
				rs.QueueMaxWait = sc.QueueMaxWait
			}
			for _, routers := range p.Routers {
				grp := rowGroup{p: p}
				for _, d := range decodes {
					spec := p.Monitor
					if d > 0 {
						spec.Thresholds.ActiveDecodeBlocks = events.Ptr(d)
					}
					key := fmt.Sprintf("%s/%s/%d/%+v/%v/%v", sc.Name, thresholdsText(spec.Thresholds), routers, rs, spec.SLO != nil, spec.Rescheduling)
					grp.keys = append(grp.keys, key)
					if planned[key] {
						continue
					}
					planned[key] = true
					for s := range g.cfg.Seeds {
						seed := g.cfg.Seed + uint64(s)
						jobs = append(jobs, &rowJob{sc: sc, p: p, spec: spec, router: rs, routers: routers, seed: seed, key: key,
							label: fmt.Sprintf("%s under %s (%s), %d router(s), seed %d", sc.Name, p.Name, thresholdsText(spec.Thresholds), routers, seed)})
					}
				}
				groups = append(groups, grp)
			}
		}
	}
	return jobs, groups
}

// rows measures every scenario under every policy: each configuration of
// a policy (each value of a sweep) with each seed is a job, the jobs run
// Parallel at a time, and a row is the best of its configurations, each
// the median of its seeds. A configuration two policies share
// (thresholds-best off its sweep is thresholds) is measured once.
func (g *goodput) rows(ctx context.Context, caps capacities) ([]GoodputRow, error) {
	jobs, groups := g.plan()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	next := make(chan *rowJob)
	for range max(1, g.cfg.Parallel) {
		wg.Go(func() {
			for j := range next {
				if err := g.measure(ctx, j, caps); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					cancel()
				}
			}
		})
	}
feed:
	for _, j := range jobs {
		select {
		case next <- j:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	byKey := map[string][]GoodputRow{}
	for _, j := range jobs { // in seed order
		byKey[j.key] = append(byKey[j.key], j.row)
	}
	out := []GoodputRow{}
	for _, grp := range groups {
		var best GoodputRow
		for i, key := range grp.keys {
			row := rounded(median(byKey[key]))
			row.Policy = grp.p.Name
			if i == 0 || row.GoodputRPS > best.GoodputRPS {
				best = row
			}
		}
		out = append(out, best)
	}
	return out, nil
}

// measure runs one job and keeps its row.
func (g *goodput) measure(ctx context.Context, j *rowJob, caps capacities) error {
	length := g.cfg.Timings.Scenario
	g.cfg.Progress(j.label)
	capacity := caps.chat
	rate := func(t time.Duration) float64 { return capacity * j.sc.Rate(t, length) }
	shape := loadShape{
		rate:     rate,
		workload: func(t time.Duration) loadgen.Workload { return j.sc.Workload(t, length) },
		length:   length,
		retries:  j.sc.Retries,
	}
	if j.sc.Join != nil {
		shape.join = j.sc.Join(length)
	}
	samples, run, err := g.run(ctx, j.router, j.spec, j.routers, j.seed, shape)
	if err != nil {
		return err
	}
	row := summarize(samples, 0, length, capacity)
	row.CeilingRPS = caps.ceiling(j.sc, length, 0, length)
	if row.CeilingRPS > 0 {
		row.CeilingPct = 100 * row.GoodputRPS / row.CeilingRPS
	}
	row.Scenario, row.Policy, row.Routers, row.Retries = j.sc.Name, j.p.Name, j.routers, j.sc.Retries
	row.Preemptions, row.CPUPct = run.preemptions, run.cpuPct
	if j.router.QueueMaxWait > 0 && j.routers > 1 && len(g.cfg.RouterShares) == j.routers && UnevenShares(g.cfg.RouterShares) {
		row.ByRouter = run.byRouter
	}
	if v := j.spec.Thresholds.ActiveDecodeBlocks; v != nil {
		row.Decode = *v
	}
	row.Series = series(samples, length, rate)
	for i := range row.Series {
		row.Series[i].CeilingRPS = caps.ceiling(j.sc, length, row.Series[i].T, min(length, row.Series[i].T+time.Second))
	}
	j.row = row
	g.cfg.Progress(fmt.Sprintf("%s: goodput %.2f/s (%.0f %%), rejected %.0f %%, failed %.0f %%, %.2f attempts a request, TTFT p99 %s, queue wait p99 %s, preemptions %d (set-up %v, drain %v)",
		j.label, row.GoodputRPS, row.GoodputPct, row.RejectedPct, row.FailedPct, row.AttemptsPerRequest, msText(row.TTFTp99), msText(row.QueueWaitP99), row.Preemptions,
		run.setup.Round(100*time.Millisecond), run.drain.Round(100*time.Millisecond)))
	return nil
}

// ChatGuess is the chat capacity's bisection's first guess, from the
// profile's closed-loop figure (docs/sim.md): about 2.5 chat requests/s a
// worker.
const ChatGuess = 2.5 * GoodputWorkers

// DocumentsGuess is the documents capacity's bisection's first guess
// (contract §21): the chat capacity × the mean tokens of a chat request ÷
// those of a documents request (prompt and output, the ranges' midpoints).
func DocumentsGuess(chat float64) float64 {
	mean := func(w loadgen.Workload) float64 {
		l, _ := w.Lengths()
		return float64(l.PromptMin+l.PromptMax+l.OutputMin+l.OutputMax) / 2
	}
	return chat * mean(loadgen.WorkloadChat) / mean(loadgen.WorkloadDocuments)
}

// capacities are the fleet's capacities per workload, requests/s.
type capacities struct{ chat, docs float64 }

// of returns the capacity for w.
func (c capacities) of(w loadgen.Workload) float64 {
	if w == loadgen.WorkloadDocuments {
		return c.docs
	}
	return c.chat
}

// ceilingStep is the step of the ceiling's integral.
const ceilingStep = 10 * time.Millisecond

// ceiling is what any policy could reach of sc over [from, to) of a
// scenario of length (contract §21): the mean over that time of min(the
// offered rate, the capacity for the workload offered), so a scenario's
// ceiling is the sum over its phases of min(offered, that phase's
// capacity), as a rate. 0 when to ≤ from.
func (c capacities) ceiling(sc Scenario, length, from, to time.Duration) float64 {
	if to <= from {
		return 0
	}
	sum, n := 0.0, 0
	for t := from + ceilingStep/2; t < to; t += ceilingStep {
		sum += min(c.chat*sc.Rate(t, length), c.of(sc.Workload(t, length)))
		n++
	}
	return sum / float64(max(n, 1))
}

// needsDocuments reports whether a scenario of scs offers documents over
// a length.
func needsDocuments(scs []Scenario, length time.Duration) bool {
	for _, sc := range scs {
		for t := time.Duration(0); t < length; t += ceilingStep {
			if sc.Workload(t, length) == loadgen.WorkloadDocuments {
				return true
			}
		}
	}
	return false
}

// capacity bisects, under policy none with one router and workload w,
// from guess, to the highest constant rate at which CapacityGoodFraction
// of the requests offered in the measured window are good.
func (g *goodput) capacity(ctx context.Context, w loadgen.Workload, guess float64) (float64, error) {
	t := g.cfg.Timings
	trial := func(rate float64) (bool, error) {
		g.cfg.Progress(fmt.Sprintf("capacity (%s): %.2f requests/s for %v after %v", w, rate, t.Measure, t.Warmup))
		samples, _, err := g.run(ctx, RouterSpec{}, MonitorSpec{}, 1, g.cfg.Seed, loadShape{
			rate:     func(time.Duration) float64 { return rate },
			workload: func(time.Duration) loadgen.Workload { return w },
			length:   t.Warmup + t.Measure,
		})
		if err != nil {
			return false, err
		}
		offered, good := 0, 0
		for _, s := range samples {
			if s.Offered >= t.Warmup && s.Offered < t.Warmup+t.Measure {
				offered++
				if s.Good {
					good++
				}
			}
		}
		frac := float64(good) / float64(max(offered, 1))
		g.cfg.Progress(fmt.Sprintf("  %d of %d good (%.1f %%)", good, offered, 100*frac))
		return offered > 0 && frac >= CapacityGoodFraction, nil
	}
	return bisect(trial, guess)
}

// bisect finds, from a first guess r, the highest rate at which trial
// holds, to CapacityTolerance: it brackets the rate (× 1.5 or ÷ 1.5) and
// halves the bracket until hi ≤ (1 + CapacityTolerance) × lo, and returns
// lo, the highest rate found to hold, within 5 % below the true one.
func bisect(trial func(rate float64) (bool, error), r float64) (float64, error) {
	lo, hi := 0.0, 0.0
	for lo == 0 || hi == 0 {
		ok, err := trial(r)
		if err != nil {
			return 0, err
		}
		if ok {
			lo, r = r, r*1.5
		} else {
			hi, r = r, r/1.5
		}
		if hi > 0 && hi < 0.05 {
			return 0, errors.New("bench: goodput: no rate keeps 99 % of the requests good")
		}
		if lo > 1000 {
			return 0, errors.New("bench: goodput: over 1000 requests/s keep 99 % of the requests good: the engines are not saturating")
		}
	}
	for hi/lo > 1+CapacityTolerance {
		mid := (lo + hi) / 2
		ok, err := trial(mid)
		if err != nil {
			return 0, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
}

// tries returns s's attempts: its Tries, or its one attempt when they are
// not given; none when it was dropped.
func tries(s loadgen.Sample) []loadgen.Try {
	if s.Dropped {
		return nil
	}
	if len(s.Tries) > 0 {
		return s.Tries
	}
	return []loadgen.Try{{Status: s.Result.Status}}
}

// rejection reports whether an answer of status is a rejection: 503 (every
// worker busy) or 429 (shed, or let go by a queue).
func rejection(status int) bool {
	return status == http.StatusServiceUnavailable || status == http.StatusTooManyRequests
}

// summarize computes a row's figures over the requests offered in [from,
// from+length).
func summarize(samples []loadgen.Sample, from, length time.Duration, capacity float64) GoodputRow {
	var offered, good, sent, attempts, rejected, failed int
	var ttft, tpot, wait []time.Duration
	for _, s := range samples {
		if s.Offered < from || s.Offered >= from+length {
			continue
		}
		offered++
		if s.Good {
			good++
		}
		if s.Dropped || s.Failed {
			failed++
		}
		if ts := tries(s); len(ts) > 0 {
			sent++
			attempts += len(ts)
			for _, t := range ts {
				if rejection(t.Status) {
					rejected++
				}
			}
		}
		if s.OK {
			ttft = append(ttft, s.Result.TTFT)
			if d, ok := s.Result.TPOT(); ok {
				tpot = append(tpot, d)
			}
		}
		if s.Queued {
			wait = append(wait, s.QueueWait)
		}
	}
	row := GoodputRow{GoodputRPS: float64(good) / length.Seconds()}
	if capacity > 0 {
		row.GoodputPct = 100 * row.GoodputRPS / capacity
	}
	if offered > 0 {
		row.FailedPct = 100 * float64(failed) / float64(offered)
	}
	if sent > 0 {
		row.RejectedPct = 100 * float64(rejected) / float64(attempts)
		row.AttemptsPerRequest = float64(attempts) / float64(sent)
	}
	row.TTFTp50, row.TTFTp99 = pct(ttft, 50), pct(ttft, 99)
	row.ITLp99, row.QueueWaitP99 = pct(tpot, 99), pct(wait, 99)
	return row
}

// series is a row's course, one point a second of length.
func series(samples []loadgen.Sample, length time.Duration, target func(time.Duration) float64) []Point {
	n := int(math.Ceil(length.Seconds()))
	pts := make([]Point, n)
	ttfts := make([][]time.Duration, n)
	for i := range pts {
		pts[i].T = time.Duration(i) * time.Second
		pts[i].TargetRPS = target(pts[i].T + time.Second/2)
	}
	for _, s := range samples {
		for _, t := range tries(s) {
			if k := int((s.Offered + t.At) / time.Second); k >= 0 && k < n {
				pts[k].Attempts++
				if rejection(t.Status) {
					pts[k].Rejected++
				}
			}
		}
		i := int(s.Offered / time.Second)
		if i < 0 || i >= n {
			continue
		}
		pts[i].Offered++
		if s.Good {
			pts[i].Good++
		}
		if s.OK {
			ttfts[i] = append(ttfts[i], s.Result.TTFT)
		}
	}
	for i := range pts {
		pts[i].TTFTp99 = math.NaN()
		if p := pct(ttfts[i], 99); p != nil {
			pts[i].TTFTp99 = *p
		}
	}
	return pts
}

// pct is the p-th percentile (nearest rank) of d in milliseconds, nil
// when d is empty.
func pct(d []time.Duration, p int) *float64 {
	if len(d) == 0 {
		return nil
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(math.Ceil(float64(p)/100*float64(len(s)))) - 1
	v := math.Round(ms(s[max(0, min(i, len(s)-1))])*10) / 10
	return &v
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// median returns the row whose figures are the medians of rows' (the
// series of the first).
func median(rows []GoodputRow) GoodputRow {
	if len(rows) == 1 {
		return rows[0]
	}
	out := rows[0]
	f := func(get func(GoodputRow) float64) float64 {
		v := make([]float64, len(rows))
		for i, r := range rows {
			v[i] = get(r)
		}
		slices.Sort(v)
		if len(v)%2 == 1 {
			return v[len(v)/2]
		}
		return (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	opt := func(get func(GoodputRow) *float64) *float64 {
		var v []float64
		for _, r := range rows {
			if p := get(r); p != nil {
				v = append(v, *p)
			}
		}
		if len(v) == 0 {
			return nil
		}
		slices.Sort(v)
		m := v[len(v)/2]
		if len(v)%2 == 0 {
			m = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
		return &m
	}
	out.GoodputRPS = f(func(r GoodputRow) float64 { return r.GoodputRPS })
	out.GoodputPct = f(func(r GoodputRow) float64 { return r.GoodputPct })
	out.CeilingPct = f(func(r GoodputRow) float64 { return r.CeilingPct })
	out.RejectedPct = f(func(r GoodputRow) float64 { return r.RejectedPct })
	out.FailedPct = f(func(r GoodputRow) float64 { return r.FailedPct })
	out.AttemptsPerRequest = f(func(r GoodputRow) float64 { return r.AttemptsPerRequest })
	out.CPUPct = f(func(r GoodputRow) float64 { return r.CPUPct })
	out.Preemptions = uint64(math.Round(f(func(r GoodputRow) float64 { return float64(r.Preemptions) })))
	out.TTFTp50 = opt(func(r GoodputRow) *float64 { return r.TTFTp50 })
	out.TTFTp99 = opt(func(r GoodputRow) *float64 { return r.TTFTp99 })
	out.ITLp99 = opt(func(r GoodputRow) *float64 { return r.ITLp99 })
	out.QueueWaitP99 = opt(func(r GoodputRow) *float64 { return r.QueueWaitP99 })
	out.ByRouter = nil
	for i := range rows[0].ByRouter {
		at := func(r GoodputRow) RouterRow {
			if i < len(r.ByRouter) {
				return r.ByRouter[i]
			}
			return RouterRow{}
		}
		out.ByRouter = append(out.ByRouter, RouterRow{Share: rows[0].ByRouter[i].Share,
			QueueWaitP90: opt(func(r GoodputRow) *float64 { return at(r).QueueWaitP90 }),
			RejectedPct:  f(func(r GoodputRow) float64 { return at(r).RejectedPct })})
	}
	return out
}

// rounded returns row with its rates and shares to 0.01.
func rounded(row GoodputRow) GoodputRow {
	for _, v := range []*float64{&row.GoodputRPS, &row.GoodputPct, &row.CeilingRPS, &row.CeilingPct, &row.RejectedPct, &row.FailedPct, &row.CPUPct} {
		*v = math.Round(*v*100) / 100
	}
	row.AttemptsPerRequest = math.Round(row.AttemptsPerRequest*1000) / 1000
	row.ByRouter = slices.Clone(row.ByRouter)
	for i := range row.ByRouter {
		r := &row.ByRouter[i]
		r.Share = math.Round(r.Share*1000) / 1000
		r.RejectedPct = math.Round(r.RejectedPct*100) / 100
	}
	return row
}

// thresholdsText names a policy's thresholds (and tells the
// configurations of the rows apart).
func thresholdsText(t events.Thresholds) string {
	var parts []string
	if t.ActiveDecodeBlocks != nil {
		parts = append(parts, "decode "+strconv.FormatFloat(*t.ActiveDecodeBlocks, 'g', -1, 64))
	}
	if t.ActivePrefillTokens != nil {
		parts = append(parts, "prefill "+strconv.FormatUint(*t.ActivePrefillTokens, 10))
	}
	if t.ActivePrefillTokensFrac != nil {
		parts = append(parts, "prefill frac "+strconv.FormatFloat(*t.ActivePrefillTokensFrac, 'g', -1, 64))
	}
	if t.KVCommitted != nil {
		parts = append(parts, "kv committed "+strconv.FormatFloat(*t.KVCommitted, 'g', -1, 64))
	}
	if t.QueueDelayMs != nil {
		parts = append(parts, "queue delay "+strconv.FormatUint(*t.QueueDelayMs, 10)+" ms")
	}
	if len(parts) == 0 {
		return "no thresholds"
	}
	return strings.Join(parts, " ")
}

// fleetConfig is the benchmark's fleet on natsURL.
func fleetConfig(natsURL string) sim.FleetConfig {
	c := sim.DefaultFleetConfig()
	c.Model, c.Workers, c.Ranks = GoodputModel, GoodputWorkers, 1
	c.Engine.Profile = GoodputProfile
	c.NATS.URL = natsURL
	return c
}
