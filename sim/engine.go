package sim

import (
	"sync/atomic"
	"time"

	"github.com/workermon/workermon/sim/stepengine"
)

// request is one completion request. promptTokens, maxTokens, outputTokens,
// notify and done are fixed at creation; produced is written by the engine
// loop and read by the HTTP handler; the rest belongs to the engine loop.
type request struct {
	promptTokens int
	maxTokens    int
	// outputTokens, when positive, is the body's sim_output_tokens: the
	// request ends there, as an end-of-sequence token would end it. Only the
	// end of the request reads it, never the scheduler or the estimate of
	// kv_committed_blocks.
	outputTokens int
	produced     atomic.Int64  // tokens generated so far
	notify       chan struct{} // a token was generated (capacity 1, never blocks the engine)
	done         chan struct{} // closed when all its tokens are generated

	rank int
	step *stepengine.Request // nil until added
}

// newRequest returns a request for promptTokens tokens of prompt and at most
// maxTokens tokens to generate, both at least 1, that ends after
// outputTokens tokens when that is positive (at most maxTokens).
func newRequest(promptTokens, maxTokens, outputTokens int) *request {
	maxTokens = max(1, maxTokens)
	return &request{
		promptTokens: max(1, promptTokens),
		maxTokens:    maxTokens,
		outputTokens: min(max(0, outputTokens), maxTokens),
		notify:       make(chan struct{}, 1),
		done:         make(chan struct{}),
	}
}

// tokens returns the tokens the request generates.
func (r *request) tokens() int {
	if r.outputTokens > 0 {
		return r.outputTokens
	}
	return r.maxTokens
}

// observer receives the latencies of a rank's requests as the engine's
// events give them (vLLM's histograms).
type observer interface {
	ttft(rank int, d time.Duration)
	itl(rank int, d time.Duration)
	e2e(rank int, d time.Duration)
}

// rankLoad is one rank's load as reported.
type rankLoad struct {
	decodeBlocks  uint64
	prefillTokens uint64
	// The leading signals of contract §21.
	waiting, running  uint64
	preemptions       uint64 // since the engine started
	prefilledTokens   uint64 // since the engine started
	kvCommittedBlocks uint64
}

// rankState is one rank: its step engine and, during a step, when it ends.
type rankState struct {
	cfg stepengine.Config
	eng *stepengine.Engine
	end time.Time
}

// engine is the scheduler of one worker's ranks, each a stepengine.Engine.
// It is not safe for concurrent use: one goroutine owns it.
type engine struct {
	ranks []rankState
	reqs  map[*stepengine.Request]*request
	obs   observer
	// outputs is the latest finished outputs of the worker's ranks: the
	// estimate of the expected output in kv_committed_blocks.
	outputs   *stepengine.OutputWindow
	completed uint64
	cancelled uint64
}

// newEngine returns an idle engine of one rank per configuration; obs may
// be nil.
func newEngine(cfgs []stepengine.Config, obs observer) (*engine, error) {
	e := &engine{
		ranks:   make([]rankState, len(cfgs)),
		reqs:    map[*stepengine.Request]*request{},
		obs:     obs,
		outputs: stepengine.NewOutputWindow(stepengine.DefaultOutputWindow),
	}
	for i, c := range cfgs {
		eng, err := stepengine.New(c)
		if err != nil {
			return nil, err
		}
		e.ranks[i] = rankState{cfg: c, eng: eng}
	}
	return e, nil
}

// maxSequence returns the longest prompt+max_tokens that the largest rank
// can ever hold, in tokens.
func (e *engine) maxSequence() int {
	most := 0
	for _, r := range e.ranks {
		most = max(most, r.cfg.MaxRequestTokens())
	}
	return most
}

// add assigns r, arrived at now, to the least loaded rank that can hold it
// (the smallest fraction of its KV cache held or wanted by the prompts still
// to prefill) and queues it there. It reports false when no rank can.
func (e *engine) add(now time.Time, r *request) bool {
	best, bestLoad := -1, 0.0
	for i := range e.ranks {
		rk := &e.ranks[i]
		if limit := rk.cfg.MaxRequestTokens(); r.promptTokens > limit || r.maxTokens > limit-r.promptTokens {
			continue
		}
		l := rk.eng.Load()
		want := (l.PrefillTokens + rk.cfg.BlockSize - 1) / rk.cfg.BlockSize
		load := float64(l.BlocksUsed+want) / float64(rk.cfg.KVBlocks)
		if best < 0 || load < bestLoad {
			best, bestLoad = i, load
		}
	}
	if best < 0 {
		return false
	}
	sr, err := e.ranks[best].eng.AddUntil(now, r.promptTokens, r.maxTokens, r.outputTokens)
	if err != nil {
		return false
	}
	r.rank, r.step = best, sr
	e.reqs[sr] = r
	return true
}

// cancel takes r out of the engine, freeing its blocks. It reports false
// when r was not in it (finished, or never added).
func (e *engine) cancel(r *request) bool {
	if r.step == nil || !e.ranks[r.rank].eng.Cancel(r.step) {
		return false
	}
	delete(e.reqs, r.step)
	e.cancelled++
	return true
}

// advance ends every step due by now, delivering its tokens, and begins the
// next step of every rank with work. It returns when the earliest step in
// progress ends; ok is false when no rank has one.
func (e *engine) advance(now time.Time) (next time.Time, ok bool) {
	for i := range e.ranks {
		rk := &e.ranks[i]
		for {
			if rk.eng.InStep() {
				if rk.end.After(now) {
					break
				}
				e.deliver(i, rk.eng.End())
			}
			end, busy := rk.eng.Begin(now)
			if !busy {
				break
			}
			rk.end = end
		}
		if rk.eng.InStep() && (!ok || rk.end.Before(next)) {
			next, ok = rk.end, true
		}
	}
	return next, ok
}

// deliver hands the events of a step of rank i to the requests' handlers.
func (e *engine) deliver(i int, events []stepengine.Event) {
	for _, ev := range events {
		r := e.reqs[ev.Request]
		if r == nil {
			continue
		}
		switch ev.Kind {
		case stepengine.EventToken:
			r.produced.Store(int64(ev.Token))
			select {
			case r.notify <- struct{}{}:
			default:
			}
			if e.obs != nil {
				if ev.First() {
					e.obs.ttft(i, ev.Latency)
				} else {
					e.obs.itl(i, ev.Latency)
				}
			}
		case stepengine.EventFinished:
			delete(e.reqs, ev.Request)
			e.completed++
			e.outputs.Add(ev.Request.Output())
			if e.obs != nil {
				e.obs.e2e(i, ev.Latency)
			}
			close(r.done)
		}
	}
}

// busy reports whether any request is waiting or running.
func (e *engine) busy() bool {
	for _, rk := range e.ranks {
		if rk.eng.Busy() {
			return true
		}
	}
	return false
}

// load returns rank i's reported load.
func (e *engine) load(i int) rankLoad {
	eng := e.ranks[i].eng
	l := eng.Load()
	return rankLoad{
		decodeBlocks:      uint64(l.BlocksUsed),
		prefillTokens:     uint64(l.PrefillTokens),
		waiting:           uint64(l.Waiting),
		running:           uint64(l.Running),
		preemptions:       l.Preemptions,
		prefilledTokens:   l.PrefilledTokens,
		kvCommittedBlocks: uint64(eng.CommittedBlocks(e.outputs.Estimate())),
	}
}
