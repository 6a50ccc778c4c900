package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
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
	return fmt.Sprintf("sent %d (%.1f/s) 200 %d 503 %d other %d errors %d cancelled %d dropped %d | p50 %s p90 %s p99 %s",
		c.Sent, float64(c.Sent)/secs, c.OK, c.Unavailable, c.OtherStatus, c.Errors, c.Cancelled, c.Dropped,
		round(c.Latency.P50), round(c.Latency.P90), round(c.Latency.P99))
}
