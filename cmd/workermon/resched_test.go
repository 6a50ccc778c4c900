package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/sim"
)

// loopResult is one run of the closed loop.
type loopResult struct {
	spread    float64       // time-averaged max − min of the workers' KV usage
	p99       time.Duration // of the requests' end-to-end latency
	requests  int
	lost      int // not answered 200 with a complete stream
	migrated  float64
	samples   int
	slowShare float64 // of the slow worker's KV usage over the fleet's mean
}

// TestReschedulerClosedLoop runs the same load against the same fleet —
// two workers and one six to seven times slower — once with the
// rescheduler off and once on: with it on, the time-averaged spread of KV
// usage across the workers falls by at least 20 % (55–75 % on an idle
// 2-core machine, 36–68 % with both cores hogged: docs/rescheduler.md),
// and no request is lost (every cut stream is continued by the router's
// migration).
func TestReschedulerClosedLoop(t *testing.T) {
	off := runClosedLoop(t, loopOptions{})
	on := runClosedLoop(t, loopOptions{reschedule: true})
	t.Logf("rescheduler off: spread %.3f, p99 %v, %d requests, %d lost, %d samples", off.spread, off.p99, off.requests, off.lost, off.samples)
	t.Logf("rescheduler on:  spread %.3f, p99 %v, %d requests, %d lost, %g migrated (spread %.0f %% lower)",
		on.spread, on.p99, on.requests, on.lost, on.migrated, 100*(1-on.spread/off.spread))
	if off.lost > 0 || on.lost > 0 {
		t.Errorf("requests lost: %d with the rescheduler off, %d on", off.lost, on.lost)
	}
	if on.migrated == 0 {
		t.Error("the rescheduler migrated nothing")
	}
	if off.migrated != 0 {
		t.Errorf("%g requests migrated with the rescheduler off", off.migrated)
	}
	// We aim at 30 % lower and most runs give 36–75 %; on a shared 2-core
	// machine the baseline itself varies (spread off 0.105–0.25), and one
	// run under the whole -race suite gave 22 %: the gate is 20 %
	// (docs/rescheduler.md has the runs).
	if on.spread > 0.8*off.spread {
		t.Errorf("spread %.3f with the rescheduler, %.3f without: want at least 20 %% lower", on.spread, off.spread)
	}
}

// loopOptions vary the closed loop.
type loopOptions struct {
	reschedule bool
	pick       string // the router's --pick; "" for the default
	tokenIDs   bool   // prompts of token ids instead of text
}

func runClosedLoop(t testing.TB, lo loopOptions) loopResult {
	t.Helper()
	const (
		model    = "loop/model"
		clients  = 9
		duration = 12 * time.Second
		warmup   = 2 * time.Second
	)
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.98)}
		if lo.reschedule {
			o.resched.interval = 250 * time.Millisecond
			o.resched.timeout = 200 * time.Millisecond
			o.resched.planner.MaxRequests = 1
			o.resched.planner.Cooldown = 500 * time.Millisecond
			o.resched.planner.BalanceGap = 0.05
		}
	})
	engine := sim.DefaultEngineConfig()
	engine.KVBlocks, engine.BlockSize = 96, 16
	engine.PrefillSpeed, engine.DecodeSpeed = 20000, 40
	startFleet := func(base uint64, workers int, speed float64) *sim.Fleet {
		cfg := sim.DefaultFleetConfig()
		cfg.Model, cfg.Workers, cfg.Ranks, cfg.BaseWorkerID = model, workers, 1, base
		cfg.Host = "127.0.0.1"
		cfg.Engine = engine
		cfg.Engine.SpeedSkew = []float64{speed}
		cfg.Publish.Heartbeat = 500 * time.Millisecond
		cfg.NATS.URL = svc.natsURL
		f, err := sim.NewFleet(t.Context(), cfg, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		closeAtCleanup(t, f.Close)
		return f
	}
	fleets := []*sim.Fleet{startFleet(1, 2, 1), startFleet(3, 1, 0.15)}
	ro := defaultRouterOptions()
	ro.natsURL, ro.httpAddr = svc.natsURL, "127.0.0.1:0"
	ro.router.MigrationLimit = 8
	if lo.pick != "" {
		ro.pick = lo.pick
	}
	rt, err := startRouter(ro, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, rt.Close)
	base := "http://" + rt.httpAddr

	// Wait until the router routes to all three.
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":60,"stream":true}`, model, strings.Repeat("tok ", 100))
	if lo.tokenIDs {
		// The same 100 token ids in every request (as a shared system
		// prompt would be): the tracker counts their blocks in the
		// workers' block size, once per rank.
		ids := make([]string, 100)
		for i := range ids {
			ids[i] = strconv.Itoa(i)
		}
		body = fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":60,"stream":true}`, model, strings.Join(ids, ","))
	}
	natstest.WaitFor(t, 15*time.Second, "the router sees the three workers", func() bool {
		return len(rt.registry.Endpoints(model)) >= 3 && rt.watcher.Decide(model).Admit
	})

	ctx, stop := context.WithTimeout(t.Context(), duration)
	defer stop()
	var (
		mu        sync.Mutex
		latencies []time.Duration
		res       loopResult
		wg        sync.WaitGroup
	)
	for range clients {
		wg.Go(func() {
			for ctx.Err() == nil {
				start := time.Now()
				why := streamCompletion(base, body)
				if ctx.Err() != nil && why != "" {
					return // cut short by the end of the run, not by the system
				}
				mu.Lock()
				res.requests++
				latencies = append(latencies, time.Since(start))
				if why != "" {
					res.lost++
					if res.lost <= 3 {
						t.Logf("lost request: %s", why)
					}
				}
				mu.Unlock()
			}
		})
	}
	began := time.Now()
	var sum float64
	var slowSum float64
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
sampling:
	for {
		select {
		case <-ctx.Done():
			break sampling
		case <-tick.C:
			if time.Since(began) < warmup {
				continue
			}
			usages := kvUsages(fleets)
			if len(usages) != 3 {
				continue
			}
			sum += slices.Max(usages) - slices.Min(usages)
			mean := (usages[0] + usages[1] + usages[2]) / 3
			if mean > 0 {
				slowSum += usages[2] / mean
			}
			res.samples++
		}
	}
	wg.Wait()
	if res.samples == 0 {
		t.Fatal("no samples")
	}
	res.spread = sum / float64(res.samples)
	res.slowShare = slowSum / float64(res.samples)
	slices.Sort(latencies)
	if n := len(latencies); n > 0 {
		res.p99 = latencies[min(n-1, n*99/100)]
	}
	res.migrated = promreg.Sum(svc.reg, "workermon_rescheduler_migrated_requests_total")
	return res
}

// kvUsages returns each worker's KV usage (decode blocks in use over the
// blocks it has, over its ranks), fleet by fleet.
func kvUsages(fleets []*sim.Fleet) []float64 {
	var usages []float64
	for _, f := range fleets {
		for _, s := range f.Stats() {
			var used, total uint64
			for _, r := range s.Ranks {
				used += r.ActiveDecodeBlocks
				total += r.KVTotalBlocks
			}
			if total > 0 {
				usages = append(usages, float64(used)/float64(total))
			}
		}
	}
	return usages
}

// streamCompletion sends a streamed completion and returns why it was not
// answered 200 with a complete stream ([DONE], no error event), or "".
func streamCompletion(base, body string) string {
	resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Sprintf("status %d: %s", resp.StatusCode, b)
	}
	done := false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasPrefix(line, []byte(`data: {"error"`)) {
			return string(line)
		}
		if bytes.Equal(line, []byte("data: [DONE]")) {
			done = true
		}
	}
	switch {
	case sc.Err() != nil:
		return sc.Err().Error()
	case !done:
		return "no [DONE]"
	}
	return ""
}

// BenchmarkPickClosedLoop measures the router's worker choices (--pick) on
// the closed loop of TestReschedulerClosedLoop (rescheduler off), with text
// and with token-id prompts: the spread of KV usage across the three
// workers (lower is better balanced), the p99 latency and the requests
// completed in 12 s. One iteration is one 12-second run:
//
//	go test -run '^$' -bench PickClosedLoop -benchtime 1x ./cmd/workermon
func BenchmarkPickClosedLoop(b *testing.B) {
	for _, prompts := range []struct {
		name     string
		tokenIDs bool
	}{{"text", false}, {"token-ids", true}} {
		for _, pick := range []string{pickInFlight, pickLeastPotential} {
			b.Run(prompts.name+"/"+pick, func(b *testing.B) {
				var res loopResult
				for b.Loop() {
					res = runClosedLoop(b, loopOptions{pick: pick, tokenIDs: prompts.tokenIDs})
				}
				if res.lost > 0 {
					b.Errorf("%d requests lost", res.lost)
				}
				b.ReportMetric(res.spread, "spread")
				b.ReportMetric(float64(res.p99.Milliseconds()), "p99-ms")
				b.ReportMetric(float64(res.requests), "requests")
				b.ReportMetric(res.slowShare, "slow-share")
			})
		}
	}
}
