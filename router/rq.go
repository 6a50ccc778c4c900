package router

import (
	"cmp"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/flow"
)

// This file holds what routers that queue as one (contract §22) tell each
// other: each router publishes its queue of every model on
// <prefix>.rq.<model_key> under its source router/<id>, and reads the other
// routers' from the record's queued_by (a busylist.Watcher's
// QueuedByOthers).

// QueueReportEvery is how often a router publishes a model's queue while
// it holds requests, changed or not (contract §22).
const QueueReportEvery = time.Second

// ErrNoRouterID: the queue reports need a router id, for their source
// router/<id>.
var ErrNoRouterID = errors.New("router: the queue reports need a router id")

// queuedView is what a BusyList tells of the other routers' queues
// (contract §22); *busylist.Watcher is one.
type queuedView interface {
	QueuedByOthers(model, own string, p int64) busylist.QueuedOthers
	OthersQueued(model, own string) []busylist.RouterQueued
}

var _ queuedView = (*busylist.Watcher)(nil)

// withOthers adds to models (GET /queues) what the other routers hold
// queued by the records (contract §22), adding the models only they queue
// for, sorted by model.
func (rt *Router) withOthers(models []QueueSnapshot) []QueueSnapshot {
	qv, ok := rt.cfg.BusyList.(queuedView)
	if !ok {
		return models
	}
	own := rt.source()
	n := len(models)
	for _, model := range rt.cfg.BusyList.Models() {
		others := qv.OthersQueued(model, own)
		if len(others) == 0 {
			continue
		}
		i, found := slices.BinarySearchFunc(models[:n], model, func(s QueueSnapshot, m string) int { return cmp.Compare(s.Model, m) })
		if !found {
			models = append(models, QueueSnapshot{Model: model, Classes: map[string]ClassQueue{}, Others: map[string]map[string]uint64{}})
			i = len(models) - 1
		}
		s := &models[i]
		for _, o := range others {
			byPriority := make(map[string]uint64, len(o.Levels))
			for _, l := range o.Levels {
				byPriority[strconv.FormatInt(l.Priority, 10)] = l.N
				s.OthersDepth += l.N
			}
			s.Others[o.Source] = byPriority
		}
	}
	slices.SortFunc(models, func(a, b QueueSnapshot) int { return cmp.Compare(a.Model, b.Model) })
	return models
}

// source is this router's source name, router/<id>; "" without an id.
func (rt *Router) source() string {
	if rt.cfg.RouterID == "" {
		return ""
	}
	return events.RouterSourcePrefix + rt.cfg.RouterID
}

// rqPublished is what the publisher last sent of one model's queue.
type rqPublished struct {
	gen  uint64    // the queue's change count it showed
	sent time.Time // zero: never
	held bool      // it listed a request
}

// RunQueueReports publishes this router's queues (contract §22) until ctx
// ends: a model's queue after every change, at most once per QueuePace;
// every QueueReportEvery while it holds requests; and once, empty, when it
// empties. Each report carries the source router/<RouterID>, a boot id
// drawn at the call and a sequence number shared by every model's reports.
// When ctx ends, the changes not published yet are, at once. publish sends
// one message; its errors are logged at a limited rate. It returns nil at
// once with flow control off, and ErrNoRouterID without a router id.
//
// The requests touch none of this: a change of a queue only counts itself
// and wakes the loop without blocking.
func (rt *Router) RunQueueReports(ctx context.Context, prefix string, publish func(subject string, data []byte) error) error {
	q := rt.queue
	if q == nil {
		return nil
	}
	if rt.cfg.RouterID == "" {
		return ErrNoRouterID
	}
	p := &rqPublisher{q: q, source: rt.source(), prefix: prefix, boot: rand.Uint64() | 1, publish: publish,
		enc: events.NewEncoder(), last: make(map[*modelQueue]*rqPublished), log: &rt.streamLog}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		next := p.pass(time.Now(), false)
		changed := q.changed
		if !next.IsZero() {
			wait := time.Until(next)
			timer.Reset(wait)
			// A change comes out within a pace anyway: the next pass is
			// that close.
			if wait <= q.pace {
				changed = nil
			}
		}
		select {
		case <-ctx.Done():
			p.pass(time.Now(), true)
			return ctx.Err()
		case <-changed:
		case <-timer.C:
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// rqPublisher is RunQueueReports's state.
type rqPublisher struct {
	q       *queues
	source  string
	prefix  string
	boot    uint64
	seq     uint64
	publish func(subject string, data []byte) error
	enc     *events.Encoder
	last    map[*modelQueue]*rqPublished
	levels  []flow.Level
	log     *rateLog
}

// pass publishes every model's queue that is due at now (all, every one
// changed since its last report) and returns when the next is due; zero
// when none is waiting.
func (p *rqPublisher) pass(now time.Time, all bool) time.Time {
	var next time.Time
	later := func(t time.Time) {
		if next.IsZero() || t.Before(next) {
			next = t
		}
	}
	for model, mq := range *p.q.byModel.Load() {
		st := p.last[mq]
		if st == nil {
			st = &rqPublished{}
			p.last[mq] = st
		}
		var due time.Time
		switch {
		case mq.gen.Load() != st.gen:
			due = st.sent.Add(p.q.pace)
			if all {
				due = now
			}
		case st.held:
			due = st.sent.Add(QueueReportEvery)
		default:
			continue
		}
		if now.Before(due) {
			later(due)
			continue
		}
		p.send(model, mq, st, now)
		if st.held {
			later(now.Add(QueueReportEvery))
		}
	}
	return next
}

// send publishes model's queue as it is now.
func (p *rqPublisher) send(model string, mq *modelQueue, st *rqPublished, now time.Time) {
	mq.mu.Lock()
	p.levels = mq.fq.Levels(p.levels[:0], events.MaxQueuedPriorities)
	gen := mq.gen.Load()
	mq.mu.Unlock()
	r := events.RouterQueue{Model: model, Source: p.source, BootID: p.boot, SentAt: now.UnixNano()}
	for _, l := range p.levels {
		r.Queued = append(r.Queued, events.QueuedLevel{Priority: l.Priority, N: uint64(l.N),
			OldestMs: uint64(max(0, now.Sub(l.Oldest).Milliseconds()))})
	}
	p.seq++
	r.Seq = p.seq
	data, err := p.enc.RouterQueue(&r)
	if err == nil {
		err = p.publish(events.RqSubject(p.prefix, model), data)
	}
	if err != nil {
		p.log.warn("router: queue report not published", "model", model, "err", err)
	}
	// Not published is as good as published: the next change, or the
	// next second, sends it again.
	st.gen, st.sent, st.held = gen, now, len(r.Queued) > 0
}
