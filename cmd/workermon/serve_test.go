package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/publisher"
)

// testService starts a monitor on its own embedded NATS server with short
// intervals, and stops it at the end of the test.
func testService(t testing.TB, mutate func(*serveOptions)) *service {
	t.Helper()
	o := defaultServeOptions()
	o.embedded.Addr = "127.0.0.1:0"
	o.embedded.DataDir = t.TempDir()
	o.httpAddr = "127.0.0.1:0"
	o.writer.Warmup = 100 * time.Millisecond
	o.writer.Heartbeat = 300 * time.Millisecond
	o.leaseTTL = 200 * time.Millisecond
	o.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
	if mutate != nil {
		mutate(&o)
	}
	svc, err := startService(t.Context(), o, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, svc.Close)
	waitSettled(t, svc)
	return svc
}

// waitSettled waits until the monitor holds its partitions (or is a
// standby): until then no report is listened to.
func waitSettled(t testing.TB, svc *service) {
	t.Helper()
	select {
	case <-svc.leaser.Settled():
	case <-time.After(10 * time.Second):
		t.Fatal("leases not settled within 10s")
	}
}

// closeAtCleanup closes what the test started when it ends, within 10s;
// an error of close fails the test.
func closeAtCleanup(t testing.TB, close func(context.Context) error) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := close(ctx); err != nil {
			t.Error(err)
		}
	})
}

func connect(t *testing.T, url string) (*nats.Conn, jetstream.KeyValue) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var kv jetstream.KeyValue
	natstest.WaitFor(t, 5*time.Second, "busy bucket", func() bool {
		kv, err = js.KeyValue(t.Context(), events.BusyBucket)
		return err == nil
	})
	return nc, kv
}

// record reads and decodes the model's record; ok is false when absent.
func record(t *testing.T, kv jetstream.KeyValue, model string) (events.BusySet, bool) {
	t.Helper()
	e, err := kv.Get(t.Context(), events.ModelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return events.BusySet{}, false
	}
	if err != nil {
		t.Fatal(err)
	}
	b, err := events.DecodeBusySet(e.Value())
	if err != nil {
		t.Fatal(err)
	}
	return b, true
}

// TestSlice runs the vertical slice: a publisher's reports reach the
// monitor, whose record appears in the busy bucket and follows the load.
func TestSlice(t *testing.T) {
	t.Parallel()
	svc := testService(t, nil)
	nc, kv := connect(t, svc.natsURL)
	const model = "Qwen/Qwen3-0.6B"

	pubs := map[uint64]*publisher.Publisher{}
	for _, id := range []uint64{11, 12} {
		p, err := publisher.New(nc, model, id, publisher.WithRanks(0, 2))
		if err != nil {
			t.Fatal(err)
		}
		pubs[id] = p
		for rank := range uint32(2) {
			if err := p.Update(rank, publisher.Load{ActiveDecodeBlocks: events.Some(10), KVTotalBlocks: events.Some(100)}); err != nil {
				t.Fatal(err)
			}
		}
	}
	natstest.WaitFor(t, 5*time.Second, "both workers free", func() bool {
		b, ok := record(t, kv, model)
		return ok && slices.Equal(b.Free, []uint64{11, 12}) && len(b.Busy) == 0
	})

	// Both ranks of worker 11 over 80%: busy; worker 12 keeps the model open.
	for rank := range uint32(2) {
		_ = pubs[11].Update(rank, publisher.Load{ActiveDecodeBlocks: events.Some(90)})
	}
	natstest.WaitFor(t, 5*time.Second, "worker 11 busy", func() bool {
		b, _ := record(t, kv, model)
		return slices.Equal(b.Busy, []uint64{11}) && b.Reasons["11"] == "kv" && !b.AllBusy
	})
	for rank := range uint32(2) {
		_ = pubs[12].Update(rank, publisher.Load{ActiveDecodeBlocks: events.Some(81)})
	}
	natstest.WaitFor(t, 5*time.Second, "all busy", func() bool {
		b, _ := record(t, kv, model)
		return b.AllBusy && slices.Equal(b.Busy, []uint64{11, 12})
	})

	// A goodbye removes the worker at once.
	if err := pubs[12].Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "worker 12 gone", func() bool {
		b, _ := record(t, kv, model)
		return slices.Equal(b.Busy, []uint64{11}) && len(b.Free) == 0 && len(b.Stale) == 0
	})

	// Heartbeat: the record is re-put with a later updated_at and seq.
	first, _ := record(t, kv, model)
	natstest.WaitFor(t, 5*time.Second, "heartbeat re-put", func() bool {
		b, _ := record(t, kv, model)
		return b.Seq > first.Seq && b.UpdatedAt > first.UpdatedAt
	})
	if first.Epoch != 1 || first.MonitorID == "" {
		t.Fatalf("epoch %d, monitor_id %q", first.Epoch, first.MonitorID)
	}
	_ = pubs[11].Close(t.Context())
}

// TestServeEmbeddedInProcess: on its embedded server the monitor's own
// connection (records, leases, watches) is in process, the reports come
// over TCP on a connection of their own (a pipe hands the server's writes
// over one buffer at a time: natsconn.Config.InProcess), and the server
// still listens for everyone else; TestSlice runs reports through both.
func TestServeEmbeddedInProcess(t *testing.T) {
	t.Parallel()
	svc := testService(t, nil)
	if addr := svc.nc.ConnectedAddr(); addr != "pipe" {
		t.Errorf("the monitor's connection is at %q, want in process (a pipe)", addr)
	}
	if addr := svc.intakeNC.ConnectedAddr(); svc.intakeNC == svc.nc || addr == "pipe" || addr == "" {
		t.Errorf("the reports' connection is at %q, want TCP", addr)
	}
	nc, _ := connect(t, svc.natsURL)
	if !nc.IsConnected() {
		t.Error("the embedded server does not take outside clients")
	}
}

// TestServeHTTP checks health, readiness and metrics of a running monitor.
func TestServeHTTP(t *testing.T) {
	t.Parallel()
	svc := testService(t, nil)
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + svc.httpAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz = %d", code)
	}
	natstest.WaitFor(t, 5*time.Second, "ready", func() bool { code, _ := get("/readyz"); return code == http.StatusOK })

	nc, _ := connect(t, svc.natsURL)
	if err := nc.Publish("workermon.load.m.1.0", []byte("garbage")); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "rejection counted", func() bool {
		return metricValue(t, svc.reg, "workermon_reports_rejected_total", "reason", "not_map") == 1
	})
	_, body := get("/metrics")
	for _, name := range []string{"workermon_busy_writer_epoch", "workermon_recompute_seconds", "go_goroutines"} {
		if !strings.Contains(body, name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
}

// metricValue returns the value of the counter or gauge name with the label
// pair given, read through the registry; -1 when absent.
func metricValue(t *testing.T, g prometheus.Gatherer, name, label, value string) float64 {
	t.Helper()
	if v, ok := promtest.Value(t, g, name, map[string]string{label: value}); ok {
		return v
	}
	return -1
}

// TestCloseWithSlowClient checks that a client that never finishes its
// request does not take the whole shutdown budget: the HTTP server gets a
// part of it, then its connections are cut, and the loops still stop (the
// writer's final flush included) within the rest.
func TestCloseWithSlowClient(t *testing.T) {
	t.Parallel()
	o := defaultServeOptions()
	o.embedded.Addr, o.embedded.DataDir, o.httpAddr = "127.0.0.1:0", t.TempDir(), "127.0.0.1:0"
	svc, err := startService(t.Context(), o, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", svc.httpAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// A body announced and never sent: the handler waits in its read. The
	// server's 100 Continue says the handler has begun reading it.
	if _, err := io.WriteString(conn, "POST /busy_threshold HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
		"Content-Length: 100\r\nExpect: 100-continue\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if line, err := bufio.NewReader(conn).ReadString('\n'); err != nil || !strings.Contains(line, "100") {
		t.Fatalf("read %q, %v; want 100 Continue", line, err)
	}
	if _, err := io.WriteString(conn, "{"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	start := time.Now()
	err = svc.Close(ctx)
	t.Logf("Close took %v: %v", time.Since(start), err)
	if took := time.Since(start); took > 4*time.Second {
		t.Errorf("Close took %v", took)
	}
	if err != nil && strings.Contains(err.Error(), "did not stop") {
		t.Errorf("Close: %v; want every loop stopped", err)
	}
	for name, done := range map[string]chan struct{}{"monitor": svc.monitorDone, "writer": svc.writerDone, "watcher": svc.watcherDone} {
		select {
		case <-done:
		default:
			t.Errorf("%s loop still running after Close", name)
		}
	}
}
