package slo

import (
	"fmt"
	"math"
)

// The leading thresholds (contract §21). kv_committed_threshold and
// queue_delay_threshold_ms bound what the ranks have taken on, not what
// they hold or what their requests measured, so they can stop an overload
// before its latency shows; they move on the leading inputs of the window:
//
//   - a KV miss: the model's ranks preempted a request in the window,
//     whatever the attainment. kv_committed comes down at once to
//     CommittedAnchor (1: no more committed than the cache holds, the
//     point at which, were every estimate right, nothing would be
//     preempted) when above it, and holds there: below it a threshold
//     cannot take back what the ranks hold already, and lower values cost
//     chat loads their throughput (measured, docs/slo.md);
//   - a TTFT miss: a rank's predicted queue delay is above the TTFT target
//     (before any sample of the requests that wait exists), or the
//     measured TTFT attainment is below the percentile. queue_delay comes
//     down at once to DelayAnchor × the TTFT target (half: the request's
//     own prefill and the prediction's error take the rest) when above it,
//     else by the factor Down;
//   - after a step down a threshold waits Settle intervals before the next:
//     the preemptions and queues of those intervals were admitted under
//     the old value;
//   - a leading miss holds off every step up (the lagging ones too); a
//     TTFT miss of the predicted queue counts as a miss of the lagging
//     controller where its samples show none yet (see Next);
//   - a threshold goes up by the factor Up per interval only after Quiet
//     intervals without a miss of its side, while the lagging controller
//     would go up too (rejections or queueing, every signal met with
//     headroom).

// Defaults of Lead.
const (
	// DefaultCommittedAnchor is where a KV miss brings a higher
	// kv_committed at once: no more committed than the cache holds.
	DefaultCommittedAnchor = 1.0
	// DefaultDelayAnchor is the share of the TTFT target a TTFT miss brings
	// a higher queue_delay to at once.
	DefaultDelayAnchor = 0.5
	// DefaultLeadDown is the factor of a step down of queue_delay at or
	// below its anchor.
	DefaultLeadDown = 0.85
	// DefaultLeadUp is the factor of a step up.
	DefaultLeadUp = 1.05
	// DefaultLeadSettle is how many intervals a leading threshold waits
	// after a step down before the next.
	DefaultLeadSettle = 3
	// DefaultLeadQuiet is how many intervals without a miss of its side a
	// leading threshold waits before it goes up (the goodput benchmark's
	// bursts come every 10 s).
	DefaultLeadQuiet = 3
	// maxQuiet caps the quiet counts (they only compare with Quiet).
	maxQuiet = 1 << 20
)

// Lead shapes the moves of the leading thresholds.
type Lead struct {
	CommittedAnchor float64
	DelayAnchor     float64
	Down, Up        float64
	Settle, Quiet   int
}

// DefaultLead is the Lead of the defaults above.
func DefaultLead() Lead {
	return Lead{CommittedAnchor: DefaultCommittedAnchor, DelayAnchor: DefaultDelayAnchor,
		Down: DefaultLeadDown, Up: DefaultLeadUp, Settle: DefaultLeadSettle, Quiet: DefaultLeadQuiet}
}

func (l Lead) validate() []error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, a...)...))
	}
	if !(l.CommittedAnchor > 0 && l.CommittedAnchor <= MaxCommitted) {
		bad("committed anchor %v must be in (0, %d]", l.CommittedAnchor, MaxCommitted)
	}
	if !(l.DelayAnchor > 0 && l.DelayAnchor <= 1) {
		bad("delay anchor %v must be in (0, 1]", l.DelayAnchor)
	}
	if !(l.Down > 0 && l.Down < 1) {
		bad("leading step down %v must be in (0, 1)", l.Down)
	}
	if !(l.Up > 1 && l.Up < 2) {
		bad("leading step up %v must be in (1, 2)", l.Up)
	}
	if l.Settle < 0 || l.Quiet < 1 {
		bad("leading settle %d must be at least 0 and quiet %d at least 1", l.Settle, l.Quiet)
	}
	return errs
}

// misses are a window's leading misses.
type misses struct{ kv, delay bool }

func leadingMisses(t Target, w *Window) misses {
	return misses{kv: w.Preemptions > 0, delay: t.TTFTms > 0 && w.QueueDelayMs > t.TTFTms}
}

func (m misses) any() bool { return m.kv || m.delay }

// lowerTo is v brought down to anchor when above it, else by the factor
// down.
func lowerTo(v, anchor, down float64) float64 {
	if v > anchor {
		return anchor
	}
	return v * down
}

// leading moves the leading thresholds on the misses m, after the lagging
// controller's move (move; raise: it would let thresholds go up), and
// returns the status and the move of the interval.
func (s Status) leading(c Config, t Target, move Move, raise bool, m misses) (Status, Move) {
	l := c.Lead
	th := &s.Suggested
	down, up := false, false
	s.CommittedWait, s.DelayWait = max(s.CommittedWait-1, 0), max(s.DelayWait-1, 0)

	if m.kv {
		s.CommittedQuiet = 0
		if s.CommittedWait == 0 {
			v := round4(max(min(th.KVCommitted, l.CommittedAnchor), c.CommittedMin))
			if v < th.KVCommitted {
				th.KVCommitted, down = v, true
				s.CommittedWait = l.Settle
			}
		}
	} else {
		s.CommittedQuiet = min(s.CommittedQuiet+1, maxQuiet)
		if raise && s.CommittedQuiet >= l.Quiet {
			if v := min(round4(th.KVCommitted*l.Up), c.CommittedMax); v > th.KVCommitted {
				th.KVCommitted, up = v, true
			}
		}
	}

	if m.delay && t.TTFTms > 0 {
		s.DelayQuiet = 0
		if s.DelayWait == 0 {
			v := clampDelay(c, lowerTo(float64(th.QueueDelayMs), l.DelayAnchor*t.TTFTms, l.Down))
			if v < th.QueueDelayMs {
				th.QueueDelayMs, down = v, true
				s.DelayWait = l.Settle
			}
		}
	} else {
		s.DelayQuiet = min(s.DelayQuiet+1, maxQuiet)
		if raise && s.DelayQuiet >= l.Quiet {
			if v := clampDelay(c, math.Ceil(float64(th.QueueDelayMs)*l.Up)); v > th.QueueDelayMs {
				th.QueueDelayMs, up = v, true
			}
		}
	}

	switch {
	case down:
		s.State, s.Smoothed = StateLowering, false
		move = -1
	case m.any() && s.State != StateInfeasible:
		// A miss waiting for its last step down to show.
		s.State = StateLowering
	case up:
		s.Smoothed = false
		if move == 0 {
			s.State, move = StateRaising, +1
		}
	}
	return s, move
}

// clampDelay turns a queue delay threshold computed in float64 into whole
// milliseconds within the delay range.
func clampDelay(c Config, v float64) uint64 {
	switch {
	case !(v < float64(c.DelayMax)): // NaN too
		return c.DelayMax
	case v <= float64(c.DelayMin):
		return c.DelayMin
	}
	return uint64(math.Round(v))
}

func round4(v float64) float64 { return math.Round(v*1e4) / 1e4 }
