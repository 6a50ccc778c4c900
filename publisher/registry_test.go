package publisher_test

import (
	"encoding/json"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

// With an endpoint the worker is registered, refreshed, and deleted on
// Close; load publishing does not depend on it.
func TestRegistryEntry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	at := time.Date(2026, 11, 5, 12, 0, 0, 0, time.UTC)
	p := e.start(t, "Qwen/Qwen3-0.6B", 7, publisher.WithRanks(0, 4),
		publisher.WithEndpoint("http://10.0.0.7:8000/"), publisher.WithRegistryRefresh(20*time.Millisecond),
		publisher.WithBlockSize(32), publisher.WithClock(func() time.Time { return at }))
	kv := workersBucket(t, e)
	key := events.RegistryKey("Qwen/Qwen3-0.6B", 7)

	entry, rev := waitEntry(t, kv, key, 0)
	want := events.WorkerEntry{Model: "Qwen/Qwen3-0.6B", WorkerID: 7, Endpoint: "http://10.0.0.7:8000",
		DPStart: 0, DPSize: 4, BootID: p.BootID(), RegisteredAt: at.UnixNano(), BlockSize: 32}
	if entry != want {
		t.Errorf("entry %+v, want %+v", entry, want)
	}
	waitEntry(t, kv, key, rev) // refreshed

	if err := p.Close(t.Context()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := kv.Get(t.Context(), key); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("Get after Close = %v, want ErrKeyNotFound", err)
	}
}

// A registry that cannot be written (here: a server without JetStream) is
// retried in the background and logged once, while reports flow as usual.
func TestRegistryFailureDoesNotBlockReports(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(o *server.Options) { o.JetStream = false })
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	logs := &logRecorder{}
	p := e.start(t, "m", 1, publisher.WithEndpoint("http://engine:8000"),
		publisher.WithRegistryRefresh(10*time.Millisecond), publisher.WithHeartbeat(50*time.Millisecond),
		publisher.WithDebounce(time.Millisecond), publisher.WithLogger(slog.New(logs)))
	if err := p.Update(0, load(1, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	const failed = "registry: write entry failed"
	poll(t, func() error {
		if logs.count(failed) == 0 {
			return errors.New("registry failure not logged yet")
		}
		return nil
	})
	// Several heartbeats, during which the registry is retried many times.
	for range 5 {
		in.waitReport(t, func(events.LoadReport) bool { return true })
	}
	if n := logs.count(failed); n != 1 {
		t.Errorf("registry failure logged %d times, want once (rate-limited)", n)
	}
}

// workersBucket opens the registry bucket from the observer's side,
// retrying until the publisher has created it and the server answers.
func workersBucket(t *testing.T, e *env) jetstream.KeyValue {
	t.Helper()
	js, err := jetstream.New(e.obs)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	var kv jetstream.KeyValue
	poll(t, func() error {
		kv, err = js.KeyValue(t.Context(), events.WorkersBucket)
		return err
	})
	return kv
}

// waitEntry polls the registry until key has a revision above after and
// returns its entry and revision.
func waitEntry(t *testing.T, kv jetstream.KeyValue, key string, after uint64) (events.WorkerEntry, uint64) {
	t.Helper()
	var entry events.WorkerEntry
	var rev uint64
	poll(t, func() error {
		got, err := kv.Get(t.Context(), key)
		if err != nil {
			return err
		}
		if got.Revision() <= after {
			return errors.New("not refreshed yet")
		}
		rev = got.Revision()
		return json.Unmarshal(got.Value(), &entry)
	})
	return entry, rev
}

// poll calls f until it succeeds, failing the test at waitTimeout.
func poll(t *testing.T, f func() error) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not done within %v: %v", waitTimeout, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}
