package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/sim"
)

// TestCordonUnderLoad: under steady streamed load on two workers, cordoning
// one stops new requests reaching it and, with the rescheduler's failover,
// moves its running streams to the other (the router continues them);
// uncordoning brings it back. No request is lost.
func TestCordonUnderLoad(t *testing.T) {
	t.Parallel()
	const model = "cordon/model"
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.adminToken = e2eToken
		o.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.98)}
		o.resched.interval = 200 * time.Millisecond
		o.resched.timeout = 150 * time.Millisecond
		o.resched.planner.Cooldown = 200 * time.Millisecond
	})
	cfg := sim.DefaultFleetConfig()
	cfg.Model, cfg.Workers, cfg.Ranks, cfg.BaseWorkerID, cfg.Host = model, 2, 1, 1, "127.0.0.1"
	cfg.Engine.KVBlocks, cfg.Engine.BlockSize = 256, 16
	cfg.Engine.PrefillSpeed, cfg.Engine.DecodeSpeed = 20000, 20 // 40 tokens: 2 s
	cfg.Publish.Heartbeat = 500 * time.Millisecond
	cfg.NATS.URL = svc.natsURL
	fleet, err := sim.NewFleet(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, fleet.Close)
	ro := defaultRouterOptions()
	ro.natsURL, ro.httpAddr = svc.natsURL, "127.0.0.1:0"
	ro.router.MigrationLimit = 4
	rt, err := startRouter(ro, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, rt.Close)
	natstest.WaitFor(t, 15*time.Second, "the router sees both workers", func() bool {
		return len(rt.registry.Endpoints(model)) == 2 && rt.watcher.Decide(model).Admit
	})

	ctx, stop := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var lost atomic.Int64
	var firstLost atomic.Pointer[string]
	body := fmt.Sprintf(`{"model":%q,"prompt":"hello","max_tokens":40,"stream":true}`, model)
	for range 6 {
		wg.Go(func() {
			for ctx.Err() == nil {
				if why := streamCompletion("http://"+rt.httpAddr, body); why != "" && ctx.Err() == nil {
					lost.Add(1)
					firstLost.CompareAndSwap(nil, &why)
				}
			}
		})
	}
	w2 := fleet.Worker(2)
	natstest.WaitFor(t, 10*time.Second, "load on worker 2", func() bool { return w2.Stats().InFlight > 0 })

	cordon := func(path string) {
		t.Helper()
		if code, _, b := call(t, svc, "POST", path, e2eToken, `{"model":"`+model+`","worker_id":2}`); code != 200 {
			t.Fatalf("%s: %d %s", path, code, b)
		}
	}
	cordon("/cordon")
	cordoned := time.Now()
	// Its streams move off (failover) and nothing new arrives.
	natstest.WaitFor(t, 10*time.Second, "worker 2 drained", func() bool { return w2.Stats().InFlight == 0 })
	t.Logf("worker 2 drained %v after the cordon (its streams last 2 s; %d migrated)",
		time.Since(cordoned).Round(10*time.Millisecond), w2.Stats().Migrated)
	if w2.Stats().Migrated == 0 {
		t.Error("no stream was moved off the cordoned worker")
	}
	served := w2.Stats().Served + w2.Stats().Cancelled
	time.Sleep(time.Second)
	if s := w2.Stats(); s.InFlight != 0 || s.Served+s.Cancelled != served {
		t.Errorf("the cordoned worker got requests: %+v", s)
	}
	code, _, b := call(t, svc, "GET", "/rescheduler", "", "")
	if code != 200 || !strings.Contains(string(b), `"reason":"failover"`) {
		t.Errorf("GET /rescheduler %d: no failover pair in %s", code, b)
	}

	cordon("/uncordon")
	natstest.WaitFor(t, 10*time.Second, "worker 2 serving again", func() bool { return w2.Stats().InFlight > 0 })
	stop()
	wg.Wait()
	if n := lost.Load(); n > 0 {
		t.Errorf("%d requests lost; the first: %s", n, *firstLost.Load())
	}
}
