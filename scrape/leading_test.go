package scrape_test

import (
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
)

// leadingOf is what a test expects of one rank's leading signals: -1 for
// a gauge left out, nil for a counter left out, else the counter's values
// by series in key order.
type leadingOf struct {
	rank                   uint32
	waiting, running       int64
	preemptions, prefilled []uint64
}

func (l leadingOf) check(t *testing.T, got scrape.RankLoad) {
	t.Helper()
	gauge := func(name string, o events.Optional, want int64) {
		t.Helper()
		if want < 0 && o.Set || want >= 0 && o != events.Some(uint64(want)) {
			t.Errorf("rank %d %s = %+v, want %d (-1: left out)", l.rank, name, o, want)
		}
	}
	counter := func(name string, c scrape.Counter, want []uint64) {
		t.Helper()
		var values []uint64
		if c != nil {
			values = []uint64{}
			for i, s := range c {
				values = append(values, s.Value)
				if i > 0 && s.Key <= c[i-1].Key {
					t.Errorf("rank %d %s: keys not ascending: %+v", l.rank, name, c)
				}
			}
		}
		if !reflect.DeepEqual(values, want) {
			t.Errorf("rank %d %s = %v, want %v (nil: left out)", l.rank, name, values, want)
		}
	}
	gauge("waiting", got.WaitingRequests, l.waiting)
	gauge("running", got.RunningRequests, l.running)
	counter("preemptions", got.Preemptions, l.preemptions)
	counter("prefilled", got.PrefilledTokens, l.prefilled)
}

func checkLeading(t *testing.T, snap scrape.Snapshot, want []leadingOf) {
	t.Helper()
	if len(snap.Ranks) != len(want) {
		t.Fatalf("%d ranks %+v, want %d", len(snap.Ranks), snap.Ranks, len(want))
	}
	for i, w := range want {
		if snap.Ranks[i].Rank != w.rank {
			t.Fatalf("rank %d at %d, want %d", snap.Ranks[i].Rank, i, w.rank)
		}
		w.check(t, snap.Ranks[i])
	}
}

// The fixtures' leading signals: the request gauges where the page has
// them; the counters of the pages that have them (no SGLang fixture but
// that of 2025 has a retraction count: sglang:num_retracted_reqs, a gauge
// of one interval, is not one).
func TestLeadingFixtures(t *testing.T) {
	t.Parallel()
	tests := []struct {
		file string
		m    scrape.Mapping
		want []leadingOf
	}{
		{"vllm-v1.metrics", scrape.VLLM{}, []leadingOf{{0, 3, 12, []uint64{0}, []uint64{142984}}}},
		{"vllm-v1-dp2.metrics", scrape.VLLM{}, []leadingOf{
			{0, 9, 57, []uint64{0}, []uint64{605117}}, {1, 0, 4, []uint64{0}, []uint64{613203}}}},
		{"vllm-v0.metrics", scrape.VLLM{}, []leadingOf{{0, 3, 12, []uint64{0}, []uint64{812890}}}},
		{"vllm-v1-early.metrics", scrape.VLLM{}, []leadingOf{{0, 0, 4, []uint64{0}, []uint64{9216}}}},
		{"vllm-v1-openmetrics.metrics", scrape.VLLM{}, []leadingOf{{0, 0, 4, []uint64{0}, []uint64{9216}}}},
		{"sglang.metrics", scrape.SGLang{}, []leadingOf{{0, 28, 162, nil, nil}}},
		// Two schedulers per rank report the same queue: never summed.
		{"sglang-dp2-tp4.metrics", scrape.SGLang{}, []leadingOf{{0, 0, 31, nil, nil}, {1, 6, 118, nil, nil}}},
		{"sglang-2025-no-total.metrics", scrape.SGLang{}, []leadingOf{{0, 6, 41, []uint64{0}, nil}}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			t.Parallel()
			checkLeading(t, tt.m.Loads(parseFile(t, tt.file)), tt.want)
		})
	}
}

// vllmPage writes the leading families of a vLLM V1 page with
// prompt_tokens_by_source (vLLM 0.11 and later), as PrometheusStatLogger
// declares them and prometheus_client writes them: labels sorted, a
// _created series after each counter's, one series per engine index and,
// for the tokens by source, per source. computed[i], cached[i] and
// preempted[i] are engine i's counts.
func vllmPage(waiting, running, preempted, computed, cached []int) string {
	var b strings.Builder
	const model = `model_name="Qwen/Qwen3-30B-A3B"`
	family := func(name, typ, help string, values []int) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
		for i, v := range values {
			sample := name
			if typ == "counter" {
				sample += "_total"
			}
			fmt.Fprintf(&b, "%s{engine=\"%d\",%s} %d.0\n", sample, i, model, v)
		}
	}
	family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", running)
	family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", waiting)
	family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", preempted)
	for i := range preempted {
		fmt.Fprintf(&b, "vllm:num_preemptions_created{engine=\"%d\",%s} 1.7795304812345e+09\n", i, model)
	}
	prompt := make([]int, len(computed))
	for i := range computed {
		prompt[i] = computed[i] + cached[i]
	}
	family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", prompt)
	b.WriteString("# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source counter\n")
	for _, src := range []struct {
		name   string
		values []int
	}{{"local_compute", computed}, {"local_cache_hit", cached}, {"external_kv_transfer", make([]int, len(computed))}} {
		for i, v := range src.values {
			fmt.Fprintf(&b, "vllm:prompt_tokens_by_source_total{engine=\"%d\",%s,source=\"%s\"} %d.0\n", i, model, src.name, v)
			fmt.Fprintf(&b, "vllm:prompt_tokens_by_source_created{engine=\"%d\",%s,source=\"%s\"} 1.7795304812345e+09\n", i, model, src.name)
		}
	}
	return b.String()
}

// sglangPage writes the leading families of an SGLang page of 2026 with
// --enable-metrics-for-all-schedulers, --dp 2 --tp 4
// --enable-dp-attention: two schedulers (tp ranks) per data-parallel rank,
// each reporting its rank's values, as SchedulerMetricsCollector declares
// them in prometheus_client's multiprocess mode (no _created series).
// Index i of each slice is dp rank i.
func sglangPage(queue, running, retracted, prefill, cache []int) string {
	var b strings.Builder
	labels := func(dp, tp int) string {
		return fmt.Sprintf(`dp_rank="%d",engine_type="unified",model_name="Qwen/Qwen3-30B-A3B",moe_ep_rank="%d",pp_rank="0",tp_rank="%d"`, dp, tp, tp)
	}
	family := func(name, typ, help string, values []int) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
		for dp, v := range values {
			for tp := 2 * dp; tp < 2*dp+2; tp++ {
				fmt.Fprintf(&b, "%s{%s} %d.0\n", name, labels(dp, tp), v)
			}
		}
	}
	family("sglang:num_running_reqs", "gauge", "The number of running requests.", running)
	family("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", queue)
	family("sglang:num_retracted_reqs", "gauge", "The number of retracted requests.", make([]int, len(queue)))
	family("sglang:num_retracted_requests_total", "counter", "Total number of retracted requests.", retracted)
	b.WriteString("# HELP sglang:realtime_tokens_total Total number of tokens processed (updated on each log interval). mode: prefill_compute, prefill_cache, decode.\n# TYPE sglang:realtime_tokens_total counter\n")
	for dp := range prefill {
		for tp := 2 * dp; tp < 2*dp+2; tp++ {
			fmt.Fprintf(&b, "sglang:realtime_tokens_total{%s,mode=\"prefill_compute\"} %d.0\n", labels(dp, tp), prefill[dp])
			fmt.Fprintf(&b, "sglang:realtime_tokens_total{%s,mode=\"prefill_cache\"} %d.0\n", labels(dp, tp), cache[dp])
			fmt.Fprintf(&b, "sglang:realtime_tokens_total{%s,mode=\"decode\"} %d.0\n", labels(dp, tp), 3*prefill[dp])
		}
	}
	return b.String()
}

func TestVLLMLeading(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		text string
		want []leadingOf
	}{
		{
			name: "computed prompt tokens: local_compute of prompt_tokens_by_source, not the cached ones",
			text: vllmPage([]int{9, 0}, []int{57, 4}, []int{2, 0}, []int{605117, 613203}, []int{1000, 0}),
			want: []leadingOf{{0, 9, 57, []uint64{2}, []uint64{605117}}, {1, 0, 4, []uint64{0}, []uint64{613203}}},
		},
		{
			name: "prompt_tokens_total where a rank has no prompt_tokens_by_source",
			text: "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 10\n" +
				"vllm:prompt_tokens_by_source_total{engine=\"1\",model_name=\"m\",source=\"local_cache_hit\"} 5\n" +
				"vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 15\nvllm:prompt_tokens_total{engine=\"1\",model_name=\"m\"} 7\n",
			want: []leadingOf{{0, -1, -1, nil, []uint64{10}}, {1, -1, -1, nil, []uint64{7}}},
		},
		{
			name: "a page without the leading families leaves them out",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n",
			want: []leadingOf{{0, -1, -1, nil, nil}},
		},
		{
			name: "a rank named only by a leading family is a rank",
			text: "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"3\",model_name=\"m\"} 2\n",
			want: []leadingOf{{3, 2, -1, nil, nil}},
		},
		{
			name: "distinct label sets of a rank add up; repeated ones do not",
			text: "vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 2\nvllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 3\n" +
				"vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 4\nvllm:num_requests_running{engine=\"0\",model_name=\"a\"} 6\n" +
				"vllm:num_preemptions_total{engine=\"0\",model_name=\"a\"} 1\nvllm:num_preemptions_total{engine=\"0\",model_name=\"b\"} 5\n",
			want: []leadingOf{{0, 5, 6, []uint64{1, 5}, nil}},
		},
		{
			name: "values that are no count are skipped; a fraction is rounded",
			text: "vllm:num_requests_waiting{engine=\"0\"} NaN\nvllm:num_requests_waiting{engine=\"1\"} -1\nvllm:num_requests_running{engine=\"0\"} 2.5\n" +
				"vllm:num_preemptions_total{engine=\"0\"} +Inf\nvllm:prompt_tokens_total{engine=\"0\"} 1e30\nvllm:prompt_tokens_total{engine=\"1\"} 12\n",
			want: []leadingOf{{0, -1, 3, nil, nil}, {1, -1, -1, nil, []uint64{12}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			checkLeading(t, scrape.VLLM{}.Loads(parseText(t, tt.text)), tt.want)
		})
	}
}

func TestSGLangLeading(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		text string
		want []leadingOf
	}{
		{
			name: "a rank's schedulers report the same values: one counts, never their sum",
			text: sglangPage([]int{0, 6}, []int{31, 118}, []int{1, 4}, []int{52000, 91000}, []int{1000, 2000}),
			want: []leadingOf{{0, 0, 31, []uint64{1}, []uint64{52000}}, {1, 6, 118, []uint64{4}, []uint64{91000}}},
		},
		{
			name: "the cumulative gauge total_retracted_reqs of older versions",
			text: "# TYPE sglang:total_retracted_reqs gauge\nsglang:total_retracted_reqs{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"} 17.0\n" +
				"# TYPE sglang:num_retracted_reqs gauge\nsglang:num_retracted_reqs{engine_type=\"unified\",model_name=\"m\",pid=\"7\",pp_rank=\"0\",tp_rank=\"0\"} 2.0\n",
			want: []leadingOf{{0, -1, -1, []uint64{17}, nil}},
		},
		{
			name: "num_retracted_requests_total wins over total_retracted_reqs, rank by rank",
			text: "sglang:num_retracted_requests_total{dp_rank=\"0\",tp_rank=\"0\"} 3\nsglang:total_retracted_reqs{dp_rank=\"0\",tp_rank=\"0\"} 9\n" +
				"sglang:total_retracted_reqs{dp_rank=\"1\",tp_rank=\"1\"} 5\n",
			want: []leadingOf{{0, -1, -1, []uint64{3}, nil}, {1, -1, -1, []uint64{5}, nil}},
		},
		{
			name: "per-priority series beside the total: the total counts",
			text: "sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\"} 7\nsglang:num_queue_reqs{model_name=\"m\",priority=\"0\",tp_rank=\"0\"} 4\n" +
				"sglang:num_queue_reqs{model_name=\"m\",priority=\"1\",tp_rank=\"0\"} 3\n" +
				"sglang:num_running_reqs{model_name=\"m\",priority=\"0\",tp_rank=\"0\"} 4\nsglang:num_running_reqs{model_name=\"m\",priority=\"1\",tp_rank=\"0\"} 5\n",
			// Running has only per-priority series: they partition the
			// requests, so they add up.
			want: []leadingOf{{0, 7, 9, nil, nil}},
		},
		{
			name: "only the prefill_compute mode of realtime_tokens_total",
			text: "sglang:realtime_tokens_total{mode=\"decode\",tp_rank=\"0\"} 900\nsglang:realtime_tokens_total{mode=\"prefill_cache\",tp_rank=\"0\"} 800\n" +
				"sglang:num_queue_reqs{tp_rank=\"0\"} 1\n",
			want: []leadingOf{{0, 1, -1, nil, nil}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			checkLeading(t, scrape.SGLang{}.Loads(parseText(t, tt.text)), tt.want)
		})
	}
}

func TestCounterSum(t *testing.T) {
	t.Parallel()
	series := func(kv ...any) scrape.Counter {
		c := scrape.Counter{}
		for i := 0; i < len(kv); i += 2 {
			c = append(c, scrape.CounterSeries{Key: kv[i].(string), Value: uint64(kv[i+1].(int))})
		}
		return c
	}
	steps := []struct {
		name   string
		page   scrape.Counter
		sum    uint64
		absent bool
	}{
		{"the first page is the baseline, however large", series("a", 1000, "b", 50), 0, false},
		{"increases add up", series("a", 1200, "b", 60), 210, false},
		{"a page lacking the counter leaves it out", nil, 210, true},
		{"the series compare with their last values", series("a", 1300, "b", 60), 310, false},
		{"a series that drops restarted from zero: all of it counts", series("a", 40, "b", 65), 355, false},
		{"a series a page lacks keeps its last value", series("b", 70), 360, false},
		{"... and the next page compares with it", series("a", 45, "b", 70), 365, false},
		{"a new series started after the first page: all of it counts", series("a", 45, "b", 70, "c", 8), 373, false},
	}
	var s scrape.CounterSum
	for _, st := range steps {
		sum, ok := s.Add(st.page)
		if sum != st.sum || ok == st.absent {
			t.Fatalf("%s: Add = %d, %v; want %d, %v", st.name, sum, ok, st.sum, !st.absent)
		}
	}

	// A counter absent from the first page: its series, when they come,
	// count from zero.
	var late scrape.CounterSum
	if sum, ok := late.Add(nil); sum != 0 || ok {
		t.Fatalf("first page without the counter: %d, %v", sum, ok)
	}
	if sum, ok := late.Add(series("x", 3)); sum != 3 || !ok {
		t.Fatalf("its first series: %d, %v; want 3, true", sum, ok)
	}

	// The sum stops at the largest uint64.
	var big scrape.CounterSum
	big.Add(scrape.Counter{{Key: "a", Value: 0}})
	big.Add(scrape.Counter{{Key: "a", Value: math.MaxUint64}})
	if sum, _ := big.Add(scrape.Counter{{Key: "a", Value: 5}}); sum != math.MaxUint64 {
		t.Fatalf("sum %d, want it saturated", sum)
	}
}

// Page after page, an engine's counters become reports' counters that
// never go down: the engine restarted between the second and third page
// (its counters fell to small values), and a page lacked a metric.
func TestCountersAcrossPages(t *testing.T) {
	t.Parallel()
	type page struct {
		text                   string
		preemptions, prefilled []int64 // per rank; -1: left out
	}
	tests := []struct {
		name  string
		m     scrape.Mapping
		pages []page
	}{
		{"vllm", scrape.VLLM{}, []page{
			{vllmPage([]int{1, 0}, []int{5, 5}, []int{4, 0}, []int{10000, 20000}, []int{500, 0}), []int64{0, 0}, []int64{0, 0}},
			{vllmPage([]int{0, 0}, []int{6, 5}, []int{6, 1}, []int{10800, 20100}, []int{900, 0}), []int64{2, 1}, []int64{800, 100}},
			// Restarted: the counts start again from zero.
			{vllmPage([]int{0, 0}, []int{1, 1}, []int{0, 0}, []int{300, 50}, []int{0, 0}), []int64{2, 1}, []int64{1100, 150}},
			// Without the preemption counter (the family missing).
			{strings.ReplaceAll(vllmPage([]int{0, 0}, []int{1, 1}, []int{9, 9}, []int{400, 60}, []int{0, 0}), "num_preemptions", "other"),
				[]int64{-1, -1}, []int64{1200, 160}},
			{vllmPage([]int{0, 0}, []int{1, 1}, []int{1, 2}, []int{400, 70}, []int{0, 0}), []int64{3, 3}, []int64{1200, 170}},
		}},
		{"sglang", scrape.SGLang{}, []page{
			{sglangPage([]int{0, 6}, []int{31, 118}, []int{7, 3}, []int{52000, 91000}, []int{0, 0}), []int64{0, 0}, []int64{0, 0}},
			{sglangPage([]int{0, 6}, []int{31, 118}, []int{8, 3}, []int{53000, 91500}, []int{0, 0}), []int64{1, 0}, []int64{1000, 500}},
			{sglangPage([]int{0, 0}, []int{2, 2}, []int{0, 1}, []int{700, 900}, []int{0, 0}), []int64{1, 1}, []int64{1700, 1400}},
			{strings.ReplaceAll(sglangPage([]int{0, 0}, []int{2, 2}, []int{5, 5}, []int{800, 950}, []int{0, 0}), "realtime_tokens", "other"),
				[]int64{6, 5}, []int64{-1, -1}},
			{sglangPage([]int{0, 0}, []int{2, 2}, []int{5, 5}, []int{900, 1000}, []int{0, 0}), []int64{6, 5}, []int64{1900, 1500}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			sums := map[uint32]*[2]scrape.CounterSum{}
			for i, p := range tt.pages {
				snap := tt.m.Loads(parseText(t, p.text))
				if len(snap.Ranks) != 2 {
					t.Fatalf("page %d: ranks %+v", i, snap.Ranks)
				}
				for _, r := range snap.Ranks {
					s := sums[r.Rank]
					if s == nil {
						s = &[2]scrape.CounterSum{}
						sums[r.Rank] = s
					}
					for j, c := range []struct {
						name string
						page scrape.Counter
						want int64
					}{{"preemptions", r.Preemptions, p.preemptions[r.Rank]}, {"prefilled", r.PrefilledTokens, p.prefilled[r.Rank]}} {
						sum, ok := s[j].Add(c.page)
						if c.want < 0 && ok || c.want >= 0 && (!ok || sum != uint64(c.want)) {
							t.Errorf("page %d rank %d %s: %d, %v; want %d (-1: left out)", i, r.Rank, c.name, sum, ok, c.want)
						}
					}
				}
			}
		})
	}
}
