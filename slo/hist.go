package slo

import (
	"math"
	"math/bits"
)

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

// AddCount is a + b, or the largest uint64 where that overflows. Counts
// arrive over the network as any uint64 (contract §18), and a sum that
// wrapped around would turn a flood of samples or rejections into a few.
func AddCount(a, b uint64) uint64 {
	if s, carry := bits.Add64(a, b, 0); carry == 0 {
		return s
	}
	return math.MaxUint64
}

// Observe counts one sample of ms milliseconds.
func (h *Hist) Observe(ms float64) { h.AddBucket(Bucket(ms), 1) }

// Add adds o's counts to h.
func (h *Hist) Add(o *Hist) {
	for k, n := range o {
		h[k] = AddCount(h[k], n)
	}
}

// AddBucket adds n samples to bucket k; a k outside 0..MaxBucket is clamped.
func (h *Hist) AddBucket(k int, n uint64) {
	k = min(max(k, 0), MaxBucket)
	h[k] = AddCount(h[k], n)
}

// Total is the number of samples (at most the largest uint64).
func (h *Hist) Total() uint64 {
	var t uint64
	for _, n := range h {
		t = AddCount(t, n)
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
		return min(under/float64(total), 1)
	}
	// Fraction of bucket kt below the target, in log2 space.
	pos := bucketsPerOctave*math.Log2(targetMs) - float64(kt)
	if kt == MaxBucket && pos > 1 {
		pos = 1
	}
	under += float64(h[kt]) * min(max(pos, 0), 1)
	return min(under/float64(total), 1) // a total held at the largest uint64 can be below the buckets' sum
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
