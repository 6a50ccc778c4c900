package bench

import (
	"fmt"
	"html"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// ReportFile is the name of the page WriteReport writes.
const ReportFile = "report.html"

// Style is how a policy's lines are drawn: a colour and a dash pattern,
// both distinct between the rows of a report, so that eight lines laid
// over each other can still be told apart (and in grey print).
type Style struct {
	Color string
	// Dash is the SVG stroke-dasharray, "" for a solid line.
	Dash string
}

// policyStyles are the rows' styles, in the order the rows first appear
// in the results: the same row has the same style in every scenario.
var policyStyles = []Style{
	{"#d62728", ""},
	{"#1f77b4", "7 3"},
	{"#2ca02c", "2 2"},
	{"#9467bd", "9 3 2 3"},
	{"#ff7f0e", "4 4"},
	{"#8c564b", "1 3"},
	{"#e377c2", "12 4"},
	{"#17becf", "6 2 2 2 2 2"},
	{"#bcbd22", "3 6"},
}

// Reference lines: the measured arrivals and the ceiling.
const (
	offeredColor = "#888"
	ceilingColor = "#222"
	ceilingDash  = "1 2"
)

// CloseMargin is the goodput margin below which the report calls a
// winner's lead within one seed's spread: between seeds of the same row,
// goodput moves by about 0.3 requests/s in 12 (docs/performance.md).
const CloseMargin = 0.03

// WriteReport writes dir/report.html: for each scenario, the offered load
// and each policy's goodput, TTFT p99 and rejections over time (and, where
// clients retry, attempts), as inline SVG charts in one self-contained page
// (no script, no outside asset), and a sentence naming the winner. It
// returns the page's path.
func WriteReport(dir string, r GoodputResult) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("bench: report: %w", err)
	}
	path := filepath.Join(dir, ReportFile)
	if err := os.WriteFile(path, []byte(ReportHTML(r)), 0o644); err != nil {
		return "", fmt.Errorf("bench: report: %w", err)
	}
	return path, nil
}

// RowStyles returns each row name's style (rowName), in the order the rows
// first appear in results.
func RowStyles(results []GoodputRow) map[string]Style {
	out := map[string]Style{}
	for _, row := range results {
		if _, ok := out[rowName(row)]; !ok {
			out[rowName(row)] = policyStyles[len(out)%len(policyStyles)]
		}
	}
	return out
}

// ReportHTML renders the report's page.
func ReportHTML(r GoodputResult) string {
	var b strings.Builder
	b.WriteString(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>workermon bench goodput</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}
.charts{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0}figcaption{font-size:.85em;color:#555;max-width:380px}
table{border-collapse:collapse;font-size:.85em}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}
td:first-child,th:first-child,td:nth-child(2),th:nth-child(2){text-align:left}
.legend span{display:inline-block;margin-right:1.2em;white-space:nowrap}.legend svg{vertical-align:middle;margin-right:.3em}
.verdict{max-width:60em}
</style></head><body>
`)
	fmt.Fprintf(&b, "<h1>workermon bench goodput</h1>\n<p>%d simulated workers, engine profile <code>%s</code>; SLO: TTFT ≤ %g ms, TPOT ≤ %g ms; capacity %.2f requests/s",
		r.Workers, html.EscapeString(r.Profile), r.SLO.TTFT, r.SLO.ITL, r.CapacityRPS)
	if r.CapacityDocumentsRPS > 0 {
		fmt.Fprintf(&b, " (documents: %.2f requests/s)", r.CapacityDocumentsRPS)
	}
	fmt.Fprintf(&b, "; scenarios of %v; seed %d", r.Scenario, r.Seed)
	if r.Seeds > 1 {
		fmt.Fprintf(&b, ", medians of %d seeds (the charts: the first seed)", r.Seeds)
	}
	b.WriteString(".</p>\n")
	for _, p := range r.Pending {
		fmt.Fprintf(&b, "<p>Not measured yet: <code>%s</code>, %s.</p>\n", html.EscapeString(p.Name), html.EscapeString(p.Pending))
	}
	for _, p := range r.Policies {
		if d := PolicySettings(p); d != "" && p.Pending == "" {
			fmt.Fprintf(&b, "<p><code>%s</code>: %s.</p>\n", html.EscapeString(p.Name), html.EscapeString(d))
		}
	}
	b.WriteString("<p>Lines: the offered load is the requests that arrived in each second (measured, not the scenario's target); " +
		"goodput counts the good requests by the second they arrived, so it never exceeds it. The ceiling (black, dotted) is what any policy could reach: " +
		"min(the offered rate, the fleet's capacity for the workload offered) at each moment. Each policy has its own colour and dash. " +
		"A TTFT line carries its last value through a second in which the policy served no request (no TTFT was measured) and marks that second with an open circle. " +
		"Host CPU is the whole machine's use over the row, not the benchmark's alone.</p>\n")
	styles := RowStyles(r.Results)
	var scenarios []string
	for _, row := range r.Results {
		if !slices.Contains(scenarios, row.Scenario) {
			scenarios = append(scenarios, row.Scenario)
		}
	}
	for _, sc := range scenarios {
		var rows []GoodputRow
		for _, row := range r.Results {
			if row.Scenario == sc {
				rows = append(rows, row)
			}
		}
		fmt.Fprintf(&b, "<section class=\"scenario\" id=\"%s\">\n<h2>%s</h2>\n", html.EscapeString(sc), html.EscapeString(sc))
		fmt.Fprintf(&b, "<p class=\"verdict\">%s</p>\n", html.EscapeString(Verdict(rows)))
		b.WriteString("<div class=\"legend\">")
		b.WriteString(legendItem("offered (measured arrivals)", Style{offeredColor, ""}, 3))
		if len(rows) > 0 && rows[0].CeilingRPS > 0 {
			b.WriteString(legendItem(fmt.Sprintf("ceiling (%.2f/s over the scenario)", rows[0].CeilingRPS), Style{ceilingColor, ceilingDash}, 1.8))
		}
		for _, row := range rows {
			b.WriteString(legendItem(rowName(row), styles[rowName(row)], 1.6))
		}
		b.WriteString("</div>\n<div class=\"charts\">\n")
		offered := referenceLine("offered", "offered (measured arrivals)", rows, func(p Point) float64 { return float64(p.Offered) }, Style{offeredColor, ""}, 3)
		reqs := []line{offered}
		if len(rows) > 0 && rows[0].CeilingRPS > 0 {
			reqs = append(reqs, referenceLine("ceiling", "ceiling", rows, func(p Point) float64 { return p.CeilingRPS }, Style{ceilingColor, ceilingDash}, 1.8))
		}
		b.WriteString(chart("requests/s: offered (grey: the measured arrivals), the ceiling (black, dotted) and goodput, 3 s averages",
			append(reqs, policyLines(rows, styles, func(p Point) float64 { return float64(p.Good) }, true, false)...), nil))
		slo := r.SLO.TTFT
		b.WriteString(chart("TTFT p99 of each second, ms (dashed: the SLO; ○: no request served that second, the last value carried)",
			policyLines(rows, styles, func(p Point) float64 { return p.TTFTp99 }, false, true), &slo))
		b.WriteString(chart("rejections/s (attempts answered 503 or 429), 3 s averages",
			policyLines(rows, styles, func(p Point) float64 { return float64(p.Rejected) }, true, false), nil))
		if retrying(rows) {
			b.WriteString(chart("attempts/s (first sends and retries) beside the offered arrivals (grey), 3 s averages",
				append([]line{offered}, policyLines(rows, styles, func(p Point) float64 { return float64(p.Attempts) }, true, false)...), nil))
		}
		b.WriteString("</div>\n<table><tr><th>policy</th><th>routers</th><th>goodput/s</th><th>% of capacity</th><th>% of ceiling</th><th>TTFT p50</th><th>TTFT p99</th><th>TPOT p99</th><th>rejected</th><th>failed</th><th>attempts/request</th><th>queue wait p99</th><th>preemptions</th><th>host CPU</th></tr>\n")
		for _, row := range rows {
			fmt.Fprintf(&b, "<tr><td>%s</td><td>%d</td><td>%.2f</td><td>%.0f %%</td><td>%.0f %%</td><td>%s</td><td>%s</td><td>%s</td><td>%.1f %%</td><td>%.1f %%</td><td>%.2f</td><td>%s</td><td>%d</td><td>%.0f %%</td></tr>\n",
				html.EscapeString(rowName(row)), row.Routers, row.GoodputRPS, row.GoodputPct, row.CeilingPct, msText(row.TTFTp50), msText(row.TTFTp99),
				msText(row.ITLp99), row.RejectedPct, row.FailedPct, row.AttemptsPerRequest, msText(row.QueueWaitP99), row.Preemptions, row.CPUPct)
		}
		b.WriteString("</table>\n")
		if lines := ByRouterLines(rows); len(lines) > 0 {
			fmt.Fprintf(&b, "<p class=\"by-router\">By router, load split %s (share: queue wait p90 of the attempts that waited, share of its attempts rejected or expired):</p>\n<ul>\n",
				html.EscapeString(sharesText(r.RouterShares)))
			for _, l := range lines {
				fmt.Fprintf(&b, "<li>%s</li>\n", html.EscapeString(l))
			}
			b.WriteString("</ul>\n")
		}
		b.WriteString("</section>\n")
	}
	b.WriteString("</body></html>\n")
	return b.String()
}

// Verdict is a sentence naming the winner of a scenario's rows, the one
// with the most goodput (ties: fewer failed requests, then fewer
// preemptions), and why, from the figures: its margin over the runner-up,
// the best row of another policy (called within one seed's spread under
// CloseMargin), the figures on which it beat the runner-up, and what the
// last row lost. When every row has the same goodput it says there is no
// winner.
func Verdict(rows []GoodputRow) string {
	if len(rows) == 0 {
		return ""
	}
	order := slices.Clone(rows)
	slices.SortStableFunc(order, func(a, b GoodputRow) int {
		switch {
		case a.GoodputRPS != b.GoodputRPS:
			return cmpDesc(a.GoodputRPS, b.GoodputRPS)
		case a.FailedPct != b.FailedPct:
			return cmpDesc(b.FailedPct, a.FailedPct)
		}
		return cmpDesc(float64(b.Preemptions), float64(a.Preemptions))
	})
	w := order[0]
	if last := order[len(order)-1]; len(order) > 1 && last.GoodputRPS == w.GoodputRPS {
		return fmt.Sprintf("No winner: all %d rows reached %.2f good requests/s (%.0f %% of capacity): this load never made admission matter.",
			len(order), w.GoodputRPS, w.GoodputPct)
	}
	s := fmt.Sprintf("Winner: %s, with %.2f good requests/s (%.0f %% of capacity", rowName(w), w.GoodputRPS, w.GoodputPct)
	if w.CeilingRPS > 0 {
		s += fmt.Sprintf(", %.0f %% of the ceiling", w.CeilingPct)
	}
	s += ")"
	if len(order) == 1 {
		return s + "."
	}
	ru := order[1]
	for _, r := range order[1:] {
		if r.Policy != w.Policy {
			ru = r
			break
		}
	}
	margin := w.GoodputRPS - ru.GoodputRPS
	if margin == 0 {
		s += fmt.Sprintf(", tied on goodput with %s, first on fewer failed requests, then fewer preemptions", rowName(ru))
	} else {
		s += fmt.Sprintf(", %.2f/s ahead of %s (%.2f/s)", margin, rowName(ru), ru.GoodputRPS)
	}
	if margin > 0 && ru.GoodputRPS > 0 && margin/ru.GoodputRPS < CloseMargin {
		s += fmt.Sprintf(": less than %.0f %%, within what one seed moves, so a tie on this run", 100*CloseMargin)
	}
	s += "."
	var why []string
	if w.Preemptions < ru.Preemptions {
		why = append(why, fmt.Sprintf("fewer preemptions (%d against %d)", w.Preemptions, ru.Preemptions))
	}
	if w.TTFTp99 != nil && ru.TTFTp99 != nil && *w.TTFTp99 < *ru.TTFTp99 {
		why = append(why, fmt.Sprintf("a lower TTFT p99 (%.0f ms against %.0f ms)", *w.TTFTp99, *ru.TTFTp99))
	}
	if w.FailedPct < ru.FailedPct {
		why = append(why, fmt.Sprintf("fewer failed requests (%.1f %% against %.1f %%)", w.FailedPct, ru.FailedPct))
	}
	if w.RejectedPct < ru.RejectedPct {
		why = append(why, fmt.Sprintf("fewer rejected attempts (%.1f %% against %.1f %%)", w.RejectedPct, ru.RejectedPct))
	}
	if len(why) > 0 {
		s += " Against the runner-up it had " + joinAnd(why) + "."
	} else {
		s += " It beat the runner-up on no other figure: it served more of what it admitted."
	}
	if last := order[len(order)-1]; len(order) > 2 && last.GoodputRPS < w.GoodputRPS {
		s += fmt.Sprintf(" Last: %s, %.2f/s, with %d preemptions", rowName(last), last.GoodputRPS, last.Preemptions)
		if last.TTFTp99 != nil {
			s += fmt.Sprintf(" and a TTFT p99 of %.0f ms", *last.TTFTp99)
		}
		s += fmt.Sprintf(" (the winner: %d preemptions, TTFT p99 %s).", w.Preemptions, msText(w.TTFTp99))
	}
	return s
}

// cmpDesc orders a before b when a is larger.
func cmpDesc(a, b float64) int {
	switch {
	case a > b:
		return -1
	case a < b:
		return 1
	}
	return 0
}

// joinAnd joins items as "a, b and c".
func joinAnd(items []string) string {
	if len(items) < 2 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " and " + items[len(items)-1]
}

// retrying reports whether the clients of any of rows retry.
func retrying(rows []GoodputRow) bool {
	for _, row := range rows {
		if row.Retries > 0 {
			return true
		}
	}
	return false
}

func rowName(row GoodputRow) string {
	s := row.Policy
	if row.Policy == PolicyThresholdsBest {
		s += " (" + strconv.FormatFloat(row.Decode, 'g', -1, 64) + ")"
	}
	if row.Routers > 1 {
		s += fmt.Sprintf(", %d routers", row.Routers)
	}
	return s
}

// legendItem is a legend's entry: a short stretch of the line and its
// name.
func legendItem(name string, st Style, width float64) string {
	return fmt.Sprintf("<span><svg width=\"34\" height=\"8\" aria-hidden=\"true\"><line x1=\"1\" x2=\"33\" y1=\"4\" y2=\"4\" stroke=\"%s\" stroke-width=\"%g\"%s/></svg>%s</span>",
		st.Color, width, dashAttr(st.Dash), html.EscapeString(name))
}

func dashAttr(dash string) string {
	if dash == "" {
		return ""
	}
	return ` stroke-dasharray="` + dash + `"`
}

// line is one line of a chart: a value a second, NaN where there is none
// (a gap); carried marks the values carried from an earlier second.
type line struct {
	class, name string
	style       Style
	width       float64
	values      []float64
	carried     []bool
}

// referenceLine is a grey line of value over the first row's seconds
// (every row of a scenario offers the same arrivals: the same seed).
func referenceLine(class, name string, rows []GoodputRow, value func(Point) float64, st Style, width float64) line {
	l := line{class: class, name: name, style: st, width: width}
	if len(rows) > 0 {
		l.values = smooth(values(rows[0].Series, value))
	}
	return l
}

// policyLines is a line of value per row. smoothed takes 3 s averages;
// carry carries the last value through a second without one (NaN), marked.
func policyLines(rows []GoodputRow, styles map[string]Style, value func(Point) float64, smoothed, carry bool) []line {
	out := make([]line, len(rows))
	for i, row := range rows {
		vs := values(row.Series, value)
		if smoothed {
			vs = smooth(vs)
		}
		l := line{class: "policy", name: rowName(row), style: styles[rowName(row)], width: 1.6, values: vs}
		if carry {
			l.values, l.carried = carryForward(vs)
		}
		out[i] = l
	}
	return out
}

func values(pts []Point, value func(Point) float64) []float64 {
	vs := make([]float64, len(pts))
	for i, p := range pts {
		vs[i] = value(p)
	}
	return vs
}

// smooth returns each value as the average of the one before, itself and
// the one after (Poisson arrivals make single seconds noisy), NaNs left
// out of the averages.
func smooth(vs []float64) []float64 {
	out := make([]float64, len(vs))
	for j := range vs {
		sum, n := 0.0, 0
		for k := max(0, j-1); k <= min(len(vs)-1, j+1); k++ {
			if !math.IsNaN(vs[k]) {
				sum += vs[k]
				n++
			}
		}
		out[j] = math.NaN()
		if n > 0 {
			out[j] = sum / float64(n)
		}
	}
	return out
}

// carryForward replaces each NaN after a value by the last value, and
// says which it replaced. NaNs before the first value stay (there is
// nothing to carry).
func carryForward(vs []float64) ([]float64, []bool) {
	out, carried := slices.Clone(vs), make([]bool, len(vs))
	last := math.NaN()
	for i, v := range vs {
		if !math.IsNaN(v) {
			last = v
			continue
		}
		if !math.IsNaN(last) {
			out[i], carried[i] = last, true
		}
	}
	return out, carried
}

// chart draws one SVG line chart of lines over the seconds, and a dashed
// level at hline (when not nil). A NaN leaves a gap; a carried value is
// marked with an open circle.
func chart(title string, lines []line, hline *float64) string {
	const w, h, left, right, top, bottom = 380.0, 220.0, 44.0, 10.0, 10.0, 28.0
	maxY, maxT := 0.0, 1.0
	for _, l := range lines {
		maxT = math.Max(maxT, float64(len(l.values)))
		for _, v := range l.values {
			if !math.IsNaN(v) {
				maxY = math.Max(maxY, v)
			}
		}
	}
	if hline != nil {
		maxY = math.Max(maxY, *hline)
	}
	maxY = niceCeil(maxY)
	x := func(t float64) float64 { return left + (w-left-right)*t/maxT }
	y := func(v float64) float64 { return top + (h-top-bottom)*(1-v/maxY) }
	var b strings.Builder
	fmt.Fprintf(&b, "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"%g\" height=\"%g\" viewBox=\"0 0 %g %g\" role=\"img\" aria-label=\"%s\">\n",
		w, h, w, h, html.EscapeString(title))
	fmt.Fprintf(&b, "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"#ccc\"/>\n", left, top, w-left-right, h-top-bottom)
	for i := 0; i <= 4; i++ {
		v := maxY * float64(i) / 4
		fmt.Fprintf(&b, "<text x=\"%g\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%s</text>\n", left-4, y(v)+3, axisLabel(v))
		if i > 0 && i < 4 {
			fmt.Fprintf(&b, "<line x1=\"%g\" x2=\"%g\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>\n", left, w-right, y(v), y(v))
		}
	}
	for t := 0.0; t <= maxT; t += tickStep(maxT) {
		fmt.Fprintf(&b, "<text x=\"%.1f\" y=\"%g\" font-size=\"10\" text-anchor=\"middle\">%gs</text>\n", x(t), h-bottom+14, t)
	}
	if hline != nil {
		fmt.Fprintf(&b, "<line x1=\"%g\" x2=\"%g\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\n", left, w-right, y(*hline), y(*hline))
	}
	for _, l := range lines {
		var d strings.Builder
		pen := false
		for i, v := range l.values {
			if math.IsNaN(v) {
				pen = false
				continue
			}
			cmd := "L"
			if !pen {
				cmd = "M"
			}
			fmt.Fprintf(&d, "%s%.1f %.1f ", cmd, x(float64(i)+0.5), y(v))
			pen = true
		}
		if d.Len() == 0 {
			continue
		}
		fmt.Fprintf(&b, "<path class=\"series %s\" data-series=\"%s\" d=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%g\"%s/>\n",
			l.class, html.EscapeString(l.name), strings.TrimSpace(d.String()), l.style.Color, l.width, dashAttr(l.style.Dash))
		for i, c := range l.carried {
			if c {
				fmt.Fprintf(&b, "<circle class=\"carried\" data-series=\"%s\" cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"#fff\" stroke=\"%s\"/>\n",
					html.EscapeString(l.name), x(float64(i)+0.5), y(l.values[i]), l.style.Color)
			}
		}
	}
	fmt.Fprintf(&b, "</svg><figcaption>%s</figcaption></figure>\n", html.EscapeString(title))
	return b.String()
}

// axisLabel renders a value of the y axis in a few characters.
func axisLabel(v float64) string {
	if v >= 10_000 {
		return strconv.FormatFloat(v/1000, 'f', -1, 64) + "k"
	}
	return strconv.FormatFloat(math.Round(v*100)/100, 'f', -1, 64)
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten (1 for v ≤ 0).
func niceCeil(v float64) float64 {
	if v <= 0 || math.IsNaN(v) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// tickStep is the spacing of the time axis's labels, in seconds.
func tickStep(maxT float64) float64 {
	switch {
	case maxT <= 15:
		return 2
	case maxT <= 40:
		return 5
	}
	return 10
}
