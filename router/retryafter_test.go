package router

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retrytest"
)

// checkRetryHeaders checks the retry headers of a rejection (contract
// §23): retry-after-ms at least floor and at most the cap, Retry-After
// that value in whole seconds, rounded, at least the floor rounded up and
// at least 1.
func checkRetryHeaders(t *testing.T, h http.Header, floor time.Duration) time.Duration {
	t.Helper()
	return retrytest.Headers(t, h, floor, admission.DefaultMaxRetryAfter)
}

// switchList is a busy list of one model served by worker 1, free or all
// busy as the test sets it.
type switchList struct{ busy atomic.Bool }

func (l *switchList) Decide(m string) admission.Decision {
	return l.DecideClass(m, admission.ClassStandard)
}

func (l *switchList) DecideClass(_ string, c admission.Class) admission.Decision {
	if l.busy.Load() {
		return admission.Decision{Reason: admission.ReasonAllBusy, Class: c, Busy: []uint64{1}}
	}
	return admission.Decision{Admit: true, Reason: admission.ReasonFree, Class: c, Free: []uint64{1}}
}
func (l *switchList) Models() []string { return []string{model} }
func (l *switchList) Ready() bool      { return true }

// oneWorker is a registry of worker 1 of model.
type oneWorker struct{}

func (oneWorker) Endpoints(m string) []events.WorkerEntry {
	if m != model {
		return nil
	}
	return []events.WorkerEntry{{Model: model, WorkerID: 1, Endpoint: "http://worker-1"}}
}
func (oneWorker) Models() []string { return []string{model} }
func (oneWorker) Ready() bool      { return true }
func (oneWorker) Live() bool       { return true }

// instantEngine answers every request at once with a small completion, in
// the process: usable in a synctest bubble.
type instantEngine struct{}

func (instantEngine) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(strings.NewReader(`{"choices":[{"text":"hi","finish_reason":"length"}]}`)), Request: r}, nil
}

// newBubbleRouter returns a Router of model in front of instantEngine,
// free until list.busy is set.
func newBubbleRouter(t *testing.T, config func(*Config)) (*Router, *switchList) {
	t.Helper()
	list := &switchList{}
	cfg := DefaultConfig()
	cfg.BusyList, cfg.Registry, cfg.Transport = list, oneWorker{}, instantEngine{}
	if config != nil {
		config(&cfg)
	}
	rt, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	return rt, list
}

// complete sends one completion of model to rt and returns the answer.
func complete(rt *Router) *http.Response {
	req := httptest.NewRequest(http.MethodPost, PathCompletions, strings.NewReader(`{"model":"`+model+`","prompt":"hi"}`))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	rt.ServeHTTP(rec, req)
	return rec.Result()
}

// serveAt sends n completions to rt at rate per second, each answered 200.
func serveAt(t *testing.T, rt *Router, n int, rate float64) {
	t.Helper()
	for range n {
		if resp := complete(rt); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d while free", resp.StatusCode)
		}
		time.Sleep(time.Duration(float64(time.Second) / rate))
	}
}

// TestRejectionsSpreadABurst: the router's worker serves 20 requests a
// second, then turns all busy and 200 requests are rejected in the same
// instant. Their retry-after-ms spread them over the 10 s the worker needs
// to serve 200 from the 1 s floor on, never more than 20 a second: a
// constant Retry-After sent the 200 back in one wave.
func TestRejectionsSpreadABurst(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rt, list := newBubbleRouter(t, nil)
		serveAt(t, rt, 200, 20)
		list.busy.Store(true)
		var waits []time.Duration
		for range 200 {
			resp := complete(rt)
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("status %d while all busy", resp.StatusCode)
			}
			waits = append(waits, checkRetryHeaders(t, resp.Header, DefaultRetryAfter))
		}
		// A histogram of 500 ms bins from 0 to 12 s: none before the floor,
		// about 10 in each from 1 s to 11 s, none much past it.
		var bins [24]int
		for _, w := range waits {
			bins[min(len(bins)-1, int(w/(500*time.Millisecond)))]++
		}
		var hist strings.Builder
		for i, n := range bins {
			fmt.Fprintf(&hist, " %.1fs:%d", float64(i)/2, n)
			switch {
			case i < 2 && n > 0:
				t.Errorf("%d come back before the 1 s floor", n)
			case i >= 2 && i < 22 && (n < 7 || n > 13):
				t.Errorf("%d come back in [%.1fs, %.1fs); want about 10 (20 a second)", n, float64(i)/2, float64(i+1)/2)
			case i >= 23 && n > 0:
				t.Errorf("%d come back after 11.5 s", n)
			}
		}
		t.Logf("retry-after-ms of 200 rejections in one instant, at 20 served a second:%s", hist.String())
	})
}

// TestQueueRetryAfter: with flow control on, the 429 of a full queue of 40
// tells its client to come back once the 40 queued ahead have had their
// slots (2 s at 20 a second), and the waits that run out are spread over
// the slots of the queue they leave behind.
func TestQueueRetryAfter(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rt, list := newBubbleRouter(t, func(c *Config) { c.QueueMaxWait, c.QueueMaxRequests = 5*time.Second, 40 })
		serveAt(t, rt, 200, 20)
		list.busy.Store(true)
		// The requests running on the busy worker go on ending, 20 a
		// second.
		stop := make(chan struct{})
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
					rt.retry.Done(model)
				}
			}
		}()
		defer func() { close(stop); <-ended }()
		var wg sync.WaitGroup
		answers := make(chan *http.Response, 40)
		for range 40 {
			wg.Go(func() { answers <- complete(rt) })
		}
		synctest.Wait() // all 40 queued
		if got := rt.queueAhead(model); got != 40 {
			t.Fatalf("%d queued; want 40", got)
		}
		resp := complete(rt)
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("status %d with the queue full; want 429", resp.StatusCode)
		}
		if w := checkRetryHeaders(t, resp.Header, DefaultRetryAfter); w < 2*time.Second || w > 2100*time.Millisecond {
			t.Errorf("a full queue of 40 at 20/s: retry-after-ms %v; want about 2 s", w)
		}
		time.Sleep(5 * time.Second) // the waits run out
		wg.Wait()
		close(answers)
		var waits []time.Duration
		for resp := range answers {
			if resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("status %d after the wait; want 429", resp.StatusCode)
			}
			waits = append(waits, checkRetryHeaders(t, resp.Header, DefaultRetryAfter))
		}
		// They leave in one instant: the first is told to come back after
		// the 39 still queued behind it (1.95 s), the others one slot of
		// 50 ms after another, up to about 4 s.
		slices.Sort(waits)
		if waits[0] < 1900*time.Millisecond || waits[len(waits)-1] < 3900*time.Millisecond || waits[len(waits)-1] > 4200*time.Millisecond {
			t.Errorf("40 expired waits: retry-after-ms from %v to %v; want from about 2 s to about 4 s", waits[0], waits[len(waits)-1])
		}
	})
}

// BenchmarkRejectAllBusy measures a rejection of the router's model, all
// busy, from the decision to the answer written (the retry headers from the
// estimate of a worker serving 1000 requests a second): nothing allocated
// but what net/http's recorder does.
func BenchmarkRejectAllBusy(b *testing.B) {
	rt, err := New(Config{BusyList: &switchList{}, Registry: oneWorker{}, RejectStatus: 503, ShedStatus: 429, RetryAfter: time.Second,
		MaxBodyBytes: 1, UpstreamTimeout: time.Second, ConnectTimeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	for range 1000 {
		rt.retry.Done(model)
	}
	d := admission.Decision{Reason: admission.ReasonAllBusy, Busy: []uint64{1}}
	w := &headerWriter{h: http.Header{}}
	b.ReportAllocs()
	for b.Loop() {
		rt.reject.RejectModel(w, model, rt.queueAhead(model), d)
	}
}

// headerWriter is a ResponseWriter that keeps its header map and discards
// the body.
type headerWriter struct{ h http.Header }

func (w *headerWriter) Header() http.Header         { return w.h }
func (w *headerWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerWriter) WriteHeader(int)             {}
