package monitor

import (
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
	tests := []struct {
		name string
		t    events.Thresholds
		l    RankLoad
		want Reason
	}{
		{"none set, huge load", events.Thresholds{}, RankLoad{1e9, 1, 1e9, 1}, 0},
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

func TestReasonString(t *testing.T) {
	t.Parallel()
	for r, want := range map[Reason]string{0: "", ReasonKV: "kv", ReasonPrefill: "prefill", ReasonKV | ReasonPrefill: "kv+prefill"} {
		if got := r.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", r, got, want)
		}
	}
}

// src builds a source state heard at heard, with ranks [start, start+size)
// declared and the given ranks' loads (decode, total, prefill, max batched;
// a negative value is absent).
func src(start, size uint32, heard time.Time, ranks map[uint32][4]int64) *sourceState {
	s := &sourceState{start: start, size: size, heard: heard, ranks: map[uint32]*rankState{}}
	for rank, l := range ranks {
		rs := &rankState{heard: heard}
		for i, v := range l {
			if v >= 0 {
				rs.load[i] = events.Some(uint64(v))
			}
		}
		s.ranks[rank] = rs
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
			s.ranks[1].heard = old
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
			c, r := classify(th, tt.sources, freshAfter, &sc)
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
