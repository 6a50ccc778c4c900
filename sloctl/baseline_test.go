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

// churningStore is a fakeStore whose status keeps changing under every
// compare-and-set while churn is set.
type churningStore struct {
	*fakeStore
	churn atomic.Bool
}

func (f *churningStore) PutStatus(ctx context.Context, st overrides.SLOStatus, rev uint64) (uint64, error) {
	if f.churn.Load() {
		return 0, overrides.ErrStatusConflict
	}
	return f.fakeStore.PutStatus(ctx, st, rev)
}

// TestClaimGivenUp: a status that keeps changing through every attempt
// to claim it at a takeover (a new epoch) gives the model up: the
// thresholds the controller applied under the old epoch go back to the
// monitor instead of staying in force uncontrolled; once the status can
// be claimed, the model is taken up again.
func TestClaimGivenUp(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	store := &churningStore{fakeStore: e.store}
	var epoch atomic.Uint64
	epoch.Store(1)
	cfg := sloctl.DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.MonitorID, cfg.Registerer = e.mon, store, "mon-a", prometheus.NewRegistry()
	cfg.Epoch = func(int) uint64 { return epoch.Load() }
	c, err := sloctl.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	c.Round(ctx)
	if e.mon.controlled[model] == nil {
		t.Fatal("nothing applied under epoch 1")
	}
	epoch.Store(2)
	store.churn.Store(true)
	c.Round(ctx)
	if got := e.mon.controlled[model]; got != nil {
		t.Fatalf("thresholds %+v still in force after the claim was given up, want them given back", *got)
	}
	store.churn.Store(false)
	c.Round(ctx)
	if e.mon.controlled[model] == nil || e.store.st[model].Epoch != 2 {
		t.Fatalf("not taken up again under epoch 2 (status epoch %d)", e.store.st[model].Epoch)
	}
}
