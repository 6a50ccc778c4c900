package busylist

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
)

// scanBucket fills the busy bucket with records of models models of
// workers workers each, spread over parts partitions, written as a Writer
// in headers mode writes them (epoch and monitor id in headers), the
// model's index as its epoch; with deleted, every fourth model is then
// deleted by a marker with headers. It returns the bucket, the connection
// and the sum of the records' sizes.
func scanBucket(t testing.TB, models, workers int, deleted bool) (jetstream.JetStream, jetstream.KeyValue, *nats.Conn, int) {
	t.Helper()
	srv := natstest.Start(t, natstest.Options(t))
	nc := natstest.Connect(t, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := kvbucket.Open(t.Context(), js, events.BusyBucket, 1)
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for i := range models {
		set := events.BusySet{Model: fmt.Sprintf("org/scan-%d", i), Stale: []uint64{}, Reasons: map[string]string{},
			MonitorID: "m", Epoch: uint64(i + 1), Seq: 1}
		for w := range workers {
			set.Free = append(set.Free, uint64(i*workers+w))
		}
		data, err := events.MarshalBusySet(&set)
		if err != nil {
			t.Fatal(err)
		}
		total += len(data)
		key := events.ModelKey(set.Model)
		m := nats.NewMsg("$KV." + events.BusyBucket + "." + key)
		m.Header.Set(headerEpoch, strconv.FormatUint(set.Epoch, 10))
		m.Header.Set(headerMonitor, "m")
		m.Data = data
		if _, err := js.PublishMsg(t.Context(), m); err != nil {
			t.Fatal(err)
		}
		if deleted && i%4 == 0 {
			d := nats.NewMsg(m.Subject)
			d.Header.Set(headerEpoch, strconv.FormatUint(set.Epoch+1000, 10))
			d.Header.Set(headerKVOp, "DEL")
			if _, err := js.PublishMsg(t.Context(), d); err != nil {
				t.Fatal(err)
			}
		}
	}
	return js, kv, nc, total
}

// TestRecordEpochsReadsHeadersOnly: the leaser's read of the records'
// epochs (the epoch of a partition it takes) lists the bucket's headers,
// not its records, and counts the delete markers' epochs: its work does not
// grow with the size of the records.
func TestRecordEpochsReadsHeadersOnly(t *testing.T) {
	t.Parallel()
	const parts, models = 8, 64
	js, kv, nc, total := scanBucket(t, models, 2000, true)
	cfg := DefaultLeaserConfig()
	cfg.JetStream, cfg.MonitorID, cfg.Partitions, cfg.Registerer = js, "scan", parts, prometheus.NewRegistry()
	cfg.OnAcquire = func(context.Context, int, uint64) {}
	cfg.OnRelease = func(context.Context, int) {}
	cfg.OnLose = func(int) {}
	l, err := NewLeaser(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l.busy = kv
	before := nc.Stats().InBytes
	top, err := l.recordEpochs(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	read := nc.Stats().InBytes - before
	t.Logf("read %d bytes for records of %d bytes in all", read, total)
	want := make([]uint64, parts)
	for i := range models {
		epoch := uint64(i + 1)
		if i%4 == 0 {
			epoch += 1000 // the marker's
		}
		p := events.Partition(fmt.Sprintf("org/scan-%d", i), parts)
		want[p] = max(want[p], epoch)
	}
	if fmt.Sprint(top) != fmt.Sprint(want) {
		t.Errorf("epochs %v, want %v", top, want)
	}
	if read > uint64(total/10) {
		t.Errorf("read %d bytes for records of %d bytes in all: more than their headers", read, total)
	}
}

// BenchmarkPartitionScan measures, on a bucket of 1,000 models of 100
// workers each (100,000 workers) split into 8 partitions, the leaser's
// read of the partitions' epochs and a takeover's read of one partition's
// records (its keys' headers listed, then each record read; or, with 2
// partitions or fewer, the bucket listed with its values), against a read
// of the whole bucket through the KV API (what both did before).
func BenchmarkPartitionScan(b *testing.B) {
	const parts = 8
	js, kv, nc, total := scanBucket(b, 1000, 100, false)
	b.Logf("bucket: 1000 records, %d bytes", total)
	ctx := context.Background()
	stream, err := bucketStream(ctx, js, kv, 5*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	run := func(b *testing.B, fn func() error) {
		before := nc.Stats().InBytes
		b.ResetTimer()
		for b.Loop() {
			if err := fn(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(nc.Stats().InBytes-before)/float64(b.N), "B-read/op")
	}
	b.Run("whole bucket", func(b *testing.B) {
		run(b, func() error {
			return kvbucket.ReadAll(ctx, kv, func(e jetstream.KeyValueEntry) { _, _ = RecordEpoch(e.Value()) })
		})
	})
	b.Run("epochs of every partition", func(b *testing.B) {
		run(b, func() error {
			_, err := partitionEpochs(ctx, js, kv, parts, nil, 5*time.Second)
			return err
		})
	})
	b.Run("one partition's records", func(b *testing.B) {
		run(b, func() error {
			heads, err := scanHeads(ctx, js, kv, parts, func(p int) bool { return p == 0 }, 5*time.Second)
			if err != nil {
				return err
			}
			fetchEach(ctx, kv, stream, heads, nil, 5*time.Second, func(*keyHead, *rawRecord, error) {})
			return nil
		})
	})
	b.Run("records listed with values", func(b *testing.B) {
		run(b, func() error {
			_, err := scanRecords(ctx, js, kv, parts, func(p int) bool { return p == 0 }, 5*time.Second)
			return err
		})
	})
}
