package slo_test

import (
	"errors"
	"math"
	"testing"

	"github.com/workermon/workermon/slo"
)

func TestBucket(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ms   float64
		want int
	}{
		{0, 0}, {0.5, 0}, {-3, 0}, {math.NaN(), 0}, {1, 0}, {1.09, 0}, {math.Exp2(1.0 / 8), 1},
		{2, 8}, {100, 53}, {1000, 79}, {440_000, 149}, {450_000, 150}, {1e9, 150}, {math.Inf(1), 150},
	} {
		if got := slo.Bucket(tc.ms); got != tc.want {
			t.Errorf("Bucket(%v) = %d, want %d", tc.ms, got, tc.want)
		}
	}
	if got := slo.BucketLower(8); got != 2 {
		t.Errorf("BucketLower(8) = %v, want 2", got)
	}
}

func TestAttainmentAndQuantile(t *testing.T) {
	t.Parallel()
	var h slo.Hist
	if !math.IsNaN(h.Attainment(10)) || !math.IsNaN(h.Quantile(0.9)) {
		t.Fatal("empty histogram: want NaN")
	}
	// 90 samples at 10 ms, 10 at 100 ms.
	for range 90 {
		h.Observe(10)
	}
	for range 10 {
		h.Observe(100)
	}
	for _, tc := range []struct{ target, want float64 }{
		{5, 0}, {20, 0.9}, {50, 0.9}, {200, 1}, {0.5, 0},
	} {
		if got := h.Attainment(tc.target); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("Attainment(%v) = %v, want %v", tc.target, got, tc.want)
		}
	}
	// Within the bucket of the target: split in log scale.
	if got := h.Attainment(math.Exp2(26.5 / 8)); !(got > 0 && got < 0.9) {
		t.Errorf("Attainment in the 10 ms bucket = %v, want in (0, 0.9)", got)
	}
	if q := h.Quantile(0.5); !(q >= slo.BucketLower(26) && q <= slo.BucketLower(27)) {
		t.Errorf("Quantile(0.5) = %v, want in the 10 ms bucket", q)
	}
	if q := h.Quantile(0.95); !(q >= slo.BucketLower(53) && q <= slo.BucketLower(54)) {
		t.Errorf("Quantile(0.95) = %v, want in the 100 ms bucket", q)
	}
	var o slo.Hist
	o.AddBucket(-1, 2)
	o.AddBucket(999, 3)
	h.Add(&o)
	if h.Total() != 105 || h[0] != 2 || h[slo.MaxBucket] != 3 {
		t.Errorf("Add/AddBucket: total %d, [0] %d, [max] %d", h.Total(), h[0], h[slo.MaxBucket])
	}
}

func TestMinSamples(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		p    float64
		want uint64
	}{{0.5, 20}, {0.75, 20}, {0.8, 25}, {0.9, 50}, {0.95, 100}, {0.99, 500}} {
		if got := (slo.Target{ITLms: 1, Percentile: tc.p}).MinSamples(); got != tc.want {
			t.Errorf("MinSamples(%v) = %d, want %d", tc.p, got, tc.want)
		}
	}
}

func TestTargetValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		t    slo.Target
		ok   bool
	}{
		{"ttft only", slo.Target{TTFTms: 500, Percentile: 0.9}, true},
		{"itl only", slo.Target{ITLms: 50, Percentile: 0.5}, true},
		{"both", slo.Target{TTFTms: 500, ITLms: 50, Percentile: 0.99}, true},
		{"none", slo.Target{Percentile: 0.9}, false},
		{"negative", slo.Target{TTFTms: -1, ITLms: 50, Percentile: 0.9}, false},
		{"NaN", slo.Target{TTFTms: math.NaN(), Percentile: 0.9}, false},
		{"inf", slo.Target{ITLms: math.Inf(1), Percentile: 0.9}, false},
		{"percentile 0", slo.Target{ITLms: 50, Percentile: 0}, false},
		{"percentile 1", slo.Target{ITLms: 50, Percentile: 1}, false},
	} {
		err := tc.t.Validate()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, slo.ErrInvalidTarget)) {
			t.Errorf("%s: Validate() = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	if err := slo.DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	c := slo.DefaultConfig()
	c.DecodeMin, c.DecodeMax = 0.9, 0.5
	c.PrefillMin = 0
	c.InfeasibleAfter = 0
	err := c.Validate()
	if !errors.Is(err, slo.ErrInvalidConfig) {
		t.Fatalf("Validate() = %v", err)
	}
	if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != 3 {
		t.Errorf("%d problems reported, want 3: %v", n, err)
	}
}

func TestStart(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	d, p := 0.1, uint64(4096)
	for _, tc := range []struct {
		name    string
		decode  *float64
		prefill *uint64
		want    slo.Thresholds
	}{
		{"unset: top", nil, nil, slo.Thresholds{Decode: 0.98, Prefill: 1048576, KVCommitted: 2, QueueDelayMs: 60000}},
		{"clamped", &d, &p, slo.Thresholds{Decode: 0.3, Prefill: 4096, KVCommitted: 2, QueueDelayMs: 60000}},
	} {
		st := slo.Start(c, slo.Base{Decode: tc.decode, Prefill: tc.prefill})
		if st.Suggested != tc.want || st.State != slo.StateNoData {
			t.Errorf("%s: Start = %+v, want %+v", tc.name, st, tc.want)
		}
	}
}

// window builds a window of n ITL samples, a share good of them at 10 ms
// and the rest at 100 ms, and n TTFT samples at 200 ms.
func window(n int, good float64, rejected uint64) *slo.Window {
	var w slo.Window
	for i := range n {
		if float64(i) < good*float64(n) {
			w.ITL.Observe(10)
		} else {
			w.ITL.Observe(100)
		}
		w.TTFT.Observe(200)
	}
	w.Rejected = rejected
	return &w
}

func TestNextRules(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	mid := slo.Status{State: slo.StateSteady, Suggested: slo.Thresholds{Decode: 0.6, Prefill: 100000}, Step: c.DecodeStep, Holds: 1}
	target := slo.Target{ITLms: 50, Percentile: 0.9}
	for _, tc := range []struct {
		name   string
		target slo.Target
		prev   slo.Status
		w      *slo.Window
		state  slo.State
		move   slo.Move
		want   slo.Thresholds
	}{
		{"too few samples, no rejections: hold", target, mid, window(49, 0, 0), slo.StateNoData, 0, mid.Suggested},
		{"no samples, no rejections: hold", target, mid, &slo.Window{}, slo.StateNoData, 0, mid.Suggested},
		{"rejections, no samples: up", target, mid, &slo.Window{Rejected: 3}, slo.StateRaising, +1, slo.Thresholds{Decode: 0.62, Prefill: 112000}},
		{"queueing, no samples: up", target, mid, &slo.Window{Queued: 3}, slo.StateRaising, +1, slo.Thresholds{Decode: 0.62, Prefill: 112000}},
		{"attainment below: down", target, mid, window(100, 0.5, 0), slo.StateLowering, -1, slo.Thresholds{Decode: 0.56, Prefill: 80645}},
		{"attainment below with rejections: down", target, mid, window(100, 0.5, 9), slo.StateLowering, -1, slo.Thresholds{Decode: 0.56, Prefill: 80645}},
		{"attainment met, rejections, headroom: up", target, mid, window(100, 1, 5), slo.StateRaising, +1, slo.Thresholds{Decode: 0.62, Prefill: 112000}},
		{"attainment met, rejections, no headroom: steady", slo.Target{ITLms: 11, Percentile: 0.9}, mid, window(100, 0.95, 5), slo.StateSteady, 0, mid.Suggested},
		{"attainment met, nothing rejected: steady", target, mid, window(100, 1, 0), slo.StateSteady, 0, mid.Suggested},
		{"worst signal decides", slo.Target{TTFTms: 1000, ITLms: 50, Percentile: 0.9}, mid, window(100, 0.5, 0), slo.StateLowering, -1, slo.Thresholds{Decode: 0.56, Prefill: 80645}},
		{"too few samples with rejections: hold (pooled)", target, mid, window(30, 1, 4), slo.StateNoData, 0, mid.Suggested},
		{"one signal short while the other meets: hold", slo.Target{TTFTms: 1000, ITLms: 50, Percentile: 0.9}, mid,
			&slo.Window{TTFT: window(100, 1, 0).TTFT, ITL: window(10, 1, 0).ITL, Rejected: 3}, slo.StateNoData, 0, mid.Suggested},
		{"one signal short while the other misses: down", slo.Target{TTFTms: 100, ITLms: 50, Percentile: 0.9}, mid,
			&slo.Window{TTFT: window(100, 1, 0).TTFT, ITL: window(10, 1, 0).ITL}, slo.StateLowering, -1,
			// A measured TTFT miss brings queue_delay to half the target at once (the floor here).
			slo.Thresholds{Decode: 0.56, Prefill: 80645, KVCommitted: 2, QueueDelayMs: 100}},
		{"signal without target ignored", slo.Target{ITLms: 50, Percentile: 0.9}, mid, window(100, 1, 0), slo.StateSteady, 0, mid.Suggested},
		{"min samples follow the percentile", slo.Target{ITLms: 50, Percentile: 0.99}, mid, window(499, 0, 0), slo.StateNoData, 0, mid.Suggested},
		{"top of the ranges: nothing to gain", target,
			slo.Status{Suggested: slo.Thresholds{Decode: 0.98, Prefill: 1048576}, Step: c.DecodeStep, Holds: 1},
			window(100, 1, 5), slo.StateSteady, 0, slo.Thresholds{Decode: 0.98, Prefill: 1048576}},
		{"floor of the ranges: lowering, no move", target,
			slo.Status{Suggested: slo.Thresholds{Decode: 0.3, Prefill: 1024}, Step: c.DecodeStep, Holds: 1},
			window(100, 0, 0), slo.StateLowering, 0, slo.Thresholds{Decode: 0.3, Prefill: 1024}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st, m := slo.Next(c, tc.target, tc.prev, tc.w)
			// The leading thresholds: unset (0) in prev, at the top of
			// their ranges after.
			if tc.want.KVCommitted == 0 && tc.want.QueueDelayMs == 0 {
				tc.want.KVCommitted, tc.want.QueueDelayMs = c.CommittedMax, c.DelayMax
			}
			if st.State != tc.state || m != tc.move || st.Suggested != tc.want {
				t.Errorf("Next = %s %+d %+v, want %s %+d %+v", st.State, m, st.Suggested, tc.state, tc.move, tc.want)
			}
		})
	}
}

func TestNextMeasured(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	st, _ := slo.Next(c, slo.Target{ITLms: 50, Percentile: 0.9}, slo.Start(c, slo.Base{}), window(10, 0.5, 2))
	m := st.Measured
	if m.ITLSamples != 10 || m.ITLAttainment == nil || *m.ITLAttainment != 0.5 || m.TTFTAttainment != nil || m.Rejected != 2 {
		t.Errorf("Measured = %+v", m)
	}
}

// TestInfeasible: at the floor, steps down that do not improve attainment
// end in infeasible after InfeasibleAfter of them; it holds while
// attainment stays, and leaves when attainment moves.
func TestInfeasible(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{ITLms: 50, Percentile: 0.9}
	st := slo.Status{Suggested: slo.Thresholds{Decode: 0.34, Prefill: 2048}, Step: c.DecodeStep}
	var states []slo.State
	for range c.InfeasibleAfter + 3 {
		st, _ = slo.Next(c, target, st, window(100, 0.2, 0))
		states = append(states, st.State)
	}
	want := make([]slo.State, 0, len(states))
	for range c.InfeasibleAfter {
		want = append(want, slo.StateLowering)
	}
	want = append(want, slo.StateInfeasible, slo.StateInfeasible, slo.StateInfeasible)
	if !equal(states, want) {
		t.Fatalf("states %v, want %v", states, want)
	}
	if st.Suggested.Decode != 0.3 || st.Suggested.Prefill != 1024 {
		t.Errorf("thresholds %+v, want the floor", st.Suggested)
	}
	// Attainment moves: the controller judges again.
	st, _ = slo.Next(c, target, st, window(100, 1, 3))
	if st.State == slo.StateInfeasible {
		t.Errorf("attainment met: still infeasible")
	}
}

// TestInfeasibleNotWhileImproving: a long run of steps down whose
// percentile latency keeps falling is not infeasible.
func TestInfeasibleNotWhileImproving(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{ITLms: 50, Percentile: 0.9}
	st := slo.Start(c, slo.Base{})
	for i := range 10 {
		var w slo.Window
		for range 100 {
			w.ITL.Observe(400 / float64(i+1)) // every sample misses, less each time
		}
		st, _ = slo.Next(c, target, st, &w)
		if st.State == slo.StateInfeasible {
			t.Fatalf("step %d: infeasible while latency falls", i)
		}
	}
}

func equal(a, b []slo.State) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestHistCountsSaturate: counts arrive over the network as any uint64;
// two sources of 2^63 samples each hold the total at the largest uint64
// instead of wrapping it round to the ten real ones, and attainment stays
// a share (it read 1.8e18, a target met).
func TestHistCountsSaturate(t *testing.T) {
	t.Parallel()
	var h slo.Hist
	h.AddBucket(0, 1<<63)
	h.AddBucket(1, 1<<63)
	h.AddBucket(100, 10) // about 5.8 s each
	if h.Total() != math.MaxUint64 {
		t.Errorf("total %d, want the largest uint64", h.Total())
	}
	if a := h.Attainment(500); !(a >= 0 && a <= 1) {
		t.Errorf("attainment %g, want a share", a)
	}
	var o slo.Hist
	o.AddBucket(100, math.MaxUint64)
	o.Add(&h)
	if o[100] != math.MaxUint64 || o.Total() != math.MaxUint64 {
		t.Errorf("bucket 100 %d, total %d: want both held at the largest uint64", o[100], o.Total())
	}
	w := slo.Window{Rejected: math.MaxUint64}
	w.Add(&slo.Window{Rejected: 2})
	if w.Rejected != math.MaxUint64 {
		t.Errorf("rejected %d, want the largest uint64", w.Rejected)
	}
}

// TestPool: windows of intervals with too few samples add up until a
// judgment, then start again.
func TestPool(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{ITLms: 50, Percentile: 0.9}
	st := slo.Status{Suggested: slo.Thresholds{Decode: 0.6, Prefill: 4096}, Step: c.DecodeStep, Holds: 1}
	var p slo.Pool
	for i := range 4 {
		w := p.Window(target, window(20, 0, 0)) // every sample misses; 20 < 50
		st, _ = slo.Next(c, target, st, w)
		p.After(target, st, w)
		want := slo.StateNoData
		if i == 2 { // 60 samples pooled: judged
			want = slo.StateLowering
		}
		if st.State != want || (i == 2) != (st.Measured.ITLSamples == 60) {
			t.Fatalf("interval %d: %s with %d samples, want %s", i, st.State, st.Measured.ITLSamples, want)
		}
	}
}

// TestPoolUnderPressure: a model that sheds with little traffic — 4 first
// tokens an interval, all well within the target, rejections every
// interval — is judged once its pooled samples add up (50 at 0.9, the 13th
// interval), and its thresholds go up; the pool does not start again after
// DefaultPoolMax intervals as it does without rejections (it did, and the
// model shed for good: 40 samples at most, never judged).
func TestPoolUnderPressure(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{TTFTms: 500, Percentile: 0.9}
	for _, rejected := range []uint64{20, 0} {
		st := slo.Start(c, slo.Base{Decode: new(0.3)})
		start := st.Suggested
		var p slo.Pool
		raisedAt := -1
		for i := range 30 {
			var w slo.Window
			for range 4 {
				w.TTFT.Observe(100)
			}
			w.Rejected = rejected
			judged := p.Window(target, &w)
			var m slo.Move
			st, m = slo.Next(c, target, st, judged)
			p.After(target, st, judged)
			if m != 0 {
				raisedAt = i
				break
			}
		}
		switch {
		case rejected > 0 && (raisedAt != 12 || st.Suggested.Decode <= start.Decode):
			t.Errorf("with rejections: moved at interval %d to %+v from %+v, want up at interval 12 (52 samples)", raisedAt, st.Suggested, start)
		case rejected == 0 && (raisedAt != -1 || st.State != slo.StateNoData):
			t.Errorf("without rejections: moved at interval %d, state %s; want no_data, no move (the pool starts again)", raisedAt, st.State)
		}
	}
}

// TestPoolPerSignal: a signal with enough samples in an interval is judged
// on that interval alone while the other is still pooled, so a collapse of
// a well-measured ITL lowers the thresholds at once instead of being
// diluted by the intervals a scarce TTFT needs.
func TestPoolPerSignal(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{TTFTms: 1000, ITLms: 50, Percentile: 0.9}
	st := slo.Status{Suggested: slo.Thresholds{Decode: 0.85, Prefill: 4096}, Step: c.DecodeStep, Holds: 1}
	interval := func(itlGood float64) *slo.Window {
		var w slo.Window
		for i := range 400 {
			if float64(i) < itlGood*400 {
				w.ITL.Observe(20)
			} else {
				w.ITL.Observe(200)
			}
		}
		for range 8 { // 8 first tokens an interval: TTFT is judged after 7
			w.TTFT.Observe(100)
		}
		return &w
	}
	var p slo.Pool
	for i := range 3 { // ITL met, TTFT short: pooled
		w := p.Window(target, interval(1))
		st, _ = slo.Next(c, target, st, w)
		p.After(target, st, w)
		if st.State != slo.StateNoData || st.Measured.TTFTSamples != uint64(8*(i+1)) || st.Measured.ITLSamples != 400 {
			t.Fatalf("interval %d: %s, %d TTFT samples (want %d, pooled), %d ITL (want 400: its own)", i, st.State,
				st.Measured.TTFTSamples, 8*(i+1), st.Measured.ITLSamples)
		}
	}
	w := p.Window(target, interval(0.4)) // ITL collapses
	st, m := slo.Next(c, target, st, w)
	if m != -1 || st.State != slo.StateLowering || st.Measured.ITLAttainment == nil || *st.Measured.ITLAttainment > 0.41 {
		t.Errorf("the interval ITL collapsed: %s, move %d, ITL attainment %v; want lowering at once on 0.4", st.State, m, st.Measured.ITLAttainment)
	}
}

// A collapse is judged at once; a smaller miss is smoothed with the
// judgments made before at the same thresholds.
func TestCollapseNotSmoothed(t *testing.T) {
	t.Parallel()
	c := slo.DefaultConfig()
	target := slo.Target{ITLms: 50, Percentile: 0.9}
	steady := slo.Status{State: slo.StateSteady, Suggested: slo.Thresholds{Decode: 0.85, Prefill: 8192}, Step: c.DecodeStep,
		Holds: 3, Attainment: 0.99, Ratio: 0.5, Smoothed: true}
	for _, tc := range []struct {
		name  string
		good  float64
		state slo.State
		move  slo.Move
		att   float64
	}{
		// 0.3 × 0.7 + 0.7 × 0.99 = 0.903 smoothed: it would hold.
		{"collapse: down at once", 0.7, slo.StateLowering, -1, 0.7},
		// 0.3 × 0.85 + 0.7 × 0.99 = 0.948: a small miss waits.
		{"small miss: smoothed", 0.85, slo.StateSteady, 0, 0.948},
	} {
		st, m := slo.Next(c, target, steady, window(100, tc.good, 0))
		if st.State != tc.state || m != tc.move || math.Abs(st.Attainment-tc.att) > 0.005 {
			t.Errorf("%s: Next = %s %+d attainment %.3f, want %s %+d %.3f", tc.name, st.State, m, st.Attainment, tc.state, tc.move, tc.att)
		}
	}
}
