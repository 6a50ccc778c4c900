package sim_test

import (
	"net/http"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
	"github.com/workermon/workermon/sim"
)

// A worker that does not publish still runs, and its /metrics page, read
// by the vLLM mapping of workermon scrape, gives the engine's real blocks
// in use and in total, rank by rank (engine label = rank).
func TestMetricsPageIsVLLMShaped(t *testing.T) {
	t.Parallel()
	cfg := sim.DefaultWorkerConfig()
	cfg.Ranks, cfg.DPStart = 2, 3
	cfg.Engine.CapacitySkew = []float64{1, 0.5}
	cfg.Publish.Disabled = true
	cfg.NATS.URL = "nats://127.0.0.1:1" // never dialled
	w := startWorker(t, cfg)
	if w.BootID() != 0 {
		t.Fatalf("a worker that does not publish has boot id %d", w.BootID())
	}
	for range 3 {
		openStream(t, w.Endpoint(), w.Model(), false)
	}

	read := func() scrape.Snapshot {
		resp, err := http.Get(w.Endpoint() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /metrics: %s", resp.Status)
		}
		fams, err := scrape.Parse(resp.Body)
		if err != nil {
			t.Fatalf("the page does not parse: %v", err)
		}
		return scrape.VLLM{}.Loads(fams)
	}
	// The page and Stats are two snapshots of a running engine: wait for a
	// pair taken between two of its steps.
	var snap scrape.Snapshot
	waitUntil(t, "the page to match the engine's state with blocks in use", func() bool {
		snap = read()
		st := w.Stats()
		if len(snap.Ranks) != len(st.Ranks) {
			t.Fatalf("page has ranks %+v, engine %+v", snap.Ranks, st.Ranks)
		}
		inUse := false
		for i, r := range st.Ranks {
			got := snap.Ranks[i]
			if got.Rank != r.Rank || got.KVTotalBlocks != events.Some(r.KVTotalBlocks) {
				t.Fatalf("page rank %+v, engine rank %+v", got, r)
			}
			if got.ActiveDecodeBlocks != events.Some(r.ActiveDecodeBlocks) {
				return false
			}
			inUse = inUse || r.ActiveDecodeBlocks > 0
		}
		return inUse
	})
	if snap.BlockSize != sim.DefaultBlockSize {
		t.Errorf("block size %d, want %d", snap.BlockSize, sim.DefaultBlockSize)
	}
	if snap.Ranks[0].Rank != 3 || snap.Ranks[1].KVTotalBlocks.Value != sim.DefaultKVBlocks/2 {
		t.Errorf("ranks %+v: want ranks 3 and 4, the second with half the blocks", snap.Ranks)
	}
}
