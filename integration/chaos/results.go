package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"time"
)

// Results is what a run prints and writes as JSON.
type Results struct {
	Seed           uint64                     `json:"seed"`
	Duration       string                     `json:"duration"`
	Start          time.Time                  `json:"start"`
	End            time.Time                  `json:"end"`
	LoadRPS        float64                    `json:"load_rps"`
	Faults         []FaultResult              `json:"faults"`
	FaultsByKind   map[Kind]int               `json:"faults_by_kind"`
	Violations     []Violation                `json:"violations"`
	Inconclusive   []Violation                `json:"inconclusive"`
	FailOpen       []Window                   `json:"fail_open_windows"`
	LongestOpenMS  float64                    `json:"longest_fail_open_ms"`
	RecoveryP50MS  *float64                   `json:"recovery_p50_ms"`
	RecoveryP99MS  *float64                   `json:"recovery_p99_ms"`
	RecoveryMaxMS  *float64                   `json:"recovery_max_ms"`
	Requests       map[string]map[Outcome]int `json:"requests"`
	Growth         []GrowthRow                `json:"growth"`
	CheckerBlindMS float64                    `json:"checker_blind_ms"`
	Pass           bool                       `json:"pass"`
	recovery       []time.Duration
}

// cpuInconclusive is the host CPU use above which every second around a
// fault makes it inconclusive (contract §20: "stayed above 90 %").
const cpuInconclusive = 90

func (d *driver) results(start, end time.Time, faults []FaultResult, load *Load) *Results {
	r := &Results{Seed: d.seed, Duration: d.duration.String(), Start: start, End: end,
		LoadRPS: load.RPS, FaultsByKind: map[Kind]int{}, Requests: load.Counts()}
	// CPU around each fault: from 5 s before it to its judgement.
	for i := range faults {
		f := &faults[i]
		if mean, lowest, ok := d.cpu.Around(f.Start.Add(-5*time.Second), f.Judged); ok {
			f.CPU = math.Round(mean*10) / 10
			f.Inconclusive = lowest > cpuInconclusive
		}
		r.FaultsByKind[f.Kind]++
		if f.Failed == "" && !f.Judged.IsZero() {
			r.recovery = append(r.recovery, f.Recovery)
		}
	}
	r.Faults = faults
	// around returns the fault a moment falls in: from its start to its
	// judgement plus stale-list-after (a window opens that long after the
	// last put).
	around := func(t time.Time) *FaultResult {
		for i := range faults {
			f := &faults[i]
			if !t.Before(f.Start) && !t.After(f.Judged.Add(d.cfg.StaleListAfter)) {
				return f
			}
		}
		return nil
	}
	d.mu.Lock()
	all := slices.Clone(d.viol)
	d.mu.Unlock()
	epochs, windows := d.ck.records.Close(end)
	all = append(all, epochs...)
	blind := d.ck.Blind(end)
	for _, b := range blind {
		r.CheckerBlindMS += float64(b.Len) / float64(time.Millisecond)
	}
	for _, w := range windows {
		for _, b := range blind {
			if w.Start.Before(b.Start.Add(b.Len)) && b.Start.Before(w.Start.Add(w.Len)) {
				w.Blind = true
			}
		}
		r.FailOpen = append(r.FailOpen, w)
		r.LongestOpenMS = max(r.LongestOpenMS, float64(w.Len)/float64(time.Millisecond))
		v := Violation{At: w.Start, Rule: RuleFailOpen, What: fmt.Sprintf("%s: record older than %v for %v from %s",
			w.Model, d.cfg.StaleListAfter, w.Len.Round(time.Millisecond), w.Start.Format("15:04:05.000"))}
		if w.Blind {
			v.What += " (the checker could not read the bucket for part of it)"
			v.Inconclusive = true
		}
		all = append(all, v)
	}
	growth, rows := d.growth.Close()
	all = append(all, growth...)
	r.Growth = rows
	for _, v := range all {
		if f := around(v.At); f != nil && v.Fault == 0 {
			v.Fault = f.N
		}
		if v.Fault != 0 {
			for _, f := range faults {
				if f.N == v.Fault && f.Inconclusive {
					v.Inconclusive = true
				}
			}
		}
		if v.Inconclusive {
			r.Inconclusive = append(r.Inconclusive, v)
		} else {
			r.Violations = append(r.Violations, v)
		}
	}
	slices.SortFunc(r.Violations, func(a, b Violation) int { return a.At.Compare(b.At) })
	if len(r.recovery) > 0 {
		p50, p99, mx := percentileMS(r.recovery, 0.5), percentileMS(r.recovery, 0.99), percentileMS(r.recovery, 1)
		r.RecoveryP50MS, r.RecoveryP99MS, r.RecoveryMaxMS = &p50, &p99, &mx
	}
	r.Pass = len(r.Violations) == 0
	if r.Violations == nil {
		r.Violations = []Violation{}
	}
	if r.Inconclusive == nil {
		r.Inconclusive = []Violation{}
	}
	if r.FailOpen == nil {
		r.FailOpen = []Window{}
	}
	return r
}

// percentileMS is the nearest-rank percentile q of ds, in milliseconds.
func percentileMS(ds []time.Duration, q float64) float64 {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	i = min(max(i, 0), len(s)-1)
	return math.Round(float64(s[i])/float64(time.Millisecond)*10) / 10
}

func msString(p *float64) string {
	if p == nil {
		return "none"
	}
	return fmt.Sprintf("%.0f ms", *p)
}

// print writes the summary.
func (r *Results) print(w io.Writer) {
	fmt.Fprintf(w, "\n== chaos run: seed %d, %s of load at %.1f requests/s, %s to %s\n", r.Seed, r.Duration, r.LoadRPS,
		r.Start.Format("15:04:05"), r.End.Format("15:04:05"))
	fmt.Fprintf(w, "faults injected (%d):\n", len(r.Faults))
	for _, f := range r.Faults {
		state := fmt.Sprintf("final state %v after healing", f.Recovery.Round(time.Millisecond))
		if f.Failed != "" {
			state = fmt.Sprintf("NO final state within %v", recoveryWithin)
		}
		inc := ""
		if f.Inconclusive {
			inc = fmt.Sprintf(", INCONCLUSIVE (CPU stayed above %d %%)", cpuInconclusive)
		}
		fmt.Fprintf(w, "  #%-3d %-14s %-10s down %-6v %s, CPU %.0f %%%s\n", f.N, f.Kind, f.Target,
			f.Healed.Sub(f.Start).Round(100*time.Millisecond), state, f.CPU, inc)
	}
	fmt.Fprintf(w, "faults by kind:")
	for _, k := range Kinds {
		fmt.Fprintf(w, " %s %d", k, r.FaultsByKind[k])
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "recovery (fault healed → final state): p50 %s, p99 %s, max %s over %d faults\n",
		msString(r.RecoveryP50MS), msString(r.RecoveryP99MS), msString(r.RecoveryMaxMS), len(r.recovery))
	fmt.Fprintf(w, "fail-open windows: %d, longest %.0f ms\n", len(r.FailOpen), r.LongestOpenMS)
	fmt.Fprintf(w, "requests by class and outcome:\n")
	for _, c := range []string{"sheddable", "standard", "critical"} {
		fmt.Fprintf(w, "  %-9s", c)
		for _, o := range []Outcome{OutOK, OutBusy, OutShed, OutCut, OutRouterDown, OutCancelled, OutAborted, OutViolation} {
			fmt.Fprintf(w, " %s=%d", o, r.Requests[c][o])
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "heap and goroutines (baseline of the 2nd minute → max after):\n")
	for _, g := range r.Growth {
		missed := ""
		if g.Missed > 0 {
			missed = fmt.Sprintf(", %d scrapes failed", g.Missed)
		}
		fmt.Fprintf(w, "  %-12s heap %.1f → %.1f MB, goroutines %.0f → %.0f%s\n", g.Process,
			g.Base["go_memstats_heap_alloc_bytes"]/1e6, g.Max["go_memstats_heap_alloc_bytes"]/1e6,
			g.Base["go_goroutines"], g.Max["go_goroutines"], missed)
	}
	if r.CheckerBlindMS > 0 {
		fmt.Fprintf(w, "the checker could not read the bucket for %.0f ms in all\n", r.CheckerBlindMS)
	}
	printViolations(w, "inconclusive", r.Inconclusive)
	printViolations(w, "violations", r.Violations)
}

// printViolations writes a heading with the count, then one line each.
func printViolations(w io.Writer, heading string, vs []Violation) {
	fmt.Fprintf(w, "%s: %d\n", heading, len(vs))
	for _, v := range vs {
		fmt.Fprintf(w, "  %s %s (fault #%d): %s\n", v.At.Format("15:04:05.000"), v.Rule, v.Fault, v.What)
	}
}
