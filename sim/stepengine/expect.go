package stepengine

import "slices"

// DefaultOutputWindow is how many of the latest finished outputs an
// OutputWindow keeps.
const DefaultOutputWindow = 256

// OutputEstimate is what an engine expects of a request's output before it
// ends, from what a real engine knows (contract §21): the p90 of the
// outputs of the requests that finished, once one has.
type OutputEstimate struct {
	// P90 is the 90th percentile of the finished outputs, in tokens.
	P90 int
	// Known: a request has finished, so P90 means something.
	Known bool
}

// Expected returns the output a request with output tokens generated so far
// and a limit of maxTokens is expected to reach: clamp(estimate, output,
// maxTokens), the estimate being the p90 once known and maxTokens until
// then. maxTokens ≤ 0 means the request has none: the p90 alone (at least
// output), or output while nothing has finished.
func (o OutputEstimate) Expected(output, maxTokens int) int {
	if maxTokens <= 0 {
		if !o.Known {
			return output
		}
		return max(o.P90, output)
	}
	est := maxTokens
	if o.Known {
		est = o.P90
	}
	return max(output, min(est, maxTokens))
}

// OutputWindow keeps the outputs of the latest finished requests, at most a
// bounded number, and gives their p90. It is not safe for concurrent use.
type OutputWindow struct {
	outs   []int // a ring of the latest outputs
	next   int   // where the next output goes
	n      int   // outputs kept
	sorted []int // scratch, to take the percentile
	est    OutputEstimate
	stale  bool // est is behind outs
}

// NewOutputWindow returns an empty window of the latest size outputs (at
// least 1).
func NewOutputWindow(size int) *OutputWindow {
	size = max(1, size)
	return &OutputWindow{outs: make([]int, size), sorted: make([]int, 0, size)}
}

// Add records the output, in tokens, of a request that finished; the
// oldest output kept falls out of a full window.
func (w *OutputWindow) Add(output int) {
	w.outs[w.next] = output
	w.next = (w.next + 1) % len(w.outs)
	w.n = min(w.n+1, len(w.outs))
	w.stale = true
}

// Estimate returns the p90 of the outputs kept (nearest rank: the smallest
// output that at least 90 % of them do not exceed), not Known while none
// has finished.
func (w *OutputWindow) Estimate() OutputEstimate {
	if w.stale {
		w.sorted = append(w.sorted[:0], w.outs[:w.n]...)
		slices.Sort(w.sorted)
		w.est = OutputEstimate{P90: w.sorted[(9*w.n+9)/10-1], Known: true}
		w.stale = false
	}
	return w.est
}
