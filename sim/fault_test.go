package sim_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/sim"
)

// silence is how long a stopped worker must stay silent: several
// heartbeats.
const silence = 5 * testHeartbeat

// settleQuiet is the silence that marks the end of the messages already on
// their way when a worker stops. It is longer than a heartbeat, so a worker
// still reporting never settles.
const settleQuiet = 5 * testHeartbeat / 2

// expectSilence drains what was on its way, fails on a goodbye among it, and
// fails if anything arrives for silence afterwards.
func expectSilence(t *testing.T, in *inbox) {
	t.Helper()
	for _, m := range in.settle(t, settleQuiet) {
		if m.bye != nil {
			t.Fatalf("goodbye %+v; want none", *m.bye)
		}
	}
	if m, ok := in.next(t, silence); ok {
		t.Fatalf("message after the worker stopped: report %+v, goodbye %+v", m.report, m.bye)
	}
}

func TestKill(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	w := startWorker(t, workerConfig(e.srv))
	in.waitReport(t, "a first report", func(events.LoadReport) bool { return true })
	waitEntry(t, e, w)

	w.Kill()
	expectSilence(t, in)
	if _, err := http.Get(w.Endpoint() + "/health"); err == nil {
		t.Error("HTTP still answers after Kill")
	}
	// A crash leaves the registry entry to expire.
	if _, err := registryEntry(t, e, w); err != nil {
		t.Errorf("registry entry after Kill: %v", err)
	}
	if w.State() != sim.StateKilled || w.BootID() != 0 {
		t.Errorf("state %v, boot %d", w.State(), w.BootID())
	}
	if err := w.Close(t.Context()); err != nil {
		t.Errorf("Close after Kill: %v", err)
	}
	if err := w.Unmute(t.Context()); err == nil {
		t.Error("Unmute after Kill succeeded")
	}
}

func TestMuteKeepsServing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	w := startWorker(t, workerConfig(e.srv))
	first := in.waitReport(t, "a first report", func(events.LoadReport) bool { return true })

	w.Mute()
	expectSilence(t, in)
	if w.State() != sim.StateMuted || w.BootID() != 0 {
		t.Errorf("state %v, boot %d", w.State(), w.BootID())
	}
	if s, err := complete(t.Context(), w, "hello", 3); err != nil || s != http.StatusOK {
		t.Fatalf("muted worker: status %d, error %v", s, err)
	}
	if m, ok := in.next(t, silence); ok {
		t.Fatalf("muted worker reported its load: %+v", m.report)
	}

	if err := w.Unmute(t.Context()); err != nil {
		t.Fatalf("Unmute: %v", err)
	}
	back := in.waitReport(t, "a report after Unmute", func(events.LoadReport) bool { return true })
	if back.BootID == first.BootID || back.BootID != w.BootID() || back.KVTotalBlocks != first.KVTotalBlocks {
		t.Errorf("report after Unmute %+v; first %+v", back, first)
	}
	if w.State() != sim.StateRunning {
		t.Errorf("state %v after Unmute", w.State())
	}
	if err := w.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	if bye := in.waitBye(t); bye.BootID != back.BootID {
		t.Errorf("goodbye of boot %d; want %d", bye.BootID, back.BootID)
	}
}

func TestSkew(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := workerConfig(e.srv)
	cfg.Ranks = 2
	cfg.Engine.CapacitySkew = []float64{1, 0.5}
	cfg.Engine.SpeedSkew = []float64{1, 0.1}
	w := startWorker(t, cfg)
	s := w.Stats()
	if len(s.Ranks) != 2 || s.Ranks[0].KVTotalBlocks != sim.DefaultKVBlocks || s.Ranks[1].KVTotalBlocks != sim.DefaultKVBlocks/2 ||
		s.Ranks[1].MaxNumBatchedTokens != sim.DefaultMaxNumBatchedTokens/2 {
		t.Errorf("ranks %+v", s.Ranks)
	}
}

func TestFleet(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	cfg := sim.DefaultFleetConfig()
	cfg.BaseWorkerID = 10
	cfg.NATS.URL = e.srv.ClientURL()
	cfg.Publish.Heartbeat = testHeartbeat
	cfg.Engine.DecodeSpeed = 2000
	f, err := sim.NewFleet(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close(context.Background()) })

	ws := f.Workers()
	if len(ws) != 2 || ws[0].ID() != 10 || ws[1].ID() != 11 || ws[0].Endpoint() == ws[1].Endpoint() ||
		f.Worker(11) != ws[1] || f.Worker(12) != nil || f.Model() != sim.DefaultModel {
		t.Fatalf("workers %v", ws)
	}
	seen := map[[2]uint64]bool{}
	in.waitReport(t, "every rank of every worker", func(r events.LoadReport) bool {
		if r.DPSize != 2 {
			t.Errorf("report %+v", r)
		}
		seen[[2]uint64{r.WorkerID, uint64(r.DPRank)}] = true
		return len(seen) == 4
	})
	for _, w := range ws {
		if s, err := complete(t.Context(), w, "hello", 3); err != nil || s != http.StatusOK {
			t.Errorf("worker %d: status %d, error %v", w.ID(), s, err)
		}
		waitEntry(t, e, w)
	}
	waitUntil(t, "one request served by each", func() bool {
		for _, s := range f.Stats() {
			if s.Served != 1 || s.State != sim.StateRunning || len(s.Ranks) != 2 {
				return false
			}
		}
		return true
	})
	if err := f.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	byes := map[uint64]bool{}
	for len(byes) < 2 {
		byes[in.waitBye(t).WorkerID] = true
	}
	if !byes[10] || !byes[11] {
		t.Errorf("goodbyes from %v", byes)
	}
}
