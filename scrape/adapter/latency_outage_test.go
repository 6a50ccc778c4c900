package adapter_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/scrape"
)

// TestLatencyWindowsNotBufferedInOutage: a latency window the adapter
// measures while its NATS connection is down is not kept in the
// connection's reconnect buffer, to arrive with the reconnect's burst long
// after its interval. A stream on the server keeps what reaches it after
// the restart, whoever listens.
func TestLatencyWindowsNotBufferedInOutage(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	// The adapter's connection reconnects only once the test lets it:
	// after the restarted server's stream is back.
	reconnect := make(chan struct{})
	nc := natstest.Connect(t, srv, nats.CustomReconnectDelay(func(int) time.Duration {
		<-reconnect
		return 0
	}))
	obs := natstest.Connect(t, srv)
	js, err := jetstream.New(obs)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "LAT", Subjects: []string{events.DefaultSubjectPrefix + ".lat.>"}}); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, latencyPage(10))
	cfg := (&env{nc: nc, obs: obs}).config(scrape.VLLM{}, e.url())
	cfg.LatencyWindow = 50 * time.Millisecond
	start(t, cfg)
	natstest.WaitFor(t, waitTimeout, "first scrapes", func() bool { return e.hits.Load() >= 3 })

	opts = natstest.Stop(t, srv, opts)
	natstest.WaitFor(t, waitTimeout, "the adapter's connection to notice the outage", func() bool { return !nc.IsConnected() })
	e.set(latencyPage(35), 0, false) // 25 samples, measured in the outage
	from := e.hits.Load()
	// 10 scrapes of 20 ms: past a window of 50 ms after the new samples.
	natstest.WaitFor(t, waitTimeout, "scrapes in the outage", func() bool { return e.hits.Load() >= from+10 })

	natstest.Start(t, opts)
	var s jetstream.Stream
	natstest.WaitFor(t, waitTimeout, "the stream back", func() bool {
		c, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		s, err = js.Stream(c, "LAT")
		return err == nil
	})
	close(reconnect)
	natstest.WaitFor(t, waitTimeout, "the reconnect", nc.IsConnected)
	if err := nc.Flush(); err != nil { // after whatever the reconnect sent
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.State.Msgs; n != 0 {
		t.Errorf("%d latency windows of the outage delivered after it, want none", n)
	}
}
