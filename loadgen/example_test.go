package loadgen_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/workermon/workermon/loadgen"
)

// Load that ramps from 1 to 60 requests per second and back every minute,
// against the router at its default address, for five minutes.
func ExampleGenerator_Run() {
	cfg := loadgen.DefaultConfig()
	cfg.Profile = loadgen.ProfileTriangle
	cfg.MinRPS, cfg.MaxRPS, cfg.Period = 1, 60, time.Minute
	g, err := loadgen.New(cfg, nil)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Run(ctx)
	}()

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
			s := g.Stats()
			w := s.Window
			fmt.Printf("target %.0f rps, sent %.1f rps: %d ok, %d 503, %d errors, p50 %v p99 %v\n",
				s.TargetRPS, w.RPS(), w.OK, w.Unavailable, w.Errors, w.Latency.P50, w.Latency.P99)
		}
	}
}
