package bench

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// PrintGoodput writes r as a table, one row per scenario and policy, and
// names the policies not measured yet.
func PrintGoodput(w io.Writer, r GoodputResult) {
	fmt.Fprintf(w, "workermon bench goodput: %d simulated workers (engine profile %s), one process, seed %d", r.Workers, r.Profile, r.Seed)
	if r.Seeds > 1 {
		fmt.Fprintf(w, ", medians of %d seeds", r.Seeds)
	}
	fmt.Fprintf(w, "\nSLO (the profile's): TTFT ≤ %g ms, TPOT ≤ %g ms\n", r.SLO.TTFT, r.SLO.ITL)
	fmt.Fprintf(w, "capacity (policy none, 1 router, chat, ≥ 99 %% good): %.2f requests/s", r.CapacityRPS)
	if r.CapacityDocumentsRPS > 0 {
		fmt.Fprintf(w, "; for documents: %.2f requests/s", r.CapacityDocumentsRPS)
	}
	fmt.Fprintln(w)
	if c := Ceilings(r.Results); len(c) > 0 {
		fmt.Fprintf(w, "ceilings (what any policy could reach: the mean over the scenario of min(offered, the capacity for the workload offered)): %s\n", strings.Join(c, ", "))
	}
	fmt.Fprintf(w, "scenarios of %v: ramp 50 %% → 250 %% → 50 %% of capacity; burst 70 %% with 10× for 2 s every 10 s; shift 70 %%, chat then documents; "+
		"spike 40 %% with 200 %% for 1 s every 10 s (queue waits up to %v there); clients of burst and spike retry %d times as the OpenAI SDKs do, the others give up\n\n",
		r.Scenario, SpikeQueueMaxWait, ClientRetries)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tpolicy\trouters\tgoodput/s\t% of cap.\t% of ceil.\tTTFT p50\tTTFT p99\tTPOT p99\trejected\tfailed\tatt./req.\tqueue p99\tpreempt.\thost CPU\t")
	for _, row := range r.Results {
		policy := row.Policy
		if row.Policy == PolicyThresholdsBest {
			policy += " (" + strconv.FormatFloat(row.Decode, 'g', -1, 64) + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.2f\t%.0f %%\t%.0f %%\t%s\t%s\t%s\t%.1f %%\t%.1f %%\t%.2f\t%s\t%d\t%.0f %%\t\n", row.Scenario, policy, row.Routers,
			row.GoodputRPS, row.GoodputPct, row.CeilingPct, msText(row.TTFTp50), msText(row.TTFTp99), msText(row.ITLp99), row.RejectedPct,
			row.FailedPct, row.AttemptsPerRequest, msText(row.QueueWaitP99), row.Preemptions, row.CPUPct)
	}
	_ = tw.Flush()
	var scenarios []string
	for _, row := range r.Results {
		if !slices.Contains(scenarios, row.Scenario) {
			scenarios = append(scenarios, row.Scenario)
		}
	}
	for _, sc := range scenarios {
		rows := slices.DeleteFunc(slices.Clone(r.Results), func(row GoodputRow) bool { return row.Scenario != sc })
		fmt.Fprintf(w, "%s: %s\n", sc, Verdict(rows))
	}
	if lines := ByRouterLines(r.Results); len(lines) > 0 {
		fmt.Fprintf(w, "\nby router, load split %s (share: queue wait p90 of the attempts that waited, share of its attempts rejected or expired):\n", sharesText(r.RouterShares))
		for _, l := range lines {
			fmt.Fprintf(w, "  %s\n", l)
		}
	}
	for _, p := range r.Pending {
		fmt.Fprintf(w, "not measured yet: %s, %s\n", p.Name, p.Pending)
	}
	fmt.Fprintf(w, "\nthresholds: decode %g, prefill unset; thresholds-best: the best of decode %v per scenario (not on spike).\n"+
		"rejected: the share of attempts answered 503 or 429; failed: of the requests, those that never got a 200; att./req.: attempts a request sent.\n"+
		"host CPU: the whole machine's use over the row, all cores, not the benchmark's alone.\n",
		ThresholdsDecode, ThresholdsSweep)
	for _, p := range r.Policies {
		if d := PolicySettings(p); d != "" && p.Pending == "" {
			fmt.Fprintf(w, "%s: %s\n", p.Name, d)
		}
	}
	if r.Took > 0 {
		fmt.Fprintf(w, "took %v\n", r.Took.Round(time.Second))
	}
}

// Ceilings lists each scenario's ceiling of results, "ramp 11.72/s", in
// the order of the results.
func Ceilings(results []GoodputRow) []string {
	var out []string
	seen := map[string]bool{}
	for _, row := range results {
		if !seen[row.Scenario] && row.CeilingRPS > 0 {
			seen[row.Scenario] = true
			out = append(out, fmt.Sprintf("%s %.2f/s", row.Scenario, row.CeilingRPS))
		}
	}
	return out
}

// ByRouterLines renders the rows with figures per router, one line each:
// "burst queue, 3 routers: 60 %: 812 ms, 55.0 %; 30 %: …".
func ByRouterLines(results []GoodputRow) []string {
	var out []string
	for _, row := range results {
		if len(row.ByRouter) == 0 {
			continue
		}
		parts := make([]string, len(row.ByRouter))
		for i, br := range row.ByRouter {
			parts[i] = fmt.Sprintf("%.0f %%: %s, %.1f %%", 100*br.Share, msText(br.QueueWaitP90), br.RejectedPct)
		}
		out = append(out, fmt.Sprintf("%s %s: %s", row.Scenario, rowName(row), strings.Join(parts, "; ")))
	}
	return out
}

// sharesText renders router shares as "60/30/10".
func sharesText(shares []float64) string {
	parts := make([]string, len(shares))
	for i, s := range shares {
		parts[i] = strconv.FormatFloat(s, 'g', -1, 64)
	}
	return strings.Join(parts, "/")
}

// msText renders a time in ms, "-" when unknown.
func msText(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.0f ms", *v)
}

// PolicySettings describes how a policy of a later section configures the
// parts, "" for the others.
func PolicySettings(p Policy) string {
	var parts []string
	if q := p.Router; q.QueueMaxWait > 0 {
		s := "router --queue-max-wait " + q.QueueMaxWait.String()
		if q.QueuePace > 0 {
			s += " --queue-pace " + q.QueuePace.String()
		}
		if q.QueueMaxRequests > 0 {
			s += " --queue-max-requests " + strconv.Itoa(q.QueueMaxRequests)
		}
		parts = append(parts, s)
	}
	if t := p.Monitor.Thresholds; p.Monitor.SLO == nil && (t.KVCommitted != nil || t.QueueDelayMs != nil) {
		var s []string
		if t.KVCommitted != nil {
			s = append(s, "--kv-committed-threshold "+strconv.FormatFloat(*t.KVCommitted, 'g', -1, 64))
		}
		if t.QueueDelayMs != nil {
			s = append(s, "--queue-delay-threshold-ms "+strconv.FormatUint(*t.QueueDelayMs, 10))
		}
		if t.ActiveDecodeBlocks == nil && t.ActivePrefillTokens == nil && t.ActivePrefillTokensFrac == nil {
			s = append(s, "(no KV or prefill check)")
		}
		parts = append(parts, "serve "+strings.Join(s, " "))
	}
	if o := p.Monitor.SLO; o != nil {
		s := fmt.Sprintf("SLO TTFT ≤ %g ms, ITL ≤ %g ms for %g %% of the samples (mode enforce, set before the fleet starts)",
			ms(o.TTFT), ms(o.ITL), 100*o.Percentile)
		if p.Monitor.SLOInterval > 0 {
			s += ", serve --slo-interval " + p.Monitor.SLOInterval.String()
		}
		if p.Monitor.SLOPrefillMax > 0 {
			s += fmt.Sprintf(" --slo-prefill-range %d-%d", p.Monitor.SLOPrefillMin, p.Monitor.SLOPrefillMax)
		}
		parts = append(parts, s)
	}
	if len(parts) == 0 {
		return ""
	}
	if d := p.Monitor.Thresholds.ActiveDecodeBlocks; d != nil {
		from := "thresholds (defaults) decode " + strconv.FormatFloat(*d, 'g', -1, 64)
		if p.Monitor.SLO != nil {
			from = "the controller starts from decode " + strconv.FormatFloat(*d, 'g', -1, 64) + " (the thresholds policy's)"
		}
		parts = append(parts, from)
	}
	return strings.Join(parts, "; ")
}
