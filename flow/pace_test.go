package flow

import (
	"testing"
	"time"
)

const pace = 20 * time.Millisecond

// TestPacerInterval: pace × max(1, routers) (contract §17); with the share
// of the head's priority known (§22), pace × all / own.
func TestPacerInterval(t *testing.T) {
	t.Parallel()
	p := NewPacer(pace, nil)
	for _, c := range []struct {
		s    Share
		want time.Duration
	}{
		{Share{}, pace},
		{Share{Routers: 1}, pace},
		{Share{Routers: 3}, 3 * pace},
		{Share{Routers: 1 << 40}, pace << 16},
		{Share{Routers: 3, Own: 10, Others: 0, Known: true}, pace},
		{Share{Routers: 3, Own: 10, Others: 30, Known: true}, 4 * pace},
		{Share{Routers: 3, Own: 30, Others: 10, Known: true}, pace * 4 / 3},
		{Share{Routers: 3, Own: 1, Others: 1 << 40, Known: true}, pace << 16},
		// Not known, or nothing held here: §17's.
		{Share{Routers: 3, Own: 10, Others: 30}, 3 * pace},
		{Share{Routers: 2, Own: 0, Others: 30, Known: true}, 2 * pace},
	} {
		if got := p.Interval(c.s); got != c.want {
			t.Errorf("Interval(%+v) = %v, want %v", c.s, got, c.want)
		}
	}
}

// TestPacerTurns: a worker first seen free may be handed a queued request
// at the phase the random source gives, less one pace (at once for a single
// router); then once per interval; a worker not handed anything for an
// interval past its turn is forgotten, its next turn a first one again.
func TestPacerTurns(t *testing.T) {
	t.Parallel()
	var phase int64
	var asked []int64
	p := NewPacer(pace, func(n int64) int64 { asked = append(asked, n); return phase })
	now := time.Unix(100, 0)

	// One router: at once, without drawing a phase.
	if !p.Ready(1, now, pace) || len(asked) != 0 {
		t.Fatalf("single router: not ready at once (phases drawn: %v)", asked)
	}
	p.Handed(1, now, pace)
	if p.Ready(1, now.Add(pace-1), pace) || !p.Ready(1, now.Add(pace), pace) {
		t.Fatal("single router: want the next turn one pace after a hand-off")
	}

	// Three routers: the phase within the interval, less one pace.
	interval := 3 * pace
	phase = int64(2*pace + pace/2) // due 1.5 paces from now
	if p.Ready(2, now, interval) {
		t.Fatal("three routers: ready at once with a late phase")
	}
	if len(asked) != 1 || asked[0] != int64(interval) {
		t.Fatalf("phase drawn in %v, want [0, %v)", asked, interval)
	}
	if p.Ready(2, now.Add(pace), interval) || !p.Ready(2, now.Add(pace*3/2), interval) {
		t.Fatal("three routers: want the first turn at the phase less one pace")
	}
	phase = int64(pace / 2) // less one pace: at once
	if !p.Ready(3, now, interval) {
		t.Fatal("three routers: an early phase is not at once")
	}
	p.Handed(3, now, interval)

	// Forgotten an interval after its turn came due; not before.
	p.Expire(now.Add(2*interval-1), interval)
	if _, ok := p.next[3]; !ok {
		t.Fatal("forgotten before an interval past its turn")
	}
	p.Expire(now.Add(2*interval), interval)
	if _, ok := p.next[3]; ok {
		t.Fatal("not forgotten an interval past its turn")
	}
	n := len(asked)
	p.Ready(3, now.Add(2*interval), interval)
	if len(asked) != n+1 {
		t.Fatal("a forgotten worker's next turn is not a first one")
	}
}

// TestPacerKeepsTheScheduleBetweenTicks: a dispatcher that looks once a
// pace hands a worker one queued request per interval on average, also
// for an interval that is not a whole number of paces (contract §22's
// shares); a worker handed late starts a new schedule.
func TestPacerKeepsTheScheduleBetweenTicks(t *testing.T) {
	t.Parallel()
	for _, interval := range []time.Duration{pace, 3 * pace, pace * 5 / 3, pace * 10 / 3, pace * 7 / 2} {
		p := NewPacer(pace, func(int64) int64 { return 0 })
		now := time.Unix(100, 0)
		handed := 0
		const ticks = 3000
		for range ticks {
			now = now.Add(pace)
			if p.Ready(1, now, interval) {
				p.Handed(1, now, interval)
				handed++
			}
		}
		want := float64(ticks*pace) / float64(interval)
		if d := float64(handed) - want; d < -2 || d > 2 {
			t.Errorf("interval %v: %d hand-offs in %d paces, want %.0f", interval, handed, ticks, want)
		}
	}
	// Handed a pace or more after its turn: the next is an interval later.
	p := NewPacer(pace, nil)
	now := time.Unix(100, 0)
	p.Handed(1, now, 3*pace)
	late := now.Add(3*pace + pace)
	p.Handed(1, late, 3*pace)
	if p.Ready(1, late.Add(3*pace-1), 3*pace) {
		t.Fatal("a late hand-off kept the old schedule")
	}
}
