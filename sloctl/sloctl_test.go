package sloctl_test

import (
	"context"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// fakeMonitor hands out the windows it is given and remembers the
// controlled thresholds.
type fakeMonitor struct {
	mu         sync.Mutex
	windows    map[string]*slo.Window
	controlled map[string]*slo.Thresholds
	base       events.Thresholds
	// rows are the ranks Loads returns, by model.
	rows map[string][]monitor.LoadRow
}

func (f *fakeMonitor) Loads(_ context.Context, model string) ([]monitor.LoadRow, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rows[model], nil
}

func (f *fakeMonitor) DrainLatency(context.Context) (map[string]*slo.Window, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := f.windows
	f.windows = map[string]*slo.Window{}
	return w, nil
}

func (f *fakeMonitor) SetControlled(_ context.Context, model string, t *slo.Thresholds) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t == nil {
		delete(f.controlled, model)
	} else {
		c := *t
		f.controlled[model] = &c
	}
	return nil
}

func (f *fakeMonitor) BaseThresholds(context.Context, string) (events.Thresholds, error) {
	return f.base, nil
}

// fakeStore keeps statuses with revisions, compare-and-set like the bucket.
type fakeStore struct {
	mu  sync.Mutex
	st  map[string]overrides.SLOStatus
	rev map[string]uint64
	seq uint64
}

func (f *fakeStore) Status(_ context.Context, model string) (overrides.SLOStatus, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.st[model], f.rev[model], nil
}

func (f *fakeStore) PutStatus(_ context.Context, st overrides.SLOStatus, rev uint64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.rev[st.Model] != rev {
		return 0, overrides.ErrStatusConflict
	}
	f.seq++
	f.st[st.Model], f.rev[st.Model] = st, f.seq
	return f.seq, nil
}

var (
	_ sloctl.Monitor = (*fakeMonitor)(nil)
	_ sloctl.Store   = (*fakeStore)(nil)
	_ sloctl.Store   = (*overrides.SLOStore)(nil)
	_ sloctl.Monitor = (*monitor.Monitor)(nil)
)

const model = "org/model"

type env struct {
	mon   *fakeMonitor
	store *fakeStore
	epoch uint64
	c     *sloctl.Controller
	reg   *prometheus.Registry
}

// newEnv returns a controller over fakes, "mon-a" at epoch e.epoch; each
// of with may change its configuration first.
func newEnv(t *testing.T, with ...func(e *env, cfg *sloctl.Config)) *env {
	t.Helper()
	e := &env{
		mon:   &fakeMonitor{windows: map[string]*slo.Window{}, controlled: map[string]*slo.Thresholds{}},
		store: &fakeStore{st: map[string]overrides.SLOStatus{}, rev: map[string]uint64{}},
		epoch: 1,
		reg:   prometheus.NewRegistry(),
	}
	cfg := sloctl.DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.MonitorID, cfg.Registerer = e.mon, e.store, "mon-a", e.reg
	cfg.Epoch = func(int) uint64 { return e.epoch }
	for _, f := range with {
		f(e, &cfg)
	}
	c, err := sloctl.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.c = c
	return e
}

// missing is a window whose ITL samples all miss a 50 ms target.
func missing() *slo.Window {
	var w slo.Window
	for range 100 {
		w.ITL.Observe(200)
	}
	return &w
}

func itl50(mode string) overrides.SLO {
	v := 50.0
	return overrides.SLO{Model: model, ITLms: &v, Percentile: 0.9, Mode: mode}
}

// TestEnforce: the first round starts from the effective thresholds
// clamped into the ranges (the top where unset), writes the status and
// applies; a missed target moves the thresholds down and is counted.
func TestEnforce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	e.mon.base = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
	if err := e.c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	e.c.Round(ctx)
	got := e.mon.controlled[model]
	if got == nil || got.Decode != 0.5 || got.Prefill != slo.DefaultPrefillMax {
		t.Fatalf("first round applied %+v, want decode 0.5, prefill the top", got)
	}
	st := e.store.st[model]
	if st.State != slo.StateNoData || st.Applied == nil || st.MonitorID != "mon-a" || st.Epoch != 1 {
		t.Fatalf("status %+v", st)
	}
	e.mon.windows[model] = missing()
	e.c.Round(ctx)
	if got := e.mon.controlled[model]; got.Decode >= 0.5 {
		t.Fatalf("after a miss: decode %v, want below 0.5", got.Decode)
	}
	if st := e.store.st[model]; st.State != slo.StateLowering || *st.Measured.ITLAttainment != 0 {
		t.Fatalf("status after a miss: %+v", st)
	}
	if n := testutil.ToFloat64(e.mustMoves(t, "down")); n != 1 {
		t.Errorf("moves down = %v, want 1", n)
	}
	// The families of §18 gathered, and clean by promtool's rules.
	if n, err := testutil.GatherAndCount(e.reg, "workermon_slo_threshold", "workermon_slo_attainment", "workermon_slo_moves_total"); err != nil || n != 6 {
		t.Errorf("gathered %d series of the slo families, want 6 (decode, prefill, kv_committed, queue_delay, itl, down): %v", n, err)
	}
	if problems, err := testutil.GatherAndLint(e.reg); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %v", problems, err)
	}
	// Deleted: the model goes back to its override and the defaults.
	if err := e.c.SetSLO(ctx, model, overrides.SLO{}, true); err != nil {
		t.Fatal(err)
	}
	if e.mon.controlled[model] != nil {
		t.Fatal("still controlled after the SLO was deleted")
	}
	if n, err := testutil.GatherAndCount(e.reg, "workermon_slo_threshold", "workermon_slo_attainment", "workermon_slo_moves_total"); err != nil || n != 0 {
		t.Errorf("gathered %d series of the slo families after the SLO was deleted, want none: %v", n, err)
	}
}

func (e *env) mustMoves(t *testing.T, dir string) prometheus.Collector {
	t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "workermon_slo_moves_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "direction" && l.GetValue() == dir {
					c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
					c.Add(m.GetCounter().GetValue())
					return c
				}
			}
		}
	}
	return prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
}

// TestShadow: suggested moves, nothing is applied.
func TestShadow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	if err := e.c.SetSLO(ctx, model, itl50(slo.ModeShadow), false); err != nil {
		t.Fatal(err)
	}
	e.mon.windows[model] = missing()
	e.c.Round(ctx)
	st := e.store.st[model]
	if st.Applied != nil || st.Suggested.Decode >= slo.DefaultDecodeMax || len(e.mon.controlled) != 0 {
		t.Fatalf("shadow: status %+v, controlled %v", st, e.mon.controlled)
	}
}

// TestTakeoverContinuesFromStatus: a new holder (a higher epoch) starts
// from the status in the bucket, not from the defaults; a status of a
// higher epoch than this monitor's is left alone; a lost lease gives the
// model back.
func TestTakeoverContinuesFromStatus(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	prev := slo.Status{State: slo.StateSteady, Suggested: slo.Thresholds{Decode: 0.55, Prefill: 8192}, Step: 0.02, Holds: 3}
	e.store.st[model] = overrides.SLOStatus{Model: model, State: prev.State, Suggested: prev.Suggested, Epoch: 1, MonitorID: "mon-old", Controller: prev}
	e.store.rev[model], e.store.seq = 7, 7
	e.epoch = 2
	if err := e.c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	e.c.Round(ctx)
	if got := e.mon.controlled[model]; got == nil || got.Decode != 0.55 || got.Prefill != 8192 {
		t.Fatalf("takeover applied %+v, want the status's 0.55 / 8192", got)
	}
	if st := e.store.st[model]; st.Epoch != 2 || st.MonitorID != "mon-a" {
		t.Fatalf("status after takeover: %+v", st)
	}

	// Another monitor takes over (epoch 3) and writes; this one, still
	// thinking it holds epoch 2, fails its compare-and-set and then leaves
	// the newer status alone.
	newer := e.store.st[model]
	newer.Epoch, newer.MonitorID = 3, "mon-b"
	e.store.seq++
	e.store.st[model], e.store.rev[model] = newer, e.store.seq
	e.c.Round(ctx)
	e.c.Round(ctx)
	if st := e.store.st[model]; st.MonitorID != "mon-b" {
		t.Fatalf("a stale holder overwrote the newer status: %+v", st)
	}

	// The lease is lost: the model goes back to the monitor's thresholds.
	e.epoch = 0
	e.c.Round(ctx)
	if e.mon.controlled[model] != nil {
		t.Fatal("still controlled after the lease was lost")
	}
}

// TestAdoptAppliesAtOnce: a monitor that comes to hold a model's partition
// applies the thresholds of its status at once (Adopt, between rounds),
// without moving them; it claims the status (its id and epoch, the rest as
// found) and writes nothing else.
func TestAdoptAppliesAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	prev := slo.Status{State: slo.StateSteady, Suggested: slo.Thresholds{Decode: 0.55, Prefill: 8192}, Step: 0.02}
	e.store.st[model] = overrides.SLOStatus{Model: model, Epoch: 1, MonitorID: "mon-old", Controller: prev,
		Applied: &prev.Suggested, Suggested: prev.Suggested}
	e.store.rev[model], e.store.seq = 3, 3
	e.epoch = 0
	if err := e.c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	e.c.Adopt(ctx)
	if len(e.mon.controlled) != 0 {
		t.Fatal("adopted a model of a partition not held")
	}
	e.epoch = 2
	e.c.Adopt(ctx)
	if got := e.mon.controlled[model]; got == nil || *got != prev.Suggested {
		t.Fatalf("adopted %+v, want %+v", got, prev.Suggested)
	}
	st := e.store.st[model]
	if e.store.rev[model] != 4 || st.Epoch != 2 || st.MonitorID != "mon-a" || st.Controller.Suggested != prev.Suggested {
		t.Errorf("after Adopt: status %+v at revision %d, want it claimed once (revision 4) as it was", st, e.store.rev[model])
	}
	e.c.Adopt(ctx)
	if e.store.rev[model] != 4 {
		t.Error("a second Adopt wrote the status again")
	}
}
