package slots

import (
	"math"
	"testing"
)

// TestPrefillTokensSaturate: prefill tokens summed past 2^64-1 stay at
// 2^64-1 on /loads and in every projection, never wrap (issue 23 item
// 23), and come back exactly as the requests leave.
func TestPrefillTokensSaturate(t *testing.T) {
	t.Parallel()
	const most = math.MaxUint64
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 2}))
	must(t, tr.Add(Request{Model: "m", ID: "a", WorkerID: 1, NewISLTokens: most}))
	must(t, tr.Add(Request{Model: "m", ID: "b", WorkerID: 1, NewISLTokens: 2}))
	must(t, tr.Add(Request{Model: "m", ID: "c", WorkerID: 1, NewISLTokens: most}))
	prefill := func() uint64 {
		t.Helper()
		return tr.Loads("m", "")[0].ActivePrefillTokens
	}
	if got := prefill(); got != most {
		t.Errorf("active_prefill_tokens after 2^64-1 + 2 + 2^64-1: %d, want %d", got, uint64(most))
	}
	ps, err := tr.PotentialLoads("m", "", nil, 5)
	must(t, err)
	if ps[0].PotentialPrefillTokens != most || ps[1].PotentialPrefillTokens != 5 {
		t.Errorf("potential loads %+v, want %d on rank 0", ps, uint64(most))
	}
	// Rank 1 is the least loaded; with 2^64-1 more it saturates too.
	if p, ok := tr.WorkerPotential("m", "", 1, nil, most); !ok || p.DPRank != 1 || p.PotentialPrefillTokens != most {
		t.Errorf("worker potential %+v %v, want rank 1 at %d", p, ok, uint64(most))
	}
	must(t, tr.Add(Request{Model: "m", ID: "d", WorkerID: 1, DPRank: 1, NewISLTokens: 3}))
	if p, ok := tr.WorkerPotential("m", "", 1, nil, most); !ok || p.DPRank != 1 || p.PotentialPrefillTokens != most {
		t.Errorf("worker potential %+v %v, want rank 1 at %d", p, ok, uint64(most))
	}
	// Rank 0 saturated is still the more loaded one.
	if r, err := tr.AddLeastLoaded(Request{Model: "m", ID: "e", WorkerID: 1}); err != nil || r != 1 {
		t.Errorf("add least loaded: rank %d, %v; want 1", r, err)
	}
	// The exact sum is kept: the tokens come back as the requests leave.
	must(t, tr.PrefillComplete("m", "", "a"))
	if got := prefill(); got != most {
		t.Errorf("active_prefill_tokens after 2 + 2^64-1: %d, want %d", got, uint64(most))
	}
	must(t, tr.Free("m", "", "c"))
	if got := prefill(); got != 2 {
		t.Errorf("active_prefill_tokens after the big requests left: %d, want 2", got)
	}
}

// TestSaturatingAdd: sums of loads stop at 2^64-1.
func TestSaturatingAdd(t *testing.T) {
	t.Parallel()
	for _, c := range [][3]uint64{{1, 2, 3}, {math.MaxUint64, 2, math.MaxUint64}, {math.MaxUint64 - 1, 1, math.MaxUint64},
		{math.MaxUint64, math.MaxUint64, math.MaxUint64}, {0, 0, 0}} {
		if got := SaturatingAdd(c[0], c[1]); got != c[2] {
			t.Errorf("SaturatingAdd(%d, %d) = %d, want %d", c[0], c[1], got, c[2])
		}
	}
}
