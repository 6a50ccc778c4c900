package admission

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// fakeClock is a clock the test moves.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time            { return c.t }
func (c *fakeClock) add(d time.Duration)       { c.t = c.t.Add(d) }
func newFakeClock() *fakeClock                 { return &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }
func within(d, lo, hi time.Duration) bool      { return d >= lo && d <= hi }
func pct(d time.Duration, p int) time.Duration { return d * time.Duration(p) / 100 }

// newTestEstimator returns an estimator of floor on clock, with a fixed
// seed.
func newTestEstimator(t *testing.T, floor time.Duration, clock *fakeClock) *RetryEstimator {
	t.Helper()
	e, err := NewRetryEstimator(floor)
	if err != nil {
		t.Fatal(err)
	}
	e.now, e.seed = clock.now, 42
	return e
}

// serve makes the requests of each model end at rate per second for d on
// clock.
func serve(e *RetryEstimator, clock *fakeClock, rate float64, d time.Duration, models ...string) {
	step := time.Duration(float64(time.Second) / rate)
	for end := clock.t.Add(d); clock.t.Before(end); clock.add(step) {
		for _, m := range models {
			e.Done(m)
		}
	}
}

func TestRetryEstimatorTable(t *testing.T) {
	t.Parallel()
	e := newTestEstimator(t, time.Second, newFakeClock())
	last := e.table[len(e.table)-1].d
	if last < DefaultMaxRetryAfter || e.table[0].d != 10*time.Millisecond {
		t.Fatalf("table from %v to %v; want 10ms to past %v", e.table[0].d, last, DefaultMaxRetryAfter)
	}
	for i := 1; i < len(e.table); i++ {
		if step := e.table[i].d - e.table[i-1].d; step < 10*time.Millisecond || step > max(10*time.Millisecond, pct(e.table[i-1].d, 1)+time.Millisecond) {
			t.Fatalf("entries %v and %v: want 10 ms or 1 %% apart", e.table[i-1].d, e.table[i].d)
		}
	}
	// index finds the first entry at least as long (to the millisecond).
	for ms := 1; ms < 70000; ms += 7 {
		d := time.Duration(ms) * time.Millisecond
		i := e.index(d.Seconds())
		if got := e.table[i].d; got < d-time.Millisecond/2 && i < len(e.table)-1 {
			t.Fatalf("index(%v) = %v: shorter", d, got)
		}
		if i > 0 && e.table[i-1].d >= d+time.Millisecond/2 {
			t.Fatalf("index(%v) = %v: %v before it is long enough", d, e.table[i].d, e.table[i-1].d)
		}
	}
	if _, err := NewRetryEstimator(0); err == nil {
		t.Error("a floor of 0 is accepted")
	}
}

// TestRetryEstimatorSpreadsABurst: 200 requests of a model whose requests
// end at 20/s are rejected in the same instant. They are told to come back
// over the 10 s the model needs to free 200 slots from the floor on, one in
// each slot of 50 ms — not in one wave after the floor, as a constant
// Retry-After did.
func TestRetryEstimatorSpreadsABurst(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newTestEstimator(t, time.Second, clock)
	serve(e, clock, 20, 30*time.Second, "m")
	var waits []time.Duration
	for range 200 {
		waits = append(waits, e.Next("m", 0))
	}
	// Rejection k (from 0) comes in the k-th slot of 50 ms after the 1 s
	// floor: within 1 s + [k, k+1] × 50 ms, the table's 1 % (and a millisecond) aside.
	for i, w := range waits {
		k := time.Duration(i)
		lo, hi := pct(time.Second+k*50*time.Millisecond, 99), pct(time.Second+(k+1)*50*time.Millisecond, 102)
		if !within(w, lo, hi) {
			t.Errorf("rejection %d: wait %v; want in [%v, %v]", i+1, w, lo, hi)
		}
	}
	// No wave: at most 10 of the 200 in any 250 ms, and the last after 9 s.
	sorted := slices.Sorted(slices.Values(waits))
	for i := range sorted {
		j := i
		for j < len(sorted) && sorted[j]-sorted[i] < 250*time.Millisecond {
			j++
		}
		if j-i > 10 {
			t.Fatalf("%d of 200 come back within 250 ms of %v: a wave (%v)", j-i, sorted[i], sorted)
		}
	}
	if sorted[0] < time.Second || sorted[len(sorted)-1] < 10*time.Second {
		t.Errorf("waits from %v to %v; want from the 1 s floor to about 11 s", sorted[0], sorted[len(sorted)-1])
	}
	t.Logf("200 rejections in one instant at 20 freed slots/s: waits %v … %v, median %v",
		sorted[0], sorted[len(sorted)-1], sorted[100])
}

// TestRetryEstimatorSchedule: the slots promised to a burst stay promised,
// so a rejection 5 s later is given the slot after the burst's last; a
// queue ahead is served first; a single rejection waits the floor and a
// fraction of a slot.
func TestRetryEstimatorSchedule(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newTestEstimator(t, time.Second, clock)
	serve(e, clock, 20, 30*time.Second, "m", "q")
	if w := e.Next("m", 0); !within(w, time.Second, pct(1050*time.Millisecond, 101)) {
		t.Errorf("a single rejection waits %v; want the 1 s floor and up to a slot of 50 ms", w)
	}
	for range 199 {
		e.Next("m", 0)
	}
	serve(e, clock, 20, 5*time.Second, "m", "q")
	if w := e.Next("m", 0); !within(w, pct(6*time.Second, 99), pct(6050*time.Millisecond, 103)) {
		t.Errorf("5 s after a burst of 200, a rejection waits %v; want about 6 s: after the burst's slots, up to 11 s", w)
	}
	if w := e.Next("q", 100); !within(w, pct(5*time.Second, 99), pct(5050*time.Millisecond, 103)) {
		t.Errorf("with 100 queued ahead, a rejection waits %v; want about 5 s (100 slots at 20/s)", w)
	}
	// Another model has its own estimate: unknown yet, the floor.
	if w := e.Next("other", 0); !within(w, time.Second, pct(1250*time.Millisecond, 101)) {
		t.Errorf("a model never served waits %v; want the floor, spread up to 1.25 s", w)
	}
}

// TestRetryEstimatorBounds: before any request of the model has ended, the
// floor, spread over a quarter of it; when the model frees almost nothing,
// the cap, spread over a quarter below it; a floor above the cap wins.
func TestRetryEstimatorBounds(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newTestEstimator(t, 2*time.Second, clock)
	distinct := map[time.Duration]bool{}
	for range 200 {
		w := e.Next("m", 0)
		if !within(w, 2*time.Second, pct(2500*time.Millisecond, 101)) {
			t.Fatalf("unknown rate: wait %v; want in [2s, 2.5s]", w)
		}
		distinct[w] = true
	}
	if len(distinct) < 15 {
		t.Errorf("unknown rate: 200 waits take %d values; want them spread", len(distinct))
	}
	e.Done("m")
	clock.add(time.Second)
	e.Done("m") // known: 1/s
	clock.add(10 * time.Minute)
	e.Done("m") // and then nothing for 10 minutes: a slot is 60 s at least
	if w := e.Next("m", 0); !within(w, 2*time.Second, DefaultMaxRetryAfter) {
		t.Fatalf("a model that frees nothing: the first wait %v; want in its slot after the floor, up to 60 s", w)
	}
	for range 50 { // the next slots start past the cap
		if w := e.Next("m", 0); !within(w, pct(DefaultMaxRetryAfter, 75), DefaultMaxRetryAfter) {
			t.Fatalf("a model that frees nothing: wait %v; want in [45s, 60s]", w)
		}
	}
	high := newTestEstimator(t, 90*time.Second, clock)
	if w := high.Next("m", 0); !within(w, 90*time.Second, 114*time.Second) {
		t.Errorf("floor 90 s: wait %v", w)
	}
}

// TestRetryEstimatorSet: the headers are the table's, and setting them
// allocates nothing once the model has been seen.
func TestRetryEstimatorSet(t *testing.T) { // not parallel: AllocsPerRun
	clock := newFakeClock()
	e := newTestEstimator(t, 1500*time.Millisecond, clock)
	h := http.Header{}
	e.Set(h, "m", 0)
	ms, err := strconv.Atoi(h.Get(RetryAfterMsHeader))
	if err != nil || ms < 1500 || ms > 1900 || h.Get("Retry-After") != "2" {
		t.Errorf("headers %v", h)
	}
	e.Done("m")
	if n := testing.AllocsPerRun(1000, func() { e.Set(h, "m", 3); e.Done("m"); clock.add(time.Millisecond) }); n != 0 {
		t.Errorf("Set and Done: %v allocations", n)
	}
}

// BenchmarkRejectModel measures the Middleware's rejection of a request of
// a model whose requests end at 1000/s: the retry headers and the body.
func BenchmarkRejectModel(b *testing.B) {
	m, err := NewMiddleware(admitTestDecisions)
	if err != nil {
		b.Fatal(err)
	}
	clock := newFakeClock()
	m.Estimator().now = clock.now
	serve(m.Estimator(), clock, 1000, time.Second, "busy")
	w := &discardWriter{h: http.Header{}}
	d := Decision{Reason: ReasonAllBusy}
	b.ReportAllocs()
	for b.Loop() {
		m.RejectModel(w, "busy", 5, d)
	}
}

// discardWriter is a ResponseWriter that keeps its header map.
type discardWriter struct{ h http.Header }

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *discardWriter) WriteHeader(int)             {}

func TestRejectModelAllocatesNothing(t *testing.T) { // not parallel: AllocsPerRun
	m, err := NewMiddleware(admitTestDecisions)
	if err != nil {
		t.Fatal(err)
	}
	w := &discardWriter{h: http.Header{}}
	m.Estimator().Done("busy")
	d := Decision{Reason: ReasonShed}
	if n := testing.AllocsPerRun(1000, func() { m.RejectModel(w, "busy", 0, d) }); n != 0 {
		t.Errorf("a rejection allocates %v times", n)
	}
	checkRetryHeaders(t, w.h, DefaultRetryAfter)
}

// switchDecider admits while busy is false.
type switchDecider struct{ busy bool }

func (d *switchDecider) Decide(string) Decision {
	if d.busy {
		return Decision{Reason: ReasonAllBusy, Busy: []uint64{1}}
	}
	return Decision{Admit: true, Reason: ReasonFree, Free: []uint64{1}}
}

// TestMiddlewareFeedsTheEstimate: the requests the Middleware lets through
// tell the estimate how fast the model frees slots (20/s here), so when the
// model turns all busy, 40 rejections in one instant are told to come back
// over the 2 s the model needs for them, after the floor — not all within
// the floor's quarter, as with no rate known.
func TestMiddlewareFeedsTheEstimate(t *testing.T) {
	t.Parallel()
	d := &switchDecider{}
	m, err := NewMiddleware(d, WithModelFunc(ModelFromHeader("X-Model")))
	if err != nil {
		t.Fatal(err)
	}
	clock := newFakeClock()
	m.Estimator().now = clock.now
	h := m.Wrap(admitTestNext)
	send := func() *http.Response {
		req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
		req.Header.Set("X-Model", "m")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Result()
	}
	for range 100 { // 5 s at 20/s
		if resp := send(); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d while free", resp.StatusCode)
		}
		clock.add(50 * time.Millisecond)
	}
	d.busy = true
	var waits []time.Duration
	for range 40 {
		resp := send()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("status %d while busy", resp.StatusCode)
		}
		ms, err := strconv.Atoi(resp.Header.Get(RetryAfterMsHeader))
		if err != nil {
			t.Fatalf("retry-after-ms %q", resp.Header.Get(RetryAfterMsHeader))
		}
		waits = append(waits, time.Duration(ms)*time.Millisecond)
	}
	lo, hi := slices.Min(waits), slices.Max(waits)
	if lo < time.Second || hi < 2900*time.Millisecond || hi > 3100*time.Millisecond {
		t.Errorf("40 rejections wait from %v to %v; want from the 1 s floor to about 3 s", lo, hi)
	}
}

// TestRetryEstimatorAfterLongIdle: a model whose requests ended at 10/s,
// then rejections 150 s apart and nothing between (no request ends), so
// that its average rate decays to almost nothing (about 1e-15/s at the
// second): each rejection still waits at least the floor and at most the
// cap. 1 s ÷ a rate that small overflowed int64 and the wait came out
// negative: 10 ms.
func TestRetryEstimatorAfterLongIdle(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newTestEstimator(t, time.Second, clock)
	serve(e, clock, 10, 5*time.Second, "m")
	for _, idle := range []time.Duration{150 * time.Second, 150 * time.Second, 150 * time.Second, time.Hour} {
		clock.add(idle)
		for range 5 {
			if d := e.Next("m", 0); d < e.Floor() || d > DefaultMaxRetryAfter {
				t.Fatalf("after %v idle: wait %v; want within [%v, %v]", idle, d, e.Floor(), DefaultMaxRetryAfter)
			}
			if d := e.Next("m", 3); d < e.Floor() || d > DefaultMaxRetryAfter {
				t.Fatalf("after %v idle, 3 ahead: wait %v; want within [%v, %v]", idle, d, e.Floor(), DefaultMaxRetryAfter)
			}
		}
	}
}

// fillModels gives e retryMaxModels models of their own, so that any other
// model shares the fallback estimate.
func fillModels(e *RetryEstimator) {
	for i := range retryMaxModels {
		e.Done("model-" + strconv.Itoa(i))
	}
}

// BenchmarkRetryOverflowModel measures a rejection and a request end of a
// model past retryMaxModels, from every CPU at once: no lock, no allocation.
func BenchmarkRetryOverflowModel(b *testing.B) {
	e, err := NewRetryEstimator(time.Second)
	if err != nil {
		b.Fatal(err)
	}
	fillModels(e)
	h := http.Header{}
	e.Set(h, "over", 0)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		h := http.Header{}
		e.Set(h, "over", 0)
		for pb.Next() {
			e.Set(h, "over", 1)
			e.Done("over")
		}
	})
}

// TestRetryEstimatorOverflowTakesNoLock: past retryMaxModels, a further
// model shares one estimate, found without the lock that serializes the
// copies of the map (held here, as by a concurrent insertion); the
// rejection path stays lock-free. The old code took the lock for every
// rejection and request end of such a model.
func TestRetryEstimatorOverflowTakesNoLock(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newTestEstimator(t, time.Second, clock)
	fillModels(e)
	e.mu.Lock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		h := http.Header{}
		e.Set(h, "over", 0)
		e.Done("over")
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second): // a deadline for a hang, not a timing assertion
		e.mu.Unlock()
		t.Fatal("a rejection of a model past the limit waits for the map's lock")
	}
	e.mu.Unlock()
	if e.model("over") != &e.other || e.model("other-too") != &e.other {
		t.Error("models past the limit do not share the fallback estimate")
	}
}

// TestRetryEstimatorDoneUnnamed: a request that names no model ends once
// in the all-models estimate, not twice: the rate every-model rejections
// are spread by is the rate requests end.
func TestRetryEstimatorDoneUnnamed(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newTestEstimator(t, time.Second, clock)
	e.Done("")
	e.Done("m")
	if got := e.total.ended.Load(); got != 2 {
		t.Errorf("two requests ended, one naming no model: the all-models total counts %d", got)
	}
}
