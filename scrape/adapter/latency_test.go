package adapter_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/scrape"
)

// latencyPage is a vLLM page with one rank and a TTFT histogram holding n
// samples under 100 ms.
func latencyPage(n uint64) []byte {
	c := strconv.FormatUint(n, 10)
	return []byte(`# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} ` + c + `
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} ` + c + `
vllm:time_to_first_token_seconds_sum{engine="0"} 1
vllm:time_to_first_token_seconds_count{engine="0"} ` + c + `
`)
}

// TestLatencyWindows: the samples the engine's TTFT histogram gains go out
// as an engine's latency window on the lat subject of the worker.
func TestLatencyWindows(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	e := newEngine(t, latencyPage(10))
	cfg := env.config(scrape.VLLM{}, e.url())
	cfg.LatencyWindow = 50 * time.Millisecond
	got := make(chan events.LatencyReport, 64)
	sub, err := env.obs.Subscribe(events.LatSubject(events.DefaultSubjectPrefix, cfg.Model, cfg.WorkerID), func(m *nats.Msg) {
		r, err := events.DecodeLatencyReport(m.Data)
		if err != nil {
			t.Errorf("decode: %v", err)
			return
		}
		got <- r
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := env.obs.Flush(); err != nil {
		t.Fatal(err)
	}
	start(t, cfg)
	// The first scrapes set the baseline; then the engine serves 25 more.
	natstest.WaitFor(t, 5*time.Second, "first scrapes", func() bool { return e.hits.Load() >= 3 })
	e.set(latencyPage(35), 0, false)
	var n uint64
	deadline := time.After(5 * time.Second)
	for n < 25 {
		select {
		case r := <-got:
			if r.Source != events.SourceEngine || r.WorkerID != cfg.WorkerID || len(r.ITL) != 0 {
				t.Fatalf("report %+v", r)
			}
			for _, b := range r.TTFT {
				if b.K > events.LatencyBucketOf(100) {
					t.Errorf("bucket %d over 100 ms", b.K)
				}
				n += b.N
			}
		case <-deadline:
			t.Fatalf("%d of 25 samples published", n)
		}
	}
	if n != 25 {
		t.Errorf("%d samples, want 25", n)
	}
}
