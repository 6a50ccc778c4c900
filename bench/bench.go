// Package bench holds the benchmarks of `workermon bench`; cmd/workermon
// only parses their flags and hands them the monitor and the routers it
// builds.
//
// [InProcess] measures everything in one process: an embedded NATS server
// and the monitor, the ingest, the report → record latency, a storm of
// flips, the memory per rank and the router's admission decision, each
// beside its raw NATS limit.
//
// [Goodput] measures goodput under overload (contract §16): a fleet of
// simulated engines of the `tiny` profile, the routers and a load
// generator, the capacity by bisection, then each scenario (ramp, burst,
// shift) under each admission policy; [WriteReport] draws the runs over
// time in a self-contained HTML page.
//
// [Run] measures workermon in the shape it is deployed in: the
// engine's publisher, the monitor (`workermon serve` on its embedded NATS
// server) and a watcher of the busy bucket, each in a process of its own,
// every figure beside the raw NATS limit measured in the same topology (a
// raw publisher process to a subscriber process; a KV put in one process
// seen by a watcher in another), in turns with workermon's so that both
// see the same load of a shared machine.
//
// [Run] is the parent: it re-executes the workermon binary as the three
// processes and drives them. [RunChild] is the publisher's and the
// watcher's side (and, when profiled, a wrapper around the monitor). The
// parent and its children talk over the children's stdin and stdout, one
// line a command and one line a reply, never over NATS.
package bench

import (
	"errors"
	"fmt"
	"io"
	"time"
)

// Defaults of a run.
const (
	// DefaultReports is how many reports the ingest publishes.
	DefaultReports = 100_000
	// DefaultWorkers is how many workers the ingest reports come from.
	DefaultWorkers = 1_000
	// DefaultModels is how many models those workers serve.
	DefaultModels = 10
	// DefaultRounds is how many rounds the ingest is sent in, each beside
	// as many raw messages.
	DefaultRounds = 5
	// DefaultFlips is how many busy/free flips the latency times.
	DefaultFlips = 200
	// DefaultWaitTimeout bounds the wait for one step.
	DefaultWaitTimeout = 2 * time.Minute
)

// Sentinel errors.
var (
	// ErrInvalidConfig: Validate found a problem in a Config.
	ErrInvalidConfig = errors.New("bench: invalid config")
	// ErrChild: a child process failed or answered out of turn.
	ErrChild = errors.New("bench: child process")
)

// Config is one run of the three-process benchmark.
type Config struct {
	// Executable is the workermon binary the processes run.
	Executable string
	// Child is the arguments that make Executable run RunChild (the
	// child's own flags follow), e.g. ["bench", "--child"].
	Child []string
	// Serve returns the arguments that make Executable run the monitor on
	// its embedded NATS server as users run it, storing under dataDir,
	// listening on free loopback ports, and printing its NATS and API
	// addresses on stdout as `workermon serve` does.
	Serve func(dataDir string) []string

	Reports, Workers, Models, Rounds, Flips int
	// WaitTimeout bounds the wait for one step (a process to start, a
	// round, a flip).
	WaitTimeout time.Duration
	// ProfileDir, when not empty, is where each process writes a CPU
	// profile of its life: monitor.cpu.pprof, publisher.cpu.pprof,
	// watcher.cpu.pprof.
	ProfileDir string
	// Stderr receives the processes' own stderr (their logs).
	Stderr io.Writer
	// Progress, when not nil, is told each phase.
	Progress func(string)
}

// DefaultConfig returns the default sizes; Executable, Child and Serve are
// the caller's.
func DefaultConfig() Config {
	return Config{Reports: DefaultReports, Workers: DefaultWorkers, Models: DefaultModels, Rounds: DefaultRounds,
		Flips: DefaultFlips, WaitTimeout: DefaultWaitTimeout, Stderr: io.Discard}
}

// Validate reports every problem of c, joined.
func (c Config) Validate() error {
	var errs []error
	if c.Executable == "" {
		errs = append(errs, errors.New("no executable"))
	}
	if c.Serve == nil {
		errs = append(errs, errors.New("no serve command"))
	}
	for _, f := range []struct {
		name   string
		v, min int
	}{{"reports", c.Reports, 1}, {"workers", c.Workers, 1}, {"models", c.Models, 1}, {"rounds", c.Rounds, 1}, {"flips", c.Flips, 2}} {
		if f.v < f.min {
			errs = append(errs, fmt.Errorf("%s %d must be at least %d", f.name, f.v, f.min))
		}
	}
	if c.Rounds > c.Reports {
		errs = append(errs, fmt.Errorf("rounds %d must be at most reports %d", c.Rounds, c.Reports))
	}
	if c.Workers > c.Models*4096 {
		errs = append(errs, errors.New("at most 4096 workers per model (the monitor's default cap)"))
	}
	if c.WaitTimeout <= 0 {
		errs = append(errs, fmt.Errorf("wait timeout %v must be positive", c.WaitTimeout))
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, errors.Join(errs...))
	}
	return nil
}

// Result is what a run measures; times in microseconds.
type Result struct {
	Cores          int     `json:"cores"`
	NATSVersion    string  `json:"nats_server_version"`
	Reports        int     `json:"reports"`
	IngestRounds   int     `json:"ingest_rounds"`
	RawIngest      float64 `json:"raw_ingest_msgs_per_s"`
	Ingest         float64 `json:"ingest_reports_per_s"`
	IngestRatio    float64 `json:"ingest_ratio"`
	IngestRatioMin float64 `json:"ingest_ratio_min"`
	IngestRatioMax float64 `json:"ingest_ratio_max"`
	IngestLost     int     `json:"ingest_lost"`
	// CPU time per message of the three processes together, and of each:
	// the publisher, the monitor (NATS server included) and the watcher
	// (Linux; 0 elsewhere).
	RawIngestCPU     float64    `json:"raw_ingest_cpu_us_per_msg"`
	IngestCPU        float64    `json:"ingest_cpu_us_per_report"`
	RawIngestCPUEach [3]float64 `json:"raw_ingest_cpu_us_per_msg_each"`
	IngestCPUEach    [3]float64 `json:"ingest_cpu_us_per_report_each"`
	// MonitorRSSMB is the monitor process's resident set after the
	// ingest (Linux; 0 elsewhere).
	MonitorRSSMB float64 `json:"monitor_rss_mb"`
	Flips        int     `json:"flips"`
	RawP50       float64 `json:"raw_kv_put_to_watch_p50_us"`
	RawP99       float64 `json:"raw_kv_put_to_watch_p99_us"`
	P50          float64 `json:"report_to_record_p50_us"`
	P99          float64 `json:"report_to_record_p99_us"`
}
