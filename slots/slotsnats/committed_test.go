package slotsnats_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsnats"
)

// TestEstimatesCommitted: the requests that carry committed blocks (a
// router's, contract §21) put kv_committed_blocks in their worker's
// estimates, summed over tenants, and 0 once they ended, until the
// worker's goodbye; a worker whose requests carry none never has it.
func TestEstimatesCommitted(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t))
	nc, obs := natstest.Connect(t, srv), natstest.Connect(t, srv)
	reports := make(chan events.LoadReport, 1024)
	sub, err := obs.Subscribe("wm.est.>", func(m *nats.Msg) {
		if r, err := events.DecodeLoadReport(m.Data); err == nil {
			reports <- r
		}
	})
	must(t, err)
	defer sub.Unsubscribe()
	must(t, obs.Flush())

	tr := newTracker(t)
	must(t, tr.Register(slots.Worker{WorkerID: 9, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Register(slots.Worker{WorkerID: 9, Model: "m", Tenant: "t2", BlockSize: 16, DPSize: 1}))
	must(t, tr.Register(slots.Worker{WorkerID: 10, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Add(slots.Request{Model: "m", ID: "a", WorkerID: 9, NewISLTokens: 40, CommittedBlocks: 7, HasCommitted: true}))
	must(t, tr.Add(slots.Request{Model: "m", Tenant: "t2", ID: "b", WorkerID: 9, NewISLTokens: 2, CommittedBlocks: 3, HasCommitted: true}))
	must(t, tr.Add(slots.Request{Model: "m", ID: "c", WorkerID: 10, NewISLTokens: 5}))
	run(t, func(ctx context.Context) {
		cfg := slotsnats.DefaultEstimatesConfig()
		cfg.Conn, cfg.Tracker, cfg.ID, cfg.SubjectPrefix = nc, tr, "r1", "wm"
		cfg.Every, cfg.IdleLinger = 10*time.Millisecond, time.Hour
		if err := slotsnats.Estimates(ctx, cfg); err != nil {
			t.Errorf("Estimates: %v", err)
		}
	})
	next := func(what string, ok func(events.LoadReport) bool) events.LoadReport {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for {
			select {
			case r := <-reports:
				if r.WorkerID == 10 && r.KVCommittedBlocks.Set {
					t.Fatalf("worker 10's requests carry no committed blocks, yet %+v", r)
				}
				if ok(r) {
					return r
				}
			case <-deadline:
				t.Fatalf("no %s within 5s", what)
			}
		}
	}
	next("worker 9's committed blocks, 7 + 3", func(r events.LoadReport) bool {
		return r.WorkerID == 9 && r.KVCommittedBlocks == events.Some(10) && r.ActivePrefillTokens == events.Some(42)
	})
	// Prefill complete leaves the committed blocks; the end of a request
	// takes its own away.
	must(t, tr.PrefillComplete("m", "", "a"))
	must(t, tr.Free("m", "t2", "b"))
	next("worker 9 with request a only", func(r events.LoadReport) bool {
		return r.WorkerID == 9 && r.KVCommittedBlocks == events.Some(7) && r.ActivePrefillTokens == events.Some(0)
	})
	must(t, tr.Free("m", "", "a"))
	next("worker 9 at 0, said, not left standing", func(r events.LoadReport) bool {
		return r.WorkerID == 9 && r.KVCommittedBlocks == events.Some(0)
	})
	// Worker 10 is estimated (its prefill tokens) without the field.
	next("worker 10's estimate", func(r events.LoadReport) bool {
		return r.WorkerID == 10 && r.ActivePrefillTokens == events.Some(5)
	})
}
