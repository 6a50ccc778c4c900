package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
)

// statusMaxIDs is how many worker ids a cell of `workermon status` shows
// before it says how many more there are.
const statusMaxIDs = 8

// runStatus is `workermon status`: the busy sets as a table.
func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := defaultClientOptions()
	var model string
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	o.flags(fs, false)
	fs.StringVar(&model, "model", "", "show only this model")
	if err := parseClientFlags(fs, args, stderr, "status [flags]\n\nPrints each model's busy set as the monitor holds it: the busy, free and stale\nworkers, whether the router rejects (ALL_BUSY) and the thresholds in force."); err != nil {
		return err
	}
	if model != "" {
		if err := events.ValidateModel(model); err != nil {
			return fmt.Errorf("%w: --model: %v", errUsage, err)
		}
	}
	c, err := o.client()
	if err != nil {
		return err
	}
	records, err := c.Records(ctx, model)
	if err != nil {
		return apiError(err)
	}
	if o.json {
		return printJSON(stdout, api.RecordsReply{Records: records})
	}
	if len(records) == 0 {
		if model != "" {
			fmt.Fprintf(stdout, "model %q has no worker tracked by this monitor\n", model)
		} else {
			fmt.Fprintln(stdout, "no model tracked: no worker has reported to this monitor recently")
		}
		return nil
	}
	return printStatus(stdout, records)
}

// printStatus writes one line per model.
func printStatus(w io.Writer, records []api.Record) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tALL_BUSY\tBUSY\tFREE\tSTALE\tTHRESHOLDS")
	for _, r := range records {
		allBusy := "no"
		if r.AllBusy {
			allBusy = "YES"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.Model, allBusy, idList(r.Busy, r.Reasons), idList(r.Free, nil),
			idList(r.Stale, nil), thresholdsCell(r.Thresholds))
	}
	return tw.Flush()
}

// idList renders a count and the ids, each busy one with its reason:
// "2 [11:kv 12:prefill]".
func idList(ids []uint64, reasons map[string]string) string {
	if len(ids) == 0 {
		return "0"
	}
	var b strings.Builder
	b.WriteString(strconv.Itoa(len(ids)))
	b.WriteString(" [")
	for i, id := range ids {
		if i == statusMaxIDs {
			fmt.Fprintf(&b, " …+%d", len(ids)-i)
			break
		}
		if i > 0 {
			b.WriteByte(' ')
		}
		s := strconv.FormatUint(id, 10)
		b.WriteString(s)
		if r := reasons[s]; r != "" {
			b.WriteString(":" + r)
		}
	}
	b.WriteByte(']')
	return b.String()
}

// thresholdsCell renders the thresholds in force; an unset check is "off".
func thresholdsCell(t events.Thresholds) string {
	return "decode=" + fmtFloat(t.ActiveDecodeBlocks) + " prefill=" + fmtUint(t.ActivePrefillTokens) +
		" prefill_frac=" + fmtFloat(t.ActivePrefillTokensFrac)
}
