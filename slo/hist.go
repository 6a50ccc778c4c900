package slo

import "math"

// Latency buckets (contract §18): bucket k counts samples in
// [2^(k/8), 2^((k+1)/8)) milliseconds, k from 0 to MaxBucket; samples under
// 1 ms count in bucket 0 and samples past the last bucket in MaxBucket.
const (
	// MaxBucket is the last bucket, about 440 s.
	MaxBucket = 150
	// NumBuckets is the number of buckets.
	NumBuckets = MaxBucket + 1
	// bucketsPerOctave is the number of buckets per doubling of latency.
	bucketsPerOctave = 8
)

// Hist is a latency histogram in the buckets of contract §18.
type Hist [NumBuckets]uint64

// Bucket is the bucket of a latency of ms milliseconds.
func Bucket(ms float64) int {
	if !(ms >= 1) { // NaN, negative and under 1 ms
		return 0
	}
	k := math.Floor(bucketsPerOctave * math.Log2(ms))
	if k >= MaxBucket { // +Inf included
		return MaxBucket
	}
	return int(k)
}

// BucketLower is the lower edge of bucket k, in milliseconds.
func BucketLower(k int) float64 {
	return math.Exp2(float64(k) / bucketsPerOctave)
}

// Observe counts one sample of ms milliseconds.
func (h *Hist) Observe(ms float64) { h[Bucket(ms)]++ }

// Add adds o's counts to h.
func (h *Hist) Add(o *Hist) {
	for k, n := range o {
		h[k] += n
	}
}

// AddBucket adds n samples to bucket k; a k outside 0..MaxBucket is clamped.
func (h *Hist) AddBucket(k int, n uint64) {
	h[min(max(k, 0), MaxBucket)] += n
}

// Total is the number of samples.
func (h *Hist) Total() uint64 {
	var t uint64
	for _, n := range h {
		t += n
	}
	return t
}

// Attainment is the share of samples at or under targetMs, with the bucket
// that holds the target split linearly (in log scale) between its edges;
// NaN when h holds no sample.
func (h *Hist) Attainment(targetMs float64) float64 {
	total := h.Total()
	if total == 0 {
		return math.NaN()
	}
	kt := Bucket(targetMs)
	var under float64
	for k := range kt {
		under += float64(h[k])
	}
	if targetMs < 1 {
		return under / float64(total)
	}
	// Fraction of bucket kt below the target, in log2 space.
	pos := bucketsPerOctave*math.Log2(targetMs) - float64(kt)
	if kt == MaxBucket && pos > 1 {
		pos = 1
	}
	under += float64(h[kt]) * min(max(pos, 0), 1)
	return under / float64(total)
}

// Quantile is the latency in ms under which a share p of the samples lie,
// interpolated in log scale within its bucket; NaN when h is empty.
func (h *Hist) Quantile(p float64) float64 {
	total := h.Total()
	if total == 0 {
		return math.NaN()
	}
	want := p * float64(total)
	var seen float64
	for k, n := range h {
		if n == 0 {
			continue
		}
		if seen+float64(n) >= want {
			frac := (want - seen) / float64(n)
			return math.Exp2((float64(k) + frac) / bucketsPerOctave)
		}
		seen += float64(n)
	}
	return BucketLower(NumBuckets)
}
