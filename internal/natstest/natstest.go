// Package natstest starts real in-process NATS servers with JetStream for
// tests: a fresh store under t.TempDir, a random port on 127.0.0.1, and
// shutdown at the end of the test. WaitFor polls for what such a server
// delivers asynchronously; Go runs what a test starts until its end.
package natstest

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Options returns the options of a single JetStream server on a random
// loopback port storing under a fresh temporary directory.
func Options(t testing.TB) *server.Options {
	t.Helper()
	return &server.Options{
		ServerName: "test",
		Host:       "127.0.0.1",
		Port:       -1,
		JetStream:  true,
		StoreDir:   t.TempDir(),
		NoLog:      true,
		NoSigs:     true,
	}
}

// Start runs a server with opts (Options(t) when nil) until the test ends.
func Start(t testing.TB, opts *server.Options) *server.Server {
	t.Helper()
	if opts == nil {
		opts = Options(t)
	}
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("natstest: new server: %v", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		t.Fatal("natstest: server not ready in 10s")
	}
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

// Restart stops s, started with opts, and starts a server with the same
// options on the same port and store, as a NATS restart in production would.
func Restart(t testing.TB, s *server.Server, opts *server.Options) *server.Server {
	t.Helper()
	return Start(t, Stop(t, s, opts))
}

// Stop stops s, started with opts, for an outage, and returns the options
// that Start takes to bring it back on the same port and store.
func Stop(t testing.TB, s *server.Server, opts *server.Options) *server.Options {
	t.Helper()
	opts = opts.Clone()
	opts.Port = s.Addr().(*net.TCPAddr).Port
	s.Shutdown()
	s.WaitForShutdown()
	return opts
}

// Connect returns a client of s with reconnects that never give up, closed
// at the end of the test.
func Connect(t testing.TB, s *server.Server, opts ...nats.Option) *nats.Conn {
	t.Helper()
	opts = append([]nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(50 * time.Millisecond),
		nats.PingInterval(2 * time.Second),
	}, opts...)
	nc, err := nats.Connect(s.ClientURL(), opts...)
	if err != nil {
		t.Fatalf("natstest: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// WaitFor polls cond every few milliseconds until it holds, failing the test
// when it still does not after within; what names the awaited condition.
func WaitFor(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Go runs fn in a goroutine until the end of the test, then cancels its
// context and waits up to within for it to return, failing the test when it
// returns an error or does not return: for the Run loops of what a test
// starts against its server.
func Go(t testing.TB, within time.Duration, fn func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(within):
			t.Error("Run did not return after cancel")
		}
	})
}

// Put puts data under key, retrying until the server takes it (it may be
// restarting) for up to 10 s, and returns the revision.
func Put(t testing.TB, kv jetstream.KeyValue, key string, data []byte) uint64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		rev, err := kv.Put(ctx, key, data)
		cancel()
		if err == nil {
			return rev
		}
		if time.Now().After(deadline) {
			t.Fatalf("natstest: put %s: %v", key, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitReady waits up to 10 s for a watcher's initial values.
func WaitReady(t testing.TB, w interface{ WaitReady(context.Context) error }) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := w.WaitReady(ctx); err != nil {
		t.Fatalf("natstest: WaitReady: %v", err)
	}
}

// Cluster starts a three-node JetStream cluster on loopback ports until the
// test ends, and waits until it has elected a meta leader that every node
// follows. (A JetStream node needs its routes, its own included, before it
// starts, so the route ports are picked first.)
func Cluster(t testing.TB) []*server.Server {
	t.Helper()
	ports := make([]int, 3)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("natstest: pick a cluster port: %v", err)
		}
		ports[i] = l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
	}
	routes := ""
	for i, p := range ports {
		if i > 0 {
			routes += ","
		}
		routes += "nats://127.0.0.1:" + strconv.Itoa(p)
	}
	servers := make([]*server.Server, 3)
	for i := range servers {
		opts := Options(t)
		opts.ServerName = "n" + strconv.Itoa(i+1)
		opts.Cluster = server.ClusterOpts{Name: "natstest", Host: "127.0.0.1", Port: ports[i]}
		opts.Routes = server.RoutesFromStr(routes)
		s, err := server.NewServer(opts)
		if err != nil {
			t.Fatalf("natstest: new cluster server: %v", err)
		}
		s.Start()
		t.Cleanup(func() {
			s.Shutdown()
			s.WaitForShutdown()
		})
		servers[i] = s
	}
	WaitFor(t, 60*time.Second, "a JetStream meta leader", func() bool {
		leaders := 0
		for _, s := range servers {
			if !s.ReadyForConnections(10*time.Millisecond) || !s.JetStreamIsCurrent() {
				return false
			}
			if s.JetStreamIsLeader() {
				leaders++
			}
		}
		return leaders == 1
	})
	return servers
}
