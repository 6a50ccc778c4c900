package stepengine

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

// FuzzEngine drives an engine of a small random configuration with random
// arrivals, cancellations and steps (some cancelled in the middle), checking
// after every operation that the blocks held never exceed the cache and the
// books add up; when the arrivals stop, every request not cancelled
// finishes with all its tokens (every other one stops early, AddUntil), and
// the engine ends idle with every block free.
func FuzzEngine(f *testing.F) {
	f.Add([]byte{4, 2, 8, 3, 0, 30, 20, 0, 10, 10, 2, 2, 2, 1, 0, 2, 2, 2, 2})
	f.Add([]byte{1, 1, 1, 1, 0, 200, 200, 0, 1, 1, 2, 3, 2})
	f.Add([]byte{16, 4, 64, 8, 0, 5, 60, 0, 6, 60, 0, 7, 60, 2, 2, 2, 2, 2, 2, 2, 2, 1, 3, 2, 2, 2, 2})
	f.Add([]byte{6, 4, 4, 2, 0, 4, 16, 0, 4, 16, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2})
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		seed := make([]byte, 64)
		for i := range seed {
			seed[i] = byte(rng.IntN(256))
		}
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < 4 {
			return
		}
		cfg := testConfig()
		cfg.KVBlocks = 1 + int(data[0]%64)
		cfg.BlockSize = 1 + int(data[1]%8)
		cfg.MaxBatchedTokens = 1 + int(data[2]%64)
		cfg.MaxNumSeqs = 1 + int(data[3]%8)
		e := newEngine(t, cfg)
		data = data[4:]
		next := func() int {
			if len(data) == 0 {
				return 0
			}
			b := data[0]
			data = data[1:]
			return int(b)
		}

		var live []*Request
		cancelled := map[*Request]bool{}
		now := t0
		maxSteps := 1
		for len(data) > 0 {
			switch next() % 4 {
			case 0: // an arrival
				prompt, maxTokens := 1+next()%48, 1+next()%48
				// Some arrive after the next step begins (a caller late
				// with its steps).
				arrival := now.Add(time.Duration(next()%4) * 5 * time.Millisecond)
				output := 0 // at max tokens
				if len(live)%2 == 1 {
					output = 1 + prompt%maxTokens
				}
				r, err := e.AddUntil(arrival, prompt, maxTokens, output)
				if prompt+maxTokens > cfg.MaxRequestTokens() {
					if !errors.Is(err, ErrTooLong) {
						t.Fatalf("Add(%d, %d) to a cache of %d tokens: %v", prompt, maxTokens, cfg.KVBlocks*cfg.BlockSize, err)
					}
					continue
				}
				if err != nil {
					t.Fatalf("Add(%d, %d): %v", prompt, maxTokens, err)
				}
				live = append(live, r)
				maxSteps += prompt + maxTokens + 1
			case 1: // a cancellation
				if len(live) > 0 {
					r := live[next()%len(live)]
					if e.Cancel(r) {
						cancelled[r] = true
					}
				}
			case 2: // a step
				if end, evs, ok := e.Step(now); ok {
					checkEvents(t, evs)
					now = end
				}
			case 3: // a step with a cancellation in its middle
				end, ok := e.Begin(now)
				if !ok {
					continue
				}
				if l := e.Load(); l.BlocksUsed > cfg.KVBlocks {
					t.Fatalf("during a step: %d blocks used of %d", l.BlocksUsed, cfg.KVBlocks)
				}
				if len(live) > 0 {
					r := live[next()%len(live)]
					if e.Cancel(r) {
						cancelled[r] = true
					}
				}
				evs := e.End()
				checkEvents(t, evs)
				for _, ev := range evs {
					if cancelled[ev.Request] && ev.Kind != EventPreempted {
						t.Fatalf("event %v for a cancelled request", ev.Kind)
					}
				}
				now = end
			}
			checkInvariants(t, e)
		}

		checkEvents(t, drain(t, e, now, maxSteps).events)
		for _, r := range live {
			switch {
			case cancelled[r]:
				if r.State() != StateCancelled || r.Blocks() != 0 {
					t.Fatalf("cancelled request: %v with %d blocks", r.State(), r.Blocks())
				}
			case r.State() != StateFinished || r.Output() != r.MaxTokens() && !r.Stopped() || r.Blocks() != 0:
				t.Fatalf("request of %d+%d tokens: %v with %d tokens and %d blocks", r.Prompt(), r.MaxTokens(), r.State(), r.Output(), r.Blocks())
			}
		}
		if l := e.Load(); l != (Load{KVBlocks: cfg.KVBlocks, Preemptions: l.Preemptions, PrefilledTokens: l.PrefilledTokens}) {
			t.Fatalf("idle engine's load %+v", l)
		}
	})
}

// checkEvents fails the test when an event comes before its request's
// arrival or has no latency.
func checkEvents(t *testing.T, evs []Event) {
	t.Helper()
	for _, ev := range evs {
		if ev.Kind == EventPreempted {
			continue
		}
		if ev.Latency <= 0 || !ev.At.After(ev.Request.Arrival()) {
			t.Fatalf("%v event at %v, latency %v, of a request that arrived at %v", ev.Kind, ev.At, ev.Latency, ev.Request.Arrival())
		}
	}
}

// TestOverloadPreemptsAndRecovers offers a small rank far more than it can
// serve, then stops: the cache fills, requests are preempted (and recompute),
// and every request still finishes.
func TestOverloadPreemptsAndRecovers(t *testing.T) {
	t.Parallel()
	p, err := LookupProfile(ProfileTiny)
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, p.Config)
	rng := rand.New(rand.NewPCG(7, 7))
	var reqs []*Request
	now := t0
	arrivals := t0
	// 3 s of chat arrivals at 40 requests/s.
	stop := t0.Add(3 * time.Second)
	for arrivals.Before(stop) {
		if !e.Busy() && now.Before(arrivals) {
			now = arrivals
		}
		for arrivals.Before(stop) && !arrivals.After(now) {
			reqs = append(reqs, add(t, e, arrivals, 128+rng.IntN(385), 64+rng.IntN(193)))
			arrivals = arrivals.Add(25 * time.Millisecond)
		}
		if end, _, ok := e.Step(now); ok {
			now = end
		}
		checkInvariants(t, e)
	}
	drain(t, e, now, 1_000_000)
	if e.Load().Preemptions == 0 {
		t.Fatal("no preemption under 10x overload")
	}
	var recomputed int
	for _, r := range reqs {
		if r.State() != StateFinished || r.Output() != r.MaxTokens() {
			t.Fatalf("request %v with %d of %d tokens", r.State(), r.Output(), r.MaxTokens())
		}
		if r.Preemptions() > 0 {
			recomputed++
		}
	}
	t.Logf("%d requests, %d preemptions, %d requests preempted at least once", len(reqs), e.Load().Preemptions, recomputed)
}
