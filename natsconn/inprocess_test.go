package natsconn

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestConnectInProcess connects to an embedded server in process: the
// connection is a pipe, not TCP, messages flow both ways between it and a
// client of the server's listener, which stays open to others.
func TestConnectInProcess(t *testing.T) {
	t.Parallel()
	e := startEmbedded(t, embeddedConfig(t))
	cfg := DefaultConfig()
	cfg.URL, cfg.InProcess = e.ClientURL(), e
	in, err := Connect(t.Context(), cfg, nil)
	if err != nil {
		t.Fatalf("Connect in process: %v", err)
	}
	defer in.Close()
	if addr := in.ConnectedAddr(); addr != "pipe" {
		t.Fatalf("in-process connection at %q, want a pipe", addr)
	}
	cfg.InProcess = nil
	tcp, err := Connect(t.Context(), cfg, nil)
	if err != nil {
		t.Fatalf("Connect over TCP: %v", err)
	}
	defer tcp.Close()
	if addr := tcp.ConnectedAddr(); addr == "pipe" || addr == "" {
		t.Fatalf("TCP connection at %q", addr)
	}
	for _, c := range []struct {
		name     string
		pub, sub *nats.Conn
	}{{"to the in-process client", tcp, in}, {"from the in-process client", in, tcp}} {
		sub, err := c.sub.SubscribeSync("in.process")
		if err != nil {
			t.Fatal(err)
		}
		if err := c.sub.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := c.pub.Publish("in.process", []byte(c.name)); err != nil {
			t.Fatal(err)
		}
		m, err := sub.NextMsg(10 * time.Second)
		if err != nil || string(m.Data) != c.name {
			t.Fatalf("%s: got %v, %v", c.name, m, err)
		}
		_ = sub.Unsubscribe()
	}
}
