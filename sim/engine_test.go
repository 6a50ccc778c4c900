package sim

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/sim/stepengine"
)

// tinyConfig returns the tiny profile's rank with kv blocks.
func tinyConfig(t *testing.T, kv int) stepengine.Config {
	t.Helper()
	p, err := stepengine.LookupProfile(stepengine.ProfileTiny)
	if err != nil {
		t.Fatal(err)
	}
	p.Config.KVBlocks = kv
	return p.Config
}

// recorder counts the latencies observed per rank.
type recorder struct{ ttfts, itls, e2es []time.Duration }

func (r *recorder) ttft(_ int, d time.Duration) { r.ttfts = append(r.ttfts, d) }
func (r *recorder) itl(_ int, d time.Duration)  { r.itls = append(r.itls, d) }
func (r *recorder) e2e(_ int, d time.Duration)  { r.e2es = append(r.e2es, d) }

func newTestEngine(t *testing.T, obs observer, cfgs ...stepengine.Config) *engine {
	t.Helper()
	e, err := newEngine(cfgs, obs)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// Tokens are delivered at the ends of the steps, not before: the engine
// loop's advance ends a step only once the clock has reached its end.
func TestEngineDeliversAtStepEnds(t *testing.T) {
	t.Parallel()
	obs := &recorder{}
	cfg := tinyConfig(t, 64)
	e := newTestEngine(t, obs, cfg)
	t0 := time.Unix(1000, 0)
	r := newRequest(100, 3, 0)
	if !e.add(t0, r) {
		t.Fatal("add refused a request that fits")
	}
	end, ok := e.advance(t0)
	if !ok || end != t0.Add(cfg.StepTime(100, 0, 0)) {
		t.Fatalf("first step ends at %v (ok %v); want the prefill of 100 tokens", end.Sub(t0), ok)
	}
	if next, _ := e.advance(end.Add(-time.Nanosecond)); next != end || r.produced.Load() != 0 {
		t.Fatalf("before the step's end: next %v, produced %d", next.Sub(t0), r.produced.Load())
	}
	e.advance(end)
	if r.produced.Load() != 1 || len(r.notify) != 1 || len(obs.ttfts) != 1 || obs.ttfts[0] != end.Sub(t0) {
		t.Fatalf("at the step's end: produced %d, notified %d, ttfts %v", r.produced.Load(), len(r.notify), obs.ttfts)
	}
	if _, ok := e.advance(end.Add(time.Hour)); ok { // catches up on every step
		t.Fatal("a step is still in progress after the request finished")
	}
	select {
	case <-r.done:
	default:
		t.Fatal("request not done")
	}
	if r.produced.Load() != 3 || len(obs.itls) != 2 || len(obs.e2es) != 1 || e.completed != 1 || e.busy() {
		t.Fatalf("produced %d, itls %v, e2es %v, completed %d, busy %v", r.produced.Load(), obs.itls, obs.e2es, e.completed, e.busy())
	}
	if l := e.load(0); l.decodeBlocks != 0 || l.prefillTokens != 0 {
		t.Fatalf("load after the end %+v", l)
	}
}

// A request goes to the least loaded rank that can hold it.
func TestEngineLeastLoaded(t *testing.T) {
	t.Parallel()
	e := newTestEngine(t, nil, tinyConfig(t, 100), tinyConfig(t, 10))
	t0 := time.Unix(1000, 0)
	a, b := newRequest(40, 40, 0), newRequest(40, 40, 0)
	if !e.add(t0, a) || !e.add(t0, b) || a.rank != 0 || b.rank != 1 {
		t.Fatalf("ranks %d and %d; want 0 then 1", a.rank, b.rank)
	}
	big := newRequest(16*20, 16, 0)
	if !e.add(t0, big) || big.rank != 0 {
		t.Fatalf("big request on rank %d; want 0, the only one that holds it", big.rank)
	}
	if e.add(t0, newRequest(16*100, 16, 0)) {
		t.Fatal("add accepted a request no rank can hold")
	}
	if l := e.load(0); l.prefillTokens != 40+16*20 {
		t.Fatalf("rank 0 prefill tokens %d; want its two prompts", l.prefillTokens)
	}
}

// A cancelled request frees its blocks and its prefill at once, waiting or
// running, and yields nothing more.
func TestEngineCancelFrees(t *testing.T) {
	t.Parallel()
	e := newTestEngine(t, nil, tinyConfig(t, 64))
	t0 := time.Unix(1000, 0)
	run, wait := newRequest(100, 50, 0), newRequest(100, 50, 0)
	e.add(t0, run)
	end, _ := e.advance(t0)
	e.add(t0, wait) // arrives during the first step: waits for the next
	e.advance(end)
	if l := e.load(0); l.decodeBlocks == 0 || l.prefillTokens == 0 {
		t.Fatalf("load %+v; want blocks held and a prompt to prefill", l)
	}
	if !e.cancel(run) || !e.cancel(wait) || e.cancel(run) {
		t.Fatal("cancel: want true for each request once, then false")
	}
	// The prompt computed stays counted.
	if l := e.load(0); l != (rankLoad{prefilledTokens: 100}) || e.busy() || e.cancelled != 2 {
		t.Fatalf("after cancelling: load %+v, busy %v, cancelled %d", l, e.busy(), e.cancelled)
	}
	e.advance(end.Add(time.Hour))
	if run.produced.Load() > 1 || wait.produced.Load() != 0 {
		t.Fatalf("cancelled requests produced %d and %d", run.produced.Load(), wait.produced.Load())
	}
}

func TestContinuation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		text string
		want int
	}{
		{"", 0},
		{"hello", 0},
		{"tok0", 1},
		{"say tok4 tok5", 6},
		{"tok12\n", 13},
		{"xtok3", 0},
		{"tok", 0},
		{"tok-1", 0},
		{"tok+1", 0},
		{"tok1a", 0},
		{"tok1234567890", 0},
	} {
		if got := continuation(tc.text); got != tc.want {
			t.Errorf("continuation(%q) = %d; want %d", tc.text, got, tc.want)
		}
	}
	if got := generatedText(3, 3, false); got != " tok3 tok4 tok5" {
		t.Errorf("generatedText completion = %q", got)
	}
	if got := generatedText(0, 2, true); got != "tok0 tok1" {
		t.Errorf("generatedText chat = %q", got)
	}
	// A text cut anywhere between tokens continues where it stopped.
	full := "prompt" + generatedText(0, 10, false)
	cut := "prompt" + generatedText(0, 4, false)
	if got := cut + generatedText(continuation(cut), 6, false); got != full {
		t.Errorf("continued text %q; want %q", got, full)
	}
}

// TestFinishedStreamIsNotCut: a stream whose request the engine finished as
// a migrate request cut it ends as served — finish reason and [DONE] —
// instead of cut (the select took either at random: the client lost the
// end of an answer it had whole, and the router ran its last tokens again
// elsewhere).
func TestFinishedStreamIsNotCut(t *testing.T) {
	t.Parallel()
	w := &Worker{}
	for range 64 {
		req := newRequest(1, 3, 0)
		req.produced.Store(3)
		close(req.done)
		cut := make(chan struct{})
		close(cut)
		rec := httptest.NewRecorder()
		if !w.stream(t.Context(), rec, job{maxTokens: 3, stream: true}, req, "cmpl-1", cut) || !strings.Contains(rec.Body.String(), "[DONE]") {
			t.Fatalf("a finished request's stream was cut: %q", rec.Body.String())
		}
	}
}

// A rank's report carries the leading signals of contract §21: the request
// counts, the counters, and kv_committed_blocks estimated from max_tokens
// until a request finished, then from the p90 of the finished outputs,
// never from a request's sim_output_tokens.
func TestEngineLeadingSignals(t *testing.T) {
	t.Parallel()
	cfg := tinyConfig(t, 64) // blocks of 16 tokens
	e := newTestEngine(t, nil, cfg)
	t0 := time.Unix(1000, 0)
	first := newRequest(32, 100, 10)
	if !e.add(t0, first) {
		t.Fatal("add refused a request that fits")
	}
	want := rankLoad{prefillTokens: 32, waiting: 1, kvCommittedBlocks: 9} // ceil((32+100)/16): max_tokens, not the hidden 10
	if got := e.load(0); got != want {
		t.Fatalf("one waiting, nothing finished:\n got %+v\nwant %+v", got, want)
	}
	e.advance(t0) // the prefill step begins
	if _, ok := e.advance(t0.Add(time.Hour)); ok {
		t.Fatal("still stepping an hour later")
	}
	if first.produced.Load() != 10 {
		t.Fatalf("produced %d, want its sim_output_tokens 10", first.produced.Load())
	}
	want = rankLoad{prefilledTokens: 32}
	if got := e.load(0); got != want {
		t.Fatalf("idle after the finish:\n got %+v\nwant %+v", got, want)
	}
	// Now the estimate is the p90 of the finished outputs (10), whatever
	// the new requests' own sim_output_tokens.
	at := t0.Add(2 * time.Hour)
	for _, r := range []*request{newRequest(32, 100, 0), newRequest(32, 100, 90)} {
		if !e.add(at, r) {
			t.Fatal("add refused a request that fits")
		}
	}
	want = rankLoad{prefillTokens: 64, waiting: 2, prefilledTokens: 32, kvCommittedBlocks: 3 + 3} // ceil((32+10)/16) each
	if got := e.load(0); got != want {
		t.Fatalf("two waiting after one finished at 10:\n got %+v\nwant %+v", got, want)
	}
}
