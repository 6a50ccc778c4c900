package sloctl_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// failingMonitor fails SetControlled while fail is set, as the monitor
// does when the caller's ctx ends before it gets to the call.
type failingMonitor struct {
	*fakeMonitor
	fail atomic.Bool
}

func (f *failingMonitor) SetControlled(ctx context.Context, model string, t *slo.Thresholds) error {
	if f.fail.Load() {
		return context.DeadlineExceeded
	}
	return f.fakeMonitor.SetControlled(ctx, model, t)
}

// TestDeleteGivesBackLater: an SLO deleted while the monitor cannot take
// the thresholds back (the watcher's ctx ended waiting for a round) is
// given back by the controller later, not left in force for good.
func TestDeleteGivesBackLater(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	mon := &failingMonitor{fakeMonitor: e.mon}
	cfg := sloctl.DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.MonitorID = mon, e.store, "mon-a"
	cfg.Epoch = func(int) uint64 { return 1 }
	c, err := sloctl.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.c = c
	ctx := t.Context()
	if err := e.c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	e.mon.windows[model] = missing()
	e.c.Round(ctx)
	if e.mon.controlled[model] == nil {
		t.Fatal("the enforced SLO's thresholds were not applied")
	}
	mon.fail.Store(true)
	if err := e.c.SetSLO(ctx, model, itl50(slo.ModeEnforce), true); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("SetSLO while the monitor fails: %v", err)
	}
	mon.fail.Store(false)
	e.c.Adopt(ctx)
	if got := e.mon.controlled[model]; got != nil {
		t.Fatalf("a deleted SLO's thresholds %+v still apply after the next take-up", got)
	}
}
