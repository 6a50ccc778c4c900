package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
)

// leaseTestJS is a client of srv with its JetStream context.
func leaseTestJS(t *testing.T, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// busyRecord reads model's record, tolerating a server that is restarting.
func busyRecord(t *testing.T, js jetstream.JetStream, model string) (events.BusySet, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, events.BusyBucket)
	if err != nil {
		return events.BusySet{}, false
	}
	e, err := kv.Get(ctx, events.ModelKey(model))
	if err != nil {
		return events.BusySet{}, false
	}
	set, err := events.DecodeBusySet(e.Value())
	return set, err == nil
}

// keepReporting publishes a report of model every 20 ms until the test
// ends, ignoring errors (the server may be away).
func keepReporting(t *testing.T, nc *nats.Conn, model string) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			data, _ := events.MarshalLoadReport(&events.LoadReport{
				Model: model, WorkerID: 1, DPSize: 1, Source: events.SourceEngine,
				ActiveDecodeBlocks: events.Some(uint64(10)), KVTotalBlocks: events.Some(uint64(100)),
				BootID: 1, Seq: uint64(time.Now().UnixNano()), SentAt: time.Now().UnixNano(),
			})
			_ = nc.Publish(events.LoadSubject(events.DefaultSubjectPrefix, model, 1, 0), data)
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// readyz returns /readyz's status and body.
func readyz(t *testing.T, svc *service) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + svc.httpAddr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// TestLeasesBackAfterLongOutage: after a NATS outage longer than the
// leases bucket's max age (made 1 s here: the monitor leaves an existing
// bucket's settings alone), the server drops every lease key; the monitor
// creates its lease again and writes records within seconds of the
// server's return (issue 22, item 1).
func TestLeasesBackAfterLongOutage(t *testing.T) {
	t.Parallel()
	const maxAge = time.Second
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	_, js := leaseTestJS(t, srv.ClientURL())
	if _, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: events.LeasesBucket, History: 1,
		TTL: maxAge, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	svc := testService(t, func(o *serveOptions) { o.natsURL = srv.ClientURL() })
	t.Logf("monitor %s", svc.monitorID)
	pub, _ := leaseTestJS(t, srv.ClientURL())
	const model = "org/outage"
	keepReporting(t, pub, model)
	var before events.BusySet
	natstest.WaitFor(t, 10*time.Second, "the record written", func() bool {
		var ok bool
		before, ok = busyRecord(t, js, model)
		return ok
	})

	// The outage: longer than the leases' max age, which the server
	// applies when it comes back.
	opts = natstest.Stop(t, srv, opts)
	time.Sleep(maxAge + maxAge/2)
	srv = natstest.Start(t, opts)
	back := time.Now()

	var after events.BusySet
	natstest.WaitFor(t, 20*time.Second, "a record written after the server came back", func() bool {
		var ok bool
		after, ok = busyRecord(t, js, model)
		return ok && after.UpdatedAt > back.UnixNano()
	})
	t.Logf("first write %v after the server came back", time.Since(back))
	// Under a new lease: created again, with a higher epoch.
	if after.Epoch <= before.Epoch || after.MonitorID != svc.monitorID {
		t.Errorf("record after the outage: epoch %d by %s, want above %d by %s", after.Epoch, after.MonitorID,
			before.Epoch, svc.monitorID)
	}
}

// TestLeasesSubscribeFailureGivesBack: a partition taken whose subscription
// fails is given back at once (its lease deleted, not renewed) and /readyz
// says so; it is taken again after a backoff, and once the subscription
// works the monitor hears it and is ready (issue 22, item 2).
func TestLeasesSubscribeFailureGivesBack(t *testing.T) {
	t.Parallel()
	var refuse atomic.Bool
	refuse.Store(true)
	var tries atomic.Int32
	hooks := &serveHooks{subscribe: func(int) error {
		tries.Add(1)
		if refuse.Load() {
			return errors.New("test: subscription refused")
		}
		return nil
	}}
	srv := natstest.Start(t, natstest.Options(t))
	svc := testService(t, func(o *serveOptions) { o.natsURL, o.hooks = srv.ClientURL(), hooks })
	_, js := leaseTestJS(t, srv.ClientURL())
	leases, err := kvbucket.Open(t.Context(), js, events.LeasesBucket, 1)
	if err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 10*time.Second, "the partition given back, its lease deleted, /readyz 503", func() bool {
		_, gerr := leases.Get(t.Context(), "p.1.0")
		code, body := readyz(t, svc)
		return tries.Load() > 0 && !svc.leaser.Holds(0) && errors.Is(gerr, jetstream.ErrKeyNotFound) &&
			code == http.StatusServiceUnavailable && strings.Contains(body, "not subscribed")
	})
	refuse.Store(false)
	nc, _ := leaseTestJS(t, srv.ClientURL())
	const model = "org/heard"
	keepReporting(t, nc, model)
	natstest.WaitFor(t, 15*time.Second, "the partition taken again, heard, and /readyz 200", func() bool {
		_, ok := busyRecord(t, js, model)
		code, _ := readyz(t, svc)
		return ok && svc.leaser.Valid(0) && code == http.StatusOK
	})
}

// TestLeasesClaimHigherEpochNotSubscribed: a takeover whose claim finds a
// record with a higher epoch (written between the lease's epoch and the
// claim) gives the partition up and does not subscribe to it; the
// partition is taken later under an epoch above that record's
// (issue 22, item 12).
func TestLeasesClaimHigherEpochNotSubscribed(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t))
	_, js := leaseTestJS(t, srv.ClientURL())
	busy, err := kvbucket.Open(t.Context(), js, events.BusyBucket, 1)
	if err != nil {
		t.Fatal(err)
	}
	const model = "org/higher"
	var once sync.Once
	var higher atomic.Uint64
	var subscribes atomic.Int32
	hooks := &serveHooks{
		acquire: func(_ int, epoch uint64) {
			once.Do(func() {
				set := events.BusySet{Model: model, MonitorID: "mon-later", Epoch: epoch + 5, Seq: 1,
					UpdatedAt: time.Now().UnixNano(), Busy: []uint64{}, Free: []uint64{1}, Stale: []uint64{}}
				data, err := events.MarshalBusySet(&set)
				if err != nil {
					t.Error(err)
					return
				}
				natstest.Put(t, busy, events.ModelKey(model), data)
				higher.Store(set.Epoch)
			})
		},
		subscribe: func(int) error { subscribes.Add(1); return nil },
	}
	svc := testService(t, func(o *serveOptions) { o.natsURL, o.hooks = srv.ClientURL(), hooks })
	// Settled: the first takeover's OnAcquire has returned.
	if n := subscribes.Load(); n != 0 || svc.intake.held[0].Load() {
		t.Fatalf("the partition given up by its claim was subscribed to (%d subscriptions)", n)
	}
	natstest.WaitFor(t, 10*time.Second, "the partition taken again above the record's epoch, and heard", func() bool {
		return svc.leaser.Epoch(0) > higher.Load() && subscribes.Load() == 1 && svc.intake.held[0].Load()
	})
}

// TestLeasesWarmupFromSubscription: the warm-up counts from when the
// partition is subscribed to, not from when it was taken: with a
// subscription that takes three warm-ups, the first record is still
// written a whole warm-up after it (issue 22, item 5).
func TestLeasesWarmupFromSubscription(t *testing.T) {
	t.Parallel()
	const warmup = 100 * time.Millisecond
	srv := natstest.Start(t, natstest.Options(t))
	nc, js := leaseTestJS(t, srv.ClientURL())
	busy, err := kvbucket.Open(t.Context(), js, events.BusyBucket, 1)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	w, err := busy.WatchAll(ctx, jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	const model = "org/warm"
	keepReporting(t, nc, model)
	var subscribed atomic.Int64
	hooks := &serveHooks{subscribe: func(int) error {
		// A slow subscription (a server busy reconnecting): the warm-up
		// counted from the take would be over by its end.
		time.Sleep(3 * warmup)
		subscribed.Store(time.Now().UnixNano())
		return nil
	}}
	testService(t, func(o *serveOptions) { o.natsURL, o.hooks, o.writer.Warmup = srv.ClientURL(), hooks, warmup })
	var first events.BusySet
	select {
	case e := <-w.Updates():
		if first, err = events.DecodeBusySet(e.Value()); err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no record written within 10s")
	}
	if at := subscribed.Load(); first.UpdatedAt < at+int64(warmup) {
		t.Errorf("first record written %v after the subscription, before the warm-up (%v) was over",
			time.Duration(first.UpdatedAt-at), warmup)
	}
}

// TestLeasesForeignNotReady: /readyz answers 503 while the leases bucket
// holds a lease of another --partitions, also on a monitor that was ready
// before, and the monitor gives its partitions back (issue 22, item 3).
func TestLeasesForeignNotReady(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t))
	svc := testService(t, func(o *serveOptions) { o.natsURL = srv.ClientURL() })
	if code, body := readyz(t, svc); code != http.StatusOK {
		t.Fatalf("/readyz %d before: %s", code, body)
	}
	_, js := leaseTestJS(t, srv.ClientURL())
	leases, err := kvbucket.Open(t.Context(), js, events.LeasesBucket, 1)
	if err != nil {
		t.Fatal(err)
	}
	natstest.Put(t, leases, "p.4.2", []byte(`{"monitor_id":"mon-four","instance":"four","epoch":1}`))
	natstest.WaitFor(t, 10*time.Second, "/readyz 503 and the partition given back", func() bool {
		code, body := readyz(t, svc)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "another --partitions") &&
			!svc.leaser.Holds(0)
	})
}
