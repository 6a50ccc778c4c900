package monitor

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/events"
)

// satSink is a fakeSink that also takes saturation changes alone.
type satSink struct {
	*fakeSink
	mu   sync.Mutex
	sats map[string][]float64
}

var _ SaturationSink = (*satSink)(nil)

func (s *satSink) SetSaturation(model string, v float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sats[model] = append(s.sats[model], v)
}

func (s *satSink) saturations(model string) []float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]float64(nil), s.sats[model]...)
}

// TestSaturation: a worker's saturation is its least saturated declared
// rank's (a rank without fresh state counts 0); the model's is the mean
// over fresh, uncordoned workers, rounded to 0.01 in the record and exact
// in the gauge; a change of it alone is handed to the sink as a saturation
// only, never as a record (contract §21).
func TestSaturation(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		fake := newFakeSink()
		sink := &satSink{fakeSink: fake, sats: map[string][]float64{}}
		h := startHarnessOn(t, sink, fake, func(c *Config) {
			// Decode 0.8: 40 of 100 blocks is 0.5; prefill 1000 tokens.
			c.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](1000)}
		})
		gauge := func() float64 { return testutil.ToFloat64(h.m.metrics.saturation.WithLabelValues(testModel)) }

		// Worker 1: 40 of 100 blocks (0.5) and 300 tokens (0.3): 0.5.
		r := h.report(1, 0, 40, 100)
		r.ActivePrefillTokens = events.Some(300)
		h.send(r)
		rec := h.expect(nil, []uint64{1}, nil)
		if rec.Saturation != 0.5 || gauge() != 0.5 {
			t.Fatalf("saturation %v, gauge %v; want 0.5", rec.Saturation, gauge())
		}
		// Worker 2, two ranks: 0.25 and 1.5 (busy on one rank only): 0.25.
		r = h.report(2, 0, 20, 100)
		r.DPSize = 2
		h.send(r)
		rec = h.expect(nil, []uint64{1, 2}, nil)
		// Rank 1 has no state yet: counts 0; the mean is (0.5 + 0) / 2.
		if rec.Saturation != 0.25 {
			t.Fatalf("saturation %v with a rank unheard, want 0.25", rec.Saturation)
		}
		r = h.report(2, 1, 120, 100)
		r.DPSize = 2
		sets := fake.setCount()
		h.send(r)
		// (0.5 + 0.25) / 2 = 0.375: the record is unchanged otherwise, so
		// the sink gets the saturation alone, rounded; the gauge is exact.
		if got := fake.setCount(); got != sets {
			t.Fatalf("a change of saturation alone built %d records", got-sets)
		}
		if got := sink.saturations(testModel); len(got) != 1 || got[0] != 0.38 {
			t.Fatalf("saturations handed over %v, want [0.38]", got)
		}
		if gauge() != 0.375 {
			t.Fatalf("gauge %v, want exactly 0.375", gauge())
		}
		// The next record carries it.
		h.cordon(2, true)
		rec = h.expect([]uint64{2}, []uint64{1}, nil)
		// Cordoned workers are left out: worker 1 alone.
		if rec.Saturation != 0.5 || gauge() != 0.5 {
			t.Fatalf("with worker 2 cordoned: saturation %v, gauge %v; want 0.5", rec.Saturation, gauge())
		}
		h.cordon(2, false)
		if rec = h.expect(nil, []uint64{1, 2}, nil); rec.Saturation != 0.38 {
			t.Fatalf("uncordoned: saturation %v, want 0.38", rec.Saturation)
		}
		// Saturation is capped at 4 per rank: 2000 tokens of a 0 token
		// threshold.
		if err := h.m.SetOverride(t.Context(), testModel, &events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](0)}); err != nil {
			t.Fatal(err)
		}
		r = h.report(1, 0, 40, 100)
		r.ActivePrefillTokens = events.Some(2000)
		h.send(r)
		// Worker 1: 4 (2000 tokens over a limit of 0); worker 2 still 0.25
		// (no token anywhere, and the decode threshold is the default's):
		// 2.125, rounded half away from zero.
		if rec = h.expect([]uint64{1}, []uint64{2}, nil); rec.Saturation != 2.13 || gauge() != 2.125 {
			t.Fatalf("saturation %v gauge %v, want (4 + 0.25) / 2 = 2.125", rec.Saturation, gauge())
		}
		// Stale workers are left out; with none fresh, 0.
		for range int(DefaultStaleAfter/time.Second) + 1 {
			time.Sleep(time.Second)
			r = h.report(2, 0, 20, 100)
			r.DPSize = 2
			h.send(r)
		}
		// Worker 2 declares 2 ranks and rank 1 went stale: counts 0.
		if rec = h.expect(nil, []uint64{2}, []uint64{1}); rec.Saturation != 0 {
			t.Fatalf("saturation %v, want 0 (worker 2's rank 1 is stale)", rec.Saturation)
		}
		for range int(DefaultStaleAfter/time.Second) + 1 {
			time.Sleep(time.Second)
		}
		h.expect(nil, nil, []uint64{1, 2})
		if gauge() != 0 {
			t.Fatalf("gauge %v with no fresh worker, want 0", gauge())
		}
	})
}
