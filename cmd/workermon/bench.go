package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	wmbench "github.com/workermon/workermon/bench"
	"github.com/workermon/workermon/events"
)

// benchOptions is everything `workermon bench` can be told.
type benchOptions struct {
	reports     int
	workers     int
	models      int
	flips       int
	rounds      int
	memWorkers  int
	storm       int
	stormFor    time.Duration
	jsonOut     bool
	waitTimeout time.Duration
	profileDir  string
	processes   bool
	log         logOptions
}

func defaultBenchOptions() benchOptions {
	d := wmbench.DefaultInProcessConfig()
	return benchOptions{reports: d.Reports, workers: d.Workers, models: d.Models, flips: d.Flips, rounds: d.Rounds,
		memWorkers: d.MemWorkers, storm: d.StormWorkers, stormFor: d.StormFor, waitTimeout: d.WaitTimeout,
		log: logOptions{level: "error", format: "text"}}
}

func (o *benchOptions) flags(fs *flag.FlagSet) {
	fs.IntVar(&o.reports, "reports", o.reports, "reports published for the ingest figures")
	fs.IntVar(&o.workers, "workers", o.workers, "workers the ingest reports come from")
	fs.IntVar(&o.models, "models", o.models, "models the workers serve")
	fs.IntVar(&o.flips, "flips", o.flips, "busy/free flips (and raw KV puts) timed for the latency figures")
	fs.IntVar(&o.rounds, "rounds", o.rounds, "rounds the ingest reports are sent in, each beside as many raw messages")
	fs.IntVar(&o.memWorkers, "mem-workers", o.memWorkers, "workers of 8 ranks held for the memory figure")
	fs.IntVar(&o.storm, "storm-workers", o.storm, "workers (of --models models) flipping busy/free 100 times a second in the storm")
	fs.DurationVar(&o.stormFor, "storm-for", o.stormFor, "how long the storm lasts")
	fs.BoolVar(&o.jsonOut, "json", o.jsonOut, "print the figures as one JSON object")
	fs.DurationVar(&o.waitTimeout, "timeout", o.waitTimeout, "longest wait for one phase")
	fs.StringVar(&o.profileDir, "profile", o.profileDir, "directory to write a CPU and an allocation profile of each phase to (go tool pprof)")
	fs.BoolVar(&o.processes, "processes", o.processes,
		"publisher, monitor (serve on its embedded NATS) and watcher in three processes: ingest and latency only")
	o.log.flags(fs)
}

func (o benchOptions) validate() error {
	if err := o.inProcess().Validate(); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// inProcess is the one-process run's configuration of o.
func (o benchOptions) inProcess() wmbench.InProcessConfig {
	return wmbench.InProcessConfig{Reports: o.reports, Workers: o.workers, Models: o.models, Flips: o.flips, Rounds: o.rounds,
		MemWorkers: o.memWorkers, StormWorkers: o.storm, StormFor: o.stormFor, WaitTimeout: o.waitTimeout, ProfileDir: o.profileDir}
}

// runBench is `workermon bench`: an embedded NATS server and the monitor in
// this process, measured side by side with the raw NATS limits.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == benchChildFlag {
		// A profiled monitor: `serve` and its flags after "--".
		return wmbench.RunChild(ctx, args[1:], os.Stdin, stdout, stderr, func(ctx context.Context, args []string) error {
			if len(args) == 0 || args[0] != "serve" {
				return fmt.Errorf("%w: bench: the monitor child runs serve, not %q", errUsage, args)
			}
			return runServe(ctx, args[1:], stdout, stderr)
		})
	}
	if len(args) > 0 && args[0] == "goodput" {
		return runBenchGoodput(ctx, args[1:], stdout, stderr)
	}
	o := defaultBenchOptions()
	log, check, err := parseCommand("bench", args, stderr, nil, o.flags, &o.log)
	if err != nil {
		return err
	}
	if err := o.validate(); err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	if o.processes {
		return runBenchProcesses(ctx, o, stdout, stderr)
	}
	cfg := o.inProcess()
	cfg.Log, cfg.Progress = log, func(msg string) { fmt.Fprintf(stderr, "bench: %s\n", msg) }
	cfg.StartMonitor = func(ctx context.Context) (wmbench.InProcessMonitor, error) {
		dir, err := os.MkdirTemp("", "workermon-bench-")
		if err != nil {
			return nil, err
		}
		so := defaultServeOptions()
		so.embedded.Addr, so.embedded.DataDir, so.httpAddr = "127.0.0.1:0", dir, "127.0.0.1:0"
		so.writer.Warmup = 0
		so.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
		svc, err := startService(ctx, so, log, newRegistry())
		if err != nil {
			return nil, errors.Join(err, os.RemoveAll(dir))
		}
		return inProcessMonitor{svc: svc, dir: dir, heartbeat: so.writer.Heartbeat}, nil
	}
	res, err := wmbench.InProcess(ctx, cfg)
	if err != nil {
		return err
	}
	return printBench(stdout, o.jsonOut, res, wmbench.PrintInProcess)
}

// inProcessMonitor is the monitor of `workermon bench` (one process).
type inProcessMonitor struct {
	svc       *service
	dir       string
	heartbeat time.Duration
}

func (m inProcessMonitor) NATSURL() string               { return m.svc.natsURL }
func (m inProcessMonitor) Gatherer() prometheus.Gatherer { return m.svc.reg }
func (m inProcessMonitor) Settled() <-chan struct{}      { return m.svc.leaser.Settled() }
func (m inProcessMonitor) Heartbeat() time.Duration      { return m.heartbeat }
func (m inProcessMonitor) Close(ctx context.Context) error {
	return errors.Join(m.svc.Close(ctx), os.RemoveAll(m.dir))
}

// benchChildFlag, first, makes `workermon bench` a child process of
// `workermon bench --processes` (bench.RunChild).
const benchChildFlag = "--child"

// runBenchProcesses is `workermon bench --processes`: this binary run as
// the publisher, the monitor and the watcher.
func runBenchProcesses(ctx context.Context, o benchOptions, stdout, stderr io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	cfg := wmbench.DefaultConfig()
	cfg.Executable, cfg.Child = exe, []string{"bench", benchChildFlag}
	cfg.Serve = func(dataDir string) []string {
		return []string{"serve", "--embedded-nats-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--data-dir", dataDir,
			"--warmup", "0", "--active-decode-blocks-threshold", "0.5", "--log-level", "error"}
	}
	cfg.Reports, cfg.Workers, cfg.Models, cfg.Rounds, cfg.Flips = o.reports, o.workers, o.models, o.rounds, o.flips
	cfg.WaitTimeout, cfg.ProfileDir, cfg.Stderr = o.waitTimeout, o.profileDir, stderr
	cfg.Progress = func(msg string) { fmt.Fprintf(stderr, "bench: %s\n", msg) }
	res, err := wmbench.Run(ctx, cfg)
	if err != nil {
		return err
	}
	return printBench(stdout, o.jsonOut, res, wmbench.Print)
}

// printBench writes a benchmark's result to w: as indented JSON with
// asJSON, else as text prints it.
func printBench[R any](w io.Writer, asJSON bool, res R, text func(io.Writer, R)) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	text(w, res)
	return nil
}
