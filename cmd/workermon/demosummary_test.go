package main

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/loadgen"
)

// peakStats are the load's figures at a demo's peak: every answer there
// is, 429s in the totals and in every class.
func peakStats() *loadgen.Stats {
	win := func(ok, tooMany, unavailable, errs uint64) loadgen.Counts {
		return loadgen.Counts{Duration: 5 * time.Second, OK: ok, TooMany: tooMany, Unavailable: unavailable, Errors: errs,
			Latency: loadgen.Latency{P50: 9540 * time.Millisecond, P99: 11610 * time.Millisecond}}
	}
	return &loadgen.Stats{
		Elapsed: 32 * time.Second, TargetRPS: 70.2,
		Window: win(44, 128, 150, 1),
		Classes: []loadgen.ClassStats{
			{Class: admission.ClassSheddable, Window: win(0, 101, 82, 0)},
			{Class: admission.ClassStandard, Window: win(35, 37, 53, 0)},
			{Class: admission.ClassCritical, Window: win(9, 0, 15, 0)},
		},
	}
}

// TestDemoSummaryLines: the summary counts the 429s beside the 200s, 503s
// and errors, and fits its lines to the width (100 columns when the
// terminal's is unknown, the terminal's when known), whatever the fleet's
// size or the model's name.
func TestDemoSummaryLines(t *testing.T) {
	t.Parallel()
	peak := demoSummary{
		load: peakStats(), model: "Qwen/Qwen3-0.6B", record: true,
		busy: []uint64{1, 2, 3}, hard: []uint64{1, 2, 3}, free: []uint64{}, amber: []uint64{}, stale: []uint64{},
		changes: 21, streaks: "all busy 11× longest 5.6s", queued: 110, allBusy: true, allBusyFor: 2 * time.Second,
		saturation: events.Ptr(1.12),
	}
	many := peak
	many.busy = make([]uint64, 200)
	for i := range many.busy {
		many.busy[i] = uint64(1000 + i)
	}
	many.reschedule, many.migrated = true, 7
	long := peak
	long.model = strings.Repeat("m", 256)
	noRecord := demoSummary{load: peakStats(), model: "Qwen/Qwen3-0.6B"}
	noThreshold := peak
	noThreshold.saturation = nil

	for _, tc := range []struct {
		name  string
		s     demoSummary
		width int
		want  []string // in the output, in this order
	}{
		{"peak at 100", peak, DefaultDemoWidth, []string{"t= 32s target  70.2/s", "200   8.8/s  429  25.6/s  503  30.0/s  err  0.2/s",
			"p50 9.54s p99 11.61s", "by class 200/429/503 sheddable 0.0/20.2/16.4 standard 7.0/7.4/10.6 critical 1.8/0.0/3.0",
			"Qwen/Qwen3-0.6B busy [1 2 3] hard [1 2 3] free [] amber [] stale []", "saturation 1.12", "queued 110", "ALL BUSY 2.0s → 503",
			"all_busy changes 21", "all busy 11× longest 5.6s"}},
		{"peak at 80", peak, 80, []string{"429  25.6/s", "ALL BUSY 2.0s → 503"}},
		{"peak on a wide terminal", peak, 400, []string{"429  25.6/s", "ALL BUSY 2.0s → 503"}},
		{"200 workers", many, DefaultDemoWidth, []string{"Qwen/Qwen3-0.6B workers busy 200 hard 3 free 0 amber 0 stale 0", "migrated 7"}},
		{"a long model name", long, DefaultDemoWidth, []string{"429  25.6/s", "…", "queued 110"}},
		{"no record yet", noRecord, DefaultDemoWidth, []string{"429  25.6/s", "Qwen/Qwen3-0.6B: no record yet"}},
		{"narrower than the least", peak, 10, []string{"429"}},
		{"no threshold: no saturation", noThreshold, DefaultDemoWidth, []string{"stale []", "queued 110"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			lines := tc.s.lines(tc.width)
			width := max(tc.width, minDemoWidth)
			for i, l := range lines {
				if n := utf8.RuneCountInString(l); n > width {
					t.Errorf("line %d has %d columns, more than %d: %q", i, n, width, l)
				}
				if i > 0 && !strings.HasPrefix(l, demoIndent) {
					t.Errorf("line %d is not indented: %q", i, l)
				}
			}
			text := strings.Join(lines, "\n")
			if tc.width >= 400 && len(lines) != 1 {
				t.Errorf("%d lines on a terminal wide enough for one:\n%s", len(lines), text)
			}
			if tc.s.saturation == nil && strings.Contains(text, "saturation") {
				t.Errorf("a saturation without a threshold in force:\n%s", text)
			}
			rest := text
			for _, w := range tc.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Fatalf("the summary lacks %q (or has it out of order):\n%s", w, text)
				}
				rest = rest[i+len(w):]
			}
		})
	}
}

// TestDemoTotals: the last lines give each class's answers as shares,
// 429s included, within the width.
func TestDemoTotals(t *testing.T) {
	t.Parallel()
	st := *peakStats()
	st.Total = st.Window
	st.Total.Sent = 323
	for i := range st.Classes {
		st.Classes[i].Total = st.Classes[i].Window
	}
	lines := demoTotals(st, DefaultDemoWidth)
	text := strings.Join(lines, "\n")
	for _, l := range lines {
		if n := utf8.RuneCountInString(l); n > DefaultDemoWidth {
			t.Errorf("%d columns: %q", n, l)
		}
	}
	for _, w := range []string{"total over 32s: sent 323", "200 44  429 128  503 150  err 1",
		"sheddable 183 answered: 200 0% 429 55% 503 45% err 0%", "critical 24 answered: 200 38% 429 0% 503 62% err 0%"} {
		if !strings.Contains(text, w) {
			t.Errorf("the totals lack %q:\n%s", w, text)
		}
	}
}

// TestDemoAnswers: the banner says what a request gets when every worker
// is busy, with the queue and without, and how to see each answer, in
// lines of at most 100 columns.
func TestDemoAnswers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		wait time.Duration
		want []string
	}{
		{"queue", 3 * time.Second, []string{"waits up to 3s", "else 429", "X-Workermon-Max-Wait: 0, the 503 at once", "50% of the load"}},
		{"no queue", 0, []string{"503 at once"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			text := demoAnswers(tc.wait, 0.5, "127.0.0.1:18080", "Qwen/Qwen3-0.6B")
			for _, w := range append(tc.want, "X-Workermon-Priority: -1", "curl -si http://127.0.0.1:18080/v1/completions -H 'X-Workermon-Max-Wait: 0'",
				`"model":"Qwen/Qwen3-0.6B"`) {
				if !strings.Contains(text, w) {
					t.Errorf("lacks %q:\n%s", w, text)
				}
			}
			for l := range strings.Lines(text) {
				if n := utf8.RuneCountInString(strings.TrimRight(l, "\n")); n > DefaultDemoWidth {
					t.Errorf("%d columns: %q", n, l)
				}
			}
		})
	}
}
