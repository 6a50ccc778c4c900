package overrides_test

import (
	"errors"
	"testing"

	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

// TestSLOStoreMax: the bucket holds at most Max SLOs (statuses not
// counted); a new one beyond is refused with ErrTooManySLOs, while an SLO
// it holds may be replaced, and a delete makes room.
func TestSLOStoreMax(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	cfg := overrides.DefaultSLOStoreConfig()
	cfg.JetStream, cfg.Max = e.js, 2
	s, err := overrides.NewSLOStore(cfg)
	if err != nil {
		t.Fatal(err)
	}
	put := func(model string, itl float64) error {
		return s.Put(ctx, overrides.SLO{Model: model, ITLms: ptr(itl), Percentile: 0.9, Mode: slo.ModeEnforce})
	}
	for _, m := range []string{"a", "b"} {
		if err := put(m, 50); err != nil {
			t.Fatal(err)
		}
		if _, err := s.PutStatus(ctx, overrides.SLOStatus{Model: m}, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := put("c", 50); !errors.Is(err, overrides.ErrTooManySLOs) {
		t.Fatalf("a third SLO with Max 2: %v, want ErrTooManySLOs", err)
	}
	if err := put("a", 80); err != nil {
		t.Fatalf("replacing an SLO at the cap: %v", err)
	}
	if err := s.Delete(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if err := put("c", 50); err != nil {
		t.Fatalf("an SLO after a delete made room: %v", err)
	}
	cfg.Max = 0
	if _, err := overrides.NewSLOStore(cfg); err == nil {
		t.Error("Max 0 accepted")
	}
}
