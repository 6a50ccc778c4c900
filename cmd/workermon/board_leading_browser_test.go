package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/workermon/workermon/board"
	"github.com/workermon/workermon/events"
)

// swapSource is a board.Source whose snapshot the test replaces.
type swapSource struct {
	mu   sync.Mutex
	snap board.Snapshot
}

func (s *swapSource) Snapshot(context.Context) (board.Snapshot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.snap, nil
}

func (s *swapSource) set(snap board.Snapshot) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.snap = snap
}

// leadingSnapshot is a board of kind with two models: m1 has a queue-delay
// threshold of 500 ms, a rank whose predicted delay is past it (667 ms at
// 6,000 tokens/s, 0.5 preemptions/s) and a rank whose prefill rate is not
// measured yet, at saturation 1.12; m2 has neither a delay threshold nor a
// rate, at saturation 0.
func leadingSnapshot(kind string) board.Snapshot {
	limit := events.Ptr[uint64](500)
	return board.Snapshot{Kind: kind, Name: "x", Models: []board.Model{
		{Name: "m1", Thresholds: events.Thresholds{QueueDelayMs: limit}, Saturation: events.Ptr(1.12),
			Counts: board.Counts{Busy: 1, Free: 1}, Workers: []board.Worker{
				{ID: 1, State: board.StateBusy, Reason: "kv_committed+queue_delay", Ranks: []board.Rank{{Prefill: 4000, KVUsed: 10, KVTotal: 100,
					PrefillRate: events.Ptr(6000.0), QueueDelayMs: events.Ptr(667.0), DelayLimit: limit, PreemptionRate: events.Ptr(0.5)}}},
				{ID: 2, State: board.StateFree, Ranks: []board.Rank{{Prefill: 10, KVUsed: 10, KVTotal: 100, DelayLimit: limit}}},
			}},
		{Name: "m2", Saturation: events.Ptr(0.0), Counts: board.Counts{Free: 1}, Workers: []board.Worker{
			{ID: 3, State: board.StateFree, Ranks: []board.Rank{{Prefill: 5, KVUsed: 1, KVTotal: 100}}}}},
	}}
}

// TestBoardLeadingInBrowser: the monitor's board shows each model's
// saturation in its header (red from 1, the busy line) and, per rank, the
// predicted queue delay and the prefill rate (contract §21) as a bar with
// the threshold's tick, past it in the colour of a value over its limit,
// hatched while the rate is unknown, in the models with a delay threshold
// or a measured rate only; the tooltip adds the preemption rate. A
// router's board, whose ranks carry no such values, shows no delay bars.
func TestBoardLeadingInBrowser(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM)", chromiumNames)
	}
	t.Parallel()
	src := &swapSource{snap: leadingSnapshot(board.KindMonitor)}
	cfg := board.DefaultConfig()
	cfg.Source, cfg.Interval = src, 50*time.Millisecond
	srvURL := serveBoard(t, cfg)

	b := openBrowser(t, chrome, srvURL+"/")
	b.poll("both models shown", `document.querySelectorAll('section.model .tile').length === 3`, 10*time.Second)
	for sel, want := range map[string]string{
		`section[data-model="m1"] .saturation`:           "saturation 1.12",
		`section[data-model="m2"] .saturation`:           "saturation 0.00",
		`.tile[data-worker="1"] .bar.qd`:                 "",
		`.tile[data-worker="1"] .cell:has(.bar.qd) .fig`: "667 ms · 6K/s",
		`.tile[data-worker="2"] .cell:has(.bar.qd) .fig`: "rate unknown",
		`.tile[data-worker="1"] .why`:                    "kvc+delay",
	} {
		if got := b.text(sel); got != want {
			t.Errorf("%s shows %q, want %q", sel, got, want)
		}
	}
	if th := b.text(`section[data-model="m1"] .thresholds`); !strings.Contains(th, "queue delay > 500 ms") {
		t.Errorf("m1's thresholds %q lack the queue delay", th)
	}
	b.poll("m1's saturation marked past the busy line, m2's not", `document.querySelector('section[data-model="m1"] .saturation').classList.contains('high') &&
		!document.querySelector('section[data-model="m2"] .saturation').classList.contains('high')`, 5*time.Second)
	b.poll("worker 1's delay past its tick, worker 2's hatched", `(a => a.classList.contains('over') && a.classList.contains('has-mark') &&
		parseFloat(a.querySelector('.mark').style.left) === 80 && parseFloat(a.querySelector('.fill').style.width) === 100)(
		document.querySelector('.tile[data-worker="1"] .bar.qd')) &&
		document.querySelector('.tile[data-worker="2"] .bar.qd').classList.contains('unknown')`, 5*time.Second)
	b.poll("m2 without delay bars", `document.querySelector('section[data-model="m2"] .tile .cell') !== null &&
		document.querySelector('section[data-model="m2"] .bar.qd') === null`, 5*time.Second)
	b.poll("the delay's key in the legend", `document.getElementById('key-delay').offsetWidth > 0`, 5*time.Second)
	title := b.attr(`.tile[data-worker="1"]`, "title")
	if !strings.Contains(title, "queue delay 667 ms at 6,000 tokens/s (threshold 500 ms); 0.5 preemptions/s") {
		t.Errorf("worker 1's tooltip %q lacks the delay, the rate and the preemptions", title)
	}
	b.screenshot("board-leading.png")

	// The same on a router's board: no delay bars, no key.
	src.set(leadingSnapshot(board.KindRouter))
	b.poll("the router's board without delay bars", `document.getElementById('kind').textContent === 'router board' &&
		document.querySelector('#models .bar.qd') === null && document.querySelectorAll('#models .bar.kv').length === 3 &&
		document.getElementById('key-delay').hidden`, 10*time.Second)
	b.checkErrors()
}

// attr returns an attribute of the first element selector matches ("" when
// none).
func (b *browser) attr(selector, name string) string {
	b.t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Evaluate[string](fmt.Sprintf(
		`(e => e === null ? "" : (e.getAttribute(%q) || ""))(document.querySelector(%q))`, name, selector)))
	if err != nil {
		b.t.Fatal(err)
	}
	return s
}
