package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/router"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
	"github.com/workermon/workermon/watch"
)

// sloOptions are the SLO controller's flags of `workermon serve` (contract
// §18).
type sloOptions struct {
	interval time.Duration
	decode   floatRange
	prefill  uintRange
	// committed and delay bound the thresholds of the leading signals
	// (contract §21).
	committed floatRange
	delay     uintRange
	maxSLOs   int
}

func defaultSLOOptions() sloOptions {
	return sloOptions{
		interval:  sloctl.DefaultInterval,
		maxSLOs:   sloctl.DefaultMaxSLOs,
		decode:    floatRange{slo.DefaultDecodeMin, slo.DefaultDecodeMax},
		prefill:   uintRange{slo.DefaultPrefillMin, slo.DefaultPrefillMax},
		committed: floatRange{slo.DefaultCommittedMin, slo.DefaultCommittedMax},
		delay:     uintRange{slo.DefaultDelayMin, slo.DefaultDelayMax},
	}
}

func (o *sloOptions) flags(fs *flag.FlagSet) {
	fs.DurationVar(&o.interval, "slo-interval", o.interval, "the SLO controller moves a model's thresholds at most once per interval")
	fs.Var(&o.decode, "slo-decode-range", "range MIN-MAX the SLO controller keeps the decode threshold in")
	fs.Var(&o.prefill, "slo-prefill-range", "range MIN-MAX (tokens) the SLO controller keeps the prefill threshold in")
	fs.Var(&o.committed, "slo-committed-range", "range MIN-MAX (fractions of the KV cache, 0 < MIN <= MAX <= 4) the SLO controller keeps kv_committed_threshold in")
	fs.Var(&o.delay, "slo-delay-range", "range MIN-MAX (milliseconds, MIN > 0) the SLO controller keeps queue_delay_threshold_ms in")
	fs.IntVar(&o.maxSLOs, "max-slos", o.maxSLOs, "most models with an SLO; a new SLO beyond is refused")
}

// controllerConfig checks the options and returns the controller's bounds.
func (o sloOptions) controllerConfig() (slo.Config, error) {
	ranges := []struct {
		flag  string
		value fmt.Stringer
		set   func(*slo.Config)
	}{
		{"slo-decode-range", &o.decode, func(c *slo.Config) { c.DecodeMin, c.DecodeMax = o.decode.min, o.decode.max }},
		{"slo-prefill-range", &o.prefill, func(c *slo.Config) { c.PrefillMin, c.PrefillMax = o.prefill.min, o.prefill.max }},
		{"slo-committed-range", &o.committed, func(c *slo.Config) { c.CommittedMin, c.CommittedMax = o.committed.min, o.committed.max }},
		{"slo-delay-range", &o.delay, func(c *slo.Config) { c.DelayMin, c.DelayMax = o.delay.min, o.delay.max }},
	}
	c := slo.DefaultConfig()
	var errs []error
	if o.interval <= 0 {
		errs = append(errs, fmt.Errorf("serve: --slo-interval %v must be positive", o.interval))
	}
	if o.maxSLOs < 1 {
		errs = append(errs, fmt.Errorf("serve: --max-slos %d must be at least 1", o.maxSLOs))
	}
	// Each range checked on its own, so that an error names its flag.
	for _, r := range ranges {
		one := slo.DefaultConfig()
		r.set(&one)
		if err := one.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("serve: --%s %s: %w", r.flag, r.value, err))
		}
		r.set(&c)
	}
	return c, errors.Join(errs...)
}

// floatRange is a flag MIN-MAX of floats.
type floatRange struct{ min, max float64 }

func (r *floatRange) String() string {
	if r == nil {
		return ""
	}
	return strconv.FormatFloat(r.min, 'g', -1, 64) + "-" + strconv.FormatFloat(r.max, 'g', -1, 64)
}

func (r *floatRange) Set(s string) error {
	lo, hi, ok := strings.Cut(s, "-")
	if !ok {
		return fmt.Errorf("want MIN-MAX, got %q", s)
	}
	a, err1 := strconv.ParseFloat(lo, 64)
	b, err2 := strconv.ParseFloat(hi, 64)
	if err := errors.Join(err1, err2); err != nil {
		return fmt.Errorf("want MIN-MAX of numbers: %w", err)
	}
	r.min, r.max = a, b
	return nil
}

// uintRange is a flag MIN-MAX of whole numbers.
type uintRange struct{ min, max uint64 }

func (r *uintRange) String() string {
	if r == nil {
		return ""
	}
	return strconv.FormatUint(r.min, 10) + "-" + strconv.FormatUint(r.max, 10)
}

func (r *uintRange) Set(s string) error {
	lo, hi, ok := strings.Cut(s, "-")
	if !ok {
		return fmt.Errorf("want MIN-MAX, got %q", s)
	}
	a, err1 := strconv.ParseUint(lo, 10, 64)
	b, err2 := strconv.ParseUint(hi, 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return fmt.Errorf("want MIN-MAX of whole numbers: %w", err)
	}
	r.min, r.max = a, b
	return nil
}

// sloParts are the running SLO pieces of a service.
type sloParts struct {
	store      *overrides.SLOStore
	watcher    *overrides.SLOWatcher
	controller *sloctl.Controller

	// The board's lines, read from the bucket at most once per
	// boardRefresh.
	boardMu   sync.Mutex
	boardAt   time.Time
	boardLast map[string]string
}

// boardRefresh is how long the board's SLO lines are reused.
const boardRefresh = 2 * time.Second

// startSLO builds the SLO bucket's store and watcher and the controller
// (contract §18); the caller runs the watcher and the controller.
func startSLO(o sloOptions, js jetstream.JetStream, replicas, partitions int, monitorID string,
	mon *monitor.Monitor, epoch func(int) uint64, log *slog.Logger, reg prometheus.Registerer) (*sloParts, error) {
	ccfg, err := o.controllerConfig()
	if err != nil {
		return nil, err
	}
	scfg := overrides.DefaultSLOStoreConfig()
	scfg.JetStream, scfg.Replicas, scfg.Max = js, replicas, o.maxSLOs
	store, err := overrides.NewSLOStore(scfg)
	if err != nil {
		return nil, err
	}
	cfg := sloctl.DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.Controller, cfg.Interval, cfg.MaxSLOs = mon, store, ccfg, o.interval, o.maxSLOs
	cfg.Partitions, cfg.Epoch, cfg.MonitorID = partitions, epoch, monitorID
	cfg.Logger, cfg.Registerer = log, reg
	ctl, err := sloctl.New(cfg)
	if err != nil {
		return nil, err
	}
	wcfg := overrides.DefaultSLOWatcherConfig()
	wcfg.JetStream, wcfg.Replicas, wcfg.Registerer, wcfg.Logger = js, replicas, reg, log
	wcfg.OnChange = func(model string, v overrides.SLO, deleted bool) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := ctl.SetSLO(ctx, model, v, deleted); err != nil && !errors.Is(err, monitor.ErrStopped) {
			log.Warn("slo change not applied", "model", model, "err", err)
		}
	}
	w, err := overrides.NewSLOWatcher(wcfg)
	if err != nil {
		return nil, err
	}
	return &sloParts{store: store, watcher: w, controller: ctl}, nil
}

// apiConfig hands the SLO pieces to the API.
func (p *sloParts) apiConfig(c *api.Config) {
	c.SLOs, c.OnSLOChange, c.Observed = p.store, p.controller.SetSLO, p.controller.Observed
}

// run runs the watcher and the controller until ctx ends.
func (p *sloParts) run(ctx context.Context) error {
	done := make(chan error, 1)
	go func() { done <- p.watcher.Run(ctx) }()
	err := p.controller.Run(ctx)
	return errors.Join(err, <-done)
}

const sloUsage = `Usage: workermon slo <get|set|delete> [flags]

  get    [--model NAME]     every SLO with its controller's state, or one model's
  set    --model NAME [--ttft-ms MS] [--itl-ms MS] [--percentile P] [--mode enforce|shadow]
                            set (replace) a model's SLO; at least one of --ttft-ms, --itl-ms
  delete --model NAME       drop a model's SLO: its override and the defaults apply again

Run 'workermon slo <get|set|delete> -h' for the flags.
`

// runSLO is `workermon slo get|set|delete`.
func runSLO(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	sub, args, err := subcommand(args, sloUsage, stderr, [3]string{"get", "set", "delete"})
	if err != nil {
		return err
	}
	o := defaultClientOptions()
	req := api.SLORequest{}
	var ttft, itl, pct optionalFloat
	fs := flag.NewFlagSet("slo "+sub, flag.ContinueOnError)
	o.flags(fs, sub != "get")
	fs.StringVar(&req.Model, "model", "", "model name, as the engines report it")
	if sub == "set" {
		fs.Var(&ttft, "ttft-ms", "time-to-first-token target in milliseconds")
		fs.Var(&itl, "itl-ms", "inter-token latency target in milliseconds")
		fs.Var(&pct, "percentile", "share of requests that must meet the targets, in (0, 1) (default 0.9)")
		fs.StringVar(&req.Mode, "mode", slo.ModeEnforce, "enforce (the controller sets the thresholds) or shadow (it only suggests)")
	}
	check, err := parseClientFlags(fs, args, stderr, "slo "+sub+" [flags]")
	if err != nil {
		return err
	}
	if req.Model == "" && sub != "get" {
		return fmt.Errorf("%w: --model is required", errUsage)
	}
	if req.Model != "" {
		if err := events.ValidateModel(req.Model); err != nil {
			return fmt.Errorf("%w: --model: %v", errUsage, err)
		}
	}
	req.TTFTms, req.ITLms, req.Percentile = ttft.p, itl.p, pct.p
	if sub == "set" && req.TTFTms == nil && req.ITLms == nil {
		return fmt.Errorf("%w: give at least one of --ttft-ms and --itl-ms", errUsage)
	}
	c, err := o.client()
	if err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	var rows []api.SLOReply
	var reply any
	switch {
	case sub == "get" && req.Model == "":
		rows, err = c.SLOs(ctx)
		reply = api.SLOsReply{SLOs: rows}
	default:
		var one api.SLOReply
		switch sub {
		case "get":
			one, err = c.SLO(ctx, req.Model)
		case "set":
			one, err = c.SetSLO(ctx, req)
		case "delete":
			one, err = c.DeleteSLO(ctx, req.Model)
		}
		rows, reply = []api.SLOReply{one}, one
	}
	if err != nil {
		return apiError(err)
	}
	if sub == "set" {
		warnBelowObserved(stderr, rows[0])
	}
	if o.json {
		return printJSON(stdout, reply)
	}
	if len(rows) == 0 {
		fmt.Fprintln(stdout, "no SLOs: `workermon slo set --model M --itl-ms 50` sets one")
		return nil
	}
	return printSLOs(stdout, rows)
}

// warnBelowObserved warns on w about each target of r below the best the
// model's fleet has shown at its percentile (the reply's observed): the
// SLO is set, but the controller will likely lower the thresholds to the
// floor of their range and call the target infeasible.
func warnBelowObserved(w io.Writer, r api.SLOReply) {
	for _, s := range []struct {
		name, flag string
		target     *float64
		floor      func(float64) (ms, at float64, ok bool)
	}{
		{"TTFT", "--ttft-ms", r.TTFTms, r.Observed.TTFTFloor},
		{"ITL", "--itl-ms", r.ITLms, r.Observed.ITLFloor},
	} {
		if s.target == nil {
			continue
		}
		best, at, ok := s.floor(r.Percentile)
		if !ok || *s.target >= best {
			continue
		}
		fmt.Fprintf(w, "workermon slo: warning: %s %g is below the best %s model %q has shown: p%g %.1f ms, the lowest "+
			"of %d windows; the SLO is set, but the controller may lower the thresholds to the floor of their range "+
			"and report the target infeasible (docs/slo.md)\n",
			s.flag, *s.target, s.name, r.Model, at*100, best, r.Observed.Windows)
	}
}

// optionalFloat is a float flag that remembers whether it was given.
type optionalFloat struct{ p *float64 }

func (f *optionalFloat) String() string {
	if f == nil || f.p == nil {
		return ""
	}
	return strconv.FormatFloat(*f.p, 'g', -1, 64)
}

func (f *optionalFloat) Set(s string) error {
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return err
	}
	f.p = &v
	return nil
}

// printSLOs writes SLOs as a table.
func printSLOs(w io.Writer, rows []api.SLOReply) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tTTFT_MS\tITL_MS\tPERCENTILE\tMODE\tSTATE\tDECODE\tPREFILL\tTTFT_ATT\tITL_ATT")
	for _, r := range rows {
		th := r.Applied
		if th == nil {
			th = r.Suggested
		}
		decode, prefill := "-", "-"
		if th != nil {
			decode, prefill = strconv.FormatFloat(th.Decode, 'g', 4, 64), strconv.FormatUint(th.Prefill, 10)
		}
		att := func(p *float64) string {
			if p == nil {
				return "-"
			}
			return strconv.FormatFloat(*p, 'f', 3, 64)
		}
		var ta, ia *float64
		if r.Measured != nil {
			ta, ia = r.Measured.TTFTAttainment, r.Measured.ITLAttainment
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%g\t%s\t%s\t%s\t%s\t%s\t%s\n", watch.QuoteModel(r.Model), fmtOff(r.TTFTms), fmtOff(r.ITLms),
			r.Percentile, r.Mode, r.State, decode, prefill, att(ta), att(ia))
	}
	return tw.Flush()
}

func fmtOff(p *float64) string {
	if p == nil {
		return "-"
	}
	return strconv.FormatFloat(*p, 'g', -1, 64)
}

// startRouterLatency publishes the router's latency windows (contract §18)
// on <prefix>.latr.… every second, and returns what stops it.
func startRouterLatency(rt *router.Router, nc *nats.Conn, prefix string, log *slog.Logger) func() {
	publish := publishWhileConnected(nc)
	stop, done := goLoop(func(ctx context.Context) error {
		return rt.RunLatency(ctx, prefix, router.DefaultLatencyWindow, publish)
	}, log, "latency windows")
	return func() {
		stop()
		<-done
	}
}

// publishWhileConnected publishes on nc only while it is connected: a
// latency window is for the interval it was measured in, and one that nc
// buffered while disconnected would reach the monitors with the burst of a
// reconnect, its rejections counted in an interval long after. The monitors
// drop windows older than --stale-after; this keeps the fresh part of a
// long outage's buffer out too. The connection keeps its reconnect buffer
// (nats.ReconnectBufSize(-1) would make every other publish of the router
// fail during a blip as well: the slot tracker's estimates, the queue's
// reports); a window published in the instant between the check and a
// disconnect may still be buffered, and is then the monitors' to drop.
func publishWhileConnected(nc *nats.Conn) func(subject string, data []byte) error {
	return func(subject string, data []byte) error {
		if !nc.IsConnected() {
			return fmt.Errorf("latency window not sent while NATS is %s: %w", nc.Status(), nats.ErrDisconnected)
		}
		return nc.Publish(subject, data)
	}
}

// statusSLOs returns the SLOs `workermon status` shows: every model's, or
// model's only; none from a monitor without the /slo endpoint.
func statusSLOs(ctx context.Context, c *api.Client, model string) ([]api.SLOReply, error) {
	all, err := c.SLOs(ctx)
	if se, ok := errors.AsType[*api.StatusError](err); ok && se.StatusCode == http.StatusNotFound {
		return []api.SLOReply{}, nil
	}
	if err != nil {
		return nil, err
	}
	out := []api.SLOReply{}
	for _, s := range all {
		if model == "" || s.Model == model {
			out = append(out, s)
		}
	}
	return out, nil
}

// boardLines describes each model's SLO for the board in one line: the
// targets, the mode, the state and the attainment of the last interval.
func (p *sloParts) boardLines(ctx context.Context) map[string]string {
	p.boardMu.Lock()
	defer p.boardMu.Unlock()
	now := time.Now()
	if now.Sub(p.boardAt) < boardRefresh {
		return p.boardLast
	}
	p.boardAt = now
	slos, statuses, err := p.store.List(ctx)
	if err != nil || len(slos) == 0 {
		p.boardLast = nil
		return nil
	}
	out := make(map[string]string, len(slos))
	for model, v := range slos {
		var b strings.Builder
		b.WriteString("SLO")
		if v.TTFTms != nil {
			fmt.Fprintf(&b, " ttft ≤ %g ms", *v.TTFTms)
		}
		if v.ITLms != nil {
			fmt.Fprintf(&b, " itl ≤ %g ms", *v.ITLms)
		}
		fmt.Fprintf(&b, " p%g %s", v.Percentile*100, v.Mode)
		st, ok := statuses[model]
		if !ok {
			b.WriteString(": no_data")
			out[model] = b.String()
			continue
		}
		fmt.Fprintf(&b, ": %s", st.State)
		if a := st.Measured.TTFTAttainment; a != nil {
			fmt.Fprintf(&b, ", ttft %.0f%%", *a*100)
		}
		if a := st.Measured.ITLAttainment; a != nil {
			fmt.Fprintf(&b, ", itl %.0f%%", *a*100)
		}
		if !v.Enforced() {
			fmt.Fprintf(&b, ", suggests decode %g prefill %d", st.Suggested.Decode, st.Suggested.Prefill)
		}
		out[model] = b.String()
	}
	p.boardLast = out
	return out
}
