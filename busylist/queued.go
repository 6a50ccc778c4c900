package busylist

import (
	"cmp"
	"maps"
	"slices"
	"time"

	"github.com/workermon/workermon/events"
)

// This file holds the router side's view of the routers' queues a record
// lists (contract §22): what the other routers of a model hold queued, for
// a router's admission and pacing.

// QueuedFreshFor is how long a record's queued_by counts for a router: a
// record received, or updated (by the router's clock), longer ago
// contributes nothing to its admission and pacing (contract §22).
const QueuedFreshFor = 3 * time.Second

// RouterQueued is one router's queue as a record lists it.
type RouterQueued struct {
	Source string // router/<id>
	// Levels are the priorities with a request queued, highest first
	// (their OldestMs unknown: 0).
	Levels []events.QueuedLevel
}

// QueuedOthers is what the routers other than one hold queued for a model,
// by its record (contract §22).
type QueuedOthers struct {
	// Known: the record is fresh (QueuedFreshFor) and lists another
	// router's queue. When false, the other fields are zero.
	Known bool
	// N is the requests the other routers hold in all, Top the highest
	// priority among them (meaningless when N is 0), and AtP those they
	// hold at the priority asked for.
	N   uint64
	Top int64
	AtP uint64
}

// routerQueuedOf returns the queues rec lists, by source, each one's levels
// highest first; nil when none holds a request.
func routerQueuedOf(rec *events.BusySet) []RouterQueued {
	var out []RouterQueued
	for _, src := range slices.Sorted(maps.Keys(rec.QueuedBy)) {
		var levels []events.QueuedLevel
		for p, n := range rec.QueuedBy[src] {
			if n > 0 {
				levels = append(levels, events.QueuedLevel{Priority: p, N: n})
			}
		}
		if len(levels) == 0 {
			continue
		}
		slices.SortFunc(levels, func(a, b events.QueuedLevel) int { return cmp.Compare(b.Priority, a.Priority) })
		out = append(out, RouterQueued{Source: src, Levels: levels})
	}
	return out
}

// QueuedByOthers returns what the routers other than own (a source,
// router/<id>; "" excludes none) hold queued for model, by its record
// (contract §22), with the count at priority p. A record received, or
// updated, QueuedFreshFor or longer ago, or missing, contributes nothing.
//
// Lock-free and allocation-free; while the record lists no router's queue
// it reads no clock.
func (w *Watcher) QueuedByOthers(model, own string, p int64) QueuedOthers {
	if !w.anyQueued.Load() {
		return QueuedOthers{}
	}
	e := w.state.Load()[model]
	if e == nil || len(e.queued) == 0 {
		return QueuedOthers{}
	}
	var o QueuedOthers
	for i := range e.queued {
		rq := &e.queued[i]
		if rq.Source == own {
			continue
		}
		if !o.Known || rq.Levels[0].Priority > o.Top {
			o.Top = rq.Levels[0].Priority
		}
		o.Known = true
		for _, l := range rq.Levels {
			o.N = addCount(o.N, l.N)
			if l.Priority == p {
				o.AtP = addCount(o.AtP, l.N)
			}
		}
	}
	if !o.Known {
		return QueuedOthers{}
	}
	now := w.now()
	if now.Sub(e.received) >= QueuedFreshFor || now.UnixNano()-e.rec.UpdatedAt >= int64(QueuedFreshFor) {
		return QueuedOthers{}
	}
	return o
}

// OthersQueued returns the routers' queues the record of model lists, less
// own's, as QueuedByOthers counts them (nil when it counts none). The
// slices are shared: do not modify them.
func (w *Watcher) OthersQueued(model, own string) []RouterQueued {
	e := w.state.Load()[model]
	if e == nil || len(e.queued) == 0 {
		return nil
	}
	now := w.now()
	if now.Sub(e.received) >= QueuedFreshFor || now.UnixNano()-e.rec.UpdatedAt >= int64(QueuedFreshFor) {
		return nil
	}
	var out []RouterQueued
	for _, rq := range e.queued {
		if rq.Source != own {
			out = append(out, rq)
		}
	}
	return out
}

// listsQueues is 1 when the entry's record lists a router's queue, else 0
// (nil too).
func (e *busyEntry) listsQueues() int {
	if e != nil && len(e.queued) > 0 {
		return 1
	}
	return 0
}

// addCount adds two counts, stopping at the largest uint64.
func addCount(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}
