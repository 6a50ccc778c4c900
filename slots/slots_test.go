package slots

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func newTracker(t *testing.T, mutate func(*Config)) (*Tracker, *clock) {
	t.Helper()
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	cfg := DefaultConfig()
	cfg.Now = c.now
	if mutate != nil {
		mutate(&cfg)
	}
	tr, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr, c
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantErr(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: error %v, want %v", what, err, want)
	}
}

// TestWorkedExample is the example of Dynamo's page: a request of three
// blocks and 48 tokens on rank 0; projecting four blocks (three shared) and
// 48 tokens gives 96 prefill tokens and 4 blocks.
func TestWorkedExample(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 7, Model: "llama-3-8b", BlockSize: 16, DPStart: 0, DPSize: 2}))
	must(t, tr.Add(Request{Model: "llama-3-8b", ID: "req-123", WorkerID: 7, DPRank: 0,
		Hashes: []uint64{101, HashFromSigned(-22), 303}, NewISLTokens: 48}))
	loads := tr.Loads("", "")
	want := "[{llama-3-8b default 7 0 48 3 0 false} {llama-3-8b default 7 1 0 0 0 false}]"
	if got := fmt.Sprint(loads); got != want {
		t.Errorf("loads %s, want %s", got, want)
	}
	pot, err := tr.PotentialLoads("llama-3-8b", "", []uint64{101, HashFromSigned(-22), 303, 404}, 48)
	must(t, err)
	if got := fmt.Sprint(pot); got != "[{7 0 96 4} {7 1 48 4}]" {
		t.Errorf("potential loads %s", got)
	}
	if HashFromSigned(-22) != math.MaxUint64-21 {
		t.Errorf("-22 read as %d", HashFromSigned(-22))
	}
	// Prefill complete: the tokens leave, the blocks stay; repeated: no-op.
	must(t, tr.PrefillComplete("llama-3-8b", "default", "req-123"))
	must(t, tr.PrefillComplete("llama-3-8b", "default", "req-123"))
	if got := fmt.Sprint(tr.Loads("llama-3-8b", "")[0]); got != "{llama-3-8b default 7 0 0 3 0 false}" {
		t.Errorf("after prefill complete %s", got)
	}
	// Free: idempotent, an unknown request included.
	must(t, tr.Free("llama-3-8b", "", "req-123"))
	must(t, tr.Free("llama-3-8b", "", "req-123"))
	must(t, tr.Free("llama-3-8b", "", "never-added"))
	if got := fmt.Sprint(tr.Loads("", "default")[0]); got != "{llama-3-8b default 7 0 0 0 0 false}" {
		t.Errorf("after free %s", got)
	}
}

// TestSharedBlocksCountOnce: two requests sharing a prefix count its blocks
// once, and the shared blocks stay until both are freed.
func TestSharedBlocksCountOnce(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Add(Request{Model: "m", ID: "a", WorkerID: 1, Hashes: []uint64{1, 2, 3}, NewISLTokens: 10}))
	must(t, tr.Add(Request{Model: "m", ID: "b", WorkerID: 1, Hashes: []uint64{1, 2, 4, 4}, NewISLTokens: 5}))
	if l := tr.Loads("m", ""); l[0].ActiveDecodeBlocks != 4 || l[0].ActivePrefillTokens != 15 {
		t.Errorf("loads %+v, want 4 blocks and 15 tokens", l)
	}
	must(t, tr.Free("m", "", "a"))
	if l := tr.Loads("m", ""); l[0].ActiveDecodeBlocks != 3 || l[0].ActivePrefillTokens != 5 {
		t.Errorf("after freeing a: %+v, want 3 blocks (1, 2, 4) and 5 tokens", l)
	}
	pot, err := tr.PotentialLoads("m", "", []uint64{1, 3, 4, 9}, 0)
	must(t, err)
	if pot[0].PotentialDecodeBlocks != 5 { // 1, 2, 4 held; 3 and 9 new
		t.Errorf("potential after freeing a: %+v, want 5 blocks", pot)
	}
	must(t, tr.Free("m", "", "b"))
	if l := tr.Loads("m", ""); l[0].ActiveDecodeBlocks != 0 || l[0].ActivePrefillTokens != 0 {
		t.Errorf("after freeing both: %+v", l)
	}
	if pot, _ := tr.PotentialLoads("m", "", []uint64{1, 2}, 0); pot[0].PotentialDecodeBlocks != 2 {
		t.Errorf("potential after freeing both: %+v, want 2 blocks", pot)
	}
	if s := tr.Stats(); s.Requests != 0 || s.Workers != 1 || s.Trackers != 1 {
		t.Errorf("stats %+v", s)
	}
}

func TestErrors(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 7, Model: "m", BlockSize: 16, DPStart: 2, DPSize: 2}))
	for _, tc := range []struct {
		name string
		err  error
		want error
	}{
		{"zero block size", tr.Register(Worker{WorkerID: 8, Model: "m", DPSize: 1}), ErrInvalid},
		{"zero dp size", tr.Register(Worker{WorkerID: 8, Model: "m", BlockSize: 16}), ErrInvalid},
		{"dp overflow", tr.Register(Worker{WorkerID: 8, Model: "m", BlockSize: 16, DPStart: math.MaxUint32, DPSize: 2}), ErrInvalid},
		{"dp too large", tr.Register(Worker{WorkerID: 8, Model: "m", BlockSize: 16, DPSize: MaxRanks + 1}), ErrInvalid},
		{"no model", tr.Register(Worker{WorkerID: 8, BlockSize: 16, DPSize: 1}), ErrInvalid},
		{"long model", tr.Register(Worker{WorkerID: 8, Model: strings.Repeat("m", MaxNameLen+1), BlockSize: 16, DPSize: 1}), ErrInvalid},
		{"long tenant", tr.Register(Worker{WorkerID: 8, Model: "m", Tenant: strings.Repeat("t", MaxNameLen+1), BlockSize: 16, DPSize: 1}), ErrInvalid},
		{"long request id", tr.Add(Request{Model: "m", ID: strings.Repeat("r", MaxNameLen+1), WorkerID: 7, DPRank: 2}), ErrInvalid},
		{"other block size", tr.Register(Worker{WorkerID: 8, Model: "m", BlockSize: 32, DPSize: 1}), ErrConflict},
		{"unregister unknown tracker", tr.Unregister("x", "", 7), ErrNotFound},
		{"unregister unknown worker", tr.Unregister("m", "", 9), ErrNotFound},
		{"unregister other tenant", tr.Unregister("m", "t2", 7), ErrNotFound},
		{"add unknown tracker", tr.Add(Request{Model: "x", ID: "r", WorkerID: 7, DPRank: 2}), ErrNotFound},
		{"add unknown worker", tr.Add(Request{Model: "m", ID: "r", WorkerID: 9, DPRank: 2}), ErrNotFound},
		{"add rank outside range", tr.Add(Request{Model: "m", ID: "r", WorkerID: 7, DPRank: 1}), ErrNotFound},
		{"add without id", tr.Add(Request{Model: "m", WorkerID: 7, DPRank: 2}), ErrInvalid},
		{"prefill unknown tracker", tr.PrefillComplete("x", "", "r"), ErrNotFound},
		{"prefill unknown request", tr.PrefillComplete("m", "", "r"), ErrNotFound},
		{"free unknown tracker", tr.Free("x", "", "r"), ErrNotFound},
	} {
		wantErr(t, tc.name, tc.err, tc.want)
	}
	must(t, tr.Add(Request{Model: "m", ID: "r", WorkerID: 7, DPRank: 3}))
	wantErr(t, "duplicate request id", tr.Add(Request{Model: "m", ID: "r", WorkerID: 7, DPRank: 2}), ErrConflict)
	if _, err := tr.PotentialLoads("x", "", nil, 0); !errors.Is(err, ErrNotFound) {
		t.Errorf("potential loads of an unknown tracker: %v", err)
	}
	// Unregister drops the worker's requests at once, and the empty tracker.
	must(t, tr.Unregister("m", "default", 7))
	if s := tr.Stats(); s != (Stats{}) {
		t.Errorf("after unregister: %+v", s)
	}
	wantErr(t, "free after the tracker is gone", tr.Free("m", "", "r"), ErrNotFound)
}

// TestSortedAndFiltered: /workers and /loads are sorted by (model, tenant,
// worker, rank) and filter independently by model and tenant.
func TestSortedAndFiltered(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	for _, w := range []Worker{
		{WorkerID: 9, Model: "b", BlockSize: 16, DPSize: 1},
		{WorkerID: 3, Model: "a", Tenant: "z", BlockSize: 16, DPSize: 1},
		{WorkerID: 2, Model: "a", BlockSize: 16, DPStart: 1, DPSize: 2},
		{WorkerID: 1, Model: "a", BlockSize: 16, DPSize: 1},
	} {
		must(t, tr.Register(w))
	}
	var ids []string
	for _, w := range tr.Workers("", "") {
		ids = append(ids, fmt.Sprintf("%s/%s/%d", w.Model, w.Tenant, w.WorkerID))
	}
	if got := fmt.Sprint(ids); got != "[a/default/1 a/default/2 a/z/3 b/default/9]" {
		t.Errorf("workers %s", got)
	}
	var ranks []string
	for _, l := range tr.Loads("a", "default") {
		ranks = append(ranks, fmt.Sprintf("%d.%d", l.WorkerID, l.DPRank))
	}
	if got := fmt.Sprint(ranks); got != "[1.0 2.1 2.2]" {
		t.Errorf("loads of a/default %s", got)
	}
	if n := len(tr.Workers("", "z")); n != 1 {
		t.Errorf("workers of tenant z: %d", n)
	}
	if n := len(tr.Loads("b", "z")); n != 0 {
		t.Errorf("loads of b/z: %d", n)
	}
}

// TestReRegister replaces a worker's range: requests on ranks that are
// gone are dropped, the others kept.
func TestReRegister(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 2}))
	must(t, tr.Add(Request{Model: "m", ID: "r0", WorkerID: 1, DPRank: 0, Hashes: []uint64{1}}))
	must(t, tr.Add(Request{Model: "m", ID: "r1", WorkerID: 1, DPRank: 1, Hashes: []uint64{2}}))
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPStart: 1, DPSize: 2}))
	if got := fmt.Sprint(tr.Loads("m", "")); got != "[{m default 1 1 0 1 0 false} {m default 1 2 0 0 0 false}]" {
		t.Errorf("loads %s", got)
	}
	if s := tr.Stats(); s.Workers != 1 || s.Requests != 1 {
		t.Errorf("stats %+v", s)
	}
	wantErr(t, "prefill of a dropped request", tr.PrefillComplete("m", "", "r0"), ErrNotFound)
	// The projection sees block 2 on rank 1 only; block 1 left with rank 0.
	pot, err := tr.PotentialLoads("m", "", []uint64{1, 2}, 5)
	must(t, err)
	if got := fmt.Sprint(pot); got != "[{1 1 5 2} {1 2 5 2}]" {
		t.Errorf("potential loads %s", got)
	}
}

// TestReRegisterBlockSize: a model's only worker registered again with
// another block size (its engine restarted so) takes it, and its requests,
// whose block hashes were in the old size's units, are dropped; with
// another worker of the model the size stays a conflict.
func TestReRegisterBlockSize(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Add(Request{Model: "m", ID: "r", WorkerID: 1, Hashes: []uint64{1, 2}}))
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 32, DPSize: 1}))
	if bs := tr.BlockSize("m", ""); bs != 32 {
		t.Errorf("block size %d, want 32", bs)
	}
	if s := tr.Stats(); s.Requests != 0 || s.Blocks != 0 {
		t.Errorf("stats %+v: want the requests of the old block size dropped", s)
	}
	must(t, tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 32, DPSize: 1}))
	wantErr(t, "a block size of its own with another worker", tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 1}), ErrConflict)
}

// TestExpiry: a request older than the TTL is dropped.
func TestExpiry(t *testing.T) {
	t.Parallel()
	tr, c := newTracker(t, func(cfg *Config) { cfg.RequestTTL = time.Minute })
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Add(Request{Model: "m", ID: "old", WorkerID: 1, Hashes: []uint64{1}, NewISLTokens: 7}))
	c.t = c.t.Add(30 * time.Second)
	must(t, tr.Add(Request{Model: "m", ID: "new", WorkerID: 1, Hashes: []uint64{1, 2}, NewISLTokens: 3}))
	c.t = c.t.Add(30 * time.Second) // old is a minute old
	if l := tr.Loads("m", "")[0]; l.ActiveDecodeBlocks != 2 || l.ActivePrefillTokens != 3 {
		t.Errorf("after the old one expired: %+v, want 2 blocks and 3 tokens", l)
	}
	wantErr(t, "prefill of an expired request", tr.PrefillComplete("m", "", "old"), ErrNotFound)
	c.t = c.t.Add(time.Minute)
	if s := tr.Stats(); s.Requests != 0 || s.Blocks != 0 || s.Expired != 2 {
		t.Errorf("stats %+v, want no request, no block, 2 expired", s)
	}
	// The id may be used again; a request freed in time never counts as
	// expired.
	must(t, tr.Add(Request{Model: "m", ID: "old", WorkerID: 1}))
	must(t, tr.Free("m", "", "old"))
	c.t = c.t.Add(2 * time.Minute)
	if s := tr.Stats(); s.Expired != 2 {
		t.Errorf("%d expired, want still 2", s.Expired)
	}
}

// TestCaps: beyond the caps, writes fail with ErrLimit (ErrTooLarge for
// the hashes of one request), nothing changes, and each refusal is counted
// under its reason.
func TestCaps(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, func(cfg *Config) {
		cfg.MaxTrackers, cfg.MaxWorkers, cfg.MaxTotalRanks, cfg.MaxRequests, cfg.MaxHashesPerRequest, cfg.MaxBlocks = 1, 2, 5, 3, 3, 5
	})
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 2}))
	must(t, tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 16, DPSize: 1}))
	wantErr(t, "a third worker", tr.Register(Worker{WorkerID: 3, Model: "m", BlockSize: 16, DPSize: 1}), ErrLimit)
	wantErr(t, "a second tracker", tr.Register(Worker{WorkerID: 1, Model: "n", BlockSize: 16, DPSize: 1}), ErrLimit)
	must(t, tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 16, DPSize: 2})) // a replacement is no new worker
	// Ranks: a replacement trades its old range for the new one.
	wantErr(t, "2 + 4 ranks", tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 16, DPSize: 4}), ErrLimit)
	must(t, tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 16, DPStart: 1, DPSize: 3}))
	must(t, tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 16, DPSize: 2}))
	if ws := tr.Workers("m", ""); len(ws) != 2 || ws[1].DPSize != 2 {
		t.Errorf("workers %+v, want worker 2 with 2 ranks", ws)
	}

	// Hashes per request: repeats count, as they are in the body.
	must(t, tr.Add(Request{Model: "m", ID: "a", WorkerID: 1, Hashes: []uint64{1, 2, 3}}))
	wantErr(t, "four hashes", tr.Add(Request{Model: "m", ID: "b", WorkerID: 1, Hashes: []uint64{4, 4, 4, 4}}), ErrTooLarge)
	_, err := tr.AddLeastLoaded(Request{Model: "m", ID: "b", WorkerID: 1, Hashes: []uint64{4, 5, 6, 7}})
	wantErr(t, "four hashes on the least loaded rank", err, ErrTooLarge)
	_, err = tr.PotentialLoads("m", "", []uint64{4, 5, 6, 7}, 0)
	wantErr(t, "a projection of four hashes", err, ErrTooLarge)
	if _, ok := tr.WorkerPotential("m", "", 1, []uint64{4, 5, 6, 7}, 0); ok {
		t.Error("WorkerPotential projected a request of four hashes")
	}

	// Blocks: the distinct hashes each request holds, summed; a block
	// shared by two requests counts twice.
	wantErr(t, "3 + 3 blocks", tr.Add(Request{Model: "m", ID: "b", WorkerID: 1, Hashes: []uint64{1, 2, 3}}), ErrLimit)
	must(t, tr.Add(Request{Model: "m", ID: "b", WorkerID: 1, DPRank: 1, Hashes: []uint64{1, 1, 2}})) // 2 distinct: 5
	if s := tr.Stats(); s.Blocks != 5 {
		t.Errorf("%d blocks held, want 5", s.Blocks)
	}
	wantErr(t, "a sixth block", tr.Add(Request{Model: "m", ID: "c", WorkerID: 2, Hashes: []uint64{9}}), ErrLimit)
	must(t, tr.Add(Request{Model: "m", ID: "c", WorkerID: 2})) // no block
	wantErr(t, "a fourth request", tr.Add(Request{Model: "m", ID: "d", WorkerID: 2}), ErrLimit)

	want := Stats{Trackers: 1, Workers: 2, Ranks: 4, Requests: 3, Blocks: 5}
	want.Rejected[RejectedTrackers] = 1
	want.Rejected[RejectedWorkers] = 1
	want.Rejected[RejectedRanks] = 1
	want.Rejected[RejectedRequests] = 1
	want.Rejected[RejectedHashes] = 3 // the add, the add on the least loaded rank, the projection
	want.Rejected[RejectedBlocks] = 2
	if s := tr.Stats(); s != want {
		t.Errorf("stats %+v\nwant  %+v", s, want)
	}
	// Freeing gives the blocks back; dropping a worker gives back those of
	// its requests.
	must(t, tr.Free("m", "", "a"))
	must(t, tr.Add(Request{Model: "m", ID: "d", WorkerID: 2, Hashes: []uint64{7, 8, 9}}))
	must(t, tr.Unregister("m", "", 1))
	if s := tr.Stats(); s.Blocks != 3 || s.Requests != 2 || s.Ranks != 2 {
		t.Errorf("after a free and an unregister: %d blocks, %d requests, %d ranks; want 3, 2, 2", s.Blocks, s.Requests, s.Ranks)
	}
	for _, r := range []Reason{RejectedTrackers, RejectedWorkers, RejectedRanks, RejectedRequests, RejectedHashes, RejectedBlocks} {
		if r.String() == "" || r.String() == fmt.Sprintf("Reason(%d)", int(r)) {
			t.Errorf("reason %d has no name", int(r))
		}
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string // in the error; "" for none
	}{
		{"defaults", func(*Config) {}, ""},
		{"zero", func(c *Config) { *c = Config{} }, "request TTL"},
		{"negative ttl", func(c *Config) { c.RequestTTL = -time.Second }, "request TTL"},
		{"no trackers", func(c *Config) { c.MaxTrackers = 0 }, "trackers (0)"},
		{"no workers", func(c *Config) { c.MaxWorkers = -1 }, "workers (-1)"},
		{"no ranks", func(c *Config) { c.MaxTotalRanks = 0 }, "ranks (0)"},
		{"no requests", func(c *Config) { c.MaxRequests = 0 }, "requests (0)"},
		{"no hashes", func(c *Config) { c.MaxHashesPerRequest = 0 }, "hashes per request (0)"},
		{"no blocks", func(c *Config) { c.MaxBlocks = 0 }, "blocks (0)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := DefaultConfig()
			tc.mutate(&cfg)
			err := cfg.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Validate: %v, want an error with %q", err, tc.want)
			}
			if _, nerr := New(cfg); (nerr == nil) != (err == nil) {
				t.Errorf("New: %v, Validate: %v", nerr, err)
			}
		})
	}
}

// TestAddLeastLoaded: without a rank, a request goes to the worker's rank
// with the fewest prefill tokens after it, then the fewest blocks, then the
// lowest rank; other workers' ranks are never chosen.
func TestAddLeastLoaded(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPStart: 2, DPSize: 3}))
	must(t, tr.Register(Worker{WorkerID: 2, Model: "m", BlockSize: 16, DPSize: 1}))
	if bs := tr.BlockSize("m", ""); bs != 16 {
		t.Fatalf("block size %d", bs)
	}
	if bs := tr.BlockSize("other", ""); bs != 0 {
		t.Fatalf("block size of an unknown model %d", bs)
	}
	add := func(id string, hashes []uint64, isl uint64) uint32 {
		t.Helper()
		r, err := tr.AddLeastLoaded(Request{Model: "m", ID: id, WorkerID: 1, DPRank: 99, Hashes: hashes, NewISLTokens: isl})
		must(t, err)
		return r
	}
	if r := add("a", []uint64{1, 2}, 100); r != 2 {
		t.Fatalf("first request on rank %d, want 2 (all empty: the lowest)", r)
	}
	if r := add("b", []uint64{1, 2}, 50); r != 3 {
		t.Fatalf("second on rank %d, want 3 (rank 2 has 100 prefill tokens)", r)
	}
	if r := add("c", nil, 10); r != 4 {
		t.Fatalf("third on rank %d, want 4", r)
	}
	must(t, tr.PrefillComplete("m", "", "a"))
	must(t, tr.PrefillComplete("m", "", "b"))
	must(t, tr.PrefillComplete("m", "", "c"))
	// All at 0 prefill tokens: rank 4 holds no block, ranks 2 and 3 hold
	// 1 and 2. A request with hashes 1, 2 adds none to 2 or 3: rank 2.
	if r := add("d", []uint64{1, 2}, 5); r != 2 {
		t.Fatalf("fourth on rank %d, want 2 (shares both blocks)", r)
	}
	if p, ok := tr.WorkerPotential("m", "", 1, []uint64{7, 8, 9}, 10); !ok || p.DPRank != 4 ||
		p.PotentialPrefillTokens != 10 || p.PotentialDecodeBlocks != 3 {
		t.Fatalf("WorkerPotential = %+v, %v; want rank 4 with 10 tokens and 3 blocks", p, ok)
	}
	if _, ok := tr.WorkerPotential("m", "", 9, nil, 0); ok {
		t.Fatal("WorkerPotential of an unknown worker")
	}
	// Prefill tokens 5, 0, 0: ranks 3 and 4 tie; rank 3 would hold 2+3
	// blocks, rank 4 only 3.
	if r := add("e", []uint64{7, 8, 9}, 0); r != 4 {
		t.Fatalf("fifth on rank %d, want 4", r)
	}
	if l := tr.Loads("m", ""); l[len(l)-1].WorkerID != 2 || l[len(l)-1].ActivePrefillTokens != 0 || l[len(l)-1].ActiveDecodeBlocks != 0 {
		t.Fatalf("worker 2 was given a request: %+v", l)
	}
	_, err := tr.AddLeastLoaded(Request{Model: "m", ID: "x", WorkerID: 9})
	wantErr(t, "unknown worker", err, ErrNotFound)
	_, err = tr.AddLeastLoaded(Request{Model: "m", ID: "a", WorkerID: 1})
	wantErr(t, "duplicate id", err, ErrConflict)
	_, err = tr.AddLeastLoaded(Request{Model: "m", WorkerID: 1})
	wantErr(t, "no id", err, ErrInvalid)
}

// TestHoldersFollowBlocks: after random adds and frees of requests sharing
// hashes on four ranks, every hash's holders are exactly the ranks whose
// blocks hold it (the first holder leaving hands its place to another), and
// nothing is left once every request is freed.
func TestHoldersFollowBlocks(t *testing.T) {
	t.Parallel()
	tr, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 4, DPSize: 4}))
	check := func(step int) {
		t.Helper()
		in := tr.trackers[key{"m", DefaultTenant}]
		want := map[uint64]map[rankKey]bool{}
		for rk, rs := range in.ranks {
			for h := range rs.blocks {
				if want[h] == nil {
					want[h] = map[rankKey]bool{}
				}
				want[h][rk] = true
			}
		}
		if len(in.holders) != len(want) {
			t.Fatalf("step %d: %d hashes have holders, %d are held", step, len(in.holders), len(want))
		}
		for h, hs := range in.holders {
			got := map[rankKey]bool{hs.first: true}
			for rk := range hs.more {
				if got[rk] {
					t.Fatalf("step %d: hash %d: rank %v twice", step, h, rk)
				}
				got[rk] = true
			}
			if fmt.Sprint(got) != fmt.Sprint(want[h]) {
				t.Fatalf("step %d: hash %d held by %v, holders %v", step, h, want[h], got)
			}
		}
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var active []string
	for step := range 2000 {
		if len(active) > 0 && rng.IntN(2) == 0 {
			i := rng.IntN(len(active))
			must(t, tr.Free("m", "", active[i]))
			active = slices.Delete(active, i, i+1)
		} else {
			id := fmt.Sprint("r", step)
			hashes := make([]uint64, 1+rng.IntN(6))
			for j := range hashes {
				hashes[j] = uint64(rng.IntN(12))
			}
			must(t, tr.Add(Request{Model: "m", ID: id, WorkerID: 1, DPRank: uint32(rng.IntN(4)), Hashes: hashes}))
			active = append(active, id)
		}
		check(step)
	}
	for _, id := range active {
		must(t, tr.Free("m", "", id))
	}
	check(-1)
}

// TestCommittedBlocks: a rank sums the committed blocks of its active
// requests that carry them (contract §21), and says whether any does;
// prefill complete leaves them, a free, an expiry and a dropped rank take
// them away.
func TestCommittedBlocks(t *testing.T) {
	t.Parallel()
	tr, c := newTracker(t, func(cfg *Config) { cfg.RequestTTL = time.Minute })
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 2}))
	rank := func(r uint32) Load {
		t.Helper()
		for _, l := range tr.Loads("m", "") {
			if l.DPRank == r {
				return l
			}
		}
		t.Fatalf("rank %d missing", r)
		return Load{}
	}
	check := func(what string, r uint32, blocks uint64, committed bool) {
		t.Helper()
		if l := rank(r); l.KVCommittedBlocks != blocks || l.Committed != committed {
			t.Errorf("%s: rank %d committed %d (%v), want %d (%v)", what, r, l.KVCommittedBlocks, l.Committed, blocks, committed)
		}
	}
	must(t, tr.Add(Request{Model: "m", ID: "old", WorkerID: 1, NewISLTokens: 9, CommittedBlocks: 4, HasCommitted: true}))
	c.t = c.t.Add(30 * time.Second)
	must(t, tr.Add(Request{Model: "m", ID: "a", WorkerID: 1, NewISLTokens: 9, CommittedBlocks: 5, HasCommitted: true}))
	must(t, tr.Add(Request{Model: "m", ID: "dynamo", WorkerID: 1, NewISLTokens: 9})) // carries none
	must(t, tr.Add(Request{Model: "m", ID: "b", WorkerID: 1, DPRank: 1, HasCommitted: true}))
	check("three requests, two with committed blocks", 0, 9, true)
	check("a request of 0 committed blocks still carries them", 1, 0, true)
	must(t, tr.PrefillComplete("m", "", "a"))
	check("prefill complete", 0, 9, true)
	c.t = c.t.Add(31 * time.Second)
	check("the old one expired", 0, 5, true)
	must(t, tr.Free("m", "", "a"))
	check("freed", 0, 0, false)
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: 2}))
	check("rank 1 dropped and back", 1, 0, false)
}
