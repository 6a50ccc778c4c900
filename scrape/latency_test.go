package scrape_test

import (
	"strconv"
	"strings"
	"testing"

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
