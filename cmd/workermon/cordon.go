package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/watch"
)

// runCordon is `workermon cordon`: with --model and --worker-id it cordons
// the worker; with neither it lists the cordons.
func runCordon(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return cordonCommand(ctx, "cordon", args, stdout, stderr)
}

// runUncordon is `workermon uncordon --model M --worker-id N`.
func runUncordon(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return cordonCommand(ctx, "uncordon", args, stdout, stderr)
}

func cordonCommand(ctx context.Context, name string, args []string, stdout, stderr io.Writer) error {
	o := defaultClientOptions()
	var model string
	var worker int64 = -1
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	o.flags(fs, true)
	fs.StringVar(&model, "model", "", "model name, as the engines report it")
	fs.Int64Var(&worker, "worker-id", worker, "the worker's id")
	synopsis := name + " --model M --worker-id N [flags]"
	if name == "cordon" {
		synopsis += "\n       workermon cordon [flags]   (lists the cordons)"
	}
	check, err := parseClientFlags(fs, args, stderr, synopsis)
	if err != nil {
		return err
	}
	list := name == "cordon" && model == "" && worker < 0
	if !list {
		if model == "" || worker < 0 {
			return fmt.Errorf("%w: give --model and --worker-id", errUsage)
		}
		if err := events.ValidateModel(model); err != nil {
			return fmt.Errorf("%w: --model: %v", errUsage, err)
		}
	}
	c, err := o.client()
	if err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	switch {
	case list:
		cordons, err := c.Cordons(ctx)
		if err != nil {
			return apiError(err)
		}
		if o.json {
			return printJSON(stdout, cordons)
		}
		return printCordons(stdout, cordons)
	case name == "cordon":
		cordon, err := c.Cordon(ctx, model, uint64(worker))
		if err != nil {
			return apiError(err)
		}
		if o.json {
			return printJSON(stdout, cordon)
		}
		fmt.Fprintf(stdout, "cordoned worker %d of %s: listed busy (reason cordoned) while it reports; routers send it nothing new\n",
			cordon.WorkerID, cordon.Model)
	default:
		reply, err := c.Uncordon(ctx, model, uint64(worker))
		if err != nil {
			return apiError(err)
		}
		if o.json {
			return printJSON(stdout, reply)
		}
		if reply.WasCordoned {
			fmt.Fprintf(stdout, "uncordoned worker %d of %s\n", reply.WorkerID, reply.Model)
		} else {
			fmt.Fprintf(stdout, "worker %d of %s was not cordoned\n", reply.WorkerID, reply.Model)
		}
	}
	return nil
}

// printCordons writes the cordons as a table.
func printCordons(w io.Writer, cordons []overrides.Cordon) error {
	if len(cordons) == 0 {
		fmt.Fprintln(w, "no worker is cordoned")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tWORKER_ID\tCORDONED_AT")
	for _, c := range cordons {
		fmt.Fprintf(tw, "%s\t%d\t%s\n", watch.QuoteModel(c.Model), c.WorkerID, time.Unix(0, c.CordonedAt).UTC().Format(time.RFC3339))
	}
	return tw.Flush()
}
