package stepengine

import "testing"

// A request added with an output ends there, stopped, its blocks freed; one
// added without (or with an output at or past its max tokens) ends at its
// max tokens, not stopped.
func TestAddUntilStopsAtOutput(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		output      int
		maxTokens   int
		wantTokens  int
		wantStopped bool
	}{
		{"stops early", 5, 20, 5, true},
		{"stops at max tokens", 20, 20, 20, true},
		{"an output past max tokens is capped", 30, 20, 20, true},
		{"no output: max tokens", 0, 20, 20, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEngine(t, testConfig())
			r, err := e.AddUntil(t0, 10, tt.maxTokens, tt.output)
			if err != nil {
				t.Fatalf("AddUntil: %v", err)
			}
			tr := drain(t, e, t0, 100)
			evs := tr.of(r)
			last := evs[len(evs)-1]
			if r.State() != StateFinished || r.Output() != tt.wantTokens || last.Kind != EventFinished {
				t.Fatalf("%v with %d tokens, last event %v; want finished with %d", r.State(), r.Output(), last.Kind, tt.wantTokens)
			}
			if r.Stopped() != tt.wantStopped {
				t.Errorf("Stopped() = %v, want %v", r.Stopped(), tt.wantStopped)
			}
			if l := e.Load(); l.BlocksUsed != 0 || l.Running != 0 {
				t.Errorf("after the finish: %+v", l)
			}
		})
	}
}

// The scheduler and the committed blocks never read the output a request
// was added with: until the first one stops, two engines whose requests
// differ only by it step alike and report the same load.
func TestAddUntilIsHiddenFromTheScheduler(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.KVBlocks = 24 // small enough to preempt
	truth, plain := newEngine(t, cfg), newEngine(t, cfg)
	for i := range 6 {
		prompt, maxTokens := 8+4*i, 24
		if _, err := truth.AddUntil(t0, prompt, maxTokens, 10+i); err != nil {
			t.Fatal(err)
		}
		add(t, plain, t0, prompt, maxTokens)
	}
	est := OutputEstimate{P90: 12, Known: true}
	now := t0
	for step := 0; ; step++ {
		endT, evT, _ := truth.Step(now)
		endP, _, _ := plain.Step(now)
		if truth.LastPlan() != plain.LastPlan() || endT != endP {
			t.Fatalf("step %d: plans differ\n truth %+v\n plain %+v", step, truth.LastPlan(), plain.LastPlan())
		}
		stopped := false
		for _, ev := range evT {
			stopped = stopped || ev.Kind == EventFinished
		}
		if stopped {
			if step == 0 {
				t.Fatal("a request stopped in the first step")
			}
			return
		}
		if truth.Load() != plain.Load() || truth.CommittedBlocks(est) != plain.CommittedBlocks(est) {
			t.Fatalf("step %d: load %+v, committed %d; without outputs %+v, %d", step,
				truth.Load(), truth.CommittedBlocks(est), plain.Load(), plain.CommittedBlocks(est))
		}
		now = endT
	}
}

// PrefilledTokens counts every prompt token computed, and the
// recomputation of a preempted request's prompt and output again.
func TestPrefilledTokensCountRecomputation(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.KVBlocks, cfg.BlockSize = 12, 4 // the three requests outgrow it (TestPreemption)
	e := newEngine(t, cfg)
	prompts := 0
	for range 3 {
		add(t, e, t0, 8, 24)
		prompts += 8
	}
	if l := e.Load(); l.PrefilledTokens != 0 {
		t.Fatalf("prefilled %d before any step", l.PrefilledTokens)
	}
	planned, recomputed := 0, 0
	now := t0
	for e.Busy() {
		end, evs, _ := e.Step(now)
		now = end
		planned += e.LastPlan().PrefillTokens
		for _, ev := range evs {
			if ev.Kind == EventPreempted {
				recomputed += ev.Request.Prompt() + ev.Request.Output()
			}
		}
		if got := e.Load().PrefilledTokens; got != uint64(planned) {
			t.Fatalf("prefilled %d after the steps planned %d prefill tokens", got, planned)
		}
	}
	l := e.Load()
	if l.Preemptions == 0 || recomputed == 0 {
		t.Fatalf("no preemption: %+v", l)
	}
	if want := uint64(prompts + recomputed); l.PrefilledTokens != want {
		t.Errorf("prefilled %d, want the prompts %d and the recomputations %d", l.PrefilledTokens, prompts, recomputed)
	}
}

// A request cancelled in the middle of its prefill step computed nothing.
func TestPrefilledTokensSkipCancelledInStep(t *testing.T) {
	t.Parallel()
	e := newEngine(t, testConfig())
	r := add(t, e, t0, 40, 4)
	if _, ok := e.Begin(t0); !ok {
		t.Fatal("Begin: idle")
	}
	e.Cancel(r)
	e.End()
	if got := e.Load().PrefilledTokens; got != 0 {
		t.Errorf("prefilled %d for a request cancelled during its prefill", got)
	}
}

// CommittedBlocks sums ceil((prompt + expected output) / block size) over
// the waiting and running requests, the expected output following the
// estimate, each request's max tokens and its output so far.
func TestCommittedBlocks(t *testing.T) {
	t.Parallel()
	cfg := testConfig() // blocks of 4 tokens
	cfg.MaxNumSeqs = 1  // one runs, the other waits
	e := newEngine(t, cfg)
	unknown, p90 := OutputEstimate{}, OutputEstimate{P90: 6, Known: true}
	if got := e.CommittedBlocks(unknown); got != 0 {
		t.Fatalf("idle: %d", got)
	}
	a := add(t, e, t0, 10, 20) // 30 tokens at max_tokens: 8 blocks
	add(t, e, t0, 7, 1)        // 8 tokens at any estimate: 2 blocks
	if got := e.CommittedBlocks(unknown); got != 8+2 {
		t.Fatalf("nothing finished: %d, want the max tokens' 8+2", got)
	}
	if got := e.CommittedBlocks(p90); got != 4+2 { // ceil(16/4), max_tokens 1 caps the second
		t.Fatalf("p90 6: %d, want 4+2", got)
	}
	now := t0
	for a.Output() < 9 {
		end, _, _ := e.Step(now)
		now = end
	}
	if l := e.Load(); l.Running != 1 || l.Waiting != 1 {
		t.Fatalf("load %+v, want one running and one waiting", l)
	}
	// Past the p90, the running request is expected to end where it is.
	if got := e.CommittedBlocks(p90); got != 5+2 { // ceil((10+9)/4)
		t.Fatalf("output 9 past p90 6: %d, want 5+2", got)
	}
	drain(t, e, now, 100)
	if got := e.CommittedBlocks(unknown); got != 0 {
		t.Errorf("idle again: %d", got)
	}
}
