package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/internal/kvbucket"
)

// stopTimeout bounds a child's clean exit before it is killed.
const stopTimeout = 15 * time.Second

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

// serveLine is what `workermon serve` prints on stdout once it runs.
var serveLine = regexp.MustCompile(`NATS (nats://\S+), API (http://\S+),`)

func parseServeLine(line string) (natsURL, apiURL string, err error) {
	m := serveLine.FindStringSubmatch(line)
	if m == nil {
		return "", "", fmt.Errorf("%w: the monitor printed %q, not its addresses", ErrChild, line)
	}
	return m[1], m[2], nil
}

// waitReady polls url until it answers 200.
func waitReady(ctx context.Context, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: the monitor was not ready within %v", ErrChild, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// scrape returns the sum of the samples of metric on a Prometheus text page.
func scrape(ctx context.Context, url, metric string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, fmt.Errorf("bench: metrics: %w", err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, metric)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		fields := strings.Fields(rest[strings.LastIndexByte(rest, '}')+1:])
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			return 0, fmt.Errorf("bench: metrics: %q: %w", line, err)
		}
		sum += v
	}
	return sum, sc.Err()
}

// proc is a child process and its command pipe.
type proc struct {
	role  string
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	done  chan struct{}
	err   error // of Wait, once done is closed
}

func start(ctx context.Context, cfg Config, role string, args []string) (*proc, error) {
	cmd := exec.Command(cfg.Executable, args...)
	cmd.Stderr = cfg.Stderr
	cmd.SysProcAttr = sysProcAttr()
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrChild, role, err)
	}
	p := &proc{role: role, cmd: cmd, in: in, lines: make(chan string, 16), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	go func() { // a cancelled run stops its children
		select {
		case <-ctx.Done():
			_ = cmd.Process.Signal(syscall.SIGTERM)
		case <-p.done:
		}
	}()
	return p, nil
}

// line returns the next line the child writes.
func (p *proc) line(timeout time.Duration) (string, error) {
	select {
	case l, ok := <-p.lines:
		if !ok {
			<-p.done
			return "", fmt.Errorf("%s exited: %v", p.role, p.err)
		}
		return l, nil
	case <-time.After(timeout):
		return "", fmt.Errorf("%s: no answer within %v", p.role, timeout)
	}
}

// call sends a command and returns the number it answers.
func (p *proc) call(command string, timeout time.Duration) (int64, error) {
	if _, err := io.WriteString(p.in, command+"\n"); err != nil {
		return 0, fmt.Errorf("%w: %s: %s: %w", ErrChild, p.role, command, err)
	}
	line, err := p.line(timeout)
	if err != nil {
		return 0, fmt.Errorf("%w: %s: %w", ErrChild, command, err)
	}
	if msg, ok := strings.CutPrefix(line, "err "); ok {
		return 0, fmt.Errorf("%w: %s: %s: %s", ErrChild, p.role, command, msg)
	}
	n, err := strconv.ParseInt(strings.TrimPrefix(line, "ok "), 10, 64)
	if err != nil || !strings.HasPrefix(line, "ok ") {
		return 0, fmt.Errorf("%w: %s: %s: answered %q", ErrChild, p.role, command, line)
	}
	return n, nil
}

// stop ends the child: its stdin closes (the publisher and the watcher
// end), SIGTERM (the monitor), then SIGKILL after stopTimeout. It returns
// the child's exit error, once.
func (p *proc) stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.in.Close()
	if p.role == roleMonitor {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%w: %s did not stop within %v", ErrChild, p.role, stopTimeout)
	}
	if p.err != nil {
		return fmt.Errorf("%w: %s: %w", ErrChild, p.role, p.err)
	}
	return nil
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
	fmt.Fprintf(tw, "report → record seen, p50 (%d flips)\t%.0f µs\t%.0f µs\t%+.0f µs\n", r.Flips, r.RawP50, r.P50, r.P50-r.RawP50)
	fmt.Fprintf(tw, "report → record seen, p99\t%.0f µs\t%.0f µs\t%+.0f µs\n", r.RawP99, r.P99, r.P99-r.RawP99)
	_ = tw.Flush()
	fmt.Fprintln(w, "\nraw limit: the same server, measured in turns with workermon: raw messages from the publisher process")
	fmt.Fprintln(w, "to a counting subscriber in the watcher process; a KV put in the publisher process seen by a watcher")
	fmt.Fprintln(w, "in the watcher process.")
}
