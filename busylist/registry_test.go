package busylist

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

func registryTestNew(t *testing.T, js jetstream.JetStream, opts ...WatchOption) *Registry {
	t.Helper()
	r, err := NewRegistry(js, opts...)
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
	watchTestPutRaw(t, kv, events.RegistryKey(e.Model, e.WorkerID), data)
}

// registryTestIDs returns the worker ids registered for model.
func registryTestIDs(r *Registry, model string) []uint64 {
	var ids []uint64
	for _, e := range r.Endpoints(model) {
		ids = append(ids, e.WorkerID)
	}
	return ids
}

func TestRegistryPutsAndDeletes(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	const model = "Qwen/Qwen3-0.6B"
	registryTestPut(t, kv, registryTestEntry(model, 30, "http://10.0.0.3:8000"))
	r := registryTestNew(t, env.js)
	watchTestWaitReady(t, r)
	if got := registryTestIDs(r, model); !watchTestEqualIDs(got, []uint64{30}) {
		t.Fatalf("initial endpoints %v", got)
	}

	registryTestPut(t, kv, registryTestEntry(model, 10, "http://10.0.0.1:8000"))
	registryTestPut(t, kv, registryTestEntry(model, 20, "http://10.0.0.2:8000"))
	registryTestPut(t, kv, registryTestEntry("other", 10, "http://10.0.1.1:8000"))
	natstest.WaitFor(t, 5*time.Second, "three workers, sorted", func() bool {
		return watchTestEqualIDs(registryTestIDs(r, model), []uint64{10, 20, 30}) && len(r.Endpoints("other")) == 1
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
	natstest.WaitFor(t, 5*time.Second, "endpoint updated", func() bool {
		e, _ := r.Lookup(model, 20)
		return e.Endpoint == "http://10.0.0.22:8000"
	})

	if err := kv.Delete(t.Context(), events.RegistryKey(model, 10)); err != nil {
		t.Fatal(err)
	}
	if err := kv.Purge(t.Context(), events.RegistryKey(model, 30)); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "delete and purge visible", func() bool {
		return watchTestEqualIDs(registryTestIDs(r, model), []uint64{20})
	})
	if err := kv.Delete(t.Context(), events.RegistryKey("other", 10)); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "model without workers gone", func() bool {
		return r.Endpoints("other") == nil && len(r.Models()) == 1
	})
}

func TestRegistryBadEntries(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	reg := prometheus.NewRegistry()
	r := registryTestNew(t, env.js, WithRegisterer(reg))
	watchTestWaitReady(t, r)

	registryTestPut(t, kv, registryTestEntry("m", 1, "http://a"))
	natstest.WaitFor(t, 5*time.Second, "good entry", func() bool { return len(r.Endpoints("m")) == 1 })
	// Bad JSON under a registered worker's key removes it.
	watchTestPutRaw(t, kv, events.RegistryKey("m", 1), []byte(`{"model":"m","worker_id":"one"`))
	natstest.WaitFor(t, 5*time.Second, "bad JSON removes the worker", func() bool { return r.Endpoints("m") == nil })

	mismatch, _ := json.Marshal(registryTestEntry("m", 3, "http://c"))
	watchTestPutRaw(t, kv, events.RegistryKey("m", 2), mismatch)
	noEndpoint, _ := json.Marshal(registryTestEntry("m", 4, ""))
	watchTestPutRaw(t, kv, events.RegistryKey("m", 4), noEndpoint)
	good, _ := json.Marshal(registryTestEntry("m", 5, "http://e"))
	watchTestPutRaw(t, kv, "m.05", good)
	watchTestPutRaw(t, kv, "m", good)
	registryTestPut(t, kv, registryTestEntry("m", 6, "http://f"))
	natstest.WaitFor(t, 5*time.Second, "good entry after bad ones", func() bool {
		return watchTestEqualIDs(registryTestIDs(r, "m"), []uint64{6})
	})
	watchTestWantSeries(t, reg, "workermon_router_watch_bad_records_total", map[string]string{"bucket": events.WorkersBucket}, "reason",
		map[string]float64{"malformed": 1, "mismatch": 1, "no_endpoint": 1, "bad_key": 2})
}

// TestRegistryExpires checks that entries not refreshed within the bucket's
// TTL go away even though no watcher hears of the expiry.
func TestRegistryExpires(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	clock := newWatchTestClock()
	r := registryTestNew(t, env.js, WithClock(clock.now))
	watchTestWaitReady(t, r)
	registryTestPut(t, kv, registryTestEntry("m", 1, "http://a"))
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b"))
	natstest.WaitFor(t, 5*time.Second, "two workers", func() bool { return len(r.Endpoints("m")) == 2 })

	clock.add(RegistryTTL / 2)
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b2")) // refreshed
	natstest.WaitFor(t, 5*time.Second, "refresh seen", func() bool {
		e, _ := r.Lookup("m", 2)
		return e.Endpoint == "http://b2"
	})
	clock.add(RegistryTTL/2 + time.Second)
	natstest.WaitFor(t, 5*time.Second, "unrefreshed worker expired", func() bool {
		return watchTestEqualIDs(registryTestIDs(r, "m"), []uint64{2})
	})
	clock.add(RegistryTTL)
	natstest.WaitFor(t, 5*time.Second, "last worker expired", func() bool { return r.Endpoints("m") == nil })
}

func TestRegistryRecoversAfterRestart(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.WorkersBucket)
	registryTestPut(t, kv, registryTestEntry("m", 1, "http://a"))
	r := registryTestNew(t, env.js)
	watchTestWaitReady(t, r)
	env.restart(t)
	registryTestPut(t, kv, registryTestEntry("m", 2, "http://b"))
	natstest.WaitFor(t, 5*time.Second, "entry put after restart", func() bool {
		return watchTestEqualIDs(registryTestIDs(r, "m"), []uint64{1, 2})
	})
}

func TestRegistryEndpointsAllocatesNothing(t *testing.T) { // not parallel: AllocsPerRun
	r := &Registry{}
	m := map[string]*registryModel{"m": {workers: []events.WorkerEntry{
		registryTestEntry("m", 1, "http://a"), registryTestEntry("m", 2, "http://b")}}}
	r.state.cur.Store(&m)
	if n := testing.AllocsPerRun(100, func() {
		_ = r.Endpoints("m")
		_, _ = r.Lookup("m", 2)
	}); n != 0 {
		t.Errorf("%v allocs", n)
	}
}

func TestRegistryParseKey(t *testing.T) {
	t.Parallel()
	for key, want := range map[string]struct {
		model  string
		worker uint64
		ok     bool
	}{
		"Qwen/Qwen3-0=2E6B.17":   {"Qwen/Qwen3-0.6B", 17, true},
		"m.0":                    {"m", 0, true},
		"m.18446744073709551615": {"m", 1<<64 - 1, true},
		"m":                      {},
		"m.":                     {},
		"m.01":                   {},
		"m.+1":                   {},
		"m.1.2":                  {},
		"m=2e.1":                 {},
		".1":                     {},
	} {
		model, worker, err := registryParseKey(key)
		if (err == nil) != want.ok || err == nil && (model != want.model || worker != want.worker) {
			t.Errorf("registryParseKey(%q) = %q, %d, %v", key, model, worker, err)
		}
	}
}
