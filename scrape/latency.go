package scrape

import (
	"math"
	"slices"

	"github.com/workermon/workermon/events"
)

// Latency histograms (contract §18): the engines' TTFT and ITL histograms,
// from which the scrape sidecar derives latency windows as the difference
// between two scrapes.
//
//   - vLLM: vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds
//     (older versions: vllm:time_per_output_token_seconds).
//   - SGLang: sglang:time_to_first_token_seconds,
//     sglang:inter_token_latency_seconds (older versions:
//     sglang:time_per_output_token_seconds).
//
// Every series of a family (ranks, label sets) is added up.

// latencyNames are each engine's TTFT and ITL families, the current ITL
// name first.
var latencyNames = map[string]struct {
	ttft string
	itl  []string
}{
	EngineVLLM:   {"vllm:time_to_first_token_seconds", []string{"vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"}},
	EngineSGLang: {"sglang:time_to_first_token_seconds", []string{"sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"}},
}

// Histogram is a cumulative histogram: Upper are the buckets' upper bounds
// in seconds, ascending, the last +Inf; Cumulative the samples at or under
// each.
type Histogram struct {
	Upper      []float64
	Cumulative []uint64
}

// LatencyHistograms returns the engine's TTFT and ITL histograms in fams,
// nil for one the page lacks.
func LatencyHistograms(engine string, fams Families) (ttft, itl *Histogram) {
	names, ok := latencyNames[engine]
	if !ok {
		return nil, nil
	}
	ttft = histogramOf(fams, names.ttft)
	for _, n := range names.itl {
		if itl = histogramOf(fams, n); itl != nil {
			break
		}
	}
	return ttft, itl
}

// histogramOf adds up the series of a histogram family.
func histogramOf(fams Families, name string) *Histogram {
	mf := fams[name]
	if mf == nil {
		return nil
	}
	sum := map[float64]uint64{}
	var total uint64
	seen := false
	for _, m := range mf.GetMetric() {
		h := m.GetHistogram()
		if h == nil {
			continue
		}
		seen = true
		for _, b := range h.GetBucket() {
			if ub := b.GetUpperBound(); !math.IsNaN(ub) {
				sum[ub] += b.GetCumulativeCount()
			}
		}
		total += h.GetSampleCount()
	}
	if !seen {
		return nil
	}
	sum[math.Inf(1)] = max(sum[math.Inf(1)], total)
	out := &Histogram{}
	for ub := range sum {
		out.Upper = append(out.Upper, ub)
	}
	slices.Sort(out.Upper)
	var prev uint64
	for _, ub := range out.Upper {
		c := max(sum[ub], prev) // cumulative never falls
		out.Cumulative = append(out.Cumulative, c)
		prev = c
	}
	return out
}

// Window returns the samples cur holds beyond prev in the buckets of
// contract §18, sparse and ascending. A Prometheus bucket (lo, hi] is spread
// over the §18 buckets it covers in proportion to their overlap in log
// scale (the first bucket as (hi/2, hi], the +Inf bucket as (lo, 2·lo]). A
// prev that is nil, of another layout, or above cur anywhere (the engine
// restarted) counts as empty.
func Window(prev, cur *Histogram) []events.LatencyBucket {
	if cur == nil {
		return nil
	}
	same := prev != nil && slices.Equal(prev.Upper, cur.Upper)
	if same {
		for i := range cur.Cumulative {
			if cur.Cumulative[i] < prev.Cumulative[i] {
				same = false
				break
			}
		}
	}
	var counts [events.LatencyMaxBucket + 1]uint64
	var below, belowPrev uint64
	for i, ub := range cur.Upper {
		c := cur.Cumulative[i]
		var p uint64
		if same {
			p = prev.Cumulative[i]
		}
		d := int64(c-below) - int64(p-belowPrev)
		below, belowPrev = c, p
		if d <= 0 {
			continue
		}
		var lo, hi float64 // ms
		switch {
		case i == 0:
			hi = ub * 1000
			lo = hi / 2
		case math.IsInf(ub, 1):
			lo = cur.Upper[i-1] * 1000
			hi = 2 * lo
		default:
			lo, hi = cur.Upper[i-1]*1000, ub*1000
		}
		spread(&counts, lo, hi, uint64(d))
	}
	var out []events.LatencyBucket
	for k, n := range counts {
		if n > 0 {
			out = append(out, events.LatencyBucket{K: uint8(k), N: n})
		}
	}
	return out
}

// spread adds n samples spread over (lo, hi] ms in log scale, rounded to
// whole samples within the range (largest remainders first), so that every
// Prometheus bucket keeps its own count.
//
// A range that is not finite in milliseconds (a bound of an engine's page
// above about 1.8e305 s) goes whole to the bucket of its upper end, the
// last; the part of a range above the last bucket's lower end goes to it.
func spread(counts *[events.LatencyMaxBucket + 1]uint64, lo, hi float64, n uint64) {
	if !(hi > lo) || hi <= 1 || lo <= 0 || math.IsInf(hi, 1) {
		counts[events.LatencyBucketOf(hi)] += n
		return
	}
	lo = max(lo, 1)
	a, b := 8*math.Log2(lo), 8*math.Log2(hi) // at most 8 × 1024
	if a >= events.LatencyMaxBucket {
		counts[events.LatencyMaxBucket] += n
		return
	}
	type share struct {
		k    int
		part float64
	}
	var shares []share
	for k := int(a); float64(k) < b; k++ {
		if k == events.LatencyMaxBucket {
			shares = append(shares, share{k, float64(n) * (b - math.Max(a, float64(k))) / (b - a)})
			break
		}
		overlap := math.Min(b, float64(k+1)) - math.Max(a, float64(k))
		if overlap > 0 {
			shares = append(shares, share{k, float64(n) * overlap / (b - a)})
		}
	}
	var given uint64
	for i := range shares {
		w := uint64(shares[i].part)
		counts[shares[i].k] += w
		given += w
		shares[i].part -= float64(w)
	}
	slices.SortStableFunc(shares, func(x, y share) int {
		switch {
		case x.part > y.part:
			return -1
		case x.part < y.part:
			return 1
		}
		return 0
	})
	for i := 0; given < n && i < len(shares); i++ {
		counts[shares[i].k]++
		given++
	}
}
