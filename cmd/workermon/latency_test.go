package main

import (
	"context"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// BenchmarkReportToRecord measures the whole slice: a report that flips a
// worker between busy and free is published, the monitor applies it, the
// writer puts the record, and a KV watcher sees it. ns/op is that latency.
func BenchmarkReportToRecord(b *testing.B) {
	o := defaultServeOptions()
	o.embedded.Addr, o.embedded.DataDir, o.httpAddr = "127.0.0.1:0", b.TempDir(), "127.0.0.1:0"
	o.writer.Warmup = 0
	o.leaseTTL = 200 * time.Millisecond
	o.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
	svc, err := startService(context.Background(), o, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		b.Fatal(err)
	}
	defer svc.Close(context.Background())
	waitSettled(b, svc)
	nc, err := nats.Connect(svc.natsURL)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx := b.Context()
	var kv jetstream.KeyValue
	natstest.WaitFor(b, 5*time.Second, "busy bucket", func() bool {
		kv, err = js.KeyValue(ctx, events.BusyBucket)
		return err == nil
	})
	const model = "bench/model"
	w, err := kv.Watch(ctx, events.ModelKey(model), jetstream.UpdatesOnly())
	if err != nil {
		b.Fatal(err)
	}
	enc := events.NewEncoder()
	subject := events.LoadSubject(events.DefaultSubjectPrefix, model, 1, 0)
	r := events.LoadReport{Model: model, WorkerID: 1, DPSize: 1, Source: events.SourceEngine,
		KVTotalBlocks: events.Some(100), BootID: 1}
	wait := func(busy bool) {
		for e := range w.Updates() {
			if e == nil {
				continue
			}
			rec, err := events.DecodeBusySet(e.Value())
			if err != nil {
				b.Fatal(err)
			}
			if slices.Contains(rec.Busy, 1) == busy && (busy || slices.Contains(rec.Free, 1)) {
				return
			}
		}
		b.Fatal("watch ended")
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		busy := i%2 == 0
		r.Seq++
		r.SentAt = time.Now().UnixNano()
		r.ActiveDecodeBlocks = events.Some(10)
		if busy {
			r.ActiveDecodeBlocks = events.Some(90)
		}
		data, _ := enc.LoadReport(&r)
		if err := nc.Publish(subject, data); err != nil {
			b.Fatal(err)
		}
		wait(busy)
	}
}
