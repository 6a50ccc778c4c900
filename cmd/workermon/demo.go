package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/board"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/loadgen"
	"github.com/workermon/workermon/router"
	"github.com/workermon/workermon/sim"
)

// Defaults of `workermon demo`.
const (
	// DefaultDemoWorkers and DefaultDemoRanks size the simulated fleet.
	DefaultDemoWorkers = 3
	DefaultDemoRanks   = 2
	// DefaultDemoPeriod is one cycle of the load ramp: up, then down.
	DefaultDemoPeriod = time.Minute
	// DefaultDemoMinRPS and DefaultDemoMaxRPS bound the ramp. The default
	// fleet serves about 9 requests per second; from about a third of the
	// way up the standard and critical requests alone are more than that,
	// and near the peak the critical ones alone almost are.
	DefaultDemoMinRPS = 2
	DefaultDemoMaxRPS = 75
	// DefaultDemoDecodeSpeed (tokens per second of one request) and
	// DefaultDemoMaxTokens make a request hold its KV cache for about 6.5 s,
	// as a long answer does: once every worker is busy, what they hold
	// keeps them busy for seconds, so the router answers 503 for seconds
	// rather than for the moment one request takes to end.
	DefaultDemoDecodeSpeed = 20
	DefaultDemoMaxTokens   = 128
	// DefaultDemoReleaseMargin is the demo's hysteresis (--release-margin):
	// a busy rank is free again only below 70 % of its threshold, so one
	// finished request does not free it.
	DefaultDemoReleaseMargin = 0.3
	// DefaultDemoDecodeThreshold is the demo's KV-cache threshold.
	DefaultDemoDecodeThreshold = 0.7
	// DefaultDemoPrefillThreshold is the demo's prefill threshold in tokens
	// (queued prompts count as prefill in the simulator).
	DefaultDemoPrefillThreshold = 1536
	// DefaultDemoCriticalFraction is the demo monitor's --critical-fraction
	// (serve's default is 1.1): docs/router.md's rule for an engine that
	// takes KV blocks as requests decode, c at least a request's growth
	// past the busy line, so that at a peak the workers do not all pass the
	// hard line at once and critical requests keep getting through.
	DefaultDemoCriticalFraction = 1.25
	// DefaultDemoInterval is how often the live summary is printed.
	DefaultDemoInterval = 2 * time.Second
	// DefaultDemoPriorityMix is the priorities of the demo's requests
	// (contract §15): half sheddable, a tenth critical.
	DefaultDemoPriorityMix = "-1=0.5,0=0.4,1=0.1"
	// DefaultDemoQueueMaxWait is the demo router's --queue-max-wait
	// (contract §17), and DefaultDemoQueueShare the share of the load that
	// may wait in its queue: the rest sends X-Workermon-Max-Wait: 0 and meets
	// the all-busy 503 at once, so each peak shows both.
	DefaultDemoQueueMaxWait = 3 * time.Second
	DefaultDemoQueueShare   = 0.5
)

// admissionMaxWait is the header a request shortens its wait with.
const admissionMaxWait = router.MaxWaitHeader

// demoOptions is everything `workermon demo` can be told.
type demoOptions struct {
	serve      serveOptions
	router     routerOptions
	fleet      sim.FleetConfig
	load       loadgen.Config
	noLoad     bool
	reschedule bool
	mix        string // --priority-mix
	// queueMaxWait and queueShare are --queue-max-wait and --queue-share:
	// runDemo turns the router's queue on with them (startDemo alone, as
	// the tests use it, leaves it off).
	queueMaxWait time.Duration
	queueShare   float64
	duration     time.Duration
	interval     time.Duration
	log          logOptions
}

func defaultDemoOptions() demoOptions {
	o := demoOptions{
		serve:      defaultServeOptions(),
		router:     defaultRouterOptions(),
		fleet:      sim.DefaultFleetConfig(),
		load:       loadgen.DefaultConfig(),
		interval:   DefaultDemoInterval,
		mix:        DefaultDemoPriorityMix,
		queueShare: DefaultDemoQueueShare,
		log:        logOptions{level: "warn", format: "text"},
	}
	o.serve.embedded.DataDir = "" // a fresh temporary store, removed at exit
	o.serve.writer.Warmup = time.Second
	// One process, one name: the router takes the monitor's, so that both
	// boards (and the logs) name the demo alike.
	o.router.router.RouterID = o.serve.writer.MonitorID
	o.serve.monitor.Defaults = events.Thresholds{
		ActiveDecodeBlocks:  events.Ptr(DefaultDemoDecodeThreshold),
		ActivePrefillTokens: events.Ptr[uint64](DefaultDemoPrefillThreshold),
	}
	o.serve.monitor.ReleaseMargin = DefaultDemoReleaseMargin
	o.serve.monitor.CriticalFraction = DefaultDemoCriticalFraction
	o.fleet.Workers, o.fleet.Ranks = DefaultDemoWorkers, DefaultDemoRanks
	o.fleet.Engine.DecodeSpeed = DefaultDemoDecodeSpeed
	o.load.MaxTokens = DefaultDemoMaxTokens
	o.fleet.Publish.Heartbeat = time.Second
	o.load.Profile = loadgen.ProfileTriangle
	o.load.MinRPS, o.load.MaxRPS, o.load.Period = DefaultDemoMinRPS, DefaultDemoMaxRPS, DefaultDemoPeriod
	o.load.Window = 5 * time.Second
	o.queueMaxWait = DefaultDemoQueueMaxWait
	return o
}

func (o *demoOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.serve.embedded.Addr, "embedded-nats-addr", o.serve.embedded.Addr, "listen address of the embedded NATS server")
	fs.StringVar(&o.serve.embedded.DataDir, "data-dir", o.serve.embedded.DataDir, "JetStream store (empty: a temporary directory removed at exit)")
	fs.StringVar(&o.serve.httpAddr, "monitor-addr", o.serve.httpAddr, "listen address of the monitor's API and metrics")
	fs.StringVar(&o.router.httpAddr, "router-addr", o.router.httpAddr, "listen address of the router")
	fs.StringVar(&o.fleet.Model, "model", o.fleet.Model, "model the simulated workers serve")
	fs.IntVar(&o.fleet.Workers, "workers", o.fleet.Workers, "number of simulated workers")
	fs.Var(uint32Value{&o.fleet.Ranks}, "ranks", "data-parallel ranks per worker")
	fs.Var(optFloat{&o.serve.monitor.Defaults.ActiveDecodeBlocks}, "active-decode-blocks-threshold", "KV-cache threshold")
	fs.Var(optUint{&o.serve.monitor.Defaults.ActivePrefillTokens}, "active-prefill-tokens-threshold", "prefill threshold in tokens")
	fs.Float64Var(&o.load.MinRPS, "min-rps", o.load.MinRPS, "lowest request rate of the ramp")
	fs.Float64Var(&o.load.MaxRPS, "max-rps", o.load.MaxRPS, "highest request rate of the ramp")
	fs.DurationVar(&o.load.Period, "period", o.load.Period, "one cycle of the ramp, up and down")
	fs.Float64Var(&o.serve.monitor.ReleaseMargin, "release-margin", o.serve.monitor.ReleaseMargin,
		"hysteresis of the busy rules in [0, 1) (0: off); the summary counts all_busy changes")
	fs.BoolVar(&o.reschedule, "reschedule", false,
		"run the rescheduler (every second, decode_load and failover) and let the router continue cut streams")
	fs.BoolVar(&o.noLoad, "no-load", false, "start no load generator (send your own requests to the router)")
	fs.StringVar(&o.mix, "priority-mix", o.mix, `priorities of the load's requests, priority=share comma-separated ("": no header)`)
	classFlags(fs, &o.serve.monitor)
	o.serve.slo.flags(fs) // the demo's monitor runs the SLO controller
	fs.DurationVar(&o.queueMaxWait, "queue-max-wait", o.queueMaxWait,
		"how long the router's queue holds a request that may wait (0: no queue)")
	fs.Float64Var(&o.queueShare, "queue-share", o.queueShare,
		"share of the load that may wait in the router's queue; the rest sends "+router.MaxWaitHeader+": 0")
	fs.DurationVar(&o.duration, "duration", 0, "stop after this long (0: run until Ctrl-C)")
	fs.DurationVar(&o.interval, "interval", o.interval, "how often to print the summary")
	o.log.flags(fs)
}

// validate checks what the demo's parts would check at their start, with
// stand-ins for what only the start decides: the temporary store, the
// embedded server's URL and the router's address. The listen addresses are
// checked here, under the demo's names for them.
func (o demoOptions) validate() error {
	serve := o.serve
	if serve.embedded.DataDir == "" {
		serve.embedded.DataDir = "(temporary)"
	}
	url := "nats://" + o.serve.embedded.Addr
	rt := o.router
	rt.natsURL = url
	serve.httpAddr, rt.httpAddr = "127.0.0.1:0", "127.0.0.1:0"
	fleet := o.fleet
	fleet.NATS.URL = url
	errs := []error{serve.validate(), rt.validate(), fleet.Validate(),
		validListenAddr("monitor-addr", o.serve.httpAddr), validListenAddr("router-addr", o.router.httpAddr)}
	if !(0 <= o.queueShare && o.queueShare <= 1) { // NaN too
		errs = append(errs, fmt.Errorf("--queue-share %v must be in [0, 1]", o.queueShare))
	}
	load := o.load
	load.Target, load.Models = "http://"+o.router.httpAddr, []string{o.fleet.Model}
	var err error
	if load.PriorityMix, err = loadgen.ParsePriorityMix(o.mix); err != nil {
		errs = append(errs, fmt.Errorf("--priority-mix: %w", err))
	} else if !o.noLoad {
		errs = append(errs, load.Validate())
	}
	return errors.Join(errs...)
}

// demo is everything of `workermon demo`, running.
type demo struct {
	monitor    *service
	router     *routerService
	routerReg  *prometheus.Registry
	fleet      *sim.Fleet
	model      string
	reschedule bool
	tmpDir     string
	// streaks times the model's all-busy periods as the router sees them
	// (its watch runs beside runDemo's summary loop).
	streaks allBusyStreaks
}

// allBusy reports whether the router rejects the model's standard
// requests because every worker is busy.
func (d *demo) allBusy() bool {
	return d.router.watcher.Decide(d.model).Reason == admission.ReasonAllBusy
}

// startDemo starts NATS and the monitor, the fleet and the router.
func startDemo(ctx context.Context, o demoOptions, log *slog.Logger) (_ *demo, err error) {
	d := &demo{model: o.fleet.Model, reschedule: o.reschedule}
	defer func() {
		if err != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), DefaultShutdownTimeout)
			defer cancel()
			_ = d.Close(cctx)
		}
	}()
	if o.serve.embedded.DataDir == "" {
		if d.tmpDir, err = os.MkdirTemp("", "workermon-demo-"); err != nil {
			return nil, fmt.Errorf("demo: %w", err)
		}
		o.serve.embedded.DataDir = d.tmpDir
	}
	if d.monitor, err = startService(ctx, o.serve, log.With("part", "monitor"), newRegistry()); err != nil {
		return nil, err
	}
	o.fleet.NATS.URL = d.monitor.natsURL
	if d.fleet, err = sim.NewFleet(ctx, o.fleet, log.With("part", "sim")); err != nil {
		return nil, err
	}
	o.router.natsURL = d.monitor.natsURL
	d.routerReg = newRegistry()
	if d.router, err = startRouter(o.router, log.With("part", "router"), d.routerReg); err != nil {
		return nil, err
	}
	// The monitor's board shows the router's rejections too.
	d.monitor.boardCounts.set(board.GatheredCounts(d.routerReg))
	d.monitor.boardCounts.setQueues(board.GatheredQueues(d.routerReg))
	return d, nil
}

// Close stops the router, the fleet (with goodbyes) and the monitor.
func (d *demo) Close(ctx context.Context) error {
	var errs []error
	if d.router != nil {
		errs = append(errs, d.router.Close(ctx))
	}
	if d.fleet != nil {
		errs = append(errs, d.fleet.Close(ctx))
	}
	if d.monitor != nil {
		errs = append(errs, d.monitor.Close(ctx))
	}
	if d.tmpDir != "" {
		errs = append(errs, os.RemoveAll(d.tmpDir))
	}
	return errors.Join(errs...)
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	// `workermon demo | tee log` and Ctrl-C: the terminal interrupts the
	// whole pipeline, tee is gone before the demo's last lines. Unasked,
	// Go kills a process that writes to a closed stdout or stderr with
	// SIGPIPE (exit 141), before any cleanup; asked for, the signal only
	// reaches this channel and the write fails with EPIPE, which ends the
	// demo below like an interrupt. The signal itself means nothing here
	// (a socket whose client went away raises it too), so nothing reads
	// it; it is taken until every part is closed. SIGHUP (the terminal
	// closed) ends the demo like Ctrl-C.
	pipe := make(chan os.Signal, 1)
	signal.Notify(pipe, syscall.SIGPIPE)
	defer signal.Stop(pipe)
	ctx, stopHUP := signal.NotifyContext(ctx, syscall.SIGHUP)
	defer stopHUP()
	width := func() int { return DefaultDemoWidth }
	if f, ok := stdout.(*os.File); ok {
		width = func() int {
			if cols, _ := terminalSize(f); cols > 0 {
				return cols
			}
			return DefaultDemoWidth
		}
	}
	ctx, endOutput := context.WithCancelCause(ctx)
	defer endOutput(nil)
	out := &endOnWriteError{w: stdout, end: endOutput}
	stdout = out

	o := defaultDemoOptions()
	log, check, err := parseCommand("demo", args, stderr, nil, o.flags, &o.log)
	if err != nil {
		return err
	}
	if err := checkPeriods(o.interval, o.duration); err != nil {
		return err
	}
	if err := o.validate(); err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	if o.duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.duration)
		defer cancel()
	}
	if o.reschedule {
		o.serve.resched.interval = time.Second
		o.serve.resched.timeout = 500 * time.Millisecond
		o.serve.resched.planner.Cooldown = time.Second
		// The demo's workers are alike: a small gap lets the rescheduler
		// even out the random imbalance of the load.
		o.serve.resched.planner.BalanceGap = 0.02
		o.router.router.MigrationLimit = max(o.router.router.MigrationLimit, 2)
	}
	o.router.router.QueueMaxWait = o.queueMaxWait
	d, err := startDemo(ctx, o, log)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), DefaultShutdownTimeout)
		defer cancel()
		if err := d.Close(cctx); err != nil {
			log.Warn("demo: shutdown", "err", err)
		}
	}()
	d.banner(stdout, o)

	if o.load.PriorityMix, err = loadgen.ParsePriorityMix(o.mix); err != nil {
		return fmt.Errorf("%w: --priority-mix: %w", errUsage, err)
	}
	o.load.Target = "http://" + d.router.httpAddr
	o.load.Models = []string{o.fleet.Model}
	if o.router.router.QueueMaxWait > 0 && o.queueShare < 1 {
		o.load.Transport = newNoWaitTransport(o.load.Concurrency, 1-o.queueShare)
	}
	var gen *loadgen.Generator
	genDone := make(chan struct{})
	if o.noLoad {
		close(genDone)
	} else {
		if gen, err = loadgen.New(o.load, log.With("part", "loadgen")); err != nil {
			return err
		}
		go func() {
			defer close(genDone)
			if err := gen.Run(ctx); err != nil {
				log.Error("demo: load generator stopped", "err", err)
			}
		}()
	}
	streaksDone := make(chan struct{})
	go func() {
		defer close(streaksDone)
		d.streaks.watch(ctx, demoStreakPoll, d.allBusy)
	}()
	tick := time.NewTicker(o.interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			<-genDone
			<-streaksDone
			if out.err != nil {
				log.Warn("demo: stopping: stdout is closed", "err", out.err)
			}
			printLines(stdout, d.summary(gen).lines(width()))
			if gen != nil {
				printLines(stdout, demoTotals(gen.Stats(), width()))
			}
			fmt.Fprintln(stdout, "stopping: router, workers (goodbyes), monitor, NATS")
			return nil
		case <-tick.C:
			printLines(stdout, d.summary(gen).lines(width()))
		}
	}
}

func printLines(w io.Writer, lines []string) {
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
}

// endOnWriteError passes writes on to w until one fails: that one calls end
// with its error and every later write is dropped. A reader that went away
// (`workermon demo | head`, or tee interrupted with the demo) so ends the
// demo through its cleanup. Not safe for concurrent use.
type endOnWriteError struct {
	w   io.Writer
	end context.CancelCauseFunc
	err error // the first failure
}

func (e *endOnWriteError) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	if err != nil {
		e.err = fmt.Errorf("demo: write the summary: %w", err)
		e.end(e.err)
		return n, e.err
	}
	return n, nil
}

func (d *demo) banner(w io.Writer, o demoOptions) {
	m, r := d.monitor.httpAddr, d.router.httpAddr
	fmt.Fprintf(w, "board: http://%s/   (live; the router's view: http://%s/)\n\n", m, r)
	fmt.Fprintf(w, `workermon demo — NATS, monitor, %d simulated workers × %d ranks, router and load, in one process

  NATS         %s
  monitor API  http://%s/busy  /loads  /busy_threshold  /slo
  metrics      http://%s/metrics   http://%s/metrics
  router       http://%s/v1/completions  (OpenAI-compatible)
`, o.fleet.Workers, o.fleet.Ranks, d.monitor.natsURL, m, m, r, r)
	for _, wk := range d.fleet.Workers() {
		fmt.Fprintf(w, "  worker %-4d  %s\n", wk.ID(), wk.Endpoint())
	}
	mon := o.serve.monitor
	fmt.Fprintf(w, "\nthresholds: %s, release margin %g, critical fraction %g\n",
		thresholdsAttr(mon.Defaults), mon.ReleaseMargin, mon.CriticalFraction)
	if !o.noLoad {
		fmt.Fprintf(w, "load: %g → %g → %g requests/s every %v, priorities %s\n",
			o.load.MinRPS, o.load.MaxRPS, o.load.MinRPS, o.load.Period, o.mix)
	}
	fmt.Fprint(w, demoAnswers(o.router.router.QueueMaxWait, o.queueShare, r, o.fleet.Model))
	fmt.Fprintf(w, "try: go run ./cmd/workermon status --monitor-url http://%s\nCtrl-C to stop.\n\n", m)
}

// demoAnswers says what the demo's router answers a request when every
// worker is busy, and how to see each answer for oneself.
func demoAnswers(queueMaxWait time.Duration, queueShare float64, router, model string) string {
	var b strings.Builder
	if queueMaxWait > 0 {
		fmt.Fprintf(&b, `every worker busy: a request waits up to %v in the router's queue, then gets
  200 if a worker frees in time, else 429; sent with %s: 0, the 503 at once.
  %.0f%% of the load may wait, the rest sends %s: 0.
  queued now: http://%s/queues
`, queueMaxWait, admissionMaxWait, 100*queueShare, admissionMaxWait, router)
	} else {
		b.WriteString("every worker busy: the router answers 503 at once.\n")
	}
	fmt.Fprintf(&b, `  X-Workermon-Priority: -1 (sheddable) gets 429 as the workers near their thresholds;
  1 (critical) may still go to busy workers below the critical fraction. Each answer:
  curl -si http://%s/v1/completions -H '%s: 0' \
    -d '{"model":%q,"prompt":"hi","max_tokens":8}'
`, router, admissionMaxWait, model)
	return b.String()
}

// summary gathers what the summary shows now.
func (d *demo) summary(gen *loadgen.Generator) demoSummary {
	s := demoSummary{model: d.model, reschedule: d.reschedule}
	if gen != nil {
		st := gen.Stats()
		s.load = &st
	}
	rec, _, ok := d.router.watcher.Record(d.model)
	if !ok {
		return s
	}
	now := time.Now()
	s.record = true
	s.busy, s.hard, s.free, s.amber, s.stale = rec.Busy, rec.Hard, rec.Free, rec.Amber, rec.Stale
	if !rec.Thresholds.IsZero() {
		s.saturation = &rec.Saturation
	}
	s.changes = promreg.Sum(d.monitor.reg, "workermon_all_busy_changes_total")
	s.streaks = d.streaks.cell(now)
	s.migrated = promreg.Sum(d.monitor.reg, "workermon_rescheduler_migrated_requests_total")
	s.queued = promreg.Sum(d.routerReg, "workermon_router_queue_depth")
	if s.allBusy = d.allBusy(); s.allBusy {
		s.allBusyFor = d.streaks.current(now)
	}
	return s
}

// noWaitTransport sends a share of the requests with
// X-Workermon-Max-Wait: 0: they never wait in the router's queue.
type noWaitTransport struct {
	base  http.RoundTripper
	share float64
	n     atomic.Uint64
}

// newNoWaitTransport returns a transport sized for concurrency requests in
// flight that marks share of them not to wait, spread evenly.
func newNoWaitTransport(concurrency int, share float64) *noWaitTransport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns, t.MaxIdleConnsPerHost = concurrency, concurrency
	return &noWaitTransport{base: t, share: share}
}

func (t *noWaitTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	n := t.n.Add(1)
	// The n-th request does not wait when the count of those that do not
	// goes up at n: share of the requests, evenly spread.
	if math.Floor(float64(n)*t.share) > math.Floor(float64(n-1)*t.share) {
		r = r.Clone(r.Context())
		r.Header.Set(router.MaxWaitHeader, "0")
	}
	return t.base.RoundTrip(r)
}

func round(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	return d.Round(10 * time.Millisecond).String()
}
