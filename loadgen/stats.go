package loadgen

import (
	"maps"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/workermon/workermon/admission"
)

// windowSlots is the number of slots the window is kept in; the window
// moves one slot at a time.
const windowSlots = 10

// Latency histogram: bucket 0 holds everything up to histMin, bucket i the
// latencies up to histMin×histGrowth^i; the last bucket holds the rest. A
// percentile is its bucket's upper bound (at most 5% high), never above the
// largest latency seen.
const (
	histMin     = 100 * time.Microsecond
	histGrowth  = 1.05
	histBuckets = 340 // up to about 1,500 s
)

// Stats is a snapshot of a Generator's counters.
type Stats struct {
	// Elapsed is the time since Run started (until it returned, once it
	// has).
	Elapsed time.Duration
	// TargetRPS is the rate the profile asks for now.
	TargetRPS float64
	// InFlight is the number of requests waiting for their answer.
	InFlight int
	// Total counts everything since Run started.
	Total Counts
	// Window counts the last Config.Window (the span moves in tenths of it).
	Window Counts
	// Statuses counts every HTTP status received since Run started.
	Statuses map[int]uint64
	// Classes counts by priority class, for the classes of
	// Config.PriorityMix (in the order sheddable, standard, critical);
	// empty without a mix.
	Classes []ClassStats
}

// ClassStats are the counts of one priority class.
type ClassStats struct {
	Class admission.Class
	// Total and Window are as Stats's, for the requests of the class.
	Total, Window Counts
	// Statuses counts every HTTP status the class received.
	Statuses map[int]uint64
}

// Counts are the outcomes of the requests of a span of time. Requests are
// counted as sent when they start and by outcome when they end.
type Counts struct {
	// Duration is the span covered.
	Duration time.Duration
	// Sent is the number of requests started.
	Sent uint64
	// Attempts is the number of times requests were sent, retries
	// included (Config.Retries), counted when the request ends. The
	// outcomes below count attempts: a request retried after a 503 and
	// then served counts once in Unavailable and once in OK.
	Attempts uint64
	// Failed is the number of requests whose last attempt got no 200
	// answer (Sample.Failed).
	Failed uint64
	// OK is the number of 200 answers received in full.
	OK uint64
	// Unavailable is the number of 503 answers (the router's rejection).
	Unavailable uint64
	// TooMany is the number of 429 answers (the router's rejection of a
	// sheddable request, contract §15).
	TooMany uint64
	// OtherStatus is the number of answers with any other status.
	OtherStatus uint64
	// Errors is the number of attempts that failed: transport errors,
	// timeouts, streams cut before [DONE] or carrying an error event.
	Errors uint64
	// Cancelled is the number of requests the client cancelled on purpose
	// (Config.CancelFraction).
	Cancelled uint64
	// Dropped is the number of requests not sent because Config.Concurrency
	// requests were in flight.
	Dropped uint64
	// Aborted is the number of requests cut off because Run ended.
	Aborted uint64
	// Latency is the time to the end of the answer of the OK requests.
	Latency Latency
	// TTFT is the time to the first token of the OK requests: to the
	// first data event with text of a stream, to the whole answer
	// otherwise.
	TTFT Latency
	// Good is the number of requests that met Config.SLO (Result.Good).
	// In a window, those that ended in it, as every outcome.
	Good uint64
	// TPOT is the time per output token of the OK streams of 2 tokens or
	// more.
	TPOT Latency
	// Queued is the number of answers that waited in a router's queue
	// (X-Workermon-Queued), and QueueWait their waits.
	Queued    uint64
	QueueWait Latency
}

// RPS returns the rate of requests sent over the span.
func (c Counts) RPS() float64 {
	if c.Duration <= 0 {
		return 0
	}
	return float64(c.Sent) / c.Duration.Seconds()
}

// Latency summarizes the latencies of a span.
type Latency struct {
	Count         uint64
	P50, P90, P99 time.Duration
	Max           time.Duration
}

// outcome is how a request ended.
type outcome uint8

const (
	outOK outcome = iota
	outUnavailable
	outTooMany
	outOther
	outError
	outCancelled
	outAborted
)

// counters are the counts of a span, without latencies.
type counters struct {
	sent, ok, unavailable, tooMany, other, errors, cancelled, dropped, aborted uint64
	good, queued, attempts, failed                                             uint64
}

func (c *counters) add(o counters) {
	c.sent += o.sent
	c.ok += o.ok
	c.unavailable += o.unavailable
	c.tooMany += o.tooMany
	c.other += o.other
	c.errors += o.errors
	c.cancelled += o.cancelled
	c.dropped += o.dropped
	c.aborted += o.aborted
	c.good += o.good
	c.queued += o.queued
	c.attempts += o.attempts
	c.failed += o.failed
}

func (c *counters) count(o outcome) {
	switch o {
	case outOK:
		c.ok++
	case outUnavailable:
		c.unavailable++
	case outTooMany:
		c.tooMany++
	case outOther:
		c.other++
	case outError:
		c.errors++
	case outCancelled:
		c.cancelled++
	case outAborted:
		c.aborted++
	}
}

// histogram counts latencies in log-spaced buckets.
type histogram struct {
	buckets [histBuckets]uint64
	n       uint64
	max     time.Duration
}

var logGrowth = math.Log(histGrowth)

func (h *histogram) add(d time.Duration) {
	i := 0
	if d > histMin {
		i = min(histBuckets-1, int(math.Ceil(math.Log(float64(d)/float64(histMin))/logGrowth)))
	}
	h.buckets[i]++
	h.n++
	h.max = max(h.max, d)
}

func (h *histogram) merge(o *histogram) {
	for i, c := range o.buckets {
		h.buckets[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// quantile returns the latency below which a fraction q of them lie.
func (h *histogram) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	var cum uint64
	for i, c := range h.buckets {
		cum += c
		if cum >= rank {
			if i == histBuckets-1 {
				return h.max // the last bucket has no upper bound
			}
			upper := time.Duration(float64(histMin) * math.Pow(histGrowth, float64(i)))
			return min(upper, h.max)
		}
	}
	return h.max
}

func (h *histogram) summary() Latency {
	return Latency{Count: h.n, P50: h.quantile(0.5), P90: h.quantile(0.9), P99: h.quantile(0.99), Max: h.max}
}

// latencies are the histograms of a span.
type latencies struct {
	e2e, ttft, tpot, wait histogram
}

func (l *latencies) merge(o *latencies) {
	l.e2e.merge(&o.e2e)
	l.ttft.merge(&o.ttft)
	l.tpot.merge(&o.tpot)
	l.wait.merge(&o.wait)
}

// add counts the latencies of a request that ended with o.
func (l *latencies) add(o outcome, d done) {
	if d.queued {
		l.wait.add(d.queueWait)
	}
	if o != outOK {
		return
	}
	l.e2e.add(d.res.E2E)
	l.ttft.add(d.ttft())
	if tpot, ok := d.res.TPOT(); ok {
		l.tpot.add(tpot)
	}
}

// done is a request that ended, or one of its attempts that was retried.
type done struct {
	class     int // noClass: none
	o         outcome
	start     time.Time // when it was sent
	res       Result
	good      bool
	queued    bool          // this attempt waited in a router's queue
	queueWait time.Duration // this attempt's wait
	attempts  int           // the request's attempts
	anyQueued bool          // an attempt waited in a router's queue
	waited    time.Duration // the attempts' waits in the queue
	tries     []Try         // the request's attempts so far
}

// failed reports whether the request's last attempt got no 200 answer:
// a rejection, another status, or an error without a 200. Cancelled and
// aborted requests are not failed: the client cut them.
func (d done) failed() bool {
	switch d.o {
	case outUnavailable, outTooMany, outOther:
		return true
	case outError:
		return d.res.Status != http.StatusOK
	}
	return false
}

// ttft returns the time to first token of an OK request: to the first
// chunk with text of a stream, the whole answer otherwise.
func (d done) ttft() time.Duration {
	if d.res.Stream && d.res.Tokens > 0 {
		return d.res.TTFT
	}
	return d.res.E2E
}

// slot is one tenth of the window.
type slot struct {
	epoch   int64 // index of the slot since the start; -1 when unused
	c       counters
	l       latencies
	classes [admission.NumClasses]counters
}

// noClass is the class of a request sent without a priority mix.
const noClass = -1

// classRec is what the recorder keeps of a priority class.
type classRec struct {
	total    counters
	l        latencies
	statuses map[int]uint64
}

// recorder keeps the counts of a run. Its methods are safe for concurrent
// use.
type recorder struct {
	window  time.Duration
	slotDur time.Duration

	mu       sync.Mutex
	start    time.Time // zero before Run
	end      time.Time // zero while running
	target   float64
	inFlight int
	total    counters
	l        latencies
	statuses map[int]uint64
	slots    [windowSlots]slot
	classes  [admission.NumClasses]*classRec // nil for a class not in the mix
}

// useClass makes the recorder count class c. Called before Run.
func (r *recorder) useClass(c admission.Class) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.classes[c] == nil {
		r.classes[c] = &classRec{statuses: map[int]uint64{}}
	}
}

func newRecorder(window time.Duration) *recorder {
	r := &recorder{window: window, slotDur: window / windowSlots, statuses: map[int]uint64{}}
	for i := range r.slots {
		r.slots[i].epoch = -1
	}
	return r
}

// begin marks the start of the run.
func (r *recorder) begin(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.start = now
}

// finish marks the end of the run: of the load when it has a Duration
// (the first call counts), the rates' span.
func (r *recorder) finish(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.end.IsZero() {
		r.end = now
	}
}

// slotAt returns the slot of now, emptied if it held an older span. r.mu is
// held.
func (r *recorder) slotAt(now time.Time) *slot {
	e := int64(max(0, now.Sub(r.start)) / r.slotDur)
	s := &r.slots[e%windowSlots]
	if s.epoch != e {
		*s = slot{epoch: e}
	}
	return s
}

func (r *recorder) setTarget(rps float64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.target = rps
}

// sent counts a request of class (noClass: none) started at now.
func (r *recorder) sent(now time.Time, class int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inFlight++
	r.total.sent++
	s := r.slotAt(now)
	s.c.sent++
	if class != noClass && r.classes[class] != nil {
		r.classes[class].total.sent++
		s.classes[class].sent++
	}
}

// dropped counts a request of class not sent at now.
func (r *recorder) dropped(now time.Time, class int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total.dropped++
	s := r.slotAt(now)
	s.c.dropped++
	if class != noClass && r.classes[class] != nil {
		r.classes[class].total.dropped++
		s.classes[class].dropped++
	}
}

// done counts a request that ended at now with d.res.Status (0 without an
// answer), in the window of its end as every outcome is: credited to its
// arrival, a good request would count only once ended, and the live window
// would leave out every arrival of its last request duration (40 % of the
// rate with 3 s requests in a 5 s window). The totals are by arrival
// anyway: every request counted arrived in the run.
func (r *recorder) done(now time.Time, d done) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inFlight--
	r.attempt(now, d, true)
}

// retried counts an attempt of a request, ended at now, that is sent
// again: its outcome and status, not the request.
func (r *recorder) retried(now time.Time, class int, d done) {
	d.class, d.good = class, false
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempt(now, d, false)
}

// attempt counts an attempt that ended at now; last: the request's last,
// which counts the request too. r.mu is held.
func (r *recorder) attempt(now time.Time, d done, last bool) {
	var c counters
	c.count(d.o)
	if d.queued {
		c.queued++
	}
	if last {
		c.attempts = uint64(d.attempts)
		if d.good {
			c.good++
		}
		if d.failed() {
			c.failed++
		}
	}
	s := r.slotAt(now)
	r.total.add(c)
	s.c.add(c)
	status := d.res.Status
	if status != 0 {
		r.statuses[status]++
	}
	r.l.add(d.o, d)
	s.l.add(d.o, d)
	class := d.class
	if class == noClass || r.classes[class] == nil {
		return
	}
	cr := r.classes[class]
	cr.total.add(c)
	s.classes[class].add(c)
	if status != 0 {
		cr.statuses[status]++
	}
	cr.l.add(d.o, d)
}

// stats returns a snapshot at now.
func (r *recorder) stats(now time.Time) Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.start.IsZero() {
		return Stats{Statuses: map[int]uint64{}}
	}
	if !r.end.IsZero() {
		now = r.end
	}
	elapsed := max(0, now.Sub(r.start))
	st := Stats{
		Elapsed:   elapsed,
		TargetRPS: r.target,
		InFlight:  r.inFlight,
		Total:     r.total.counts(elapsed, &r.l),
		Statuses:  maps.Clone(r.statuses),
	}
	cur := int64(elapsed / r.slotDur)
	first := max(0, cur-windowSlots+1)
	span := elapsed - time.Duration(first)*r.slotDur
	var c counters
	var l latencies
	var classes [admission.NumClasses]counters
	for i := range r.slots {
		s := &r.slots[i]
		if s.epoch >= first && s.epoch <= cur {
			c.add(s.c)
			l.merge(&s.l)
			for k := range classes {
				classes[k].add(s.classes[k])
			}
		}
	}
	st.Window = c.counts(span, &l)
	for _, k := range admission.Classes() { // sheddable, standard, critical
		cr := r.classes[k]
		if cr == nil {
			continue
		}
		st.Classes = append(st.Classes, ClassStats{
			Class:    k,
			Total:    cr.total.counts(elapsed, &cr.l),
			Window:   classes[k].counts(span, &latencies{}),
			Statuses: maps.Clone(cr.statuses),
		})
	}
	return st
}

// counts returns c with l's latencies over a span of d.
func (c counters) counts(d time.Duration, l *latencies) Counts {
	return Counts{
		Duration:    d,
		Sent:        c.sent,
		Attempts:    c.attempts,
		Failed:      c.failed,
		OK:          c.ok,
		Unavailable: c.unavailable,
		TooMany:     c.tooMany,
		OtherStatus: c.other,
		Errors:      c.errors,
		Cancelled:   c.cancelled,
		Dropped:     c.dropped,
		Aborted:     c.aborted,
		Latency:     l.e2e.summary(),
		TTFT:        l.ttft.summary(),
		Good:        c.good,
		TPOT:        l.tpot.summary(),
		Queued:      c.queued,
		QueueWait:   l.wait.summary(),
	}
}
