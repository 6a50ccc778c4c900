package publisher

import (
	"math"
	"testing"
)

func TestCounter(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		values []uint64 // the engine's, in order
		want   []uint64 // published after each
	}{
		{"first value as given", []uint64{42}, []uint64{42}},
		{"increases add up", []uint64{0, 3, 3, 10}, []uint64{0, 3, 3, 10}},
		{"a restart from zero adds all of the new value", []uint64{10, 12, 2, 5}, []uint64{10, 12, 14, 17}},
		{"a restart to zero keeps the total", []uint64{10, 0, 0, 1}, []uint64{10, 10, 10, 11}},
		{"the sum stops at the top", []uint64{math.MaxUint64 - 1, 5}, []uint64{math.MaxUint64 - 1, math.MaxUint64}},
		{"and stays there", []uint64{math.MaxUint64, 1, 2}, []uint64{math.MaxUint64, math.MaxUint64, math.MaxUint64}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var c counter
			for i, v := range tt.values {
				if got := c.add(v); got != tt.want[i] {
					t.Fatalf("add(%d) after %v = %d, want %d", v, tt.values[:i], got, tt.want[i])
				}
			}
		})
	}
}
