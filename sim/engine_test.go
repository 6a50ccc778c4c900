package sim

import (
	"testing"
)

// spec is a rank of kv blocks and batch budget with one-token-per-second
// speeds scaled by speed.
func spec(kv, batch int, speed float64) rankSpec {
	return rankSpec{kvBlocks: kv, maxBatched: batch, prefillSpeed: 100 * speed, decodeSpeed: 10 * speed}
}

func TestEngineQueuesWhenKVFull(t *testing.T) {
	t.Parallel()
	// 10 blocks of 16 tokens; each request reserves ceil((40+40)/16) = 5.
	e := newEngine([]rankSpec{spec(10, 1000, 1)}, 16)
	reqs := []*request{newRequest(40, 40), newRequest(40, 40), newRequest(40, 40)}
	for _, r := range reqs {
		if !e.add(r) {
			t.Fatal("add refused a request that fits")
		}
	}
	rk := &e.ranks[0]
	if len(rk.running) != 2 || len(rk.waiting) != 1 {
		t.Fatalf("running %d, waiting %d; want 2 and 1", len(rk.running), len(rk.waiting))
	}
	// Queued prompts count as prefill load; admitted ones hold their prompt
	// blocks.
	if l := e.load(0); l.prefillTokens != 120 || l.decodeBlocks != 6 {
		t.Fatalf("load %+v; want 120 prefill tokens and 6 blocks", l)
	}
	e.advance(0.5) // prefill done (100 tokens/s)
	if l := e.load(0); l.prefillTokens != 40 {
		t.Fatalf("prefill tokens after prefill %d; want the queued 40", l.prefillTokens)
	}
	e.advance(2) // 20 tokens each
	if got := reqs[0].produced.Load(); got != 20 {
		t.Fatalf("produced %d; want 20", got)
	}
	if l := e.load(0); l.decodeBlocks != 2*4 { // ceil(60/16) each
		t.Fatalf("decode blocks %d; want 8", l.decodeBlocks)
	}
	e.advance(2) // 40: the first two finish, the third is admitted
	for _, r := range reqs[:2] {
		select {
		case <-r.done:
		default:
			t.Fatal("request not done after max_tokens")
		}
	}
	if len(rk.running) != 1 || len(rk.waiting) != 0 || reqs[2].phase != phasePrefill {
		t.Fatalf("running %d, waiting %d, third in phase %d", len(rk.running), len(rk.waiting), reqs[2].phase)
	}
	if e.completed != 2 || rk.reserved != 5 {
		t.Fatalf("completed %d, reserved %d; want 2 and 5", e.completed, rk.reserved)
	}
}

func TestEngineBatchBudget(t *testing.T) {
	t.Parallel()
	e := newEngine([]rankSpec{spec(1000, 100, 1)}, 16)
	a, b := newRequest(60, 10), newRequest(60, 10)
	e.add(a)
	e.add(b)
	if a.phase != phasePrefill || b.phase != phaseWaiting {
		t.Fatalf("phases %d, %d; want prefill and waiting", a.phase, b.phase)
	}
	e.advance(0.6) // a's prefill ends, freeing the batch
	if a.phase != phaseDecode || b.phase != phasePrefill {
		t.Fatalf("phases %d, %d; want decode and prefill", a.phase, b.phase)
	}
	// A prompt above the budget still runs alone.
	big := newRequest(500, 10)
	e2 := newEngine([]rankSpec{spec(1000, 100, 1)}, 16)
	e2.add(big)
	if big.phase != phasePrefill {
		t.Fatalf("big prompt in phase %d; want prefill", big.phase)
	}
}

func TestEngineCancelFrees(t *testing.T) {
	t.Parallel()
	e := newEngine([]rankSpec{spec(10, 1000, 1)}, 16)
	running, waiting := newRequest(40, 40), newRequest(40, 100)
	e.add(running)
	e.add(waiting) // 9 blocks do not fit beside 5
	e.advance(1)
	if waiting.phase != phaseWaiting {
		t.Fatalf("second request in phase %d; want waiting", waiting.phase)
	}
	if !e.cancel(waiting) {
		t.Fatal("cancel of a waiting request reported false")
	}
	if l := e.load(0); l.prefillTokens != 0 {
		t.Fatalf("prefill tokens %d after cancelling the queued request", l.prefillTokens)
	}
	if !e.cancel(running) {
		t.Fatal("cancel of a running request reported false")
	}
	if l := e.load(0); l != (rankLoad{}) {
		t.Fatalf("load %+v after cancelling everything; want zero", l)
	}
	if rk := e.ranks[0]; rk.reserved != 0 || rk.wanted != 0 || rk.batch != 0 || e.busy() {
		t.Fatalf("rank %+v not empty", rk)
	}
	if e.cancel(running) {
		t.Fatal("second cancel reported true")
	}
	if e.cancelled != 2 {
		t.Fatalf("cancelled %d; want 2", e.cancelled)
	}
}

func TestEngineLeastLoaded(t *testing.T) {
	t.Parallel()
	// Rank 1 has half the KV cache: it takes every third request.
	e := newEngine([]rankSpec{spec(100, 1000, 1), spec(50, 1000, 1)}, 16)
	var on [2]int
	for range 6 {
		r := newRequest(16, 16) // 2 blocks
		e.add(r)
		on[r.rank]++
	}
	if on != [2]int{4, 2} {
		t.Fatalf("requests per rank %v; want [4 2]", on)
	}
	// A request too large for rank 1 goes to rank 0 whatever the load.
	big := newRequest(16*60, 16)
	if !e.add(big) || big.rank != 0 {
		t.Fatalf("big request on rank %d", big.rank)
	}
	if e.add(newRequest(16*100, 16)) {
		t.Fatal("add accepted a request no rank can hold")
	}
}

func TestContinuation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		text string
		want int
	}{
		{"", 0},
		{"hello", 0},
		{"tok0", 1},
		{"say tok4 tok5", 6},
		{"tok12\n", 13},
		{"xtok3", 0},
		{"tok", 0},
		{"tok-1", 0},
		{"tok+1", 0},
		{"tok1a", 0},
		{"tok1234567890", 0},
	} {
		if got := continuation(tc.text); got != tc.want {
			t.Errorf("continuation(%q) = %d; want %d", tc.text, got, tc.want)
		}
	}
	if got := generatedText(3, 3, false); got != " tok3 tok4 tok5" {
		t.Errorf("generatedText completion = %q", got)
	}
	if got := generatedText(0, 2, true); got != "tok0 tok1" {
		t.Errorf("generatedText chat = %q", got)
	}
	// A text cut anywhere between tokens continues where it stopped.
	full := "prompt" + generatedText(0, 10, false)
	cut := "prompt" + generatedText(0, 4, false)
	if got := cut + generatedText(continuation(cut), 6, false); got != full {
		t.Errorf("continued text %q; want %q", got, full)
	}
}
