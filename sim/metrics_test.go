package sim_test

import (
	"bytes"
	"io"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
	"github.com/workermon/workermon/sim"
	"github.com/workermon/workermon/sim/stepengine"
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

// The page carries vLLM's latency histograms (its names, bucket bounds and
// labels), its queue gauges and its preemption counter, rank by rank, and
// passes client_golang's linter but for the colons of vLLM's names.
func TestMetricsPageHasVLLMLatencies(t *testing.T) {
	t.Parallel()
	cfg := sim.DefaultWorkerConfig()
	cfg.Ranks, cfg.DPStart = 2, 5
	cfg.Engine.DecodeSpeed = 1000
	cfg.Publish.Disabled = true
	cfg.NATS.URL = "nats://127.0.0.1:1" // never dialled
	w := startWorker(t, cfg)
	completeMany(t, w, 2, 10, 5)

	resp, err := http.Get(w.Endpoint() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	page, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	problems, err := promlint.New(bytes.NewReader(page)).Lint()
	if err != nil {
		t.Fatalf("lint: %v", err)
	}
	for _, p := range problems {
		if !strings.HasPrefix(p.Metric, "vllm:") || p.Text != "metric names should not contain ':'" {
			t.Errorf("lint: %s: %s", p.Metric, p.Text)
		}
	}
	fams, err := scrape.Parse(bytes.NewReader(page))
	if err != nil {
		t.Fatalf("scrape's parser: %v", err)
	}
	for _, tc := range []struct {
		name    string
		typ     dto.MetricType
		buckets []float64
	}{
		{stepengine.MetricTTFT, dto.MetricType_HISTOGRAM, stepengine.TTFTBuckets()},
		{stepengine.MetricITL, dto.MetricType_HISTOGRAM, stepengine.ITLBuckets()},
		{stepengine.MetricE2E, dto.MetricType_HISTOGRAM, stepengine.E2EBuckets()},
		{stepengine.MetricWaiting, dto.MetricType_GAUGE, nil},
		{stepengine.MetricRunning, dto.MetricType_GAUGE, nil},
		{stepengine.MetricPreemptions, dto.MetricType_COUNTER, nil},
	} {
		mf := fams[tc.name]
		if mf == nil || mf.GetType() != tc.typ || len(mf.Metric) != 2 {
			t.Errorf("%s: %v; want a %v with a series per rank", tc.name, mf, tc.typ)
			continue
		}
		var observed uint64
		for i, m := range mf.Metric {
			labels := map[string]string{}
			for _, l := range m.Label {
				labels[l.GetName()] = l.GetValue()
			}
			if want := map[string]string{"engine": strconv.Itoa(5 + i), "model_name": w.Model()}; !maps.Equal(labels, want) {
				t.Errorf("%s series %d: labels %v; want %v", tc.name, i, labels, want)
			}
			if tc.buckets == nil {
				continue
			}
			var bounds []float64
			for _, b := range m.GetHistogram().GetBucket() {
				if math.IsInf(b.GetUpperBound(), 1) {
					continue // the parser adds +Inf
				}
				bounds = append(bounds, b.GetUpperBound())
			}
			if !slices.Equal(bounds, tc.buckets) {
				t.Errorf("%s buckets %v; want vLLM's %v", tc.name, bounds, tc.buckets)
			}
			observed += m.GetHistogram().GetSampleCount()
		}
		if tc.buckets != nil && tc.name != stepengine.MetricITL && observed != 2 {
			t.Errorf("%s: %d observations; want one per request", tc.name, observed)
		}
	}
}
