package monitor

import (
	"context"
	"math"
	"testing"
	"testing/synctest"

	"github.com/workermon/workermon/events"
)

// TestRescheduleSnapshotSumsSaturate: a worker's KV blocks and request
// counts summed over its ranks stop at the largest uint64 rather than wrap
// to a small number (values come from the network): a wrapped total or
// request count would size the rescheduler's pairs from nonsense.
func TestRescheduleSnapshotSumsSaturate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		const big = uint64(1)<<63 + 50
		for rank := range uint32(2) {
			r := h.report(1, rank, 10, big)
			r.DPRank, r.DPSize = rank, 2
			r.KVCommittedBlocks = events.Some(uint64(10))
			r.RunningRequests, r.WaitingRequests = events.Some(big), events.Some(big)
			h.send(r)
		}
		synctest.Wait()
		snap, err := h.m.RescheduleSnapshot(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		w := snap.Models[0].Workers[0]
		if w.TotalBlocks != math.MaxUint64 {
			t.Errorf("total blocks %d, want %d (capped, not wrapped)", w.TotalBlocks, uint64(math.MaxUint64))
		}
		if w.Requests != math.MaxUint64 {
			t.Errorf("requests %d, want %d (capped, not wrapped)", w.Requests, uint64(math.MaxUint64))
		}
	})
}
