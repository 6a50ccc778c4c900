package busylist

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// leaseEntry is a hand-written KeyValueEntry.
type leaseEntry struct {
	key   string
	value []byte
	rev   uint64
	op    jetstream.KeyValueOp
}

func (e leaseEntry) Bucket() string                  { return events.LeasesBucket }
func (e leaseEntry) Key() string                     { return e.key }
func (e leaseEntry) Value() []byte                   { return e.value }
func (e leaseEntry) Revision() uint64                { return e.rev }
func (e leaseEntry) Created() time.Time              { return time.Time{} }
func (e leaseEntry) Delta() uint64                   { return 0 }
func (e leaseEntry) Operation() jetstream.KeyValueOp { return e.op }

func leasePut(t *testing.T, key string, v any, rev uint64) leaseEntry {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return leaseEntry{key: key, value: data, rev: rev, op: jetstream.KeyValuePut}
}

// TestLeaseBookExpiryByObservation: a lease is expired when its key has not
// changed for the TTL on the observer's clock; a renewal seen just before
// keeps it; a re-watch that delivers the same revision again does not make
// it look fresh.
func TestLeaseBookExpiryByObservation(t *testing.T) {
	t.Parallel()
	const ttl = 3 * time.Second
	t0 := time.Unix(1_800_000_000, 0)
	b := newLeaseBook(4, "me", "nonce-me")
	held := func(int) bool { return false }
	free := func(now time.Time) map[int]leaseCandidate {
		out := map[int]leaseCandidate{}
		for _, c := range b.free(now, ttl, held) {
			out[c.p] = c
		}
		return out
	}
	other := LeaseValue{MonitorID: "other", Instance: "nonce-other", Epoch: 4}
	if err := b.apply(leasePut(t, LeaseKey(4, 1), other, 10), t0); err != nil {
		t.Fatal(err)
	}
	if _, ok := free(t0.Add(ttl - time.Millisecond))[1]; ok {
		t.Error("a lease seen changed less than a TTL ago counts as free")
	}
	// Renewed just before the TTL: kept for another TTL from that sighting.
	if err := b.apply(leasePut(t, LeaseKey(4, 1), other, 11), t0.Add(ttl-time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, ok := free(t0.Add(ttl + time.Second))[1]; ok {
		t.Error("a lease renewed just before its TTL counts as expired")
	}
	// A full re-watch delivers revision 11 again: not a change.
	b.reset()
	if err := b.apply(leasePut(t, LeaseKey(4, 1), other, 11), t0.Add(2*ttl)); err != nil {
		t.Fatal(err)
	}
	b.publish()
	c, ok := free(t0.Add(2*ttl - time.Millisecond))[1]
	if !ok || c.rev != 11 || c.epoch != 4 {
		t.Errorf("lease unchanged for a TTL: candidate %+v ok=%v, want rev 11 epoch 4", c, ok)
	}
	// Partitions without a key come first, as creates.
	all := b.free(t0.Add(2*ttl), ttl, held)
	if len(all) != 4 || all[0].rev != 0 || all[len(all)-1].p != 1 {
		t.Errorf("candidates %+v: want the three free partitions, then the expired one", all)
	}
	// A deleted lease (released) is free at once.
	if err := b.apply(leaseEntry{key: LeaseKey(4, 1), rev: 12, op: jetstream.KeyValueDelete}, t0.Add(2*ttl)); err != nil {
		t.Fatal(err)
	}
	if c := free(t0.Add(2 * ttl))[1]; c.rev != 0 {
		t.Errorf("released lease: candidate %+v, want a create", c)
	}
}

func TestLeaseBookMonitors(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	t0 := time.Unix(1_800_000_000, 0)
	b := newLeaseBook(2, "me", "nonce-me")
	for i, id := range []string{"a", "b"} {
		if err := b.apply(leasePut(t, AnnounceKey(id), Announce{MonitorID: id, Instance: id}, uint64(i+1)), t0); err != nil {
			t.Fatal(err)
		}
	}
	if n := b.live(t0.Add(ttl/2), ttl); n != 3 {
		t.Errorf("live = %d, want 3 (two others and this one)", n)
	}
	if n := b.live(t0.Add(ttl), ttl); n != 1 {
		t.Errorf("live after a TTL without announces = %d, want 1", n)
	}
	if got := fairShare(8, 3); got != 3 {
		t.Errorf("fairShare(8, 3) = %d", got)
	}
	// The book only notes another process announcing this monitor's id
	// while watching live; the Leaser decides (the one starting refuses, a
	// running one warns). The value met in a full sync may be a dead
	// process's last announce: not counted.
	b.reset()
	for _, e := range []leaseEntry{
		leasePut(t, AnnounceKey("a"), Announce{MonitorID: "a", Instance: "a"}, 1),
		leasePut(t, AnnounceKey("me"), Announce{MonitorID: "me", Instance: "dead"}, 5),
	} {
		if err := b.apply(e, t0); err != nil {
			t.Fatal(err)
		}
	}
	b.publish()
	if d := b.takeDupe(); d != nil {
		t.Fatalf("an announce met in a full sync counted as a live duplicate (%+v)", d)
	}
	// Its own announce is no duplicate.
	if err := b.apply(leasePut(t, AnnounceKey("me"), Announce{MonitorID: "me", Instance: "nonce-me"}, 6), t0); err != nil {
		t.Fatal(err)
	}
	if d := b.takeDupe(); d != nil {
		t.Fatalf("this process's own announce counted as a duplicate (%+v)", d)
	}
	if err := b.apply(leasePut(t, AnnounceKey("me"), Announce{MonitorID: "me", Instance: "twin"}, 7), t0); err != nil {
		t.Fatal(err)
	}
	if d := b.takeDupe(); d == nil || d.Instance != "twin" {
		t.Errorf("duplicate %+v, want twin", d)
	}
	if d := b.takeDupe(); d != nil {
		t.Errorf("duplicate %+v noted twice", d)
	}
	if n := b.live(t0, ttl); n != 2 {
		t.Errorf("live = %d, want 2: this monitor's own key is not another monitor", n)
	}
}

// TestLeaseBookForeign: a lease of another partition count stops this
// monitor from taking anything only while it is in the bucket as observed:
// until its delete, a full sync that no longer has it, or the bucket's max
// age after it was seen (the server removes it then without a marker).
func TestLeaseBookForeign(t *testing.T) {
	t.Parallel()
	const maxAge = time.Minute
	t0 := time.Unix(1_800_000_000, 0)
	put := func(b *leaseBook, key string, rev uint64, at time.Time) {
		t.Helper()
		if err := b.apply(leasePut(t, key, LeaseValue{MonitorID: "old", Instance: "old", Epoch: 3}, rev), at); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name string
		gone func(b *leaseBook)
	}{
		{"deleted", func(b *leaseBook) {
			for i, key := range []string{LeaseKey(3, 0), LeaseKey(3, 2)} {
				if err := b.apply(leaseEntry{key: key, rev: uint64(20 + i), op: jetstream.KeyValueDelete}, t0); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{"purged", func(b *leaseBook) {
			for i, key := range []string{LeaseKey(3, 0), LeaseKey(3, 2)} {
				if err := b.apply(leaseEntry{key: key, rev: uint64(20 + i), op: jetstream.KeyValuePurge}, t0); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{"absent from a full sync", func(b *leaseBook) {
			b.reset()
			put(b, LeaseKey(2, 0), 30, t0)
			b.publish()
		}},
		{"aged out", func(b *leaseBook) {
			b.sweep(t0.Add(maxAge-time.Second), maxAge)
			if b.foreignKey() == "" {
				t.Fatal("swept before the max age")
			}
			b.sweep(t0.Add(maxAge+time.Second), maxAge)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := newLeaseBook(2, "me", "nonce-me")
			put(b, LeaseKey(3, 2), 10, t0)
			put(b, LeaseKey(3, 0), 11, t0)
			put(b, LeaseKey(2, 1), 12, t0) // of this partition count
			if got := b.foreignKey(); got != LeaseKey(3, 0) {
				t.Fatalf("foreign = %q, want %q", got, LeaseKey(3, 0))
			}
			tt.gone(b)
			if got := b.foreignKey(); got != "" {
				t.Errorf("foreign = %q after the keys of 3 partitions went", got)
			}
		})
	}
}

// leaseClock is a settable clock shared by the leasers of a test.
type leaseClock struct{ ns atomic.Int64 }

func (c *leaseClock) now() time.Time      { return time.Unix(0, c.ns.Load()) }
func (c *leaseClock) add(d time.Duration) { c.ns.Add(int64(d)) }

// testLeaser returns a Leaser on js with clock, whose Run is not started:
// the test drives its rounds. mutate, when given, changes its config.
func testLeaser(t *testing.T, js jetstream.JetStream, id string, clock *leaseClock, ttl time.Duration,
	mutate ...func(*LeaserConfig),
) *Leaser {
	t.Helper()
	cfg := DefaultLeaserConfig()
	cfg.JetStream, cfg.MonitorID, cfg.TTL, cfg.Now = js, id, ttl, clock.now
	cfg.OnAcquire = func(context.Context, int, uint64) {}
	cfg.OnRelease = func(context.Context, int) {}
	cfg.OnLose = func(int) {}
	for _, m := range mutate {
		m(&cfg)
	}
	l, err := NewLeaser(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l.started = clock.now().Add(-ttl)
	if err := l.open(t.Context()); err != nil {
		t.Fatal(err)
	}
	l.loop.Start()
	t.Cleanup(l.loop.Close)
	t.Cleanup(l.calls.wg.Wait)
	natstest.WaitReady(t, l.loop)
	// The start-up window (one TTL after the initial values, without
	// taking) is behind it: what it may take depends on what it has seen
	// alone.
	l.mu.Lock()
	l.readyAt = clock.now().Add(-ttl)
	l.mu.Unlock()
	return l
}

// round is one round of a Leaser driven by a test: the renewals due, then
// Run's step.
func round(t *testing.T, l *Leaser) {
	t.Helper()
	l.renew(t.Context(), l.now())
	if err := l.step(t.Context()); err != nil {
		t.Error(err)
	}
}

// waitSeen waits until l's book holds partition 0's lease at rev.
// leaseTestBucket starts a server and returns a client of it and its
// leases bucket.
func leaseTestBucket(t *testing.T) (jetstream.JetStream, jetstream.KeyValue) {
	t.Helper()
	env := watchTestStart(t)
	return env.js, env.bucket(t, events.LeasesBucket)
}

func waitSeen(t *testing.T, l *Leaser, rev uint64) {
	t.Helper()
	natstest.WaitFor(t, 5*time.Second, "the lease seen", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		s := l.book.leases[0]
		return s != nil && s.rev == rev
	})
}

// TestLeaseContendersAndFencing drives two monitors' rounds on one clock
// against a real server: a dead holder's lease is taken only once it has
// been seen unchanged for the TTL, by exactly one of two contenders; and a
// holder that cannot renew stops writing before the other can take over.
func TestLeaseContendersAndFencing(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	js, kv := leaseTestBucket(t)
	dead, _ := json.Marshal(LeaseValue{MonitorID: "dead", Instance: "gone", Epoch: 7})
	rev, err := kv.Create(t.Context(), LeaseKey(1, 0), dead)
	if err != nil {
		t.Fatal(err)
	}
	clock := &leaseClock{}
	clock.ns.Store(time.Unix(1_800_000_000, 0).UnixNano())
	a := testLeaser(t, js, "mon-a", clock, ttl)
	b := testLeaser(t, js, "mon-b", clock, ttl)
	waitSeen(t, a, rev)
	waitSeen(t, b, rev)

	step := func(ls ...*Leaser) {
		var wg sync.WaitGroup
		for _, l := range ls {
			wg.Go(func() { round(t, l) })
		}
		wg.Wait()
	}
	clock.add(ttl - time.Millisecond)
	step(a, b)
	if len(a.Held())+len(b.Held()) != 0 {
		t.Fatalf("a lease seen unchanged for less than its TTL was taken: a=%v b=%v", a.Held(), b.Held())
	}
	clock.add(time.Millisecond)
	step(a, b) // both try, with a compare-and-set on the same revision
	holder, other := a, b
	if len(b.Held()) == 1 {
		holder, other = b, a
	}
	if len(holder.Held()) != 1 || len(other.Held()) != 0 {
		t.Fatalf("two contenders: a holds %v, b holds %v; want exactly one", a.Held(), b.Held())
	}
	e, err := kv.Get(t.Context(), LeaseKey(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	var v LeaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil || v.MonitorID != holder.cfg.MonitorID || v.Epoch != 8 {
		t.Fatalf("lease %s (%v), want %s's with epoch 8 (the dead one's + 1)", e.Value(), err, holder.cfg.MonitorID)
	}
	if !holder.Valid(0) || other.Valid(0) {
		t.Fatalf("Valid: holder %v, other %v", holder.Valid(0), other.Valid(0))
	}
	waitSeen(t, other, e.Revision())

	// The holder's renewals stop reaching the server (its rounds stop):
	// its writes stop once a TTL has passed since its last good renewal
	// was sent, while the other still sees the lease as live.
	sentAt := clock.now()
	clock.add(ttl - time.Millisecond)
	step(other)
	if !holder.Valid(0) || len(other.Held()) != 0 {
		t.Fatalf("before the TTL: holder valid %v, other holds %v", holder.Valid(0), other.Held())
	}
	clock.add(time.Millisecond)
	if holder.Valid(0) {
		t.Fatalf("the holder still writes %v after its last good renewal was sent", clock.now().Sub(sentAt))
	}
	// The other saw the lease change when it was taken, which is after it
	// was sent: it may take it only now, when the holder already stopped.
	step(other)
	if len(other.Held()) != 1 {
		t.Fatalf("the lease unchanged for a TTL was not taken over")
	}
	// The old holder's next renewal fails: it drops the partition.
	step(holder)
	if len(holder.Held()) != 0 || holder.Valid(0) {
		t.Errorf("the deposed holder still holds %v", holder.Held())
	}
}
