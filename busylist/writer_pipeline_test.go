package busylist_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// TestWriterWritesAtOnceWithoutRun: a Set of a key with no write in flight
// is written on the caller's goroutine: here Run's goroutine is held up in
// OnExisting (a partition's claim) while the record is written.
func TestWriterWritesAtOnceWithoutRun(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	writerPut(t, kv, writerSet("found", nil, []uint64{1}))
	release := make(chan struct{})
	entered := make(chan struct{})
	cfg := e.config()
	cfg.Leased = true
	cfg.OnExisting = func([]events.BusySet) {
		close(entered)
		<-release // Run's goroutine waits here
	}
	w := e.run(t, cfg)
	acquired := make(chan error, 1)
	go func() { acquired <- w.Acquire(context.WithoutCancel(t.Context()), 0, 3) }()
	select {
	case <-entered:
	case <-time.After(writerWait):
		t.Fatal("the claim did not reach OnExisting")
	}
	w.Set(writerSet("lone", []uint64{7}, nil))
	writerEventually(t, "lone written while Run is held up", func() bool {
		rec, _, ok := writerGet(t, kv, "lone")
		return ok && rec.Epoch == 3 && slices.Equal(rec.Busy, []uint64{7})
	})
	close(release)
	if err := <-acquired; err != nil {
		t.Fatal(err)
	}
}

// TestWriterPipelinesKeys: many versions of several keys given as fast as
// possible. A watcher of the bucket sees each key's versions in the order
// they were given, never an older one after a newer one, with seq rising,
// and the last version of every key in the end.
func TestWriterPipelinesKeys(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	w := e.run(t, e.config())
	kv := e.bucket(t, events.BusyBucket)
	watch, err := kv.WatchAll(t.Context(), jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Stop()
	const keys, versions = 8, 300
	for v := 1; v <= versions; v++ {
		for k := range keys {
			w.Set(writerSet(fmt.Sprintf("pipe-%d", k), []uint64{uint64(v)}, nil))
		}
	}
	last := map[string][2]uint64{} // version, seq
	done := 0
	timeout := time.After(writerWait)
	for done < keys {
		select {
		case entry := <-watch.Updates():
			if entry == nil {
				continue
			}
			rec, err := events.DecodeBusySet(entry.Value())
			if err != nil {
				t.Fatal(err)
			}
			v := rec.Busy[0]
			prev := last[rec.Model]
			if v <= prev[0] || rec.Seq <= prev[1] {
				t.Fatalf("%s: version %d seq %d after version %d seq %d", rec.Model, v, rec.Seq, prev[0], prev[1])
			}
			last[rec.Model] = [2]uint64{v, rec.Seq}
			if v == versions {
				done++
			}
		case <-timeout:
			t.Fatalf("last versions not all seen: %v", last)
		}
	}
	writes := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_change")
	t.Logf("%d versions of %d keys given, %v puts", versions, keys, writes)
}

// TestWriterBacksOffPerKey: a key whose writes keep failing (its record is
// larger than the bucket accepts) does not hold back the others, even with
// a retry delay of an hour: the backoff is the failing key's own.
func TestWriterBacksOffPerKey(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	kv, err := e.js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: events.BusyBucket, History: 1,
		MaxValueSize: 2048})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.RetryMin, cfg.RetryMax = time.Hour, time.Hour
	w := e.run(t, cfg)
	huge := writerSet("huge", nil, nil)
	huge.MonitorID = strings.Repeat("x", 4096)
	for i := range uint64(600) {
		huge.Free = append(huge.Free, 1_000_000+i)
	}
	w.Set(huge)
	writerEventually(t, "the huge record refused", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_errors_total", "kind", "put_change") >= 1
	})
	for v := range uint64(3) {
		w.Set(writerSet("small", []uint64{v}, nil))
		writerEventually(t, "small written beside the failing key", func() bool {
			rec, _, ok := writerGet(t, kv, "small")
			return ok && len(rec.Busy) == 1 && rec.Busy[0] == v
		})
	}
	if _, _, ok := writerGet(t, kv, "huge"); ok {
		t.Fatal("the huge record was written")
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_pending_records"); got != 1 {
		t.Errorf("pending records = %v, want 1 (huge)", got)
	}
}
