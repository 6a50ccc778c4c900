package monitor

import (
	"container/heap"
	"maps"
	"slices"
	"time"

	"github.com/workermon/workermon/events"
)

// This file holds the routers' queues (contract §22): each router with flow
// control on reports its queue of a model on <prefix>.rq.<model_key>; the
// monitor keeps every router's latest report for RouterQueueKeep of its own
// receipt clock and writes them in the record, as queued_by per router and
// queued summed, so that the routers of a model queue as one.

const (
	// RouterQueueKeep is how long a router's queue report counts after the
	// monitor received it: a router that died leaves nothing behind for
	// longer (contract §22).
	RouterQueueKeep = 3 * time.Second
	// RouterQueueCountsEvery is how often a change of the queued counts
	// alone is written: at most once per this, while a change of which
	// priorities hold requests is written at once (contract §22).
	RouterQueueCountsEvery = 100 * time.Millisecond
	// DefaultMaxRoutersPerModel bounds the routers whose queues a model
	// keeps.
	DefaultMaxRoutersPerModel = 64
	// rejectNoWorkers: a router's queue of a model with no worker (contract
	// §22).
	rejectNoWorkers = "no_workers"
)

// rqSource is one router's latest queue report of a model.
type rqSource struct {
	bootID uint64
	seq    uint64
	sentAt int64
	heard  time.Time // monitor clock
	queued []events.QueuedLevel
}

// rqState is a model's routers' queues.
type rqState struct {
	bySource map[string]*rqSource
	// given is when a record last carried the queues (monitor clock);
	// countsDue, when not zero, is when a change of counts alone waiting
	// since is due (given + RouterQueueCountsEvery).
	given, countsDue time.Time
	// deadline is the next time the queues need the loop: a report
	// expiring, or countsDue; index is the model's place in state.rqTimers,
	// -1 when not there.
	deadline time.Time
	index    int
}

// sameShape reports whether two queues hold requests at the same
// priorities.
func sameShape(a, b []events.QueuedLevel) bool {
	return slices.EqualFunc(a, b, func(x, y events.QueuedLevel) bool { return x.Priority == y.Priority })
}

// sameCounts reports whether two queues hold the same requests by priority
// (their ages aside).
func sameCounts(a, b []events.QueuedLevel) bool {
	return slices.EqualFunc(a, b, func(x, y events.QueuedLevel) bool { return x.Priority == y.Priority && x.N == y.N })
}

// applyRouterQueue applies a router's queue report; it returns a rejection
// reason or "".
func (s *state) applyRouterQueue(r *events.RouterQueue, now time.Time) string {
	m := s.models[r.Model]
	if m == nil || len(m.workers) == 0 {
		return rejectNoWorkers
	}
	if s.fromFuture(r.SentAt, now) {
		return rejectFuture
	}
	rq := &m.rq
	src := rq.bySource[r.Source]
	var before []events.QueuedLevel
	switch {
	case src == nil:
		if len(rq.bySource) >= s.cfg.MaxRoutersPerModel {
			return rejectSources
		}
		if rq.bySource == nil {
			rq.bySource = make(map[string]*rqSource)
		}
		src = &rqSource{bootID: r.BootID}
		rq.bySource[r.Source] = src
		defer s.recountRouters(m, now)
	case src.bootID != r.BootID:
		if r.SentAt <= src.sentAt {
			return rejectDeadBoot
		}
		before = src.queued
		*src = rqSource{bootID: r.BootID}
	case r.Seq <= src.seq:
		return rejectDuplicate
	default:
		before = src.queued
	}
	src.seq, src.sentAt, src.heard, src.queued = r.Seq, r.SentAt, now, r.Queued
	switch {
	case !sameShape(before, r.Queued):
		s.queuesChanged(m) // which priorities hold requests: at once
	case !sameCounts(before, r.Queued) && rq.countsDue.IsZero():
		// Counts alone: at most once per RouterQueueCountsEvery.
		if due := rq.given.Add(RouterQueueCountsEvery); now.Before(due) {
			rq.countsDue = due
		} else {
			s.queuesChanged(m)
		}
	}
	s.scheduleQueues(m)
	return ""
}

// queuesChanged marks m's record for the next flush, for its queues.
func (s *state) queuesChanged(m *model) {
	m.rq.countsDue = time.Time{}
	m.dirty = true
	s.markDirty(m)
}

// scheduleQueues puts m's next queue deadline (the first report to
// expire, or a change of counts due) on the loop's timers.
func (s *state) scheduleQueues(m *model) {
	rq := &m.rq
	var next time.Time
	for _, src := range rq.bySource {
		if t := src.heard.Add(RouterQueueKeep); next.IsZero() || t.Before(next) {
			next = t
		}
	}
	if !rq.countsDue.IsZero() && (next.IsZero() || rq.countsDue.Before(next)) {
		next = rq.countsDue
	}
	rq.deadline = next
	switch {
	case next.IsZero() && rq.index >= 0:
		heap.Remove(&s.rqTimers, rq.index)
	case next.IsZero():
	case rq.index >= 0:
		heap.Fix(&s.rqTimers, rq.index)
	default:
		heap.Push(&s.rqTimers, m)
	}
}

// expireQueues forgets the reports of m received RouterQueueKeep or more
// before now, and hands over a change of counts that is due.
func (s *state) expireQueues(m *model, now time.Time) {
	rq := &m.rq
	n := len(rq.bySource)
	maps.DeleteFunc(rq.bySource, func(_ string, src *rqSource) bool { return !now.Before(src.heard.Add(RouterQueueKeep)) })
	if len(rq.bySource) != n {
		s.recountRouters(m, now)
		s.queuesChanged(m)
	}
	if !rq.countsDue.IsZero() && !now.Before(rq.countsDue) {
		s.queuesChanged(m)
	}
	s.scheduleQueues(m)
}

// dropQueues takes a model that goes away off the queue timers.
func (s *state) dropQueues(m *model) {
	if m.rq.index >= 0 {
		heap.Remove(&s.rqTimers, m.rq.index)
	}
}

// queuesGiven notes that a record carrying m's queues was handed to the
// sink at now: a change of counts waiting is in it.
func (m *model) queuesGiven(now time.Time) {
	m.rq.given, m.rq.countsDue = now, time.Time{}
}

// expireQueuesDue runs the queue deadlines that are due.
func (s *state) expireQueuesDue(now time.Time) {
	for len(s.rqTimers) > 0 && !s.rqTimers[0].rq.deadline.After(now) {
		s.expireQueues(s.rqTimers[0], now)
	}
}

// queuedRouters counts m's routers with a queue report that are not among
// its estimating routers (routerHeard): with them, the record's routers
// (contract §17, §22).
func (m *model) queuedRouters() int {
	n := 0
	for name := range m.rq.bySource {
		if _, ok := m.routerHeard[name]; !ok {
			n++
		}
	}
	return n
}

// queuedRecord returns the record's queued_by and queued, freshly
// allocated.
func (m *model) queuedRecord() (map[string]map[int64]uint64, map[int64]uint64) {
	if len(m.rq.bySource) == 0 {
		return nil, nil // written as empty maps
	}
	by := make(map[string]map[int64]uint64, len(m.rq.bySource))
	sum := make(map[int64]uint64)
	for name, src := range m.rq.bySource {
		if len(src.queued) == 0 {
			continue
		}
		q := make(map[int64]uint64, len(src.queued))
		for _, l := range src.queued {
			q[l.Priority] = l.N
			sum[l.Priority] = addCount(sum[l.Priority], l.N)
		}
		by[name] = q
	}
	return by, sum
}

// addCount adds two counts, stopping at the largest uint64.
func addCount(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}

// modelQueueTimers is a min-heap of models by their next queue deadline.
type modelQueueTimers []*model

func (h modelQueueTimers) Len() int           { return len(h) }
func (h modelQueueTimers) Less(i, j int) bool { return h[i].rq.deadline.Before(h[j].rq.deadline) }
func (h modelQueueTimers) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].rq.index, h[j].rq.index = i, j
}
func (h *modelQueueTimers) Push(x any) {
	m := x.(*model)
	m.rq.index = len(*h)
	*h = append(*h, m)
}
func (h *modelQueueTimers) Pop() any {
	old := *h
	m := old[len(old)-1]
	old[len(old)-1] = nil
	m.rq.index = -1
	*h = old[:len(old)-1]
	return m
}
