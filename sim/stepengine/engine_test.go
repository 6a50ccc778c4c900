package stepengine

import (
	"errors"
	"math"
	"testing"
	"time"
)

func TestStepTimeFormula(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	e := newEngine(t, cfg)
	add(t, e, t0, 40, 3)

	// Step 1 prefills the 40-token prompt: no decode, no context yet.
	end, ok := e.Begin(t0)
	if !ok {
		t.Fatal("Begin: idle")
	}
	want := 10*time.Millisecond + 40*100*time.Microsecond
	if got := end.Sub(t0); got != want {
		t.Fatalf("prefill step lasts %v, want %v", got, want)
	}
	if p := e.LastPlan(); p.PrefillTokens != 40 || p.Decoding != 0 || p.ContextTokens != 0 || p.Requests != 1 {
		t.Fatalf("prefill plan %+v", p)
	}
	evs := e.End()
	if len(evs) != 1 || !evs[0].First() || evs[0].Latency != want {
		t.Fatalf("prefill step events %+v, want the first token after %v", evs, want)
	}

	// Step 2 decodes 1 token reading the 40 tokens of context.
	start := end
	end, _ = e.Begin(start)
	want = 10*time.Millisecond + time.Millisecond + 40*time.Microsecond
	if got := end.Sub(start); got != want {
		t.Fatalf("decode step lasts %v, want %v", got, want)
	}
	if p := e.LastPlan(); p.PrefillTokens != 0 || p.Decoding != 1 || p.ContextTokens != 40 {
		t.Fatalf("decode plan %+v", p)
	}
	evs = e.End()
	if len(evs) != 1 || evs[0].Token != 2 || evs[0].Latency != want {
		t.Fatalf("decode step events %+v, want token 2 after %v", evs, want)
	}

	if got := cfg.StepTime(7, 3, 1000); got != 10*time.Millisecond+700*time.Microsecond+3*time.Millisecond+time.Millisecond {
		t.Fatalf("StepTime(7, 3, 1000) = %v", got)
	}
}

func TestITLRisesWithBatch(t *testing.T) {
	t.Parallel()
	var prev time.Duration
	for _, batch := range []int{1, 4, 16, 64} {
		cfg := testConfig()
		cfg.KVBlocks, cfg.MaxNumSeqs, cfg.MaxBatchedTokens = 4096, 256, 4096
		e := newEngine(t, cfg)
		for range batch {
			add(t, e, t0, 32, 64)
		}
		tr := drain(t, e, t0, 1000)
		itl := mean(tr.latencies(EventToken, false))
		t.Logf("batch %d: mean ITL %v", batch, itl)
		if itl <= prev {
			t.Fatalf("batch %d: mean ITL %v, not above %v of the smaller batch", batch, itl, prev)
		}
		prev = itl
	}
}

func TestTTFTIncludesQueueing(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.MaxNumSeqs = 1
	e := newEngine(t, cfg)
	first := add(t, e, t0, 20, 10)
	second := add(t, e, t0, 20, 10)
	tr := drain(t, e, t0, 100)

	firstDone := tr.of(first)[len(tr.of(first))-1]
	if firstDone.Kind != EventFinished {
		t.Fatalf("first request's last event %+v", firstDone)
	}
	ttft := tr.of(second)[0]
	if !ttft.First() {
		t.Fatalf("second request's first event %+v", ttft)
	}
	// The second waits for the first to finish, then prefills.
	want := firstDone.At.Sub(t0) + cfg.StepTime(20, 0, 0)
	if ttft.Latency != want {
		t.Fatalf("queued request's TTFT %v, want %v (the first's e2e %v + its prefill step)", ttft.Latency, want, firstDone.Latency)
	}
}

func TestTTFTGrowsWithOthersPrefill(t *testing.T) {
	t.Parallel()
	e := newEngine(t, testConfig())
	alone := add(t, e, t0, 40, 1)
	ttftAlone := drain(t, e, t0, 10).of(alone)[0].Latency

	e = newEngine(t, testConfig())
	add(t, e, t0, 60, 1) // fills the 64-token budget but 4
	late := add(t, e, t0, 40, 1)
	ttftLate := drain(t, e, t0, 10).of(late)[0].Latency
	if ttftLate <= ttftAlone {
		t.Fatalf("TTFT behind another prefill %v, not above %v alone", ttftLate, ttftAlone)
	}
}

func TestChunkedPrefill(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.MaxBatchedTokens = 10
	e := newEngine(t, cfg)
	r := add(t, e, t0, 25, 2)

	var chunks []int
	var firstStep int
	now := t0
	for step := 1; e.Busy(); step++ {
		end, evs, _ := e.Step(now)
		now = end
		if p := e.LastPlan(); p.PrefillTokens > 0 {
			chunks = append(chunks, p.PrefillTokens)
		}
		for _, ev := range evs {
			if ev.First() {
				firstStep = step
			}
		}
		if step == 1 && e.Load().PrefillTokens != 15 {
			t.Fatalf("after one chunk: %d prefill tokens left, want 15", e.Load().PrefillTokens)
		}
	}
	if len(chunks) != 3 || chunks[0] != 10 || chunks[1] != 10 || chunks[2] != 5 {
		t.Fatalf("prefill chunks %v, want [10 10 5]", chunks)
	}
	if firstStep != 3 {
		t.Fatalf("first token in step %d, want 3 (the one that finishes the prefill)", firstStep)
	}
	if r.State() != StateFinished || r.Output() != 2 {
		t.Fatalf("request %v with %d tokens", r.State(), r.Output())
	}
}

func TestBudgetAndMaxNumSeqs(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		maxSeqs     int
		budget      int
		prompts     []int
		wantRunning int
		wantTokens  int
	}{
		{"max num seqs", 2, 64, []int{4, 4, 4, 4, 4}, 2, 8},
		{"budget chunks the last admitted", 16, 10, []int{6, 6, 6}, 2, 10},
		{"budget full stops admission", 16, 6, []int{6, 6}, 1, 6},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig()
			cfg.MaxNumSeqs, cfg.MaxBatchedTokens = tt.maxSeqs, tt.budget
			e := newEngine(t, cfg)
			for _, p := range tt.prompts {
				add(t, e, t0, p, 4)
			}
			e.Step(t0)
			checkInvariants(t, e)
			l, p := e.Load(), e.LastPlan()
			if l.Running != tt.wantRunning || p.PrefillTokens != tt.wantTokens {
				t.Fatalf("running %d, prefill tokens %d; want %d, %d", l.Running, p.PrefillTokens, tt.wantRunning, tt.wantTokens)
			}
			if l.Waiting != len(tt.prompts)-tt.wantRunning {
				t.Fatalf("waiting %d, want %d", l.Waiting, len(tt.prompts)-tt.wantRunning)
			}
			drain(t, e, t0, 1000)
		})
	}
}

// TestPreemption fills a small cache with requests that grow: the most
// recently admitted is preempted, its blocks freed, it recomputes its
// prefill (prompt and tokens so far) and finishes.
func TestPreemption(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.KVBlocks, cfg.BlockSize = 12, 4 // 48 tokens
	e := newEngine(t, cfg)
	var reqs []*Request
	for range 3 {
		reqs = append(reqs, add(t, e, t0, 8, 24)) // up to 31 tokens, 8 blocks each
	}
	now := t0
	var preempted *Request
	var blocksBefore int
	for preempted == nil {
		if !e.Busy() {
			t.Fatal("finished without a preemption")
		}
		blocksBefore = e.Load().BlocksUsed
		held := map[*Request]int{}
		for _, r := range reqs {
			held[r] = r.Blocks()
		}
		end, evs, _ := e.Step(now)
		now = end
		checkInvariants(t, e)
		for _, ev := range evs {
			if ev.Kind == EventPreempted {
				preempted = ev.Request
				if preempted.Blocks() != 0 || held[preempted] == 0 {
					t.Fatalf("preempted request holds %d blocks (had %d)", preempted.Blocks(), held[preempted])
				}
			}
		}
	}
	if preempted != reqs[2] {
		t.Fatalf("preempted request %d, want the most recently admitted", indexOf(reqs, preempted))
	}
	l := e.Load()
	if l.Preemptions != 1 || l.Waiting != 1 || l.Running != 2 {
		t.Fatalf("after the preemption: %+v", l)
	}
	if p := e.LastPlan(); p.Preempted != 1 || blocksBefore != cfg.KVBlocks {
		t.Fatalf("plan %+v with %d of %d blocks used before", p, blocksBefore, cfg.KVBlocks)
	}
	if left, want := l.PrefillTokens, preempted.Prompt()+preempted.Output(); left != want {
		t.Fatalf("prefill tokens %d after the preemption, want %d (its prompt and output to recompute)", left, want)
	}
	outputAtPreemption := preempted.Output()

	tr := drain(t, e, now, 1000)
	var recomputed bool
	for _, ev := range tr.of(preempted) {
		if ev.Kind == EventToken && ev.Token == outputAtPreemption+1 {
			recomputed = true
		}
	}
	if !recomputed {
		t.Fatalf("no token %d after the recomputation", outputAtPreemption+1)
	}
	for i, r := range reqs {
		if r.State() != StateFinished || r.Output() != 24 {
			t.Fatalf("request %d: %v with %d tokens", i, r.State(), r.Output())
		}
	}
	if e.Load().BlocksUsed != 0 {
		t.Fatalf("%d blocks held when idle", e.Load().BlocksUsed)
	}
}

func indexOf(rs []*Request, r *Request) int {
	for i, x := range rs {
		if x == r {
			return i
		}
	}
	return -1
}

// TestPreemptingStepAdmitsNothing: a waiting request that would fit is not
// admitted by a step that preempted.
func TestPreemptingStepAdmitsNothing(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.KVBlocks, cfg.BlockSize, cfg.MaxBatchedTokens = 6, 4, 4
	e := newEngine(t, cfg)
	a := add(t, e, t0, 4, 16)
	b := add(t, e, t0, 4, 16)
	now := t0
	for e.Load().Preemptions == 0 {
		end, _, _ := e.Step(now)
		now = end
	}
	if b.State() != StateWaiting || a.State() != StateRunning {
		t.Fatalf("a %v, b %v after the preemption", a.State(), b.State())
	}
	// b's next chunk (the budget left, 3 tokens: 1 block) would fit, but a
	// step that preempted admits nothing.
	p := e.LastPlan()
	if p.Requests != 1 || e.Load().Running != 1 {
		t.Fatalf("the preempting step ran %d requests: %+v", p.Requests, e.Load())
	}
	if left := cfg.MaxBatchedTokens - p.Decoding - p.PrefillTokens; left < 1 || e.Load().BlocksUsed >= cfg.KVBlocks {
		t.Fatalf("no room left for b anyway: budget %d, %d blocks used", left, e.Load().BlocksUsed)
	}
	e.Step(now)
	if b.State() != StateRunning {
		t.Fatalf("b %v in the next step", b.State())
	}
	drain(t, e, now, 1000)
}

func TestCancelFreesBlocks(t *testing.T) {
	t.Parallel()
	e := newEngine(t, testConfig())
	running := add(t, e, t0, 30, 10)
	end, _, _ := e.Step(t0)
	waiting := add(t, e, end, 20, 10)
	// Cancelled during a step: no token at its end.
	if _, ok := e.Begin(end); !ok {
		t.Fatal("Begin: idle")
	}
	if running.Blocks() == 0 || waiting.Blocks() == 0 {
		t.Fatalf("blocks before cancelling: %d, %d", running.Blocks(), waiting.Blocks())
	}
	if !e.Cancel(running) || running.State() != StateCancelled || running.Blocks() != 0 {
		t.Fatalf("cancelled running request: %v, %d blocks", running.State(), running.Blocks())
	}
	for _, ev := range e.End() {
		if ev.Request == running {
			t.Fatalf("event %+v for a request cancelled during the step", ev)
		}
	}
	checkInvariants(t, e)
	if !e.Cancel(waiting) || waiting.Blocks() != 0 {
		t.Fatal("cancel the other")
	}
	if l := e.Load(); l.BlocksUsed != 0 || l.PrefillTokens != 0 || l.Running != 0 || l.Waiting != 0 || e.Busy() {
		t.Fatalf("load after cancelling everything: %+v", l)
	}
	if e.Cancel(waiting) {
		t.Fatal("cancelling twice reported true")
	}

	// A waiting request cancelled before it ran.
	queued := add(t, e, t0, 20, 10)
	if !e.Cancel(queued) || e.Load().PrefillTokens != 0 || e.Load().Waiting != 0 {
		t.Fatalf("load after cancelling a queued request: %+v", e.Load())
	}
}

func TestClockTiedToSchedule(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	e := newEngine(t, cfg)
	add(t, e, t0, 4, 3)
	end1, _, _ := e.Step(t0)
	// The caller is 1 s late (a host stall): the next step still starts at
	// the previous end.
	end2, ok := e.Begin(end1.Add(time.Second))
	if !ok || e.LastPlan().Start != end1 {
		t.Fatalf("busy engine: step starts at %v, want the previous end %v", e.LastPlan().Start, end1)
	}
	if end2.Sub(end1) != cfg.StepTime(0, 1, 4) {
		t.Fatalf("stalled step lasts %v", end2.Sub(end1))
	}
	e.End()
	// Called early: still at the previous end.
	e.Begin(end2.Add(-time.Millisecond))
	if e.LastPlan().Start != end2 {
		t.Fatalf("early call: step starts at %v, want %v", e.LastPlan().Start, end2)
	}
	e.End()
	if e.Busy() {
		t.Fatal("busy after 3 tokens")
	}
	if _, ok := e.Begin(t0.Add(time.Hour)); ok {
		t.Fatal("Begin on an idle engine reported a step")
	}
	// Idle: the next step starts when asked.
	later := t0.Add(time.Hour)
	add(t, e, later, 4, 1)
	e.Begin(later)
	if e.LastPlan().Start != later {
		t.Fatalf("after idling: step starts at %v, want %v", e.LastPlan().Start, later)
	}
	// Begin during a step only returns its end.
	if end, _ := e.Begin(later.Add(time.Hour)); end != e.LastPlan().End {
		t.Fatalf("Begin during a step returned %v", end)
	}
	e.End()
	if e.End() != nil {
		t.Fatal("End outside a step returned events")
	}
}

// TestStallKeepsTimeOrder: after a stall the caller catches up with steps
// that began before a request arrived; none of them admits it, and its first
// token comes after its arrival.
func TestStallKeepsTimeOrder(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	e := newEngine(t, cfg)
	add(t, e, t0, 4, 100)
	end, _, _ := e.Step(t0)
	late := end.Add(200 * time.Millisecond) // the caller wakes 200 ms late
	r := add(t, e, late, 8, 2)
	now := late
	for steps := 0; r.Output() == 0; steps++ {
		if steps > 100 {
			t.Fatal("the late request never got its first token")
		}
		end, evs, _ := e.Step(now)
		if e.LastPlan().Start.Before(late) && r.State() != StateWaiting {
			t.Fatalf("a step that began at %v admitted a request that arrived at %v", e.LastPlan().Start.Sub(t0), late.Sub(t0))
		}
		for _, ev := range evs {
			if ev.Request == r && (ev.Latency <= 0 || !ev.At.After(late)) {
				t.Fatalf("event %+v of a request that arrived at %v", ev, late.Sub(t0))
			}
		}
		now = end
	}

	// An idle engine given a request that arrives later starts then.
	e = newEngine(t, cfg)
	future := t0.Add(time.Second)
	add(t, e, future, 4, 1)
	if _, ok := e.Begin(t0); !ok || e.LastPlan().Start != future {
		t.Fatalf("step starts at %v, want the arrival %v", e.LastPlan().Start, future)
	}
	e.End()
}

func TestAddTooLong(t *testing.T) {
	t.Parallel()
	cfg := testConfig() // 64 blocks of 4: 256 tokens of context
	e := newEngine(t, cfg)
	if _, err := e.Add(t0, 200, 58); !errors.Is(err, ErrTooLong) {
		t.Fatalf("Add 258 tokens: %v, want ErrTooLong", err)
	}
	// A sum that overflows is too long too: accepted, it preempted every
	// request of the rank, itself included, for ever.
	if _, err := e.Add(t0, 1, math.MaxInt); !errors.Is(err, ErrTooLong) {
		t.Fatalf("Add 1 + MaxInt tokens: %v, want ErrTooLong", err)
	}
	r := add(t, e, t0, 200, 57) // the 257th token is never stored
	drain(t, e, t0, 100)
	if r.State() != StateFinished {
		t.Fatalf("request filling the cache: %v", r.State())
	}
}

func TestLatenciesOfEvents(t *testing.T) {
	t.Parallel()
	e := newEngine(t, testConfig())
	arrival := t0.Add(-5 * time.Millisecond)
	r := add(t, e, arrival, 8, 3)
	tr := drain(t, e, t0, 10)
	evs := tr.of(r)
	if len(evs) != 4 || evs[3].Kind != EventFinished {
		t.Fatalf("events %+v, want 3 tokens and a finish", evs)
	}
	if evs[0].Latency != evs[0].At.Sub(arrival) {
		t.Fatalf("TTFT %v, want from the arrival", evs[0].Latency)
	}
	for i := 1; i < 3; i++ {
		if evs[i].Latency != evs[i].At.Sub(evs[i-1].At) {
			t.Fatalf("ITL of token %d: %v", i+1, evs[i].Latency)
		}
	}
	if evs[3].Latency != evs[3].At.Sub(arrival) || evs[3].At != evs[2].At {
		t.Fatalf("finish %+v", evs[3])
	}
}
