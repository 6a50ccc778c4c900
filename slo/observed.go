package slo

import "math"

// ObservedPercentiles are the percentiles Observed keeps the best of.
var ObservedPercentiles = [...]float64{0.5, 0.9, 0.95, 0.99}

// Best is one signal's best windows: for each of ObservedPercentiles, the
// lowest latency in ms at that percentile of any window that held enough
// samples to judge it (Target.MinSamples: 20, 50, 100 and 500); 0 where
// no window did.
type Best [len(ObservedPercentiles)]float64

// Observed is the best latency a model's fleet has shown, window by window
// (each --slo-interval's merged window, as the controller judges them), so
// that a target below it can be told apart before the controller learns
// it the slow way (docs/slo.md).
type Observed struct {
	TTFT, ITL Best
	// Windows counts the windows added.
	Windows uint64
}

// Add takes a window in.
func (o *Observed) Add(w *Window) {
	o.Windows++
	o.TTFT.add(&w.TTFT)
	o.ITL.add(&w.ITL)
}

func (b *Best) add(h *Hist) {
	n := h.Total()
	for i, p := range ObservedPercentiles {
		if n < (Target{Percentile: p}).MinSamples() {
			continue
		}
		if q := h.Quantile(p); !math.IsNaN(q) && (b[i] == 0 || q < b[i]) {
			b[i] = q
		}
	}
}

// Floor returns the lowest latency at percentile p the windows allow: the
// best of the largest kept percentile at or below p (at every window's
// percentile p the latency was at least that). ok is false when no window
// judged such a percentile.
func (b Best) Floor(p float64) (ms, at float64, ok bool) {
	for i := len(ObservedPercentiles) - 1; i >= 0; i-- {
		if ObservedPercentiles[i] <= p && b[i] > 0 {
			return b[i], ObservedPercentiles[i], true
		}
	}
	return 0, 0, false
}
