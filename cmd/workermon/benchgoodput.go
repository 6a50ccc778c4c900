package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	wmbench "github.com/workermon/workermon/bench"
)

// benchGoodputOptions is everything `workermon bench goodput` can be told.
type benchGoodputOptions struct {
	quick     bool
	jsonOut   bool
	reportDir string
	seeds     int
	seed      uint64
	log       logOptions
}

func (o *benchGoodputOptions) flags(fs *flag.FlagSet) {
	fs.BoolVar(&o.quick, "quick", false, "shorter windows (8 s after 3 s for the capacity, 12 s scenarios), thresholds-best on ramp and shift only: within 8 minutes on 2 cores")
	fs.BoolVar(&o.jsonOut, "json", false, "print the figures as one JSON object")
	fs.StringVar(&o.reportDir, "report", "", "directory to write report.html to: offered load, goodput, TTFT p99 and rejections over time, per scenario and policy")
	fs.IntVar(&o.seeds, "seeds", 1, "run each row this many times (seeds --seed, --seed+1, ...) and report the medians")
	fs.Uint64Var(&o.seed, "seed", wmbench.DefaultGoodputSeed, "seed of the Poisson arrivals and of the requests' lengths")
	o.log.flags(fs)
}

// runBenchGoodput is `workermon bench goodput`.
func runBenchGoodput(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := benchGoodputOptions{seeds: 1, log: logOptions{level: "error", format: "text"}}
	log, check, err := parseCommand("bench goodput", args, stderr, nil, o.flags, &o.log)
	if err != nil {
		return err
	}
	if o.seeds < 1 {
		err = fmt.Errorf("%w: --seeds %d must be at least 1", errUsage, o.seeds)
	}
	if err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	res, err := wmbench.Goodput(ctx, wmbench.GoodputConfig{
		Stack: goodputStack{log: log}, Quick: o.quick, Seeds: o.seeds, Seed: o.seed, Log: log,
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
	so.monitor.Defaults = spec.Thresholds
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
	return m, nil
}

func (s goodputStack) StartRouter(_ context.Context, spec wmbench.RouterSpec) (wmbench.Router, error) {
	ro := defaultRouterOptions()
	ro.natsURL, ro.httpAddr, ro.router.RouterID = spec.NATSURL, "127.0.0.1:0", spec.ID
	svc, err := startRouter(ro, s.log.With("part", "router", "router_id", spec.ID), newRegistry())
	if err != nil {
		return nil, err
	}
	return goodputRouter{svc}, nil
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
