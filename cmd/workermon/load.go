package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/workermon/workermon/loadgen"
)

// DefaultLoadInterval is how often `workermon load` prints a line.
const DefaultLoadInterval = 2 * time.Second

func runLoad(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := loadgen.DefaultConfig()
	c.Window = 5 * time.Second
	var models, profile, api string = strings.Join(c.Models, ","), string(c.Profile), string(c.API)
	var duration time.Duration
	var mix, workload, arrivals string = "", string(c.Workload), string(loadgen.ArrivalsPoisson)
	var asJSON bool
	interval := DefaultLoadInterval
	lo := defaultLogOptions()
	lo.level = "warn"
	register := func(fs *flag.FlagSet) {
		fs.StringVar(&c.Target, "target", c.Target, "base URL of the router (or any OpenAI-compatible server)")
		fs.StringVar(&models, "model", models, "model(s) of the requests, comma-separated")
		fs.StringVar(&api, "api", api, "completions or chat")
		fs.BoolVar(&c.Stream, "stream", c.Stream, "stream the answers (SSE)")
		fs.StringVar(&profile, "profile", profile, "constant (--rps) or triangle (--min-rps → --max-rps → --min-rps every --period)")
		fs.Float64Var(&c.RPS, "rps", c.RPS, "requests per second of the constant profile")
		fs.Float64Var(&c.MinRPS, "min-rps", c.MinRPS, "lowest rate of the triangle profile")
		fs.Float64Var(&c.MaxRPS, "max-rps", c.MaxRPS, "highest rate of the triangle profile")
		fs.DurationVar(&c.Period, "period", c.Period, "one cycle of the triangle profile")
		fs.IntVar(&c.Concurrency, "concurrency", c.Concurrency, "most requests in flight")
		fs.StringVar(&arrivals, "arrivals", arrivals, "poisson (seeded by --seed) or uniform spacing of the requests")
		fs.StringVar(&workload, "workload", workload,
			"fixed (--prompt-tokens, --max-tokens), chat (prompt 128-512, output 64-256) or documents (prompt 2048-6144, output 64-256)")
		fs.IntVar(&c.PromptTokens, "prompt-tokens", c.PromptTokens, "prompt size in tokens (workload fixed)")
		fs.IntVar(&c.MaxTokens, "max-tokens", c.MaxTokens, "max_tokens of each request (workload fixed)")
		fs.DurationVar(&c.SLO.TTFT, "slo-ttft", c.SLO.TTFT, "a good request's time to first token is at most this")
		fs.DurationVar(&c.SLO.ITL, "slo-itl", c.SLO.ITL, "a good request's time per output token is at most this")
		fs.BoolVar(&asJSON, "json", false, "print only the final report, as JSON")
		fs.Float64Var(&c.CancelFraction, "cancel-fraction", c.CancelFraction, "share of requests the client cancels mid-way")
		fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "timeout of one request, its retries and the waits between them included")
		fs.IntVar(&c.Retries, "retries", c.Retries,
			"send a request again up to this many times after a 408, 409, 429, 5xx or connection error, as the OpenAI SDKs do (honouring retry-after-ms and Retry-After)")
		fs.BoolVar(&c.SimOutputTokens, "sim-output-tokens", false,
			"send max_tokens = the top of the workload's output range and the drawn length in the sim-only body field sim_output_tokens, where workermon sim ends the answer (workload chat or documents)")
		fs.StringVar(&mix, "priority-mix", "",
			`send the X-Workermon-Priority header in these shares, e.g. "-1=0.5,0=0.4,1=0.1" (priority=share; shares are weights), and report by class`)
		fs.Uint64Var(&c.Seed, "seed", c.Seed,
			"seed of the arrivals, the lengths and the priorities: the same seed sends the same sequence (0: a random one, printed)")
		fs.BoolVar(&c.NoPriorityHeader, "no-priority-header", false,
			"draw priorities from --priority-mix for the report but send no header (every request priority 0): a baseline")
		fs.DurationVar(&duration, "duration", 0, "offer load for this long, then let the requests in flight that can still be good finish (0: until Ctrl-C)")
		fs.DurationVar(&interval, "interval", interval, "how often to print a line")
		lo.flags(fs)
	}
	log, check, err := parseCommand("load", args, stderr, nil, register, &lo)
	if err != nil {
		return err
	}
	if err := checkPeriods(interval, duration); err != nil {
		return err
	}
	if c.PriorityMix, err = loadgen.ParsePriorityMix(mix); err != nil {
		return fmt.Errorf("%w: --priority-mix: %w", errUsage, err)
	}
	c.Models = strings.Split(models, ",")
	c.Profile, c.API = loadgen.Profile(profile), loadgen.API(api)
	c.Workload, c.Arrivals = loadgen.Workload(workload), loadgen.Arrivals(arrivals)
	c.Duration = duration
	if check.on {
		// A seed of 0 stays 0 here: the run draws one and prints it.
		return check.report(stdout, c.Validate(), nil)
	}
	if c.Seed == 0 {
		c.Seed = rand.Uint64()
	}
	gen, err := loadgen.New(c, log)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	done := make(chan error, 1)
	go func() { done <- gen.Run(ctx) }()
	progress := stdout
	if asJSON {
		progress = stderr // stdout carries the document alone
	}
	fmt.Fprintf(progress, "seed %d, workload %s, arrivals %s, SLO TTFT %v ITL %v\n", c.Seed, c.Workload, c.Arrivals, c.SLO.TTFT, c.SLO.ITL)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			s := gen.Stats()
			if asJSON {
				enc := json.NewEncoder(stdout)
				enc.SetIndent("", "  ")
				return errors.Join(err, enc.Encode(s.Report()))
			}
			fmt.Fprintf(stdout, "total after %v: %s\n", s.Elapsed.Round(time.Second), countsLine(s.Total))
			fmt.Fprintf(stdout, "goodput %s\n", goodputLine(s.Total))
			if c.Retries > 0 {
				fmt.Fprintf(stdout, "retries %s\n", retriesLine(s.Total))
			}
			if len(s.Classes) > 0 {
				printClasses(stdout, s.Classes)
			}
			return err
		case <-tick.C:
			if asJSON {
				continue
			}
			s := gen.Stats()
			fmt.Fprintf(stdout, "t=%3.0fs target %5.1f/s in flight %4d | last %v: %s | good %.1f/s\n",
				s.Elapsed.Seconds(), s.TargetRPS, s.InFlight, s.Window.Duration.Round(time.Second), countsLine(s.Window),
				perSecond(s.Window.Good, s.Window.Duration))
		}
	}
}

// perSecond returns n over d, 0 for an empty span.
func perSecond(n uint64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// goodputLine renders the good requests, their rate and the latencies the
// SLO tests.
// With answers that waited in a router's queue (X-Workermon-Queued), their
// number and waits too.
func goodputLine(c loadgen.Counts) string {
	line := fmt.Sprintf("%.1f/s (%d good of %d sent) | TTFT p50 %s p99 %s | TPOT p50 %s p99 %s | e2e p99 %s",
		perSecond(c.Good, c.Duration), c.Good, c.Sent, round(c.TTFT.P50), round(c.TTFT.P99),
		round(c.TPOT.P50), round(c.TPOT.P99), round(c.Latency.P99))
	if c.Queued > 0 {
		line += fmt.Sprintf(" | queued %d, wait p50 %s p99 %s", c.Queued, round(c.QueueWait.P50), round(c.QueueWait.P99))
	}
	return line
}

// retriesLine renders the attempts of the requests sent and the requests
// whose last attempt got no 200 (contract §23).
func retriesLine(c loadgen.Counts) string {
	per := 0.0
	if c.Sent > 0 {
		per = float64(c.Attempts) / float64(c.Sent)
	}
	return fmt.Sprintf("%d attempts for %d requests (%.2f each) | failed %d (last attempt not a 200)", c.Attempts, c.Sent, per, c.Failed)
}

// checkPeriods checks the --interval and --duration of load and demo.
func checkPeriods(interval, duration time.Duration) error {
	var errs []error
	if interval <= 0 {
		errs = append(errs, fmt.Errorf("--interval %v must be positive", interval))
	}
	if duration < 0 {
		errs = append(errs, fmt.Errorf("--duration %v must not be negative (0: until Ctrl-C)", duration))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// countsLine renders counts as rates and latency percentiles.
func countsLine(c loadgen.Counts) string {
	secs := max(c.Duration.Seconds(), 0.001)
	return fmt.Sprintf("sent %d (%.1f/s) 200 %d 503 %d 429 %d other %d errors %d cancelled %d dropped %d | p50 %s p90 %s p99 %s",
		c.Sent, float64(c.Sent)/secs, c.OK, c.Unavailable, c.TooMany, c.OtherStatus, c.Errors, c.Cancelled, c.Dropped,
		round(c.Latency.P50), round(c.Latency.P90), round(c.Latency.P99))
}

// printClasses writes the table of the answers by priority class: 200s,
// rejections by status, the share rejected, TTFT and latency of the 200s.
func printClasses(w io.Writer, classes []loadgen.ClassStats) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CLASS\tSENT\t200\t429\t503\tOTHER\tREJECTED\tGOOD\tGOODPUT\tTTFT_P50\tTTFT_P99\tTPOT_P99\tP50\tP99")
	for _, c := range classes {
		t := c.Total
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%.1f/s\t%s\t%s\t%s\t%s\t%s\n", c.Class, t.Sent, t.OK, t.TooMany, t.Unavailable,
			t.OtherStatus+t.Errors, rejectedShare(t), t.Good, perSecond(t.Good, t.Duration), round(t.TTFT.P50), round(t.TTFT.P99),
			round(t.TPOT.P99), round(t.Latency.P50), round(t.Latency.P99))
	}
	_ = tw.Flush()
}

// rejectedShare is the share of the answered requests that the router
// rejected (429 or 503), as a percentage.
func rejectedShare(c loadgen.Counts) string {
	answered := c.OK + c.TooMany + c.Unavailable + c.OtherStatus + c.Errors
	if answered == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(c.TooMany+c.Unavailable)/float64(answered))
}
