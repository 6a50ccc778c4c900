package router

import (
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/flow"
)

// fakeFleet is a model's record as the queue's dispatcher sees it.
type fakeFleet struct {
	mu         sync.Mutex
	free, busy []uint64
	stale      bool
	gone       bool
	routers    uint64
	registered []events.WorkerEntry
}

func (f *fakeFleet) set(free, busy []uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.free, f.busy = free, busy
}

func (f *fakeFleet) deps() queueDeps {
	return queueDeps{
		decide: func(_ string, c admission.Class) admission.Decision {
			f.mu.Lock()
			defer f.mu.Unlock()
			switch {
			case f.gone:
				return admission.Decision{Admit: true, Reason: admission.ReasonUnknownModel, Class: c}
			case f.stale:
				return admission.Decision{Admit: true, Reason: admission.ReasonStale, Class: c}
			case len(f.free) == 0:
				return admission.Decision{Reason: admission.ReasonAllBusy, Class: c, Busy: f.busy}
			}
			return admission.Decision{Admit: true, Reason: admission.ReasonFree, Class: c, Free: f.free, Busy: f.busy}
		},
		registered: func(string) []events.WorkerEntry {
			f.mu.Lock()
			defer f.mu.Unlock()
			return f.registered
		},
		routers: func(string) uint64 {
			f.mu.Lock()
			defer f.mu.Unlock()
			return f.routers
		},
		pick: func(c []events.WorkerEntry) (events.WorkerEntry, bool) {
			if len(c) == 0 {
				return events.WorkerEntry{}, false
			}
			return c[0], true
		},
	}
}

func newFakeFleet(workers ...uint64) *fakeFleet {
	f := &fakeFleet{busy: workers}
	for _, id := range workers {
		f.registered = append(f.registered, events.WorkerEntry{Model: "m", WorkerID: id, Endpoint: "http://w"})
	}
	return f
}

func newTestQueue(t *testing.T, f *fakeFleet, maxRequests int) *modelQueue {
	t.Helper()
	m, err := newQueueMetrics(nil, 10)
	if err != nil {
		t.Fatal(err)
	}
	mq := newQueues(queueLimits{maxWait: time.Hour, maxRequests: maxRequests, maxBytes: DefaultQueueMaxBytes, pace: DefaultQueuePace},
		f.deps(), m).forModel("m")
	// Whatever the test left queued goes, so that the bubble ends.
	t.Cleanup(func() {
		mq.mu.Lock()
		mq.releaseAllLocked(time.Now())
		mq.mu.Unlock()
		time.Sleep(2 * DefaultQueuePace) // the dispatcher sees the queue empty and ends
	})
	return mq
}

// sent is one dispatch seen by a test.
type sent struct {
	name   string
	worker uint64
	at     time.Duration // since the test's start
	kind   verdictKind
}

// collector records the verdicts of waiters.
type collector struct {
	mu    sync.Mutex
	start time.Time
	got   []sent
}

func (c *collector) watch(name string, w *waiter) {
	go func() {
		v := <-w.Value.done
		c.mu.Lock()
		defer c.mu.Unlock()
		c.got = append(c.got, sent{name: name, worker: v.worker.WorkerID, at: time.Since(c.start), kind: v.kind})
	}()
}

func (c *collector) sent() []sent {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.got)
}

func (c *collector) names() []string {
	var out []string
	for _, s := range c.sent() {
		out = append(out, s.name)
	}
	return out
}

// arrival is a newcomer of priority p and tenant, with a body of 100 bytes.
func arrival(p int64, tenant string, admitted, mayWait bool) flow.Arrival {
	return flow.Arrival{Priority: p, Tenant: tenant, Bytes: 100, Admitted: admitted, MayWait: mayWait}
}

func join(t *testing.T, mq *modelQueue, c *collector, name string, p int64, tenant string) {
	t.Helper()
	w, err := mq.join(arrival(p, tenant, false, true), admission.ClassOf(p), time.Now())
	if err != nil {
		t.Fatalf("join %s: %v", name, err)
	}
	c.watch(name, w)
}

// TestQueueOrder: higher priority first; within a priority the tenants
// take turns one request at a time; first come first served within a
// tenant (contract §17).
func TestQueueOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFleet(1)
		mq := newTestQueue(t, f, 100)
		c := &collector{start: time.Now()}
		join(t, mq, c, "a1", 0, "a")
		join(t, mq, c, "a2", 0, "a")
		join(t, mq, c, "a3", 0, "a")
		join(t, mq, c, "b1", 0, "b")
		join(t, mq, c, "low", -1, "a")
		join(t, mq, c, "high", 5, "b")
		join(t, mq, c, "b2", 0, "b")
		join(t, mq, c, "c1", 0, "c")
		f.set([]uint64{1}, nil)
		time.Sleep(20 * DefaultQueuePace)
		synctest.Wait()
		want := []string{"high", "a1", "b1", "c1", "a2", "b2", "a3", "low"}
		if got := c.names(); !slices.Equal(got, want) {
			t.Fatalf("dispatch order %v, want %v", got, want)
		}
		if mq.depth.Load() != 0 {
			t.Fatalf("depth %d after all were sent", mq.depth.Load())
		}
	})
}

// TestQueueOvertake: a newcomer that would be admitted goes ahead only of
// a queue whose head has a lower priority; otherwise it joins the queue, or
// is refused when it may not wait.
func TestQueueOvertake(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFleet(1)
		mq := newTestQueue(t, f, 100)
		if _, err := mq.join(arrival(0, "", true, true), admission.ClassStandard, time.Now()); err != flow.ErrAhead {
			t.Fatalf("admitted newcomer, empty queue: %v, want errOvertake", err)
		}
		c := &collector{start: time.Now()}
		join(t, mq, c, "first", 0, "")
		for _, p := range []int64{0, -3} {
			w, err := mq.join(arrival(p, "", true, true), admission.ClassOf(p), time.Now())
			if err != nil {
				t.Fatalf("admitted newcomer of priority %d behind priority 0: %v, want queued", p, err)
			}
			c.watch("later", w)
		}
		if _, err := mq.join(arrival(1, "", true, true), admission.ClassCritical, time.Now()); err != flow.ErrAhead {
			t.Fatalf("admitted newcomer of higher priority: %v, want errOvertake", err)
		}
		// One that may not wait (X-Workermon-Max-Wait: 0) is refused, not
		// sent ahead, unless its priority is higher.
		if _, err := mq.join(arrival(0, "", true, false), admission.ClassStandard, time.Now()); err != flow.ErrNoWait {
			t.Fatalf("admitted newcomer that may not wait, behind priority 0: %v, want errNoWait", err)
		}
		if _, err := mq.join(arrival(1, "", true, false), admission.ClassCritical, time.Now()); err != flow.ErrAhead {
			t.Fatalf("admitted newcomer of higher priority that may not wait: %v, want errOvertake", err)
		}
		f.set([]uint64{1}, nil)
		time.Sleep(10 * DefaultQueuePace)
		synctest.Wait()
		if got := c.names(); len(got) != 3 || got[0] != "first" {
			t.Fatalf("sent %v, want first, then the two later ones", got)
		}
	})
}

// TestQueuePacing: with one router a freed worker gets its first queued
// request within one pace of its class getting a candidate, and then one per
// pace; with 3 routers in the record, the first within one interval of 3
// paces (at a random phase, see TestQueueRoutersShareAFreedWorker), then one
// per 3 paces; a record listing the worker busy again stops it at once.
func TestQueuePacing(t *testing.T) {
	for _, routers := range []uint64{0, 1, 3} {
		t.Run("routers="+string(rune('0'+routers)), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFakeFleet(1, 2)
				f.routers = routers
				mq := newTestQueue(t, f, 100)
				c := &collector{start: time.Now()}
				for range 50 {
					join(t, mq, c, "r", 0, "")
				}
				// Worker 1 frees at 105 ms: off the dispatcher's ticks.
				time.Sleep(105 * time.Millisecond)
				f.set([]uint64{1}, []uint64{2})
				freed := time.Since(c.start)
				time.Sleep(400 * time.Millisecond)
				synctest.Wait()
				got := c.sent()
				if len(got) == 0 {
					t.Fatal("nothing sent")
				}
				every := DefaultQueuePace * time.Duration(max(1, routers))
				if wait := got[0].at - freed; wait < 0 || wait > every {
					t.Fatalf("first dispatch %v after the worker freed, want within one pace, %v a router (%v)", wait, every, DefaultQueuePace)
				}
				for i := 1; i < len(got); i++ {
					if got[i].worker != 1 {
						t.Fatalf("dispatch %d to worker %d, want 1 (2 is busy)", i, got[i].worker)
					}
					if gap := got[i].at - got[i-1].at; gap < every {
						t.Fatalf("dispatches %d and %d %v apart, want at least %v", i-1, i, gap, every)
					}
				}
				if want := int(400*time.Millisecond/every) + 1; len(got) < want-1 || len(got) > want {
					t.Fatalf("%d dispatches in 400 ms, want about %d (one per %v)", len(got), want, every)
				}
				// Busy again: nothing more.
				f.set(nil, []uint64{1, 2})
				n := len(c.sent())
				time.Sleep(200 * time.Millisecond)
				synctest.Wait()
				if m := len(c.sent()); m != n {
					t.Fatalf("%d dispatches after the record listed the worker busy, want 0", m-n)
				}
				// Two free workers: two per interval (with several routers,
				// each worker's first comes at a phase of its own within
				// the interval, on one of the dispatcher's ticks).
				f.set([]uint64{1, 2}, nil)
				time.Sleep(every + DefaultQueuePace)
				synctest.Wait()
				per := map[uint64]int{}
				for _, d := range c.sent()[n:] {
					per[d.worker]++
				}
				if per[1] < 1 || per[1] > 2 || per[2] < 1 || per[2] > 2 {
					t.Fatalf("dispatches per worker %v within an interval and a pace of both freeing, want 1 or 2 each", per)
				}
			})
		})
	}
}

// TestQueueRoutersShareAFreedWorker: three routers (each its own queue, the
// record counting 3), whose dispatchers tick together, with requests queued
// when a worker frees: together they hand it about one queued request in
// its first pace, as in each later one (contract §17), not one each on their
// next tick before the record can show the first.
func TestQueueRoutersShareAFreedWorker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFleet(1)
		f.routers = 3
		c := &collector{start: time.Now()}
		var mqs []*modelQueue
		for range 3 {
			mq := newTestQueue(t, f, 1000)
			for range 200 {
				join(t, mq, c, "r", 0, "")
			}
			mqs = append(mqs, mq)
		}
		const trials = 150
		firstPace := 0
		for range trials {
			// Busy long enough for every router to forget the worker,
			// then free off the dispatchers' ticks for one pace.
			time.Sleep(7 * DefaultQueuePace)
			n := len(c.sent())
			time.Sleep(DefaultQueuePace / 4)
			f.set([]uint64{1}, nil)
			time.Sleep(DefaultQueuePace)
			f.set(nil, []uint64{1})
			synctest.Wait()
			firstPace += len(c.sent()) - n
		}
		// One each on the next tick would be 3 a trial; one in three
		// routers taking its turn in the first pace is 1 on average
		// (binomial: 150 ± 12 over 150 trials).
		if mean := float64(firstPace) / trials; mean < 0.7 || mean > 1.35 {
			t.Fatalf("%.2f queued requests handed a freed worker in its first pace by 3 routers, want about 1", mean)
		}
	})
}

// TestQueueReleasesOnStaleOrGoneRecord: a record that turns stale, or goes
// away, releases every queued request at once (fail open).
func TestQueueReleasesOnStaleOrGoneRecord(t *testing.T) {
	for _, how := range []string{"stale", "gone"} {
		t.Run(how, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFakeFleet(1)
				mq := newTestQueue(t, f, 100)
				c := &collector{start: time.Now()}
				for range 30 {
					join(t, mq, c, "r", 0, "")
				}
				time.Sleep(5 * DefaultQueuePace)
				synctest.Wait()
				if n := len(c.sent()); n != 0 {
					t.Fatalf("%d sent while all busy", n)
				}
				f.mu.Lock()
				f.stale, f.gone = how == "stale", how == "gone"
				f.mu.Unlock()
				time.Sleep(DefaultQueuePace)
				synctest.Wait()
				got := c.sent()
				if len(got) != 30 {
					t.Fatalf("%d released within one pace, want all 30", len(got))
				}
				for _, s := range got {
					if s.kind != verdictRelease {
						t.Fatalf("verdict %v, want release", s.kind)
					}
				}
			})
		})
	}
}

// TestQueueFullEvicts: a full queue evicts its newest request of the
// lowest priority for a newcomer of higher priority, and refuses a
// newcomer of equal or lower priority.
func TestQueueFullEvicts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFleet(1)
		mq := newTestQueue(t, f, 3)
		c := &collector{start: time.Now()}
		join(t, mq, c, "low-old", -1, "")
		join(t, mq, c, "low-new", -1, "x")
		join(t, mq, c, "std", 0, "")
		if _, err := mq.join(arrival(-1, "", false, true), admission.ClassSheddable, time.Now()); err != flow.ErrFull {
			t.Fatalf("newcomer of the lowest priority: %v, want errQueueFull", err)
		}
		join(t, mq, c, "high", 1, "")
		synctest.Wait()
		got := c.sent()
		if len(got) != 1 || got[0].name != "low-new" || got[0].kind != verdictEvicted {
			t.Fatalf("verdicts %+v, want low-new evicted", got)
		}
		if mq.depth.Load() != 3 {
			t.Fatalf("depth %d, want 3", mq.depth.Load())
		}
		mq.mu.Lock()
		for _, w := range []*waiter{mq.fq.Head()} {
			if w.Priority() != 1 {
				t.Errorf("head priority %d, want 1", w.Priority())
			}
		}
		mq.releaseAllLocked(time.Now())
		mq.mu.Unlock()
		synctest.Wait()
	})
}

// TestQueueRemove: a request taken out (its client gone, or its wait over)
// leaves the queue and the turn order intact.
func TestQueueRemove(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFleet(1)
		mq := newTestQueue(t, f, 100)
		c := &collector{start: time.Now()}
		join(t, mq, c, "a1", 0, "a")
		wb, err := mq.join(arrival(0, "b", false, true), admission.ClassStandard, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		join(t, mq, c, "a2", 0, "a")
		join(t, mq, c, "c1", 0, "c")
		if !mq.remove(wb) || mq.remove(wb) {
			t.Fatal("remove: want true once, then false")
		}
		f.set([]uint64{1}, nil)
		time.Sleep(10 * DefaultQueuePace)
		synctest.Wait()
		if got, want := c.names(), []string{"a1", "c1", "a2"}; !slices.Equal(got, want) {
			t.Fatalf("order %v, want %v", got, want)
		}
	})
}
