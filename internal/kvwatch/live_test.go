package kvwatch

import (
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
)

// fakeSweeper records what the loop asks of a Sweeper sink.
type fakeSweeper struct {
	mu     sync.Mutex
	sweeps []time.Time // the now of each Sweep
}

func (f *fakeSweeper) Reset()                                         {}
func (f *fakeSweeper) Apply(jetstream.KeyValueEntry, time.Time) error { return nil }
func (f *fakeSweeper) Publish() int                                   { return 0 }

func (f *fakeSweeper) Sweep(now time.Time, _ time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sweeps = append(f.sweeps, now)
}

func (f *fakeSweeper) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.sweeps)
}

// reasonStats records why watches ended.
type reasonStats struct {
	mu      sync.Mutex
	reasons map[string]int
}

func (s *reasonStats) Rewatched(reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reasons[reason]++
}

func (s *reasonStats) count(reason string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reasons[reason]
}

func (*reasonStats) BadRecord(string) {}
func (*reasonStats) Published(int)    {}

// liveClock is a settable clock that counts its reads.
type liveClock struct{ ns, reads atomic.Int64 }

func (c *liveClock) now() time.Time {
	c.reads.Add(1)
	return time.Unix(0, c.ns.Load())
}

// waitReads waits until the clock has been read n more times (the loop reads
// it at each sweep tick).
func (c *liveClock) waitReads(t *testing.T, n int64) {
	t.Helper()
	want := c.reads.Load() + n
	natstest.WaitFor(t, 10*time.Second, "the loop reading its clock", func() bool { return c.reads.Load() >= want })
}

// TestLoopPausesSweepsWhileProbesFail takes from the client, by a
// configuration reload of a server that stays up, the right to ask about
// streams: the connection holds but every probe fails. The loop is not live
// and does not sweep, however far the clock moves; when the right is back
// the watch is replaced, live again, and sweeps resume one TTL after that
// moment.
func TestLoopPausesSweepsWhileProbesFail(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	opts.Users = []*server.User{{Username: "wm", Password: "secret"}}
	srv := natstest.Start(t, opts)
	opts = opts.Clone()
	opts.Port = srv.Addr().(*net.TCPAddr).Port // a reload keeps the port
	reload := func(perms *server.Permissions) {
		t.Helper()
		o := opts.Clone()
		o.Users = []*server.User{{Username: "wm", Password: "secret", Permissions: perms}}
		if err := srv.ReloadOptions(o); err != nil {
			t.Fatalf("reload: %v", err)
		}
	}
	nc := natstest.Connect(t, srv, nats.UserInfo("wm", "secret"),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})) // the denied probes

	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	clock := &liveClock{}
	clock.ns.Store(time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC).UnixNano())
	sink, stats := &fakeSweeper{}, &reasonStats{reasons: map[string]int{}}
	l := New(Config{JS: js, Bucket: events.WorkersBucket, Replicas: 1, Log: slog.New(slog.DiscardHandler),
		ErrLevel: slog.LevelWarn, Now: clock.now, OpTimeout: 500 * time.Millisecond, ProbeEvery: 50 * time.Millisecond,
		RetryMin: 10 * time.Millisecond, RetryMax: 100 * time.Millisecond}, sink, stats)
	l.sweepEvery = 20 * time.Millisecond
	l.Start()
	t.Cleanup(l.Close)
	natstest.WaitReady(t, l)
	natstest.WaitFor(t, 5*time.Second, "the loop live", l.Live)

	// Live, but not for a TTL yet: no sweep.
	clock.waitReads(t, 3)
	if n := sink.count(); n != 0 {
		t.Fatalf("%d sweeps within the first TTL", n)
	}
	clock.ns.Add(int64(kvbucket.RegistryTTL + time.Second))
	natstest.WaitFor(t, 5*time.Second, "a sweep past the TTL", func() bool { return sink.count() > 0 })

	// No stream info, connection up: probes fail.
	reload(&server.Permissions{Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{"$JS.API.STREAM.INFO.>"}}})
	natstest.WaitFor(t, 10*time.Second, "the loop not live", func() bool { return !l.Live() })
	if !nc.IsConnected() {
		t.Fatal("the connection dropped: this test wants it up without JetStream")
	}
	before := sink.count()
	clock.ns.Add(int64(3 * kvbucket.RegistryTTL))
	clock.waitReads(t, 5)
	if n := sink.count() - before; n != 0 {
		t.Fatalf("%d sweeps while probes failed", n)
	}

	// Stream info allowed again: live again, and a fresh grace of one TTL.
	reload(nil)
	natstest.WaitFor(t, 20*time.Second, "the loop live again", l.Live)
	if stats.count("recovered") == 0 || stats.count("reconnect") != 0 {
		t.Errorf("re-watches: %d recovered, %d reconnect; want at least one for the recovered probe and none for a reconnect",
			stats.count("recovered"), stats.count("reconnect"))
	}
	clock.waitReads(t, 3)
	if n := sink.count() - before; n != 0 {
		t.Fatalf("%d sweeps in the first TTL after recovery", n)
	}
	clock.ns.Add(int64(kvbucket.RegistryTTL + time.Second))
	natstest.WaitFor(t, 5*time.Second, "sweeps resumed one TTL after recovery", func() bool { return sink.count() > before })
}
