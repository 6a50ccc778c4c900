package adapter_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
)

// vllmLeadingPage is a vLLM V1 page of one engine (0.11 and later:
// prompt_tokens_by_source) with its KV usage and the leading families of
// contract §21, as prometheus_client writes them. withCounters false
// leaves both counter families out.
func vllmLeadingPage(waiting, running, preempted, computed int, withCounters bool) []byte {
	var b strings.Builder
	const l = `engine="0",model_name="Qwen/Qwen3-0.6B"`
	b.WriteString("# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\n")
	fmt.Fprintf(&b, "vllm:num_requests_running{%s} %d.0\n", l, running)
	b.WriteString("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n# TYPE vllm:num_requests_waiting gauge\n")
	fmt.Fprintf(&b, "vllm:num_requests_waiting{%s} %d.0\n", l, waiting)
	b.WriteString("# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n")
	fmt.Fprintf(&b, "vllm:kv_cache_usage_perc{%s} 0.25\n", l)
	if withCounters {
		b.WriteString("# HELP vllm:num_preemptions Cumulative number of preemption from the engine.\n# TYPE vllm:num_preemptions counter\n")
		fmt.Fprintf(&b, "vllm:num_preemptions_total{%s} %d.0\nvllm:num_preemptions_created{%s} 1.7795304812345e+09\n", l, preempted, l)
		b.WriteString("# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source counter\n")
		for _, src := range []struct {
			name string
			n    int
		}{{"local_compute", computed}, {"local_cache_hit", 5 * computed}, {"external_kv_transfer", 0}} {
			fmt.Fprintf(&b, "vllm:prompt_tokens_by_source_total{%s,source=\"%s\"} %d.0\n", l, src.name, src.n)
		}
	}
	b.WriteString("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n")
	fmt.Fprintf(&b, "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0\n")
	return []byte(b.String())
}

// The adapter publishes the engine's request gauges as they are and its
// counters as the sums of the increases since its first scrape: they start
// at 0, never go down when the engine restarts under the adapter (its
// counts fall to small values), and a page lacking them leaves them out
// (the reports keep the last value).
func TestLeadingSignalsArePublished(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	eng := newEngine(t, vllmLeadingPage(3, 5, 4, 10000, true))
	start(t, e.config(scrape.VLLM{}, eng.url()))

	var lastPreempt, lastPrefilled uint64
	wait := func(step string, ok func(r events.LoadReport) bool) events.LoadReport {
		t.Helper()
		return in.waitReport(t, func(r events.LoadReport) bool {
			if !r.Preemptions.Set || !r.PrefilledTokens.Set {
				t.Fatalf("%s: a report without the counters: %+v", step, r)
			}
			if r.Preemptions.Value < lastPreempt || r.PrefilledTokens.Value < lastPrefilled {
				t.Fatalf("%s: a counter went down: preemptions %d after %d, prefilled %d after %d", step,
					r.Preemptions.Value, lastPreempt, r.PrefilledTokens.Value, lastPrefilled)
			}
			lastPreempt, lastPrefilled = r.Preemptions.Value, r.PrefilledTokens.Value
			return ok(r)
		})
	}
	steps := []struct {
		name                   string
		page                   []byte
		waiting, running       uint64
		preemptions, prefilled uint64
	}{
		// The engine's counts so far are the baseline.
		{"first page", nil, 3, 5, 0, 0},
		{"counts grow", vllmLeadingPage(0, 6, 6, 10800, true), 0, 6, 2, 800},
		{"the engine restarted", vllmLeadingPage(1, 1, 1, 300, true), 1, 1, 3, 1100},
		{"a page without the counters", vllmLeadingPage(7, 2, 0, 0, false), 7, 2, 3, 1100},
		{"they come back", vllmLeadingPage(0, 2, 1, 450, true), 0, 2, 3, 1250},
	}
	for _, st := range steps {
		if st.page != nil {
			eng.set(st.page, 0, false)
		}
		r := wait(st.name, func(r events.LoadReport) bool {
			return r.WaitingRequests == some(st.waiting) && r.RunningRequests == some(st.running) &&
				r.Preemptions == some(st.preemptions) && r.PrefilledTokens == some(st.prefilled)
		})
		if r.ActiveDecodeBlocks != some(250) || r.KVTotalBlocks != some(1000) || r.KVCommittedBlocks.Set {
			t.Errorf("%s: KV fields %+v %+v, committed %+v", st.name, r.ActiveDecodeBlocks, r.KVTotalBlocks, r.KVCommittedBlocks)
		}
	}
}

// A page without the counters never publishes them: left out, not 0.
func TestLeadingSignalsLeftOut(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	eng := newEngine(t, fixture(t, "sglang.metrics")) // gauges, no counters
	start(t, e.config(scrape.SGLang{}, eng.url()))
	for range 3 {
		r := in.waitReport(t, func(events.LoadReport) bool { return true })
		if r.WaitingRequests != some(28) || r.RunningRequests != some(162) {
			t.Errorf("request gauges %+v %+v, want 28 and 162", r.WaitingRequests, r.RunningRequests)
		}
		if r.Preemptions.Set || r.PrefilledTokens.Set || r.KVCommittedBlocks.Set {
			t.Errorf("fields the page lacks are set: %+v", r)
		}
	}
}
