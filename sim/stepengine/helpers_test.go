package stepengine

import (
	"testing"
	"time"
)

// t0 is the start of every simulated timeline.
var t0 = time.Unix(1_700_000_000, 0)

// testConfig returns a small configuration with round step costs: 10 ms a
// step, 1 ms a decoding request, 0.1 ms a prompt token, 1 µs a context
// token.
func testConfig() Config {
	return Config{
		KVBlocks:         64,
		BlockSize:        4,
		MaxBatchedTokens: 64,
		MaxNumSeqs:       16,
		StepBase:         10 * time.Millisecond,
		PrefillPerToken:  100 * time.Microsecond,
		DecodePerRequest: time.Millisecond,
		ContextPerToken:  time.Microsecond,
	}
}

// newEngine returns an Engine of cfg or fails the test.
func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return e
}

// add queues a request or fails the test.
func add(t testing.TB, e *Engine, now time.Time, prompt, maxTokens int) *Request {
	t.Helper()
	r, err := e.Add(now, prompt, maxTokens)
	if err != nil {
		t.Fatalf("Add(%d, %d): %v", prompt, maxTokens, err)
	}
	return r
}

// trace is what a run of steps produced.
type trace struct {
	steps  int
	end    time.Time
	events []Event
}

// latencies returns the latencies of the events of kind k (first tokens
// only, or later tokens only, for EventToken).
func (tr trace) latencies(k EventKind, first bool) []time.Duration {
	var out []time.Duration
	for _, ev := range tr.events {
		if ev.Kind == k && (k != EventToken || ev.First() == first) {
			out = append(out, ev.Latency)
		}
	}
	return out
}

// of returns the events of request r.
func (tr trace) of(r *Request) []Event {
	var out []Event
	for _, ev := range tr.events {
		if ev.Request == r {
			out = append(out, ev)
		}
	}
	return out
}

// drain steps e from now until it is idle (at most limit steps), checking
// its invariants after each step.
func drain(t testing.TB, e *Engine, now time.Time, limit int) trace {
	t.Helper()
	tr := trace{end: now}
	for e.Busy() {
		if tr.steps == limit {
			t.Fatalf("still busy after %d steps: %+v", limit, e.Load())
		}
		end, evs, ok := e.Step(tr.end)
		if !ok {
			t.Fatal("Step: not ok while busy")
		}
		tr.steps++
		tr.end = end
		tr.events = append(tr.events, evs...)
		checkInvariants(t, e)
	}
	return tr
}

// checkInvariants fails the test when e's books do not add up (outside a
// step).
func checkInvariants(t testing.TB, e *Engine) {
	t.Helper()
	cfg := e.cfg
	held, prefill := 0, 0
	for _, r := range e.running {
		if r.state != StateRunning {
			t.Fatalf("running request in state %v", r.state)
		}
		if want := cfg.blocksFor(r.computed); r.blocks != want {
			t.Fatalf("running request holds %d blocks for %d tokens, want %d", r.blocks, r.computed, want)
		}
		held += r.blocks
		prefill += r.prefillLeft()
	}
	for _, r := range e.waiting.items[e.waiting.head:] {
		if r.state != StateWaiting || r.blocks != 0 || r.computed != 0 {
			t.Fatalf("waiting request: state %v, %d blocks, %d computed", r.state, r.blocks, r.computed)
		}
		prefill += r.prefillLeft()
	}
	l := e.Load()
	if l.BlocksUsed != held || held > cfg.KVBlocks || e.free < 0 {
		t.Fatalf("blocks used %d, held %d, free %d, cache %d", l.BlocksUsed, held, e.free, cfg.KVBlocks)
	}
	if l.PrefillTokens != prefill {
		t.Fatalf("prefill tokens %d, want %d", l.PrefillTokens, prefill)
	}
	// At max tokens every request commits at least the blocks it holds.
	if c := e.CommittedBlocks(OutputEstimate{}); c < l.BlocksUsed {
		t.Fatalf("%d blocks committed at max tokens, fewer than the %d held", c, l.BlocksUsed)
	}
	if l.Running > cfg.MaxNumSeqs {
		t.Fatalf("%d running, max %d", l.Running, cfg.MaxNumSeqs)
	}
	if p := e.LastPlan(); p.Decoding+p.PrefillTokens > cfg.MaxBatchedTokens {
		t.Fatalf("step scheduled %d tokens, budget %d", p.Decoding+p.PrefillTokens, cfg.MaxBatchedTokens)
	}
}

// mean returns the mean of ds, 0 for none.
func mean(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return sum / time.Duration(len(ds))
}
