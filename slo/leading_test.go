package slo_test

import (
	"testing"

	"github.com/workermon/workermon/slo"
)

// chatWindow is an interval of a chat load the fleet serves well: n TTFT
// samples at 300 ms, 20n ITL samples at 20 ms, some rejections.
func chatWindow(n int, rejected uint64) *slo.Window {
	var w slo.Window
	for range n {
		w.TTFT.Observe(300)
	}
	for range 20 * n {
		w.ITL.Observe(20)
	}
	w.Rejected = rejected
	return &w
}

// TestLeadingShift: a long-prompt shift arrives under a chat load that meets
// its targets. In the first interval of the shift no request of the new
// load has a first token yet (they wait in the ranks), the ITL of the chat
// requests still decoding meets its target, and the ranks have preempted
// and predict a queue longer than the TTFT target: the controller tightens
// kv_committed and queue_delay in that very interval, whatever the
// attainment, and holds off raising; the lagging controller counts the
// queue's miss as a TTFT miss too (decode and prefill a step down). Then,
// while preemptions go on, kv_committed holds at the anchor and nothing
// steps up; quiet again, it rises after Quiet intervals.
func TestLeadingShift(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{TTFTms: 1000, ITLms: 50, Percentile: 0.9}
	st := slo.Start(c, slo.Base{Decode: new(0.85)})
	for i := range 10 {
		var m slo.Move
		st, m = slo.Next(c, target, st, chatWindow(60, 0))
		if m != 0 || st.Suggested.KVCommitted != c.CommittedMax || st.Suggested.QueueDelayMs != c.DelayMax {
			t.Fatalf("chat interval %d: %s %+d %+v, want the leading thresholds held at the top", i, st.State, m, st.Suggested)
		}
	}
	decode := st.Suggested.Decode

	// The shift: chat's last tokens (ITL met), rejections, no TTFT sample.
	shift := func(preemptions uint64, delay float64) *slo.Window {
		w := chatWindow(0, 20)
		for range 400 {
			w.ITL.Observe(20)
		}
		w.Preemptions, w.QueueDelayMs = preemptions, delay
		return w
	}
	w := shift(3, 1800)
	if w.TTFT.Total() != 0 {
		t.Fatal("the shift's window holds a TTFT sample")
	}
	st, m := slo.Next(c, target, st, w)
	if m != -1 || st.State != slo.StateLowering {
		t.Fatalf("first interval of the shift: %s %+d, want lowering -1", st.State, m)
	}
	if st.Suggested.KVCommitted != c.Lead.CommittedAnchor || st.Suggested.QueueDelayMs != uint64(c.Lead.DelayAnchor*target.TTFTms) {
		t.Fatalf("first interval of the shift: %+v, want kv_committed %v and queue_delay %v", st.Suggested,
			c.Lead.CommittedAnchor, c.Lead.DelayAnchor*target.TTFTms)
	}
	if st.Suggested.Decode >= decode {
		t.Fatalf("decode %v → %v: a leading miss counts as a miss of the lagging controller too", decode, st.Suggested.Decode)
	}
	if st.Measured.Preemptions != 3 || st.Measured.QueueDelayMs == nil || *st.Measured.QueueDelayMs != 1800 {
		t.Fatalf("measured %+v, want the leading inputs", st.Measured)
	}

	// Preemptions go on (the requests admitted before the move, which a
	// threshold cannot take back): kv_committed stays at the anchor, never
	// lower on preemptions alone, and nothing steps up while they last,
	// rejections or not.
	for i := 1; i <= 2*c.Lead.Settle; i++ {
		st, m = slo.Next(c, target, st, shift(2, 400))
		if st.Suggested.KVCommitted != c.Lead.CommittedAnchor || st.State != slo.StateLowering || m > 0 {
			t.Fatalf("interval %d after the first move: %s %+d kv_committed %v, want held at %v", i, st.State, m,
				st.Suggested.KVCommitted, c.Lead.CommittedAnchor)
		}
	}
	if st.Suggested.QueueDelayMs != uint64(c.Lead.DelayAnchor*target.TTFTms) {
		t.Fatalf("%+v: queue_delay moved without a miss of its own", st.Suggested)
	}

	// Quiet again, with rejections and every signal met: kv_committed
	// rises only after Quiet intervals without a preemption, by Up.
	held := st.Suggested.KVCommitted
	for i := 1; i <= c.Lead.Quiet; i++ {
		w := chatWindow(60, 5)
		st, _ = slo.Next(c, target, st, w)
		if i < c.Lead.Quiet && st.Suggested.KVCommitted != held {
			t.Fatalf("quiet interval %d: kv_committed %v, want held at %v", i, st.Suggested.KVCommitted, held)
		}
	}
	if want := round4(held * c.Lead.Up); st.Suggested.KVCommitted != want {
		t.Fatalf("after %d quiet intervals: kv_committed %v, want %v", c.Lead.Quiet, st.Suggested.KVCommitted, want)
	}
}

// TestLeadingRules: the leading thresholds' single moves.
func TestLeadingRules(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	ttft := slo.Target{TTFTms: 1000, Percentile: 0.9}
	itl := slo.Target{ITLms: 50, Percentile: 0.9}
	mid := slo.Status{State: slo.StateSteady, Step: c.DecodeStep, Holds: 1,
		Suggested: slo.Thresholds{Decode: 0.6, Prefill: 100000, KVCommitted: 0.8, QueueDelayMs: 400}}
	top := mid
	top.Suggested.KVCommitted, top.Suggested.QueueDelayMs = 2, 60000
	floor := mid
	floor.Suggested.KVCommitted, floor.Suggested.QueueDelayMs = 0.5, 100
	old := mid
	old.Suggested.KVCommitted, old.Suggested.QueueDelayMs = 0, 0 // a status of before §21
	for _, tc := range []struct {
		name          string
		target        slo.Target
		prev          slo.Status
		w             slo.Window
		move          slo.Move
		kv            float64
		delay         uint64
		decodeRaised  bool
		decodeLowered bool
	}{
		{"preemption above the anchor: to it", ttft, top, slo.Window{Preemptions: 1}, -1, 1, 60000, false, false},
		{"preemption at or below it: held", ttft, mid, slo.Window{Preemptions: 1}, 0, 0.8, 400, false, false},
		{"preemption at the floor: held", ttft, floor, slo.Window{Preemptions: 1}, 0, 0.5, 100, false, false},
		{"delay over the target, above the anchor: to it", ttft, top, slo.Window{QueueDelayMs: 1001}, -1, 2, 500, false, true},
		{"delay over the target below it: ×0.85", ttft, mid, slo.Window{QueueDelayMs: 1001}, -1, 0.8, 340, false, true},
		{"delay at the target: no miss", ttft, mid, slo.Window{QueueDelayMs: 1000}, 0, 0.8, 400, false, false},
		{"delay without a TTFT target: no miss", itl, mid, slo.Window{QueueDelayMs: 5000}, 0, 0.8, 400, false, false},
		{"rejections, no sample: the lagging step up", ttft, mid, slo.Window{Rejected: 3}, +1, 0.8, 400, true, false},
		{"rejections and a preemption: no step up", ttft, mid, slo.Window{Rejected: 3, Preemptions: 1}, 0, 0.8, 400, false, false},
		{"a status of before §21: the tops", ttft, old, slo.Window{}, 0, 2, 60000, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st, m := slo.Next(c, tc.target, tc.prev, &tc.w)
			if m != tc.move || st.Suggested.KVCommitted != tc.kv || st.Suggested.QueueDelayMs != tc.delay ||
				(st.Suggested.Decode > tc.prev.Suggested.Decode) != tc.decodeRaised ||
				(st.Suggested.Decode < tc.prev.Suggested.Decode) != tc.decodeLowered {
				t.Errorf("Next = %s %+d %+v, want %+d kv_committed %v queue_delay %v (decode raised: %v, lowered: %v)",
					st.State, m, st.Suggested, tc.move, tc.kv, tc.delay, tc.decodeRaised, tc.decodeLowered)
			}
		})
	}
}

func round4(v float64) float64 { return float64(int64(v*1e4+0.5)) / 1e4 }
