package kvwatch

import "testing"

func TestWatchLagStalled(t *testing.T) {
	t.Parallel()
	var g watchLag
	steps := []struct {
		lastSeq, lastRev uint64
		want             bool
	}{
		{10, 10, false}, // up to date
		{12, 10, false}, // behind once
		{13, 11, false}, // behind, but progressing
		{13, 11, true},  // behind twice without progress
		{13, 11, false}, // already re-watched for this last sequence
		{13, 11, false},
		{14, 11, false}, // a new message: behind once
		{14, 11, true},
		{14, 14, false},
	}
	for i, s := range steps {
		if got := g.stalled(s.lastSeq, s.lastRev); got != s.want {
			t.Errorf("step %d: stalled(%d, %d) = %v, want %v", i, s.lastSeq, s.lastRev, got, s.want)
		}
	}
}
