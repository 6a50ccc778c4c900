package router

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// TestLatencyBook: TTFT from dispatch to the first text, ITL between later
// ones, in the §18 buckets; sheddable requests not timed; a window drains
// once; rejections ride on the model's reports, or on a registered worker's
// when no worker has samples.
func TestLatencyBook(t *testing.T) {
	t.Parallel()
	var b latencyBook
	t0 := time.Unix(1000, 0)
	if b.begin("m", 3, admission.ClassStandard, t0).e != nil {
		t.Fatal("timed while off (RunLatency not running)")
	}
	b.on.Store(true)
	s := b.begin("m", 3, admission.ClassStandard, t0)
	s.text(t0.Add(100 * time.Millisecond))
	s.text(t0.Add(120 * time.Millisecond))
	s.text(t0.Add(140 * time.Millisecond))
	if b.begin("m", 3, admission.ClassSheddable, t0).e != nil {
		t.Error("a sheddable request is timed")
	}
	b.reject("m")
	b.reject("m")
	b.queue("m")
	b.reject("other")
	reports := b.drain("router/r", time.Second, t0.Add(time.Second), func(string) []uint64 { return []uint64{9} })
	if len(reports) != 2 {
		t.Fatalf("reports %+v, want one for m/3 and one for other/9", reports)
	}
	r := reports[0]
	if r.Model != "m" || r.WorkerID != 3 || r.Source != "router/r" || r.WindowMs != 1000 || r.Rejected != 2 || r.Queued != 1 {
		t.Fatalf("report %+v", r)
	}
	if len(r.TTFT) != 1 || r.TTFT[0] != (events.LatencyBucket{K: events.LatencyBucketOf(100), N: 1}) {
		t.Errorf("ttft %+v, want one sample in the 100 ms bucket", r.TTFT)
	}
	if len(r.ITL) != 1 || r.ITL[0] != (events.LatencyBucket{K: events.LatencyBucketOf(20), N: 2}) {
		t.Errorf("itl %+v, want two samples in the 20 ms bucket", r.ITL)
	}
	if o := reports[1]; o.Model != "other" || o.WorkerID != 9 || o.Rejected != 1 || len(o.TTFT)+len(o.ITL) != 0 {
		t.Errorf("rejections-only report %+v", o)
	}
	for _, r := range reports {
		if _, err := events.MarshalLatencyReport(&r); err != nil {
			t.Errorf("report does not encode: %v", err)
		}
	}
	if again := b.drain("router/r", time.Second, t0.Add(2*time.Second), func(string) []uint64 { return nil }); len(again) != 0 {
		t.Errorf("second drain: %+v", again)
	}
}

// TestRouterPublishesLatency: streams relayed through the router (a
// completion and a chat completion) are timed on their worker and
// published on latr subjects; a rejected request counts in the window.
func TestRouterPublishesLatency(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.RouterID = "r1" }})
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		if _, chat := body["messages"]; chat {
			fmt.Fprint(w, `data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}`+"\n\n")
			for _, tok := range []string{"a", "b", "c"} {
				fmt.Fprint(w, `data: {"id":"c","choices":[{"index":0,"delta":{"content":"`+tok+`"}}]}`+"\n\n")
			}
		} else {
			for _, tok := range []string{"a", "b"} {
				fmt.Fprint(w, sseEvent(completionChunk("c", tok, "", nil)))
			}
		}
		fmt.Fprint(w, sseEvent(completionChunk("c", "", "stop", nil)))
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	env.putWorker(t, model, 4, e.srv.URL)
	env.putRecord(t, model, []uint64{4}, nil, time.Now())

	var mu sync.Mutex
	var got []events.LatencyReport
	go func() {
		_ = env.rt.RunLatency(t.Context(), "wm", 20*time.Millisecond, func(subject string, data []byte) error {
			r, err := events.DecodeLatencyReport(data)
			if err != nil || subject != events.LatrSubject("wm", r.Model, r.WorkerID) {
				t.Errorf("published %s: %+v %v", subject, r, err)
			}
			mu.Lock()
			got = append(got, r)
			mu.Unlock()
			return nil
		})
	}()
	natstest.WaitFor(t, 5*time.Second, "latency windows on", env.rt.latency.on.Load)

	for _, req := range []struct{ path, body string }{
		{PathCompletions, `{"model":"` + model + `","prompt":"x","stream":true}`},
		{PathChatCompletions, `{"model":"` + model + `","messages":[{"role":"user","content":"x"}],"stream":true}`},
	} {
		resp := env.post(t, req.path, req.body)
		readAll(t, resp)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d", req.body, resp.StatusCode)
		}
	}
	env.putRecord(t, model, nil, []uint64{4}, time.Now())
	if resp := env.post(t, PathCompletions, `{"model":"`+model+`","prompt":"x"}`); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("all busy: %d", resp.StatusCode)
	}

	count := func(bs []events.LatencyBucket) (n uint64) {
		for _, b := range bs {
			n += b.N
		}
		return n
	}
	var ttft, itl, rejected uint64
	natstest.WaitFor(t, 5*time.Second, "the windows published", func() bool {
		mu.Lock()
		defer mu.Unlock()
		ttft, itl, rejected = 0, 0, 0
		for _, r := range got {
			if r.Model != model || r.WorkerID != 4 || r.Source != "router/r1" {
				t.Errorf("report %+v", r)
			}
			ttft, itl, rejected = ttft+count(r.TTFT), itl+count(r.ITL), rejected+r.Rejected
		}
		return ttft >= 2 && itl >= 3 && rejected >= 1
	})
	// Two streams: two TTFT samples; 1 + 2 gaps between text events.
	if ttft != 2 || itl != 3 || rejected != 1 {
		t.Errorf("ttft %d itl %d samples, %d rejected; want 2, 3 and 1", ttft, itl, rejected)
	}
}

// TestLatencyRejectNoLockNoAlloc: counting a rejection or a queued request
// of a known model takes no lock and allocates nothing, and a model that
// rejected in a window is still known in the next (the drain does not make
// the first rejection of every window allocate and take the write lock).
func TestLatencyRejectNoLockNoAlloc(t *testing.T) { // not parallel: AllocsPerRun
	var b latencyBook
	b.on.Store(true)
	b.reject("m")
	none := func(string) []uint64 { return []uint64{1} }
	b.drain("router/r", time.Second, time.Unix(1, 0), none)
	if (*b.models.Load())["m"] == nil {
		t.Fatal("model m forgotten after a window with a rejection")
	}
	if n := testing.AllocsPerRun(1000, func() { b.reject("m"); b.queue("m") }); n != 0 {
		t.Errorf("%v allocs/op, want 0", n)
	}
	// Held locked: counting for a known model never takes it.
	b.mu.Lock()
	done := make(chan struct{})
	go func() { b.reject("m"); b.queue("m"); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Error("reject blocks on the book's lock")
	}
	b.mu.Unlock()
	<-done
	// A model idle for a whole window is forgotten.
	b.drain("router/r", time.Second, time.Unix(2, 0), none)
	b.drain("router/r", time.Second, time.Unix(3, 0), none)
	if (*b.models.Load())["m"] != nil {
		t.Error("model m kept after a window without rejections")
	}
}

// BenchmarkLatencyReject measures counting a rejected request, from every
// core at once (the path of a router under overload).
func BenchmarkLatencyReject(b *testing.B) {
	var book latencyBook
	book.on.Store(true)
	book.reject("m")
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			book.reject("m")
		}
	})
}

// TestLatencyBeginNoAlloc: timing a stream of a known worker allocates
// nothing: the stream's timer lives in its exchange.
func TestLatencyBeginNoAlloc(t *testing.T) { // not parallel: AllocsPerRun
	var b latencyBook
	b.on.Store(true)
	t0 := time.Unix(1000, 0)
	ex := &exchange{}
	sink = ex
	if n := testing.AllocsPerRun(1000, func() {
		ex.lat = b.begin("m", 3, admission.ClassStandard, t0)
		ex.lat.text(t0.Add(time.Millisecond))
	}); n != 0 {
		t.Errorf("%v allocs/op, want 0", n)
	}
}

// sink keeps the exchange of TestLatencyBeginNoAlloc on the heap, as a
// real one is.
var sink *exchange

// TestLatencyTextNoLock: recording a text event of a timed stream takes no
// lock (the entry's counts are atomic; its mutex is the drain's only).
func TestLatencyTextNoLock(t *testing.T) {
	t.Parallel()
	var b latencyBook
	b.on.Store(true)
	t0 := time.Unix(1000, 0)
	s := b.begin("m", 3, admission.ClassStandard, t0)
	s.e.mu.Lock()
	done := make(chan struct{})
	go func() { s.text(t0.Add(100 * time.Millisecond)); s.text(t0.Add(120 * time.Millisecond)); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Error("text blocks on the entry's lock")
	}
	s.e.mu.Unlock()
	<-done
	r := b.drain("router/r", time.Second, t0.Add(time.Second), func(string) []uint64 { return nil })
	if len(r) != 1 || len(r[0].TTFT) != 1 || len(r[0].ITL) != 1 {
		t.Errorf("reports %+v, want one TTFT and one ITL sample", r)
	}
}

// BenchmarkLatencyText measures recording a text event, from streams of
// one worker on every core at once.
func BenchmarkLatencyText(b *testing.B) {
	var book latencyBook
	book.on.Store(true)
	t0 := time.Unix(1000, 0)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		s := book.begin("m", 3, admission.ClassStandard, t0)
		now := t0
		for pb.Next() {
			now = now.Add(20 * time.Millisecond)
			s.text(now)
		}
	})
}

// TestLatencySlowFirstToken: a stream whose first text comes windows after
// its dispatch still counts it: the drain keeps the entry of a stream in
// progress, however long without samples.
func TestLatencySlowFirstToken(t *testing.T) {
	t.Parallel()
	var b latencyBook
	b.on.Store(true)
	t0 := time.Unix(1000, 0)
	none := func(string) []uint64 { return nil }
	s := b.begin("m", 3, admission.ClassStandard, t0)
	b.drain("router/r", time.Second, t0.Add(time.Second), none)
	b.drain("router/r", time.Second, t0.Add(2*time.Second), none)
	s.text(t0.Add(2500 * time.Millisecond))
	r := b.drain("router/r", time.Second, t0.Add(3*time.Second), none)
	if len(r) != 1 || len(r[0].TTFT) != 1 {
		t.Fatalf("reports %+v, want the 2.5 s TTFT", r)
	}
	s.end()
	b.drain("router/r", time.Second, t0.Add(4*time.Second), none)
	b.mu.RLock()
	defer b.mu.RUnlock()
	if len(b.entries) != 0 {
		t.Errorf("%d entries left after the stream ended, want 0", len(b.entries))
	}
}
