package board

import (
	"math"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/slots"
)

// TestEstimatesSaturate: a rank's estimates summed over tenants stop at
// 2^64-1 instead of wrapping (issue 23 item 23).
func TestEstimatesSaturate(t *testing.T) {
	t.Parallel()
	workers := []Worker{{ID: 7}}
	loads := []slots.Load{
		{Model: "m", Tenant: "t1", WorkerID: 7, ActivePrefillTokens: math.MaxUint64, ActiveDecodeBlocks: math.MaxUint64},
		{Model: "m", Tenant: "t2", WorkerID: 7, ActivePrefillTokens: 2, ActiveDecodeBlocks: 3},
	}
	addEstimates(workers, events.Thresholds{}, "m", loads)
	if r := workers[0].Ranks; len(r) != 1 || r[0].Prefill != math.MaxUint64 || r[0].KVUsed != math.MaxUint64 {
		t.Errorf("ranks %+v, want one at 2^64-1 tokens and blocks", r)
	}
}
