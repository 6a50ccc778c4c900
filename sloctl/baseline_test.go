package sloctl_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

var errBucketAway = errors.New("bucket away")

// failingStore is a fakeStore whose status writes fail while fail is set.
type failingStore struct {
	*fakeStore
	fail atomic.Bool
}

func (f *failingStore) PutStatus(ctx context.Context, st overrides.SLOStatus, rev uint64) (uint64, error) {
	if f.fail.Load() {
		return 0, errBucketAway
	}
	return f.fakeStore.PutStatus(ctx, st, rev)
}

// TestPreemptionsKeptWhileWriteFails: the preemptions of a round whose
// status write fails are not lost: the baseline moves only once a round's
// status lands, so the next round that lands counts them.
func TestPreemptionsKeptWhileWriteFails(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	store := &failingStore{fakeStore: e.store}
	cfg := sloctl.DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.MonitorID, cfg.Registerer = e.mon, store, "mon-a", prometheus.NewRegistry()
	cfg.Epoch = func(int) uint64 { return 1 }
	c, err := sloctl.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	ttft := 1000.0
	if err := c.SetSLO(ctx, model, overrides.SLO{Model: model, TTFTms: &ttft, Percentile: 0.9, Mode: slo.ModeEnforce}, false); err != nil {
		t.Fatal(err)
	}
	round := func(preemptions uint64) {
		e.mon.mu.Lock()
		e.mon.rows = map[string][]monitor.LoadRow{model: {rank(1, 7, preemptions, 0, false)}}
		e.mon.mu.Unlock()
		c.Round(ctx)
	}
	round(40) // the baseline
	store.fail.Store(true)
	round(43) // 3 preemptions, the write fails
	store.fail.Store(false)
	round(43)
	if got := e.store.st[model].Measured.Preemptions; got != 3 {
		t.Fatalf("measured %d preemptions once the write landed, want the 3 of the failed round", got)
	}
}
