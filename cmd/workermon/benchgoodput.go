package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	wmbench "github.com/workermon/workermon/bench"
	"github.com/workermon/workermon/resched"
)

// benchGoodputOptions is everything `workermon bench goodput` can be told.
type benchGoodputOptions struct {
	quick     bool
	jsonOut   bool
	reportDir string
	seeds     int
	seed      uint64
	policies  string
	scenarios string
	capacity  float64
	capDocs   float64
	shares    string
	parallel  int
	log       logOptions
}

func (o *benchGoodputOptions) flags(fs *flag.FlagSet) {
	fs.BoolVar(&o.quick, "quick", false, "shorter windows (8 s after 3 s for the capacities, 12 s scenarios), thresholds-best on ramp and shift only: within 10 minutes on 2 cores")
	fs.BoolVar(&o.jsonOut, "json", false, "print the figures as one JSON object")
	fs.StringVar(&o.reportDir, "report", "", "directory to write report.html to: offered load, goodput, TTFT p99, rejections and (where clients retry) attempts over time, per scenario and policy")
	fs.IntVar(&o.seeds, "seeds", 1, "run each row this many times (seeds --seed, --seed+1, ...) and report the medians")
	fs.Uint64Var(&o.seed, "seed", wmbench.DefaultGoodputSeed, "seed of the Poisson arrivals and of the requests' lengths")
	fs.StringVar(&o.policies, "policies", "", "run only these policies, comma-separated (none, thresholds, thresholds-best, queue, slo, committed, resched; default all)")
	fs.StringVar(&o.scenarios, "scenarios", "", "run only these scenarios, comma-separated (ramp, burst, shift, spike, scaleout; default all)")
	fs.StringVar(&o.shares, "router-shares", "", fmt.Sprintf("split the load of the %d-router rows in these proportions, comma-separated, e.g. 60,30,10 (default even); the queue rows then give each router's queue-wait p90 and rejected share", wmbench.MultiRouters))
	fs.IntVar(&o.parallel, "parallel", wmbench.DefaultParallel, "rows measured at once, each with its own monitor, fleet and routers (the capacity's trials run one at a time)")
	fs.Float64Var(&o.capacity, "capacity", 0, "take this capacity (requests/s) instead of measuring it, e.g. a full run's, to repeat some rows (0: measure it)")
	fs.Float64Var(&o.capDocs, "capacity-documents", 0, "take this capacity for the documents workload (requests/s) instead of measuring it (0: measure it when a scenario offers documents, from the chat capacity × 480 ÷ 4256 tokens)")
	o.log.flags(fs)
}

// runBenchGoodput is `workermon bench goodput`.
func runBenchGoodput(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := benchGoodputOptions{seeds: 1, parallel: wmbench.DefaultParallel, log: logOptions{level: "error", format: "text"}}
	log, check, err := parseCommand("bench goodput", args, stderr, nil, o.flags, &o.log)
	if err != nil {
		return err
	}
	if o.seeds < 1 {
		err = fmt.Errorf("%w: --seeds %d must be at least 1", errUsage, o.seeds)
	}
	if o.parallel < 1 {
		err = errors.Join(err, fmt.Errorf("%w: --parallel %d must be at least 1", errUsage, o.parallel))
	}
	if !(o.capacity >= 0) || math.IsInf(o.capacity, 0) {
		err = errors.Join(err, fmt.Errorf("%w: --capacity %v must be a positive rate, or 0 to measure it", errUsage, o.capacity))
	}
	if !(o.capDocs >= 0) || math.IsInf(o.capDocs, 0) {
		err = errors.Join(err, fmt.Errorf("%w: --capacity-documents %v must be a positive rate, or 0 to measure it", errUsage, o.capDocs))
	}
	shares, sherr := parseShares(o.shares)
	if sherr != nil {
		err = errors.Join(err, fmt.Errorf("%w: --router-shares %q: %w", errUsage, o.shares, sherr))
	}
	policies, perr := wmbench.SelectPolicies(o.quick, splitList(o.policies))
	if perr != nil {
		err = errors.Join(err, fmt.Errorf("%w: --policies: %w", errUsage, perr))
	}
	scenarios, serr := wmbench.SelectScenarios(splitList(o.scenarios))
	if serr != nil {
		err = errors.Join(err, fmt.Errorf("%w: --scenarios: %w", errUsage, serr))
	}
	if err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	res, err := wmbench.Goodput(ctx, wmbench.GoodputConfig{
		Stack: goodputStack{log: log}, Quick: o.quick, Seeds: o.seeds, Seed: o.seed, Log: log,
		Policies: policies, Scenarios: scenarios, Capacity: o.capacity, CapacityDocuments: o.capDocs, Parallel: o.parallel, RouterShares: shares,
		Progress: func(msg string) { fmt.Fprintf(stderr, "bench: %s\n", msg) },
	})
	if err != nil {
		return err
	}
	if o.reportDir != "" {
		path, err := wmbench.WriteReport(o.reportDir, res)
		if err != nil {
			return err
		}
		fmt.Fprintf(stderr, "bench: report written to %s\n", path)
	}
	return printBench(stdout, o.jsonOut, res, wmbench.PrintGoodput)
}

// goodputLeaseTTL is the --lease-ttl of the benchmark's monitors.
const goodputLeaseTTL = time.Second

// goodputStack starts the goodput benchmark's monitor and routers as
// `workermon serve` and `workermon router` run them.
type goodputStack struct{ log *slog.Logger }

func (s goodputStack) StartMonitor(ctx context.Context, spec wmbench.MonitorSpec) (wmbench.Monitor, error) {
	dir, err := os.MkdirTemp("", "workermon-goodput-")
	if err != nil {
		return nil, err
	}
	so := defaultServeOptions()
	so.embedded.Addr, so.embedded.DataDir, so.httpAddr = "127.0.0.1:0", dir, "127.0.0.1:0"
	so.writer.Warmup = 0
	// The row's monitor is alone on its own NATS server: it takes its
	// partitions one lease TTL after its start, with no other monitor to
	// wait for, so a short TTL shortens every row's set-up (3 s to 1 s).
	so.leaseTTL = goodputLeaseTTL
	so.monitor.Defaults = spec.Thresholds
	if spec.SLOInterval > 0 {
		so.slo.interval = spec.SLOInterval
	}
	if spec.SLOPrefillMin > 0 && spec.SLOPrefillMax > 0 {
		so.slo.prefill = uintRange{spec.SLOPrefillMin, spec.SLOPrefillMax}
	}
	if spec.Rescheduling > 0 {
		// The values docs/rescheduler.md recommends for a round this
		// often; contract §12's defaults move one request per 10 s.
		so.resched.interval, so.resched.planner = spec.Rescheduling, resched.RecommendedConfig()
	}
	svc, err := startService(ctx, so, s.log.With("part", "monitor"), newRegistry())
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(dir))
	}
	m := &goodputMonitor{svc: svc, dir: dir}
	select {
	case <-svc.leaser.Settled():
	case <-time.After(time.Minute):
		return nil, errors.Join(errors.New("bench: the monitor did not take its partitions"), m.Close(context.WithoutCancel(ctx)))
	case <-ctx.Done():
		return nil, errors.Join(ctx.Err(), m.Close(context.WithoutCancel(ctx)))
	}
	if spec.SLO != nil {
		if err := postGoodputSLO(ctx, "http://"+svc.httpAddr, *spec.SLO); err != nil {
			return nil, errors.Join(err, m.Close(context.WithoutCancel(ctx)))
		}
	}
	return m, nil
}

// postGoodputSLO sets the benchmark model's SLO through the monitor's API,
// as `workermon slo set` does.
func postGoodputSLO(ctx context.Context, base string, spec wmbench.SLOSpec) error {
	body := map[string]any{"model": wmbench.GoodputModel, "percentile": spec.Percentile, "mode": "enforce"}
	if spec.TTFT > 0 {
		body["ttft_ms"] = float64(spec.TTFT) / float64(time.Millisecond)
	}
	if spec.ITL > 0 {
		body["itl_ms"] = float64(spec.ITL) / float64(time.Millisecond)
	}
	data, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/slo", bytes.NewReader(data))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("bench: set the SLO: %w", err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("bench: set the SLO: %s: %s", resp.Status, bytes.TrimSpace(msg))
	}
	return nil
}

func (s goodputStack) StartRouter(_ context.Context, spec wmbench.RouterSpec) (wmbench.Router, error) {
	ro := goodputRouterOptions(spec)
	svc, err := startRouter(ro, s.log.With("part", "router", "router_id", spec.ID), newRegistry())
	if err != nil {
		return nil, err
	}
	return goodputRouter{svc}, nil
}

// goodputRouterOptions are the options of a benchmark router as spec
// configures it.
func goodputRouterOptions(spec wmbench.RouterSpec) routerOptions {
	ro := defaultRouterOptions()
	ro.natsURL, ro.httpAddr, ro.router.RouterID = spec.NATSURL, "127.0.0.1:0", spec.ID
	if spec.QueueMaxWait > 0 {
		ro.router.QueueMaxWait = spec.QueueMaxWait
	}
	if spec.QueueMaxRequests > 0 {
		ro.router.QueueMaxRequests = spec.QueueMaxRequests
	}
	if spec.QueuePace > 0 {
		ro.router.QueuePace = spec.QueuePace
	}
	if spec.MigrationLimit > 0 {
		ro.router.MigrationLimit = spec.MigrationLimit
	}
	return ro
}

type goodputMonitor struct {
	svc *service
	dir string
}

func (m *goodputMonitor) NATSURL() string { return m.svc.natsURL }

func (m *goodputMonitor) Close(ctx context.Context) error {
	return errors.Join(m.svc.Close(ctx), os.RemoveAll(m.dir))
}

type goodputRouter struct{ svc *routerService }

func (r goodputRouter) URL() string                     { return "http://" + r.svc.httpAddr }
func (r goodputRouter) Close(ctx context.Context) error { return r.svc.Close(ctx) }

// parseShares parses --router-shares: one positive number per router of
// the multi-router rows; nil when s is empty.
func parseShares(s string) ([]float64, error) {
	items := splitList(s)
	if len(items) == 0 {
		return nil, nil
	}
	if len(items) != wmbench.MultiRouters {
		return nil, fmt.Errorf("want %d shares, one per router, got %d", wmbench.MultiRouters, len(items))
	}
	out := make([]float64, len(items))
	for i, it := range items {
		v, err := strconv.ParseFloat(it, 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("share %q is not a positive number", it)
		}
		out[i] = v
	}
	return out, nil
}

// splitList splits a comma-separated flag value, dropping empty items and
// spaces.
func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
