package main

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// BenchmarkIngestScaleOut measures the combined ingest of 1, 2 and 4
// monitors sharing 8 partitions (docs/ha.md): one client publishes reports
// of 64 models as fast as it can, and the clock stops when the monitors
// together have accepted them all. reports/s is the figure; on a machine
// with more cores than monitors the ratio to one monitor grows, on 2 cores
// the monitors compete for the same CPU as NATS and the publisher.
func BenchmarkIngestScaleOut(b *testing.B) {
	for _, n := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("monitors=%d", n), func(b *testing.B) { benchScaleOut(b, n) })
	}
}

func benchScaleOut(b *testing.B, monitors int) {
	const (
		parts  = 8
		models = 64
		batch  = 50_000
	)
	var svcs []*service
	var url string
	for i := range monitors {
		o := defaultServeOptions()
		o.httpAddr, o.partitions, o.leaseTTL = "127.0.0.1:0", parts, 300*time.Millisecond
		o.writer.Warmup, o.writer.MonitorID = 0, fmt.Sprintf("bench-%d", i)
		o.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
		if i == 0 {
			o.embedded.Addr, o.embedded.DataDir = "127.0.0.1:0", b.TempDir()
		} else {
			o.natsURL = url
		}
		svc, err := startService(context.Background(), o, slog.New(slog.DiscardHandler), newRegistry())
		if err != nil {
			b.Fatal(err)
		}
		defer svc.Close(context.Background())
		url = svc.natsURL
		svcs = append(svcs, svc)
	}
	// Every partition held, spread evenly.
	natstest.WaitFor(b, 30*time.Second, "partitions spread", func() bool {
		total, most := 0, 0
		for _, s := range svcs {
			h := len(s.leaser.Held())
			total += h
			most = max(most, h)
		}
		return total == parts && most == (parts+monitors-1)/monitors
	})
	nc, err := nats.Connect(url)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	enc := events.NewEncoder()
	subjects := make([]string, models)
	reports := make([]events.LoadReport, models)
	for m := range models {
		name := fmt.Sprintf("bench/model-%d", m)
		subjects[m] = events.LoadSubject(events.DefaultSubjectPrefix, name, 1, 0)
		reports[m] = events.LoadReport{Model: name, WorkerID: 1, DPSize: 1, Source: events.SourceEngine,
			KVTotalBlocks: events.Some(100), BootID: 1}
	}
	accepted := func() float64 {
		var sum float64
		for _, s := range svcs {
			mfs, _ := s.reg.Gather()
			for _, mf := range mfs {
				if mf.GetName() == "workermon_reports_accepted_total" {
					sum += counterWith(mf, "kind", "load")
				}
			}
		}
		return sum
	}
	var seq uint64
	b.ResetTimer()
	start := time.Now()
	base := accepted()
	sent := 0
	for range b.N {
		for i := range batch {
			m := i % models
			seq++
			r := reports[m]
			r.Seq, r.SentAt = seq, time.Now().UnixNano()
			r.ActiveDecodeBlocks = events.Some(seq % 100)
			data, err := enc.LoadReport(&r)
			if err != nil {
				b.Fatal(err)
			}
			if err := nc.Publish(subjects[m], data); err != nil {
				b.Fatal(err)
			}
		}
		sent += batch
		deadline := time.Now().Add(30 * time.Second)
		for accepted()-base < float64(sent) {
			if time.Now().After(deadline) {
				b.Fatalf("accepted %v of %d", accepted()-base, sent)
			}
			time.Sleep(time.Millisecond)
		}
	}
	b.ReportMetric(float64(sent)/time.Since(start).Seconds(), "reports/s")
}

// counterWith returns the counter of mf labelled name=value.
func counterWith(mf *dto.MetricFamily, name, value string) float64 {
	for _, m := range mf.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == name && l.GetValue() == value {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
