package scrape_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/workermon/workermon/scrape"
)

// FuzzParseAndMap feeds arbitrary bytes to the parser and every engine's
// mapping: an engine's page is network input, so nothing may panic, and
// what a mapping returns must be well formed.
func FuzzParseAndMap(f *testing.F) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.metrics"))
	if err != nil {
		f.Fatal(err)
	}
	// The fixtures' families that matter, plus a histogram and a summary:
	// whole pages (up to 100 KB) would spend the fuzzing time minimizing.
	keep := []string{"kv_cache_usage_perc", "gpu_cache_usage_perc", "cache_config_info", "num_used_tokens",
		"max_total_num_tokens", "token_usage", "request_params_n", "http_request_size_bytes", "# EOF",
		"num_requests_waiting", "num_requests_running", "num_preemptions", "prompt_tokens", "num_queue_reqs",
		"num_running_reqs", "retracted", "realtime_tokens"}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		var seed []byte
		for line := range bytes.Lines(data) {
			for _, k := range keep {
				if bytes.Contains(line, []byte(k)) {
					seed = append(seed, line...)
					break
				}
			}
		}
		f.Add(seed)
	}
	f.Add([]byte("vllm:kv_cache_usage_perc{engine=\"1\"} 0.5\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"7\"} 1\n"))
	f.Add([]byte("sglang:num_used_tokens{dp_rank=\"2\",tp_rank=\"0\"} 1e300\nsglang:max_total_num_tokens{dp_rank=\"2\",tp_rank=\"0\"} 3\n"))
	f.Add([]byte("{\"vllm:kv_cache_usage_perc\",\"engine\"=\"0\"} NaN\n"))
	f.Add([]byte("vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"local_compute\"} 5\nvllm:prompt_tokens_total{engine=\"1\"} 9\n"))
	f.Add([]byte("sglang:num_queue_reqs{dp_rank=\"1\",priority=\"2\",tp_rank=\"0\"} 3\nsglang:num_queue_reqs{dp_rank=\"1\",tp_rank=\"1\"} 4\n" +
		"sglang:realtime_tokens_total{dp_rank=\"1\",mode=\"prefill_compute\"} 1e19\nsglang:total_retracted_reqs 2\n"))
	f.Add([]byte("\ufeffsglang:token_usage{name=\"m\"} 0.5\r\nsglang:max_total_num_tokens{name=\"m\"} 9\r\nsglang:num_used_tokens{a=\"1\"} 3"))
	f.Fuzz(func(t *testing.T, data []byte) {
		fams, err := scrape.Parse(bytes.NewReader(data))
		if err != nil {
			return
		}
		for _, name := range scrape.Engines() {
			m, err := scrape.ForEngine(name)
			if err != nil {
				t.Fatal(err)
			}
			snap := m.Loads(fams)
			for i, r := range snap.Ranks {
				if i > 0 && r.Rank <= snap.Ranks[i-1].Rank {
					t.Fatalf("%s: ranks not strictly ascending: %+v", name, snap.Ranks)
				}
				if r.ActiveDecodeBlocks.Set && !r.KVTotalBlocks.Set && name == scrape.EngineVLLM {
					t.Fatalf("%s: rank %d has used blocks without a total", name, r.Rank)
				}
				if r.KVTotalBlocks.Set && r.KVTotalBlocks.Value == 0 {
					t.Fatalf("%s: rank %d reports a total of 0", name, r.Rank)
				}
				for _, c := range []scrape.Counter{r.Preemptions, r.PrefilledTokens} {
					for i := 1; i < len(c); i++ {
						if c[i].Key <= c[i-1].Key {
							t.Fatalf("%s: rank %d counter series not strictly ascending by key: %+v", name, r.Rank, c)
						}
					}
				}
			}
		}
	})
}
