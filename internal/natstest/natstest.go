// Package natstest starts real in-process NATS servers with JetStream for
// tests: a fresh store under t.TempDir, a random port on 127.0.0.1, and
// shutdown at the end of the test. WaitFor polls for what such a server
// delivers asynchronously.
package natstest

import (
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
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
	opts = opts.Clone()
	opts.Port = s.Addr().(*net.TCPAddr).Port
	s.Shutdown()
	s.WaitForShutdown()
	return Start(t, opts)
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
