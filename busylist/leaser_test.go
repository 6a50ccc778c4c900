package busylist

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
)

// runLeaser runs a Leaser on a real clock in the background; the returned
// channel receives Run's result, and stop cancels Run and waits for it. The
// Leaser is stopped at the end of the test.
func runLeaser(t *testing.T, js jetstream.JetStream, id string, parts int, ttl time.Duration,
	mutate func(*LeaserConfig),
) (l *Leaser, reg *prometheus.Registry, result <-chan error, stop func()) {
	t.Helper()
	reg = prometheus.NewRegistry()
	cfg := DefaultLeaserConfig()
	cfg.JetStream, cfg.MonitorID, cfg.Partitions, cfg.TTL, cfg.Registerer = js, id, parts, ttl, reg
	cfg.OnAcquire = func(context.Context, int, uint64) {}
	cfg.OnRelease = func(context.Context, int) {}
	cfg.OnLose = func(int) {}
	if mutate != nil {
		mutate(&cfg)
	}
	l, err := NewLeaser(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	out, done := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(done)
		out <- l.Run(ctx)
	}()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return l, reg, out, stop
}

// leaseInstances returns the instance in each lease key of parts
// partitions ("" when absent).
func leaseInstances(t *testing.T, kv jetstream.KeyValue, parts int) []string {
	t.Helper()
	out := make([]string, parts)
	for p := range parts {
		e, err := kv.Get(t.Context(), LeaseKey(parts, p))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		var v LeaseValue
		if err := json.Unmarshal(e.Value(), &v); err != nil {
			t.Fatal(err)
		}
		out[p] = v.Instance
	}
	return out
}

func metric(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	v, _ := promtest.Value(t, reg, name, nil)
	return v
}

// TestLeaserDuplicateID: a second process with a running monitor's id is
// refused at its start (contract §10) and takes nothing; the running one
// keeps running, holding its partitions, and counts the other. A dead
// process's announce left in the bucket (a restart after a crash) refuses
// nobody.
func TestLeaserDuplicateID(t *testing.T) {
	t.Parallel()
	// Long enough that the newcomer sees the running one re-announce
	// (every TTL/3) well inside its first TTL on a loaded machine.
	const ttl = time.Second
	js, kv := leaseTestBucket(t)
	dead, _ := json.Marshal(Announce{MonitorID: "mon-x", Instance: "crashed", StartedAt: 1})
	natstest.Put(t, kv, AnnounceKey("mon-x"), dead)

	a, regA, errA, _ := runLeaser(t, js, "mon-x", 2, ttl, nil)
	select {
	case <-a.Settled():
	case err := <-errA:
		t.Fatalf("a monitor restarted after a crash was refused: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the first monitor did not settle within 10s")
	}
	natstest.WaitFor(t, 5*time.Second, "the first monitor holding both partitions", func() bool {
		return slices.Equal(a.Held(), []int{0, 1})
	})

	b, _, errB, _ := runLeaser(t, js, "mon-x", 2, ttl, nil)
	select {
	case err := <-errB:
		if !errors.Is(err, ErrDuplicateMonitor) {
			t.Fatalf("the newcomer's Run returned %v, want ErrDuplicateMonitor", err)
		}
	case err := <-errA:
		t.Fatalf("the running monitor stopped when the newcomer started: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the newcomer with the same id was not refused within 10s")
	}
	if held := b.Held(); len(held) != 0 {
		t.Errorf("the refused newcomer holds %v", held)
	}
	natstest.WaitFor(t, 5*time.Second, "the running monitor counting the newcomer", func() bool {
		return metric(t, regA, "workermon_lease_duplicate_monitors_total") == 1
	})
	// The running monitor goes on: its announce is its own again, and it
	// keeps renewing both leases (their revisions move on).
	natstest.WaitFor(t, 5*time.Second, "the running monitor announcing itself again", func() bool {
		e, err := kv.Get(t.Context(), AnnounceKey("mon-x"))
		var ann Announce
		return err == nil && json.Unmarshal(e.Value(), &ann) == nil && ann.Instance == a.Instance()
	})
	revs := func() []uint64 {
		var out []uint64
		for p := range 2 {
			e, err := kv.Get(t.Context(), LeaseKey(2, p))
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, e.Revision())
		}
		return out
	}
	before := revs()
	natstest.WaitFor(t, 5*time.Second, "both leases renewed", func() bool {
		now := revs()
		return now[0] > before[0] && now[1] > before[1]
	})
	select {
	case err := <-errA:
		t.Fatalf("the running monitor stopped: %v", err)
	default:
	}
	if got := leaseInstances(t, kv, 2); got[0] != a.Instance() || got[1] != a.Instance() {
		t.Errorf("leases held by %v, want both by the running monitor %s", got, a.Instance())
	}
	if !a.Valid(0) || !a.Valid(1) {
		t.Errorf("the running monitor no longer writes: valid %v %v", a.Valid(0), a.Valid(1))
	}
}

// TestLeaserForeignGone: a lease of another partition count keeps a
// monitor from taking anything (and from settling) only while it is in the
// bucket: once it is deleted, the monitor takes its partitions, its gauge
// goes back to 0 and it settles, without a restart.
func TestLeaserForeignGone(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	js, kv := leaseTestBucket(t)
	old, _ := json.Marshal(LeaseValue{MonitorID: "old", Instance: "old", Epoch: 4})
	natstest.Put(t, kv, LeaseKey(3, 1), old)
	clock := &leaseClock{}
	clock.ns.Store(time.Unix(1_800_000_000, 0).UnixNano())
	reg := prometheus.NewRegistry()
	l := testLeaser(t, js, "mon-new", clock, ttl, func(c *LeaserConfig) { c.Partitions, c.Registerer = 2, reg })
	settled := func() bool {
		select {
		case <-l.Settled():
			return true
		default:
			return false
		}
	}
	for range 3 {
		clock.add(ttl)
		if err := l.step(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if held := l.Held(); len(held) != 0 || settled() || l.Foreign() != LeaseKey(3, 1) {
		t.Fatalf("with a lease of 3 partitions in the bucket: holds %v, settled %v, foreign %q", held, settled(), l.Foreign())
	}
	if v := metric(t, reg, "workermon_lease_partitions_mismatch"); v != 1 {
		t.Fatalf("foreign gauge %v, want 1", v)
	}
	// The old monitor's lease goes (here deleted; aged out, it is swept).
	if err := kv.Delete(t.Context(), LeaseKey(3, 1)); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "the delete seen", func() bool { return l.Foreign() == "" })
	clock.add(ttl)
	if err := l.step(t.Context()); err != nil {
		t.Fatal(err)
	}
	if held := l.Held(); !slices.Equal(held, []int{0, 1}) {
		t.Errorf("after the foreign lease went: holds %v, want [0 1]", held)
	}
	// Settled once the OnAcquire calls of the round have returned.
	natstest.WaitFor(t, 5*time.Second, "settled", settled)
	if v := metric(t, reg, "workermon_lease_partitions_mismatch"); v != 0 {
		t.Errorf("foreign gauge %v, want 0", v)
	}
}

// TestLeaserAcquireOffTheLoop: OnAcquire of one partition taking longer
// than several TTLs (many records, a slow server) holds up neither the
// taking of the other partition nor the renewals of either: both leases
// are renewed meanwhile and stay writable. The partition's OnRelease runs
// only after its OnAcquire has returned.
func TestLeaserAcquireOffTheLoop(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	js, kv := leaseTestBucket(t)
	var mu sync.Mutex
	var calls []string
	note := func(s string) { mu.Lock(); calls = append(calls, s); mu.Unlock() }
	l, _, result, stop := runLeaser(t, js, "mon-slow", 2, ttl, func(c *LeaserConfig) {
		c.OnAcquire = func(ctx context.Context, p int, _ uint64) {
			if p == 0 {
				<-ctx.Done() // until Run stops
			}
			note(fmt.Sprint("acquired ", p))
		}
		c.OnRelease = func(_ context.Context, p int) { note(fmt.Sprint("released ", p)) }
	})
	natstest.WaitFor(t, 10*time.Second, "both partitions taken while the first one's OnAcquire blocks", func() bool {
		return slices.Equal(l.Held(), []int{0, 1})
	})
	// Three renewals of each lease (one every TTL/3, so a whole TTL) with
	// partition 0's OnAcquire still blocked: every new revision of a key
	// seen is one renewal.
	seen := [2]map[uint64]bool{{}, {}}
	natstest.WaitFor(t, 10*time.Second, "both leases renewed three times", func() bool {
		for p := range 2 {
			e, err := kv.Get(t.Context(), LeaseKey(2, p))
			if err != nil {
				t.Fatal(err)
			}
			seen[p][e.Revision()] = true
		}
		return len(seen[0]) > 3 && len(seen[1]) > 3
	})
	if !l.Valid(0) || !l.Valid(1) {
		t.Errorf("a blocked OnAcquire fenced the leases: valid %v %v", l.Valid(0), l.Valid(1))
	}
	stop()
	if err := <-result; err != nil {
		t.Fatalf("Run returned %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if a, r := slices.Index(calls, "acquired 0"), slices.Index(calls, "released 0"); a < 0 || r < a {
		t.Errorf("calls %v: partition 0 released before its OnAcquire returned", calls)
	}
	if got := leaseInstances(t, kv, 2); got[0] != "" || got[1] != "" {
		t.Errorf("leases left after a clean stop: %v", got)
	}
}

// TestPartitionCallsOrder: the calls of one partition run one after the
// other in the order given; those of different partitions do not wait for
// each other.
func TestPartitionCallsOrder(t *testing.T) {
	t.Parallel()
	var c partitionCalls
	block := make(chan struct{})
	var mu sync.Mutex
	var order []string
	note := func(s string) func() { return func() { mu.Lock(); order = append(order, s); mu.Unlock() } }
	c.do(0, func() { <-block; note("0a")() })
	c.do(0, note("0b"))
	c.do(1, note("1a"))
	natstest.WaitFor(t, 5*time.Second, "partition 1's call", func() bool { return !c.busy(1) })
	if !c.busy(0) {
		t.Fatal("partition 0 not busy while its first call blocks")
	}
	close(block)
	c.wait(0)
	c.wg.Wait()
	if !slices.Equal(order, []string{"1a", "0a", "0b"}) {
		t.Errorf("order %v, want [1a 0a 0b]", order)
	}
}
