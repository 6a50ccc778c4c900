package resched

import (
	"slices"
	"testing"
	"time"
)

func w(id uint64, usage float64, free bool) Worker {
	return Worker{ID: id, Usage: usage, HasUsage: true, Fresh: true, Free: free}
}

func TestPlan(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_800_000_000, 0)
	stale := w(9, 0.0, true)
	stale.Fresh = false
	cordoned := w(5, 0.5, false)
	cordoned.Cordoned = true
	unknown := Worker{ID: 7, Fresh: true, Free: true}
	for _, c := range []struct {
		name    string
		workers []Worker
		want    []Pair
	}{
		{"balanced: nothing to do", []Worker{w(1, 0.5, true), w(2, 0.55, true), w(3, 0.45, true)}, nil},
		{"one hot, one cold", []Worker{w(1, 0.9, false), w(2, 0.5, true), w(3, 0.1, true)},
			[]Pair{{"m", 1, 3, PolicyDecodeLoad, 1}}},
		{"highest with lowest", []Worker{w(1, 0.9, false), w(2, 0.8, false), w(3, 0.1, true), w(4, 0.2, true)},
			[]Pair{{"m", 1, 3, PolicyDecodeLoad, 1}, {"m", 2, 4, PolicyDecodeLoad, 1}}},
		{"destination must be free", []Worker{w(1, 0.9, false), w(2, 0.1, false), w(3, 0.5, true)}, nil},
		{"stale workers take no part", []Worker{w(1, 0.9, false), w(2, 0.5, false), stale},
			nil},
		{"a single worker is never paired with itself", []Worker{w(1, 0.9, true)}, nil},
		{"unknown usage stays out of decode_load", []Worker{w(1, 0.9, false), unknown}, nil},
		{"failover moves work off a cordoned worker to the least used free one",
			[]Worker{cordoned, w(1, 0.4, true), w(2, 0.3, true)},
			[]Pair{{"m", 5, 2, PolicyFailover, RecommendedMaxRequests}}},
		{"one pair per worker per round: failover takes the next free one",
			[]Worker{cordoned, w(1, 0.95, false), w(2, 0.1, true), w(3, 0.55, true)},
			[]Pair{{"m", 1, 2, PolicyDecodeLoad, 1}, {"m", 5, 3, PolicyFailover, RecommendedMaxRequests}}},
		{"failover without a free worker", []Worker{cordoned, w(1, 0.9, false)}, nil},
	} {
		p, err := New(RecommendedConfig())
		if err != nil {
			t.Fatal(err)
		}
		got := p.Plan(Snapshot{Now: now, Models: []Model{{Name: "m", Workers: c.workers}}})
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: pairs %v, want %v", c.name, got, c.want)
		}
	}
}

// crossed ranks workers 1, 2 and 3 both as sources and as destinations,
// in orders that invite A → B beside B → A and a worker paired with
// itself; 4 is a destination with room for all three.
type crossed struct{}

func (crossed) Name() string { return "test" }
func (crossed) Candidates(m Model, _ float64) (srcs, dsts []Candidate) {
	byID := func(blocks float64, ids ...uint64) []Candidate {
		var cs []Candidate
		for _, id := range ids {
			for _, w := range m.Workers {
				if w.ID == id {
					cs = append(cs, Candidate{Worker: w, Blocks: blocks})
				}
			}
		}
		return cs
	}
	dsts = append(byID(1, 2, 1, 3), byID(3, 4)...)
	return byID(1, 1, 2, 3), dsts
}

func TestPlanValidates(t *testing.T) {
	t.Parallel()
	cfg := RecommendedConfig()
	cfg.Policies = []Policy{crossed{}}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	got := p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{w(1, 0.5, true), w(2, 0.5, true), w(3, 0.5, true), w(4, 0.5, true)}}}})
	want := []Pair{{"m", 1, 4, "test", 1}, {"m", 2, 4, "test", 1}, {"m", 3, 4, "test", 1}}
	if !slices.Equal(got, want) {
		t.Errorf("pairs %v, want %v (a source is never a destination: no B → A beside A → B, no self pair)", got, want)
	}
}

func TestPlanRepairsAroundARestingDestination(t *testing.T) {
	t.Parallel()
	p, err := New(RecommendedConfig())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1_800_000_000, 0)
	// Round 1: 1 → 3 (the least loaded), both rest for the cooldown.
	first := []Worker{w(1, 0.9, false), w(2, 0.5, true), w(3, 0.05, true), w(4, 0.5, true)}
	if got, want := p.Plan(Snapshot{Now: t0, Models: []Model{{Name: "m", Workers: first}}}), []Pair{{"m", 1, 3, PolicyDecodeLoad, 1}}; !slices.Equal(got, want) {
		t.Fatalf("first round: %v, want %v", got, want)
	}
	// Round 2: 5 is hot; the least loaded destination (3) rests, so the
	// selection moves on to the next one below the mean (6) instead of
	// dropping the source.
	second := []Worker{w(1, 0.5, false), w(2, 0.5, true), w(3, 0.05, true), w(4, 0.5, true), w(5, 0.95, false), w(6, 0.1, true)}
	got := p.Plan(Snapshot{Now: t0.Add(RecommendedCooldown / 2), Models: []Model{{Name: "m", Workers: second}}})
	if want := []Pair{{"m", 5, 6, PolicyDecodeLoad, 1}}; !slices.Equal(got, want) {
		t.Errorf("second round: %v, want %v", got, want)
	}
}

func TestPlanCooldown(t *testing.T) {
	t.Parallel()
	cfg := RecommendedConfig()
	cfg.Cooldown = 10 * time.Second
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1_800_000_000, 0)
	model := []Model{{Name: "m", Workers: []Worker{w(1, 0.9, false), w(2, 0.1, true), w(3, 0.5, true)}}}
	if got := p.Plan(Snapshot{Now: t0, Models: model}); len(got) != 1 {
		t.Fatalf("first round: %v", got)
	}
	if got := p.Plan(Snapshot{Now: t0.Add(cfg.Cooldown - time.Nanosecond), Models: model}); len(got) != 0 {
		t.Errorf("during the cooldown: %v", got)
	}
	if got := p.Plan(Snapshot{Now: t0.Add(cfg.Cooldown), Models: model}); len(got) != 1 {
		t.Errorf("after the cooldown: %v", got)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, c := range []Config{{BalanceGap: -0.1, MaxRequests: 1}, {BalanceGap: 1, MaxRequests: 1},
		{Cooldown: -time.Second, MaxRequests: 1}, {}} {
		if _, err := New(c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

func TestPlanPairsEveryLoadedSource(t *testing.T) {
	t.Parallel()
	// Llumnix's scale-out case: two full workers, a third joins empty.
	// Both sources move work to it in the same round; its room (up to
	// the mean) is shared between them.
	p, err := New(RecommendedConfig())
	if err != nil {
		t.Fatal(err)
	}
	got := p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{w(1, 0.9, false), w(2, 0.9, false), w(3, 0, true)}}}})
	want := []Pair{{"m", 1, 3, PolicyDecodeLoad, 1}, {"m", 2, 3, PolicyDecodeLoad, 1}}
	if !slices.Equal(got, want) {
		t.Errorf("pairs %v, want %v", got, want)
	}
}

func TestPlanDestinationStopsAtTheLightMark(t *testing.T) {
	t.Parallel()
	// A destination takes from one source after another while it stays
	// below the mean − gap (it keeps room of more than gap × its size).
	p, err := New(RecommendedConfig())
	if err != nil {
		t.Fatal(err)
	}
	got := p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{w(1, 0.9, false), w(2, 0.8, false), w(3, 0.5, true), w(4, 0.3, true), w(5, 0.0, true)}}}})
	// Mean 0.5: sources 1 (0.4 to give) and 2 (0.3); destinations 5 (0.5
	// to take) and 4 (0.2). 1 → 5 leaves 5 room of 0.1 > its keep of
	// 0.05, so 5 takes 2 as well.
	want := []Pair{{"m", 1, 5, PolicyDecodeLoad, 1}, {"m", 2, 5, PolicyDecodeLoad, 1}}
	if !slices.Equal(got, want) {
		t.Errorf("pairs %v, want %v", got, want)
	}
	p, _ = New(RecommendedConfig())
	got = p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{w(1, 0.9, false), w(2, 0.8, false), w(3, 0.5, true), w(4, 0.15, true), w(6, 0.5, true)}}}})
	// Mean (0.9+0.8+0.5+0.15+0.5)/5 = 0.57: 4 may take 0.42, 1 gives 0.33
	// (4 keeps 0.09 > 0.05: still light), 2 gives 0.23 more.
	want = []Pair{{"m", 1, 4, PolicyDecodeLoad, 1}, {"m", 2, 4, PolicyDecodeLoad, 1}}
	if !slices.Equal(got, want) {
		t.Errorf("pairs %v, want %v", got, want)
	}
	p, _ = New(RecommendedConfig())
	got = p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{w(1, 1, false), w(2, 0.8, false), w(4, 0.42, true), w(6, 0.68, true)}}}})
	// Mean 0.725: 4 may take 0.305; 1 gives 0.275 and leaves it 0.03,
	// below its keep of 0.05 (4 would then be above mean − gap): 2 (above
	// 0.775) finds no destination, 6 (0.68) is not light.
	want = []Pair{{"m", 1, 4, PolicyDecodeLoad, 1}}
	if !slices.Equal(got, want) {
		t.Errorf("pairs %v, want %v", got, want)
	}
}

func TestPlanSizesPairs(t *testing.T) {
	t.Parallel()
	sized := func(id uint64, usage float64, free bool, total, requests uint64) Worker {
		x := w(id, usage, free)
		x.TotalBlocks, x.Requests = total, requests
		return x
	}
	for _, c := range []struct {
		name    string
		max     uint64
		workers []Worker
		want    []Pair
	}{
		// Mean 0.5; 1 holds 90 blocks in 9 requests (10 each) and gives
		// 40: 4 requests.
		{"the gap in requests", 8, []Worker{sized(1, 0.9, false, 100, 9), sized(2, 0.1, true, 100, 1), sized(3, 0.5, true, 100, 5)},
			[]Pair{{"m", 1, 2, PolicyDecodeLoad, 4}}},
		{"capped", 2, []Worker{sized(1, 0.9, false, 100, 9), sized(2, 0.1, true, 100, 1), sized(3, 0.5, true, 100, 5)},
			[]Pair{{"m", 1, 2, PolicyDecodeLoad, 2}}},
		// The destination has room for 20 of its 50 blocks (mean 0.5,
		// at 0.1 of 50): 2 requests of 10.
		{"the destination's room, in its own size", 8,
			[]Worker{sized(1, 0.9, false, 100, 9), sized(2, 0.1, true, 50, 1), sized(3, 0.5, true, 100, 5)},
			[]Pair{{"m", 1, 2, PolicyDecodeLoad, 2}}},
		// 1 holds 60 blocks in 2 requests and gives 10, a third of one:
		// moving one would leave it 20 below the mean. No pair.
		{"less than half a request", 8, []Worker{sized(1, 0.6, false, 100, 2), sized(2, 0.4, true, 100, 1), sized(3, 0.5, true, 100, 5)},
			nil},
		// Half a request or more moves one.
		{"half a request", 8, []Worker{sized(1, 0.6, false, 100, 5), sized(2, 0.4, true, 100, 1), sized(3, 0.5, true, 100, 5)},
			[]Pair{{"m", 1, 2, PolicyDecodeLoad, 1}}},
	} {
		cfg := RecommendedConfig()
		cfg.MaxRequests = c.max
		p, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		got := p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m", Workers: c.workers}}})
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: pairs %v, want %v", c.name, got, c.want)
		}
	}
}

func TestPlanBalancesOnCommitted(t *testing.T) {
	t.Parallel()
	committed := func(id uint64, usage, committed float64) Worker {
		x := w(id, usage, true)
		x.Committed, x.HasCommitted = committed, true
		return x
	}
	p, err := New(RecommendedConfig())
	if err != nil {
		t.Fatal(err)
	}
	// Equal KV in use, but 1 has admitted work that will grow to twice
	// the others': it gives to the least committed, 3.
	got := p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{committed(1, 0.4, 1.2), committed(2, 0.4, 0.5), committed(3, 0.4, 0.3)}}}})
	if want := []Pair{{"m", 1, 3, PolicyDecodeLoad, 1}}; !slices.Equal(got, want) {
		t.Errorf("committed: pairs %v, want %v", got, want)
	}
	// One worker without the committed value: every worker is compared on
	// KV in use, which is even.
	got = p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{committed(1, 0.4, 1.2), committed(2, 0.4, 0.5), w(3, 0.4, true)}}}})
	if len(got) != 0 {
		t.Errorf("mixed: pairs %v, want none", got)
	}
}

// TestDefaultsAreTheContracts: the defaults are contract §12's (gap 0.1,
// cooldown 10s, 1 request a pair); the measured values are only
// recommended.
func TestDefaultsAreTheContracts(t *testing.T) {
	t.Parallel()
	if got, want := DefaultConfig(), (Config{BalanceGap: 0.1, Cooldown: 10 * time.Second, MaxRequests: 1}); got.BalanceGap != want.BalanceGap ||
		got.Cooldown != want.Cooldown || got.MaxRequests != want.MaxRequests {
		t.Errorf("defaults %+v, want contract §12's %+v", got, want)
	}
	if err := RecommendedConfig().Validate(); err != nil {
		t.Error(err)
	}
}
