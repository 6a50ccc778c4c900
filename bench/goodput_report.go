package bench

import (
	"fmt"
	"html"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ReportFile is the name of the page WriteReport writes.
const ReportFile = "report.html"

// policyColors are the lines' colours, in the order of the rows.
var policyColors = []string{"#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"}

// WriteReport writes dir/report.html: for each scenario, the offered load
// and each policy's goodput, TTFT p99 and rejections over time, as inline
// SVG charts in one self-contained page (no script, no outside asset). It
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

// ReportHTML renders the report's page.
func ReportHTML(r GoodputResult) string {
	var b strings.Builder
	b.WriteString(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>workermon bench goodput</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}
.charts{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0}figcaption{font-size:.85em;color:#555}
table{border-collapse:collapse;font-size:.85em}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}
td:first-child,th:first-child,td:nth-child(2),th:nth-child(2){text-align:left}
.legend span{display:inline-block;margin-right:1.2em}.legend i{display:inline-block;width:1.6em;height:3px;vertical-align:middle;margin-right:.3em}
</style></head><body>
`)
	fmt.Fprintf(&b, "<h1>workermon bench goodput</h1>\n<p>%d simulated workers, engine profile <code>%s</code>; SLO: TTFT ≤ %g ms, TPOT ≤ %g ms; capacity %.2f requests/s; scenarios of %v; seed %d.</p>\n",
		r.Workers, html.EscapeString(r.Profile), r.SLO.TTFT, r.SLO.ITL, r.CapacityRPS, r.Scenario, r.Seed)
	for _, p := range r.Pending {
		fmt.Fprintf(&b, "<p>Not measured yet: <code>%s</code>, %s.</p>\n", html.EscapeString(p.Name), html.EscapeString(p.Pending))
	}
	for _, p := range r.Policies {
		if d := PolicySettings(p); d != "" && p.Pending == "" {
			fmt.Fprintf(&b, "<p><code>%s</code>: %s.</p>\n", html.EscapeString(p.Name), html.EscapeString(d))
		}
	}
	var scenarios []string
	for _, row := range r.Results {
		if !containsString(scenarios, row.Scenario) {
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
		fmt.Fprintf(&b, "<section class=\"scenario\" id=\"%s\">\n<h2>%s</h2>\n<div class=\"legend\"><span><i style=\"background:#888\"></i>offered</span>", html.EscapeString(sc), html.EscapeString(sc))
		for i, row := range rows {
			fmt.Fprintf(&b, "<span><i style=\"background:%s\"></i>%s</span>", policyColors[i%len(policyColors)], html.EscapeString(rowName(row)))
		}
		b.WriteString("</div>\n<div class=\"charts\">\n")
		offered := func(p Point) float64 { return p.TargetRPS }
		b.WriteString(chart("requests/s: offered (grey) and goodput, 3 s averages", rows, offered,
			func(p Point) float64 { return float64(p.Good) }, nil, true))
		slo := r.SLO.TTFT
		b.WriteString(chart("TTFT p99 of each second, ms (dashed: the SLO)", rows, nil,
			func(p Point) float64 { return p.TTFTp99 }, &slo, false))
		b.WriteString(chart("rejections/s (attempts answered 503 or 429), 3 s averages", rows, nil,
			func(p Point) float64 { return float64(p.Rejected) }, nil, true))
		if retrying(rows) {
			b.WriteString(chart("attempts/s (first sends and retries) beside the offered arrivals (grey), 3 s averages", rows,
				func(p Point) float64 { return float64(p.Offered) }, func(p Point) float64 { return float64(p.Attempts) }, nil, true))
		}
		b.WriteString("</div>\n<table><tr><th>policy</th><th>routers</th><th>goodput/s</th><th>% of capacity</th><th>TTFT p50</th><th>TTFT p99</th><th>TPOT p99</th><th>rejected</th><th>failed</th><th>attempts/request</th><th>queue wait p99</th><th>preemptions</th></tr>\n")
		for _, row := range rows {
			fmt.Fprintf(&b, "<tr><td>%s</td><td>%d</td><td>%.2f</td><td>%.0f %%</td><td>%s</td><td>%s</td><td>%s</td><td>%.1f %%</td><td>%.1f %%</td><td>%.2f</td><td>%s</td><td>%d</td></tr>\n",
				html.EscapeString(rowName(row)), row.Routers, row.GoodputRPS, row.GoodputPct, msText(row.TTFTp50), msText(row.TTFTp99),
				msText(row.ITLp99), row.RejectedPct, row.FailedPct, row.AttemptsPerRequest, msText(row.QueueWaitP99), row.Preemptions)
		}
		b.WriteString("</table>\n</section>\n")
	}
	b.WriteString("</body></html>\n")
	return b.String()
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

func containsString(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// chart draws one SVG line chart: grey the reference line of ref (when
// not nil), one coloured line per row of value, a dashed level at hline
// (when not nil). NaN values leave gaps. smooth draws each second's value
// as the average of the second before, itself and the second after:
// Poisson arrivals make single seconds noisy.
func chart(title string, rows []GoodputRow, ref, value func(Point) float64, hline *float64, smooth bool) string {
	values := make([][]float64, len(rows))
	for i, row := range rows {
		values[i] = make([]float64, len(row.Series))
		for j := range row.Series {
			if !smooth {
				values[i][j] = value(row.Series[j])
				continue
			}
			sum, n := 0.0, 0
			for k := max(0, j-1); k <= min(len(row.Series)-1, j+1); k++ {
				sum += value(row.Series[k])
				n++
			}
			values[i][j] = sum / float64(n)
		}
	}
	const w, h, left, right, top, bottom = 380.0, 220.0, 44.0, 10.0, 10.0, 28.0
	maxY, maxT := 0.0, 0.0
	for i, row := range rows {
		for j, p := range row.Series {
			maxT = math.Max(maxT, p.T.Seconds()+1)
			if v := values[i][j]; !math.IsNaN(v) {
				maxY = math.Max(maxY, v)
			}
			if ref != nil {
				maxY = math.Max(maxY, ref(p))
			}
		}
	}
	if hline != nil {
		maxY = math.Max(maxY, *hline)
	}
	maxY = niceCeil(maxY)
	maxT = math.Max(maxT, 1)
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
	line := func(pts []Point, vs []float64, color string, width float64) {
		var d strings.Builder
		pen := false
		for i, p := range pts {
			v := vs[i]
			if math.IsNaN(v) {
				pen = false
				continue
			}
			cmd := "L"
			if !pen {
				cmd = "M"
			}
			fmt.Fprintf(&d, "%s%.1f %.1f ", cmd, x(p.T.Seconds()+0.5), y(v))
			pen = true
		}
		if d.Len() > 0 {
			fmt.Fprintf(&b, "<path class=\"series\" d=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%g\"/>\n", strings.TrimSpace(d.String()), color, width)
		}
	}
	if ref != nil && len(rows) > 0 {
		vs := make([]float64, len(rows[0].Series))
		for j, p := range rows[0].Series {
			vs[j] = ref(p)
		}
		line(rows[0].Series, vs, "#888", 3)
	}
	for i, row := range rows {
		line(row.Series, values[i], policyColors[i%len(policyColors)], 1.6)
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
