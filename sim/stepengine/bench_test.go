package stepengine

import "testing"

// BenchmarkStepBatch256 measures one step (Begin and End) of 256 decoding
// requests.
func BenchmarkStepBatch256(b *testing.B) {
	cfg := DefaultConfig()
	cfg.KVBlocks, cfg.MaxBatchedTokens = 1<<24, 1<<17
	e := newEngine(b, cfg)
	for range 256 {
		add(b, e, t0, 512, 1<<20)
	}
	now, _, _ := e.Step(t0) // all 256 prefill
	b.ReportAllocs()
	for b.Loop() {
		end, _ := e.Begin(now)
		if evs := e.End(); len(evs) != 256 {
			b.Fatalf("%d events, want 256", len(evs))
		}
		now = end
	}
	if e.LastPlan().Decoding != 256 {
		b.Fatalf("plan %+v", e.LastPlan())
	}
}

// BenchmarkStepPreempting measures steps of a full cache under overload,
// where preemptions and recomputations happen.
func BenchmarkStepPreempting(b *testing.B) {
	p, _ := LookupProfile(ProfileTiny)
	e := newEngine(b, p.Config)
	now := t0
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if e.Load().Waiting < 64 {
			add(b, e, now, 128+i%384, 64+i%192)
		}
		end, _, _ := e.Step(now)
		now = end
	}
}
