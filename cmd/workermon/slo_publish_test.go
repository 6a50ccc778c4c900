package main

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/internal/natstest"
)

// TestLatencyPublishNotBuffered: while the router's connection is
// disconnected its latency windows fail to publish instead of going into
// the reconnect buffer (which a reconnect would deliver as a burst of stale
// windows); the connection's other publishes still buffer.
func TestLatencyPublishNotBuffered(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	nc := natstest.Connect(t, srv)
	publish := publishWhileConnected(nc)
	if err := publish("workermon.latr.m.1", []byte("window")); err != nil {
		t.Fatalf("publish while connected: %v", err)
	}
	natstest.Stop(t, srv, opts)
	natstest.WaitFor(t, 10*time.Second, "the connection to notice the outage", func() bool { return !nc.IsConnected() })
	err := publish("workermon.latr.m.1", []byte("window"))
	if !errors.Is(err, nats.ErrDisconnected) {
		t.Errorf("publish while disconnected: %v, want ErrDisconnected", err)
	}
	if n, err := nc.Buffered(); err != nil || n != 0 {
		t.Fatalf("%d bytes buffered for after the reconnect (%v), want 0", n, err)
	}
	if err := nc.Publish("workermon.other", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if n, _ := nc.Buffered(); n == 0 {
		t.Error("another publish was not buffered: the connection's reconnect buffer is off")
	}
}
