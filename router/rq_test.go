package router

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
)

// TestQueueSharesTurnsAcrossRouters (contract §22): three routers whose
// queues hold 60, 30 and 10 requests (kept so: each dispatched request is
// replaced), each knowing the others' from a fresh record, share a free
// worker's turns near 60/30/10, and together hand it about one queued
// request per pace. Without the shares (§17's pace × routers) each would
// take about a third.
func TestQueueSharesTurnsAcrossRouters(t *testing.T) {
	for _, known := range []bool{true, false} {
		name := map[bool]string{true: "shares", false: "routers only"}[known]
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFakeFleet(1)
				f.set([]uint64{1}, nil)
				f.routers = 3
				sizes := []int{60, 30, 10}
				m, err := newQueueMetrics(nil, 10)
				if err != nil {
					t.Fatal(err)
				}
				mqs := make([]*modelQueue, len(sizes))
				for i := range sizes {
					deps := f.deps()
					deps.others = func(_ string, p int64) busylist.QueuedOthers {
						// A fresh record: the other routers' queues.
						var n uint64
						for j, mq := range mqs {
							if j != i && mq != nil {
								n += uint64(mq.depth.Load())
							}
						}
						if !known {
							return busylist.QueuedOthers{}
						}
						return busylist.QueuedOthers{Known: true, N: n, AtP: n}
					}
					mqs[i] = newQueues(queueLimits{maxWait: time.Hour, maxRequests: 1000, maxBytes: DefaultQueueMaxBytes,
						pace: DefaultQueuePace}, deps, m).forModel("m")
				}
				var mu sync.Mutex
				dispatched := make([]int, len(sizes))
				var wg sync.WaitGroup
				stop := make(chan struct{})
				var refill func(i int)
				refill = func(i int) {
					w, err := mqs[i].join(arrival(0, "", false, true), admission.ClassStandard, time.Now())
					if err != nil {
						t.Errorf("join: %v", err)
						return
					}
					wg.Go(func() {
						select {
						case v := <-w.Value.done:
							if v.kind != verdictDispatch {
								return
							}
							mu.Lock()
							dispatched[i]++
							mu.Unlock()
							refill(i)
						case <-stop:
						}
					})
				}
				for i, n := range sizes {
					for range n {
						refill(i)
					}
				}
				const run = 4 * time.Second
				time.Sleep(run)
				f.set(nil, []uint64{1})
				synctest.Wait()
				close(stop)
				for _, mq := range mqs {
					mq.mu.Lock()
					mq.releaseAllLocked(time.Now())
					mq.mu.Unlock()
				}
				wg.Wait()
				time.Sleep(2 * DefaultQueuePace)

				total := dispatched[0] + dispatched[1] + dispatched[2]
				perPace := float64(total) / float64(run/DefaultQueuePace)
				shares := make([]float64, len(sizes))
				for i := range sizes {
					shares[i] = 100 * float64(dispatched[i]) / float64(max(total, 1))
				}
				t.Logf("dispatched %v: shares %.0f%%, %.0f%%, %.0f%%; %.2f per pace", dispatched, shares[0], shares[1], shares[2], perPace)
				if perPace < 0.85 || perPace > 1.15 {
					t.Errorf("%.2f queued requests per pace from all routers together, want about 1", perPace)
				}
				if !known {
					return // §17: turns alike, whatever each holds
				}
				for i, want := range []float64{60, 30, 10} {
					if math.Abs(shares[i]-want) > 6 {
						t.Errorf("router %d's share %.1f%%, want %v%% ± 6", i, shares[i], want)
					}
				}
			})
		})
	}
}

// testRouterOf is a Router around queues q, for the publisher.
func testRouterOf(q *queues, id string) *Router {
	rt := &Router{cfg: Config{RouterID: id}, queue: q}
	rt.streamLog = rateLog{log: slog.New(slog.DiscardHandler), every: time.Second}
	return rt
}

// published is one queue report a test received.
type published struct {
	at time.Duration
	r  events.RouterQueue
}

// TestRunQueueReports (contract §22): a router publishes a model's queue on
// its rq subject after a change (at most once per pace), every second while
// it holds requests, and once, empty, when it empties; then nothing. One
// boot, one increasing seq, its source.
func TestRunQueueReports(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFleet(1) // busy: nothing is dispatched
		m, err := newQueueMetrics(nil, 10)
		if err != nil {
			t.Fatal(err)
		}
		q := newQueues(queueLimits{maxWait: time.Hour, maxRequests: 1000, maxBytes: DefaultQueueMaxBytes, pace: DefaultQueuePace},
			f.deps(), m)
		rt := testRouterOf(q, "r1")
		start := time.Now()
		var mu sync.Mutex
		var got []published
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- rt.RunQueueReports(ctx, "wm", func(subject string, data []byte) error {
				if subject != "wm.rq.m" {
					t.Errorf("published on %s", subject)
				}
				r, err := events.DecodeRouterQueue(data)
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				got = append(got, published{time.Since(start), r})
				mu.Unlock()
				return nil
			})
		}()
		reports := func() []published {
			synctest.Wait()
			mu.Lock()
			defer mu.Unlock()
			return append([]published(nil), got...)
		}
		mq := q.forModel("m")
		synctest.Wait()
		if n := len(reports()); n != 0 {
			t.Fatalf("%d reports of a queue that never held anything", n)
		}
		var ws []*waiter
		for range 3 {
			w, err := mq.join(arrival(0, "", false, true), admission.ClassStandard, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			ws = append(ws, w)
		}
		time.Sleep(DefaultQueuePace)
		r := reports()
		if len(r) == 0 || len(r) > 2 {
			t.Fatalf("%d reports for three joins at once, want 1 or 2", len(r))
		}
		last := r[len(r)-1].r
		if len(last.Queued) != 1 || last.Queued[0].Priority != 0 || last.Queued[0].N != 3 || last.Source != "router/r1" ||
			last.Model != "m" {
			t.Fatalf("report %+v, want 3 standard requests from router/r1", last)
		}

		// Unchanged: every second.
		n := len(r)
		time.Sleep(3*time.Second + time.Millisecond)
		r = reports()
		if k := len(r) - n; k != 3 {
			t.Fatalf("%d reports in 3 s of an unchanged queue, want 3", k)
		}
		if r[len(r)-1].r.Queued[0].OldestMs < 3000 {
			t.Errorf("oldest_ms %d after 3 s", r[len(r)-1].r.Queued[0].OldestMs)
		}

		// A change every millisecond for 200 ms: at most one report a pace.
		n = len(r)
		for range 200 {
			time.Sleep(time.Millisecond)
			w, err := mq.join(arrival(1, "", false, true), admission.ClassCritical, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			ws = append(ws, w)
		}
		time.Sleep(DefaultQueuePace)
		r = reports()
		burst := r[n:]
		if paces := int(200 * time.Millisecond / DefaultQueuePace); len(burst) < paces-1 || len(burst) > paces+1 {
			t.Fatalf("%d reports for 200 changes in 200 ms, want about one per pace (%v)", len(burst), DefaultQueuePace)
		}
		for i := 1; i < len(burst); i++ {
			if gap := burst[i].at - burst[i-1].at; gap < DefaultQueuePace {
				t.Fatalf("reports %v apart, want at least a pace", gap)
			}
		}
		if l := burst[len(burst)-1].r.Queued; len(l) != 2 || l[0] != (events.QueuedLevel{Priority: 1, N: 200, OldestMs: l[0].OldestMs}) || l[1].N != 3 {
			t.Fatalf("last report %+v, want 200 critical and 3 standard requests", l)
		}

		// Emptied: one report with nothing, then none.
		mq.mu.Lock()
		mq.releaseAllLocked(time.Now())
		mq.mu.Unlock()
		time.Sleep(DefaultQueuePace)
		n = len(reports())
		if e := reports()[n-1].r; len(e.Queued) != 0 {
			t.Fatalf("report %+v after the queue emptied, want it empty", e)
		}
		time.Sleep(5 * time.Second)
		if k := len(reports()) - n; k != 0 {
			t.Fatalf("%d reports of an empty queue", k)
		}
		r = reports()
		for i, p := range r {
			if p.r.BootID != r[0].r.BootID || i > 0 && p.r.Seq <= r[i-1].r.Seq {
				t.Fatalf("report %d: boot %d seq %d after boot %d seq %d", i, p.r.BootID, p.r.Seq, r[0].r.BootID, r[max(i-1, 0)].r.Seq)
			}
		}

		// A change then the end: published at once, not a pace later.
		if _, err := mq.join(arrival(0, "", false, true), admission.ClassStandard, time.Now()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(DefaultQueuePace)
		n = len(reports())
		mq.mu.Lock()
		mq.releaseAllLocked(time.Now())
		mq.mu.Unlock()
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("RunQueueReports: %v", err)
		}
		r = reports()
		if len(r) != n+1 || len(r[n].r.Queued) != 0 {
			t.Fatalf("%d reports at the end, want 1, empty", len(r)-n)
		}
		time.Sleep(2 * DefaultQueuePace) // the dispatcher ends
		_ = ws
	})
}

// TestRunQueueReportsNATSAway: while every publish fails (NATS away for
// minutes, the reconnect buffer full), the loop neither spins nor wedges:
// a queue that holds requests is tried about once a second, and once
// publishing works again the next report goes out within a second; the
// end's last report is tried once and the loop returns at once.
func TestRunQueueReportsNATSAway(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, err := newQueueMetrics(nil, 10)
		if err != nil {
			t.Fatal(err)
		}
		q := newQueues(queueLimits{maxWait: time.Hour, maxRequests: 1000, maxBytes: DefaultQueueMaxBytes, pace: DefaultQueuePace},
			newFakeFleet(1).deps(), m)
		rt := testRouterOf(q, "r1")
		var mu sync.Mutex
		var tries, sent int
		away := true
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- rt.RunQueueReports(ctx, "wm", func(string, []byte) error {
				mu.Lock()
				defer mu.Unlock()
				tries++
				if away {
					return errors.New("nats: outbound buffer limit exceeded")
				}
				sent++
				return nil
			})
		}()
		counts := func() (int, int) {
			synctest.Wait()
			mu.Lock()
			defer mu.Unlock()
			return tries, sent
		}
		mq := q.forModel("m")
		if _, err := mq.join(arrival(0, "", false, true), admission.ClassStandard, time.Now()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Minute)
		if n, _ := counts(); n < 290 || n > 310 {
			t.Fatalf("%d tries in 5 minutes of failing publishes, want about one a second", n)
		}
		mu.Lock()
		away = false
		mu.Unlock()
		time.Sleep(QueueReportEvery + time.Millisecond)
		if _, k := counts(); k != 1 {
			t.Fatalf("%d reports within a second of NATS back, want 1", k)
		}
		mu.Lock()
		away = true
		mu.Unlock()
		mq.mu.Lock()
		mq.releaseAllLocked(time.Now())
		mq.mu.Unlock()
		before, _ := counts()
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("RunQueueReports: %v", err)
		}
		if n, _ := counts(); n > before+1 {
			t.Fatalf("%d tries at the end, want at most 1", n-before)
		}
		time.Sleep(2 * DefaultQueuePace) // the dispatcher ends
	})
}

func TestRunQueueReportsNeedsID(t *testing.T) {
	t.Parallel()
	m, err := newQueueMetrics(nil, 10)
	if err != nil {
		t.Fatal(err)
	}
	q := newQueues(queueLimits{maxWait: time.Hour, maxRequests: 10, maxBytes: DefaultQueueMaxBytes, pace: DefaultQueuePace},
		newFakeFleet(1).deps(), m)
	if err := testRouterOf(q, "").RunQueueReports(t.Context(), "wm", nil); !errors.Is(err, ErrNoRouterID) {
		t.Fatalf("without a router id: %v", err)
	}
	if err := testRouterOf(nil, "").RunQueueReports(t.Context(), "wm", nil); err != nil {
		t.Fatalf("with flow control off: %v", err)
	}
}

// TestQueueBehindOtherRouters (contract §22): with a free worker and a
// record whose queued_by shows another router's standard requests, a
// standard newcomer joins this router's queue (one that may not wait gets
// the queue's 429 at once) while a critical one goes straight to the
// worker; this router's own entry, and a record older than 3 s, hold
// nobody back. GET /queues shows the other router's requests.
func TestQueueBehindOtherRouters(t *testing.T) {
	t.Parallel()
	env, e := queueEnv(t, time.Minute, 0, busylist.WithStaleListAfter(time.Minute))
	env.rt.cfg.RouterID = "me" // as New would have had it
	own := "router/me"
	qv := env.rt.cfg.BusyList.(queuedView)
	env.rt.queue.deps.others = func(model string, p int64) busylist.QueuedOthers { return qv.QueuedByOthers(model, own, p) }
	record := func(by map[string]map[int64]uint64, updated time.Time) {
		queued := map[int64]uint64{}
		for _, q := range by {
			for p, n := range q {
				queued[p] += n
			}
		}
		env.putSet(t, events.BusySet{Model: model, Free: []uint64{1}, QueuedBy: by, Queued: queued, UpdatedAt: updated.UnixNano()})
	}

	// This router's own entry, as the record states it: no wait.
	record(map[string]map[int64]uint64{own: {0: 3}}, time.Now())
	if resp := env.post(t, PathCompletions, queueBody); resp.StatusCode != http.StatusOK || resp.Header.Get(QueuedHeader) != "" {
		t.Fatalf("behind its own past: %d, queued %q", resp.StatusCode, resp.Header.Get(QueuedHeader))
	}
	// Another router's, in a record older than 3 s: no wait.
	record(map[string]map[int64]uint64{"router/other": {0: 3}}, time.Now().Add(-busylist.QueuedFreshFor))
	if resp := env.post(t, PathCompletions, queueBody); resp.StatusCode != http.StatusOK || resp.Header.Get(QueuedHeader) != "" {
		t.Fatalf("behind an old record's queue: %d, queued %q", resp.StatusCode, resp.Header.Get(QueuedHeader))
	}

	record(map[string]map[int64]uint64{"router/other": {0: 3}}, time.Now())
	hits := e.hits.Load()
	critical, err := env.postWith(t.Context(), t, queueBody, map[string]string{admission.PriorityHeader: "1"})
	if err != nil {
		t.Fatal(err)
	}
	_ = critical.Body.Close()
	if critical.StatusCode != http.StatusOK || critical.Header.Get(QueuedHeader) != "" || e.hits.Load() != hits+1 {
		t.Fatalf("critical newcomer: %d, queued %q", critical.StatusCode, critical.Header.Get(QueuedHeader))
	}
	noWait, err := env.postWith(t.Context(), t, queueBody, map[string]string{MaxWaitHeader: "0"})
	if err != nil {
		t.Fatal(err)
	}
	_ = noWait.Body.Close()
	if noWait.StatusCode != http.StatusTooManyRequests || noWait.Header.Get(QueuedHeader) != "0" {
		t.Fatalf("a standard newcomer that may not wait: %d, queued %q; want the queue's 429", noWait.StatusCode, noWait.Header.Get(QueuedHeader))
	}
	ch := env.send(t, t.Context(), queueBody, nil)
	env.waitQueued(t, 1)

	resp := env.get(t, PathQueues)
	var qa queuesAnswer
	if err := json.NewDecoder(resp.Body).Decode(&qa); err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if len(qa.Models) != 1 || qa.Models[0].Depth != 1 || qa.Models[0].OthersDepth != 3 || qa.Models[0].Others["router/other"]["0"] != 3 {
		t.Fatalf("GET /queues: %+v", qa.Models)
	}

	// The other router's queue empties: this one's goes out.
	record(nil, time.Now())
	a := <-ch
	if a.err != nil || a.resp.StatusCode != http.StatusOK || a.resp.Header.Get(QueuedHeader) == "" {
		t.Fatalf("queued standard request: %v, %+v", a.err, a.resp)
	}
}

// TestQueueHotPathWatcherNoAlloc: with a real busylist.Watcher, a request
// that does not wait, no queue holding anything, allocates nothing.
func TestQueueHotPathWatcherNoAlloc(t *testing.T) { // not parallel: AllocsPerRun
	hot := watcherHotPath(t)
	if !hot() {
		t.Fatal("the request would wait")
	}
	if n := testing.AllocsPerRun(1000, func() { _ = hot() }); n != 0 {
		t.Errorf("%v allocs/op, want 0", n)
	}
}

// watcherHotPath is what a request that does not wait goes through with
// flow control on, on a real Watcher: its class decided, then its own
// queue and the record's other routers' queues looked at, all empty.
func watcherHotPath(tb testing.TB) func() bool {
	env := newTestEnv(tb, envOptions{config: func(c *Config) { c.QueueMaxWait, c.RouterID = time.Second, "me" }})
	env.putRecord(tb, model, []uint64{1, 3}, []uint64{2}, time.Now())
	env.rt.queue.forModel(model)
	req := httptest.NewRequest(http.MethodPost, PathCompletions, nil)
	qh := queueHeaders{maxWait: -1}
	return func() bool {
		d := env.watcher.DecideClass(model, admission.ClassStandard)
		return d.Admit && !env.rt.queue.waits(req, model, d, qh)
	}
}

// BenchmarkQueueHotPathWatcher measures watcherHotPath: the decision of
// §7/§15 and the looks at the queues (contract §17, §22), no queue holding
// anything.
func BenchmarkQueueHotPathWatcher(b *testing.B) {
	hot := watcherHotPath(b)
	b.ReportAllocs()
	for b.Loop() {
		if !hot() {
			b.Fatal("would wait")
		}
	}
}
