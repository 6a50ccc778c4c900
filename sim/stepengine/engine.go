// Package stepengine simulates one data-parallel rank of an LLM inference
// engine step by step, the way vLLM V1's scheduler runs it
// (vllm/v1/core/sched/scheduler.py), so that admitting more slows everyone
// down as it does on a GPU. It is pure: no network, no goroutine, no clock;
// the caller passes the time in and drives the steps.
//
// # A step
//
// Each step has a token budget, Config.MaxBatchedTokens. The running
// requests are scheduled first, in the order they were admitted: one that
// decodes takes 1 token, one still prefilling takes its next chunk (what is
// left of its prompt, at most the budget left). The waiting requests follow,
// first come first served, while the budget, Config.MaxNumSeqs and the KV
// cache allow (no watermark, as V1's default).
//
// KV blocks are taken on demand: a request holds ceil(context tokens /
// block size) blocks, its context being the tokens computed so far. When a
// running request needs a block and none is free, the most recently admitted
// running request is preempted: its blocks are freed and it goes back to the
// head of the waiting queue, to compute its prompt (and the tokens it had
// generated) again. A step that preempted admits nothing from the waiting
// queue. A request's first token comes from the step that finishes its
// prefill, and each later step that runs it yields one more token. A
// request finishes at its max tokens, or earlier at the output it was added
// with (AddUntil), as an end-of-sequence token ends it: the scheduler never
// reads that output, it only stops the request there.
//
// A step lasts Config.StepTime: t_base + c_prefill × prefill tokens +
// c_decode × decoding requests + c_ctx × context tokens read.
//
// # Time
//
// Steps end at scheduled times: Begin computes the step's end from its
// start, the caller waits until then (a timer on the wall clock) and calls
// End, which stamps the step's tokens with that end. While there is work the
// next step starts at the previous end, not when the caller got round to it,
// so a stall of the host delays the delivery of tokens but does not lengthen
// the simulated steps (and the steps that catch up admit no request that
// arrived after they began); an idle engine starts its next step when
// asked.
//
// An Engine is not safe for concurrent use: one goroutine owns it.
package stepengine

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

var (
	// ErrInvalidConfig: a Config field is out of range.
	ErrInvalidConfig = errors.New("invalid configuration")
	// ErrTooLong: a request's prompt and max_tokens do not fit in the KV
	// cache even alone.
	ErrTooLong = errors.New("request does not fit in the KV cache")
	// ErrUnknownProfile: no engine profile has that name.
	ErrUnknownProfile = errors.New("unknown engine profile")
)

// State is where a request is in the engine.
type State uint8

// States of a Request.
const (
	// StateWaiting: in the waiting queue (new, or preempted).
	StateWaiting State = iota + 1
	// StateRunning: admitted, prefilling or decoding.
	StateRunning
	// StateFinished: all its max_tokens generated, or its output
	// (AddUntil).
	StateFinished
	// StateCancelled: cancelled before it finished.
	StateCancelled
)

// String returns "waiting", "running", "finished" or "cancelled".
func (s State) String() string {
	switch s {
	case StateWaiting:
		return "waiting"
	case StateRunning:
		return "running"
	case StateFinished:
		return "finished"
	case StateCancelled:
		return "cancelled"
	}
	return "unknown"
}

// Request is one completion request in an Engine. Its methods read what the
// engine has done with it; they are safe only on the engine's goroutine.
type Request struct {
	prompt      int
	maxTokens   int
	stop        int // output at which it ends (AddUntil), at most maxTokens
	output      int // tokens generated
	computed    int // tokens whose KV is in the cache
	blocks      int // KV blocks held
	scheduled   int // tokens scheduled in the current step
	preemptions int
	state       State
	arrival     time.Time
	lastToken   time.Time
}

// Prompt returns the request's prompt tokens.
func (r *Request) Prompt() int { return r.prompt }

// MaxTokens returns the tokens the request generates before it finishes.
func (r *Request) MaxTokens() int { return r.maxTokens }

// Stopped reports whether the request finished at the output it was added
// with (AddUntil), as an end-of-sequence token ends a request, rather than
// at its max tokens.
func (r *Request) Stopped() bool { return r.state == StateFinished && r.stop > 0 }

// Output returns the tokens generated so far.
func (r *Request) Output() int { return r.output }

// Blocks returns the KV blocks the request holds.
func (r *Request) Blocks() int { return r.blocks }

// Preemptions returns how many times the request was preempted.
func (r *Request) Preemptions() int { return r.preemptions }

// State returns where the request is.
func (r *Request) State() State { return r.state }

// Arrival returns when the request was added.
func (r *Request) Arrival() time.Time { return r.arrival }

// tokens returns the tokens of the request's sequence: its prompt and what it
// has generated.
func (r *Request) tokens() int { return r.prompt + r.output }

// decoding reports whether the request's next computation is one decode
// token (rather than a prefill, or a recomputation after a preemption).
func (r *Request) decoding() bool { return r.output > 0 && r.tokens()-r.computed == 1 }

// prefillLeft returns the tokens the request still has to prefill (its
// recomputation after a preemption included); 0 once it decodes or is done.
func (r *Request) prefillLeft() int {
	if (r.state != StateWaiting && r.state != StateRunning) || r.decoding() {
		return 0
	}
	return r.tokens() - r.computed
}

// EventKind says what happened to a request.
type EventKind uint8

// Kinds of Event.
const (
	// EventToken: the request generated a token (Event.Token says which;
	// 1 is the first).
	EventToken EventKind = iota + 1
	// EventFinished: the request generated its last token (reported just
	// after that token's EventToken) and left the engine.
	EventFinished
	// EventPreempted: the request was preempted and went back to the
	// waiting queue.
	EventPreempted
)

// String returns "token", "finished" or "preempted".
func (k EventKind) String() string {
	switch k {
	case EventToken:
		return "token"
	case EventFinished:
		return "finished"
	case EventPreempted:
		return "preempted"
	}
	return "unknown"
}

// Event is something that happened to a request in a step.
type Event struct {
	Kind    EventKind
	Request *Request
	// At is when it happened: the step's end for a token or a finish, its
	// start for a preemption.
	At time.Time
	// Token is the index of the token generated, from 1 (EventToken).
	Token int
	// Latency is, for the first token, the time to first token (from the
	// request's arrival); for a later token, the inter-token latency (from
	// the request's previous token); for EventFinished, the end-to-end
	// latency. These are what vLLM's histograms observe.
	Latency time.Duration
}

// First reports whether e is a request's first token.
func (e Event) First() bool { return e.Kind == EventToken && e.Token == 1 }

// Load is a snapshot of a rank's load and counters.
type Load struct {
	// Waiting and Running are the requests in each queue
	// (vllm:num_requests_waiting, vllm:num_requests_running).
	Waiting, Running int
	// BlocksUsed is the KV blocks held (active_decode_blocks); KVBlocks the
	// cache's size (kv_total_blocks).
	BlocksUsed, KVBlocks int
	// PrefillTokens is the tokens still to prefill of the waiting and
	// running requests, recomputation after preemptions included
	// (active_prefill_tokens).
	PrefillTokens int
	// Preemptions counts the preemptions so far
	// (vllm:num_preemptions_total).
	Preemptions uint64
	// PrefilledTokens counts the prompt tokens computed so far,
	// recomputation after preemptions included (prefilled_tokens).
	PrefilledTokens uint64
}

// Engine is one simulated rank.
type Engine struct {
	cfg         Config
	waiting     queue
	running     []*Request // in admission order
	free        int        // KV blocks free
	prefill     int        // tokens to prefill, see Load.PrefillTokens
	preemptions uint64
	prefilled   uint64 // see Load.PrefilledTokens

	batch    []*Request // the current (or last) step's requests
	events   []Event
	inStep   bool
	end      time.Time // end of the current or last step
	catchUp  bool      // work was left at end: the next step starts there
	lastPlan Plan
}

// New returns an idle Engine of cfg.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Engine{cfg: cfg, free: cfg.KVBlocks}, nil
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// Add queues a request of prompt prompt tokens that generates maxTokens
// tokens, arriving at now. Both are at least 1 (smaller values count as 1).
// It fails with ErrTooLong when the request could not fit in the KV cache
// even alone.
func (e *Engine) Add(now time.Time, prompt, maxTokens int) (*Request, error) {
	return e.AddUntil(now, prompt, maxTokens, 0)
}

// AddUntil queues a request as Add does that ends after output tokens, as
// an end-of-sequence token would end it (Request.Stopped); output is
// capped at maxTokens, and 0 (or less) means at maxTokens, as Add. Only the
// end of the request reads output: the scheduler and CommittedBlocks know
// only the prompt and maxTokens, as a real engine does.
func (e *Engine) AddUntil(now time.Time, prompt, maxTokens, output int) (*Request, error) {
	prompt, maxTokens = max(1, prompt), max(1, maxTokens)
	// Compared without the sum, which overflows for a max_tokens near the
	// largest int (and was then accepted, to preempt everyone for ever).
	if limit := e.cfg.MaxRequestTokens(); prompt > limit || maxTokens > limit-prompt {
		return nil, fmt.Errorf("stepengine: add request: %d prompt + %d max tokens exceeds %d: %w", prompt, maxTokens, limit, ErrTooLong)
	}
	r := &Request{prompt: prompt, maxTokens: maxTokens, stop: min(max(0, output), maxTokens), state: StateWaiting, arrival: now}
	e.waiting.pushBack(r)
	e.prefill += r.prefillLeft()
	return r, nil
}

// Cancel removes a waiting or running request and frees its blocks; it
// reports whether the request was in the engine. A request cancelled during
// a step yields nothing at the step's end.
func (e *Engine) Cancel(r *Request) bool {
	switch r.state {
	case StateWaiting:
		e.waiting.remove(r)
	case StateRunning:
		e.running = slices.DeleteFunc(e.running, func(x *Request) bool { return x == r })
		e.free += r.blocks
		r.blocks = 0
	default:
		return false
	}
	e.prefill -= r.prefillLeft()
	r.scheduled = 0
	r.state = StateCancelled
	if !e.Busy() {
		e.catchUp = false // the next request starts a new busy period
	}
	return true
}

// Busy reports whether the engine has requests, waiting or running.
func (e *Engine) Busy() bool { return len(e.running) > 0 || e.waiting.len() > 0 }

// InStep reports whether a step has begun and not ended.
func (e *Engine) InStep() bool { return e.inStep }

// Load returns the engine's load now.
func (e *Engine) Load() Load {
	return Load{
		Waiting:         e.waiting.len(),
		Running:         len(e.running),
		BlocksUsed:      e.cfg.KVBlocks - e.free,
		KVBlocks:        e.cfg.KVBlocks,
		PrefillTokens:   e.prefill,
		Preemptions:     e.preemptions,
		PrefilledTokens: e.prefilled,
	}
}

// CommittedBlocks returns the KV blocks the waiting and running requests
// would hold together at their expected length (kv_committed_blocks,
// contract §21): the sum of ceil((prompt + expected output) / block size),
// the expected output being est.Expected(output so far, max tokens). It
// never reads a request's AddUntil output.
func (e *Engine) CommittedBlocks(est OutputEstimate) int {
	n := 0
	for _, r := range e.running {
		n += e.cfg.blocksFor(r.prompt + est.Expected(r.output, r.maxTokens))
	}
	for _, r := range e.waiting.items[e.waiting.head:] {
		n += e.cfg.blocksFor(r.prompt + est.Expected(r.output, r.maxTokens))
	}
	return n
}

// Plan is what a step computes.
type Plan struct {
	// Start and End bound the step.
	Start, End time.Time
	// Requests is the number of requests it runs; Decoding of them decode
	// one token, the others prefill PrefillTokens tokens in all.
	Requests, Decoding, PrefillTokens int
	// ContextTokens is the tokens it reads from the cache.
	ContextTokens int
	// Preempted is the number of requests it preempted.
	Preempted int
}

// LastPlan returns the plan of the current or last step.
func (e *Engine) LastPlan() Plan { return e.lastPlan }

// Begin schedules a step starting at now (at the previous step's end if the
// engine has been busy since, or if now is before it; at the first arrival
// if nothing runs) and returns when it ends; ok is false, and nothing
// happens, when the engine has no request. A step admits no request that
// arrived after it began, so a caller catching up after a stall never
// yields a token before its request arrived. The step's preemptions are
// reported by End. Begin during a step only returns the step's end.
func (e *Engine) Begin(now time.Time) (end time.Time, ok bool) {
	if e.inStep {
		return e.end, true
	}
	if !e.Busy() {
		e.catchUp = false
		return time.Time{}, false
	}
	start := now
	if e.catchUp || start.Before(e.end) {
		start = e.end
	}
	if len(e.running) == 0 {
		// Nothing runs before the first waiting request arrives.
		if a := e.waiting.front().arrival; start.Before(a) {
			start = a
		}
	}
	e.events = e.events[:0]
	e.batch = e.batch[:0]
	p := Plan{Start: start}
	budget := e.cfg.MaxBatchedTokens

	// Running requests first, in admission order.
	for i := 0; i < len(e.running) && budget > 0; {
		r := e.running[i]
		n := min(r.tokens()-r.computed, budget)
		scheduled := true
		for !e.allocate(r, n) {
			victim := e.running[len(e.running)-1]
			e.running = e.running[:len(e.running)-1]
			e.preempt(victim, start)
			p.Preempted++
			if victim == r {
				scheduled = false
				break
			}
		}
		if !scheduled {
			break
		}
		e.schedule(r, n, &p)
		budget -= n
		i++
	}
	// Then the waiting ones, unless this step preempted.
	for p.Preempted == 0 && budget > 0 && e.waiting.len() > 0 && len(e.running) < e.cfg.MaxNumSeqs {
		r := e.waiting.front()
		if r.arrival.After(start) {
			break // it arrived after the step began (the caller is catching up)
		}
		n := min(r.tokens()-r.computed, budget)
		if !e.allocate(r, n) {
			break
		}
		e.waiting.popFront()
		r.state = StateRunning
		e.running = append(e.running, r)
		e.schedule(r, n, &p)
		budget -= n
	}
	p.End = start.Add(e.cfg.StepTime(p.PrefillTokens, p.Decoding, p.ContextTokens))
	e.lastPlan = p
	e.end = p.End
	e.inStep = true
	return p.End, true
}

// End completes the step begun: each request it ran has its tokens computed,
// and yields a token when that finishes its sequence so far; a request with
// all its tokens leaves the engine. It returns the step's events, valid
// until the next Begin: preemptions first, then per request its token and
// its finish. End outside a step returns nothing.
func (e *Engine) End() []Event {
	if !e.inStep {
		return nil
	}
	e.inStep = false
	at := e.end
	finished := false
	for _, r := range e.batch {
		if r.state != StateRunning || r.scheduled == 0 {
			continue // cancelled during the step
		}
		e.prefill -= r.prefillLeft()
		if !r.decoding() {
			e.prefilled += uint64(r.scheduled) // a prefill chunk, or a recomputation
		}
		r.computed += r.scheduled
		r.scheduled = 0
		if r.computed == r.tokens() {
			r.output++
			ev := Event{Kind: EventToken, Request: r, At: at, Token: r.output}
			if r.output == 1 {
				ev.Latency = at.Sub(r.arrival)
			} else {
				ev.Latency = at.Sub(r.lastToken)
			}
			r.lastToken = at
			e.events = append(e.events, ev)
			if r.output == r.maxTokens || r.output == r.stop {
				e.free += r.blocks
				r.blocks = 0
				r.state = StateFinished
				finished = true
				e.events = append(e.events, Event{Kind: EventFinished, Request: r, At: at, Latency: at.Sub(r.arrival)})
			}
		}
		e.prefill += r.prefillLeft()
	}
	if finished {
		e.running = slices.DeleteFunc(e.running, func(r *Request) bool { return r.state == StateFinished })
	}
	e.catchUp = e.Busy()
	return e.events
}

// Step runs one whole step from now: Begin, then End at once. It suits
// simulations that jump from step to step; ok is false when the engine has
// no request.
func (e *Engine) Step(now time.Time) (end time.Time, events []Event, ok bool) {
	end, ok = e.Begin(now)
	if !ok {
		return end, nil, false
	}
	return end, e.End(), true
}

// allocate gives r the blocks to hold n more tokens and reports whether
// there were enough free.
func (e *Engine) allocate(r *Request, n int) bool {
	need := e.cfg.blocksFor(r.computed+n) - r.blocks
	if need <= 0 {
		return true
	}
	if need > e.free {
		return false
	}
	e.free -= need
	r.blocks += need
	return true
}

// schedule adds n tokens of r to the step of plan p.
func (e *Engine) schedule(r *Request, n int, p *Plan) {
	r.scheduled = n
	e.batch = append(e.batch, r)
	p.Requests++
	if r.decoding() {
		p.Decoding++
	} else {
		p.PrefillTokens += n
	}
	p.ContextTokens += r.computed
}

// preempt sends running request r, already out of the running list, back to
// the head of the waiting queue with its blocks freed.
func (e *Engine) preempt(r *Request, at time.Time) {
	e.prefill -= r.prefillLeft()
	e.free += r.blocks
	r.blocks = 0
	r.computed = 0
	r.scheduled = 0
	r.state = StateWaiting
	r.preemptions++
	e.preemptions++
	e.prefill += r.prefillLeft()
	e.waiting.pushFront(r)
	e.events = append(e.events, Event{Kind: EventPreempted, Request: r, At: at})
}

// queue is a FIFO of requests that can also take one at its head.
type queue struct {
	items []*Request
	head  int
}

func (q *queue) len() int { return len(q.items) - q.head }

func (q *queue) front() *Request { return q.items[q.head] }

func (q *queue) pushBack(r *Request) { q.items = append(q.items, r) }

func (q *queue) pushFront(r *Request) {
	if q.head > 0 {
		q.head--
		q.items[q.head] = r
		return
	}
	q.items = slices.Insert(q.items, 0, r)
}

func (q *queue) popFront() {
	q.items[q.head] = nil
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	} else if q.head > 64 && q.head > len(q.items)/2 {
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items, q.head = q.items[:n], 0
	}
}

func (q *queue) remove(r *Request) {
	i := slices.Index(q.items[q.head:], r)
	if i < 0 {
		return
	}
	q.items = slices.Delete(q.items, q.head+i, q.head+i+1)
}
