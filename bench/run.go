package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/internal/kvbucket"
)

// Run starts the monitor, the publisher and the watcher as processes of
// their own and measures, in turns with their raw limits in the same
// topology: the ingest (cfg.Reports reports in cfg.Rounds rounds, each
// beside as many raw messages from the publisher process to a counting
// subscriber in the watcher process) and the report → record latency
// (cfg.Flips busy/free flips, each beside a raw KV put in the publisher
// process seen by a watcher in the watcher process).
func Run(ctx context.Context, cfg Config) (Result, error) {
	res := Result{Cores: runtime.NumCPU(), Reports: cfg.Reports, IngestRounds: cfg.Rounds, Flips: cfg.Flips}
	if err := cfg.Validate(); err != nil {
		return res, err
	}
	progress := cfg.Progress
	if progress == nil {
		progress = func(string) {}
	}
	if cfg.Stderr == nil {
		cfg.Stderr = io.Discard
	}
	dir, err := os.MkdirTemp("", "workermon-bench-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	if cfg.ProfileDir != "" {
		if err := os.MkdirAll(cfg.ProfileDir, 0o755); err != nil {
			return res, fmt.Errorf("bench: profile: %w", err)
		}
	}
	profile := func(role string) string {
		if cfg.ProfileDir == "" {
			return ""
		}
		return filepath.Join(cfg.ProfileDir, role+".cpu.pprof")
	}

	progress("starting the monitor: workermon serve on its embedded NATS server")
	monArgs := cfg.Serve(filepath.Join(dir, "data"))
	if p := profile(roleMonitor); p != "" {
		monArgs = append(append(slices.Clone(cfg.Child), "--role", roleMonitor, "--cpuprofile", p, "--"), monArgs...)
	}
	mon, err := start(ctx, cfg, roleMonitor, monArgs)
	if err != nil {
		return res, err
	}
	defer mon.stop()
	line, err := mon.line(cfg.WaitTimeout)
	if err != nil {
		return res, fmt.Errorf("%w: monitor: %w", ErrChild, err)
	}
	natsURL, apiURL, err := parseServeLine(line)
	if err != nil {
		return res, err
	}
	if err := waitReady(ctx, apiURL+"/readyz", cfg.WaitTimeout); err != nil {
		return res, err
	}
	nc, err := nats.Connect(natsURL, nats.Name("workermon-bench"))
	if err != nil {
		return res, err
	}
	defer nc.Close()
	res.NATSVersion = nc.ConnectedServerVersion()
	js, err := jetstream.New(nc)
	if err != nil {
		return res, err
	}
	if _, err := kvbucket.Open(ctx, js, rawBucket, 1); err != nil {
		return res, err
	}
	progress(fmt.Sprintf("monitor ready: nats-server %s at %s, API %s", res.NATSVersion, natsURL, apiURL))

	co := childOptions{natsURL: natsURL, reports: cfg.Reports, workers: cfg.Workers, models: cfg.Models}
	procs := map[string]*proc{}
	for _, role := range []string{rolePublisher, roleWatcher} {
		o := co
		o.role, o.cpuProfile = role, profile(role)
		p, err := start(ctx, cfg, role, append(slices.Clone(cfg.Child), o.args()...))
		if err != nil {
			return res, err
		}
		defer p.stop()
		if line, err := p.line(cfg.WaitTimeout); err != nil || line != "ready" {
			return res, fmt.Errorf("%w: %s did not start: %q %v", ErrChild, role, line, err)
		}
		procs[role] = p
	}
	r := &runner{cfg: cfg, pub: procs[rolePublisher], watch: procs[roleWatcher], mon: mon, metricsURL: apiURL + "/metrics"}
	progress(fmt.Sprintf("ingest: %d reports from %d workers of %d models, in %d rounds beside as many raw messages",
		cfg.Reports, cfg.Workers, cfg.Models, cfg.Rounds))
	if err := r.ingest(ctx, &res); err != nil {
		return res, err
	}
	progress(fmt.Sprintf("latency: %d busy/free flips timed from report to record, each beside a raw KV put", cfg.Flips))
	if err := r.latency(&res); err != nil {
		return res, err
	}
	// Stop in order, so that each profile is written.
	for _, p := range []*proc{r.pub, r.watch, mon} {
		if err := p.stop(); err != nil {
			return res, err
		}
	}
	return res, nil
}

// runner drives the publisher and the watcher.
type runner struct {
	cfg             Config
	pub, watch, mon *proc
	metricsURL      string
	sentinels       int
}

// timed arms the watcher with arm, runs cmd on the publisher and returns
// the time from the publisher's start to the watcher's sight.
func (r *runner) timed(arm, cmd string) (time.Duration, error) {
	if _, err := r.watch.call(arm, r.cfg.WaitTimeout); err != nil {
		return 0, err
	}
	start, err := r.pub.call(cmd, r.cfg.WaitTimeout)
	if err != nil {
		return 0, err
	}
	seen, err := r.watch.call("wait", r.cfg.WaitTimeout)
	if err != nil {
		return 0, err
	}
	return time.Duration(seen - start), nil
}

// ingest runs the rounds: each its raw messages, then its reports and a
// sentinel report, whose record in the bucket ends the round (one
// subscription keeps their order, so every report before it is applied).
func (r *runner) ingest(ctx context.Context, res *Result) error {
	before, err := scrape(ctx, r.metricsURL, "workermon_reports_accepted_total")
	if err != nil {
		return err
	}
	var rawTook, took time.Duration
	var rawCPU, cpu [3]time.Duration // publisher, monitor, watcher
	procs := [3]*proc{r.pub, r.mon, r.watch}
	cpuTimes := func() (t [3]time.Duration) {
		for i, p := range procs {
			t[i] = processCPU(p.cmd.Process.Pid)
		}
		return t
	}
	res.IngestRatioMin, res.IngestRatioMax = math.Inf(1), 0
	for round := range r.cfg.Rounds {
		lo, hi := round*r.cfg.Reports/r.cfg.Rounds, (round+1)*r.cfg.Reports/r.cfg.Rounds
		c0 := cpuTimes()
		raw, err := r.timed(fmt.Sprintf("count %d", hi), fmt.Sprintf("raw %d %d", lo, hi))
		if err != nil {
			return fmt.Errorf("bench: raw ingest: %w", err)
		}
		c1 := cpuTimes()
		r.sentinels++
		wm, err := r.timed(fmt.Sprintf("sentinel %d", r.sentinels), fmt.Sprintf("reports %d %d %d", lo, hi, r.sentinels))
		if err != nil {
			return fmt.Errorf("bench: ingest: %w", err)
		}
		c2 := cpuTimes()
		for i := range procs {
			rawCPU[i] += c1[i] - c0[i]
			cpu[i] += c2[i] - c1[i]
		}
		rawTook, took = rawTook+raw, took+wm
		ratio := raw.Seconds() / wm.Seconds()
		res.IngestRatioMin, res.IngestRatioMax = min(res.IngestRatioMin, ratio), max(res.IngestRatioMax, ratio)
	}
	res.RawIngest = float64(r.cfg.Reports) / rawTook.Seconds()
	res.Ingest = float64(r.cfg.Reports) / took.Seconds()
	res.IngestRatio = res.Ingest / res.RawIngest
	perMsg := func(d [3]time.Duration) (each [3]float64, sum float64) {
		for i := range d {
			each[i] = float64(d[i].Nanoseconds()) / 1e3 / float64(r.cfg.Reports)
			sum += each[i]
		}
		return each, sum
	}
	res.RawIngestCPUEach, res.RawIngestCPU = perMsg(rawCPU)
	res.IngestCPUEach, res.IngestCPU = perMsg(cpu)
	after, err := scrape(ctx, r.metricsURL, "workermon_reports_accepted_total")
	if err != nil {
		return err
	}
	res.IngestLost = r.cfg.Reports + r.cfg.Rounds - int(after-before)
	res.MonitorRSSMB = processRSSMB(r.mon.cmd.Process.Pid)
	return nil
}

// latency times the flips, each right after its raw KV put.
func (r *runner) latency(res *Result) error {
	rawTook := make([]time.Duration, 0, r.cfg.Flips)
	took := make([]time.Duration, 0, r.cfg.Flips)
	for i := range r.cfg.Flips + 1 {
		if i > 0 { // the first flip creates the record: untimed
			d, err := r.timed(fmt.Sprintf("rawkv %d", i), fmt.Sprintf("put %d", i))
			if err != nil {
				return fmt.Errorf("bench: raw put: %w", err)
			}
			rawTook = append(rawTook, d)
		}
		busy := 0
		if i%2 == 0 {
			busy = 1
		}
		d, err := r.timed(fmt.Sprintf("flip %d", busy), fmt.Sprintf("flip %d %d", i, busy))
		if err != nil {
			return fmt.Errorf("bench: flip: %w", err)
		}
		if i > 0 {
			took = append(took, d)
		}
	}
	res.RawP50, res.RawP99 = percentileUS(rawTook, 50), percentileUS(rawTook, 99)
	res.P50, res.P99 = percentileUS(took, 50), percentileUS(took, 99)
	return nil
}

func percentileUS(d []time.Duration, p int) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, len(s)*p/100)].Nanoseconds()) / 1e3
}

// Print writes the figures as a table: workermon beside the raw limit, and
// their ratio or difference.
func Print(w io.Writer, r Result) {
	fmt.Fprintf(w, "workermon bench --processes: %d cores, nats-server %s embedded in `workermon serve`;\n", r.Cores, r.NATSVersion)
	fmt.Fprintf(w, "publisher, monitor and watcher in three processes\n\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\traw limit\tworkermon\tratio / delta")
	fmt.Fprintf(tw, "ingest (%d reports, %d rounds)\t%.0f msgs/s\t%.0f reports/s\t%.0f %% of raw (rounds %.0f–%.0f %%), %d lost\n",
		r.Reports, r.IngestRounds, r.RawIngest, r.Ingest, 100*r.IngestRatio, 100*r.IngestRatioMin, 100*r.IngestRatioMax, r.IngestLost)
	fmt.Fprintf(tw, "ingest, CPU time per message (3 processes)\t%.2f µs\t%.2f µs\t%.0f %% of raw; the monitor's process %.2f µs (raw part: %.2f µs)\n",
		r.RawIngestCPU, r.IngestCPU, 100*r.RawIngestCPU/max(r.IngestCPU, 1e-9), r.IngestCPUEach[1], r.RawIngestCPUEach[1])
	fmt.Fprintf(tw, "monitor process after the ingest\t—\t%.0f MB RSS\t\n", r.MonitorRSSMB)
	fmt.Fprintf(tw, "report → record seen, p50 (%d flips)\t%.0f µs\t%.0f µs\t%+.0f µs\n", r.Flips, r.RawP50, r.P50, r.P50-r.RawP50)
	fmt.Fprintf(tw, "report → record seen, p99\t%.0f µs\t%.0f µs\t%+.0f µs\n", r.RawP99, r.P99, r.P99-r.RawP99)
	_ = tw.Flush()
	fmt.Fprintln(w, "\nraw limit: the same server, measured in turns with workermon: raw messages from the publisher process")
	fmt.Fprintln(w, "to a counting subscriber in the watcher process; a KV put in the publisher process seen by a watcher")
	fmt.Fprintln(w, "in the watcher process.")
}
