package scrape

import (
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"

	"github.com/workermon/workermon/events"
)

// The leading signals of contract §21 that a stock engine's page gives: the
// requests waiting and running (gauges), and the preemptions and prompt
// tokens computed (counters). The names, confirmed against each engine's
// source (docs/engines.md has the table with the files):
//
//   - vLLM (vllm/v1/metrics/loggers.py, PrometheusStatLogger; labels
//     model_name and engine): vllm:num_requests_waiting,
//     vllm:num_requests_running, vllm:num_preemptions_total, and
//     vllm:prompt_tokens_by_source_total{source="local_compute"} (the prompt
//     tokens the engine computed, without those from its prefix cache or a
//     KV transfer), else vllm:prompt_tokens_total (every prompt token).
//   - SGLang (python/sglang/srt/metrics/collector.py,
//     SchedulerMetricsCollector; the scheduler's labels model_name,
//     engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank): sglang:num_queue_reqs,
//     sglang:num_running_reqs, sglang:num_retracted_requests_total (older:
//     sglang:total_retracted_reqs, a gauge that only grows) and
//     sglang:realtime_tokens_total{mode="prefill_compute"}.
//
// How a rank's several series combine: series whose labels differ only in a
// replica label (SGLang's tp_rank, pp_rank, moe_ep_rank and pid: schedulers
// that each report the same queue) are one series, the largest value of
// them counting; the remaining distinct label sets (another model_name,
// engine_type or priority) count apart, and a gauge is their sum. Where
// SGLang writes per-priority series beside the total (a series without a
// priority label), only the total counts.
//
// A counter is returned series by series (Counter): a CounterSum adds up
// their increases page after page, so that one series restarting (an
// engine restarted, a new pid) does not look like a decrease of the sum.

// Metric names and labels of the leading signals.
const (
	// VLLMWaitingMetric is vLLM's gauge of the requests waiting to be
	// scheduled, preempted ones included.
	VLLMWaitingMetric = "vllm:num_requests_waiting"
	// VLLMRunningMetric is vLLM's gauge of the requests scheduled.
	VLLMRunningMetric = "vllm:num_requests_running"
	// VLLMPreemptionsMetric is vLLM's counter of preemptions.
	VLLMPreemptionsMetric = "vllm:num_preemptions_total"
	// VLLMPromptBySourceMetric is vLLM's counter of prompt tokens by
	// source; its source="local_compute" series counts the tokens the
	// engine computed.
	VLLMPromptBySourceMetric = "vllm:prompt_tokens_by_source_total"
	// VLLMPromptSourceLabel and VLLMPromptComputed select the computed
	// tokens of VLLMPromptBySourceMetric.
	VLLMPromptSourceLabel = "source"
	VLLMPromptComputed    = "local_compute"
	// VLLMPromptMetric is vLLM's counter of every prompt token, read for
	// a rank without VLLMPromptBySourceMetric (vLLM before it).
	VLLMPromptMetric = "vllm:prompt_tokens_total"

	// SGLangWaitingMetric is SGLang's gauge of the requests in the
	// waiting queue.
	SGLangWaitingMetric = "sglang:num_queue_reqs"
	// SGLangRunningMetric is SGLang's gauge of the running requests.
	SGLangRunningMetric = "sglang:num_running_reqs"
	// SGLangRetractionsMetric is SGLang's counter of retracted requests
	// (its preemptions).
	SGLangRetractionsMetric = "sglang:num_retracted_requests_total"
	// SGLangLegacyRetractionsMetric is the same count in older versions, a
	// gauge that only grows; read for a rank without
	// SGLangRetractionsMetric. (sglang:num_retracted_reqs, a gauge of one
	// log interval's retractions, is not a count since start: not read.)
	SGLangLegacyRetractionsMetric = "sglang:total_retracted_reqs"
	// SGLangTokensMetric is SGLang's counter of tokens processed by mode;
	// its mode="prefill_compute" series counts the prompt tokens computed.
	SGLangTokensMetric = "sglang:realtime_tokens_total"
	// SGLangTokensModeLabel and SGLangPrefillCompute select them.
	SGLangTokensModeLabel = "mode"
	SGLangPrefillCompute  = "prefill_compute"
	// SGLangPriorityLabel marks SGLang's per-priority series.
	SGLangPriorityLabel = "priority"
)

// sglangReplicaLabels name the schedulers that report the same rank.
var sglangReplicaLabels = []string{"tp_rank", "pp_rank", "moe_ep_rank", "pid"}

// Counter is one rank's engine counter as one page gives it: the value of
// each series that counts on its own, by Key, ascending. Nil: the page does
// not export the counter for the rank.
type Counter []CounterSeries

// CounterSeries is one series of a Counter: Key names it (its family and
// its labels but the rank's and the replicas'), Value is its count.
type CounterSeries struct {
	Key   string
	Value uint64
}

// reading says how a family is read.
type reading struct {
	rankLabel string
	// replicas are labels of series that report the same thing.
	replicas []string
	// totalLabel, when set, marks partial series: where a rank has series
	// without it, only those count.
	totalLabel string
	// keep selects the samples read; nil: all.
	keep func(*dto.Metric) bool
}

// groups reads family name per rank: for each rank, the value of each
// distinct series (replicas merged, the largest value counting), by key.
// Samples that are not finite, negative or beyond uint64 are skipped; a
// series whose every sample is skipped is left out.
func (rd reading) groups(fams Families, name string) map[uint32]map[string]uint64 {
	mf := fams[name]
	if mf == nil {
		return nil
	}
	out := map[uint32]map[string]uint64{}
	partial := map[uint32]map[string]bool{}
	for _, m := range mf.GetMetric() {
		if rd.keep != nil && !rd.keep(m) {
			continue
		}
		rank, ok := rankOf(m, rd.rankLabel)
		if !ok {
			continue
		}
		v, ok := sampleValue(m)
		if !ok {
			continue
		}
		n, ok := count(v)
		if !ok {
			continue
		}
		key := name + "\xfd" + rd.key(m)
		byKey := out[rank]
		if byKey == nil {
			byKey = map[string]uint64{}
			out[rank] = byKey
			partial[rank] = map[string]bool{}
		}
		if old, seen := byKey[key]; !seen || n > old {
			byKey[key] = n
		}
		if rd.totalLabel != "" {
			if p, _ := label(m, rd.totalLabel); p != "" {
				partial[rank][key] = true
			}
		}
	}
	for rank, byKey := range out {
		if len(partial[rank]) < len(byKey) { // some series are totals
			for key := range partial[rank] {
				delete(byKey, key)
			}
		}
	}
	return out
}

// key identifies a series by its labels but the rank's and the replicas',
// in the order the names sort.
func (rd reading) key(m *dto.Metric) string {
	pairs := make([]string, 0, len(m.GetLabel()))
	for _, lp := range m.GetLabel() {
		if n := lp.GetName(); n != rd.rankLabel && !slices.Contains(rd.replicas, n) {
			pairs = append(pairs, n+"\xff"+lp.GetValue())
		}
	}
	slices.Sort(pairs)
	return strings.Join(pairs, "\xfe")
}

// gauge sums a rank's series.
func gauge(byKey map[string]uint64) events.Optional {
	if byKey == nil {
		return events.Optional{}
	}
	var sum uint64
	for _, v := range byKey {
		sum = addSaturating(sum, v)
	}
	return events.Some(sum)
}

// counter lists a rank's series by key.
func counter(byKey map[string]uint64) Counter {
	if byKey == nil {
		return nil
	}
	c := make(Counter, 0, len(byKey))
	for k, v := range byKey {
		c = append(c, CounterSeries{Key: k, Value: v})
	}
	slices.SortFunc(c, func(a, b CounterSeries) int { return strings.Compare(a.Key, b.Key) })
	return c
}

// leading is what one page gives of the leading signals, by rank.
type leading struct {
	waiting, running       map[uint32]map[string]uint64
	preemptions, prefilled map[uint32]map[string]uint64
}

// ranks names every rank of the leading signals.
func (l leading) ranks(into map[uint32]bool) {
	for _, m := range []map[uint32]map[string]uint64{l.waiting, l.running, l.preemptions, l.prefilled} {
		for r := range m {
			into[r] = true
		}
	}
}

// fill sets rl's leading signals.
func (l leading) fill(rl *RankLoad) {
	rl.WaitingRequests = gauge(l.waiting[rl.Rank])
	rl.RunningRequests = gauge(l.running[rl.Rank])
	rl.Preemptions = counter(l.preemptions[rl.Rank])
	rl.PrefilledTokens = counter(l.prefilled[rl.Rank])
}

// firstOf takes, rank by rank, the first family's series, else the
// second's.
func firstOf(first, second map[uint32]map[string]uint64) map[uint32]map[string]uint64 {
	if first == nil {
		return second
	}
	for r, byKey := range second {
		if _, ok := first[r]; !ok {
			first[r] = byKey
		}
	}
	return first
}

// labelIs selects the samples whose label name is value.
func labelIs(name, value string) func(*dto.Metric) bool {
	return func(m *dto.Metric) bool {
		v, _ := label(m, name)
		return v == value
	}
}

// vllmLeading reads vLLM's leading signals.
func vllmLeading(fams Families) leading {
	rd := reading{rankLabel: VLLMRankLabel}
	computed := rd
	computed.keep = labelIs(VLLMPromptSourceLabel, VLLMPromptComputed)
	return leading{
		waiting:     rd.groups(fams, VLLMWaitingMetric),
		running:     rd.groups(fams, VLLMRunningMetric),
		preemptions: rd.groups(fams, VLLMPreemptionsMetric),
		prefilled:   firstOf(computed.groups(fams, VLLMPromptBySourceMetric), rd.groups(fams, VLLMPromptMetric)),
	}
}

// sglangLeading reads SGLang's leading signals.
func sglangLeading(fams Families) leading {
	rd := reading{rankLabel: SGLangRankLabel, replicas: sglangReplicaLabels, totalLabel: SGLangPriorityLabel}
	prefill := rd
	prefill.keep = labelIs(SGLangTokensModeLabel, SGLangPrefillCompute)
	return leading{
		waiting:     rd.groups(fams, SGLangWaitingMetric),
		running:     rd.groups(fams, SGLangRunningMetric),
		preemptions: firstOf(rd.groups(fams, SGLangRetractionsMetric), rd.groups(fams, SGLangLegacyRetractionsMetric)),
		prefilled:   prefill.groups(fams, SGLangTokensMetric),
	}
}

// addSaturating returns a+b, or the largest uint64 when that overflows.
func addSaturating(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}
