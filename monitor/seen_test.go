package monitor

import (
	"context"
	"fmt"
	"testing"
	"testing/synctest"
	"time"
)

// TestThresholdsListsTrackedModelAfterSeenIsFull: Thresholds lists every
// model the monitor knows (see Known), the ones tracked now included: once
// maxSeenModels names had come and gone over the process's life, a model
// tracked after was Known yet missing from Thresholds (GET /thresholds,
// the SLO view), which walked only the names seen and the overrides.
func TestThresholdsListsTrackedModelAfterSeenIsFull(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startHarness(t, nil)
		n := 0
		for n < maxSeenModels {
			for i := 0; i < DefaultMaxModels/2 && n < maxSeenModels; i++ {
				r := h.report(1, 0, 1, 100)
				r.Model = fmt.Sprintf("old-%d", n)
				h.send(r)
				n++
			}
			time.Sleep(DefaultGoneAfter + DefaultStaleAfter + time.Second) // they go
			synctest.Wait()
		}
		r := h.report(1, 0, 1, 100)
		r.Model = "new-model"
		h.send(r)

		ctx := context.Background()
		known, err := h.m.Known(ctx, "new-model")
		if err != nil || !known {
			t.Fatalf("Known(new-model) = %v, %v; want true", known, err)
		}
		all, err := h.m.Thresholds(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := all["new-model"]; !ok {
			t.Errorf("Thresholds() lacks new-model, which is tracked and Known (%d models listed)", len(all))
		}
	})
}
