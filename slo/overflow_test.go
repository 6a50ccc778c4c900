package slo_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/workermon/workermon/slo"
)

// TestStepUpNearTheTopOfUint64: a step up of a prefill threshold whose
// range ends near 2^64 stays at the top of the range. The product of the
// step overflowed uint64, so the threshold fell to 2^63 (amd64's conversion
// of a float out of range) and the controller then moved up every interval
// for ever; Next clamps in float64 before converting.
func TestStepUpNearTheTopOfUint64(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	c.PrefillMin, c.PrefillMax = 1024, math.MaxUint64 // not Validate'd: the arithmetic must hold by itself
	target := slo.Target{ITLms: 50, Percentile: 0.9}
	for _, start := range []uint64{math.MaxUint64, math.MaxUint64 - 1<<20, 1 << 63, 15 << 60} {
		prev := slo.Status{State: slo.StateSteady, Suggested: slo.Thresholds{Decode: 0.6, Prefill: start}, Step: c.DecodeStep, Holds: 1}
		st, _ := slo.Next(c, target, prev, window(100, 1, 5)) // attainment met, rejections: up
		if st.Suggested.Prefill < start {
			t.Errorf("step up from %d: prefill %d, below where it was", start, st.Suggested.Prefill)
		}
		// At the top of the prefill range, steps up move only the decode
		// threshold and end steady: none is a move of the prefill.
		for range 20 {
			st.Holds = 1
			st, _ = slo.Next(c, target, st, window(100, 1, 5))
		}
		if st.Suggested.Prefill != math.MaxUint64 || st.State != slo.StateSteady {
			t.Errorf("from %d after 20 steps up: %+v %s, want prefill %d, steady", start, st.Suggested, st.State, uint64(math.MaxUint64))
		}
	}
	// A step down from the top stays under it and above the floor.
	prev := slo.Status{State: slo.StateSteady, Suggested: slo.Thresholds{Decode: 0.6, Prefill: math.MaxUint64}, Step: c.DecodeStep, Holds: 1}
	st, _ := slo.Next(c, target, prev, window(100, 0, 0))
	if p := st.Suggested.Prefill; p >= math.MaxUint64 || p < 1<<63 {
		t.Errorf("step down from the top: prefill %d", p)
	}
}

// TestPrefillRangeBounded: a prefill range past slo.MaxPrefill (2^53, the
// integers float64 holds exactly) is refused with an error that says so.
func TestPrefillRangeBounded(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	c.PrefillMax = slo.MaxPrefill
	if err := c.Validate(); err != nil {
		t.Fatalf("a range up to MaxPrefill: %v", err)
	}
	c.PrefillMax = slo.MaxPrefill + 1
	err := c.Validate()
	if !errors.Is(err, slo.ErrInvalidConfig) || !strings.Contains(err.Error(), "9007199254740992") {
		t.Fatalf("a range past MaxPrefill: %v", err)
	}
}
