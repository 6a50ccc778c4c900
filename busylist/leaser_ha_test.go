package busylist

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
)

// leaseOf reads partition p's lease among parts (ok false when absent).
func leaseOf(t *testing.T, kv jetstream.KeyValue, parts, p int) (LeaseValue, uint64, bool) {
	t.Helper()
	e, err := kv.Get(t.Context(), LeaseKey(parts, p))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return LeaseValue{}, 0, false
	}
	if err != nil {
		return LeaseValue{}, 0, false // a bucket being recreated
	}
	var v LeaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		t.Fatal(err)
	}
	return v, e.Revision(), true
}

// TestLeaserGoneKeyRetaken: a held lease whose key disappears (a purge, a
// delete, a recreated bucket; the bucket's max age passing during an
// outage is TestLeasesBackAfterLongOutage in cmd/workermon) is given up at
// once (OnLose) and created again under a higher epoch, without a restart.
func TestLeaserGoneKeyRetaken(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	tests := []struct {
		name string
		gone func(t *testing.T, js jetstream.JetStream, kv jetstream.KeyValue)
	}{
		{"purged", func(t *testing.T, _ jetstream.JetStream, kv jetstream.KeyValue) {
			if err := kv.Purge(t.Context(), LeaseKey(1, 0)); err != nil {
				t.Fatal(err)
			}
		}},
		{"deleted", func(t *testing.T, _ jetstream.JetStream, kv jetstream.KeyValue) {
			if err := kv.Delete(t.Context(), LeaseKey(1, 0)); err != nil {
				t.Fatal(err)
			}
		}},
		{"bucket recreated", func(t *testing.T, js jetstream.JetStream, _ jetstream.KeyValue) {
			if err := js.DeleteKeyValue(t.Context(), events.LeasesBucket); err != nil {
				t.Fatal(err)
			}
			if _, err := kvbucket.Open(t.Context(), js, events.LeasesBucket, 1); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			js, kv := leaseTestBucket(t)
			var mu sync.Mutex
			var lost []int
			l, _, _, _ := runLeaser(t, js, "mon-gone", 1, ttl, func(c *LeaserConfig) {
				c.OnLose = func(p int) { mu.Lock(); lost = append(lost, p); mu.Unlock() }
			})
			natstest.WaitFor(t, 10*time.Second, "the partition taken", func() bool { return l.Holds(0) })
			before, _, _ := leaseOf(t, kv, 1, 0)
			tt.gone(t, js, kv)
			natstest.WaitFor(t, 10*time.Second, "the lease created again under a higher epoch", func() bool {
				v, _, ok := leaseOf(t, kv, 1, 0)
				return ok && v.Instance == l.Instance() && v.Epoch > before.Epoch && l.Valid(0)
			})
			mu.Lock()
			defer mu.Unlock()
			if !slices.Equal(lost, []int{0}) {
				t.Errorf("OnLose calls %v, want [0]: the partition given up before it was taken again", lost)
			}
		})
	}
}

// TestLeaserRenewsDuringSlowRelease: a release whose final write takes
// longer than several TTLs holds up no renewal: the lease being released
// and the one kept are both renewed meanwhile and stay writable.
func TestLeaserRenewsDuringSlowRelease(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	js, kv := leaseTestBucket(t)
	inRelease, unblock := make(chan int, 2), make(chan struct{})
	l, _, _, _ := runLeaser(t, js, "mon-slow-release", 2, ttl, func(c *LeaserConfig) {
		c.OnRelease = func(_ context.Context, p int) {
			inRelease <- p
			<-unblock
		}
	})
	t.Cleanup(func() { close(unblock) }) // before the Leaser stops (cleanups run last first)
	natstest.WaitFor(t, 10*time.Second, "both partitions taken", func() bool {
		return slices.Equal(l.Held(), []int{0, 1})
	})
	// Another monitor comes: the share is one partition, and the leaser
	// releases partition 1 (after 2 TTLs over its share).
	other, _ := json.Marshal(Announce{MonitorID: "mon-other", Instance: "other"})
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(ttl / 4)
		defer tick.Stop()
		for {
			pctx, pcancel := context.WithTimeout(ctx, time.Second)
			_, _ = kv.Put(pctx, AnnounceKey("mon-other"), other)
			pcancel()
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
	var p int
	select {
	case p = <-inRelease:
	case <-time.After(10 * time.Second):
		t.Fatal("no partition released within 10s")
	}
	if p != 1 {
		t.Fatalf("released partition %d, want 1", p)
	}
	// Three renewals of each lease (a whole TTL) while the release's final
	// write is blocked.
	seen := [2]map[uint64]bool{{}, {}}
	natstest.WaitFor(t, 10*time.Second, "both leases renewed three times during the release", func() bool {
		for q := range 2 {
			if _, rev, ok := leaseOf(t, kv, 2, q); ok {
				seen[q][rev] = true
			}
		}
		return len(seen[0]) > 3 && len(seen[1]) > 3
	})
	if !l.Valid(0) || !l.Valid(1) {
		t.Errorf("a slow release fenced the leases: valid %v %v", l.Valid(0), l.Valid(1))
	}
}

// TestLeaserCountsEveryFence: workermon_lease_self_fenced_total counts a
// holder's validity lapsing whether it ends with a renewal that succeeds
// late or with the loss of the lease.
func TestLeaserCountsEveryFence(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	t.Run("late renewal", func(t *testing.T) {
		t.Parallel()
		js, _ := leaseTestBucket(t)
		clock := &leaseClock{}
		clock.ns.Store(time.Unix(1_800_000_000, 0).UnixNano())
		reg := prometheus.NewRegistry()
		l := testLeaser(t, js, "mon-late", clock, ttl, func(c *LeaserConfig) { c.Registerer = reg })
		round(t, l)
		if !l.Valid(0) {
			t.Fatal("partition not taken")
		}
		clock.add(ttl + time.Millisecond) // the renewals did not run for a TTL
		if l.Valid(0) {
			t.Fatal("still valid a TTL after the last renewal")
		}
		round(t, l) // the late renewal succeeds: nobody took the lease
		if !l.Valid(0) {
			t.Fatal("not valid again after a late renewal that succeeded")
		}
		if v := metric(t, reg, "workermon_lease_self_fenced_total"); v != 1 {
			t.Errorf("self_fenced_total %v, want 1", v)
		}
	})
	t.Run("loss", func(t *testing.T) {
		t.Parallel()
		js, kv := leaseTestBucket(t)
		clock := &leaseClock{}
		clock.ns.Store(time.Unix(1_800_000_000, 0).UnixNano())
		reg := prometheus.NewRegistry()
		a := testLeaser(t, js, "mon-a", clock, ttl, func(c *LeaserConfig) { c.Registerer = reg })
		b := testLeaser(t, js, "mon-b", clock, ttl)
		round(t, a)
		_, rev, ok := leaseOf(t, kv, 1, 0)
		if !ok || !a.Valid(0) {
			t.Fatal("partition not taken")
		}
		waitSeen(t, b, rev)
		clock.add(ttl) // a is paused: its lease expires for b
		round(t, b)
		if !b.Valid(0) {
			t.Fatal("the expired lease was not taken over")
		}
		round(t, a) // its renewal finds the lease taken: lost
		if a.Holds(0) {
			t.Fatal("the deposed holder still holds the partition")
		}
		if v := metric(t, reg, "workermon_lease_self_fenced_total"); v != 1 {
			t.Errorf("self_fenced_total %v, want 1", v)
		}
	})
}

// TestLeaserForeignLeaseStops: a monitor that sees a lease of another
// partition count while it holds partitions stops writing them and gives
// them back (OnLose, leases deleted), logs it and counts it.
func TestLeaserForeignLeaseStops(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	js, kv := leaseTestBucket(t)
	var mu sync.Mutex
	var lost []int
	l, reg, _, _ := runLeaser(t, js, "mon-two", 2, ttl, func(c *LeaserConfig) {
		c.OnLose = func(p int) { mu.Lock(); lost = append(lost, p); mu.Unlock() }
	})
	natstest.WaitFor(t, 10*time.Second, "both partitions taken", func() bool {
		return slices.Equal(l.Held(), []int{0, 1})
	})
	three, _ := json.Marshal(LeaseValue{MonitorID: "mon-three", Instance: "three", Epoch: 1})
	natstest.Put(t, kv, LeaseKey(3, 1), three)
	natstest.WaitFor(t, 10*time.Second, "the partitions given back", func() bool {
		got := leaseInstances(t, kv, 2)
		return len(l.Held()) == 0 && got[0] == "" && got[1] == ""
	})
	if l.Valid(0) || l.Valid(1) {
		t.Error("still writing beside a lease of another partition count")
	}
	if v := metric(t, reg, "workermon_lease_foreign_stops_total"); v != 1 {
		t.Errorf("foreign_stops_total %v, want 1", v)
	}
	natstest.WaitFor(t, 5*time.Second, "OnLose of both", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Equal(slices.Sorted(slices.Values(lost)), []int{0, 1})
	})
}

// TestLeaserHeldBack: a monitor whose writer is held back (HoldUntil not
// closed) announces nothing and takes no lease, so another monitor takes
// every partition; once released it takes its share.
func TestLeaserHeldBack(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	js, kv := leaseTestBucket(t)
	hold := make(chan struct{})
	held, _, _, _ := runLeaser(t, js, "mon-held", 2, ttl, func(c *LeaserConfig) { c.HoldUntil = hold })
	free, _, _, _ := runLeaser(t, js, "mon-free", 2, ttl, nil)
	natstest.WaitFor(t, 10*time.Second, "the other monitor holding both partitions", func() bool {
		return slices.Equal(free.Held(), []int{0, 1})
	})
	if got := held.Held(); len(got) != 0 {
		t.Errorf("the held-back monitor holds %v", got)
	}
	if _, err := kv.Get(t.Context(), AnnounceKey("mon-held")); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("the held-back monitor announced itself (%v)", err)
	}
	close(hold)
	natstest.WaitFor(t, 10*time.Second, "each monitor holding one partition", func() bool {
		return len(held.Held()) == 1 && len(free.Held()) == 1
	})
}

// waitAnnounce waits until l's book has seen monitor id's announce at rev
// or later.
func waitAnnounce(t *testing.T, l *Leaser, id string, rev uint64) {
	t.Helper()
	natstest.WaitFor(t, 5*time.Second, "the announce seen", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		s := l.book.monitors[id]
		return s != nil && s.rev >= rev
	})
}

// TestLeaserTwinStandsDown: a monitor paused past its TTL is replaced by a
// process with the same id (which saw no live announce of it at its start
// and took its partitions). When the paused one resumes beside it, it
// stands down: Run's step returns ErrDuplicateMonitor once the replacement
// has gone on announcing for 2 TTLs, holding nothing; the replacement keeps
// running and holding.
func TestLeaserTwinStandsDown(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	js, kv := leaseTestBucket(t)
	clock := &leaseClock{}
	clock.ns.Store(time.Now().UnixNano())
	old := testLeaser(t, js, "mon-twin", clock, ttl, func(c *LeaserConfig) { c.Partitions = 2 })
	round(t, old)
	if !slices.Equal(old.Held(), []int{0, 1}) {
		t.Fatalf("the first process holds %v", old.Held())
	}
	// The first process pauses; the replacement starts a TTL later and
	// takes its expired leases.
	clock.add(ttl)
	repl := testLeaser(t, js, "mon-twin", clock, ttl, func(c *LeaserConfig) { c.Partitions = 2 })
	for _, p := range []int{0, 1} {
		_, rev, _ := leaseOf(t, kv, 2, p)
		natstest.WaitFor(t, 5*time.Second, "the leases seen", func() bool {
			repl.mu.Lock()
			defer repl.mu.Unlock()
			s := repl.book.leases[p]
			return s != nil && s.rev == rev
		})
	}
	clock.add(ttl)
	round(t, repl)
	if !slices.Equal(repl.Held(), []int{0, 1}) {
		t.Fatalf("the replacement holds %v", repl.Held())
	}
	// Both run now, each announcing every TTL/3.
	announced := func() uint64 {
		e, err := kv.Get(t.Context(), AnnounceKey("mon-twin"))
		if err != nil {
			t.Fatal(err)
		}
		return e.Revision()
	}
	var err error
	for i := 0; i < 20 && err == nil; i++ {
		clock.add(ttl / 3)
		old.renew(t.Context(), old.now())
		err = old.step(t.Context())
		if err != nil {
			break
		}
		waitAnnounce(t, repl, "mon-twin", announced())
		repl.renew(t.Context(), repl.now())
		if rerr := repl.step(t.Context()); rerr != nil {
			t.Fatalf("the replacement stopped: %v", rerr)
		}
		waitAnnounce(t, old, "mon-twin", announced())
	}
	if !errors.Is(err, ErrDuplicateMonitor) {
		t.Fatalf("the resumed process did not stand down: %v", err)
	}
	if len(old.Held()) != 0 {
		t.Errorf("the resumed process holds %v", old.Held())
	}
	if !slices.Equal(repl.Held(), []int{0, 1}) || !repl.Valid(0) || !repl.Valid(1) {
		t.Errorf("the replacement holds %v, valid %v %v", repl.Held(), repl.Valid(0), repl.Valid(1))
	}
}

// TestWriterWarmsUpFromListening: with WarmOnListen a partition taken and
// claimed is not written until Listening says its intake is in place, even
// with no warm-up at all; from then on it is.
func TestWriterWarmsUpFromListening(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	cfg := DefaultWriterConfig()
	cfg.JetStream, cfg.MonitorID, cfg.Partitions = env.js, "mon-listen", 1
	cfg.Leased, cfg.WarmOnListen, cfg.Warmup = true, true, 0
	w, err := NewWriter(cfg)
	if err != nil {
		t.Fatal(err)
	}
	natstest.Go(t, 10*time.Second, w.Run)
	if err := w.Acquire(t.Context(), 0, 3); err != nil {
		t.Fatal(err)
	}
	const model = "org/listen"
	w.Set(events.BusySet{Model: model, Busy: []uint64{}, Free: []uint64{1}, Stale: []uint64{}})
	// A round of Run's loop (which starts what may be written) after the
	// Set.
	if err := w.do(t.Context(), func(*writerRun) {}); err != nil {
		t.Fatal(err)
	}
	w.mu.Lock()
	rec := w.recs[model]
	started := rec == nil || rec.writing || rec.rev != 0
	w.mu.Unlock()
	if started {
		t.Fatal("a partition nobody listens to yet was written")
	}
	if err := w.Listening(t.Context(), 0); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 10*time.Second, "the record written once the partition is heard", func() bool {
		e, err := kv.Get(t.Context(), events.ModelKey(model))
		if err != nil {
			return false
		}
		set, err := events.DecodeBusySet(e.Value())
		return err == nil && set.Epoch == 3
	})
}
