package scrape_test

import (
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
)

// page is a vLLM page with a TTFT and an ITL histogram of two ranks.
func page(ttftLow, ttftHigh, itl uint64) string {
	return `# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} ` + u(ttftLow) + `
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.2"} ` + u(ttftLow+ttftHigh) + `
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} ` + u(ttftLow+ttftHigh) + `
vllm:time_to_first_token_seconds_sum{engine="0"} 1
vllm:time_to_first_token_seconds_count{engine="0"} ` + u(ttftLow+ttftHigh) + `
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1"} 0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.2"} 0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 0
vllm:time_to_first_token_seconds_sum{engine="1"} 0
vllm:time_to_first_token_seconds_count{engine="1"} 0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.04"} ` + u(itl) + `
vllm:time_per_output_token_seconds_bucket{le="+Inf"} ` + u(itl) + `
vllm:time_per_output_token_seconds_sum 1
vllm:time_per_output_token_seconds_count ` + u(itl) + `
`
}

func u(n uint64) string { return strconv.FormatUint(n, 10) }

func total(bs []events.LatencyBucket) (n uint64) {
	for _, b := range bs {
		n += b.N
	}
	return n
}

// TestLatencyWindow: two scrapes' difference, spread over the §18 buckets
// of each Prometheus bucket, keeps the sample count; the older ITL name
// stands in; a restart (counts falling) counts from zero.
func TestLatencyWindow(t *testing.T) {
	t.Parallel()
	parse := func(s string) scrape.Families {
		f, err := scrape.Parse(strings.NewReader(s))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	t1, i1 := scrape.LatencyHistograms(scrape.EngineVLLM, parse(page(10, 5, 100)))
	t2, i2 := scrape.LatencyHistograms(scrape.EngineVLLM, parse(page(30, 8, 250)))
	if t1 == nil || i1 == nil {
		t.Fatal("histograms not found")
	}
	w := scrape.Window(t1, t2)
	if total(w) != 23 {
		t.Fatalf("ttft window %+v: %d samples, want 23", w, total(w))
	}
	// The 20 new samples in (0, 100 ms] lie in (50, 100] ms; the 3 in
	// (100, 200] ms above 100 ms.
	var upTo100, over100 uint64
	for _, b := range w {
		switch {
		case slo100(b.K):
			upTo100 += b.N
		default:
			over100 += b.N
		}
		if events.LatencyBucketOf(50) > b.K {
			t.Errorf("bucket %d below 50 ms", b.K)
		}
	}
	if upTo100 != 20 || over100 != 3 {
		t.Errorf("%d samples up to 100 ms and %d over, want 20 and 3: %+v", upTo100, over100, w)
	}
	if iw := scrape.Window(i1, i2); total(iw) != 150 {
		t.Errorf("itl window %+v, want 150 samples (older name)", iw)
	}
	// A restart: the counts fell, everything in cur is new.
	if rw := scrape.Window(t2, t1); total(rw) != 15 {
		t.Errorf("after a restart: %d samples, want 15", total(rw))
	}
	if scrape.Window(t1, t1) != nil {
		t.Error("no change: want no buckets")
	}
	if a, b := scrape.LatencyHistograms("other", parse(page(1, 1, 1))); a != nil || b != nil {
		t.Error("an unknown engine has histograms")
	}
}

// slo100 reports whether bucket k lies at or under 100 ms.
func slo100(k uint8) bool { return k < events.LatencyBucketOf(100) }

// TestLatencyWindowHugeBounds: an engine's page is network input, and a
// histogram bound may be any float. Bounds that overflow once turned into
// milliseconds (le="1e306"), or whose doubling does (the +Inf bucket after
// le="1e305"), or that lie far past the last §18 bucket, put their samples
// in the last bucket; Window returns at once and keeps every sample (it
// looped forever on le="1e306", growing its memory).
func TestLatencyWindowHugeBounds(t *testing.T) {
	for _, bounds := range [][]float64{
		{0.1, 1e306, math.Inf(1)},
		{0.1, 1e300, math.Inf(1)},
		{0.1, 1e305, math.Inf(1)},
		{1e10, 1e20, math.Inf(1)},
		{math.MaxFloat64, math.Inf(1)},
	} {
		prev := &scrape.Histogram{Upper: bounds, Cumulative: make([]uint64, len(bounds))}
		cur := &scrape.Histogram{Upper: bounds, Cumulative: make([]uint64, len(bounds))}
		for i := 1; i < len(bounds); i++ {
			cur.Cumulative[i] = 5 * uint64(i) // 5 samples in each bucket above the first
		}
		done := make(chan []events.LatencyBucket)
		go func() { done <- scrape.Window(prev, cur) }()
		select {
		case got := <-done:
			want := cur.Cumulative[len(bounds)-1]
			if total(got) != want {
				t.Errorf("bounds %v: %d samples, want %d: %v", bounds, total(got), want, got)
			}
			if last := got[len(got)-1]; last.K != events.LatencyMaxBucket {
				t.Errorf("bounds %v: highest bucket %d, want the last (%d): %v", bounds, last.K, events.LatencyMaxBucket, got)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("bounds %v: Window did not return", bounds)
		}
	}
}

// FuzzLatencyWindow: whatever two histograms of a page hold (bounds
// ascending as the parser gives them, any counts), Window returns, within
// the §18 buckets, as many samples as the counts rose.
func FuzzLatencyWindow(f *testing.F) {
	f.Add(0.1, 0.2, uint64(0), uint64(3), uint64(7), uint64(9))
	f.Add(1e305, 1e306, uint64(1), uint64(2), uint64(3), uint64(4))
	f.Add(1e-300, 5e-324, uint64(5), uint64(4), uint64(3), uint64(1))
	f.Fuzz(func(t *testing.T, b1, b2 float64, p1, p2, c1, c2 uint64) {
		if math.IsNaN(b1) || math.IsNaN(b2) || math.IsInf(b1, 0) || math.IsInf(b2, 0) || !(b1 < b2) {
			return
		}
		bounds := []float64{b1, b2, math.Inf(1)}
		prev := &scrape.Histogram{Upper: bounds, Cumulative: []uint64{p1 % 1e6, p1%1e6 + p2%1e6, p1%1e6 + p2%1e6}}
		cur := &scrape.Histogram{Upper: bounds, Cumulative: []uint64{c1 % 1e6, c1%1e6 + c2%1e6, c1%1e6 + c2%1e6 + 1}}
		got := scrape.Window(prev, cur)
		for _, b := range got {
			if b.K > events.LatencyMaxBucket || b.N == 0 {
				t.Fatalf("bucket %+v", b)
			}
		}
		// The samples Window keeps: each bucket's rise, or its count when
		// the counts fell (a restart counts from zero).
		var want uint64
		fell := false
		for i := range bounds {
			fell = fell || cur.Cumulative[i] < prev.Cumulative[i]
		}
		var below, belowPrev uint64
		for i := range bounds {
			c, p := cur.Cumulative[i], prev.Cumulative[i]
			if fell {
				p = 0
			}
			if d := int64(c-below) - int64(p-belowPrev); d > 0 {
				want += uint64(d)
			}
			below, belowPrev = c, p
		}
		if total(got) != want {
			t.Fatalf("bounds %v, prev %v, cur %v: %d samples, want %d", bounds, prev.Cumulative, cur.Cumulative, total(got), want)
		}
	})
}
