package monitor

import (
	"maps"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
)

func TestRankBusy(t *testing.T) {
	t.Parallel()
	kv := func(v float64) events.Thresholds { return events.Thresholds{ActiveDecodeBlocks: &v} }
	pf := func(v uint64) events.Thresholds { return events.Thresholds{ActivePrefillTokens: &v} }
	frac := func(v float64) events.Thresholds { return events.Thresholds{ActivePrefillTokensFrac: &v} }
	all := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5), ActivePrefillTokens: events.Ptr[uint64](10)}
	kc := func(v float64) events.Thresholds { return events.Thresholds{KVCommitted: &v} }
	qd := func(v uint64) events.Thresholds { return events.Thresholds{QueueDelayMs: &v} }
	tests := []struct {
		name string
		t    events.Thresholds
		l    RankLoad
		want Reason
	}{
		{"none set, huge load", events.Thresholds{}, RankLoad{ActiveDecodeBlocks: 1e9, KVTotalBlocks: 1, ActivePrefillTokens: 1e9, MaxNumBatchedTokens: 1, KVCommittedBlocks: 1e9, QueueDelayMs: 1e9, QueueDelayKnown: true}, 0},
		{"kv exactly at threshold", kv(0.8), RankLoad{ActiveDecodeBlocks: 80, KVTotalBlocks: 100}, 0},
		{"kv one above", kv(0.8), RankLoad{ActiveDecodeBlocks: 81, KVTotalBlocks: 100}, ReasonKV},
		{"kv total unknown", kv(0.8), RankLoad{ActiveDecodeBlocks: 1000}, 0},
		{"kv threshold 0, idle", kv(0), RankLoad{KVTotalBlocks: 100}, 0},
		{"kv threshold 0, one block", kv(0), RankLoad{ActiveDecodeBlocks: 1, KVTotalBlocks: 100}, ReasonKV},
		{"kv threshold 1, full", kv(1), RankLoad{ActiveDecodeBlocks: 100, KVTotalBlocks: 100}, 0},
		{"kv threshold 1, over full", kv(1), RankLoad{ActiveDecodeBlocks: 101, KVTotalBlocks: 100}, ReasonKV},
		{"kv float64 as written", kv(0.1), RankLoad{ActiveDecodeBlocks: 3, KVTotalBlocks: 30}, 0},
		{"prefill exactly at threshold", pf(100), RankLoad{ActivePrefillTokens: 100}, 0},
		{"prefill one above", pf(100), RankLoad{ActivePrefillTokens: 101}, ReasonPrefill},
		{"prefill threshold 0, idle", pf(0), RankLoad{}, 0},
		{"prefill threshold 0, one token", pf(0), RankLoad{ActivePrefillTokens: 1}, ReasonPrefill},
		{"frac at threshold", frac(0.5), RankLoad{ActivePrefillTokens: 4096, MaxNumBatchedTokens: 8192}, 0},
		{"frac one above", frac(0.5), RankLoad{ActivePrefillTokens: 4097, MaxNumBatchedTokens: 8192}, ReasonPrefill},
		{"frac truncates", frac(0.3333), RankLoad{ActivePrefillTokens: 3, MaxNumBatchedTokens: 10}, 0},
		{"frac truncates, above", frac(0.3333), RankLoad{ActivePrefillTokens: 4, MaxNumBatchedTokens: 10}, ReasonPrefill},
		{"frac unknown capacity at 10M", frac(0.5), RankLoad{ActivePrefillTokens: 5_000_000}, 0},
		{"frac unknown capacity above", frac(0.5), RankLoad{ActivePrefillTokens: 5_000_001}, ReasonPrefill},
		{"frac 0, idle", frac(0), RankLoad{MaxNumBatchedTokens: 8192}, 0},
		{"frac 0, one token", frac(0), RankLoad{ActivePrefillTokens: 1}, ReasonPrefill},
		{"frac above 1", frac(2), RankLoad{ActivePrefillTokens: 16384, MaxNumBatchedTokens: 8192}, 0},
		{"both checks, kv only", all, RankLoad{ActiveDecodeBlocks: 51, KVTotalBlocks: 100, ActivePrefillTokens: 10}, ReasonKV},
		{"both checks, prefill only", all, RankLoad{ActiveDecodeBlocks: 50, KVTotalBlocks: 100, ActivePrefillTokens: 11}, ReasonPrefill},
		{"both checks, both", all, RankLoad{ActiveDecodeBlocks: 51, KVTotalBlocks: 100, ActivePrefillTokens: 11}, ReasonKV | ReasonPrefill},
		// Contract §21.
		{"committed at threshold", kc(1.5), RankLoad{KVCommittedBlocks: 150, KVTotalBlocks: 100}, 0},
		{"committed one above", kc(1.5), RankLoad{KVCommittedBlocks: 151, KVTotalBlocks: 100}, ReasonKVCommitted},
		{"committed total unknown", kc(0.5), RankLoad{KVCommittedBlocks: 1_000_000}, 0},
		{"committed threshold 0, one block", kc(0), RankLoad{KVCommittedBlocks: 1, KVTotalBlocks: 100}, ReasonKVCommitted},
		{"committed threshold 4", kc(4), RankLoad{KVCommittedBlocks: 401, KVTotalBlocks: 100}, ReasonKVCommitted},
		{"committed float64 as written", kc(0.1), RankLoad{KVCommittedBlocks: 3, KVTotalBlocks: 30}, 0},
		{"delay at threshold", qd(200), RankLoad{QueueDelayMs: 200, QueueDelayKnown: true}, 0},
		{"delay above", qd(200), RankLoad{QueueDelayMs: 200.001, QueueDelayKnown: true}, ReasonQueueDelay},
		{"delay unknown rate", qd(0), RankLoad{QueueDelayMs: 1e9, ActivePrefillTokens: 1e9}, 0},
		{"delay threshold 0, idle", qd(0), RankLoad{QueueDelayKnown: true}, 0},
		{"every check", events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5), ActivePrefillTokens: events.Ptr[uint64](10),
			KVCommitted: events.Ptr(1.0), QueueDelayMs: events.Ptr[uint64](100)},
			RankLoad{ActiveDecodeBlocks: 51, KVTotalBlocks: 100, ActivePrefillTokens: 11, KVCommittedBlocks: 101, QueueDelayMs: 101, QueueDelayKnown: true},
			ReasonKV | ReasonPrefill | ReasonKVCommitted | ReasonQueueDelay},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := RankBusy(tt.t, tt.l); got != tt.want {
				t.Fatalf("RankBusy = %q, want %q", got, tt.want)
			}
		})
	}
}

// sourcesOf names the sources of a table row, in the order of their names.
func sourcesOf(byName map[string]*sourceState) []*sourceState {
	var out []*sourceState
	for _, name := range slices.Sorted(maps.Keys(byName)) {
		byName[name].name = name
		out = append(out, byName[name])
	}
	return out
}

// src builds a source state heard at heard, with ranks [start, start+size)
// declared and the given ranks' loads (decode, total, prefill, max batched;
// a negative value is absent).
func src(start, size uint32, heard time.Time, ranks map[uint32][4]int64) *sourceState {
	s := &sourceState{start: start, size: size, heard: heard}
	for rank, l := range ranks {
		rs := s.rank(rank)
		rs.heard = heard
		for i, v := range l {
			if v >= 0 {
				rs.load[i] = events.Some(uint64(v))
			}
		}
	}
	return s
}

func TestClassify(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	fresh, old := now, now.Add(-time.Minute)
	freshAfter := now.Add(-10 * time.Second)
	th := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](100)}
	busyKV := [4]int64{90, 100, 0, -1}
	busyPF := [4]int64{10, 100, 200, -1}
	idle := [4]int64{10, 100, 0, -1}
	tests := []struct {
		name       string
		sources    map[string]*sourceState
		wantClass  Class
		wantReason Reason
	}{
		{"one rank busy", map[string]*sourceState{"engine": src(0, 1, fresh, map[uint32][4]int64{0: busyKV})}, ClassBusy, ReasonKV},
		{"one rank free", map[string]*sourceState{"engine": src(0, 1, fresh, map[uint32][4]int64{0: idle})}, ClassFree, 0},
		{"nothing fresh", map[string]*sourceState{"engine": src(0, 1, old, map[uint32][4]int64{0: busyKV})}, ClassStale, 0},
		{"no sources", map[string]*sourceState{}, ClassStale, 0},
		{"DP: one of two busy, other unobserved", map[string]*sourceState{"engine": src(0, 2, fresh, map[uint32][4]int64{0: busyKV})}, ClassFree, 0},
		{"DP: one of two busy, other idle", map[string]*sourceState{"engine": src(0, 2, fresh, map[uint32][4]int64{0: busyKV, 1: idle})}, ClassFree, 0},
		{"DP: all busy, reasons unite", map[string]*sourceState{"engine": src(4, 2, fresh, map[uint32][4]int64{4: busyKV, 5: busyPF})}, ClassBusy, ReasonKV | ReasonPrefill},
		{"DP: stale rank counts free", func() map[string]*sourceState {
			s := src(0, 2, fresh, map[uint32][4]int64{0: busyKV, 1: busyKV})
			s.find(1).heard = old
			return map[string]*sourceState{"engine": s}
		}(), ClassFree, 0},
		{"sources: router high hides nothing", map[string]*sourceState{
			"engine":     src(0, 1, fresh, map[uint32][4]int64{0: idle}),
			"router/r-1": src(0, 1, fresh, map[uint32][4]int64{0: busyPF}),
		}, ClassBusy, ReasonPrefill},
		{"sources: router low does not hide engine", map[string]*sourceState{
			"engine":     src(0, 1, fresh, map[uint32][4]int64{0: busyKV}),
			"router/r-1": src(0, 1, fresh, map[uint32][4]int64{0: {0, 1000, 0, -1}}),
		}, ClassBusy, ReasonKV},
		{"sources: smallest positive capacity counts", map[string]*sourceState{
			"engine":     src(0, 1, fresh, map[uint32][4]int64{0: {85, 100, -1, -1}}),
			"router/r-1": src(0, 1, fresh, map[uint32][4]int64{0: {0, 200, -1, -1}}),
		}, ClassBusy, ReasonKV},
		{"sources: zero capacity is unknown", map[string]*sourceState{
			"engine":     src(0, 1, fresh, map[uint32][4]int64{0: {85, 100, -1, -1}}),
			"router/r-1": src(0, 1, fresh, map[uint32][4]int64{0: {0, 0, -1, -1}}),
		}, ClassBusy, ReasonKV},
		{"sources: stale source ignored", map[string]*sourceState{
			"engine":     src(0, 1, fresh, map[uint32][4]int64{0: idle}),
			"router/r-1": src(0, 1, old, map[uint32][4]int64{0: busyPF}),
		}, ClassFree, 0},
		{"sources: declared ranks are the union", map[string]*sourceState{
			"engine":     src(0, 2, fresh, map[uint32][4]int64{0: busyKV, 1: busyKV}),
			"router/r-1": src(1, 2, fresh, map[uint32][4]int64{1: busyKV}),
		}, ClassFree, 0},
		{"sources: union all busy", map[string]*sourceState{
			"engine":     src(0, 2, fresh, map[uint32][4]int64{0: busyKV, 1: busyKV}),
			"router/r-1": src(1, 2, fresh, map[uint32][4]int64{2: busyPF}),
		}, ClassBusy, ReasonKV | ReasonPrefill},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var sc scratch
			c, r, _, _ := classify(th, Fractions{Shed: DefaultShedFraction, Critical: DefaultCriticalFraction}, &worker{sources: sourcesOf(tt.sources)}, 0, now, freshAfter, DefaultRateWindow, &sc)
			if c != tt.wantClass || r != tt.wantReason {
				t.Fatalf("classify = %v %q, want %v %q", c, r, tt.wantClass, tt.wantReason)
			}
		})
	}
}

func TestUnionSize(t *testing.T) {
	t.Parallel()
	tests := []struct {
		spans []span
		want  uint64
	}{
		{[]span{{0, 4}}, 4},
		{[]span{{0, 2}, {2, 4}}, 4},
		{[]span{{2, 4}, {0, 3}}, 4},
		{[]span{{0, 2}, {5, 6}}, 3},
		{[]span{{0, 10}, {2, 3}, {4, 5}}, 10},
		{[]span{{0, 1 << 32}, {0, 1}}, 1 << 32},
	}
	for _, tt := range tests {
		if got := unionSize(tt.spans); got != tt.want {
			t.Errorf("unionSize(%v) = %d, want %d", tt.spans, got, tt.want)
		}
	}
}

// TestRankChecksHysteresis: with a release margin, becoming busy is §5
// unchanged, and a latched check lets go only at or below its release level
// (1 − m) × threshold, evaluated left to right in float64.
func TestRankChecksHysteresis(t *testing.T) {
	t.Parallel()
	kv := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
	pf := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](1000)}
	frac := events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.5)}
	both := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](1000)}
	kc := events.Thresholds{KVCommitted: events.Ptr(1.5)}
	qd := events.Thresholds{QueueDelayMs: events.Ptr[uint64](200)}
	tests := []struct {
		name    string
		t       events.Thresholds
		l       RankLoad
		margin  float64
		latched Checks
		want    Checks
	}{
		// Not latched: exactly §5, whatever the margin.
		{"kv at threshold, not latched", kv, RankLoad{ActiveDecodeBlocks: 80, KVTotalBlocks: 100}, 0.1, 0, 0},
		{"kv above, not latched", kv, RankLoad{ActiveDecodeBlocks: 81, KVTotalBlocks: 100}, 0.1, 0, CheckDecode},
		{"kv between release and threshold, not latched", kv, RankLoad{ActiveDecodeBlocks: 75, KVTotalBlocks: 100}, 0.1, 0, 0},
		// Latched: held until at or below (1 − 0.1) × 0.8 × 100 = 72.
		{"kv latched, at threshold", kv, RankLoad{ActiveDecodeBlocks: 80, KVTotalBlocks: 100}, 0.1, CheckDecode, CheckDecode},
		{"kv latched, one above release", kv, RankLoad{ActiveDecodeBlocks: 73, KVTotalBlocks: 100}, 0.1, CheckDecode, CheckDecode},
		{"kv latched, at release", kv, RankLoad{ActiveDecodeBlocks: 72, KVTotalBlocks: 100}, 0.1, CheckDecode, 0},
		{"kv latched, margin 0 is §5", kv, RankLoad{ActiveDecodeBlocks: 80, KVTotalBlocks: 100}, 0, CheckDecode, 0},
		{"kv latched, total unknown", kv, RankLoad{ActiveDecodeBlocks: 80}, 0.1, CheckDecode, 0},
		// Prefill tokens: release 0.9 × 1000 = 900.
		{"prefill latched, 901", pf, RankLoad{ActivePrefillTokens: 901}, 0.1, CheckPrefill, CheckPrefill},
		{"prefill latched, 900", pf, RankLoad{ActivePrefillTokens: 900}, 0.1, CheckPrefill, 0},
		{"prefill not latched, 950", pf, RankLoad{ActivePrefillTokens: 950}, 0.1, 0, 0},
		// Fraction: release trunc(0.9 × 0.5 × 8192) = trunc(3686.4) = 3686.
		{"frac latched, 3687", frac, RankLoad{ActivePrefillTokens: 3687, MaxNumBatchedTokens: 8192}, 0.1, CheckPrefillFrac, CheckPrefillFrac},
		{"frac latched, 3686", frac, RankLoad{ActivePrefillTokens: 3686, MaxNumBatchedTokens: 8192}, 0.1, CheckPrefillFrac, 0},
		{"frac not latched, 4000", frac, RankLoad{ActivePrefillTokens: 4000, MaxNumBatchedTokens: 8192}, 0.1, 0, 0},
		// Each check has its own latch: a latched kv does not hold prefill.
		{"kv latched, prefill between", both, RankLoad{ActiveDecodeBlocks: 75, KVTotalBlocks: 100, ActivePrefillTokens: 950}, 0.1, CheckDecode, CheckDecode},
		{"kv released, prefill between not latched", both, RankLoad{ActiveDecodeBlocks: 70, KVTotalBlocks: 100, ActivePrefillTokens: 950}, 0.1, CheckDecode, 0},
		{"both latched, only prefill holds", both, RankLoad{ActiveDecodeBlocks: 70, KVTotalBlocks: 100, ActivePrefillTokens: 950}, 0.1, CheckDecode | CheckPrefill, CheckPrefill},
		// Committed 1.5 × 100: release (1 − 0.1) × 1.5 × 100 = 135.
		{"committed not latched, 140", kc, RankLoad{KVCommittedBlocks: 140, KVTotalBlocks: 100}, 0.1, 0, 0},
		{"committed latched, 136", kc, RankLoad{KVCommittedBlocks: 136, KVTotalBlocks: 100}, 0.1, CheckKVCommitted, CheckKVCommitted},
		{"committed latched, 135", kc, RankLoad{KVCommittedBlocks: 135, KVTotalBlocks: 100}, 0.1, CheckKVCommitted, 0},
		// Delay 200 ms: release 0.9 × 200 = 180.
		{"delay not latched, 190", qd, RankLoad{QueueDelayMs: 190, QueueDelayKnown: true}, 0.1, 0, 0},
		{"delay latched, 181", qd, RankLoad{QueueDelayMs: 181, QueueDelayKnown: true}, 0.1, CheckQueueDelay, CheckQueueDelay},
		{"delay latched, 180", qd, RankLoad{QueueDelayMs: 180, QueueDelayKnown: true}, 0.1, CheckQueueDelay, 0},
		{"delay latched, rate unknown", qd, RankLoad{QueueDelayMs: 1000}, 0.1, CheckQueueDelay, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := RankChecks(tt.t, tt.l, tt.margin, tt.latched); got != tt.want {
				t.Fatalf("RankChecks = %03b, want %03b", got, tt.want)
			}
		})
	}
}

func TestLatchOf(t *testing.T) {
	t.Parallel()
	for reason, want := range map[string]Checks{
		"kv": CheckDecode, "prefill": CheckPrefill | CheckPrefillFrac, "kv+prefill": CheckDecode | CheckPrefill | CheckPrefillFrac,
		"cordoned": 0, "": 0, "bogus": 0,
		"kv_committed": CheckKVCommitted, "queue_delay": CheckQueueDelay,
		"prefill+queue_delay":                 CheckPrefill | CheckPrefillFrac | CheckQueueDelay,
		"kv+prefill+kv_committed+queue_delay": checkAll,
		"kv_committed+bogus":                  CheckKVCommitted,
	} {
		if got := latchOf(reason); got != want {
			t.Errorf("latchOf(%q) = %03b, want %03b", reason, got, want)
		}
	}
}

// TestRankLevel: the graded levels of contract §15 at every boundary, with
// the default fractions (amber 0.8, hard 1.1) unless a case says otherwise.
// Strictly greater, float64, left to right as the contract writes it.
func TestRankLevel(t *testing.T) {
	t.Parallel()
	kv := func(v float64) events.Thresholds { return events.Thresholds{ActiveDecodeBlocks: &v} }
	pf := func(v uint64) events.Thresholds { return events.Thresholds{ActivePrefillTokens: &v} }
	frac := func(v float64) events.Thresholds { return events.Thresholds{ActivePrefillTokensFrac: &v} }
	def := Fractions{Shed: DefaultShedFraction, Critical: DefaultCriticalFraction}
	blocks := func(n uint64) RankLoad { return RankLoad{ActiveDecodeBlocks: n, KVTotalBlocks: 100} }
	kc := func(v float64) events.Thresholds { return events.Thresholds{KVCommitted: &v} }
	qd := func(v uint64) events.Thresholds { return events.Thresholds{QueueDelayMs: &v} }
	committed := func(n uint64) RankLoad { return RankLoad{KVCommittedBlocks: n, KVTotalBlocks: 100} }
	delay := func(ms float64) RankLoad { return RankLoad{QueueDelayMs: ms, QueueDelayKnown: true} }
	tests := []struct {
		name string
		t    events.Thresholds
		f    Fractions
		l    RankLoad
		want Level
	}{
		// No threshold set: every level is off.
		{"none set, huge load", events.Thresholds{}, def, RankLoad{ActiveDecodeBlocks: 1e9, KVTotalBlocks: 1, ActivePrefillTokens: 1e9, MaxNumBatchedTokens: 1, KVCommittedBlocks: 1e9, QueueDelayMs: 1e9, QueueDelayKnown: true}, LevelFree},
		{"kv unset, prefill set, decode full", pf(1000), def, RankLoad{ActiveDecodeBlocks: 100, KVTotalBlocks: 100, ActivePrefillTokens: 10}, LevelFree},
		// Decode 0.8 of 100 blocks: amber above 0.8 × 0.8 × 100 = 64.00000000000001,
		// busy above 80, hard above min(1.1 × 0.8, 1) × 100 = 88.00000000000001.
		{"kv idle", kv(0.8), def, blocks(0), LevelFree},
		{"kv at amber", kv(0.8), def, blocks(64), LevelFree},
		{"kv above amber", kv(0.8), def, blocks(65), LevelAmber},
		{"kv at busy", kv(0.8), def, blocks(80), LevelAmber},
		{"kv above busy", kv(0.8), def, blocks(81), LevelBusy},
		{"kv at hard", kv(0.8), def, blocks(88), LevelBusy},
		{"kv above hard", kv(0.8), def, blocks(89), LevelHard},
		{"kv total unknown", kv(0.8), def, RankLoad{ActiveDecodeBlocks: 1000}, LevelFree},
		// Left to right: 0.7 × 0.1 × 100 = 6.999999999999999, so 7 blocks are
		// amber (0.7 × (0.1 × 100) would be 7, and 7 would not be).
		{"kv float64 left to right", kv(0.1), Fractions{Shed: 0.7, Critical: 1.1}, blocks(7), LevelAmber},
		{"kv float64 left to right, below", kv(0.1), Fractions{Shed: 0.7, Critical: 1.1}, blocks(6), LevelFree},
		// The decode check of hard is capped at the whole cache: with 0.95,
		// min(1.1 × 0.95, 1) × 100 = 100, not 104.5.
		{"kv cap, full cache", kv(0.95), def, blocks(100), LevelBusy},
		{"kv cap, over full", kv(0.95), def, blocks(101), LevelHard},
		{"kv threshold 1, full is not hard", kv(1), def, blocks(100), LevelAmber},
		{"kv threshold 1, over full", kv(1), def, blocks(101), LevelHard},
		{"kv threshold 0, one block", kv(0), def, blocks(1), LevelHard},
		{"kv threshold 0, idle", kv(0), def, blocks(0), LevelFree},
		// Prefill tokens 1000: amber above 800, busy above 1000, hard above 1100.
		{"prefill at amber", pf(1000), def, RankLoad{ActivePrefillTokens: 800}, LevelFree},
		{"prefill above amber", pf(1000), def, RankLoad{ActivePrefillTokens: 801}, LevelAmber},
		{"prefill at busy", pf(1000), def, RankLoad{ActivePrefillTokens: 1000}, LevelAmber},
		{"prefill above busy", pf(1000), def, RankLoad{ActivePrefillTokens: 1001}, LevelBusy},
		{"prefill at hard", pf(1000), def, RankLoad{ActivePrefillTokens: 1100}, LevelBusy},
		{"prefill above hard", pf(1000), def, RankLoad{ActivePrefillTokens: 1101}, LevelHard},
		{"prefill threshold 0, one token", pf(0), def, RankLoad{ActivePrefillTokens: 1}, LevelHard},
		// Fraction 0.5 of 8192: amber above trunc(3276.8) = 3276, busy above
		// 4096, hard above trunc(4505.6) = 4505.
		{"frac at amber", frac(0.5), def, RankLoad{ActivePrefillTokens: 3276, MaxNumBatchedTokens: 8192}, LevelFree},
		{"frac above amber", frac(0.5), def, RankLoad{ActivePrefillTokens: 3277, MaxNumBatchedTokens: 8192}, LevelAmber},
		{"frac at busy", frac(0.5), def, RankLoad{ActivePrefillTokens: 4096, MaxNumBatchedTokens: 8192}, LevelAmber},
		{"frac above busy", frac(0.5), def, RankLoad{ActivePrefillTokens: 4097, MaxNumBatchedTokens: 8192}, LevelBusy},
		{"frac at hard", frac(0.5), def, RankLoad{ActivePrefillTokens: 4505, MaxNumBatchedTokens: 8192}, LevelBusy},
		{"frac above hard", frac(0.5), def, RankLoad{ActivePrefillTokens: 4506, MaxNumBatchedTokens: 8192}, LevelHard},
		// Unknown capacity counts as 10,000,000: amber above 4,000,000, hard above 5,500,000.
		{"frac unknown capacity at amber", frac(0.5), def, RankLoad{ActivePrefillTokens: 4_000_000}, LevelFree},
		{"frac unknown capacity above amber", frac(0.5), def, RankLoad{ActivePrefillTokens: 4_000_001}, LevelAmber},
		{"frac unknown capacity at hard", frac(0.5), def, RankLoad{ActivePrefillTokens: 5_500_000}, LevelBusy},
		{"frac unknown capacity above hard", frac(0.5), def, RankLoad{ActivePrefillTokens: 5_500_001}, LevelHard},
		// Any check counts at each level: kv amber and prefill hard is hard.
		{"checks combine", events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](1000)}, def,
			RankLoad{ActiveDecodeBlocks: 70, KVTotalBlocks: 100, ActivePrefillTokens: 1200}, LevelHard},
		// Fractions at their bounds: 1 puts amber (or hard) on the busy line.
		{"shed 1: amber is busy", kv(0.8), Fractions{Shed: 1, Critical: 1.1}, blocks(80), LevelFree},
		{"shed 1: above busy", kv(0.8), Fractions{Shed: 1, Critical: 1.1}, blocks(81), LevelBusy},
		{"critical 1: busy is hard", kv(0.8), Fractions{Shed: 0.8, Critical: 1}, blocks(81), LevelHard},
		// Committed 2 × 100: amber above 160, busy above 200, hard above
		// 220, not capped at the cache (overcommit).
		{"committed at amber", kc(2), def, committed(160), LevelFree},
		{"committed above amber", kc(2), def, committed(161), LevelAmber},
		{"committed above busy", kc(2), def, committed(201), LevelBusy},
		{"committed at hard", kc(2), def, committed(220), LevelBusy},
		{"committed above hard", kc(2), def, committed(221), LevelHard},
		// Delay 500 ms: amber above 400, hard above 550.
		{"delay at amber", qd(500), def, delay(400), LevelFree},
		{"delay above amber", qd(500), def, delay(400.5), LevelAmber},
		{"delay above busy", qd(500), def, delay(501), LevelBusy},
		{"delay at hard", qd(500), def, delay(550), LevelBusy},
		{"delay above hard", qd(500), def, delay(551), LevelHard},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := RankLevel(tt.t, tt.l, tt.f); got != tt.want {
				t.Fatalf("RankLevel = %v, want %v", got, tt.want)
			}
			// Busy is §5 whatever the fractions.
			if busy := RankBusy(tt.t, tt.l) != 0; busy != (RankLevel(tt.t, tt.l, tt.f) >= LevelBusy) {
				t.Fatalf("RankBusy = %v, level %v", busy, RankLevel(tt.t, tt.l, tt.f))
			}
		})
	}
}

// TestRankLevelsHysteresis: each level has its own latch with the same
// margin: a latched level lets go only at or below (1 − m) × that level,
// left to right in float64; an unlatched one is the rule unchanged.
func TestRankLevelsHysteresis(t *testing.T) {
	t.Parallel()
	kv := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
	kv95 := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.95)}
	pf := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](1000)}
	frac := events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.5)}
	def := Fractions{Shed: DefaultShedFraction, Critical: DefaultCriticalFraction}
	blocks := func(n uint64) RankLoad { return RankLoad{ActiveDecodeBlocks: n, KVTotalBlocks: 100} }
	amber := Latch{Amber: CheckDecode}
	hard := Latch{Amber: CheckDecode, Busy: CheckDecode, Hard: CheckDecode}
	tests := []struct {
		name    string
		t       events.Thresholds
		l       RankLoad
		latched Latch
		want    Latch
	}{
		// Amber: on above 64.00000000000001; latched, off at or below
		// 0.9 × 0.8 × 0.8 × 100 = 57.60000000000001.
		{"amber, not latched, 60", kv, blocks(60), Latch{}, Latch{}},
		{"amber latched, 58", kv, blocks(58), amber, amber},
		{"amber latched, 57", kv, blocks(57), amber, Latch{}},
		// Hard: on above 88.00000000000001; latched, off at or below
		// 0.9 × min(1.1 × 0.8, 1) × 100 = 79.20000000000002 (busy's own
		// release level is 72).
		{"hard latched, 80", kv, blocks(80), hard, hard},
		{"hard latched, 79", kv, blocks(79), hard, Latch{Amber: CheckDecode, Busy: CheckDecode}},
		{"hard not latched, 85", kv, blocks(85), Latch{Amber: CheckDecode, Busy: CheckDecode}, Latch{Amber: CheckDecode, Busy: CheckDecode}},
		// The capped hard level releases at 0.9 × 1 × 100 = 90.
		{"hard cap latched, 91", kv95, blocks(91), hard, hard},
		{"hard cap latched, 90", kv95, blocks(90), hard, Latch{Amber: CheckDecode, Busy: CheckDecode}},
		// Prefill tokens: amber releases at 0.9 × 0.8 × 1000 = 720.0000000000001,
		// hard at 0.9 × 1.1 × 1000 = 990.0000000000001.
		{"prefill amber latched, 721", pf, RankLoad{ActivePrefillTokens: 721}, Latch{Amber: CheckPrefill}, Latch{Amber: CheckPrefill}},
		{"prefill amber latched, 720", pf, RankLoad{ActivePrefillTokens: 720}, Latch{Amber: CheckPrefill}, Latch{}},
		{"prefill hard latched, 991", pf, RankLoad{ActivePrefillTokens: 991}, Latch{Amber: CheckPrefill, Busy: CheckPrefill, Hard: CheckPrefill},
			Latch{Amber: CheckPrefill, Busy: CheckPrefill, Hard: CheckPrefill}},
		{"prefill hard latched, 990", pf, RankLoad{ActivePrefillTokens: 990}, Latch{Amber: CheckPrefill, Busy: CheckPrefill, Hard: CheckPrefill},
			Latch{Amber: CheckPrefill, Busy: CheckPrefill}},
		// Fraction: amber releases at trunc(0.9 × 0.8 × 0.5 × 8192) = 2949,
		// hard at trunc(0.9 × 1.1 × 0.5 × 8192) = 4055.
		{"frac amber latched, 2950", frac, RankLoad{ActivePrefillTokens: 2950, MaxNumBatchedTokens: 8192}, Latch{Amber: CheckPrefillFrac}, Latch{Amber: CheckPrefillFrac}},
		{"frac amber latched, 2949", frac, RankLoad{ActivePrefillTokens: 2949, MaxNumBatchedTokens: 8192}, Latch{Amber: CheckPrefillFrac}, Latch{}},
		{"frac hard latched, 4056", frac, RankLoad{ActivePrefillTokens: 4056, MaxNumBatchedTokens: 8192}, Latch{Busy: CheckPrefillFrac, Hard: CheckPrefillFrac},
			Latch{Amber: CheckPrefillFrac, Busy: CheckPrefillFrac, Hard: CheckPrefillFrac}},
		{"frac hard latched, 4055", frac, RankLoad{ActivePrefillTokens: 4055, MaxNumBatchedTokens: 8192}, Latch{Busy: CheckPrefillFrac, Hard: CheckPrefillFrac},
			Latch{Amber: CheckPrefillFrac, Busy: CheckPrefillFrac}},
		{"frac busy released, 3686", frac, RankLoad{ActivePrefillTokens: 3686, MaxNumBatchedTokens: 8192}, Latch{Busy: CheckPrefillFrac, Hard: CheckPrefillFrac},
			Latch{Amber: CheckPrefillFrac}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := RankLevels(tt.t, tt.l, def, 0.1, tt.latched); got != tt.want {
				t.Fatalf("RankLevels = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestLatchLevel(t *testing.T) {
	t.Parallel()
	for l, want := range map[Latch]Level{
		{}:                           LevelFree,
		{Amber: CheckDecode}:         LevelAmber,
		{Busy: CheckDecode}:          LevelBusy, // busy is at least amber
		{Hard: CheckDecode}:          LevelFree, // hard counts only on a busy rank
		{Amber: 1, Busy: 1}:          LevelBusy,
		{Busy: 1, Hard: 1}:           LevelHard,
		{Amber: 1, Hard: 1}:          LevelAmber,
		{Amber: 7, Busy: 7, Hard: 7}: LevelHard,
	} {
		if got := l.Level(); got != want {
			t.Errorf("%+v.Level() = %v, want %v", l, got, want)
		}
	}
	for l, want := range map[Level]string{LevelFree: "free", LevelAmber: "amber", LevelBusy: "busy", LevelHard: "hard"} {
		if got := l.String(); got != want {
			t.Errorf("String = %q, want %q", got, want)
		}
	}
}

// TestClassifyLevels: a worker is at the lowest level of its declared ranks,
// a declared rank with no fresh state counting as free (contract §15).
func TestClassifyLevels(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	fresh := now
	freshAfter := now.Add(-10 * time.Second)
	th := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
	def := Fractions{Shed: DefaultShedFraction, Critical: DefaultCriticalFraction}
	free, amber, busy, hard := [4]int64{10, 100, -1, -1}, [4]int64{70, 100, -1, -1}, [4]int64{85, 100, -1, -1}, [4]int64{95, 100, -1, -1}
	tests := []struct {
		name      string
		ranks     map[uint32][4]int64
		size      uint32
		wantClass Class
		wantLevel Level
	}{
		{"one rank free", map[uint32][4]int64{0: free}, 1, ClassFree, LevelFree},
		{"one rank amber", map[uint32][4]int64{0: amber}, 1, ClassFree, LevelAmber},
		{"one rank busy", map[uint32][4]int64{0: busy}, 1, ClassBusy, LevelBusy},
		{"one rank hard", map[uint32][4]int64{0: hard}, 1, ClassBusy, LevelHard},
		{"hard and amber: amber", map[uint32][4]int64{0: hard, 1: amber}, 2, ClassFree, LevelAmber},
		{"hard and busy: busy", map[uint32][4]int64{0: hard, 1: busy}, 2, ClassBusy, LevelBusy},
		{"hard and hard: hard", map[uint32][4]int64{0: hard, 1: hard}, 2, ClassBusy, LevelHard},
		{"busy and free: free", map[uint32][4]int64{0: busy, 1: free}, 2, ClassFree, LevelFree},
		{"hard, second rank unobserved: free", map[uint32][4]int64{0: hard}, 2, ClassFree, LevelFree},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var sc scratch
			w := &worker{sources: sourcesOf(map[string]*sourceState{"engine": src(0, tt.size, fresh, tt.ranks)})}
			c, _, l, _ := classify(th, def, w, 0, now, freshAfter, DefaultRateWindow, &sc)
			if c != tt.wantClass || l != tt.wantLevel {
				t.Fatalf("classify = %v %v, want %v %v", c, l, tt.wantClass, tt.wantLevel)
			}
		})
	}
}

// contractChecks is the contract's arithmetic for one level, written out as
// §5, §12 and §15 spell it, level by level: the oracle of FuzzRankLevels.
func contractChecks(t events.Thresholds, l RankLoad, lvl Level, f Fractions, m float64, latched Checks) Checks {
	var c Checks
	capacity := float64(l.MaxNumBatchedTokens)
	if l.MaxNumBatchedTokens == 0 {
		capacity = events.DefaultMaxNumBatchedTokens
	}
	decode, tokens := float64(l.ActiveDecodeBlocks), float64(l.ActivePrefillTokens)
	total := float64(l.KVTotalBlocks)
	var decodeLevel, tokensLevel, fracLevel float64
	switch lvl {
	case LevelBusy:
		if t.ActiveDecodeBlocks != nil {
			decodeLevel = *t.ActiveDecodeBlocks * total
			if latched&CheckDecode != 0 {
				decodeLevel = (1 - m) * *t.ActiveDecodeBlocks * total
			}
		}
		if t.ActivePrefillTokens != nil {
			tokensLevel = (1 - m) * float64(*t.ActivePrefillTokens)
		}
		if t.ActivePrefillTokensFrac != nil {
			fracLevel = math.Trunc(*t.ActivePrefillTokensFrac * capacity)
			if latched&CheckPrefillFrac != 0 {
				fracLevel = math.Trunc((1 - m) * *t.ActivePrefillTokensFrac * capacity)
			}
		}
	case LevelAmber, LevelHard:
		fr := f.Shed
		if lvl == LevelHard {
			fr = f.Critical
		}
		if t.ActiveDecodeBlocks != nil {
			if lvl == LevelHard {
				decodeLevel = math.Min(fr**t.ActiveDecodeBlocks, 1) * total
				if latched&CheckDecode != 0 {
					decodeLevel = (1 - m) * math.Min(fr**t.ActiveDecodeBlocks, 1) * total
				}
			} else {
				decodeLevel = fr * *t.ActiveDecodeBlocks * total
				if latched&CheckDecode != 0 {
					decodeLevel = (1 - m) * fr * *t.ActiveDecodeBlocks * total
				}
			}
		}
		if t.ActivePrefillTokens != nil {
			tokensLevel = fr * float64(*t.ActivePrefillTokens)
			if latched&CheckPrefill != 0 {
				tokensLevel = (1 - m) * fr * float64(*t.ActivePrefillTokens)
			}
		}
		if t.ActivePrefillTokensFrac != nil {
			fracLevel = math.Trunc(fr * *t.ActivePrefillTokensFrac * capacity)
			if latched&CheckPrefillFrac != 0 {
				fracLevel = math.Trunc((1 - m) * fr * *t.ActivePrefillTokensFrac * capacity)
			}
		}
	}
	if t.ActiveDecodeBlocks != nil && l.KVTotalBlocks > 0 && decode > decodeLevel {
		c |= CheckDecode
	}
	if t.ActivePrefillTokens != nil {
		// §5 compares the token counts as integers; a latched check
		// compares with its float64 release level.
		above := tokens > tokensLevel
		if lvl == LevelBusy && latched&CheckPrefill == 0 {
			above = l.ActivePrefillTokens > *t.ActivePrefillTokens
		}
		if above {
			c |= CheckPrefill
		}
	}
	if t.ActivePrefillTokensFrac != nil && tokens > fracLevel {
		c |= CheckPrefillFrac
	}
	return c
}

// FuzzRankLevels checks every level of RankLevels, and RankChecks, against
// the contract's arithmetic written out level by level.
func FuzzRankLevels(f *testing.F) {
	f.Add(0.8, uint64(1000), 0.5, uint64(81), uint64(100), uint64(1001), uint64(8192), 0.8, 1.1, 0.1, uint8(7), uint8(0), uint8(7))
	f.Add(0.1, uint64(10), 0.3333, uint64(3), uint64(30), uint64(4), uint64(10), 1.0, 1.0, 0.0, uint8(7), uint8(7), uint8(7))
	f.Add(0.9, uint64(1<<60), 0.5, uint64(1<<62), uint64(1<<61), uint64(1<<60+1), uint64(0), 0.95, 1.2, 0.2, uint8(1), uint8(2), uint8(4))
	// A fraction of exactly 1 at amber or hard compares tokens in float64
	// (§15), unlike the busy level's integers (§5): 2^53+1 is not above 2^53.
	f.Add(0.5, uint64(1<<53), 0.5, uint64(0), uint64(100), uint64(1<<53+1), uint64(0), 1.0, 1.0, 0.0, uint8(2), uint8(0), uint8(0))
	f.Fuzz(func(t *testing.T, decodeT float64, tokensT uint64, fracT float64, decode, total, tokens, batched uint64,
		shed, critical, margin float64, set, latchedAmber, latchedHard uint8) {
		for _, v := range []float64{decodeT, fracT, shed, critical, margin} {
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				t.Skip()
			}
		}
		if margin >= 1 || shed == 0 || shed > 1 || critical < 1 {
			t.Skip()
		}
		var th events.Thresholds
		if set&1 != 0 {
			th.ActiveDecodeBlocks = &decodeT
		}
		if set&2 != 0 {
			th.ActivePrefillTokens = &tokensT
		}
		if set&4 != 0 {
			th.ActivePrefillTokensFrac = &fracT
		}
		l := RankLoad{ActiveDecodeBlocks: decode, KVTotalBlocks: total, ActivePrefillTokens: tokens, MaxNumBatchedTokens: batched}
		fr := Fractions{Shed: shed, Critical: critical}
		latched := Latch{Amber: Checks(latchedAmber) & checkAll, Busy: Checks(set>>3) & checkAll, Hard: Checks(latchedHard) & checkAll}
		got := RankLevels(th, l, fr, margin, latched)
		want := Latch{
			Amber: contractChecks(th, l, LevelAmber, fr, margin, latched.Amber),
			Busy:  contractChecks(th, l, LevelBusy, fr, margin, latched.Busy),
			Hard:  contractChecks(th, l, LevelHard, fr, margin, latched.Hard),
		}
		if got != want {
			t.Fatalf("RankLevels(%+v, %+v, %+v, %v, %+v) = %+v, want %+v", th, l, fr, margin, latched, got, want)
		}
		if c := RankChecks(th, l, margin, latched.Busy); c != want.Busy {
			t.Fatalf("RankChecks = %v, want %v", c, want.Busy)
		}
	})
}

// TestReasonString: the reasons of the checks joined by "+" in the order
// kv, prefill, kv_committed, queue_delay (contract §21); cordoned outranks.
func TestReasonString(t *testing.T) { // not parallel: AllocsPerRun
	for r, want := range map[Reason]string{
		0: "", ReasonKV: "kv", ReasonPrefill: "prefill", ReasonKV | ReasonPrefill: "kv+prefill",
		ReasonKVCommitted: "kv_committed", ReasonQueueDelay: "queue_delay",
		ReasonPrefill | ReasonQueueDelay:                                "prefill+queue_delay",
		ReasonQueueDelay | ReasonKVCommitted | ReasonKV:                 "kv+kv_committed+queue_delay",
		ReasonKV | ReasonPrefill | ReasonKVCommitted | ReasonQueueDelay: "kv+prefill+kv_committed+queue_delay",
		ReasonCordoned | ReasonKV:                                       "cordoned",
	} {
		if got := r.String(); got != want {
			t.Errorf("Reason(%05b) = %q, want %q", uint8(r), got, want)
		}
		if r&ReasonCordoned == 0 {
			if back := latchOf(want).Reason(); back != r {
				t.Errorf("latchOf(%q).Reason() = %05b, want %05b", want, back, r)
			}
		}
	}
	if got := testing.AllocsPerRun(10, func() { _ = (ReasonKV | ReasonQueueDelay).String() }); got != 0 {
		t.Errorf("Reason.String allocates %v times", got)
	}
}
