package overrides_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
)

// testWait is how long the tests wait for something over the network:
// generous, so that they pass beside a busy CPU (a wait ends as soon as
// its condition holds).
const testWait = 15 * time.Second

// testEnv is a NATS server with JetStream, a client of it and a metrics
// registry.
type testEnv struct {
	opts *server.Options
	srv  *server.Server
	js   jetstream.JetStream
	reg  *prometheus.Registry
}

func newTestEnv(t *testing.T) *testEnv {
	t.Helper()
	e := &testEnv{opts: natstest.Options(t), reg: prometheus.NewRegistry()}
	e.srv = natstest.Start(t, e.opts)
	e.js = testJetStream(t, natstest.Connect(t, e.srv))
	return e
}

func testJetStream(t *testing.T, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream.New: %v", err)
	}
	return js
}

func (e *testEnv) logger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// bucket opens a bucket, creating it when missing.
func (e *testEnv) bucket(t *testing.T, name string) jetstream.KeyValue {
	t.Helper()
	kv, err := kvbucket.Open(t.Context(), e.js, name, 1)
	if err != nil {
		t.Fatalf("open bucket: %v", err)
	}
	return kv
}

// testMetric returns the value of a counter or gauge with the given label
// pairs from the registry.
func testMetric(t *testing.T, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	v, ok := promtest.Value(t, g, name, want)
	if !ok {
		t.Fatalf("metric %s %v not found", name, labels)
	}
	return v
}

// fakeJS stands for a JetStream in configuration tests.
type fakeJS struct{ jetstream.JetStream }
