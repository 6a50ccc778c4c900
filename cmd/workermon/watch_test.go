package main

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
)

// TestWatchLines runs `workermon watch` with its output not a terminal
// against a real NATS server whose busy bucket a busylist.Writer writes,
// heartbeats included: one line per change of a record, none per
// heartbeat, one per deletion; --model filters.
func TestWatchLines(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	nc := natstest.Connect(t, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	wcfg := busylist.DefaultWriterConfig()
	wcfg.JetStream, wcfg.MonitorID = js, "test-monitor"
	wcfg.Warmup, wcfg.Heartbeat = 0, 50*time.Millisecond
	writer, err := busylist.NewWriter(wcfg)
	if err != nil {
		t.Fatal(err)
	}
	wctx, stopWriter := context.WithCancel(t.Context())
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		_ = writer.Run(wctx)
	}()
	t.Cleanup(func() { stopWriter(); <-writerDone })
	const model, other = "Qwen/Qwen3-0.6B", "other model"
	thresholds := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
	writer.Set(events.BusySet{Model: model, Free: []uint64{11, 12}, Thresholds: thresholds})

	start := func(args ...string) (*syncbuf.Buffer, *syncbuf.Buffer, func() error) {
		var out, errOut syncbuf.Buffer
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- runWatch(ctx, append([]string{"--nats-url", srv.ClientURL()}, args...), &out, &errOut) }()
		var once sync.Once
		var runErr error
		stop := func() error {
			once.Do(func() { cancel(); runErr = <-done })
			return runErr
		}
		t.Cleanup(func() { _ = stop() })
		return &out, &errOut, stop
	}
	out, errOut, stop := start()
	filtered, _, stopFiltered := start("--model", other)

	waitLine := func(what string, n int, want ...string) {
		t.Helper()
		natstest.WaitFor(t, 10*time.Second, what, func() bool {
			lines := out.Lines()
			if len(lines) < n {
				return false
			}
			for _, w := range want {
				if !strings.Contains(lines[n-1], w) {
					return false
				}
			}
			return true
		})
	}
	waitLine("the first record", 1, "model=Qwen/Qwen3-0.6B all_busy=false busy=[] free=[11 12] stale=[]", "thresholds=[kv>0.8]")
	writer.Set(events.BusySet{Model: model, Busy: []uint64{11}, Free: []uint64{12}, Reasons: map[string]string{"11": "kv"},
		Thresholds: thresholds})
	waitLine("worker 11 busy", 2, "all_busy=false busy=[11] free=[12]", "reasons=[11:kv]")
	writer.Set(events.BusySet{Model: other, Busy: []uint64{1}, AllBusy: true, Reasons: map[string]string{"1": "prefill"}})
	waitLine("the other model, all busy", 3, `model="other model" all_busy=true busy=[1]`, "reasons=[1:prefill]")
	writer.Set(events.BusySet{Model: model, Busy: []uint64{11, 12}, AllBusy: true, Reasons: map[string]string{"11": "kv", "12": "kv"},
		Thresholds: thresholds})
	waitLine("all busy", 4, "model=Qwen/Qwen3-0.6B all_busy=true busy=[11 12] free=[]")
	writer.Delete(model)
	waitLine("deleted", 5, "model=Qwen/Qwen3-0.6B deleted")

	// Every record is re-put every 50ms: no line for those. Let a few go by.
	kv, err := js.KeyValue(t.Context(), events.BusyBucket)
	if err != nil {
		t.Fatal(err)
	}
	seqOf := func() uint64 {
		e, err := kv.Get(t.Context(), events.ModelKey(other))
		if err != nil {
			t.Fatal(err)
		}
		rec, err := events.DecodeBusySet(e.Value())
		if err != nil {
			t.Fatal(err)
		}
		return rec.Seq
	}
	seq := seqOf()
	natstest.WaitFor(t, 10*time.Second, "three heartbeats", func() bool { return seqOf() >= seq+3 })
	if err := stop(); err != nil {
		t.Fatalf("watch ended with %v", err)
	}
	lines := out.Lines()
	if len(lines) != 5 {
		t.Fatalf("%d lines, want one per change (5):\n%s", len(lines), strings.Join(lines, "\n"))
	}
	for _, l := range lines {
		if _, err := time.Parse("2006-01-02T15:04:05.000Z07:00", strings.Fields(l)[0]); err != nil {
			t.Errorf("line does not begin with its time: %q", l)
		}
	}
	if !strings.Contains(errOut.String(), "nats: connected") || !strings.Contains(errOut.String(), "server_version=") {
		t.Errorf("the connection and the server's version are not logged:\n%s", errOut.String())
	}
	if err := stopFiltered(); err != nil {
		t.Fatal(err)
	}
	if got := filtered.Lines(); len(got) != 1 || !strings.Contains(got[0], `model="other model" all_busy=true`) {
		t.Errorf("--model %q wrote:\n%s", other, strings.Join(got, "\n"))
	}
}

func TestWatchUsage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--model", strings.Repeat("m", 257)},
		{"--nats-url", "ftp://x"},
		{"extra"},
	} {
		err := runWatch(t.Context(), args, &syncbuf.Buffer{}, &syncbuf.Buffer{})
		if !errors.Is(err, errUsage) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}
