package slots

import (
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// within runs f and fails the test when it has not returned after d: a
// walk of ranks that wraps never returns.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}

// TestRangeEndingAt2To32: a range that ends exactly at 2^32 (rank
// 4294967295 is legal, contract §3) is registered, loaded, moved and
// unregistered, and no walk of its ranks wraps to 0; a range past 2^32 is
// refused.
func TestRangeEndingAt2To32(t *testing.T) {
	t.Parallel()
	const top = math.MaxUint32
	tr, _ := newTracker(t, nil)
	within(t, 5*time.Second, "the walks of a range ending at 2^32", func() {
		must(t, tr.Register(Worker{WorkerID: 8, Model: "m1", BlockSize: 16, DPStart: top, DPSize: 1}))
		if l := tr.Loads("", ""); len(l) != 1 || l[0].DPRank != top {
			t.Errorf("loads %+v, want rank %d alone", l, uint32(top))
		}
		must(t, tr.Add(Request{Model: "m1", ID: "a", WorkerID: 8, DPRank: top, Hashes: []uint64{1}, NewISLTokens: 5}))
		if p, ok := tr.WorkerPotential("m1", "", 8, []uint64{2}, 3); !ok || p.DPRank != top || p.PotentialPrefillTokens != 8 ||
			p.PotentialDecodeBlocks != 2 {
			t.Errorf("worker potential %+v %v, want rank %d, 8 tokens, 2 blocks", p, ok, uint32(top))
		}
		if r, err := tr.AddLeastLoaded(Request{Model: "m1", ID: "b", WorkerID: 8, Hashes: []uint64{1}}); err != nil || r != top {
			t.Errorf("add least loaded: rank %d, %v; want %d", r, err, uint32(top))
		}
		// Moved to two ranks ending at 2^32: the old rank stays with its
		// requests; moved back to the last one alone, rank top-1 goes.
		must(t, tr.Register(Worker{WorkerID: 8, Model: "m1", BlockSize: 16, DPStart: top - 1, DPSize: 2}))
		if l := tr.Loads("", ""); len(l) != 2 || l[1].DPRank != top || l[1].ActivePrefillTokens != 5 {
			t.Errorf("loads after the move %+v", l)
		}
		must(t, tr.Add(Request{Model: "m1", ID: "c", WorkerID: 8, DPRank: top - 1, NewISLTokens: 7}))
		must(t, tr.Register(Worker{WorkerID: 8, Model: "m1", BlockSize: 16, DPStart: top, DPSize: 1}))
		if s := tr.Stats(); s.Ranks != 1 || s.Requests != 2 {
			t.Errorf("after moving back: %d ranks, %d requests; want 1 and 2", s.Ranks, s.Requests)
		}
		must(t, tr.Unregister("m1", "", 8))
		if s := tr.Stats(); s.Workers != 0 || s.Ranks != 0 || s.Requests != 0 || s.Blocks != 0 {
			t.Errorf("after unregistering: %+v", s)
		}
	})
	for _, w := range []Worker{{DPStart: top, DPSize: 2}, {DPStart: top - 1, DPSize: 3}, {DPStart: top - 1022, DPSize: 1024}} {
		w.WorkerID, w.Model, w.BlockSize = 9, "m1", 16
		wantErr(t, "a range past 2^32", tr.Register(w), ErrInvalid)
	}
	if s := tr.Stats(); s.Workers != 0 || s.Ranks != 0 {
		t.Errorf("a range past 2^32 left %+v", s)
	}
}

// checkIndex checks the tracker's per-rank request lists: every active
// request is on its rank's list once, nothing else is, and a rank's
// prefill tokens and blocks are those of its listed requests.
func checkIndex(t *testing.T, tr *Tracker) {
	t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	total := 0
	for _, trk := range tr.trackers {
		listed := 0
		for rk, rs := range trk.ranks {
			var prefill tokens
			blocks := map[uint64]uint32{}
			var prev *request
			for r := rs.requests; r != nil; prev, r = r, r.next {
				if r.prev != prev || r.freed || r.at != rk || trk.requests[r.id] != r {
					t.Fatalf("rank %+v lists request %q wrongly (at %+v, freed %v)", rk, r.id, r.at, r.freed)
				}
				prefill.add(r.prefill)
				for _, h := range r.hashes {
					blocks[h]++
				}
				listed++
			}
			if prefill != rs.prefill || !maps.Equal(blocks, rs.blocks) {
				t.Fatalf("rank %+v: prefill %d, blocks %v; its listed requests make %d, %v", rk, rs.prefill, rs.blocks, prefill, blocks)
			}
		}
		if listed != len(trk.requests) {
			t.Fatalf("%d requests listed by rank, %d active", listed, len(trk.requests))
		}
		total += listed
	}
	if total != tr.requests {
		t.Fatalf("%d requests listed, %d counted", total, tr.requests)
	}
}

// TestRequestsIndexedByRank: through random adds, frees, prefill
// completions, expiries, moved ranges and unregistrations, each rank lists
// exactly its active requests (issue 23 item 20: a rank is dropped by
// walking its own requests; BenchmarkUnregister shows the cost).
func TestRequestsIndexedByRank(t *testing.T) {
	t.Parallel()
	tr, c := newTracker(t, func(c *Config) { c.RequestTTL = time.Minute })
	rng := rand.New(rand.NewPCG(1, 2))
	next := 0
	for step := range 5000 {
		worker := uint64(rng.IntN(4))
		switch op := rng.IntN(10); {
		case op == 0:
			start := uint32(rng.IntN(4))
			if rng.IntN(4) == 0 {
				start = math.MaxUint32 - 3
			}
			must(t, tr.Register(Worker{WorkerID: worker, Model: "m", BlockSize: 16, DPStart: start, DPSize: uint32(1 + rng.IntN(4))}))
		case op == 1 && rng.IntN(4) == 0:
			_ = tr.Unregister("m", "", worker)
		case op <= 5:
			next++
			hashes := []uint64{uint64(rng.IntN(8)), uint64(rng.IntN(8))}
			_, _ = tr.AddLeastLoaded(Request{Model: "m", ID: fmt.Sprint(next), WorkerID: worker, Hashes: hashes,
				NewISLTokens: uint64(rng.IntN(100))})
		case op <= 7:
			_ = tr.Free("m", "", fmt.Sprint(rng.IntN(next+1)))
		case op == 8:
			_ = tr.PrefillComplete("m", "", fmt.Sprint(rng.IntN(next+1)))
		default:
			c.t = c.t.Add(time.Duration(rng.IntN(10)) * time.Second)
		}
		if step%10 == 0 {
			checkIndex(t, tr)
		}
	}
	checkIndex(t, tr)
	for w := range uint64(4) {
		_ = tr.Unregister("m", "", w)
	}
	checkIndex(t, tr)
	if s := tr.Stats(); s.Requests != 0 || s.Blocks != 0 || s.Ranks != 0 {
		t.Errorf("after unregistering every worker: %+v", s)
	}
}
