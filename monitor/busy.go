package monitor

import (
	"math"
	"strings"

	"github.com/workermon/workermon/events"
)

// Reason says why a rank or worker is busy; the zero value means not busy.
type Reason uint8

// Busy reasons, combinable.
const (
	ReasonKV Reason = 1 << iota
	ReasonPrefill
	// ReasonCordoned: an operator cordoned the worker (contract §12); it
	// outranks the others in a record.
	ReasonCordoned
	// ReasonKVCommitted and ReasonQueueDelay are the leading checks of
	// contract §21.
	ReasonKVCommitted
	ReasonQueueDelay
)

// reasonNames are the record's spellings of the combinations of the four
// check reasons, indexed by kv | prefill<<1 | kv_committed<<2 |
// queue_delay<<3: the names joined by "+" in that order (contract §21),
// built once so that naming a reason allocates nothing.
var reasonNames = func() [16]string {
	var out [16]string
	names := [...]string{events.ReasonKV, events.ReasonPrefill, events.ReasonKVCommitted, events.ReasonQueueDelay}
	for i := range out {
		var parts []string
		for b, n := range names {
			if i&(1<<b) != 0 {
				parts = append(parts, n)
			}
		}
		out[i] = strings.Join(parts, events.ReasonSep)
	}
	return out
}()

// index is r's index in reasonNames.
func (r Reason) index() int {
	return int(r&(ReasonKV|ReasonPrefill)) | int(r&(ReasonKVCommitted|ReasonQueueDelay))>>1
}

// String returns the contract's spelling: "kv", "prefill",
// "kv_committed", "queue_delay" or several of them joined by "+" in that
// order ("kv+prefill"), "cordoned", or "" when not busy.
func (r Reason) String() string {
	if r&ReasonCordoned != 0 {
		return events.ReasonCordoned
	}
	return reasonNames[r.index()]
}

// RankLoad is one rank's load as the busy rules see it: for each signal the
// maximum over fresh sources, for each capacity the smallest positive value
// (0 = unknown).
type RankLoad struct {
	ActiveDecodeBlocks  uint64
	KVTotalBlocks       uint64
	ActivePrefillTokens uint64
	MaxNumBatchedTokens uint64
	// KVCommittedBlocks is the larger of the engine's value and the sum of
	// the routers' estimates (contract §21).
	KVCommittedBlocks uint64
	// QueueDelayMs is the predicted queue delay, active_prefill_tokens ÷
	// the prefill rate, in milliseconds; QueueDelayKnown is false while the
	// prefill rate is unknown, and the queue-delay check does not apply.
	QueueDelayMs    float64
	QueueDelayKnown bool
}

// RankBusy applies the busy rules of the contract (§5) to one rank. Every
// comparison is strict; an unset threshold is a check that is off.
func RankBusy(t events.Thresholds, l RankLoad) Reason {
	return RankChecks(t, l, 0, 0).Reason()
}

// Checks is a set of the busy checks of a rank.
type Checks uint8

// The busy checks.
const (
	CheckDecode      Checks = 1 << iota // active_decode_blocks_threshold
	CheckPrefill                        // active_prefill_tokens_threshold
	CheckPrefillFrac                    // active_prefill_tokens_threshold_frac
	CheckKVCommitted                    // kv_committed_threshold (§21)
	CheckQueueDelay                     // queue_delay_threshold_ms (§21)
	checkPrefillBoth = CheckPrefill | CheckPrefillFrac
	checkAll         = CheckDecode | checkPrefillBoth | CheckKVCommitted | CheckQueueDelay
)

// Reason is the busy reason of the checks that hold.
func (c Checks) Reason() Reason {
	var r Reason
	if c&CheckDecode != 0 {
		r |= ReasonKV
	}
	if c&checkPrefillBoth != 0 {
		r |= ReasonPrefill
	}
	if c&CheckKVCommitted != 0 {
		r |= ReasonKVCommitted
	}
	if c&CheckQueueDelay != 0 {
		r |= ReasonQueueDelay
	}
	return r
}

// latchOf is what a record's reason says of the checks that made a worker
// busy, to seed the latch of a new writer (contract §12): the checks of
// each name joined by "+".
func latchOf(reason string) Checks {
	var c Checks
	for name := range strings.SplitSeq(reason, events.ReasonSep) {
		switch name {
		case events.ReasonKV:
			c |= CheckDecode
		case events.ReasonPrefill:
			c |= checkPrefillBoth
		case events.ReasonKVCommitted:
			c |= CheckKVCommitted
		case events.ReasonQueueDelay:
			c |= CheckQueueDelay
		}
	}
	return c
}

// RankChecks applies the busy rules with hysteresis (contract §12) to one
// rank: a check holds when its value is strictly above the threshold (§5),
// or, for a check in latched (it held before), strictly above its release
// level, (1 − margin) × the threshold. A rank is busy while any check holds,
// so it becomes free only when every check that made it busy is at or
// below its release level. With margin 0 the release level is the
// threshold: exactly §5. Arithmetic in float64, left to right.
func RankChecks(t events.Thresholds, l RankLoad, margin float64, latched Checks) Checks {
	return checksAt(t, l, 1, false, true, margin, latched)
}

// Level is a rank's or a worker's place on the graded scale of priority
// classes (contract §15): free, amber (near its thresholds), busy (§5) and
// hard (beyond them). Each level includes the ones below it.
type Level uint8

// Levels, in order.
const (
	LevelFree Level = iota
	LevelAmber
	LevelBusy
	LevelHard
)

// String returns the level's name.
func (l Level) String() string {
	switch l {
	case LevelAmber:
		return "amber"
	case LevelBusy:
		return "busy"
	case LevelHard:
		return "hard"
	}
	return "free"
}

// Fractions place the amber and hard levels relative to the thresholds
// (contract §15): a check holds at amber when its value is strictly above
// Shed × its threshold, and at hard when strictly above Critical × its
// threshold, the decode check's level capped at the whole cache.
type Fractions struct {
	Shed     float64 // --shed-fraction, in (0, 1]
	Critical float64 // --critical-fraction, ≥ 1
}

// Latch is the checks that hold at each level of a rank. With a release
// margin it is also what the next evaluation of the rank starts from: each
// level has its own latch (contract §12, §15).
type Latch struct {
	Amber, Busy, Hard Checks
}

// Level is the rank's level. Busy is §5; hard counts only on a busy rank and
// a busy rank is at least amber, so the levels stay nested whatever the
// fractions and latches.
func (l Latch) Level() Level {
	switch {
	case l.Busy != 0 && l.Hard != 0:
		return LevelHard
	case l.Busy != 0:
		return LevelBusy
	case l.Amber != 0:
		return LevelAmber
	}
	return LevelFree
}

// IsZero reports whether no check holds at any level.
func (l Latch) IsZero() bool { return l == Latch{} }

// RankLevel applies the graded rules of contract §15 without hysteresis to
// one rank.
func RankLevel(t events.Thresholds, l RankLoad, f Fractions) Level {
	return RankLevels(t, l, f, 0, Latch{}).Level()
}

// RankLevels applies the rules of every level to one rank, each with its own
// hysteresis (contract §12, §15): amber is RankChecks at f.Shed of the
// thresholds, busy is RankChecks, hard is RankChecks at f.Critical of the
// thresholds with the decode level capped at the whole cache. A latched
// check of a level holds until its value is at or below (1 − margin) × that
// level. Arithmetic in float64, left to right, as the contract writes it:
//
//	amber: blocks > f × threshold × total
//	       prefill > f × tokens threshold
//	       prefill > trunc(f × frac × max_num_batched_tokens)
//	hard:  blocks > min(c × threshold, 1) × total
//	       prefill > c × tokens threshold
//	       prefill > trunc(c × frac × max_num_batched_tokens)
//
// and, latched, (1 − margin) × the same product, e.g.
// blocks ≤ (1 − m) × f × threshold × total releases an amber decode check.
func RankLevels(t events.Thresholds, l RankLoad, f Fractions, margin float64, latched Latch) Latch {
	return Latch{
		Amber: checksAt(t, l, f.Shed, false, false, margin, latched.Amber),
		Busy:  checksAt(t, l, 1, false, true, margin, latched.Busy),
		Hard:  checksAt(t, l, f.Critical, true, false, margin, latched.Hard),
	}
}

// checksAt applies the busy checks with every threshold scaled by frac
// (1 for the busy level itself), the decode level capped at the whole cache
// when capDecode (the hard level). The products are taken left to right as
// the contract writes them; a factor of 1 leaves them exact, so the busy
// level is §5's arithmetic. With busy (the busy level, frac 1), the
// unlatched token check compares integers, as §5 does; the other levels
// compare in float64 (§15), even at a fraction of 1.
func checksAt(t events.Thresholds, l RankLoad, frac float64, capDecode, busy bool, margin float64, latched Checks) Checks {
	release := 1 - margin
	var c Checks
	if t.ActiveDecodeBlocks != nil && l.KVTotalBlocks > 0 {
		total := float64(l.KVTotalBlocks)
		var level float64
		switch latch := latched&CheckDecode != 0; {
		case capDecode && latch:
			level = release * math.Min(frac**t.ActiveDecodeBlocks, 1) * total
		case capDecode:
			level = math.Min(frac**t.ActiveDecodeBlocks, 1) * total
		case latch:
			level = release * frac * *t.ActiveDecodeBlocks * total
		default:
			level = frac * *t.ActiveDecodeBlocks * total
		}
		if float64(l.ActiveDecodeBlocks) > level {
			c |= CheckDecode
		}
	}
	if t.ActivePrefillTokens != nil {
		var above bool
		switch {
		case latched&CheckPrefill != 0:
			above = float64(l.ActivePrefillTokens) > release*frac*float64(*t.ActivePrefillTokens)
		case busy:
			above = l.ActivePrefillTokens > *t.ActivePrefillTokens
		default:
			above = float64(l.ActivePrefillTokens) > frac*float64(*t.ActivePrefillTokens)
		}
		if above {
			c |= CheckPrefill
		}
	}
	if t.ActivePrefillTokensFrac != nil {
		capacity := l.MaxNumBatchedTokens
		if capacity == 0 {
			capacity = events.DefaultMaxNumBatchedTokens
		}
		level := math.Trunc(frac * *t.ActivePrefillTokensFrac * float64(capacity))
		if latched&CheckPrefillFrac != 0 {
			level = math.Trunc(release * frac * *t.ActivePrefillTokensFrac * float64(capacity))
		}
		if float64(l.ActivePrefillTokens) > level {
			c |= CheckPrefillFrac
		}
	}
	if t.KVCommitted != nil && l.KVTotalBlocks > 0 {
		// Committed blocks may exceed the cache (overcommit, §21): the
		// hard level is not capped.
		level := frac * *t.KVCommitted * float64(l.KVTotalBlocks)
		if latched&CheckKVCommitted != 0 {
			level = release * frac * *t.KVCommitted * float64(l.KVTotalBlocks)
		}
		if float64(l.KVCommittedBlocks) > level {
			c |= CheckKVCommitted
		}
	}
	if t.QueueDelayMs != nil && l.QueueDelayKnown {
		level := frac * float64(*t.QueueDelayMs)
		if latched&CheckQueueDelay != 0 {
			level = release * frac * float64(*t.QueueDelayMs)
		}
		if l.QueueDelayMs > level {
			c |= CheckQueueDelay
		}
	}
	return c
}

// MaxSaturation caps a saturation (contract §21).
const MaxSaturation = 4

// RankSaturation is a rank's saturation (contract §21): the largest value ÷
// limit over the checks of t that can apply to l (0 when none), a limit of 0
// giving 0 for a value of 0 and MaxSaturation otherwise, capped at
// MaxSaturation. The limits are the busy levels of checksAt: t × total
// blocks (decode and committed, only when the total is known), the token
// threshold, trunc(frac × max_num_batched_tokens), the delay threshold
// (only while the prefill rate is known). A rank is busy exactly when its
// saturation is above 1, hysteresis aside.
func RankSaturation(t events.Thresholds, l RankLoad) float64 {
	s := 0.0
	ratio := func(value, limit float64) {
		r := 0.0
		switch {
		case limit > 0:
			r = value / limit
		case value > 0:
			r = MaxSaturation
		}
		s = max(s, r)
	}
	if t.ActiveDecodeBlocks != nil && l.KVTotalBlocks > 0 {
		ratio(float64(l.ActiveDecodeBlocks), *t.ActiveDecodeBlocks*float64(l.KVTotalBlocks))
	}
	if t.ActivePrefillTokens != nil {
		ratio(float64(l.ActivePrefillTokens), float64(*t.ActivePrefillTokens))
	}
	if t.ActivePrefillTokensFrac != nil {
		capacity := l.MaxNumBatchedTokens
		if capacity == 0 {
			capacity = events.DefaultMaxNumBatchedTokens
		}
		ratio(float64(l.ActivePrefillTokens), math.Trunc(*t.ActivePrefillTokensFrac*float64(capacity)))
	}
	if t.KVCommitted != nil && l.KVTotalBlocks > 0 {
		ratio(float64(l.KVCommittedBlocks), *t.KVCommitted*float64(l.KVTotalBlocks))
	}
	if t.QueueDelayMs != nil && l.QueueDelayKnown {
		ratio(l.QueueDelayMs, float64(*t.QueueDelayMs))
	}
	return min(s, MaxSaturation)
}

// Class is a worker's place in a record.
type Class uint8

// Worker classes. A worker that said goodbye is in no list.
const (
	ClassNone Class = iota
	ClassFree
	ClassBusy
	ClassStale
)

// String returns the class as the record's list name.
func (c Class) String() string {
	switch c {
	case ClassFree:
		return "free"
	case ClassBusy:
		return "busy"
	case ClassStale:
		return "stale"
	}
	return "none"
}
