package overrides_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

func sloStore(t *testing.T, e *testEnv) *overrides.SLOStore {
	t.Helper()
	cfg := overrides.DefaultSLOStoreConfig()
	cfg.JetStream = e.js
	s, err := overrides.NewSLOStore(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func ptr(v float64) *float64 { return &v }

// TestSLOStore: put, get, list, status by compare-and-set, delete (with
// its status).
func TestSLOStore(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	s := sloStore(t, e)
	v := overrides.SLO{Model: "org/m-1.5", ITLms: ptr(50), Percentile: 0.9, Mode: slo.ModeEnforce, UpdatedAt: 1}
	if err := s.Put(ctx, v); err != nil {
		t.Fatal(err)
	}
	got, ok, err := s.Get(ctx, v.Model)
	if err != nil || !ok || *got.ITLms != 50 || got.TTFTms != nil || !got.Enforced() {
		t.Fatalf("Get = %+v %v %v", got, ok, err)
	}
	if err := s.Put(ctx, overrides.SLO{Model: "x", Percentile: 0.9, Mode: "enforce"}); !errors.Is(err, slo.ErrInvalidTarget) {
		t.Errorf("SLO without a target: %v", err)
	}
	if err := s.Put(ctx, overrides.SLO{Model: "x", ITLms: ptr(5), Percentile: 0.9, Mode: "loud"}); !errors.Is(err, slo.ErrInvalidTarget) {
		t.Errorf("bad mode: %v", err)
	}

	st := overrides.SLOStatus{Model: v.Model, State: slo.StateSteady, Epoch: 3}
	rev, err := s.PutStatus(ctx, st, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.PutStatus(ctx, st, 0); !errors.Is(err, overrides.ErrStatusConflict) {
		t.Errorf("create over an existing status: %v", err)
	}
	if _, err := s.PutStatus(ctx, st, rev+5); !errors.Is(err, overrides.ErrStatusConflict) {
		t.Errorf("update on a wrong revision: %v", err)
	}
	back, brev, err := s.Status(ctx, v.Model)
	if err != nil || brev != rev || back.Epoch != 3 || back.State != slo.StateSteady {
		t.Fatalf("Status = %+v %d %v", back, brev, err)
	}
	slos, statuses, err := s.List(ctx)
	if err != nil || len(slos) != 1 || len(statuses) != 1 {
		t.Fatalf("List = %v %v %v", slos, statuses, err)
	}
	if err := s.Delete(ctx, v.Model); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := s.Get(ctx, v.Model); ok {
		t.Error("SLO still there after Delete")
	}
	if _, rev, _ := s.Status(ctx, v.Model); rev != 0 {
		t.Error("status still there after Delete")
	}
}

// TestSLOUnderAnotherKey: an SLO or a status stored under another model's
// key (by anybody but the store) is refused, as a cordon is, not taken
// for that model's.
func TestSLOUnderAnotherKey(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	s := sloStore(t, e)
	if err := s.Put(ctx, overrides.SLO{Model: "c", ITLms: ptr(50), Percentile: 0.9, Mode: slo.ModeEnforce}); err != nil {
		t.Fatal(err) // creates the bucket
	}
	kv, err := e.js.KeyValue(ctx, overrides.SLOBucket)
	if err != nil {
		t.Fatal(err)
	}
	put := func(key, value string) {
		t.Helper()
		if _, err := kv.Put(ctx, key, []byte(value)); err != nil {
			t.Fatal(err)
		}
	}
	put(events.ModelKey("b"), `{"model":"a","itl_ms":50,"percentile":0.9,"mode":"enforce"}`)
	put(events.ModelKey("b")+".status", `{"model":"a","state":"steady","epoch":1}`)
	if _, ok, err := s.Get(ctx, "b"); ok || !errors.Is(err, overrides.ErrBadSLO) {
		t.Errorf("Get(b) of a's SLO: ok %v, err %v; want ErrBadSLO", ok, err)
	}
	if _, _, err := s.Status(ctx, "b"); !errors.Is(err, overrides.ErrBadSLO) {
		t.Errorf("Status(b) of a's status: %v, want ErrBadSLO", err)
	}
	if slos, statuses, err := s.List(ctx); err != nil || len(slos) != 1 || len(statuses) != 0 {
		t.Errorf("List = %v %v %v, want c's SLO alone", slos, statuses, err)
	}
}

// TestSLOWatcher: SLO puts and deletes reach OnChange; status writes do not.
func TestSLOWatcher(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	s := sloStore(t, e)
	type change struct {
		model   string
		mode    string
		deleted bool
	}
	changes := make(chan change, 16)
	cfg := overrides.DefaultSLOWatcherConfig()
	cfg.JetStream, cfg.Registerer = e.js, e.reg
	cfg.OnChange = func(model string, v overrides.SLO, deleted bool) { changes <- change{model, v.Mode, deleted} }
	w, err := overrides.NewSLOWatcher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(wctx) }()
	t.Cleanup(func() { cancel(); <-done })
	expect := func(want change) {
		t.Helper()
		select {
		case c := <-changes:
			if c != want {
				t.Fatalf("change %+v, want %+v", c, want)
			}
		case <-time.After(testWait):
			t.Fatalf("no change, want %+v", want)
		}
	}
	if err := s.Put(ctx, overrides.SLO{Model: "m", TTFTms: ptr(500), Percentile: 0.9, Mode: slo.ModeShadow}); err != nil {
		t.Fatal(err)
	}
	expect(change{"m", slo.ModeShadow, false})
	if _, err := s.PutStatus(ctx, overrides.SLOStatus{Model: "m"}, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "m"); err != nil {
		t.Fatal(err)
	}
	expect(change{"m", "", true})
	select {
	case c := <-changes:
		t.Fatalf("unexpected change %+v (a status is not an SLO)", c)
	default:
	}
}
