package scrape

import (
	"strconv"
	"testing"
)

// A counter whose series keys churn (each page a new label set) keeps only
// the series of the last pages: the memory of a CounterSum is bounded by
// the series alive, not by every series ever seen.
func TestCounterSumForgetsGoneSeries(t *testing.T) {
	t.Parallel()
	var s CounterSum
	for i := range 10 * counterSeriesPages {
		s.Add(Counter{{Key: "stable", Value: uint64(i)}, {Key: "k" + strconv.Itoa(i), Value: 1}})
	}
	if n := len(s.last); n > counterSeriesPages+1 {
		t.Fatalf("%d series kept after %d pages of churn, want at most %d", n, 10*counterSeriesPages, counterSeriesPages+1)
	}
	if _, ok := s.last["stable"]; !ok {
		t.Fatal("the series present on every page was dropped")
	}

	// A series absent for fewer pages than the window still compares with
	// its last value when it returns.
	var r CounterSum
	r.Add(Counter{{Key: "a", Value: 100}, {Key: "b", Value: 0}})
	for range counterSeriesPages - 1 {
		r.Add(Counter{{Key: "b", Value: 0}})
	}
	if sum, _ := r.Add(Counter{{Key: "a", Value: 105}, {Key: "b", Value: 0}}); sum != 5 {
		t.Fatalf("a series back after %d pages: sum %d, want 5", counterSeriesPages-1, sum)
	}
	// Pages that lack the counter altogether do not age its series.
	for range 2 * counterSeriesPages {
		r.Add(nil)
	}
	if sum, _ := r.Add(Counter{{Key: "a", Value: 107}, {Key: "b", Value: 0}}); sum != 7 {
		t.Fatalf("after pages without the counter: sum %d, want 7", sum)
	}
}
