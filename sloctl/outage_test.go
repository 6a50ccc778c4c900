package sloctl_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// countingStore counts the calls that reach the SLO bucket.
type countingStore struct {
	*overrides.SLOStore
	calls atomic.Int64
}

func (s *countingStore) Status(ctx context.Context, model string) (overrides.SLOStatus, uint64, error) {
	s.calls.Add(1)
	return s.SLOStore.Status(ctx, model)
}

func (s *countingStore) PutStatus(ctx context.Context, st overrides.SLOStatus, rev uint64) (uint64, error) {
	s.calls.Add(1)
	return s.SLOStore.PutStatus(ctx, st, rev)
}

// TestRoundStopsWhileBucketAway: with NATS stopped, a round over many
// models makes one call to the bucket, not one per model (each would wait
// out the store's timeout under the lock SetSLO needs, so that with a few
// hundred models the watcher's changes would wait minutes); a take-up stops
// likewise. Once NATS is back, rounds write every model's status again.
func TestRoundStopsWhileBucketAway(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	scfg := overrides.DefaultSLOStoreConfig()
	scfg.JetStream, scfg.Timeout = js, 200*time.Millisecond
	inner, err := overrides.NewSLOStore(scfg)
	if err != nil {
		t.Fatal(err)
	}
	store := &countingStore{SLOStore: inner}
	mon := &fakeMonitor{windows: map[string]*slo.Window{}, controlled: map[string]*slo.Thresholds{}}
	cfg := sloctl.DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.MonitorID, cfg.Registerer = mon, store, "mon-a", prometheus.NewRegistry()
	cfg.Epoch = func(int) uint64 { return 1 }
	c, err := sloctl.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	const n = 20
	models := make([]string, n)
	for i := range models {
		models[i] = fmt.Sprintf("org/model-%d", i)
		if err := c.SetSLO(ctx, models[i], itl50(slo.ModeEnforce), false); err != nil {
			t.Fatal(err)
		}
	}
	revs := map[string]uint64{}
	natstest.WaitFor(t, 30*time.Second, "every status written", func() bool {
		c.Round(ctx)
		for _, m := range models {
			_, rev, err := inner.Status(ctx, m)
			if err != nil || rev == 0 {
				return false
			}
			revs[m] = rev
		}
		return true
	})

	opts = natstest.Stop(t, srv, opts)
	store.calls.Store(0)
	c.Round(ctx)
	if got := store.calls.Load(); got != 1 {
		t.Fatalf("a round with the bucket away made %d calls to it, want 1", got)
	}
	store.calls.Store(0)
	c.Adopt(ctx)
	if got := store.calls.Load(); got > 1 {
		t.Fatalf("a take-up with the bucket away made %d calls to it, want at most 1", got)
	}

	natstest.Start(t, opts)
	natstest.WaitFor(t, 30*time.Second, "every status written again after the outage", func() bool {
		c.Round(ctx)
		for _, m := range models {
			if _, rev, err := inner.Status(ctx, m); err != nil || rev <= revs[m] {
				return false
			}
		}
		return true
	})
}
