package main

import (
	"testing"
	"time"
)

// TestAllBusyStreaks: the periods are counted when they begin, the longest
// includes the one under way, and a period ends at the first observation
// that is not all busy.
func TestAllBusyStreaks(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1_800_000_000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	var s allBusyStreaks
	for _, step := range []struct {
		ms      int
		allBusy bool
		current time.Duration
		cell    string
	}{
		{0, false, 0, "all busy 0× longest 0.0s"},
		{100, true, 0, "all busy 1× longest 0.0s"},
		{2100, true, 2 * time.Second, "all busy 1× longest 2.0s"},
		{2600, false, 0, "all busy 1× longest 2.5s"},
		{3000, true, 0, "all busy 2× longest 2.5s"},
		{3500, true, 500 * time.Millisecond, "all busy 2× longest 2.5s"},
		{6500, true, 3500 * time.Millisecond, "all busy 2× longest 3.5s"},
	} {
		s.observe(at(step.ms), step.allBusy)
		if got := s.current(at(step.ms)); got != step.current {
			t.Errorf("at %d ms: current %v, want %v", step.ms, got, step.current)
		}
		if got := s.cell(at(step.ms)); got != step.cell {
			t.Errorf("at %d ms: cell %q, want %q", step.ms, got, step.cell)
		}
	}
}
