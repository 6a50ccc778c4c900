package busylist_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
)

// TestWriterHeartbeatsWhileAnotherPartitionIsTaken: the records of a held
// partition keep their heartbeats while the writer is busy taking another
// partition over (here its claims' hand-over to the monitor is held up):
// a slow takeover never lets a healthy partition's records go stale.
func TestWriterHeartbeatsWhileAnotherPartitionIsTaken(t *testing.T) {
	t.Parallel()
	const parts = 2
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	model := func(p int) string {
		for i := 0; ; i++ {
			if m := fmt.Sprintf("org/hb-%d", i); events.Partition(m, parts) == p {
				return m
			}
		}
	}
	healthy, taken := model(1), model(0)
	found := writerSet(taken, []uint64{7}, nil)
	found.MonitorID, found.Epoch = "old-monitor", 1
	writerPut(t, kv, found)

	entered, unblock := make(chan struct{}), make(chan struct{})
	var once sync.Once
	cfg := e.config()
	cfg.Partitions, cfg.Leased, cfg.Heartbeat = parts, true, 100*time.Millisecond
	cfg.OnExisting = func(recs []events.BusySet) {
		if len(recs) > 0 && recs[0].Model == taken {
			close(entered)
			<-unblock // a takeover held up
		}
	}
	w := e.run(t, cfg)
	t.Cleanup(func() { once.Do(func() { close(unblock) }) }) // before Run is waited for
	if err := w.Acquire(t.Context(), 1, 2); err != nil {
		t.Fatal(err)
	}
	w.Set(writerSet(healthy, nil, []uint64{1}))
	writerEventually(t, "the healthy partition's record", func() bool {
		_, _, ok := writerGet(t, kv, healthy)
		return ok
	})
	go func() { _ = w.Acquire(t.Context(), 0, 2) }()
	select {
	case <-entered:
	case <-time.After(writerWait):
		t.Fatal("the takeover did not start")
	}
	_, rev, _ := writerGet(t, kv, healthy)
	writerEventually(t, "three heartbeats of the healthy partition during the takeover", func() bool {
		_, now, _ := writerGet(t, kv, healthy)
		return now >= rev+3
	})
	once.Do(func() { close(unblock) })
}
