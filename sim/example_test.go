package sim_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os/signal"
	"syscall"
	"time"

	"github.com/workermon/workermon/sim"
)

// A fleet of two workers of two ranks each, reporting to the NATS server at
// the default address until Ctrl-C, printing a summary every second.
func ExampleNewFleet() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	cfg := sim.DefaultFleetConfig()
	cfg.Engine.CapacitySkew = []float64{1, 0.5} // rank 1 has half the KV cache
	f, err := sim.NewFleet(ctx, cfg, slog.Default())
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		// ctx is cancelled by now: give Close a fresh, bounded one.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = f.Close(cctx)
	}()

	f.Workers()[1].Mute() // goes stale in the monitor, keeps serving

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			for _, s := range f.Stats() {
				fmt.Printf("worker %d %s at %s: %d served, %d in flight\n",
					s.WorkerID, s.State, s.Endpoint, s.Served, s.InFlight)
				for _, r := range s.Ranks {
					fmt.Printf("  rank %d: %d/%d blocks, %d prefill tokens, %d waiting\n",
						r.Rank, r.ActiveDecodeBlocks, r.KVTotalBlocks, r.ActivePrefillTokens, r.Waiting)
				}
			}
		}
	}
}
