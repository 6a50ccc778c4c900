package sloctl_test

import (
	"errors"
	"testing"

	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// TestMaxSLOs: the controller takes at most MaxSLOs models (each costs a
// status write every interval and metric series); one more is refused with
// ErrTooManySLOs, while a model it has may change, and a deleted one makes
// room.
func TestMaxSLOs(t *testing.T) {
	t.Parallel()
	var cfg sloctl.Config
	e := newEnv(t, func(_ *env, c *sloctl.Config) {
		c.MaxSLOs = 2
		cfg = *c
	})
	c := e.c
	ctx := t.Context()
	set := func(name, mode string) error {
		v := itl50(mode)
		v.Model = name
		return c.SetSLO(ctx, name, v, false)
	}
	for _, name := range []string{"a", "b"} {
		if err := set(name, slo.ModeEnforce); err != nil {
			t.Fatal(err)
		}
	}
	if err := set("c", slo.ModeEnforce); !errors.Is(err, overrides.ErrTooManySLOs) {
		t.Fatalf("a third SLO with MaxSLOs 2: %v, want ErrTooManySLOs", err)
	}
	if err := set("a", slo.ModeShadow); err != nil {
		t.Fatalf("changing a model's SLO at the cap: %v", err)
	}
	c.Round(ctx)
	if _, ok := e.store.st["c"]; ok {
		t.Error("the refused SLO is controlled")
	}
	if err := c.SetSLO(ctx, "b", overrides.SLO{}, true); err != nil {
		t.Fatal(err)
	}
	if err := set("c", slo.ModeEnforce); err != nil {
		t.Fatalf("an SLO after a delete made room: %v", err)
	}
	cfg.MaxSLOs = 0
	if _, err := sloctl.New(cfg); !errors.Is(err, sloctl.ErrInvalidConfig) {
		t.Errorf("MaxSLOs 0: %v, want ErrInvalidConfig", err)
	}
}
