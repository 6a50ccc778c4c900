package busylist_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
)

// fenceWriter is a leased writer of one partition for the fencing tests,
// with its own registry, remembering the partitions it gave up.
type fenceWriter struct {
	w    *busylist.Writer
	mu   sync.Mutex
	lost []int
}

func (f *fenceWriter) gaveUp() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.lost) > 0
}

func startFenceWriter(t *testing.T, e *writerEnv, id string, epoch uint64) *fenceWriter {
	t.Helper()
	f := &fenceWriter{}
	cfg := e.config()
	cfg.MonitorID, cfg.Leased, cfg.Partitions = id, true, 1
	cfg.Registerer = prometheus.NewRegistry()
	cfg.OnLost = func(p int) { f.mu.Lock(); f.lost = append(f.lost, p); f.mu.Unlock() }
	f.w = e.run(t, cfg)
	if err := f.w.Acquire(t.Context(), 0, epoch); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestWriterCreateFencedByMarker: a record the new holder deleted cannot be
// brought back by the old holder, at its lower epoch, whether the old
// holder's write is a put on the revision it last saw or a create of a key
// it never wrote (contract §10: a record's epoch never decreases). The
// delete marker carries the new holder's epoch; the old holder's write
// fails its compare-and-set, reads the marker and gives the partition up.
func TestWriterCreateFencedByMarker(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name     string
		oldWrote bool // the old holder had written the record (a put), or never (a create)
	}{
		{"put", true},
		{"create", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newWriterEnv(t)
			kv := e.bucket(t, events.BusyBucket)
			const model = "org/fenced"
			old := startFenceWriter(t, e, "old-monitor", 5)
			if tt.oldWrote {
				old.w.Set(writerSet(model, []uint64{1}, nil))
				writerEventually(t, "the old holder's record", func() bool {
					rec, _, ok := writerGet(t, kv, model)
					return ok && rec.Epoch == 5
				})
			}
			// The old holder pauses; the new one takes over, writes and
			// deletes the record.
			nw := startFenceWriter(t, e, "new-monitor", 6)
			nw.w.Set(writerSet(model, nil, []uint64{2}))
			writerEventually(t, "the new holder's record", func() bool {
				rec, _, ok := writerGet(t, kv, model)
				return ok && rec.Epoch == 6 && rec.MonitorID == "new-monitor"
			})
			nw.w.Delete(model)
			writerEventually(t, "the record deleted", func() bool {
				_, _, ok := writerGet(t, kv, model)
				return !ok
			})
			// The old holder resumes and writes.
			old.w.Set(writerSet(model, []uint64{3}, nil))
			writerEventually(t, "the old holder gives up or brings the record back", func() bool {
				_, _, ok := writerGet(t, kv, model)
				return ok || old.gaveUp()
			})
			if rec, _, ok := writerGet(t, kv, model); ok {
				t.Fatalf("the old holder brought the record back: epoch %d by %s", rec.Epoch, rec.MonitorID)
			}
			if !old.gaveUp() {
				t.Error("the old holder did not give the partition up")
			}
		})
	}
}

// TestWriterClaimsUndecodableRecords: a record that does not decode is
// claimed too (re-put as it is, under the new epoch), so that the old
// writer's compare-and-set on it fails.
func TestWriterClaimsUndecodableRecords(t *testing.T) {
	t.Parallel()
	wrongType, err := msgpack.Marshal(map[string]any{"v": 1, "model": "org/bad-1", "epoch": 3, "busy": "not a list"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		data []byte
	}{
		{"not msgpack", []byte{0xc1, 0x00}},
		{"wrong type", wrongType},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newWriterEnv(t)
			kv := e.bucket(t, events.BusyBucket)
			key := events.ModelKey("org/bad-1")
			rev, err := kv.Put(t.Context(), key, tt.data)
			if err != nil {
				t.Fatal(err)
			}
			f := startFenceWriter(t, e, "new-monitor", 5)
			if f.gaveUp() {
				t.Fatal("the partition was given up")
			}
			// The old writer's next put, on the revision it wrote.
			_, err = kv.Update(t.Context(), key, []byte("late"), rev)
			if !errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
				t.Fatalf("the old writer's compare-and-set: %v, want a revision mismatch", err)
			}
			en, err := kv.Get(t.Context(), key)
			if err != nil {
				t.Fatal(err)
			}
			if string(en.Value()) != string(tt.data) {
				t.Errorf("claimed as %x, want kept as found %x", en.Value(), tt.data)
			}
		})
	}
}

// TestWriterRefusesUsedEpoch: an epoch read before another holder used it
// (a pause between the read of the bucket and the take) is refused: a
// partition with a record of the claim's epoch, or of a higher one, is
// given up without claiming anything, and a writer that meets, while
// writing, a record of its own epoch by another monitor stops writing.
// Otherwise two holders would share one epoch, with seq reset within it.
func TestWriterRefusesUsedEpoch(t *testing.T) {
	t.Parallel()
	const model = "org/used-epoch"
	other := writerSet(model, []uint64{1}, nil)
	other.MonitorID, other.Epoch, other.Seq, other.UpdatedAt = "other-monitor", 6, 50, 1_800_000_000
	t.Run("at the claim", func(t *testing.T) {
		t.Parallel()
		e := newWriterEnv(t)
		kv := e.bucket(t, events.BusyBucket)
		writerPut(t, kv, other)
		f := startFenceWriter(t, e, "new-monitor", 6)
		if !f.gaveUp() {
			t.Error("the partition was not given up")
		}
		rec, _, ok := writerGet(t, kv, model)
		if !ok || rec.MonitorID != "other-monitor" || rec.Seq != 50 {
			t.Errorf("record %+v, want left as the other monitor wrote it", rec)
		}
	})
	t.Run("while writing", func(t *testing.T) {
		t.Parallel()
		e := newWriterEnv(t)
		kv := e.bucket(t, events.BusyBucket)
		f := startFenceWriter(t, e, "new-monitor", 6)
		f.w.Set(writerSet(model, nil, []uint64{2}))
		writerEventually(t, "the record written", func() bool {
			rec, _, ok := writerGet(t, kv, model)
			return ok && rec.MonitorID == "new-monitor"
		})
		writerPut(t, kv, other) // the other holder of epoch 6
		f.w.Set(writerSet(model, nil, []uint64{3}))
		writerEventually(t, "the writer gives up or overwrites", func() bool {
			rec, _, ok := writerGet(t, kv, model)
			return ok && rec.MonitorID == "new-monitor" || f.gaveUp()
		})
		if rec, _, _ := writerGet(t, kv, model); rec.MonitorID != "other-monitor" {
			t.Errorf("record by %s seq %d, want the other monitor's left", rec.MonitorID, rec.Seq)
		}
		if !f.gaveUp() {
			t.Error("the partition was not given up")
		}
	})
}

// TestWriterEpochAboveMarkers: without leases, a writer's epoch is above
// the delete markers' too: a monitor restarted after it deleted every
// record still writes (its creates meet markers of its former epoch).
func TestWriterEpochAboveMarkers(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	e.bucket(t, events.BusyBucket)
	const model = "org/deleted-before"
	m := nats.NewMsg("$KV." + events.BusyBucket + "." + events.ModelKey(model))
	m.Header.Set("KV-Operation", "DEL")
	m.Header.Set("Workermon-Epoch", "9")
	m.Header.Set("Workermon-Monitor-Id", "test-monitor")
	if _, err := e.js.PublishMsg(t.Context(), m); err != nil {
		t.Fatal(err)
	}
	w := e.run(t, e.config())
	if got := w.Epoch(); got != 10 {
		t.Errorf("epoch %d, want 10", got)
	}
	w.Set(writerSet(model, nil, []uint64{1}))
	kv := e.bucket(t, events.BusyBucket)
	writerEventually(t, "the record created over the marker", func() bool {
		rec, _, ok := writerGet(t, kv, model)
		return ok && rec.Epoch == 10
	})
}
