package sloctl_test

import (
	"testing"
	"time"

	"github.com/workermon/workermon/slo"
	"github.com/workermon/workermon/sloctl"
)

// itlWindow is a window of n ITL samples of ms milliseconds.
func itlWindow(n int, ms float64) *slo.Window {
	var w slo.Window
	for range n {
		w.ITL.Observe(ms)
	}
	return &w
}

// TestObserved: every model's windows, with an SLO or without, count
// towards the best latency its fleet has shown; the best stays when worse
// windows follow, and a model not heard for a day is forgotten.
func TestObserved(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_700_000_000, 0)
	e := newEnv(t, func(_ *env, cfg *sloctl.Config) { cfg.Now = func() time.Time { return now } })
	mon, c := e.mon, e.c
	ctx := t.Context()
	if err := c.SetSLO(ctx, model, itl50(slo.ModeEnforce), false); err != nil {
		t.Fatal(err)
	}
	const other = "org/no-slo"
	round := func(ws map[string]*slo.Window) {
		mon.mu.Lock()
		mon.windows = ws
		mon.mu.Unlock()
		c.Round(ctx)
	}
	p90 := func(m string) (float64, bool) {
		o, ok := c.Observed(m)
		ms, _, found := o.ITL.Floor(0.9)
		return ms, ok && found
	}

	if _, ok := c.Observed(model); ok {
		t.Fatal("observed latency before any window")
	}
	round(map[string]*slo.Window{model: itlWindow(100, 60), other: itlWindow(100, 40)})
	round(map[string]*slo.Window{model: itlWindow(100, 200), other: itlWindow(10, 5)}) // worse; too few to judge
	for _, tc := range []struct {
		model string
		want  float64
	}{{model, 60}, {other, 40}} {
		got, ok := p90(tc.model)
		if !ok || got < tc.want*0.91 || got > tc.want*1.1 {
			t.Errorf("%s: best ITL p90 %v (%v), want about %v", tc.model, got, ok, tc.want)
		}
	}
	if o, _ := c.Observed(model); o.Windows != 2 {
		t.Errorf("windows %d, want 2", o.Windows)
	}

	now = now.Add(25 * time.Hour)
	round(map[string]*slo.Window{model: itlWindow(100, 70)})
	if _, ok := c.Observed(other); ok {
		t.Errorf("%s not heard for 25 h is still observed", other)
	}
	if got, ok := p90(model); !ok || got > 66 {
		t.Errorf("%s: best ITL p90 %v (%v), want the 60 ms of the first window", model, got, ok)
	}
}
