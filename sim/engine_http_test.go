package sim_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/workermon/workermon/scrape"
	"github.com/workermon/workermon/sim"
	"github.com/workermon/workermon/sim/stepengine"
)

// offlineWorker returns a one-rank worker of profile that stays off NATS.
func offlineWorker(t *testing.T, profile string, change func(*sim.EngineConfig)) *sim.Worker {
	t.Helper()
	cfg := sim.DefaultWorkerConfig()
	cfg.Ranks = 1
	cfg.Engine.Profile = profile
	if change != nil {
		change(&cfg.Engine)
	}
	cfg.Publish.Disabled = true
	cfg.NATS.URL = "nats://127.0.0.1:1" // never dialled
	return startWorker(t, cfg)
}

// families reads and parses w's /metrics page.
func families(t *testing.T, w *sim.Worker) scrape.Families {
	t.Helper()
	resp, err := http.Get(w.Endpoint() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	fams, err := scrape.Parse(resp.Body)
	if err != nil {
		t.Fatalf("the page does not parse: %v", err)
	}
	return fams
}

// histogram returns the sample count and sum of the one series of a
// histogram family.
func histogram(t *testing.T, fams scrape.Families, name string) (uint64, float64) {
	t.Helper()
	mf := fams[name]
	if mf == nil || mf.GetType() != dto.MetricType_HISTOGRAM || len(mf.Metric) != 1 {
		t.Fatalf("%s: %v; want one histogram series", name, mf)
	}
	h := mf.Metric[0].GetHistogram()
	return h.GetSampleCount(), h.GetSampleSum()
}

// completeMany sends n non-streamed completions at once of prompt words and
// maxTokens tokens and waits for them all; each must succeed.
func completeMany(t *testing.T, w *sim.Worker, n, words, maxTokens int) {
	t.Helper()
	prompt := strings.Repeat("abc ", words)
	var wg sync.WaitGroup
	errs := make(chan string, n)
	for range n {
		wg.Go(func() {
			resp, err := tryPost(t.Context(), w.Endpoint()+"/v1/completions",
				map[string]any{"model": w.Model(), "prompt": prompt, "max_tokens": maxTokens})
			if err != nil {
				errs <- err.Error()
				return
			}
			defer resp.Body.Close()
			_, _ = io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != http.StatusOK {
				errs <- resp.Status
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatalf("a completion failed: %s", e)
	}
}

// Admitting more slows everyone down: the mean inter-token latency of
// vLLM's histogram on /metrics grows with the requests decoding together.
// The latencies are the engine's scheduled step times, not the wall clock,
// so a loaded host does not change them.
func TestITLGrowsWithConcurrency(t *testing.T) {
	t.Parallel()
	w := offlineWorker(t, stepengine.ProfileTiny, nil)
	meanITL := func(n int) float64 {
		c0, s0 := histogram(t, families(t, w), stepengine.MetricITL)
		completeMany(t, w, n, 200, 40)
		c1, s1 := histogram(t, families(t, w), stepengine.MetricITL)
		if want := uint64(n * 39); c1-c0 != want {
			t.Fatalf("%d requests: %d inter-token latencies observed; want %d", n, c1-c0, want)
		}
		return (s1 - s0) / float64(c1-c0)
	}
	alone := meanITL(1)
	batch := meanITL(24)
	t.Logf("mean ITL alone %.1f ms, 24 at once %.1f ms", 1000*alone, 1000*batch)
	if batch < 1.5*alone {
		t.Errorf("mean ITL with 24 requests at once %.1f ms; want at least 1.5 × %.1f ms alone", 1000*batch, 1000*alone)
	}
	if c, _ := histogram(t, families(t, w), stepengine.MetricE2E); c != 25 {
		t.Errorf("%d end-to-end latencies; want 25", c)
	}
	if c, _ := histogram(t, families(t, w), stepengine.MetricTTFT); c != 25 {
		t.Errorf("%d times to first token; want 25", c)
	}
}

// Under overload a small KV cache preempts, and vllm:num_preemptions_total
// says so; every request still finishes and the cache is empty after.
func TestPreemptionsUnderOverload(t *testing.T) {
	t.Parallel()
	w := offlineWorker(t, stepengine.ProfileTiny, func(e *sim.EngineConfig) { e.KVBlocks, e.DecodeSpeed = 64, 400 })
	completeMany(t, w, 16, 100, 100)
	fams := families(t, w)
	mf := fams[stepengine.MetricPreemptions]
	if mf == nil || mf.GetType() != dto.MetricType_COUNTER || len(mf.Metric) != 1 {
		t.Fatalf("%s: %v", stepengine.MetricPreemptions, mf)
	}
	if got := mf.Metric[0].GetCounter().GetValue(); got < 1 {
		t.Errorf("%s = %v after overloading 64 blocks with 16 requests of 200 tokens", stepengine.MetricPreemptions, got)
	}
	waitUntil(t, "the cache to empty", func() bool {
		s := w.Stats()
		return s.InFlight == 0 && s.Ranks[0].ActiveDecodeBlocks == 0
	})
	if s := w.Stats(); s.Ranks[0].Preemptions < 1 || s.Served != 16 {
		t.Errorf("stats %+v; want preemptions and 16 served", s)
	}
}

// A client that goes away frees its blocks at once, waiting or running.
func TestDisconnectFreesBlocks(t *testing.T) {
	t.Parallel()
	w := offlineWorker(t, stepengine.ProfileTiny, nil)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			resp, err := tryPost(ctx, w.Endpoint()+"/v1/completions",
				map[string]any{"model": w.Model(), "prompt": strings.Repeat("abc ", 500), "max_tokens": 5000, "stream": true})
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	waitUntil(t, "every request in the engine, blocks held", func() bool {
		s := w.Stats()
		return s.InFlight == 8 && s.Ranks[0].ActiveDecodeBlocks > 0
	})
	cancel()
	wg.Wait()
	waitUntil(t, "every block freed", func() bool {
		s := w.Stats()
		return s.InFlight == 0 && s.Ranks[0].ActiveDecodeBlocks == 0 && s.Ranks[0].ActivePrefillTokens == 0
	})
	if s := w.Stats(); s.Cancelled != 8 {
		t.Errorf("cancelled %d; want 8", s.Cancelled)
	}
}
