package sloctl_test

import (
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// TestTakeoverOverBucket: two monitors' controllers over one real
// workermon-slo bucket. The first lowers the thresholds under epoch 1; the
// second, taking the partition over with epoch 2, continues from the
// status it finds (same thresholds, same step), not from the defaults; the
// first, still believing it holds epoch 1, then leaves the model alone.
func TestTakeoverOverBucket(t *testing.T) {
	t.Parallel()
	store, newController := bucketControllers(t)
	ctx := t.Context()
	epochA, epochB := uint64(1), uint64(0)
	a, monA := newController("mon-a", &epochA)
	for range 3 {
		monA.windows[model] = missing()
		a.Round(ctx)
	}
	st, _, err := store.Status(ctx, model)
	if err != nil || st.MonitorID != "mon-a" || st.Applied == nil || st.Applied.Decode >= slo.DefaultDecodeMax {
		t.Fatalf("status after mon-a's rounds: %+v %v", st, err)
	}
	reached := *st.Applied

	// mon-a is cut off (it still believes it holds epoch 1); mon-b takes
	// the partition with epoch 2. A window that meets the target and
	// rejects nothing: mon-b holds where mon-a left the thresholds.
	epochB = 2
	b, monB := newController("mon-b", &epochB)
	var good slo.Window
	for range 100 {
		good.ITL.Observe(10)
	}
	monB.windows[model] = &good
	b.Round(ctx)
	if got := monB.controlled[model]; got == nil || *got != reached {
		t.Fatalf("mon-b applied %+v, want mon-a's %+v", got, reached)
	}
	st, _, _ = store.Status(ctx, model)
	if st.MonitorID != "mon-b" || st.Epoch != 2 || st.State != slo.StateSteady {
		t.Fatalf("status after the takeover: %+v", st)
	}
	monA.windows[model] = missing()
	a.Round(ctx) // its compare-and-set fails
	a.Round(ctx) // it reads epoch 2 and lets go
	if st, _, _ = store.Status(ctx, model); st.MonitorID != "mon-b" {
		t.Fatalf("mon-a overwrote mon-b's status: %+v", st)
	}
	if monA.controlled[model] != nil {
		t.Error("mon-a still applies thresholds of a model it no longer holds")
	}
}

// bucketControllers starts a server with a real workermon-slo bucket and
// returns its store and a maker of controllers over it: each with its own
// fake monitor, its monitor id, the epoch *epoch holds, and the model's
// ITL objective set in enforce mode.
func bucketControllers(t *testing.T) (*overrides.SLOStore, func(id string, epoch *uint64) (*sloctl.Controller, *fakeMonitor)) {
	t.Helper()
	srv := natstest.Start(t, natstest.Options(t))
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	scfg := overrides.DefaultSLOStoreConfig()
	scfg.JetStream = js
	store, err := overrides.NewSLOStore(scfg)
	if err != nil {
		t.Fatal(err)
	}
	return store, func(id string, epoch *uint64) (*sloctl.Controller, *fakeMonitor) {
		t.Helper()
		mon := &fakeMonitor{windows: map[string]*slo.Window{}, controlled: map[string]*slo.Thresholds{}}
		cfg := sloctl.DefaultConfig()
		cfg.Monitor, cfg.Store, cfg.MonitorID, cfg.Registerer = mon, store, id, prometheus.NewRegistry()
		cfg.Epoch = func(int) uint64 { return *epoch }
		c, err := sloctl.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.SetSLO(t.Context(), model, itl50(slo.ModeEnforce), false); err != nil {
			t.Fatal(err)
		}
		return c, mon
	}
}
