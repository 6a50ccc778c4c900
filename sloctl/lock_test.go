package sloctl_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// slowStore is a fakeStore whose status writes wait until the test opens
// the gate, as a bucket that takes its time does.
type slowStore struct {
	*fakeStore
	entered chan struct{} // one send per write that waits
	gate    chan struct{}
}

func (s *slowStore) PutStatus(ctx context.Context, st overrides.SLOStatus, rev uint64) (uint64, error) {
	select {
	case s.entered <- struct{}{}:
	default:
	}
	select {
	case <-s.gate:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return s.fakeStore.PutStatus(ctx, st, rev)
}

// gatedMonitor is a fakeMonitor whose SetControlled waits for the gate.
type gatedMonitor struct {
	*fakeMonitor
	entered chan struct{}
	gate    chan struct{}
}

func (g *gatedMonitor) SetControlled(ctx context.Context, model string, t *slo.Thresholds) error {
	if t != nil {
		select {
		case g.entered <- struct{}{}:
		default:
		}
		<-g.gate
	}
	return g.fakeMonitor.SetControlled(ctx, model, t)
}

// failBound bounds the wait for a call that must not wait for the round:
// reached only when it does (the test then fails instead of hanging).
const failBound = 10 * time.Second

// call runs fn and returns its error, or fails the test when fn is still
// waiting after failBound.
func call(t *testing.T, what string, fn func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-time.After(failBound):
		t.Fatalf("%s still waits for the round after %v", what, failBound)
		return nil
	}
}

// TestSetSLONotBehindRoundIO: a round of 40 models whose status writes are
// slow does not keep SetSLO waiting (the API's POST /slo): the controller
// holds no lock across a bucket call. Before, a POST with a 100 ms deadline
// waited 2 s behind such a round.
func TestSetSLONotBehindRoundIO(t *testing.T) {
	t.Parallel()
	var store *slowStore
	c := newEnv(t, func(e *env, cfg *sloctl.Config) {
		store = &slowStore{fakeStore: e.store, entered: make(chan struct{}, 1), gate: make(chan struct{})}
		cfg.Store = store
	}).c
	ctx := t.Context()
	for i := range 40 {
		v := itl50(slo.ModeEnforce)
		v.Model = fmt.Sprintf("org/model-%d", i)
		if err := c.SetSLO(ctx, v.Model, v, false); err != nil {
			t.Fatal(err)
		}
	}
	round := make(chan struct{})
	go func() {
		defer close(round)
		c.Round(ctx)
	}()
	t.Cleanup(func() { <-round })
	defer close(store.gate)
	<-store.entered // the round waits in a status write

	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	v := itl50(slo.ModeShadow)
	if err := call(t, "SetSLO", func() error { return c.SetSLO(sctx, model, v, false) }); err != nil {
		t.Fatalf("SetSLO during a round's slow write: %v", err)
	}
	if err := call(t, "SetSLO (delete)", func() error { return c.SetSLO(sctx, "org/model-3", overrides.SLO{}, true) }); err != nil {
		t.Fatalf("SetSLO (delete) during a round's slow write: %v", err)
	}
}

// TestSetSLOHonoursContext: SetSLO that must wait for the round (which
// holds the controller while it hands thresholds to the monitor) gives up
// when its ctx ends.
func TestSetSLOHonoursContext(t *testing.T) {
	t.Parallel()
	var mon *gatedMonitor
	e := newEnv(t, func(e *env, cfg *sloctl.Config) {
		mon = &gatedMonitor{fakeMonitor: e.mon, entered: make(chan struct{}, 1), gate: make(chan struct{})}
		cfg.Monitor = mon
	})
	c := e.c
	ctx := t.Context()
	if err := c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	e.mon.windows[model] = missing()
	round := make(chan struct{})
	go func() {
		defer close(round)
		c.Round(ctx)
	}()
	t.Cleanup(func() { <-round })
	defer close(mon.gate)
	<-mon.entered // the round hands the thresholds to the monitor

	sctx, cancel := context.WithCancel(ctx)
	cancel()
	err := call(t, "SetSLO with an ended ctx", func() error { return c.SetSLO(sctx, model, overrides.SLO{}, true) })
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("SetSLO with an ended ctx: %v, want context.Canceled", err)
	}
}
