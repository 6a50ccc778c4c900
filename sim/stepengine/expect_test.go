package stepengine

import (
	"slices"
	"testing"
)

func TestOutputEstimateExpected(t *testing.T) {
	t.Parallel()
	unknown := OutputEstimate{}
	p90 := func(v int) OutputEstimate { return OutputEstimate{P90: v, Known: true} }
	tests := []struct {
		name      string
		est       OutputEstimate
		output    int
		maxTokens int
		want      int
	}{
		{"nothing finished: max_tokens", unknown, 0, 256, 256},
		{"nothing finished, some output: still max_tokens", unknown, 40, 256, 256},
		{"p90 under max_tokens", p90(100), 0, 256, 100},
		{"p90 over max_tokens: max_tokens", p90(300), 0, 256, 256},
		{"output past the p90: the output", p90(100), 180, 256, 180},
		{"output at max_tokens", p90(100), 256, 256, 256},
		{"no max_tokens: the p90 alone", p90(5000), 0, 0, 5000},
		{"no max_tokens, output past the p90", p90(100), 120, 0, 120},
		{"no max_tokens, nothing finished: the output", unknown, 7, 0, 7},
		{"a p90 of 0 is known", p90(0), 0, 256, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := tt.est.Expected(tt.output, tt.maxTokens); got != tt.want {
				t.Errorf("%+v.Expected(%d, %d) = %d, want %d", tt.est, tt.output, tt.maxTokens, got, tt.want)
			}
		})
	}
}

func TestOutputWindow(t *testing.T) {
	t.Parallel()
	seq := func(from, to int) []int { // from..to inclusive
		var out []int
		for v := from; v <= to; v++ {
			out = append(out, v)
		}
		return out
	}
	tests := []struct {
		name    string
		size    int
		outputs []int
		want    OutputEstimate
	}{
		{"none finished", 8, nil, OutputEstimate{}},
		{"one", 8, []int{42}, OutputEstimate{P90: 42, Known: true}},
		{"ten: the ninth smallest", 16, []int{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}, OutputEstimate{P90: 9, Known: true}},
		{"eleven: the tenth smallest", 16, seq(1, 11), OutputEstimate{P90: 10, Known: true}},
		{"hundred", 128, seq(1, 100), OutputEstimate{P90: 90, Known: true}},
		{"the oldest fall out", 10, append(seq(1000, 1009), seq(1, 10)...), OutputEstimate{P90: 9, Known: true}},
		{"a size below 1 keeps one", 0, []int{5, 7}, OutputEstimate{P90: 7, Known: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			w := NewOutputWindow(tt.size)
			for _, o := range tt.outputs {
				w.Add(o)
			}
			if got := w.Estimate(); got != tt.want {
				t.Errorf("Estimate() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// The estimate follows each finish, not only the first.
func TestOutputWindowFollowsFinishes(t *testing.T) {
	t.Parallel()
	w := NewOutputWindow(4)
	var kept []int
	for i, o := range []int{50, 10, 90, 30, 70, 20} {
		w.Add(o)
		kept = append(kept, o)
		if len(kept) > 4 {
			kept = kept[1:]
		}
		s := slices.Sorted(slices.Values(kept))
		want := s[(9*len(s)+9)/10-1]
		if got := w.Estimate(); !got.Known || got.P90 != want {
			t.Fatalf("after %d finishes (%v): %+v, want p90 %d", i+1, kept, got, want)
		}
	}
}
