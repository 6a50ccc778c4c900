package sim

import (
	"slices"
	"sync/atomic"
)

// rankSpec is one rank's capacity and speed, skew applied.
type rankSpec struct {
	kvBlocks     int
	maxBatched   int
	prefillSpeed float64 // prompt tokens per second, per request
	decodeSpeed  float64 // tokens per second, per request
}

// phase is where a request is in the engine.
type phase uint8

const (
	phaseNew     phase = iota // not yet given to the engine
	phaseWaiting              // in its rank's queue
	phasePrefill              // admitted, prefilling its prompt
	phaseDecode               // generating
	phaseDone                 // finished or cancelled
)

// request is one completion request. promptTokens, maxTokens, notify and done
// are fixed at creation; produced is written by the engine and read by the
// HTTP handler; the rest belongs to the engine.
type request struct {
	promptTokens int
	maxTokens    int
	produced     atomic.Int64  // tokens generated so far
	notify       chan struct{} // a token was generated (capacity 1, never blocks the engine)
	done         chan struct{} // closed when all maxTokens are generated

	rank      int
	phase     phase
	reserve   int     // KV blocks reserved
	prefilled float64 // prompt tokens prefilled
	decoded   float64 // tokens generated, with the fraction of the next one
}

// newRequest returns a request for promptTokens tokens of prompt and
// maxTokens tokens to generate, both at least 1.
func newRequest(promptTokens, maxTokens int) *request {
	return &request{
		promptTokens: max(1, promptTokens),
		maxTokens:    max(1, maxTokens),
		notify:       make(chan struct{}, 1),
		done:         make(chan struct{}),
	}
}

// rankLoad is one rank's load as reported.
type rankLoad struct {
	decodeBlocks  uint64
	prefillTokens uint64
}

// rankState is one rank of the engine.
type rankState struct {
	spec     rankSpec
	waiting  []*request // first come, first served
	running  []*request // in prefill or decode
	reserved int        // KV blocks reserved by running
	wanted   int        // KV blocks the waiting requests will reserve
	batch    int        // prompt tokens in prefill
}

// engine is the scheduler of one worker's ranks. It is not safe for
// concurrent use: one goroutine owns it.
type engine struct {
	blockSize int
	ranks     []rankState
	completed uint64
	cancelled uint64
}

func newEngine(specs []rankSpec, blockSize int) *engine {
	e := &engine{blockSize: blockSize, ranks: make([]rankState, len(specs))}
	for i, s := range specs {
		e.ranks[i].spec = s
	}
	return e
}

// blocks returns the KV blocks that tokens tokens fill.
func (e *engine) blocks(tokens int) int { return (tokens + e.blockSize - 1) / e.blockSize }

// maxSequence returns the longest prompt+max_tokens that the largest rank
// can ever hold, in tokens.
func (e *engine) maxSequence() int {
	most := 0
	for _, r := range e.ranks {
		most = max(most, r.spec.kvBlocks)
	}
	return most * e.blockSize
}

// add assigns r to the least loaded rank that can ever hold it and queues
// it there, admitting what fits. It reports false when no rank can hold r.
func (e *engine) add(r *request) bool {
	r.reserve = e.blocks(r.promptTokens + r.maxTokens)
	best, bestLoad := -1, 0.0
	for i := range e.ranks {
		rk := &e.ranks[i]
		if r.reserve > rk.spec.kvBlocks {
			continue
		}
		load := float64(rk.reserved+rk.wanted) / float64(rk.spec.kvBlocks)
		if best < 0 || load < bestLoad {
			best, bestLoad = i, load
		}
	}
	if best < 0 {
		return false
	}
	rk := &e.ranks[best]
	r.rank, r.phase = best, phaseWaiting
	rk.waiting = append(rk.waiting, r)
	rk.wanted += r.reserve
	e.admit(rk)
	return true
}

// admit moves the head of rk's queue into prefill while the KV cache and the
// batch budget allow.
func (e *engine) admit(rk *rankState) {
	for len(rk.waiting) > 0 {
		r := rk.waiting[0]
		if rk.reserved+r.reserve > rk.spec.kvBlocks {
			return
		}
		if rk.batch > 0 && rk.batch+r.promptTokens > rk.spec.maxBatched {
			return
		}
		rk.waiting[0] = nil
		rk.waiting = rk.waiting[1:]
		rk.wanted -= r.reserve
		rk.reserved += r.reserve
		rk.batch += r.promptTokens
		r.phase = phasePrefill
		rk.running = append(rk.running, r)
	}
}

// cancel takes r out of the engine, freeing what it holds. It reports false
// when r was already done.
func (e *engine) cancel(r *request) bool {
	rk := &e.ranks[r.rank]
	switch r.phase {
	case phaseWaiting:
		rk.waiting = slices.DeleteFunc(rk.waiting, func(x *request) bool { return x == r })
		rk.wanted -= r.reserve
	case phasePrefill:
		rk.batch -= r.promptTokens
		fallthrough
	case phaseDecode:
		rk.running = slices.DeleteFunc(rk.running, func(x *request) bool { return x == r })
		rk.reserved -= r.reserve
	default:
		return false
	}
	r.phase = phaseDone
	e.cancelled++
	e.admit(rk)
	return true
}

// advance moves every running request forward by dt seconds, finishes those
// that are complete and admits what then fits.
func (e *engine) advance(dt float64) {
	if dt <= 0 {
		return
	}
	for i := range e.ranks {
		rk := &e.ranks[i]
		finished := false
		for _, r := range rk.running {
			switch r.phase {
			case phasePrefill:
				r.prefilled += rk.spec.prefillSpeed * dt
				if r.prefilled >= float64(r.promptTokens) {
					r.phase = phaseDecode
					rk.batch -= r.promptTokens
				}
			case phaseDecode:
				r.decoded += rk.spec.decodeSpeed * dt
				n := min(int64(r.decoded), int64(r.maxTokens))
				if n == r.produced.Load() {
					continue
				}
				r.produced.Store(n)
				select {
				case r.notify <- struct{}{}:
				default:
				}
				if n == int64(r.maxTokens) {
					r.phase = phaseDone
					rk.reserved -= r.reserve
					e.completed++
					close(r.done)
					finished = true
				}
			}
		}
		if finished {
			rk.running = slices.DeleteFunc(rk.running, func(r *request) bool { return r.phase == phaseDone })
		}
		e.admit(rk)
	}
}

// busy reports whether any request is waiting or running.
func (e *engine) busy() bool {
	for _, rk := range e.ranks {
		if len(rk.waiting) > 0 || len(rk.running) > 0 {
			return true
		}
	}
	return false
}

// load returns rank i's reported load.
func (e *engine) load(i int) rankLoad {
	rk := &e.ranks[i]
	var l rankLoad
	for _, r := range rk.waiting {
		l.prefillTokens += uint64(r.promptTokens)
	}
	for _, r := range rk.running {
		if r.phase == phasePrefill {
			l.prefillTokens += uint64(r.promptTokens)
		}
		l.decodeBlocks += uint64(e.blocks(r.promptTokens + int(r.produced.Load())))
	}
	return l
}
