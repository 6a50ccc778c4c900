// Command workermon runs the workermon control plane: `serve` (the monitor),
// `router` (the gateway), `sim` (a simulated engine fleet), `demo`
// (everything in one process) and the operator commands.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"demo", "run NATS, monitor, simulated engines, router and load in one process", runDemo},
		{"serve", "run the monitor: load state, busy sets, thresholds API", runServe},
		{"router", "run the gateway: admit, reject and route OpenAI-compatible requests", runRouter},
		{"sim", "run a simulated engine fleet that publishes its load and serves OpenAI-compatible requests", runSim},
		{"load", "send OpenAI-compatible requests at a constant or ramping rate and count the answers", runLoad},
		{"status", "print each model's busy, free and stale workers and its thresholds", runStatus},
		{"watch", "follow the busy-set bucket: models and workers redrawn in place, or one line per change", runWatch},
		{"thresholds", "get, set or unset a model's busy thresholds on a running monitor", runThresholds},
		{"slo", "get, set or delete a model's latency SLO on a running monitor: the monitor finds the thresholds", runSLO},
		{"slots", "run the slot tracker: Dynamo's standalone slot tracker API over active-request accounting", runSlots},
		{"scrape", "publish a stock engine's load (vLLM, SGLang) from its Prometheus /metrics page", runScrape},
		{"cordon", "cordon a worker on a running monitor: listed busy, sent nothing new, its work moved off", runCordon},
		{"uncordon", "lift a worker's cordon on a running monitor", runUncordon},
		{"bench", "measure ingest, report-to-record latency, memory and admission on this machine beside the raw NATS limits; bench goodput: goodput under overload per admission policy", runBench},
		{"nats-config", "print the subject mappings an external NATS server needs for --partitions", runNATSConfig},
		{"healthcheck", "GET a health URL and fail unless it answers 2xx (for container HEALTHCHECKs)", runHealthcheck},
	}
}

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// run dispatches a subcommand and returns the process exit code: 0 on
// success or interrupt, 2 on a usage error, 1 otherwise.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		return runCommand(ctx, c, args[1:], stdout, stderr)
	}
	fmt.Fprintf(stderr, "workermon: unknown command %q\n\n", args[0])
	usage(stderr)
	return 2
}

// runCommand runs c until ctx ends (Ctrl-C, SIGTERM) and returns its exit
// code, as run documents. A command interrupted before it is up, such as
// while it waits for NATS, ends with ctx's context.Canceled: that is an
// interrupt too, exit 0.
func runCommand(ctx context.Context, c command, args []string, stdout, stderr io.Writer) int {
	err := c.run(ctx, args, stdout, stderr)
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		fmt.Fprintf(stderr, "workermon %s: %v\n", c.name, err)
		return 2
	case errors.Is(err, context.Canceled) && ctx.Err() != nil:
		return 0
	default:
		fmt.Fprintf(stderr, "workermon %s: %v\n", c.name, err)
		return 1
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: workermon <command> [flags]\n\nCommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'workermon <command> -h' for the flags of a command.")
}
