package slo

import (
	"math"
	"testing"
)

// window returns a window of n ITL samples spread evenly (in log scale)
// over [lo, hi] ms, and as many TTFT samples at ttft ms.
func window(n int, lo, hi, ttft float64) *Window {
	var w Window
	for i := range n {
		f := 0.5
		if n > 1 {
			f = float64(i) / float64(n-1)
		}
		w.ITL.Observe(lo * math.Pow(hi/lo, f))
		w.TTFT.Observe(ttft)
	}
	return &w
}

func TestObservedKeepsTheBestWindow(t *testing.T) {
	t.Parallel()
	var o Observed
	o.Add(window(600, 80, 200, 900)) // overloaded
	o.Add(window(600, 50, 70, 400))  // the best
	o.Add(window(30, 10, 12, 100))   // too few samples for anything but p50
	o.Add(&Window{})                 // nothing measured
	if o.Windows != 4 {
		t.Errorf("Windows = %d, want 4", o.Windows)
	}
	near := func(got, want float64) bool { return math.Abs(got-want) <= 0.1*want }
	// The best window's ITL p90 is about 50 × 1.4^0.9 ≈ 68 ms; p50 comes
	// from the small window (30 samples ≥ 20).
	for _, tc := range []struct {
		name   string
		b      Best
		p      float64
		want   float64
		wantAt float64
		ok     bool
	}{
		{"ITL at p90", o.ITL, 0.9, 68, 0.9, true},
		{"ITL at p0.93 falls back to p90", o.ITL, 0.93, 68, 0.9, true},
		{"ITL at p99", o.ITL, 0.99, 69.5, 0.99, true},
		{"ITL at p50 from the small window", o.ITL, 0.5, 11, 0.5, true},
		{"TTFT at p90", o.TTFT, 0.9, 400, 0.9, true},
		{"below every kept percentile", o.ITL, 0.3, 0, 0, false},
		{"nothing observed", Best{}, 0.9, 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, at, ok := tc.b.Floor(tc.p)
			if ok != tc.ok || at != tc.wantAt || (ok && !near(got, tc.want)) {
				t.Errorf("Floor(%v) = %v at p%v, %v; want about %v at p%v, %v", tc.p, got, at, ok, tc.want, tc.wantAt, tc.ok)
			}
		})
	}
}
