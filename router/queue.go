package router

import (
	"container/list"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/promreg"
)

// This file holds flow control (contract §17): a request whose class has no
// candidate waits in its model's queue instead of being rejected at once,
// and is sent when a worker frees, each router handing a freed worker at
// most one queued request per pace × the number of routers.
//
// A model's queue is guarded by its mutex and served by one goroutine that
// runs while the queue holds requests; close stops these goroutines and
// waits for them. A request that does not wait reads
// only an immutable map of the queues and the queue's atomic depth: no lock
// and no allocation while the queue is empty.

// Headers of flow control (contract §17).
const (
	// MaxWaitHeader shortens a request's wait in the queue, in
	// milliseconds; 0 means do not wait.
	MaxWaitHeader = "X-Workermon-Max-Wait"
	// TenantHeader names the tenant a request is queued for: tenants take
	// turns within a priority.
	TenantHeader = "X-Workermon-Tenant"
	// QueuedHeader is set on every answer to a request that waited: the
	// milliseconds it waited, rounded down.
	QueuedHeader = "X-Workermon-Queued"
)

// Defaults of flow control.
const (
	// DefaultQueueMaxWait is how long a request may wait: 0, flow control
	// is off.
	DefaultQueueMaxWait = 0
	// DefaultQueueMaxRequests is how many requests a model's queue holds.
	DefaultQueueMaxRequests = 1024
	// DefaultQueuePace is the pace of dispatch: one queued request per free
	// worker per pace × max(1, routers).
	DefaultQueuePace = 20 * time.Millisecond
	// maxTenantLen is the longest tenant name.
	maxTenantLen = 64
)

// Outcomes of workermon_router_queue_wait_seconds.
const (
	queueDispatched = "dispatched" // sent to a worker (or released: the record turned stale or went away)
	queueExpired    = "expired"    // the wait ran out
	queueEvicted    = "evicted"    // pushed out of a full queue, or turned away by one
	queueGone       = "gone"       // the client went away
)

// queueHeaders are the flow-control headers of one request.
type queueHeaders struct {
	maxWait time.Duration // the request's own limit; -1 when it sets none
	tenant  string
}

// parseQueueHeaders reads MaxWaitHeader and TenantHeader; msg is the message
// of a 400 when one is malformed. It allocates only on error.
func parseQueueHeaders(r *http.Request) (qh queueHeaders, msg string) {
	qh.maxWait = -1
	switch vs := r.Header.Values(MaxWaitHeader); len(vs) {
	case 0:
	case 1:
		v := strings.TrimSpace(vs[0])
		ms, err := strconv.ParseUint(v, 10, 64)
		if err != nil && !errors.Is(err, strconv.ErrRange) {
			return qh, fmt.Sprintf("%s %.32q is not a non-negative integer of milliseconds (0: do not wait)", MaxWaitHeader, v)
		}
		qh.maxWait = time.Duration(min(ms, uint64(math.MaxInt64/int64(time.Millisecond)))) * time.Millisecond
	default:
		return qh, fmt.Sprintf("%s is given %d times; give it once", MaxWaitHeader, len(vs))
	}
	switch vs := r.Header.Values(TenantHeader); len(vs) {
	case 0:
	case 1:
		if !validTenant(vs[0]) {
			return qh, fmt.Sprintf("%s must be at most %d visible ASCII characters", TenantHeader, maxTenantLen)
		}
		qh.tenant = vs[0]
	default:
		return qh, fmt.Sprintf("%s is given %d times; give it once", TenantHeader, len(vs))
	}
	return qh, ""
}

// validTenant reports whether t is at most maxTenantLen visible ASCII bytes.
func validTenant(t string) bool {
	if len(t) > maxTenantLen {
		return false
	}
	for i := 0; i < len(t); i++ {
		if t[i] < 0x21 || t[i] > 0x7e {
			return false
		}
	}
	return true
}

// priorityOf returns the integer of a request's PriorityHeader, already
// checked by admission.ClassFromRequest; beyond int64 it saturates.
func priorityOf(r *http.Request) int64 {
	v := strings.TrimSpace(r.Header.Get(admission.PriorityHeader))
	if v == "" {
		return 0
	}
	p, _ := strconv.ParseInt(v, 10, 64)
	return p
}

// verdictKind is how a request leaves the queue.
type verdictKind uint8

const (
	// verdictDispatch: send to worker, chosen by the dispatcher.
	verdictDispatch verdictKind = iota + 1
	// verdictRelease: the record turned stale or went away, or the model
	// lost its workers: decide again, without queuing (fail open).
	verdictRelease
	// verdictEvicted: pushed out of a full queue by a request of higher
	// priority.
	verdictEvicted
)

// verdict is what the dispatcher (or an evicting newcomer) tells a waiter.
type verdict struct {
	kind   verdictKind
	worker events.WorkerEntry
	d      admission.Decision
	cands  []events.WorkerEntry // the dispatch's candidates, for retries
}

// waiter is one queued request.
type waiter struct {
	priority int64
	class    admission.Class
	tenant   string
	seq      uint64 // arrival order in the model's queue
	since    time.Time
	done     chan verdict // buffered: the sender never blocks
	// Under the queue's mutex:
	tq   *tenantQueue
	elem *list.Element
}

// tenantQueue is one tenant's requests of one priority, first come first
// served.
type tenantQueue struct {
	name  string
	level *priorityLevel
	l     list.List
}

// priorityLevel holds the requests of one priority; its tenants take turns.
type priorityLevel struct {
	priority int64
	tenants  []*tenantQueue // in turn order; none is empty
	next     int            // the tenant whose turn it is
	byName   map[string]*tenantQueue
}

// queueMetrics are the metrics of flow control.
type queueMetrics struct {
	depth     *prometheus.GaugeVec
	wait      [admission.NumClasses]map[string]prometheus.Observer
	maxModels int

	mu     sync.Mutex
	models map[string]bool // the models with a label of their own
}

func newQueueMetrics(reg prometheus.Registerer, maxModels int) (*queueMetrics, error) {
	depth := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "workermon_router_queue_depth",
		Help: `Requests waiting in the router's queue, by model ("other" beyond the label cap) and priority class.`,
	}, []string{"model", "class"})
	wait := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "workermon_router_queue_wait_seconds",
		Help:    "Time requests waited in the router's queue, by priority class and outcome: dispatched, expired, evicted, gone.",
		Buckets: []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
	}, []string{"class", "outcome"})
	if err := errors.Join(promreg.Shared(reg, &depth), promreg.Shared(reg, &wait)); err != nil {
		return nil, err
	}
	m := &queueMetrics{depth: depth, maxModels: maxModels, models: make(map[string]bool)}
	for _, c := range admission.Classes() {
		m.wait[c] = make(map[string]prometheus.Observer)
		for _, o := range []string{queueDispatched, queueExpired, queueEvicted, queueGone} {
			m.wait[c][o] = wait.WithLabelValues(c.String(), o)
		}
	}
	return m, nil
}

// depthGauges returns the depth gauges of model, by class, giving the model
// a label of its own while there is room.
func (m *queueMetrics) depthGauges(model string) [admission.NumClasses]prometheus.Gauge {
	m.mu.Lock()
	label := model
	if !m.models[model] {
		if len(m.models) >= m.maxModels || events.ValidateModel(model) != nil {
			label = admission.OtherModel
		} else {
			m.models[model] = true
		}
	}
	m.mu.Unlock()
	var g [admission.NumClasses]prometheus.Gauge
	for _, c := range admission.Classes() {
		g[c] = m.depth.WithLabelValues(label, c.String())
	}
	return g
}

// queueDeps is what the queues need of the Router.
type queueDeps struct {
	decide     func(model string, c admission.Class) admission.Decision
	registered func(model string) []events.WorkerEntry
	routers    func(model string) uint64
	pick       func(cands []events.WorkerEntry) (events.WorkerEntry, bool)
}

// queues are the Router's queues, one per model.
type queues struct {
	maxWait     time.Duration
	maxRequests int
	pace        time.Duration
	deps        queueDeps
	metrics     *queueMetrics

	byModel atomic.Pointer[map[string]*modelQueue] // copied on write under mu
	mu      sync.Mutex

	closed      atomic.Bool   // set under mu; read under a modelQueue's mu by join
	stop        chan struct{} // closed by close: the dispatchers end
	dispatchers sync.WaitGroup
}

func newQueues(maxWait time.Duration, maxRequests int, pace time.Duration, deps queueDeps, m *queueMetrics) *queues {
	q := &queues{maxWait: maxWait, maxRequests: maxRequests, pace: pace, deps: deps, metrics: m, stop: make(chan struct{})}
	q.byModel.Store(&map[string]*modelQueue{})
	return q
}

// close stops queuing: every queued request is released, to be decided
// again as if it never queued (requests in flight are not interrupted), a
// newcomer no longer queues, and the dispatchers end; it returns once they
// have. Idempotent.
func (q *queues) close() {
	q.mu.Lock()
	if q.closed.Load() {
		q.mu.Unlock()
		return
	}
	q.closed.Store(true)
	close(q.stop)
	byModel := *q.byModel.Load()
	q.mu.Unlock()
	// A queue created from now on sees closed; one of byModel sees it once
	// released here, so no dispatcher starts after this loop.
	now := time.Now()
	for _, mq := range byModel {
		mq.mu.Lock()
		mq.releaseAllLocked(now)
		mq.mu.Unlock()
	}
	q.dispatchers.Wait()
}

// lookup returns model's queue, or nil when it never had one. Lock-free.
func (q *queues) lookup(model string) *modelQueue {
	return (*q.byModel.Load())[model]
}

// forModel returns model's queue, creating it.
func (q *queues) forModel(model string) *modelQueue {
	if mq := q.lookup(model); mq != nil {
		return mq
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	cur := *q.byModel.Load()
	if mq := cur[model]; mq != nil {
		return mq
	}
	mq := &modelQueue{q: q, model: model, handed: make(map[uint64]time.Time), gauges: q.metrics.depthGauges(model)}
	next := make(map[string]*modelQueue, len(cur)+1)
	maps.Copy(next, cur)
	next[model] = mq
	q.byModel.Store(&next)
	return mq
}

// modelQueue is one model's queue.
type modelQueue struct {
	q      *queues
	model  string
	gauges [admission.NumClasses]prometheus.Gauge
	// depth is the number of queued requests, read without the lock.
	depth atomic.Int64

	mu      sync.Mutex
	levels  []*priorityLevel // by priority, highest first; none is empty
	byClass [admission.NumClasses]int
	seq     uint64
	running bool // the dispatcher goroutine runs
	// handed is, per worker, the earliest time this router may hand it a
	// queued request: a hand-off puts it one pacing interval ahead, and a
	// worker first seen free gets a random phase within the interval (see
	// firstTurn). Entries are dropped one interval after they come due.
	handed map[uint64]time.Time
}

// Errors of join.
var (
	errQueueFull = errors.New("router: queue full")
	errOvertake  = errors.New("router: the request goes ahead of the queue")
	errNoWait    = errors.New("router: the request may not wait")
	errClosed    = errors.New("router: the queues are closed")
)

// join queues a request of priority p, class c and tenant t. admitted says
// whether it would be admitted without queuing: it then goes ahead
// (errOvertake) unless the queue holds a request of equal or higher
// priority. A request that would have to join but may not wait (mayWait
// false: X-Workermon-Max-Wait 0) is refused (errNoWait). A full queue
// evicts its newest request of the lowest priority for a newcomer of higher
// priority, or refuses the newcomer (errQueueFull). Once the queues are
// closed, nothing joins (errClosed).
func (mq *modelQueue) join(p int64, c admission.Class, t string, admitted, mayWait bool, now time.Time) (*waiter, error) {
	mq.mu.Lock()
	defer mq.mu.Unlock()
	if mq.q.closed.Load() {
		return nil, errClosed
	}
	n := int(mq.depth.Load())
	if admitted && (n == 0 || p > mq.levels[0].priority) {
		return nil, errOvertake
	}
	if !mayWait {
		return nil, errNoWait
	}
	if n >= mq.q.maxRequests {
		low := mq.levels[len(mq.levels)-1]
		if p <= low.priority {
			return nil, errQueueFull
		}
		victim := low.newest()
		mq.removeLocked(victim)
		mq.q.metrics.wait[victim.class][queueEvicted].Observe(now.Sub(victim.since).Seconds())
		victim.done <- verdict{kind: verdictEvicted}
	}
	mq.seq++
	w := &waiter{priority: p, class: c, tenant: t, seq: mq.seq, since: now, done: make(chan verdict, 1)}
	mq.pushLocked(w)
	if !mq.running {
		mq.running = true
		mq.q.dispatchers.Add(1)
		go mq.run()
	}
	return w, nil
}

// newest returns the request of l that arrived last.
func (l *priorityLevel) newest() *waiter {
	var w *waiter
	for _, tq := range l.tenants {
		if b := tq.l.Back().Value.(*waiter); w == nil || b.seq > w.seq {
			w = b
		}
	}
	return w
}

// pushLocked appends w to its priority and tenant.
func (mq *modelQueue) pushLocked(w *waiter) {
	i, found := slices.BinarySearchFunc(mq.levels, w.priority, func(l *priorityLevel, p int64) int {
		switch {
		case l.priority > p:
			return -1
		case l.priority < p:
			return 1
		}
		return 0
	})
	if !found {
		mq.levels = slices.Insert(mq.levels, i, &priorityLevel{priority: w.priority, byName: make(map[string]*tenantQueue)})
	}
	lvl := mq.levels[i]
	tq := lvl.byName[w.tenant]
	if tq == nil {
		tq = &tenantQueue{name: w.tenant, level: lvl}
		lvl.byName[w.tenant] = tq
		lvl.tenants = append(lvl.tenants, tq)
	}
	w.tq, w.elem = tq, tq.l.PushBack(w)
	mq.byClass[w.class]++
	mq.gauges[w.class].Inc()
	mq.depth.Add(1)
}

// removeLocked takes w out of the queue; false when it is not in it any
// more (dispatched, evicted or released).
func (mq *modelQueue) removeLocked(w *waiter) bool {
	tq := w.tq
	if tq == nil {
		return false
	}
	tq.l.Remove(w.elem)
	w.tq, w.elem = nil, nil
	mq.byClass[w.class]--
	mq.gauges[w.class].Dec()
	mq.depth.Add(-1)
	if tq.l.Len() > 0 {
		return true
	}
	lvl := tq.level
	delete(lvl.byName, tq.name)
	i := slices.Index(lvl.tenants, tq)
	lvl.tenants = slices.Delete(lvl.tenants, i, i+1)
	if i < lvl.next {
		lvl.next--
	}
	if lvl.next >= len(lvl.tenants) {
		lvl.next = 0
	}
	if len(lvl.tenants) == 0 {
		mq.levels = slices.DeleteFunc(mq.levels, func(l *priorityLevel) bool { return l == lvl })
	}
	return true
}

// remove takes w out of the queue, when it is still in it.
func (mq *modelQueue) remove(w *waiter) bool {
	mq.mu.Lock()
	defer mq.mu.Unlock()
	return mq.removeLocked(w)
}

// headLocked returns the request to send next: highest priority, the
// tenant whose turn it is, first come.
func (mq *modelQueue) headLocked() *waiter {
	lvl := mq.levels[0]
	return lvl.tenants[lvl.next].l.Front().Value.(*waiter)
}

// popLocked takes the head out and passes the turn to the next tenant.
func (mq *modelQueue) popLocked(w *waiter) {
	lvl := mq.levels[0]
	turn := lvl.next
	emptied := w.tq.l.Len() == 1
	mq.removeLocked(w)
	if !emptied && len(lvl.tenants) > 0 {
		lvl.next = (turn + 1) % len(lvl.tenants)
	}
	// An emptied tenant's removal already moved the turn to the next.
}

// run is the model's dispatcher: every pace, while the queue holds
// requests and the queues are not closed, it sends what the record allows.
func (mq *modelQueue) run() {
	defer mq.q.dispatchers.Done()
	t := time.NewTimer(mq.q.pace)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-mq.q.stop:
			mq.mu.Lock()
			mq.running = false
			mq.mu.Unlock()
			return
		}
		mq.mu.Lock()
		if mq.depth.Load() > 0 {
			mq.dispatchLocked(time.Now())
		}
		if mq.depth.Load() == 0 {
			mq.running = false
			mq.mu.Unlock()
			return
		}
		mq.mu.Unlock()
		t.Reset(mq.q.pace)
	}
}

// dispatchLocked sends the heads of the queue while their class has a
// candidate that this router may hand a queued request now, and releases
// every request when the record cannot be trusted or is gone.
func (mq *modelQueue) dispatchLocked(now time.Time) {
	deps := &mq.q.deps
	interval := mq.q.pace * time.Duration(max(1, min(deps.routers(mq.model), 1<<16)))
	for id, next := range mq.handed {
		if now.Sub(next) >= interval {
			delete(mq.handed, id)
		}
	}
	for mq.depth.Load() > 0 {
		w := mq.headLocked()
		d := deps.decide(mq.model, w.class)
		registered := deps.registered(mq.model)
		switch {
		case len(registered) == 0, d.Reason != admission.ReasonFree && d.Reason != admission.ReasonAllBusy && d.Reason != admission.ReasonShed:
			// No trustworthy record (stale, gone, not loaded) or no worker:
			// every request goes its own way now (fail open, or the
			// rejection of a router that fails closed).
			mq.releaseAllLocked(now)
			return
		case !d.Admit:
			return
		}
		cands := d.Candidates(nil, registered)
		free := slices.DeleteFunc(slices.Clone(cands), func(e events.WorkerEntry) bool {
			next, seen := mq.handed[e.WorkerID]
			if !seen {
				next = now.Add(firstTurn(mq.q.pace, interval))
				mq.handed[e.WorkerID] = next
			}
			return now.Before(next)
		})
		worker, ok := deps.pick(free)
		if !ok {
			return
		}
		mq.handed[worker.WorkerID] = now.Add(interval)
		mq.popLocked(w)
		mq.q.metrics.wait[w.class][queueDispatched].Observe(now.Sub(w.since).Seconds())
		w.done <- verdict{kind: verdictDispatch, worker: worker, d: d, cands: cands}
	}
}

// firstTurn returns when, from now, a router may hand a worker it sees
// free for the first time its first queued request: at a uniformly random
// phase of the pacing interval, less one pace (at once when that is not
// positive). Each of N routers then takes its first turn within the first
// pace with a probability of 1/N, so that together they hand a freed worker
// about one queued request in its first pace, as in every later one, rather
// than N on their next ticks before the record can show the first (contract
// §17). A single router (interval = pace) always hands at once.
func firstTurn(pace, interval time.Duration) time.Duration {
	if interval <= pace {
		return 0
	}
	return time.Duration(rand.Int64N(int64(interval))) - pace
}

// releaseAllLocked lets every queued request go, in queue order.
func (mq *modelQueue) releaseAllLocked(now time.Time) {
	for mq.depth.Load() > 0 {
		w := mq.headLocked()
		mq.popLocked(w)
		mq.q.metrics.wait[w.class][queueDispatched].Observe(now.Sub(w.since).Seconds())
		w.done <- verdict{kind: verdictRelease}
	}
}

// QueueSnapshot is one model's queue in GET /queues.
type QueueSnapshot struct {
	Model string `json:"model"`
	Depth int    `json:"depth"`
	// Classes are the queued requests by class, then by tenant ("" is the
	// default tenant).
	Classes map[string]ClassQueue `json:"classes"`
	// OldestMs is how long the oldest queued request has waited.
	OldestMs int64 `json:"oldest_ms"`
}

// ClassQueue is one class of a model's queue.
type ClassQueue struct {
	Depth   int            `json:"depth"`
	Tenants map[string]int `json:"tenants"`
}

// snapshot returns the queues that hold requests, sorted by model.
func (q *queues) snapshot(now time.Time) []QueueSnapshot {
	byModel := *q.byModel.Load()
	out := []QueueSnapshot{}
	for _, model := range slices.Sorted(maps.Keys(byModel)) {
		mq := byModel[model]
		mq.mu.Lock()
		if mq.depth.Load() == 0 {
			mq.mu.Unlock()
			continue
		}
		s := QueueSnapshot{Model: model, Depth: int(mq.depth.Load()), Classes: map[string]ClassQueue{}}
		var oldest time.Time
		for _, lvl := range mq.levels {
			for _, tq := range lvl.tenants {
				for e := tq.l.Front(); e != nil; e = e.Next() {
					w := e.Value.(*waiter)
					cq := s.Classes[w.class.String()]
					if cq.Tenants == nil {
						cq.Tenants = map[string]int{}
					}
					cq.Depth++
					cq.Tenants[w.tenant]++
					s.Classes[w.class.String()] = cq
					if oldest.IsZero() || w.since.Before(oldest) {
						oldest = w.since
					}
				}
			}
		}
		mq.mu.Unlock()
		s.OldestMs = now.Sub(oldest).Milliseconds()
		out = append(out, s)
	}
	return out
}

// waits reports whether a request for model with decision d and headers qh
// goes through the queue (contract §17): flow control is on, and the
// request may wait and its class has no candidate, or its model's queue
// holds requests (which an admitted request that may not wait must not
// overtake either: the queue answers it). nil-safe. With the queue empty it
// takes no lock and allocates nothing.
func (q *queues) waits(model string, d admission.Decision, qh queueHeaders) bool {
	if q == nil || (qh.maxWait == 0 && !d.Admit) {
		return false
	}
	if !d.Admit && queueable(d) {
		return true
	}
	mq := q.lookup(model)
	return mq != nil && mq.depth.Load() > 0
}

// queueable reports whether a rejection may wait in the queue: the record
// is fresh and the request's class has no candidate (a stale record's
// rejection, with fail-open off, never waits).
func queueable(d admission.Decision) bool {
	return d.Reason == admission.ReasonAllBusy || d.Reason == admission.ReasonShed
}

// rejected returns d as the rejection a request that left the queue
// without dispatch counts as.
func rejected(d admission.Decision) admission.Decision {
	if d.Admit {
		d.Admit, d.Reason = false, admission.ReasonAllBusy
	}
	return d
}

// queued puts the request in its model's queue and waits for its turn.
// It returns the candidates to send it to, or false when the request is
// answered (expired, evicted, refused by a full queue, rejected or gone).
func (ex *exchange) queued(d admission.Decision, cands []events.WorkerEntry, qh queueHeaders) ([]events.WorkerEntry, bool) {
	rt := ex.rt
	q := rt.queue
	wait := q.maxWait
	if qh.maxWait > 0 {
		wait = min(wait, qh.maxWait)
	}
	mq := q.forModel(ex.model)
	start := time.Now()
	w, err := mq.join(priorityOf(ex.r), ex.class, qh.tenant, d.Admit, qh.maxWait != 0, start)
	switch {
	case errors.Is(err, errOvertake):
		rt.admission.Observe(ex.model, d)
		return cands, true
	case errors.Is(err, errClosed):
		// The router is closing: decided as without flow control.
		return ex.decideAgain()
	case errors.Is(err, errNoWait):
		// Its wait of 0 ran out at once, behind the queue it may not
		// overtake.
		q.metrics.wait[ex.class][queueExpired].Observe(0)
		ex.queueReject(d, 0, expiredMessage(0, ex.model))
		return nil, false
	case errors.Is(err, errQueueFull):
		q.metrics.wait[ex.class][queueEvicted].Observe(0)
		ex.queueReject(d, time.Since(start), fullMessage(ex.model))
		return nil, false
	}
	rt.latency.queue(ex.model)

	timer := time.NewTimer(wait)
	defer timer.Stop()
	var v verdict
	select {
	case v = <-w.done:
	case <-ex.r.Context().Done():
		if mq.remove(w) {
			q.metrics.wait[ex.class][queueGone].Observe(time.Since(start).Seconds())
			ex.clientGone()
			return nil, false
		}
		v = <-w.done
	case <-timer.C:
		if mq.remove(w) {
			waited := time.Since(start)
			q.metrics.wait[ex.class][queueExpired].Observe(waited.Seconds())
			ex.queueReject(d, waited, expiredMessage(waited, ex.model))
			return nil, false
		}
		v = <-w.done
	}
	waited := time.Since(start)
	ex.w.Header().Set(QueuedHeader, strconv.FormatInt(waited.Milliseconds(), 10))
	switch v.kind {
	case verdictDispatch:
		rt.admission.Observe(ex.model, v.d)
		// The request goes out on the dispatcher's decision: should every
		// candidate fail, its next tier and rejection are that decision's,
		// not those of the rejection it queued on.
		ex.decision, ex.registered = v.d, rt.cfg.Registry.Endpoints(ex.model)
		ex.preferred = &v.worker
		return v.cands, true
	case verdictEvicted: // counted by the request that pushed it out
		ex.queueReject(d, waited, fullMessage(ex.model))
		return nil, false
	}
	return ex.decideAgain()
}

// expiredMessage is the message of a request whose wait ran out.
func expiredMessage(waited time.Duration, model string) string {
	return fmt.Sprintf("Request waited %d ms in the queue for model %.256q: all workers stayed busy, please retry later",
		waited.Milliseconds(), model)
}

// fullMessage is the message of a request a full queue turned away.
func fullMessage(model string) string {
	return fmt.Sprintf("The queue for model %.256q is full, please retry later", model)
}

// queueReject answers a request that leaves the queue without dispatch,
// after waited: counted as a rejection of d (the decision it queued on), in
// the latency windows' rejections too, and answered with the shed status,
// the retry headers, X-Workermon-Queued and the error body.
func (ex *exchange) queueReject(d admission.Decision, waited time.Duration, msg string) {
	ex.rt.admission.Observe(ex.model, rejected(d))
	ex.rt.latency.reject(ex.model)
	h := ex.w.Header()
	h.Set(QueuedHeader, strconv.FormatInt(waited.Milliseconds(), 10))
	ex.rt.retry.Set(h, ex.model, ex.rt.queueAhead(ex.model))
	ex.writeError(ex.rt.cfg.ShedStatus, typeServiceUnavailable, msg)
}

// decideAgain takes the decision of a request released from the queue, as
// for a request that never queued (contract §7, §15, §7c).
func (ex *exchange) decideAgain() ([]events.WorkerEntry, bool) {
	rt := ex.rt
	registered := rt.cfg.Registry.Endpoints(ex.model)
	if len(registered) == 0 {
		ex.code = http.StatusServiceUnavailable
		rt.writeNoWorkers(ex.w, ex.model, "no worker is registered")
		return nil, false
	}
	d := rt.cfg.BusyList.DecideClass(ex.model, ex.class)
	cands := d.Candidates(nil, registered)
	if d.Admit && len(cands) == 0 {
		d = rt.unroutable(ex.model, d, registered)
	}
	ex.decision, ex.registered = d, registered
	rt.admission.Observe(ex.model, d)
	if !d.Admit {
		ex.code = rt.reject.RejectStatus(d)
		rt.reject.RejectModel(ex.w, ex.model, rt.queueAhead(ex.model), d)
		return nil, false
	}
	return cands, true
}

// queuesAnswer is the answer of GET /queues.
type queuesAnswer struct {
	Enabled     bool            `json:"enabled"`
	MaxWaitMs   int64           `json:"max_wait_ms"`
	MaxRequests int             `json:"max_requests"`
	PaceMs      float64         `json:"pace_ms"`
	Models      []QueueSnapshot `json:"models"`
}

// serveQueues answers GET /queues: each model's queue by class and tenant.
func (rt *Router) serveQueues(w http.ResponseWriter, _ *http.Request) {
	a := queuesAnswer{Models: []QueueSnapshot{}}
	if q := rt.queue; q != nil {
		a.Enabled, a.MaxWaitMs, a.MaxRequests = true, q.maxWait.Milliseconds(), q.maxRequests
		a.PaceMs = float64(q.pace) / float64(time.Millisecond)
		a.Models = q.snapshot(time.Now())
	}
	body, err := json.Marshal(a)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "internal_error", err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}
