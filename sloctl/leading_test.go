package sloctl_test

import (
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

// rank is a row of the monitor's loads with the leading values the
// controller reads.
func rank(worker uint64, boot, preemptions uint64, delayMs float64, stale bool) monitor.LoadRow {
	r := monitor.LoadRow{Model: model, WorkerID: worker, Stale: stale,
		Sources: map[string]monitor.SourceLoad{events.SourceEngine: {BootID: boot}}}
	r.Preemptions = &preemptions
	if delayMs > 0 {
		r.QueueDelayMs = &delayMs
	}
	return r
}

// TestLeadingInputs: each round reads the monitor's view of the model's
// ranks (contract §21): the preemptions counted since the previous round
// (the first reading and a new boot set a baseline and count nothing; a
// stale rank counts nothing) move kv_committed down at once, and the largest
// predicted queue delay of the fresh ranks above the TTFT target moves
// queue_delay down, before any latency sample; the monitor gets all four
// thresholds and the status shows the inputs.
func TestLeadingInputs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	ttft := 1000.0
	if err := e.c.SetSLO(ctx, model, overrides.SLO{Model: model, TTFTms: &ttft, Percentile: 0.9, Mode: slo.ModeEnforce}, false); err != nil {
		t.Fatal(err)
	}
	round := func(rows ...monitor.LoadRow) (slo.Thresholds, overrides.SLOStatus) {
		t.Helper()
		e.mon.mu.Lock()
		e.mon.rows = map[string][]monitor.LoadRow{model: rows}
		e.mon.mu.Unlock()
		e.c.Round(ctx)
		got := e.mon.controlled[model]
		if got == nil {
			t.Fatal("nothing applied")
		}
		return *got, e.store.st[model]
	}

	// Baselines: 40 preemptions before the controller looked count nothing.
	got, st := round(rank(1, 7, 40, 200, false), rank(2, 8, 3, 0, false))
	if got.KVCommitted != slo.DefaultCommittedMax || got.QueueDelayMs != slo.DefaultDelayMax || st.Measured.Preemptions != 0 {
		t.Fatalf("first round: applied %+v, measured %+v; want the tops of the ranges and no preemption", got, st.Measured)
	}
	if d := st.Measured.QueueDelayMs; d == nil || *d != 200 {
		t.Fatalf("first round: measured queue delay %v, want 200", d)
	}

	// Two preemptions on worker 1; a new boot of worker 2 (its counter
	// from 0) and a stale rank count nothing; no TTFT sample at all.
	got, st = round(rank(1, 7, 42, 300, false), rank(2, 9, 5, 0, false), rank(3, 1, 90, 5000, true))
	if st.Measured.Preemptions != 2 {
		t.Fatalf("second round: measured %d preemptions, want 2", st.Measured.Preemptions)
	}
	if got.KVCommitted != slo.DefaultCommittedAnchor || got.QueueDelayMs != slo.DefaultDelayMax || st.State != slo.StateLowering {
		t.Fatalf("second round: applied %+v (%s), want kv_committed at %v and queue_delay kept", got, st.State, slo.DefaultCommittedAnchor)
	}

	// A predicted queue delay above the target (the largest of the fresh
	// ranks), no preemption.
	got, st = round(rank(1, 7, 42, 300, false), rank(2, 9, 5, 1500, false))
	if st.Measured.Preemptions != 0 || got.QueueDelayMs != uint64(slo.DefaultDelayAnchor*ttft) || got.KVCommitted != slo.DefaultCommittedAnchor {
		t.Fatalf("third round: applied %+v, measured %+v; want queue_delay at half the TTFT target", got, st.Measured)
	}
}
