package busylist_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
)

// TestWriterAcquireClaims: taking a partition over claims every one of its
// records (the claims are in flight together): each is re-put with this
// writer's monitor_id, the new epoch, seq 1 and updated_at kept, and handed
// to OnExisting, without the old writer's routers' queues (contract §22:
// a new writer writes queued_by only from reports it received itself); the
// other partition's records are left alone. A record
// with a higher epoch makes the writer give the partition up (OnLost).
func TestWriterAcquireClaims(t *testing.T) {
	t.Parallel()
	const (
		parts  = 2
		models = 300
		epoch  = 7
	)
	tests := []struct {
		name   string
		higher bool // one record of partition 0 has an epoch above the claim's
	}{
		{"claimed", false},
		{"higher epoch found", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newWriterEnv(t)
			kv := e.bucket(t, events.BusyBucket)
			updated := time.Unix(1_800_000_000, 0).UnixNano()
			revs := map[string]uint64{}
			var inP0 []string
			for i := range models {
				rec := writerSet(fmt.Sprintf("org/claim-%d", i), []uint64{uint64(i)}, nil)
				rec.MonitorID, rec.Epoch, rec.Seq, rec.UpdatedAt = "old-monitor", epoch-1, 50, updated
				rec.QueuedBy, rec.Queued = map[string]map[int64]uint64{"router/x": {0: 2}}, map[int64]uint64{0: 2}
				if events.Partition(rec.Model, parts) == 0 {
					if tt.higher && len(inP0) == models/4 {
						rec.Epoch = epoch + 2
					}
					inP0 = append(inP0, rec.Model)
				}
				revs[rec.Model] = writerPut(t, kv, rec)
			}
			var mu sync.Mutex
			var existing []events.BusySet
			var lost []int
			cfg := e.config()
			cfg.Partitions, cfg.Leased = parts, true
			cfg.Warmup = time.Hour // no write but the claims
			cfg.OnExisting = func(r []events.BusySet) { mu.Lock(); existing = append(existing, r...); mu.Unlock() }
			cfg.OnLost = func(p int) { mu.Lock(); lost = append(lost, p); mu.Unlock() }
			w := e.run(t, cfg)
			if err := w.Acquire(t.Context(), 0, epoch); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			if tt.higher {
				if len(lost) != 1 || lost[0] != 0 || len(existing) != 0 {
					t.Errorf("with a higher epoch in the partition: lost %v, existing %d; want lost [0], none", lost, len(existing))
				}
				return
			}
			if len(lost) != 0 || len(existing) != len(inP0) {
				t.Errorf("lost %v, %d records handed over; want none lost, %d", lost, len(existing), len(inP0))
			}
			for model, rev := range revs {
				rec, now, ok := writerGet(t, kv, model)
				if !ok {
					t.Fatalf("%s: record gone", model)
				}
				if events.Partition(model, parts) != 0 {
					if now != rev {
						t.Errorf("%s of partition 1 rewritten", model)
					}
					continue
				}
				if rec.MonitorID != "test-monitor" || rec.Epoch != epoch || rec.Seq != 1 || rec.UpdatedAt != updated {
					t.Errorf("%s claimed as %s epoch %d seq %d updated_at %d", model, rec.MonitorID, rec.Epoch, rec.Seq, rec.UpdatedAt)
				}
				if len(rec.QueuedBy) != 0 || len(rec.Queued) != 0 {
					t.Errorf("%s claimed with the old writer's queues: queued_by %v, queued %v", model, rec.QueuedBy, rec.Queued)
				}
			}
			if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "claim"); int(got) != len(inP0) {
				t.Errorf("claims counted %v, want %d", got, len(inP0))
			}
		})
	}
}

// TestWriterAcquireReadsOnlyItsPartition: taking a partition over reads
// the values of that partition's records only (the bucket's keys are
// listed by their headers), so that its work is bounded by the partition,
// not by the bucket.
func TestWriterAcquireReadsOnlyItsPartition(t *testing.T) {
	t.Parallel()
	const parts, models, workers = 8, 64, 2000
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	total, mine := 0, 0
	for i := range models {
		rec := writerSet(fmt.Sprintf("org/big-%d", i), nil, nil)
		for w := range workers {
			rec.Free = append(rec.Free, uint64(i*workers+w))
		}
		rec.MonitorID, rec.Epoch, rec.Seq = "old-monitor", 1, 1
		data, err := events.MarshalBusySet(&rec)
		if err != nil {
			t.Fatal(err)
		}
		total += len(data)
		if events.Partition(rec.Model, parts) == 0 {
			mine += len(data)
		}
		writerPut(t, kv, rec)
	}
	cfg := e.config()
	cfg.Partitions, cfg.Leased, cfg.Warmup = parts, true, time.Hour
	w := e.run(t, cfg)
	before := e.nc.Stats().InBytes
	if err := w.Acquire(t.Context(), 0, 2); err != nil {
		t.Fatal(err)
	}
	read := int(e.nc.Stats().InBytes - before)
	t.Logf("read %d bytes to claim a partition of %d bytes (the bucket: %d)", read, mine, total)
	if read > mine+total/8 {
		t.Errorf("read %d bytes to claim a partition of %d bytes (the bucket: %d)", read, mine, total)
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "claim"); got == 0 {
		t.Error("nothing claimed")
	}
}
