package slotsnats_test

import (
	"context"
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/registry"
	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsnats"
)

// waitUnlocked polls cond until it holds, failing after d; unlike
// natstest.WaitFor it also fails when cond itself never returns (a tracker
// whose lock a runaway walk holds).
func waitUnlocked(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil && !cond() {
			time.Sleep(10 * time.Millisecond)
		}
	}()
	select {
	case <-done:
		if ctx.Err() != nil {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
	case <-ctx.Done():
		t.Fatalf("timed out after %v waiting for %s", d, what)
	}
}

// goUnlessFailed runs f until the test ends, and waits for it then unless
// the test failed: a walk that wraps holds the tracker, and so f, for ever.
func goUnlessFailed(t *testing.T, f func(ctx context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		if !t.Failed() {
			<-done
		}
	})
}

// TestSyncRangeEndingAt2To32: a registry entry, put in a real workers
// bucket, whose ranks end exactly at 2^32 is registered in the tracker as
// routers and `workermon slots --from-registry` read it, its rank
// 4294967295 takes requests and is estimated, and an entry past 2^32 is
// left out (issue 23 item 16: the walk wrapped and held the tracker for
// ever).
func TestSyncRangeEndingAt2To32(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t))
	nc := natstest.Connect(t, srv)
	js, err := jetstream.New(nc)
	must(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	kv, err := kvbucket.Open(ctx, js, events.WorkersBucket, 1)
	must(t, err)
	put := func(e events.WorkerEntry) {
		t.Helper()
		data, err := json.Marshal(e)
		must(t, err)
		natstest.Put(t, kv, events.RegistryKey(e.Model, e.WorkerID), data)
	}
	put(events.WorkerEntry{Model: "m1", WorkerID: 8, Endpoint: "http://a", DPStart: math.MaxUint32, DPSize: 1, BlockSize: 16})
	put(events.WorkerEntry{Model: "m1", WorkerID: 9, Endpoint: "http://b", DPStart: math.MaxUint32, DPSize: 2, BlockSize: 16})
	put(events.WorkerEntry{Model: "m1", WorkerID: 10, Endpoint: "http://c", DPStart: 3, DPSize: 1, BlockSize: 16})
	reg, err := registry.NewWatcher(js)
	must(t, err)
	t.Cleanup(func() { _ = reg.Close() })

	obs := natstest.Connect(t, srv)
	ests := make(chan events.LoadReport, 64)
	sub, err := obs.Subscribe("wm.est.>", func(m *nats.Msg) {
		if r, err := events.DecodeLoadReport(m.Data); err == nil {
			select {
			case ests <- r:
			default:
			}
		}
	})
	must(t, err)
	defer sub.Unsubscribe()
	must(t, obs.Flush())

	tr := newTracker(t)
	goUnlessFailed(t, func(ctx context.Context) {
		cfg := slotsnats.DefaultSyncConfig()
		cfg.Tracker, cfg.Registry, cfg.Every = tr, reg, 10*time.Millisecond
		if err := slotsnats.Sync(ctx, cfg); err != nil {
			t.Errorf("Sync: %v", err)
		}
	})
	goUnlessFailed(t, func(ctx context.Context) {
		cfg := slotsnats.DefaultEstimatesConfig()
		cfg.Conn, cfg.Tracker, cfg.ID, cfg.SubjectPrefix, cfg.Every = nc, tr, "r1", "wm", 10*time.Millisecond
		if err := slotsnats.Estimates(ctx, cfg); err != nil {
			t.Errorf("Estimates: %v", err)
		}
	})
	// Tracker reads go through waitUnlocked: on a wrapping walk they block.
	var workers []slots.Worker
	waitUnlocked(t, 15*time.Second, "workers 8 and 10 registered", func() bool {
		workers = tr.Workers("", "")
		return len(workers) == 2
	})
	if w := workers[0]; w.WorkerID != 8 || w.DPStart != math.MaxUint32 || w.DPSize != 1 || workers[1].WorkerID != 10 {
		t.Fatalf("registered %+v, want workers 8 (rank 4294967295) and 10", workers)
	}
	waitUnlocked(t, 15*time.Second, "a request on rank 4294967295", func() bool {
		return tr.Add(slots.Request{Model: "m1", ID: "a", WorkerID: 8, DPRank: math.MaxUint32, Hashes: []uint64{1}, NewISLTokens: 5}) == nil
	})
	deadline := time.After(15 * time.Second)
	for {
		select {
		case r := <-ests:
			if r.WorkerID == 8 && r.DPRank == math.MaxUint32 && r.ActivePrefillTokens == events.Some(5) {
				if r.DPStart != math.MaxUint32 || r.DPSize != 1 {
					t.Errorf("estimate declares ranks [%d, +%d), want [4294967295, +1)", r.DPStart, r.DPSize)
				}
				return
			}
		case <-deadline:
			t.Fatal("no estimate of rank 4294967295 within 15s")
		}
	}
}

// TestEstimatesSaturate: a rank's estimate, summed over tenants, stops at
// 2^64-1 instead of wrapping (issue 23 item 23).
func TestEstimatesSaturate(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t))
	nc, obs := natstest.Connect(t, srv), natstest.Connect(t, srv)
	ests := make(chan events.LoadReport, 64)
	sub, err := obs.Subscribe("wm.est.>", func(m *nats.Msg) {
		if r, err := events.DecodeLoadReport(m.Data); err == nil {
			select {
			case ests <- r:
			default:
			}
		}
	})
	must(t, err)
	defer sub.Unsubscribe()
	must(t, obs.Flush())
	tr := newTracker(t)
	for _, tenant := range []string{"t1", "t2"} {
		must(t, tr.Register(slots.Worker{WorkerID: 7, Model: "m", Tenant: tenant, BlockSize: 16, DPSize: 1}))
		must(t, tr.Add(slots.Request{Model: "m", Tenant: tenant, ID: "a", WorkerID: 7, Hashes: []uint64{1}, NewISLTokens: math.MaxUint64}))
	}
	run(t, func(ctx context.Context) {
		cfg := slotsnats.DefaultEstimatesConfig()
		cfg.Conn, cfg.Tracker, cfg.ID, cfg.SubjectPrefix, cfg.Every = nc, tr, "r1", "wm", 10*time.Millisecond
		if err := slotsnats.Estimates(ctx, cfg); err != nil {
			t.Errorf("Estimates: %v", err)
		}
	})
	select {
	case r := <-ests:
		if r.ActivePrefillTokens != events.Some(math.MaxUint64) || r.ActiveDecodeBlocks != events.Some(2) {
			t.Errorf("estimate %+v, want 2^64-1 prefill tokens and 2 blocks", r)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no estimate within 15s")
	}
}
