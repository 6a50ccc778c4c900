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
			[]Pair{{"m", 1, 3, PolicyDecodeLoad}}},
		{"highest with lowest", []Worker{w(1, 0.9, false), w(2, 0.8, false), w(3, 0.1, true), w(4, 0.2, true)},
			[]Pair{{"m", 1, 3, PolicyDecodeLoad}, {"m", 2, 4, PolicyDecodeLoad}}},
		{"destination must be free", []Worker{w(1, 0.9, false), w(2, 0.1, false), w(3, 0.5, true)}, nil},
		{"stale workers take no part", []Worker{w(1, 0.9, false), w(2, 0.5, false), stale},
			nil},
		{"a single worker is never paired with itself", []Worker{w(1, 0.9, true)}, nil},
		{"unknown usage stays out of decode_load", []Worker{w(1, 0.9, false), unknown}, nil},
		{"failover moves work off a cordoned worker to the least used free one",
			[]Worker{cordoned, w(1, 0.4, true), w(2, 0.3, true)},
			[]Pair{{"m", 5, 2, PolicyFailover}}},
		{"one pair per worker per round: failover takes the next free one",
			[]Worker{cordoned, w(1, 0.95, false), w(2, 0.1, true), w(3, 0.55, true)},
			[]Pair{{"m", 1, 2, PolicyDecodeLoad}, {"m", 5, 3, PolicyFailover}}},
		{"failover without a free worker", []Worker{cordoned, w(1, 0.9, false)}, nil},
	} {
		p, err := New(DefaultConfig())
		if err != nil {
			t.Fatal(err)
		}
		got := p.Plan(Snapshot{Now: now, Models: []Model{{Name: "m", Workers: c.workers}}})
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: pairs %v, want %v", c.name, got, c.want)
		}
	}
}

// crossed ranks workers 1, 2 and 3 both as sources and as destinations, in
// orders that invite A → B beside B → A and a worker paired with itself.
type crossed struct{}

func (crossed) Name() string { return "test" }
func (crossed) Candidates(m Model, _ float64) (srcs, dsts []Worker) {
	byID := func(ids ...uint64) []Worker {
		var ws []Worker
		for _, id := range ids {
			for _, w := range m.Workers {
				if w.ID == id {
					ws = append(ws, w)
				}
			}
		}
		return ws
	}
	return byID(1, 2, 3), byID(2, 1, 3)
}

func TestPlanValidates(t *testing.T) {
	t.Parallel()
	p, err := New(Config{Policies: []Policy{crossed{}}})
	if err != nil {
		t.Fatal(err)
	}
	got := p.Plan(Snapshot{Now: time.Unix(0, 0), Models: []Model{{Name: "m",
		Workers: []Worker{w(1, 0.5, true), w(2, 0.5, true), w(3, 0.5, true), w(4, 0.5, true)}}}})
	if want := []Pair{{"m", 1, 2, "test"}}; !slices.Equal(got, want) {
		t.Errorf("pairs %v, want %v (no B → A beside A → B, no self pair)", got, want)
	}
}

func TestPlanRepairsAroundARestingDestination(t *testing.T) {
	t.Parallel()
	p, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1_800_000_000, 0)
	// Round 1: 1 → 3 (the least loaded), both rest for the cooldown.
	first := []Worker{w(1, 0.9, false), w(2, 0.5, true), w(3, 0.05, true), w(4, 0.5, true)}
	if got, want := p.Plan(Snapshot{Now: t0, Models: []Model{{Name: "m", Workers: first}}}), []Pair{{"m", 1, 3, PolicyDecodeLoad}}; !slices.Equal(got, want) {
		t.Fatalf("first round: %v, want %v", got, want)
	}
	// Round 2: 5 is hot; the least loaded destination (3) rests, so the
	// selection moves on to the next one below the mean (6) instead of
	// dropping the source.
	second := []Worker{w(1, 0.5, false), w(2, 0.5, true), w(3, 0.05, true), w(4, 0.5, true), w(5, 0.95, false), w(6, 0.1, true)}
	got := p.Plan(Snapshot{Now: t0.Add(time.Second), Models: []Model{{Name: "m", Workers: second}}})
	if want := []Pair{{"m", 5, 6, PolicyDecodeLoad}}; !slices.Equal(got, want) {
		t.Errorf("second round: %v, want %v", got, want)
	}
}

func TestPlanCooldown(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
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
	for _, c := range []Config{{BalanceGap: -0.1}, {BalanceGap: 1}, {Cooldown: -time.Second}} {
		if _, err := New(c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}
