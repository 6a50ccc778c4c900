package sloctl_test

import (
	"testing"

	"github.com/workermon/workermon/slo"
)

// TestLateWriteOfOldHolderFails: a new holder claims the status at
// takeover (a compare-and-set re-put with its monitor_id and epoch, the
// controller's state kept), as the busy records are claimed (contract §10),
// so that a late write of the old holder (back from a stall it did not
// notice: a GC pause, SIGSTOP) fails instead of landing before the new
// holder's first round and making it drop its own state for the old
// holder's move.
func TestLateWriteOfOldHolderFails(t *testing.T) {
	t.Parallel()
	store, newController := bucketControllers(t)
	ctx := t.Context()
	epochA, epochB := uint64(1), uint64(2)
	a, monA := newController("mon-a", &epochA)
	for range 2 {
		monA.windows[model] = missing()
		a.Round(ctx)
	}
	before, _, err := store.Status(ctx, model)
	if err != nil || before.MonitorID != "mon-a" || before.Applied == nil {
		t.Fatalf("status after mon-a's rounds: %+v %v", before, err)
	}

	// mon-b takes the partition (epoch 2) and takes the model up.
	b, monB := newController("mon-b", &epochB)
	b.Adopt(ctx)
	claimed, _, err := store.Status(ctx, model)
	if err != nil || claimed.MonitorID != "mon-b" || claimed.Epoch != 2 {
		t.Fatalf("status after mon-b's take-up: %+v %v; want it claimed by mon-b under epoch 2", claimed, err)
	}
	if !sameState(claimed.Controller, before.Controller) || claimed.UpdatedAt != before.UpdatedAt {
		t.Errorf("the claim changed the controller's state or updated_at: %+v, was %+v", claimed, before)
	}

	// mon-a, stalled, still believes it holds epoch 1: its late write fails.
	monA.windows[model] = missing()
	a.Round(ctx)
	if st, _, _ := store.Status(ctx, model); st.MonitorID != "mon-b" || !sameState(st.Controller, before.Controller) {
		t.Fatalf("mon-a's late write landed over mon-b's claim: %+v", st)
	}
	// mon-b's first round moves from where it took the model up, and
	// writes: its compare-and-set holds.
	monB.windows[model] = missing()
	b.Round(ctx)
	st, _, _ := store.Status(ctx, model)
	if st.MonitorID != "mon-b" || st.Epoch != 2 || st.Suggested.Decode >= before.Suggested.Decode {
		t.Fatalf("status after mon-b's round: %+v; want mon-b's move down from %+v", st, before.Suggested)
	}
	if got := monB.controlled[model]; got == nil || *got != st.Suggested {
		t.Errorf("mon-b applies %+v, want its status's %+v", got, st.Suggested)
	}
	// mon-a reads the newer epoch and lets go.
	a.Round(ctx)
	if monA.controlled[model] != nil {
		t.Error("mon-a still applies thresholds of a model it no longer holds")
	}
}

// sameState compares the controller's state between moves (its Measured
// holds pointers).
func sameState(a, b slo.Status) bool {
	return a.State == b.State && a.Suggested == b.Suggested && a.Step == b.Step && a.Dir == b.Dir &&
		a.Holds == b.Holds && a.Streak == b.Streak && a.Attainment == b.Attainment && a.Ratio == b.Ratio
}
