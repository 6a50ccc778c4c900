package main

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/workermon/workermon/loadgen"
)

// DefaultDemoWidth is the width of the demo's summary lines when the
// terminal's is not known (stdout is a pipe or a file).
const DefaultDemoWidth = 100

// minDemoWidth is the narrowest width the summary is laid out for.
const minDemoWidth = 40

// demoSummary is what one summary of `workermon demo` shows, gathered from
// its parts: the load's answers, the model's record as the router sees it,
// the monitor's counters.
type demoSummary struct {
	load    *loadgen.Stats // nil: no load generator
	model   string
	record  bool // the router has a record of the model
	busy    []uint64
	hard    []uint64
	free    []uint64
	amber   []uint64
	stale   []uint64
	changes float64 // all_busy changes
	streaks string  // allBusyStreaks.cell
	// migrated is the rescheduler's count, shown when rescheduling.
	reschedule bool
	migrated   float64
	queued     float64
	// saturation is the record's (contract §21), nil when no threshold is
	// in force (it is 0 then, whatever the load).
	saturation *float64
	// allBusyFor is how long the model has been all busy (0: it is not).
	allBusy    bool
	allBusyFor time.Duration
}

// lines lays the summary out in lines of at most width columns: cells
// separated by " | ", as many to a line as fit, the lines after the first
// indented. A cell wider than a line is cut with "…", save the worker sets,
// which turn into counts first.
func (s demoSummary) lines(width int) []string {
	width = max(width, minDemoWidth)
	var cells []string
	if s.load != nil {
		st := s.load
		w := st.Window
		secs := max(w.Duration.Seconds(), 0.001)
		rate := func(n uint64) float64 { return float64(n) / secs }
		cells = append(cells,
			fmt.Sprintf("t=%3.0fs target %5.1f/s", st.Elapsed.Seconds(), st.TargetRPS),
			fmt.Sprintf("200 %5.1f/s  429 %5.1f/s  503 %5.1f/s  err %4.1f/s",
				rate(w.OK), rate(w.TooMany), rate(w.Unavailable), rate(w.Errors+w.OtherStatus)),
			fmt.Sprintf("p50 %5s p99 %5s", round(w.Latency.P50), round(w.Latency.P99)))
	}
	if !s.record {
		cells = append(cells, s.model+": no record yet")
		return packCells(cells, width)
	}
	if s.load != nil {
		if c := classesCell(s.load.Classes); c != "" {
			cells = append(cells, c)
		}
	}
	sets := fmt.Sprintf("%s busy %v hard %v free %v amber %v stale %v", s.model, s.busy, s.hard, s.free, s.amber, s.stale)
	if utf8.RuneCountInString(sets) > width-len(demoIndent) {
		sets = fmt.Sprintf("%s workers busy %d hard %d free %d amber %d stale %d", s.model,
			len(s.busy), len(s.hard), len(s.free), len(s.amber), len(s.stale))
	}
	cells = append(cells, sets)
	if s.saturation != nil {
		cells = append(cells, fmt.Sprintf("saturation %.2f", *s.saturation))
	}
	cells = append(cells, fmt.Sprintf("queued %g", s.queued))
	if s.allBusy {
		cells = append(cells, fmt.Sprintf("ALL BUSY %.1fs → 503", s.allBusyFor.Seconds()))
	}
	cells = append(cells, fmt.Sprintf("all_busy changes %g", s.changes), s.streaks)
	if s.reschedule {
		cells = append(cells, fmt.Sprintf("migrated %g", s.migrated))
	}
	return packCells(cells, width)
}

// demoIndent starts every summary line after a summary's first.
const demoIndent = "    "

// packCells joins cells with " | " into lines of at most width columns,
// the lines after the first indented by demoIndent.
func packCells(cells []string, width int) []string {
	var lines []string
	var line strings.Builder
	n := 0 // columns in line
	for _, c := range cells {
		if c == "" {
			continue
		}
		c = cut(c, width-len(demoIndent))
		cw := utf8.RuneCountInString(c)
		switch {
		case n == 0:
		case n+3+cw <= width:
			line.WriteString(" | ")
			n += 3
		default:
			lines = append(lines, line.String())
			line.Reset()
			n = 0
		}
		if n == 0 && len(lines) > 0 {
			line.WriteString(demoIndent)
			n = len(demoIndent)
		}
		line.WriteString(c)
		n += cw
	}
	if n > 0 {
		lines = append(lines, line.String())
	}
	return lines
}

// cut shortens s to at most w columns, ending it with "…" when cut.
func cut(s string, w int) string {
	if utf8.RuneCountInString(s) <= w {
		return s
	}
	r := []rune(s)
	return string(r[:max(w-1, 0)]) + "…"
}

// classesCell renders the recent answers by priority class, per second:
// "by class 200/429/503 sheddable 3.1/2.0/0.0 standard 4.0/0.0/0.0 critical 1.0/0.0/0.0".
func classesCell(classes []loadgen.ClassStats) string {
	if len(classes) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("by class 200/429/503")
	for _, c := range classes {
		w := c.Window
		secs := max(w.Duration.Seconds(), 0.001)
		fmt.Fprintf(&b, " %s %.1f/%.1f/%.1f", c.Class, float64(w.OK)/secs, float64(w.TooMany)/secs, float64(w.Unavailable)/secs)
	}
	return b.String()
}

// demoTotals lays out the load's answers since the start, for the demo's
// last lines: counts, then each class's answers as shares of what it was
// answered (200, 429, 503 and the rest).
func demoTotals(st loadgen.Stats, width int) []string {
	t := st.Total
	cells := []string{fmt.Sprintf("total over %.0fs: sent %d", st.Elapsed.Seconds(), t.Sent),
		fmt.Sprintf("200 %d  429 %d  503 %d  err %d", t.OK, t.TooMany, t.Unavailable, t.Errors+t.OtherStatus)}
	for _, c := range st.Classes {
		w := c.Total
		answered := w.OK + w.TooMany + w.Unavailable + w.Errors + w.OtherStatus
		pct := func(n uint64) float64 { return 100 * float64(n) / float64(max(answered, 1)) }
		cells = append(cells, fmt.Sprintf("%s %d answered: 200 %.0f%% 429 %.0f%% 503 %.0f%% err %.0f%%", c.Class, answered,
			pct(w.OK), pct(w.TooMany), pct(w.Unavailable), pct(w.Errors+w.OtherStatus)))
	}
	return packCells(cells, max(width, minDemoWidth))
}
