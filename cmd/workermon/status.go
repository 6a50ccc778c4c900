package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/watch"
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
	check, err := parseClientFlags(fs, args, stderr, "status [flags]\n\nPrints each model's busy set as the monitor holds it: the busy, free and stale\nworkers, whether the router rejects (ALL_BUSY) and the thresholds in force;\nthen every partition with the monitor that holds it and its epoch.")
	if err != nil {
		return err
	}
	if model != "" {
		if err := events.ValidateModel(model); err != nil {
			return fmt.Errorf("%w: --model: %v", errUsage, err)
		}
	}
	c, err := o.client()
	if err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	records, err := c.Records(ctx, model)
	if err != nil {
		return apiError(err)
	}
	parts, err := c.Partitions(ctx)
	if err != nil {
		return apiError(err)
	}
	slos, err := statusSLOs(ctx, c, model)
	if err != nil {
		return apiError(err)
	}
	if o.json {
		return printJSON(stdout, statusReply{Records: records, Partitions: parts, SLOs: slos})
	}
	if len(records) == 0 {
		fmt.Fprintln(stdout, noRecords(model, parts))
	} else if err := printStatus(stdout, records); err != nil {
		return err
	}
	if len(slos) > 0 {
		fmt.Fprintln(stdout)
		if err := printSLOs(stdout, slos); err != nil {
			return err
		}
	}
	fmt.Fprintln(stdout)
	return printPartitions(stdout, parts)
}

// noRecords says why the monitor lists no record: it holds no partition
// (a standby, or not settled yet), not the model's, or no worker of it
// has reported.
func noRecords(model string, parts api.PartitionsReply) string {
	switch {
	case len(parts.Held) == 0:
		return fmt.Sprintf("no model tracked: monitor %s holds no partition (a standby); the holders are listed below", parts.MonitorID)
	case model != "" && !slices.Contains(parts.Held, events.Partition(model, max(parts.Partitions, 1))):
		return fmt.Sprintf("model %q is in partition %d, which monitor %s does not hold; its holder is listed below",
			model, events.Partition(model, max(parts.Partitions, 1)), parts.MonitorID)
	case model != "":
		return fmt.Sprintf("model %q has no worker tracked by this monitor", model)
	}
	return "no model tracked: no worker has reported to this monitor recently"
}

// statusReply is what `workermon status --json` prints.
type statusReply struct {
	Records    []api.Record        `json:"records"`
	Partitions api.PartitionsReply `json:"partitions"`
	// SLOs are the models' SLOs with their controllers' state (§18).
	SLOs []api.SLOReply `json:"slos"`
}

// printPartitions writes one line per partition: its holder and epoch as
// the monitor observes the leases bucket.
func printPartitions(w io.Writer, r api.PartitionsReply) error {
	fmt.Fprintf(w, "monitor %s holds %d of %d partitions (lease TTL %s)\n", r.MonitorID, len(r.Held), r.Partitions, r.LeaseTTL)
	if r.Unmapped > 0 {
		fmt.Fprintf(w, "WARNING: %d reports arrived on unmapped subjects: the NATS servers lack the partition mapping (workermon nats-config)\n", r.Unmapped)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tHOLDER\tEPOCH\tLEASE")
	for _, p := range r.List {
		holder, state := p.MonitorID, fmt.Sprintf("renewed %.1fs ago", p.AgeSeconds)
		switch {
		case p.Free:
			holder, state = "-", "free"
		case p.Expired:
			state = fmt.Sprintf("EXPIRED (%.1fs)", p.AgeSeconds)
		}
		if p.Mine {
			holder += " (this monitor)"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\n", p.Partition, holder, p.Epoch, state)
	}
	return tw.Flush()
}

// printStatus writes one line per model: HARD lists the busy workers at
// hard level, AMBER the free workers at amber level (contract §15).
func printStatus(w io.Writer, records []api.Record) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tALL_BUSY\tBUSY\tHARD\tFREE\tAMBER\tSTALE\tTHRESHOLDS")
	for _, r := range records {
		allBusy := "no"
		if r.AllBusy {
			allBusy = "YES"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", watch.QuoteModel(r.Model), allBusy, idList(r.Busy, r.Reasons), idList(r.Hard, nil),
			idList(r.Free, nil), idList(r.Amber, nil), idList(r.Stale, nil), thresholdsCell(r.Thresholds))
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

// thresholdsCell renders the thresholds in force; an unset check of
// section 5 is "off", and those of section 21 are shown only when set.
func thresholdsCell(t events.Thresholds) string {
	s := "decode=" + fmtFloat(t.ActiveDecodeBlocks) + " prefill=" + fmtUint(t.ActivePrefillTokens) +
		" prefill_frac=" + fmtFloat(t.ActivePrefillTokensFrac)
	if t.KVCommitted != nil {
		s += " kv_committed=" + fmtFloat(t.KVCommitted)
	}
	if t.QueueDelayMs != nil {
		s += " queue_delay_ms=" + fmtUint(t.QueueDelayMs)
	}
	return s
}
