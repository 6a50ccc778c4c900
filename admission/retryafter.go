package admission

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// When a rejected client should come back (contract §23). Every rejection
// carries retry-after-ms and Retry-After (whole seconds, at least 1), both
// from one estimate of when the model has a free slot again for this
// client, spread so that the clients of one burst do not all return at the
// same moment. The official OpenAI SDKs honour retry-after-ms first.
//
// The estimate, per model, from what the router itself sees:
//
//   - R, the rate at which the model's requests end (each end frees a
//     slot): an exponentially weighted average over about RetryRateWindow
//     of the requests this router (or Middleware) let through that have
//     ended;
//   - ahead, the requests waiting for a slot before this client (the
//     router's queue of the model; 0 for the Middleware);
//   - the slots already promised: every rejection is given the next slot
//     of a schedule that frees one slot every 1/R, and the schedule's
//     tail is kept.
//
// A client rejected at now is given the slot that starts at
//
//	start = max(now + floor, tail + 1/R, now + ahead/R), at most now + cap
//
// (floor: the router's --retry-after; cap: DefaultMaxRetryAfter), and told
// a uniform random point within it, start − now + u/R. A single rejection
// waits the floor and a fraction of a slot; a burst of n rejections is
// spread over the n/R seconds the model needs to free n slots, one client
// per slot, never denser than the model can serve them, starting at the
// floor (the slots before it go to the requests already queued or
// arriving); a full queue sends its rejections behind the queue. Random
// points within the slots keep the clients of several routers (each with
// its own schedule) from lining up. A wait past the cap is spread over the
// quarter below it. Before any request of the model has ended, R is
// unknown and the wait is the floor, spread over the quarter above it.
//
// A rejection allocates nothing: it reads a few atomic values of its
// model, found in a copy-on-write map, and moves the schedule's tail with a
// compare-and-swap; the average is refreshed at most every retryRefresh by
// whichever caller comes first; and the header values are taken from a
// table rendered at construction.

// RetryAfterMsHeader is the header that tells a rejected client how long to
// wait, in milliseconds; read before Retry-After by the official OpenAI
// SDKs.
const RetryAfterMsHeader = "Retry-After-Ms"

// Bounds and pace of the estimate.
const (
	// DefaultMaxRetryAfter caps the wait a rejection asks for: the
	// longest that every official OpenAI SDK honours (Node 60 s; Python
	// and Go 120 s, and they do not retry past it).
	DefaultMaxRetryAfter = 60 * time.Second
	// RetryRateWindow is the time constant of the average rate at which a
	// model's requests end.
	RetryRateWindow = 5 * time.Second
	// retryRefresh is how often a model's average is refreshed, at most.
	retryRefresh = 100 * time.Millisecond
	// retryMaxModels bounds the models with an estimate of their own;
	// beyond it they share one.
	retryMaxModels = 1024
)

// The table's grid: every 10 ms up to 1 s, then 1 % apart.
const (
	gridLinearStep = 10 * time.Millisecond
	gridLinear     = int(time.Second / gridLinearStep) // entries up to 1 s
	gridGrowth     = 1.01
)

// retryValue is one pre-rendered pair of header values.
type retryValue struct {
	ms, secs []string
	d        time.Duration
}

// RetryEstimator estimates when a model has a free slot again, for the
// retry headers of its rejections. Its methods are safe for concurrent
// use and allocate nothing but for the first request of a model. Build it
// with NewRetryEstimator.
type RetryEstimator struct {
	floor, ceiling time.Duration
	table          []retryValue
	logGrowth      float64
	now            func() time.Time
	seed           uint64
	draws          atomic.Uint64

	other  retryModel // the models beyond retryMaxModels
	total  retryModel // every model: for a rejection that names none
	models atomic.Pointer[map[string]*retryModel]
	mu     sync.Mutex // serializes the copies of models
}

// retryModel is one model's estimate.
type retryModel struct {
	ended atomic.Uint64 // requests ended
	tail  atomic.Int64  // Unix nanoseconds: the start of the last slot promised

	// Refreshed by one caller at a time, at most every retryRefresh.
	at      atomic.Int64  // Unix nanoseconds of the last refresh; 0: none yet
	counted atomic.Uint64 // ended at the last refresh
	rate    atomic.Uint64 // float64 bits: requests ended per second
	known   atomic.Bool   // a request has ended: rate means something
}

// NewRetryEstimator returns an estimator whose values are at least floor
// (positive).
func NewRetryEstimator(floor time.Duration) (*RetryEstimator, error) {
	if floor <= 0 {
		return nil, fmt.Errorf("%w: retry-after floor %v is not positive", ErrInvalidOption, floor)
	}
	e := &RetryEstimator{floor: floor, ceiling: max(DefaultMaxRetryAfter, floor), now: time.Now,
		seed: rand.Uint64(), logGrowth: math.Log(gridGrowth)}
	e.models.Store(&map[string]*retryModel{})
	// The grid reaches past the largest value: 1.25 × the floor or the cap.
	top := max(e.ceiling, floor+floor/4) + time.Second
	secs := map[int64][]string{}
	floorSecs := int64((floor + time.Second - 1) / time.Second)
	for i := 0; ; i++ {
		d := e.gridValue(i)
		ms := d.Milliseconds()
		s := max(1, floorSecs, (ms+500)/1000)
		if secs[s] == nil {
			secs[s] = []string{strconv.FormatInt(s, 10)}[:1:1]
		}
		// Full slice expressions: a later Header.Add must not write into
		// the shared arrays.
		e.table = append(e.table, retryValue{ms: []string{strconv.FormatInt(ms, 10)}[:1:1], secs: secs[s], d: d})
		if d > top {
			return e, nil
		}
	}
}

// gridValue is the i-th value of the table: (i+1) × 10 ms up to 1 s, then
// 1 % apart, in whole milliseconds.
func (e *RetryEstimator) gridValue(i int) time.Duration {
	if i < gridLinear {
		return time.Duration(i+1) * gridLinearStep
	}
	ms := math.Round(1000 * math.Pow(gridGrowth, float64(i-gridLinear+1)))
	return time.Duration(ms) * time.Millisecond
}

// index returns the first entry of the table at least secs seconds long
// (to within the rounding of a millisecond), the last one past the table.
func (e *RetryEstimator) index(secs float64) int {
	var i int
	if ms := secs * 1000; ms <= 1000 {
		i = max(0, int(math.Ceil(ms/10))-1)
	} else {
		i = gridLinear - 1 + int(math.Ceil(math.Log(ms/1000)/e.logGrowth-1e-9))
	}
	return min(i, len(e.table)-1)
}

// Floor returns the smallest value the estimator gives.
func (e *RetryEstimator) Floor() time.Duration { return e.floor }

// model returns model's estimate, creating it; "" is every model's.
func (e *RetryEstimator) model(model string) *retryModel {
	if model == "" {
		return &e.total
	}
	cur := *e.models.Load()
	if m := cur[model]; m != nil {
		return m
	}
	if len(cur) >= retryMaxModels {
		return &e.other // the map no longer grows: no lock
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	cur = *e.models.Load()
	if m := cur[model]; m != nil {
		return m
	}
	if len(cur) >= retryMaxModels {
		return &e.other
	}
	m := &retryModel{}
	m.at.Store(e.now().UnixNano())
	next := make(map[string]*retryModel, len(cur)+1)
	for k, v := range cur {
		next[k] = v
	}
	next[model] = m
	e.models.Store(&next)
	return m
}

// Done records that a request of model that was let through has ended: a
// slot of the model is free again.
func (e *RetryEstimator) Done(model string) {
	now := e.now().UnixNano()
	if m := e.model(model); m != &e.total {
		m.done(now)
	}
	e.total.done(now)
}

// done counts an end at now.
func (m *retryModel) done(now int64) {
	m.refresh(now) // first: a refresh at t counts the ends in [its last, t)
	m.ended.Add(1)
}

// refresh brings the average rate up to now, when retryRefresh has passed since the last refresh; of concurrent
// callers, one does it.
func (m *retryModel) refresh(now int64) {
	last := m.at.Load()
	if last == 0 {
		m.at.CompareAndSwap(0, now) // the first call starts the clock
		return
	}
	dt := time.Duration(now - last)
	if dt < retryRefresh || !m.at.CompareAndSwap(last, now) {
		return
	}
	secs := dt.Seconds()
	ended := m.ended.Load()
	n := ended - m.counted.Swap(ended)
	inst := float64(n) / secs
	rate := math.Float64frombits(m.rate.Load())
	switch {
	case m.known.Load():
		rate += (1 - math.Exp(-secs/RetryRateWindow.Seconds())) * (inst - rate)
	case n > 0:
		rate = inst
		m.known.Store(true)
	}
	m.rate.Store(math.Float64bits(rate))
}

// uniforms returns two independent uniform numbers in [0, 1), from a
// counter hashed with the estimator's seed (no lock, no allocation).
func (e *RetryEstimator) uniforms() (float64, float64) {
	z := e.seed + e.draws.Add(1)*0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	const unit = 1 << 24
	return float64(z>>40) / unit, float64(z&(unit-1)) / unit
}

// maxAhead bounds the requests ahead that count.
const maxAhead = 1 << 20

// next gives a rejected request of model ("" for one that names none),
// with ahead requests waiting before it, the next slot of the model's
// schedule, and returns the table entry of its wait.
func (e *RetryEstimator) next(model string, ahead int) *retryValue {
	m := e.model(model)
	now := e.now().UnixNano()
	m.refresh(now)
	u1, u2 := e.uniforms()
	rate := math.Float64frombits(m.rate.Load())
	if !m.known.Load() || !(rate > 0) {
		return &e.table[e.index(e.floor.Seconds()*(1+u1/4))]
	}
	floor, ceiling := int64(e.floor), int64(e.ceiling)
	// Capped before the conversion: a rate decayed to almost nothing gives
	// a slot past int64.
	slot := ceiling
	if s := float64(time.Second) / rate; s < float64(ceiling) {
		slot = int64(s)
	}
	queue := int64(min(max(ahead, 0), maxAhead)) * slot
	var start int64
	for {
		tail := m.tail.Load()
		start = min(max(now+floor, tail+slot, now+queue), now+ceiling)
		if m.tail.CompareAndSwap(tail, start) {
			break
		}
	}
	wait := float64(start-now) + u1*float64(slot)
	if wait > float64(ceiling) {
		wait = max(float64(ceiling)*(1-u2/4), float64(floor))
	}
	i := e.index(wait / float64(time.Second))
	if i > 0 && e.table[i].d > e.ceiling && e.table[i-1].d >= e.floor {
		i-- // the table's rounding up stays within the cap
	}
	return &e.table[i]
}

// Next gives a rejected request of model ("" for one that names none),
// with ahead requests waiting before it in the router's queue, the next
// slot of the model's schedule, and returns how long it should wait: the
// value of retry-after-ms.
func (e *RetryEstimator) Next(model string, ahead int) time.Duration { return e.next(model, ahead).d }

// SetFloor sets the headers of a 503 that no slot will end (a model with
// no worker): the floor, spread over the quarter above it.
func (e *RetryEstimator) SetFloor(h http.Header) {
	u, _ := e.uniforms()
	v := &e.table[e.index(e.floor.Seconds()*(1+u/4))]
	h[RetryAfterMsHeader] = v.ms
	h["Retry-After"] = v.secs
}

// Set gives a rejected request of model its slot (see Next) and sets
// RetryAfterMsHeader and Retry-After on h: whole seconds, rounded to the
// nearest, at least the floor rounded up and at least 1. It allocates nothing when h already has room for both.
func (e *RetryEstimator) Set(h http.Header, model string, ahead int) {
	v := e.next(model, ahead)
	h[RetryAfterMsHeader] = v.ms
	h["Retry-After"] = v.secs
}
