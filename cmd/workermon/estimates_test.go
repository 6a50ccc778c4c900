package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/sim"
	"github.com/workermon/workermon/slots"
)

// TestRouterEstimatesMakeBusyFirst (contract §11): an engine whose own
// report says it is idle (0 prefill tokens: its report lags, as a real
// engine's does between its one-second reports) gets a burst of three
// requests of 100 prompt tokens through the router. The router's estimate
// (300 tokens, over the threshold of 250) makes the worker busy in the
// monitor's record while the engine still reports 0, and the router rejects
// the next request. At the first tokens the estimate falls and the worker is
// free again; when the router stops, its goodbye removes its source.
func TestRouterEstimatesMakeBusyFirst(t *testing.T) {
	t.Parallel()
	const model = "est/model"
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.monitor.Defaults = events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](250)}
	})
	nc, kv := connect(t, svc.natsURL)

	// The engine: streams that send their first token only when released,
	// and a publisher that reports 0 prefill tokens throughout.
	release := make(chan struct{})
	var mu sync.Mutex
	started := 0
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		started++
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, `data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
	}))
	t.Cleanup(eng.Close)
	pub, err := publisher.New(nc, model, 1, publisher.WithEndpoint(eng.URL), publisher.WithBlockSize(16),
		publisher.WithHeartbeat(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, pub.Close)
	if err := pub.Update(0, publisher.Load{ActivePrefillTokens: events.Some(0), ActiveDecodeBlocks: events.Some(0),
		KVTotalBlocks: events.Some(1000)}); err != nil {
		t.Fatal(err)
	}

	ro := defaultRouterOptions()
	ro.natsURL, ro.httpAddr, ro.router.RouterID = svc.natsURL, "127.0.0.1:0", "rt1"
	routerReg := newRegistry()
	rt, err := startRouter(ro, slog.New(slog.DiscardHandler), routerReg)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, rt.Close)
	natstest.WaitFor(t, 15*time.Second, "the router admits for the model", func() bool {
		return len(rt.registry.Endpoints(model)) == 1 && rt.watcher.Decide(model).Admit
	})
	natstest.WaitFor(t, 5*time.Second, "the router's tracker has the worker", func() bool {
		return len(routerSlotLoads(t, rt, model)) == 1
	})

	prompt := make([]int, 100)
	for i := range prompt {
		prompt[i] = i
	}
	tokens, _ := json.Marshal(prompt)
	body := fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":1,"stream":true}`, model, tokens)
	var wg sync.WaitGroup
	codes := make(chan int, 3)
	for range 3 {
		wg.Go(func() {
			resp, err := http.Post("http://"+rt.httpAddr+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	natstest.WaitFor(t, 5*time.Second, "three streams at the engine", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return started == 3
	})

	if n := promreg.Sum(routerReg, "workermon_slots_requests"); n != 3 {
		t.Errorf("the router's workermon_slots_requests = %v, want 3", n)
	}
	start := time.Now()
	var busyRec events.BusySet
	natstest.WaitFor(t, 5*time.Second, "worker 1 busy in the record", func() bool {
		rec, ok := record(t, kv, model)
		busyRec = rec
		return ok && slices.Contains(rec.Busy, 1)
	})
	t.Logf("worker busy in the record %v after the third request reached the engine", time.Since(start).Round(time.Millisecond))
	if busyRec.Reasons["1"] != "prefill" || !busyRec.AllBusy {
		t.Fatalf("record %+v, want worker 1 busy for prefill, all busy", busyRec)
	}
	// The engine's own state still says 0; the router's says 300.
	rows := monitorLoads(t, svc, model)
	if len(rows) != 1 || rows[0].ActivePrefillTokens != 300 {
		t.Fatalf("loads %+v, want one rank at 300 prefill tokens", rows)
	}
	if e := rows[0].Sources[events.SourceEngine]; e.ActivePrefillTokens == nil || *e.ActivePrefillTokens != 0 {
		t.Fatalf("engine source %+v, want 0 prefill tokens", e)
	}
	if r := rows[0].Sources["router/rt1"]; r.ActivePrefillTokens == nil || *r.ActivePrefillTokens != 300 ||
		r.ActiveDecodeBlocks == nil || *r.ActiveDecodeBlocks != 6 { // 100 tokens: 6 blocks of 16, shared by the 3
		t.Fatalf("router source %+v, want 300 prefill tokens and 6 blocks", r)
	}
	natstest.WaitFor(t, 5*time.Second, "the router rejects", func() bool { return !rt.watcher.Decide(model).Admit })
	resp, err := http.Post("http://"+rt.httpAddr+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("a request while the estimate says busy: %d, want 503", resp.StatusCode)
	}

	close(release)
	wg.Wait()
	for range 3 {
		if c := <-codes; c != http.StatusOK {
			t.Fatalf("a stream answered %d", c)
		}
	}
	natstest.WaitFor(t, 5*time.Second, "worker 1 free once the streams ended", func() bool {
		rec, ok := record(t, kv, model)
		return ok && slices.Contains(rec.Free, 1)
	})

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := rt.Close(ctx); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "the router's source gone after its goodbye", func() bool {
		rows := monitorLoads(t, svc, model)
		_, has := rows[0].Sources["router/rt1"]
		return len(rows) == 1 && !has
	})
}

// monitorLoads reads the monitor's GET /loads for one model.
func monitorLoads(t *testing.T, svc *service, model string) []monitor.LoadRow {
	t.Helper()
	code, _, b := call(t, svc, "GET", "/loads?model="+model, "", "")
	if code != http.StatusOK {
		t.Fatalf("GET /loads: %d %s", code, b)
	}
	var reply api.LoadsReply
	if err := json.Unmarshal(b, &reply); err != nil {
		t.Fatalf("GET /loads: %v: %s", err, b)
	}
	return reply.Loads
}

// routerSlotLoads reads the router's own GET /loads (its slot tracker).
func routerSlotLoads(t *testing.T, rt *routerService, model string) []slots.Load {
	t.Helper()
	resp, err := http.Get("http://" + rt.httpAddr + "/loads?model_name=" + model)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []slots.Load
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatalf("router GET /loads: %v", err)
	}
	return rows
}

// TestSlotsFromRegistryPublish: `workermon slots --from-registry --publish`
// registers the simulator's workers with the block size of their registry
// entries, and a request added over its API reaches the monitor as the
// estimate of source router/<tracker-id>, summed over tenants.
func TestSlotsFromRegistryPublish(t *testing.T) {
	t.Parallel()
	const model = "slots/model"
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.monitor.Defaults = events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](500)}
	})
	cfg := sim.DefaultFleetConfig()
	cfg.Model, cfg.Workers, cfg.Ranks, cfg.BaseWorkerID, cfg.Host = model, 2, 2, 1, "127.0.0.1"
	cfg.Engine.BlockSize = 32
	cfg.NATS.URL = svc.natsURL
	fleet, err := sim.NewFleet(t.Context(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, fleet.Close)

	o := defaultSlotsOptions()
	o.httpAddr, o.natsURL, o.fromRegistry, o.estimates.publish, o.trackerID = "127.0.0.1:0", svc.natsURL, true, true, "st1"
	st, err := startSlots(t.Context(), o, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, st.close)
	base := "http://" + st.http.addr
	var workers []slots.Worker
	natstest.WaitFor(t, 10*time.Second, "both simulated workers registered", func() bool {
		resp, err := http.Get(base + "/workers")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		return json.NewDecoder(resp.Body).Decode(&workers) == nil && len(workers) == 2
	})
	for _, w := range workers {
		if w.BlockSize != 32 || w.DPSize != 2 || w.Tenant != "default" {
			t.Fatalf("registration %+v, want block size 32 from the registry entry, 2 ranks", w)
		}
	}
	for i, tenant := range []string{"default", "other"} {
		if tenant != "default" {
			reg := fmt.Sprintf(`{"worker_id":2,"model_name":%q,"tenant_id":%q,"block_size":32,"dp_size":2}`, model, tenant)
			if resp, err := http.Post(base+"/register", "application/json", strings.NewReader(reg)); err != nil || resp.StatusCode != http.StatusCreated {
				t.Fatalf("register tenant %s: %v %v", tenant, resp, err)
			}
		}
		add := fmt.Sprintf(`{"model_name":%q,"tenant_id":%q,"request_id":"r%d","worker_id":2,"dp_rank":1,"sequence_hashes":[1,2],"new_isl_tokens":300}`,
			model, tenant, i)
		resp, err := http.Post(base+"/add", "application/json", strings.NewReader(add))
		if err != nil || resp.StatusCode != http.StatusCreated {
			t.Fatalf("add: %v %v", resp, err)
		}
		resp.Body.Close()
	}
	// 300 + 300 over the tenants on rank 1; rank 0 of worker 2 is idle, so
	// the worker is not busy (every rank must be), but the monitor holds
	// the sum.
	natstest.WaitFor(t, 5*time.Second, "the estimate of 600 tokens at the monitor", func() bool {
		for _, row := range monitorLoads(t, svc, model) {
			if src, ok := row.Sources["router/st1"]; ok && row.WorkerID == 2 && row.DPRank == 1 &&
				src.ActivePrefillTokens != nil && *src.ActivePrefillTokens == 600 && row.ActivePrefillTokens == 600 {
				return true
			}
		}
		return false
	})
}
