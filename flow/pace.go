package flow

import (
	"math/rand/v2"
	"time"
)

// maxShare caps the factor of the pacing interval over the pace.
const maxShare = 1 << 16

// Share is what the pacing interval of one model's queue is computed from.
type Share struct {
	// Routers is the record's routers (contract §17): the routers that
	// share the model's workers.
	Routers uint64
	// Own is the requests this router holds at its head's priority, and
	// Others those the other routers hold there (contract §22), when Known
	// (a fresh record with another router's entry).
	Own, Others int
	Known       bool
}

// Pacer paces one model's queue at the workers this router sees free: it
// hands each worker at most one queued request per interval. Not safe for
// concurrent use.
type Pacer struct {
	pace time.Duration
	rand func(n int64) int64
	// next is, per worker, the earliest time it may be handed a queued
	// request: a hand-off puts it one interval ahead, and a worker first
	// seen free gets a random phase within the interval (see firstTurn).
	next map[uint64]time.Time
}

// NewPacer returns a pacer of the given pace (positive). rnd returns a
// uniform integer in [0, n), for the phase of a worker's first turn (nil:
// math/rand/v2's Int64N).
func NewPacer(pace time.Duration, rnd func(n int64) int64) *Pacer {
	if rnd == nil {
		rnd = rand.Int64N
	}
	return &Pacer{pace: pace, rand: rnd, next: make(map[uint64]time.Time)}
}

// Interval is how often this router may hand one free worker a queued
// request: pace × (Own + Others) / Own when the share is Known, so that
// turns at a freed worker go in proportion to what each router holds
// (contract §22); otherwise pace × max(1, Routers), so that all routers
// together hand a freed worker about one queued request per pace (§17).
func (p *Pacer) Interval(s Share) time.Duration {
	if s.Known && s.Own > 0 && s.Others >= 0 {
		share := min((float64(s.Own)+float64(s.Others))/float64(s.Own), maxShare)
		return time.Duration(float64(p.pace) * share)
	}
	return p.pace * time.Duration(max(1, min(s.Routers, maxShare)))
}

// Expire forgets the workers whose turn came due more than one interval
// before now: their next turn is a first one again.
func (p *Pacer) Expire(now time.Time, interval time.Duration) {
	for id, next := range p.next {
		if now.Sub(next) >= interval {
			delete(p.next, id)
		}
	}
}

// Ready reports whether worker, seen free, may be handed a queued request
// at now. A worker seen for the first time gets its first turn at a random
// phase of the interval (see firstTurn).
func (p *Pacer) Ready(worker uint64, now time.Time, interval time.Duration) bool {
	next, seen := p.next[worker]
	if !seen {
		next = now.Add(max(0, p.firstTurn(interval)))
		p.next[worker] = next
	}
	return !now.Before(next)
}

// Handed records that worker was handed a queued request at now: its next
// turn is one interval after this one came due, when it was handed within a
// pace of that (so that a dispatcher that looks once a pace still hands it
// one per interval on average, an interval that is not a whole number of
// paces included), else one interval after now.
func (p *Pacer) Handed(worker uint64, now time.Time, interval time.Duration) {
	next := now.Add(interval)
	if due, ok := p.next[worker]; ok && !now.Before(due) && now.Sub(due) < p.pace {
		next = due.Add(interval)
	}
	p.next[worker] = next
}

// firstTurn returns when, from now, a router may hand a worker it sees
// free for the first time its first queued request: at a uniformly random
// phase of the pacing interval, less one pace (at once when that is not
// positive). Each of N routers then takes its first turn within the first
// pace with a probability of 1/N, so that together they hand a freed worker
// about one queued request in its first pace, as in every later one, rather
// than N on their next ticks before the record can show the first (contract
// §17). A single router (interval = pace) always hands at once.
func (p *Pacer) firstTurn(interval time.Duration) time.Duration {
	if interval <= p.pace {
		return 0
	}
	return time.Duration(p.rand(int64(interval))) - p.pace
}
