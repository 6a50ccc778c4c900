// Package flow is the router's flow control (contract §17) as plain data:
// the order of one model's queue (higher priority first, tenants taking
// turns within a priority, first come first served within a tenant), its
// limits (requests per model, and bytes queued across every model of a
// router) with the evictions that a full queue makes, the rule that lets a
// newcomer go straight to a worker, and the pacing of queued requests at a
// free worker.
//
// Nothing here talks to HTTP or NATS, starts a goroutine or reads a clock:
// every call that depends on time takes it. A Queue and a Pacer are not safe
// for concurrent use (the router guards each model's with a mutex); a
// Budget is, being shared by the queues of every model.
//
// Two inputs are seams for routers that queue as one (contract §22): what
// other routers hold (Held, in Arrival.Others and Direct), and their share
// of a priority for the pacing (Share.Others, Share.Known). Left zero, the
// queue and the pacing are those of §17.
package flow

import (
	"errors"
	"sync/atomic"
)

// Errors of Queue.Join.
var (
	// ErrFull: the queue is full (its requests or the router's bytes), and
	// the newcomer may push out none of the queued requests.
	ErrFull = errors.New("flow: queue full")
	// ErrAhead: the newcomer is admitted and goes ahead of the queue: no
	// queued request has its priority or a higher one.
	ErrAhead = errors.New("flow: the request goes ahead of the queue")
	// ErrNoWait: the newcomer would have to join the queue but may not
	// wait.
	ErrNoWait = errors.New("flow: the request may not wait")
)

// Held is what a queue, or the queues of other routers, hold for a model:
// N requests, the highest of priority Top (meaningless when N is 0).
type Held struct {
	N   int
	Top int64
}

// Direct reports whether a newcomer of priority p, which the record admits,
// goes straight to a worker: neither this router's queue (own) nor, with
// routers that queue as one (contract §22), another router's (others)
// holds a request of priority p or higher. A newcomer of equal or lower
// priority never overtakes a queued request.
func Direct(p int64, own, others Held) bool {
	return (own.N == 0 || p > own.Top) && (others.N == 0 || p > others.Top)
}

// Budget bounds the bytes queued across every model's queue of a router;
// the queues that share it take from it and give back. Safe for concurrent
// use.
type Budget struct {
	max  int64
	used atomic.Int64
}

// NewBudget returns a budget of max bytes.
func NewBudget(max int64) *Budget {
	return &Budget{max: max}
}

// Max is the budget's size in bytes.
func (b *Budget) Max() int64 { return b.max }

// Used is the bytes queued now.
func (b *Budget) Used() int64 { return b.used.Load() }

// giveBack returns n bytes to the budget; nil-safe.
func (b *Budget) giveBack(n int64) {
	if b != nil && n != 0 {
		b.used.Add(-n)
	}
}
