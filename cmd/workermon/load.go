package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
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
	var mix string
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
		fs.IntVar(&c.PromptTokens, "prompt-tokens", c.PromptTokens, "prompt size in tokens")
		fs.IntVar(&c.MaxTokens, "max-tokens", c.MaxTokens, "max_tokens of each request")
		fs.Float64Var(&c.CancelFraction, "cancel-fraction", c.CancelFraction, "share of requests the client cancels mid-way")
		fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "timeout of one request")
		fs.StringVar(&mix, "priority-mix", "",
			`send the X-Workermon-Priority header in these shares, e.g. "-1=0.5,0=0.4,1=0.1" (priority=share; shares are weights), and report by class`)
		fs.Uint64Var(&c.Seed, "seed", c.Seed, "seed of the choice of priorities: the same seed sends the same sequence")
		fs.BoolVar(&c.NoPriorityHeader, "no-priority-header", false,
			"draw priorities from --priority-mix for the report but send no header (every request priority 0): a baseline")
		fs.DurationVar(&duration, "duration", 0, "stop after this long (0: until Ctrl-C)")
		fs.DurationVar(&interval, "interval", interval, "how often to print a line")
		lo.flags(fs)
	}
	log, err := parseCommand("load", args, stderr, nil, register, &lo)
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
	gen, err := loadgen.New(c, log)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	}
	done := make(chan error, 1)
	go func() { done <- gen.Run(ctx) }()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			s := gen.Stats()
			fmt.Fprintf(stdout, "total after %v: %s\n", s.Elapsed.Round(time.Second), countsLine(s.Total))
			if len(s.Classes) > 0 {
				printClasses(stdout, s.Classes)
			}
			return err
		case <-tick.C:
			s := gen.Stats()
			fmt.Fprintf(stdout, "t=%3.0fs target %5.1f/s in flight %4d | last %v: %s\n",
				s.Elapsed.Seconds(), s.TargetRPS, s.InFlight, s.Window.Duration.Round(time.Second), countsLine(s.Window))
		}
	}
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
	fmt.Fprintln(tw, "CLASS\tSENT\t200\t429\t503\tOTHER\tREJECTED\tTTFT_P50\tTTFT_P99\tP50\tP99")
	for _, c := range classes {
		t := c.Total
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\n", c.Class, t.Sent, t.OK, t.TooMany, t.Unavailable,
			t.OtherStatus+t.Errors, rejectedShare(t), round(t.TTFT.P50), round(t.TTFT.P99), round(t.Latency.P50), round(t.Latency.P99))
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
