package monitor

import (
	"context"
	"math"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/events"
)

// expectLevels checks the amber and hard lists of the model's record.
func (h *harness) expectLevels(amber, hard []uint64) {
	h.t.Helper()
	rec, ok := h.sink.record(testModel)
	if !ok {
		h.t.Fatalf("no record for %s", testModel)
	}
	if len(rec.Amber) != len(amber) || len(rec.Amber) > 0 && !slices.Equal(rec.Amber, amber) ||
		len(rec.Hard) != len(hard) || len(rec.Hard) > 0 && !slices.Equal(rec.Hard, hard) {
		h.t.Fatalf("record amber=%v hard=%v, want amber=%v hard=%v", rec.Amber, rec.Hard, amber, hard)
	}
}

// TestLevelsInRecord: with the harness's decode threshold 0.8 of 100
// blocks, amber is above 64, busy above 80, hard above 88. The record lists
// amber the free workers at amber and hard the busy workers at hard;
// crossing a level writes a record, a report that crosses none does not.
func TestLevelsInRecord(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100)) // free
		h.send(h.report(2, 0, 70, 100)) // amber
		h.send(h.report(3, 0, 85, 100)) // busy
		h.send(h.report(4, 0, 95, 100)) // hard
		h.expect([]uint64{3, 4}, []uint64{1, 2}, nil)
		h.expectLevels([]uint64{2}, []uint64{4})
		if got := testutil.ToFloat64(h.m.metrics.workers.WithLabelValues(testModel, "amber")); got != 1 {
			t.Errorf("amber workers gauge = %v", got)
		}
		if got := testutil.ToFloat64(h.m.metrics.workers.WithLabelValues(testModel, "hard")); got != 1 {
			t.Errorf("hard workers gauge = %v", got)
		}

		// Within a level, and heartbeats: no record.
		n := h.sink.setCount()
		h.send(h.report(2, 0, 75, 100))
		h.send(h.report(4, 0, 99, 100))
		h.send(h.report(1, 0, 64, 100)) // at the amber level, not above it
		h.send(h.report(3, 0, 88, 100)) // at the hard level, not above it
		h.send(h.report(3, 0, 88, 100))
		if got := h.sink.setCount(); got != n {
			t.Fatalf("%d records for reports that crossed no level", got-n)
		}

		// Each crossing is a record.
		steps := []struct {
			worker, blocks uint64
			amber, hard    []uint64
		}{
			{1, 65, []uint64{1, 2}, []uint64{4}},    // free → amber
			{3, 89, []uint64{1, 2}, []uint64{3, 4}}, // busy → hard
			{2, 64, []uint64{1}, []uint64{3, 4}},    // amber → free
			{4, 81, []uint64{1}, []uint64{3}},       // hard → busy
			{3, 10, []uint64{1}, nil},               // hard → free
			{1, 100, nil, []uint64{1}},              // amber → hard
		}
		for _, s := range steps {
			n := h.sink.setCount()
			h.send(h.report(s.worker, 0, s.blocks, 100))
			if got := h.sink.setCount(); got != n+1 {
				t.Fatalf("worker %d to %d blocks: %d records, want 1", s.worker, s.blocks, got-n)
			}
			h.expectLevels(s.amber, s.hard)
		}
		h.expect([]uint64{1, 4}, []uint64{2, 3}, nil)

		// A stale worker is at no level.
		time.Sleep(DefaultStaleAfter + time.Second)
		h.send(h.report(2, 0, 70, 100))
		h.expect(nil, []uint64{2}, []uint64{1, 3, 4})
		h.expectLevels([]uint64{2}, nil)
	})
}

// TestLevelsDataParallel: a worker is at the lowest level of its declared
// ranks.
func TestLevelsDataParallel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		rank := func(r uint32, blocks uint64) {
			rep := h.report(1, r, blocks, 100)
			rep.DPSize = 2
			h.send(rep)
		}
		rank(0, 95)
		h.expectLevels(nil, nil) // rank 1 not heard yet: free
		rank(1, 70)
		h.expect(nil, []uint64{1}, nil)
		h.expectLevels([]uint64{1}, nil)
		rank(1, 85)
		h.expect([]uint64{1}, nil, nil)
		h.expectLevels(nil, nil)
		rank(1, 90)
		h.expectLevels(nil, []uint64{1})
		rank(0, 70)
		h.expect(nil, []uint64{1}, nil)
		h.expectLevels([]uint64{1}, nil)

		// The inspection API shows the levels of the worker and its ranks.
		ws, err := h.m.Workers(context.Background(), testModel)
		if err != nil || len(ws) != 1 || ws[0].Level != "amber" {
			t.Fatalf("workers %+v, %v", ws, err)
		}
		ls, err := h.m.Loads(context.Background(), testModel)
		if err != nil || len(ls) != 2 || ls[0].Level != "amber" || ls[1].Level != "hard" {
			t.Fatalf("loads %+v, %v", ls, err)
		}
	})
}

// TestLevelsCordon: a cordoned worker gets nothing new, critical requests
// included: it is busy and hard.
func TestLevelsCordon(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		h.send(h.report(1, 0, 10, 100))
		h.send(h.report(2, 0, 70, 100))
		h.cordon(2, true)
		h.expect([]uint64{2}, []uint64{1}, nil)
		h.expectLevels(nil, []uint64{2})
		h.cordon(2, false)
		h.expectLevels([]uint64{2}, nil)
	})
}

// TestLevelsReleaseMargin: each level latches with the same margin, and a
// new writer seeds the latches from the record's lists.
func TestLevelsReleaseMargin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.ReleaseMargin = 0.1 })
		// Amber above 64, released at or below 0.9 × 0.8 × 0.8 × 100 = 57.6.
		h.send(h.report(1, 0, 60, 100))
		h.expectLevels(nil, nil)
		h.send(h.report(1, 0, 65, 100))
		h.expectLevels([]uint64{1}, nil)
		h.send(h.report(1, 0, 58, 100))
		h.expectLevels([]uint64{1}, nil)
		h.send(h.report(1, 0, 57, 100))
		h.expectLevels(nil, nil)
		// Hard above 88, released at or below 0.9 × 0.88 × 100 = 79.2.
		h.send(h.report(2, 0, 89, 100))
		h.expectLevels(nil, []uint64{2})
		h.send(h.report(2, 0, 80, 100))
		h.expectLevels(nil, []uint64{2})
		h.send(h.report(2, 0, 79, 100))
		h.expect([]uint64{2}, []uint64{1}, nil) // still busy: busy releases at 72
		h.expectLevels(nil, nil)
		h.send(h.report(2, 0, 72, 100))
		h.expect(nil, []uint64{1, 2}, nil)
		h.expectLevels([]uint64{2}, nil) // amber holds down to 57.6
	})
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.ReleaseMargin = 0.1 })
		prev := []events.BusySet{{Model: testModel, Busy: []uint64{3}, Free: []uint64{1, 2}, Amber: []uint64{2}, Hard: []uint64{3},
			Reasons: map[string]string{"3": "kv"}}}
		if err := h.m.Seed(context.Background(), prev); err != nil {
			t.Fatal(err)
		}
		h.send(h.report(1, 0, 60, 100)) // not latched: free
		h.send(h.report(2, 0, 60, 100)) // latched amber by the record
		h.send(h.report(3, 0, 85, 100)) // latched hard by the record
		h.expect([]uint64{3}, []uint64{1, 2}, nil)
		h.expectLevels([]uint64{2}, []uint64{3})
	})
}

// TestLevelsFractions: the fractions come from the config; 1 and 1 make
// amber and busy, and busy and hard, the same line.
func TestLevelsFractions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.ShedFraction, c.CriticalFraction = 1, 1 })
		h.send(h.report(1, 0, 79, 100))
		h.send(h.report(2, 0, 81, 100))
		h.expect([]uint64{2}, []uint64{1}, nil)
		h.expectLevels(nil, []uint64{2})
	})
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, func(c *Config) { c.ShedFraction = 0.5 })
		h.send(h.report(1, 0, 41, 100))
		h.expectLevels([]uint64{1}, nil)
	})
}

func TestConfigValidateFractions(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		shed, critical float64
		want           string
	}{
		{0, 1.1, "shed-fraction"},
		{-0.1, 1.1, "shed-fraction"},
		{1.01, 1.1, "shed-fraction"},
		{math.NaN(), 1.1, "shed-fraction"},
		{0.8, 0.99, "critical-fraction"},
		{0.8, math.Inf(1), "critical-fraction"},
		{0.8, math.NaN(), "critical-fraction"},
		{1, 1, ""},
		{0.01, 100, ""},
	} {
		cfg := DefaultConfig()
		cfg.ShedFraction, cfg.CriticalFraction = tt.shed, tt.critical
		err := cfg.Validate()
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("shed %v critical %v: %v, want %q", tt.shed, tt.critical, err, tt.want)
		}
	}
}
