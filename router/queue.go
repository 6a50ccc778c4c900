package router

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/flow"
	"github.com/workermon/workermon/internal/promreg"
)

// This file holds flow control (contract §17): a request whose class has no
// candidate waits in its model's queue instead of being rejected at once,
// and is sent when a worker frees, each router handing a freed worker at
// most one queued request per pace × the number of routers. Routers that
// queue as one (contract §22) also queue a newcomer while another router's
// queue holds a request of its priority or higher, and share the turns at a
// freed worker in proportion to what each holds (the record's queued_by);
// rq.go publishes this router's queues. The queue's order, tenants, limits
// and pacing are package flow's; this file wires them to the requests, the
// record and the clock.
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
	// DefaultQueueMaxBytes is how many bytes of request bodies the queues
	// of all models hold together: 64 bodies of DefaultMaxBodyBytes.
	DefaultQueueMaxBytes = 256 << 20
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
	queueEvicted    = "evicted"    // pushed out of a full queue, or turned away by one (requests or bytes)
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
	// priority, or of a tenant that holds fewer (flow.Queue.Join).
	verdictEvicted
)

// verdict is what the dispatcher (or an evicting newcomer) tells a waiter.
type verdict struct {
	kind   verdictKind
	worker events.WorkerEntry
	d      admission.Decision
	cands  []events.WorkerEntry // the dispatch's candidates, for retries
}

// ticket is what the router keeps of a queued request.
type ticket struct {
	class admission.Class
	done  chan verdict // buffered: the sender never blocks
}

// waiter is one queued request, in its model's flow.Queue.
type waiter = flow.Item[ticket]

// queueMetrics are the metrics of flow control.
type queueMetrics struct {
	depth     *prometheus.GaugeVec
	bytes     prometheus.Gauge
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
	bytes := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "workermon_router_queue_bytes",
		Help: "Bytes of request bodies waiting in the router's queues, all models together (bounded by --queue-max-bytes).",
	})
	if err := errors.Join(promreg.Shared(reg, &depth), promreg.Shared(reg, &wait), promreg.Shared(reg, &bytes)); err != nil {
		return nil, err
	}
	m := &queueMetrics{depth: depth, bytes: bytes, maxModels: maxModels, models: make(map[string]bool)}
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
	// others is what the other routers hold queued for model, by the
	// record, with their count at priority p (contract §22).
	others func(model string, p int64) busylist.QueuedOthers
	pick   func(cands []events.WorkerEntry) (events.WorkerEntry, bool)
}

// queueLimits are the settings of flow control (Config's Queue* fields).
type queueLimits struct {
	maxWait     time.Duration
	maxRequests int   // per model
	maxBytes    int64 // all models together
	pace        time.Duration
}

// queues are the Router's queues, one per model.
type queues struct {
	queueLimits
	deps    queueDeps
	metrics *queueMetrics
	budget  *flow.Budget // the bytes of every model's queue

	byModel atomic.Pointer[map[string]*modelQueue] // copied on write under mu
	mu      sync.Mutex

	closed      atomic.Bool   // set under mu; read under a modelQueue's mu by join
	stop        chan struct{} // closed by close: the dispatchers end
	dispatchers sync.WaitGroup
	// changed wakes the publisher of the queues (rq.go) after a change of
	// any model's queue; a send that would block is dropped.
	changed chan struct{}
}

func newQueues(l queueLimits, deps queueDeps, m *queueMetrics) *queues {
	if deps.others == nil {
		deps.others = func(string, int64) busylist.QueuedOthers { return busylist.QueuedOthers{} }
	}
	q := &queues{queueLimits: l, deps: deps, metrics: m, budget: flow.NewBudget(l.maxBytes), stop: make(chan struct{}),
		changed: make(chan struct{}, 1)}
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
	mq := &modelQueue{q: q, model: model, gauges: q.metrics.depthGauges(model),
		fq: flow.NewQueue[ticket](q.maxRequests, q.budget), pacer: flow.NewPacer(q.pace, nil)}
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
	// gen counts the changes of the queue, for its publisher (rq.go).
	gen atomic.Uint64

	mu      sync.Mutex
	fq      *flow.Queue[ticket]
	pacer   *flow.Pacer
	running bool // the dispatcher goroutine runs
}

// Errors of join.
var (
	errClosed = errors.New("router: the queues are closed")
)

// join queues a request of class c that arrives at now, as flow.Queue.Join
// says: it may go ahead of the queue (flow.ErrAhead), be refused
// (flow.ErrNoWait, flow.ErrFull), or join, pushing out others, who are
// told. Once the queues are closed, nothing joins (errClosed).
func (mq *modelQueue) join(a flow.Arrival, c admission.Class, now time.Time) (*waiter, error) {
	mq.mu.Lock()
	defer mq.mu.Unlock()
	if mq.q.closed.Load() {
		return nil, errClosed
	}
	w, victims, err := mq.fq.Join(a, ticket{class: c, done: make(chan verdict, 1)}, now)
	if err != nil {
		return nil, err
	}
	for _, v := range victims {
		mq.leftLocked(v)
		mq.q.metrics.wait[v.Value.class][queueEvicted].Observe(now.Sub(v.Since()).Seconds())
		v.Value.done <- verdict{kind: verdictEvicted}
	}
	mq.gauges[c].Inc()
	mq.q.metrics.bytes.Add(float64(w.Bytes()))
	mq.depth.Store(int64(mq.fq.Len()))
	mq.changedLocked()
	if !mq.running {
		mq.running = true
		mq.q.dispatchers.Add(1)
		go mq.run()
	}
	return w, nil
}

// leftLocked counts w out of the queue's gauges, once flow has taken it
// out.
func (mq *modelQueue) leftLocked(w *waiter) {
	mq.gauges[w.Value.class].Dec()
	mq.q.metrics.bytes.Sub(float64(w.Bytes()))
	mq.depth.Store(int64(mq.fq.Len()))
	mq.changedLocked()
}

// changedLocked counts a change of the queue and wakes its publisher
// (rq.go) without blocking.
func (mq *modelQueue) changedLocked() {
	mq.gen.Add(1)
	select {
	case mq.q.changed <- struct{}{}:
	default:
	}
}

// remove takes w out of the queue, when it is still in it.
func (mq *modelQueue) remove(w *waiter) bool {
	mq.mu.Lock()
	defer mq.mu.Unlock()
	if !mq.fq.Remove(w) {
		return false
	}
	mq.leftLocked(w)
	return true
}

// popLocked takes the head out and passes the turn to the next tenant.
func (mq *modelQueue) popLocked() *waiter {
	w := mq.fq.Pop()
	mq.leftLocked(w)
	return w
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
		if mq.fq.Len() > 0 {
			mq.dispatchLocked(time.Now())
		}
		if mq.fq.Len() == 0 {
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
	// Routers that queue as one (contract §22): the turns at a freed
	// worker go by the share of the head's priority this router holds.
	head := mq.fq.Head().Priority()
	others := deps.others(mq.model, head)
	interval := mq.pacer.Interval(flow.Share{Routers: deps.routers(mq.model), Own: mq.fq.CountAt(head),
		Others: int(min(others.AtP, math.MaxInt32)), Known: others.Known})
	mq.pacer.Expire(now, interval)
	for mq.fq.Len() > 0 {
		w := mq.fq.Head()
		d := deps.decide(mq.model, w.Value.class)
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
			return !mq.pacer.Ready(e.WorkerID, now, interval)
		})
		worker, ok := deps.pick(free)
		if !ok {
			return
		}
		mq.pacer.Handed(worker.WorkerID, now, interval)
		mq.popLocked()
		mq.q.metrics.wait[w.Value.class][queueDispatched].Observe(now.Sub(w.Since()).Seconds())
		w.Value.done <- verdict{kind: verdictDispatch, worker: worker, d: d, cands: cands}
	}
}

// releaseAllLocked lets every queued request go, in queue order.
func (mq *modelQueue) releaseAllLocked(now time.Time) {
	for mq.fq.Len() > 0 {
		w := mq.popLocked()
		mq.q.metrics.wait[w.Value.class][queueDispatched].Observe(now.Sub(w.Since()).Seconds())
		w.Value.done <- verdict{kind: verdictRelease}
	}
}

// QueueSnapshot is one model's queue in GET /queues.
type QueueSnapshot struct {
	Model string `json:"model"`
	Depth int    `json:"depth"`
	// Bytes is what the queued requests' bodies hold.
	Bytes int64 `json:"bytes"`
	// Classes are the queued requests by class, then by tenant ("" is the
	// default tenant).
	Classes map[string]ClassQueue `json:"classes"`
	// OldestMs is how long the oldest queued request has waited.
	OldestMs int64 `json:"oldest_ms"`
	// Others are the requests the other routers hold queued for the
	// model, by router source and then priority (in decimal), as a fresh
	// record states them (contract §22), and OthersDepth their number.
	Others      map[string]map[string]uint64 `json:"others"`
	OthersDepth uint64                       `json:"others_depth"`
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
		s := QueueSnapshot{Model: model, Depth: mq.fq.Len(), Bytes: mq.fq.Bytes(), Classes: map[string]ClassQueue{},
			Others: map[string]map[string]uint64{}}
		var oldest time.Time
		for w := range mq.fq.All() {
			class := w.Value.class.String()
			cq := s.Classes[class]
			if cq.Tenants == nil {
				cq.Tenants = map[string]int{}
			}
			cq.Depth++
			cq.Tenants[w.Tenant()]++
			s.Classes[class] = cq
			if oldest.IsZero() || w.Since().Before(oldest) {
				oldest = w.Since()
			}
		}
		mq.mu.Unlock()
		s.OldestMs = now.Sub(oldest).Milliseconds()
		out = append(out, s)
	}
	return out
}

// waits reports whether a request for model with decision d and headers qh
// goes through the queue (contract §17): flow control is on, and either the
// request may wait and its class has no candidate on a fresh record, or it
// is admitted and its model's queue holds requests (which an admitted
// request that may not wait must not overtake either: the queue answers
// it), or another router's queue holds one of its priority or higher by
// the record (contract §22, flow.Direct). Any other rejection (a stale
// record's, with fail-open off) is answered at once. nil-safe. With no
// queue holding anything it takes no lock and allocates nothing.
func (q *queues) waits(r *http.Request, model string, d admission.Decision, qh queueHeaders) bool {
	if q == nil {
		return false
	}
	if !d.Admit {
		return qh.maxWait != 0 && queueable(d)
	}
	if mq := q.lookup(model); mq != nil && mq.depth.Load() > 0 {
		return true
	}
	o := q.deps.others(model, 0)
	return o.N > 0 && !flow.Direct(priorityOf(r), flow.Held{}, flow.Held{N: 1, Top: o.Top})
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

// queued puts the request, whose body holds size bytes, in its model's
// queue and waits for its turn. It returns the candidates to send it to, or
// false when the request is answered (expired, evicted, refused by a full
// queue, rejected or gone).
func (ex *exchange) queued(d admission.Decision, cands []events.WorkerEntry, qh queueHeaders, size int64) ([]events.WorkerEntry, bool) {
	rt := ex.rt
	q := rt.queue
	wait := q.maxWait
	if qh.maxWait > 0 {
		wait = min(wait, qh.maxWait)
	}
	mq := q.forModel(ex.model)
	start := time.Now()
	p := priorityOf(ex.r)
	var others flow.Held
	if o := q.deps.others(ex.model, p); o.N > 0 {
		others = flow.Held{N: int(min(o.N, math.MaxInt32)), Top: o.Top}
	}
	w, err := mq.join(flow.Arrival{Priority: p, Tenant: qh.tenant, Bytes: size,
		Admitted: d.Admit, MayWait: qh.maxWait != 0, Others: others}, ex.class, start)
	switch {
	case errors.Is(err, flow.ErrAhead):
		rt.admission.Observe(ex.model, d)
		return cands, true
	case errors.Is(err, errClosed):
		// The router is closing: decided as without flow control.
		return ex.decideAgain()
	case errors.Is(err, flow.ErrNoWait):
		// Its wait of 0 ran out at once, behind the queue it may not
		// overtake.
		q.metrics.wait[ex.class][queueExpired].Observe(0)
		ex.queueReject(d, 0, expiredMessage(0, ex.model))
		return nil, false
	case errors.Is(err, flow.ErrFull):
		q.metrics.wait[ex.class][queueEvicted].Observe(0)
		ex.queueReject(d, time.Since(start), fullMessage(ex.model))
		return nil, false
	}
	rt.latency.queue(ex.model)

	timer := time.NewTimer(wait)
	defer timer.Stop()
	var v verdict
	select {
	case v = <-w.Value.done:
	case <-ex.r.Context().Done():
		if mq.remove(w) {
			q.metrics.wait[ex.class][queueGone].Observe(time.Since(start).Seconds())
			ex.clientGone()
			return nil, false
		}
		v = <-w.Value.done
	case <-timer.C:
		if mq.remove(w) {
			waited := time.Since(start)
			q.metrics.wait[ex.class][queueExpired].Observe(waited.Seconds())
			ex.queueReject(d, waited, expiredMessage(waited, ex.model))
			return nil, false
		}
		v = <-w.Value.done
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
	MaxBytes    int64           `json:"max_bytes"`
	Bytes       int64           `json:"bytes"` // queued now, all models
	PaceMs      float64         `json:"pace_ms"`
	Models      []QueueSnapshot `json:"models"`
}

// serveQueues answers GET /queues: each model's queue by class and tenant.
func (rt *Router) serveQueues(w http.ResponseWriter, _ *http.Request) {
	a := queuesAnswer{Models: []QueueSnapshot{}}
	if q := rt.queue; q != nil {
		a.Enabled, a.MaxWaitMs, a.MaxRequests = true, q.maxWait.Milliseconds(), q.maxRequests
		a.MaxBytes, a.Bytes = q.maxBytes, q.budget.Used()
		a.PaceMs = float64(q.pace) / float64(time.Millisecond)
		a.Models = rt.withOthers(q.snapshot(time.Now()))
	}
	body, err := json.Marshal(a)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "internal_error", err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}
