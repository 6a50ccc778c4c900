package busylist_test

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
)

var _ monitor.SaturationSink = (*busylist.Writer)(nil)

// nextPut returns the next record the watch delivers.
func nextPut(t *testing.T, watch jetstream.KeyWatcher, what string) events.BusySet {
	t.Helper()
	select {
	case entry := <-watch.Updates():
		rec, err := events.DecodeBusySet(entry.Value())
		if err != nil {
			t.Fatal(err)
		}
		return rec
	case <-time.After(writerWait):
		t.Fatalf("%s: no put seen", what)
	}
	return events.BusySet{}
}

// TestWriterSaturationAlone: a change of saturation alone, by
// SetSaturation or by a Set whose other content is unchanged, is not
// written on its own (contract §21): the next put, here a change of the
// lists, is the next thing the bucket sees, and it carries the value given
// with it.
func TestWriterSaturationAlone(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	w := e.run(t, e.config()) // heartbeat: an hour
	kv := e.bucket(t, events.BusyBucket)
	watch, err := kv.Watch(t.Context(), events.ModelKey("sat"), jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Stop()

	first := writerSet("sat", []uint64{1}, []uint64{2})
	first.Saturation = 0.5
	w.Set(first)
	if rec := nextPut(t, watch, "first"); rec.Saturation != 0.5 {
		t.Fatalf("first put: saturation %v, want 0.5", rec.Saturation)
	}
	w.SetSaturation("sat", 0.75)
	same := writerSet("sat", []uint64{1}, []uint64{2})
	same.Saturation = 0.8
	w.Set(same)
	w.SetSaturation("no/such-model", 3) // ignored
	changed := writerSet("sat", []uint64{1, 2}, nil)
	changed.Saturation = 1.5
	w.Set(changed)
	rec := nextPut(t, watch, "the change")
	if !slices.Equal(rec.Busy, []uint64{1, 2}) || rec.Saturation != 1.5 {
		t.Fatalf("next put %+v: want the change (busy [1 2], saturation 1.5), no put of saturation alone", rec)
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_heartbeat"); got != 0 {
		t.Errorf("heartbeats = %v, want 0", got)
	}
}

// TestWriterSaturationWithHeartbeat: the heartbeat after SetSaturation
// carries the new value; it is a heartbeat, not a change.
func TestWriterSaturationWithHeartbeat(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	cfg := e.config()
	cfg.Heartbeat = 100 * time.Millisecond
	w := e.run(t, cfg)
	kv := e.bucket(t, events.BusyBucket)
	watch, err := kv.Watch(t.Context(), events.ModelKey("sat"), jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Stop()
	w.Set(writerSet("sat", []uint64{1}, []uint64{2}))
	if rec := nextPut(t, watch, "first"); rec.Saturation != 0 {
		t.Fatalf("first put: saturation %v", rec.Saturation)
	}
	w.SetSaturation("sat", 2.25)
	for i := 0; ; i++ {
		rec := nextPut(t, watch, "a heartbeat with the saturation")
		if rec.Saturation == 2.25 {
			if !slices.Equal(rec.Busy, []uint64{1}) {
				t.Fatalf("heartbeat content %+v", rec)
			}
			break
		}
		if i > 2 {
			t.Fatalf("put %d still has saturation %v", i, rec.Saturation)
		}
	}
	writerEventually(t, "the heartbeat counted", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_heartbeat") >= 1
	})
	if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_change"); got != 1 {
		t.Errorf("changes written = %v, want 1 (the first)", got)
	}
}
