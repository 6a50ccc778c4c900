package registry

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/internal/watchmetrics"
)

// registryTestWait bounds every wait on the NATS server: generous, so that
// the tests pass beside a busy CPU.
const registryTestWait = 15 * time.Second

func registryTestNew(t *testing.T, js jetstream.JetStream, opts ...Option) *Watcher {
	t.Helper()
	r, err := NewWatcher(js, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func registryTestEntry(model string, worker uint64, endpoint string) events.WorkerEntry {
	return events.WorkerEntry{Model: model, WorkerID: worker, Endpoint: endpoint, DPSize: 1,
		BootID: 42, RegisteredAt: time.Now().UnixNano()}
}

func registryTestPut(t *testing.T, kv jetstream.KeyValue, e events.WorkerEntry) {
	t.Helper()
	data, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	natstest.Put(t, kv, events.RegistryKey(e.Model, e.WorkerID), data)
}

// registryTestIDs returns the worker ids registered for model.
func registryTestIDs(r *Watcher, model string) []uint64 {
	var ids []uint64
	for _, e := range r.Endpoints(model) {
		ids = append(ids, e.WorkerID)
	}
	return ids
}

// registryTestTwoWorkers starts a server and a Watcher on a test clock, and
// registers workers 1 and 2 of model "m".
func registryTestTwoWorkers(t *testing.T) (*testEnv, jetstream.KeyValue, *testClock, *Watcher) {
	t.Helper()
	env := testStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	clock := newTestClock()
	r := registryTestNew(t, env.js, WithClock(clock.now))
	natstest.WaitReady(t, r)
	registryTestPut(t, kv, registryTestEntry("m", 1, "http://a"))
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b"))
	natstest.WaitFor(t, registryTestWait, "two workers", func() bool { return len(r.Endpoints("m")) == 2 })
	return env, kv, clock, r
}

func TestRegistryPutsAndDeletes(t *testing.T) {
	t.Parallel()
	env := testStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	const model = "Qwen/Qwen3-0.6B"
	registryTestPut(t, kv, registryTestEntry(model, 30, "http://10.0.0.3:8000"))
	r := registryTestNew(t, env.js)
	natstest.WaitReady(t, r)
	if got := registryTestIDs(r, model); !slices.Equal(got, []uint64{30}) {
		t.Fatalf("initial endpoints %v", got)
	}

	registryTestPut(t, kv, registryTestEntry(model, 10, "http://10.0.0.1:8000"))
	registryTestPut(t, kv, registryTestEntry(model, 20, "http://10.0.0.2:8000"))
	registryTestPut(t, kv, registryTestEntry("other", 10, "http://10.0.1.1:8000"))
	natstest.WaitFor(t, registryTestWait, "three workers, sorted", func() bool {
		return slices.Equal(registryTestIDs(r, model), []uint64{10, 20, 30}) && len(r.Endpoints("other")) == 1
	})
	if e, ok := r.Lookup(model, 20); !ok || e.Endpoint != "http://10.0.0.2:8000" {
		t.Errorf("Lookup(20) = %+v, %v", e, ok)
	}
	if _, ok := r.Lookup(model, 25); ok {
		t.Error("Lookup(25) found a worker")
	}
	if got := r.Models(); len(got) != 2 || got[0] != model || got[1] != "other" {
		t.Errorf("Models() = %v", got)
	}

	// An update replaces the endpoint.
	registryTestPut(t, kv, registryTestEntry(model, 20, "http://10.0.0.22:8000"))
	natstest.WaitFor(t, registryTestWait, "endpoint updated", func() bool {
		e, _ := r.Lookup(model, 20)
		return e.Endpoint == "http://10.0.0.22:8000"
	})

	if err := kv.Delete(t.Context(), events.RegistryKey(model, 10)); err != nil {
		t.Fatal(err)
	}
	if err := kv.Purge(t.Context(), events.RegistryKey(model, 30)); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, registryTestWait, "delete and purge visible", func() bool {
		return slices.Equal(registryTestIDs(r, model), []uint64{20})
	})
	if err := kv.Delete(t.Context(), events.RegistryKey("other", 10)); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, registryTestWait, "model without workers gone", func() bool {
		return r.Endpoints("other") == nil && len(r.Models()) == 1
	})
}

func TestRegistryBadEntries(t *testing.T) {
	t.Parallel()
	env := testStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	reg := prometheus.NewRegistry()
	m, err := watchmetrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	r := registryTestNew(t, env.js, WithStats(m.Bucket(events.WorkersBucket)))
	natstest.WaitReady(t, r)

	registryTestPut(t, kv, registryTestEntry("m", 1, "http://a"))
	natstest.WaitFor(t, registryTestWait, "good entry", func() bool { return len(r.Endpoints("m")) == 1 })
	// Bad JSON under a registered worker's key removes it.
	natstest.Put(t, kv, events.RegistryKey("m", 1), []byte(`{"model":"m","worker_id":"one"`))
	natstest.WaitFor(t, registryTestWait, "bad JSON removes the worker", func() bool { return r.Endpoints("m") == nil })

	mismatch, _ := json.Marshal(registryTestEntry("m", 3, "http://c"))
	natstest.Put(t, kv, events.RegistryKey("m", 2), mismatch)
	noEndpoint, _ := json.Marshal(registryTestEntry("m", 4, ""))
	natstest.Put(t, kv, events.RegistryKey("m", 4), noEndpoint)
	good, _ := json.Marshal(registryTestEntry("m", 5, "http://e"))
	natstest.Put(t, kv, "m.05", good)
	natstest.Put(t, kv, "m", good)
	registryTestPut(t, kv, registryTestEntry("m", 6, "http://f"))
	natstest.WaitFor(t, registryTestWait, "good entry after bad ones", func() bool {
		return slices.Equal(registryTestIDs(r, "m"), []uint64{6})
	})
	for reason, want := range map[string]float64{"malformed": 1, "mismatch": 1, "no_endpoint": 1, "bad_key": 2} {
		lbl := map[string]string{"bucket": events.WorkersBucket, "reason": reason}
		if v, _ := promtest.Value(t, reg, "workermon_router_watch_bad_records_total", lbl); v != want {
			t.Errorf("bad records %v = %v, want %v", lbl, v, want)
		}
	}
}

// TestRegistryExpires checks that entries not refreshed within the bucket's
// TTL go away even though no watcher hears of the expiry.
func TestRegistryExpires(t *testing.T) {
	t.Parallel()
	_, kv, clock, r := registryTestTwoWorkers(t)

	clock.add(TTL / 2)
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b2")) // refreshed
	natstest.WaitFor(t, registryTestWait, "refresh seen", func() bool {
		e, _ := r.Lookup("m", 2)
		return e.Endpoint == "http://b2"
	})
	clock.add(TTL/2 + time.Second)
	natstest.WaitFor(t, registryTestWait, "unrefreshed worker expired", func() bool {
		return slices.Equal(registryTestIDs(r, "m"), []uint64{2})
	})
	clock.add(TTL)
	natstest.WaitFor(t, registryTestWait, "last worker expired", func() bool { return r.Endpoints("m") == nil })
}

// TestRegistryOutageLongerThanTTL stops the NATS server for longer than the
// TTL by the watcher's clock: no entry expires while the registry cannot be
// read, Live says so, and once the watch is current again every entry has
// one more TTL, from that moment, to be refreshed in.
func TestRegistryOutageLongerThanTTL(t *testing.T) {
	t.Parallel()
	env, kv, clock, r := registryTestTwoWorkers(t)
	natstest.WaitFor(t, registryTestWait, "the watch live", r.Live)

	opts := natstest.Stop(t, env.srv, env.opts)
	natstest.WaitFor(t, registryTestWait, "the outage seen", func() bool { return !r.Live() })
	clock.add(2 * TTL)
	clock.waitReads(t, 3) // each sweep reads the clock: sweeps had their chance
	if got := registryTestIDs(r, "m"); !slices.Equal(got, []uint64{1, 2}) {
		t.Fatalf("during an outage of 2 TTLs the workers are %v, want [1 2] kept", got)
	}
	if r.Live() {
		t.Fatal("Live during the outage")
	}

	env.srv = natstest.Start(t, opts)
	natstest.WaitFor(t, registryTestWait, "the watch live again", r.Live)
	clock.waitReads(t, 3)
	if got := registryTestIDs(r, "m"); !slices.Equal(got, []uint64{1, 2}) {
		t.Fatalf("after the outage the workers are %v, want [1 2] kept", got)
	}
	clock.add(TTL / 2)
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b2")) // refreshed after the outage
	natstest.WaitFor(t, registryTestWait, "refresh seen", func() bool {
		e, _ := r.Lookup("m", 2)
		return e.Endpoint == "http://b2"
	})
	clock.add(TTL / 2) // one TTL since the watch was current again: the grace holds
	clock.waitReads(t, 3)
	if got := registryTestIDs(r, "m"); !slices.Equal(got, []uint64{1, 2}) {
		t.Fatalf("one TTL after the outage the workers are %v, want [1 2]", got)
	}
	clock.add(time.Second) // past it: the worker not refreshed since goes
	natstest.WaitFor(t, registryTestWait, "the unrefreshed worker expired", func() bool {
		return slices.Equal(registryTestIDs(r, "m"), []uint64{2})
	})
}

func TestRegistryRecoversAfterRestart(t *testing.T) {
	t.Parallel()
	env := testStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	registryTestPut(t, kv, registryTestEntry("m", 1, "http://a"))
	r := registryTestNew(t, env.js)
	natstest.WaitReady(t, r)
	env.restart(t)
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b"))
	natstest.WaitFor(t, registryTestWait, "entry put after restart", func() bool {
		return slices.Equal(registryTestIDs(r, "m"), []uint64{1, 2})
	})
}

func TestRegistryEndpointsAllocatesNothing(t *testing.T) { // not parallel: AllocsPerRun
	r := &Watcher{}
	r.state.Reset()
	r.state.Edit()["m"] = &registryModel{workers: []events.WorkerEntry{
		registryTestEntry("m", 1, "http://a"), registryTestEntry("m", 2, "http://b")}}
	r.state.Publish()
	if n := testing.AllocsPerRun(100, func() {
		_ = r.Endpoints("m")
		_, _ = r.Lookup("m", 2)
	}); n != 0 {
		t.Errorf("%v allocs", n)
	}
}

// testEnv is a real in-process NATS server with a client.
type testEnv struct {
	srv  *server.Server
	opts *server.Options
	js   jetstream.JetStream
}

func testStart(t *testing.T) *testEnv {
	t.Helper()
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	return &testEnv{srv: srv, opts: opts, js: js}
}

// restart restarts the server on the same port and store.
func (e *testEnv) restart(t *testing.T) {
	t.Helper()
	e.srv = natstest.Restart(t, e.srv, e.opts)
}

func (e *testEnv) bucket(t *testing.T, name string) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	kv, err := kvbucket.Open(ctx, e.js, name, 1)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// testClock is a settable clock that counts its reads.
type testClock struct{ ns, reads atomic.Int64 }

func newTestClock() *testClock {
	c := &testClock{}
	c.ns.Store(time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC).UnixNano())
	return c
}

func (c *testClock) now() time.Time {
	c.reads.Add(1)
	return time.Unix(0, c.ns.Load())
}

func (c *testClock) add(d time.Duration) { c.ns.Add(int64(d)) }

// waitReads waits until the clock has been read n more times. The watch loop
// reads it at each sweep (every second) and for each entry received.
func (c *testClock) waitReads(t *testing.T, n int64) {
	t.Helper()
	want := c.reads.Load() + n
	natstest.WaitFor(t, registryTestWait, "the watcher reading its clock", func() bool { return c.reads.Load() >= want })
}

// TestRegistryRankRange: an entry whose ranks end exactly at 2^32 is kept
// (rank 4294967295 is legal, contract §3); one whose ranks pass 2^32 is
// dropped and counted as bad_range (issue 23 item 16).
func TestRegistryRankRange(t *testing.T) {
	t.Parallel()
	env := testStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	reg := prometheus.NewRegistry()
	m, err := watchmetrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	r := registryTestNew(t, env.js, WithStats(m.Bucket(events.WorkersBucket)))
	natstest.WaitReady(t, r)

	top := registryTestEntry("m", 8, "http://a")
	top.DPStart, top.DPSize = math.MaxUint32, 1
	registryTestPut(t, kv, top)
	zero := registryTestEntry("m", 9, "http://b") // dp_size 0 is read as 1
	zero.DPStart, zero.DPSize = math.MaxUint32, 0
	registryTestPut(t, kv, zero)
	for i, bad := range [][2]uint32{{math.MaxUint32, 2}, {math.MaxUint32 - 1, 3}} {
		e := registryTestEntry("m", uint64(10+i), "http://c")
		e.DPStart, e.DPSize = bad[0], bad[1]
		registryTestPut(t, kv, e)
	}
	registryTestPut(t, kv, registryTestEntry("m", 20, "http://d"))
	natstest.WaitFor(t, registryTestWait, "the entry after the bad ones", func() bool {
		_, ok := r.Lookup("m", 20)
		return ok
	})
	if ids := registryTestIDs(r, "m"); !slices.Equal(ids, []uint64{8, 9, 20}) {
		t.Errorf("workers %v, want 8, 9 and 20", ids)
	}
	lbl := map[string]string{"bucket": events.WorkersBucket, "reason": "bad_range"}
	if v, _ := promtest.Value(t, reg, "workermon_router_watch_bad_records_total", lbl); v != 2 {
		t.Errorf("bad records %v = %v, want 2", lbl, v)
	}
	// A registered worker whose entry moves past 2^32 is removed.
	top.DPSize = 2
	registryTestPut(t, kv, top)
	natstest.WaitFor(t, registryTestWait, "worker 8 removed", func() bool {
		_, ok := r.Lookup("m", 8)
		return !ok
	})
}
