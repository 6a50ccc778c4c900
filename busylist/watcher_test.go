package busylist

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
)

// watchTestEnv is a real in-process NATS server with a client.
type watchTestEnv struct {
	srv  *server.Server
	opts *server.Options
	js   jetstream.JetStream
}

func watchTestStart(t *testing.T) *watchTestEnv {
	t.Helper()
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	return &watchTestEnv{srv: srv, opts: opts, js: js}
}

// restart restarts the server on the same port and store.
func (e *watchTestEnv) restart(t *testing.T) {
	t.Helper()
	e.srv = natstest.Restart(t, e.srv, e.opts)
}

func (e *watchTestEnv) bucket(t *testing.T, name string) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	kv, err := kvbucket.Open(ctx, e.js, name, 1)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// watchTestPut puts a busy set, retrying until the server takes it (it may
// be restarting), and returns its revision.
func watchTestPut(t *testing.T, kv jetstream.KeyValue, set events.BusySet) uint64 {
	t.Helper()
	data, err := events.MarshalBusySet(&set)
	if err != nil {
		t.Fatal(err)
	}
	return watchTestPutRaw(t, kv, events.ModelKey(set.Model), data)
}

func watchTestPutRaw(t *testing.T, kv jetstream.KeyValue, key string, data []byte) uint64 {
	t.Helper()
	return natstest.Put(t, kv, key, data)
}

func watchTestWaitReady(t *testing.T, w interface{ WaitReady(context.Context) error }) {
	t.Helper()
	natstest.WaitReady(t, w)
}

func watchTestNew(t *testing.T, js jetstream.JetStream, opts ...WatchOption) *Watcher {
	t.Helper()
	w, err := NewWatcher(js, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	return w
}

// watchTestClock is a settable clock.
type watchTestClock struct{ ns atomic.Int64 }

func newWatchTestClock() *watchTestClock {
	c := &watchTestClock{}
	c.ns.Store(time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC).UnixNano())
	return c
}

func (c *watchTestClock) now() time.Time           { return time.Unix(0, c.ns.Load()) }
func (c *watchTestClock) add(d time.Duration)      { c.ns.Add(int64(d)) }
func (c *watchTestClock) at(d time.Duration) int64 { return c.ns.Load() + int64(d) }

// watchTestMetric returns a counter's or gauge's value from g, or -1 when
// there is no such series.
func watchTestMetric(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	if v, ok := promtest.Value(t, g, name, labels); ok {
		return v
	}
	return -1
}

// watchTestWantSeries checks one series of the metric name per entry of
// want: the series labelled as base plus key = the entry's key.
func watchTestWantSeries(t *testing.T, g prometheus.Gatherer, name string, base map[string]string, key string, want map[string]float64) {
	t.Helper()
	for val, w := range want {
		lbl := map[string]string{key: val}
		maps.Copy(lbl, base)
		if v := watchTestMetric(t, g, name, lbl); v != w {
			t.Errorf("%s%v = %v, want %v", name, lbl, v, w)
		}
	}
}

func watchTestSet(model string, now int64, free, busy []uint64) events.BusySet {
	return events.BusySet{
		Model:     model,
		Free:      free,
		Busy:      busy,
		AllBusy:   len(free) == 0 && len(busy) > 0,
		UpdatedAt: now,
		MonitorID: "test",
		Epoch:     1,
	}
}

func TestWatcherReadyAfterInitialValues(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	now := time.Now().UnixNano()
	models := []string{"Qwen/Qwen3-0.6B", "a b", "x=y"}
	for _, m := range models {
		watchTestPut(t, kv, watchTestSet(m, now, []uint64{1}, []uint64{2}))
	}
	reg := prometheus.NewRegistry()
	w := watchTestNew(t, env.js, WithRegisterer(reg))
	watchTestWaitReady(t, w)
	// Every initial value is in the first snapshot: no polling here.
	if !w.Ready() {
		t.Fatal("Ready false after WaitReady")
	}
	for _, m := range models {
		if d := w.Decide(m); d.Reason != admission.ReasonFree || !d.Admit {
			t.Errorf("Decide(%q) = %+v, want admitted free", m, d)
		}
		if rec, _, ok := w.Record(m); !ok || rec.Model != m {
			t.Errorf("Record(%q) = %+v, %v", m, rec, ok)
		}
	}
	if got := w.Models(); len(got) != len(models) {
		t.Errorf("Models() = %v", got)
	}
	lbl := map[string]string{"bucket": events.BusyBucket}
	if v := watchTestMetric(t, reg, "workermon_router_watch_ready", lbl); v != 1 {
		t.Errorf("ready gauge = %v", v)
	}
	if v := watchTestMetric(t, reg, "workermon_router_watch_keys", lbl); v != 3 {
		t.Errorf("keys gauge = %v", v)
	}
}

// TestWatcherManyModels loads and updates more records than a KV watcher's
// channel holds (256), so that batches are applied and published whole.
func TestWatcherManyModels(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	const n = 600
	now := time.Now().UnixNano()
	for i := range n {
		watchTestPut(t, kv, watchTestSet(fmt.Sprintf("m-%d", i), now, []uint64{1}, nil))
	}
	reg := prometheus.NewRegistry()
	w := watchTestNew(t, env.js, WithRegisterer(reg))
	watchTestWaitReady(t, w)
	if got := len(w.Models()); got != n {
		t.Fatalf("%d models after WaitReady, want %d", got, n)
	}
	for i := range n {
		watchTestPut(t, kv, watchTestSet(fmt.Sprintf("m-%d", i), now, nil, []uint64{1}))
	}
	natstest.WaitFor(t, 10*time.Second, "every model all busy", func() bool {
		for i := range n {
			if w.Decide(fmt.Sprintf("m-%d", i)).Reason != admission.ReasonAllBusy {
				return false
			}
		}
		return true
	})
	if v := watchTestMetric(t, reg, "workermon_router_watch_keys", map[string]string{"bucket": events.BusyBucket}); v != n {
		t.Errorf("keys gauge %v, want %d", v, n)
	}
}

func TestWatcherNotReadyWithoutServer(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	env.srv.Shutdown()
	env.srv.WaitForShutdown()
	w := watchTestNew(t, env.js)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if err := w.WaitReady(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitReady = %v, want deadline exceeded", err)
	}
	if d := w.Decide("m"); !d.Admit || d.Reason != admission.ReasonNotReady {
		t.Fatalf("Decide before ready = %+v", d)
	}
	start := time.Now()
	_ = w.Close()
	_ = w.Close() // idempotent
	if el := time.Since(start); el > 8*time.Second {
		t.Errorf("Close took %v", el)
	}
	if err := w.WaitReady(t.Context()); !errors.Is(err, ErrWatcherClosed) {
		t.Errorf("WaitReady after Close = %v, want ErrWatcherClosed", err)
	}
}

func TestWatcherDecisionTable(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	clock := newWatchTestClock()
	open := watchTestNew(t, env.js, WithClock(clock.now))
	closed := watchTestNew(t, env.js, WithClock(clock.now), WithFailOpen(false))
	watchTestWaitReady(t, open)
	watchTestWaitReady(t, closed)

	watchTestPut(t, kv, watchTestSet("free", clock.at(0), []uint64{1, 2}, []uint64{3}))
	watchTestPut(t, kv, watchTestSet("busy", clock.at(0), nil, []uint64{1, 2}))
	watchTestPut(t, kv, watchTestSet("only-stale-workers", clock.at(0), nil, nil))
	watchTestPut(t, kv, watchTestSet("old-updated-at", clock.at(-DefaultStaleListAfter-time.Nanosecond), []uint64{1}, nil))
	watchTestPut(t, kv, watchTestSet("edge-updated-at", clock.at(-DefaultStaleListAfter), nil, []uint64{1}))
	// updated_at far ahead: only the receive time can make it stale.
	watchTestPut(t, kv, watchTestSet("future", clock.at(time.Hour), nil, []uint64{1}))
	for _, w := range []*Watcher{open, closed} {
		natstest.WaitFor(t, 5*time.Second, "all records visible", func() bool { return len(w.Models()) == 6 })
	}

	type row struct {
		model      string
		openAdmit  bool
		closeAdmit bool
		reason     admission.Reason
		free, busy []uint64
	}
	check := func(t *testing.T, rows []row) {
		t.Helper()
		for _, r := range rows {
			for _, c := range []struct {
				w     *Watcher
				admit bool
			}{{open, r.openAdmit}, {closed, r.closeAdmit}} {
				d := c.w.Decide(r.model)
				if d.Admit != c.admit || d.Reason != r.reason || !watchTestEqualIDs(d.Free, r.free) || !watchTestEqualIDs(d.Busy, r.busy) ||
					(r.reason == admission.ReasonStale || r.reason == admission.ReasonUnknownModel) && (d.Free != nil || d.Busy != nil) {
					t.Errorf("failOpen=%v Decide(%q) = %+v, want admit=%v reason=%v free=%v busy=%v",
						c.w.policy.FailOpen, r.model, d, c.admit, r.reason, r.free, r.busy)
				}
			}
		}
	}
	t.Run("fresh", func(t *testing.T) {
		check(t, []row{
			{"unknown", true, true, admission.ReasonUnknownModel, nil, nil},
			{"free", true, true, admission.ReasonFree, []uint64{1, 2}, []uint64{3}},
			{"busy", false, false, admission.ReasonAllBusy, []uint64{}, []uint64{1, 2}},
			{"only-stale-workers", true, true, admission.ReasonFree, []uint64{}, []uint64{}},
			{"old-updated-at", true, false, admission.ReasonStale, nil, nil},
			{"edge-updated-at", false, false, admission.ReasonAllBusy, []uint64{}, []uint64{1}},
			{"future", false, false, admission.ReasonAllBusy, []uint64{}, []uint64{1}},
		})
	})
	t.Run("received exactly stale-list-after ago", func(t *testing.T) {
		clock.add(DefaultStaleListAfter)
		check(t, []row{{"future", false, false, admission.ReasonAllBusy, []uint64{}, []uint64{1}}})
	})
	t.Run("received more than stale-list-after ago", func(t *testing.T) {
		clock.add(time.Nanosecond)
		check(t, []row{
			{"future", true, false, admission.ReasonStale, nil, nil},
			{"free", true, false, admission.ReasonStale, nil, nil},
			{"busy", true, false, admission.ReasonStale, nil, nil},
			{"unknown", true, true, admission.ReasonUnknownModel, nil, nil},
		})
	})
}

// equalIDs compares worker lists; nil and empty are equal.
func watchTestEqualIDs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestWatcherUpdatesAndDeletes(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	w := watchTestNew(t, env.js)
	watchTestWaitReady(t, w)
	const model = "org/model-1.5"
	key := events.ModelKey(model)
	reason := func(want admission.Reason) func() bool {
		return func() bool { return w.Decide(model).Reason == want }
	}

	watchTestPut(t, kv, watchTestSet(model, time.Now().UnixNano(), []uint64{7}, nil))
	natstest.WaitFor(t, 5*time.Second, "put visible", reason(admission.ReasonFree))
	watchTestPut(t, kv, watchTestSet(model, time.Now().UnixNano(), nil, []uint64{7}))
	natstest.WaitFor(t, 5*time.Second, "all_busy visible", reason(admission.ReasonAllBusy))
	if err := kv.Delete(t.Context(), key); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "delete visible", reason(admission.ReasonUnknownModel))
	watchTestPut(t, kv, watchTestSet(model, time.Now().UnixNano(), nil, []uint64{7}))
	natstest.WaitFor(t, 5*time.Second, "put after delete visible", reason(admission.ReasonAllBusy))
	if err := kv.Purge(t.Context(), key); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "purge visible", reason(admission.ReasonUnknownModel))
}

func TestWatcherRecoversAfterRestart(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	watchTestPut(t, kv, watchTestSet("before", time.Now().UnixNano(), []uint64{1}, nil))
	reg := prometheus.NewRegistry()
	w := watchTestNew(t, env.js, WithRegisterer(reg))
	watchTestWaitReady(t, w)

	env.restart(t)
	watchTestPut(t, kv, watchTestSet("after", time.Now().UnixNano(), nil, []uint64{1}))
	// A watcher that is not re-created stalls for 10–20 s here.
	put := time.Now()
	natstest.WaitFor(t, 5*time.Second, "put after restart visible", func() bool {
		return w.Decide("after").Reason == admission.ReasonAllBusy
	})
	t.Logf("put after restart visible after %v", time.Since(put))
	if d := w.Decide("before"); d.Reason != admission.ReasonFree {
		t.Errorf("record from before the restart: %+v", d)
	}
	lbl := map[string]string{"bucket": events.BusyBucket, "reason": "reconnect"}
	if v := watchTestMetric(t, reg, "workermon_router_watch_rewatches_total", lbl); v < 1 {
		t.Errorf("reconnect re-watches = %v, want ≥ 1", v)
	}
	// Updates keep flowing on the new watch.
	watchTestPut(t, kv, watchTestSet("after", time.Now().UnixNano(), []uint64{1}, nil))
	natstest.WaitFor(t, 5*time.Second, "second put visible", func() bool {
		return w.Decide("after").Reason == admission.ReasonFree
	})
}

// watchTestNoConn hides the connection, so that the watcher gets no
// reconnect signal and must notice a stall with its probes.
type watchTestNoConn struct{ jetstream.JetStream }

func (watchTestNoConn) Conn() *nats.Conn { return nil }

func TestWatcherStallDetectedWithoutReconnectSignal(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	reg := prometheus.NewRegistry()
	w := watchTestNew(t, watchTestNoConn{env.js}, WithRegisterer(reg), WithProbeInterval(100*time.Millisecond))
	watchTestWaitReady(t, w)

	env.restart(t)
	watchTestPut(t, kv, watchTestSet("after", time.Now().UnixNano(), nil, []uint64{1}))
	// A stalled watcher stays silent for 10–20 s; the probes notice sooner.
	natstest.WaitFor(t, 5*time.Second, "put after restart visible", func() bool {
		return w.Decide("after").Reason == admission.ReasonAllBusy
	})
	lbl := map[string]string{"bucket": events.BusyBucket, "reason": "stalled"}
	if v := watchTestMetric(t, reg, "workermon_router_watch_rewatches_total", lbl); v < 1 {
		t.Errorf("stalled re-watches = %v, want ≥ 1", v)
	}
}

func TestWatcherBucketRecreated(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	now := time.Now().UnixNano()
	for range 3 {
		watchTestPut(t, kv, watchTestSet("old-1", now, []uint64{1}, nil))
		watchTestPut(t, kv, watchTestSet("old-2", now, []uint64{1}, nil))
	}
	reg := prometheus.NewRegistry()
	w := watchTestNew(t, env.js, WithRegisterer(reg), WithProbeInterval(50*time.Millisecond))
	watchTestWaitReady(t, w)
	if len(w.Models()) != 2 {
		t.Fatalf("models %v", w.Models())
	}

	if err := env.js.DeleteKeyValue(t.Context(), events.BusyBucket); err != nil {
		t.Fatal(err)
	}
	// The watcher may have recreated the bucket already; OpenBucket takes
	// either. Right after the delete the server may still refuse to create
	// the stream's store: retry. The new bucket's revisions start again
	// from 1.
	natstest.WaitFor(t, 5*time.Second, "bucket open again", func() bool {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		var err error
		kv, err = kvbucket.Open(ctx, env.js, events.BusyBucket, 1)
		return err == nil
	})
	rev := watchTestPut(t, kv, watchTestSet("new", time.Now().UnixNano(), nil, []uint64{1}))
	if rev >= 6 {
		t.Fatalf("revision %d did not go backwards", rev)
	}
	natstest.WaitFor(t, 5*time.Second, "new bucket's record visible and old ones gone", func() bool {
		m := w.Models()
		return len(m) == 1 && m[0] == "new"
	})
	if d := w.Decide("new"); d.Reason != admission.ReasonAllBusy {
		t.Errorf("Decide(new) = %+v", d)
	}
	var n float64
	for _, reason := range []string{"gone", "recreated"} {
		n += max(0, watchTestMetric(t, reg, "workermon_router_watch_rewatches_total",
			map[string]string{"bucket": events.BusyBucket, "reason": reason}))
	}
	if n < 1 {
		t.Errorf("no gone/recreated re-watch counted")
	}
	// Live updates flow on the new bucket.
	watchTestPut(t, kv, watchTestSet("new", time.Now().UnixNano(), []uint64{1}, nil))
	natstest.WaitFor(t, 5*time.Second, "update on the new bucket", func() bool {
		return w.Decide("new").Reason == admission.ReasonFree
	})
}

func TestWatcherBadRecords(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	reg := prometheus.NewRegistry()
	w := watchTestNew(t, env.js, WithRegisterer(reg))
	watchTestWaitReady(t, w)
	now := time.Now().UnixNano()

	// A good record, then garbage under its key: the model goes.
	watchTestPut(t, kv, watchTestSet("m", now, []uint64{1}, nil))
	natstest.WaitFor(t, 5*time.Second, "good record", func() bool { return w.Decide("m").Reason == admission.ReasonFree })
	watchTestPutRaw(t, kv, "m", []byte("\xc1 not msgpack"))
	natstest.WaitFor(t, 5*time.Second, "garbage removes the model", func() bool {
		return w.Decide("m").Reason == admission.ReasonUnknownModel
	})

	mismatch := watchTestSet("other", now, nil, []uint64{1})
	data, _ := events.MarshalBusySet(&mismatch)
	watchTestPutRaw(t, kv, "mm", data)
	bad := watchTestSet("inconsistent", now, []uint64{1}, []uint64{2})
	bad.AllBusy = true
	watchTestPut(t, kv, bad)
	watchTestPutRaw(t, kv, "bad=ZZkey", data)
	// A good record after the bad ones still gets through.
	watchTestPut(t, kv, watchTestSet("ok", now, nil, []uint64{3}))
	natstest.WaitFor(t, 5*time.Second, "good record after bad ones", func() bool {
		return w.Decide("ok").Reason == admission.ReasonAllBusy
	})
	for _, m := range []string{"mm", "other", "inconsistent"} {
		if d := w.Decide(m); d.Reason != admission.ReasonUnknownModel {
			t.Errorf("Decide(%q) = %+v, want unknown", m, d)
		}
	}
	watchTestWantSeries(t, reg, "workermon_router_watch_bad_records_total", map[string]string{"bucket": events.BusyBucket}, "reason",
		map[string]float64{"malformed": 1, "mismatch": 1, "inconsistent": 1, "bad_key": 1})
}

func TestWatchOptionsInvalid(t *testing.T) {
	t.Parallel()
	env := watchTestStart(t)
	for name, opt := range map[string]WatchOption{
		"stale zero":     WithStaleListAfter(0),
		"stale negative": WithStaleListAfter(-time.Second),
		"probe zero":     WithProbeInterval(0),
		"nil clock":      WithClock(nil),
		"nil logger":     WithLogger(nil),
		"replicas 0":     WithBucketReplicas(0),
		"replicas 6":     WithBucketReplicas(6),
	} {
		if _, err := NewWatcher(env.js, opt); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: NewWatcher error %v, want ErrInvalidOption", name, err)
		}
	}
	if _, err := NewWatcher(nil); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("nil JetStream: %v", err)
	}
}

// admitTestModels is a bucket's worth of records for the allocation test and
// the benchmark.
func admitTestModels(now time.Time) []events.BusySet {
	var recs []events.BusySet
	for i := range 50 {
		recs = append(recs, watchTestSet(fmt.Sprintf("org/model-%d.5B", i), now.UnixNano(),
			[]uint64{uint64(i), uint64(i + 100)}, []uint64{uint64(i + 200)}))
	}
	recs = append(recs, watchTestSet("busy/model", now.UnixNano(), nil, []uint64{1, 2}))
	return recs
}

func TestDecideAllocatesNothing(t *testing.T) { // not parallel: AllocsPerRun
	start := time.Now()
	clock := func() time.Time { return start }
	w := admitTestWatcher(true, clock, admitTestModels(start)...)
	stale := admitTestWatcher(true, func() time.Time { return start.Add(time.Minute) }, admitTestModels(start)...)
	for _, c := range []struct {
		w      *Watcher
		model  string
		reason admission.Reason
	}{
		{w, "org/model-7.5B", admission.ReasonFree},
		{admitTestWatcher(true, nil, admitTestModels(time.Now())...), "org/model-7.5B", admission.ReasonFree},
		{w, "busy/model", admission.ReasonAllBusy},
		{w, "not/there", admission.ReasonUnknownModel},
		{stale, "org/model-7.5B", admission.ReasonStale},
		{&Watcher{policy: admission.Policy{StaleAfter: DefaultStaleListAfter, FailOpen: true}, now: clock}, "org/model-7.5B", admission.ReasonNotReady},
	} {
		if d := c.w.Decide(c.model); d.Reason != c.reason {
			t.Fatalf("Decide(%q) = %+v, want %v", c.model, d, c.reason)
		}
		var sink admission.Decision
		if n := testing.AllocsPerRun(1000, func() { sink = c.w.Decide(c.model) }); n != 0 {
			t.Errorf("Decide(%q) (%v): %v allocs/op, want 0", c.model, c.reason, n)
		}
		_ = sink
	}
}

func BenchmarkDecide(b *testing.B) {
	// Each sub-benchmark gets records received when it starts: a record
	// turns stale (and is admitted, failing open) after stale-list-after.
	watcher := func() *Watcher {
		now := time.Now()
		return admitTestWatcher(true, nil, append(admitTestModels(now), classTestModels(now)...)...)
	}
	b.Run("free", func(b *testing.B) {
		w := watcher()
		b.ReportAllocs()
		for b.Loop() {
			if d := w.Decide("org/model-7.5B"); !d.Admit {
				b.Fatal("rejected")
			}
		}
	})
	b.Run("all_busy", func(b *testing.B) {
		w := watcher()
		b.ReportAllocs()
		for b.Loop() {
			if d := w.Decide("busy/model"); d.Admit {
				b.Fatal("admitted")
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		w := watcher()
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				_ = w.Decide("org/model-7.5B")
			}
		})
	})
	// By priority class (contract §15), on a record with free, amber, busy
	// and hard workers, among 50 other models.
	for _, c := range admission.Classes() {
		b.Run(c.String(), func(b *testing.B) {
			w := watcher()
			b.ReportAllocs()
			for b.Loop() {
				if d := w.DecideClass("mixed/model", c); !d.Admit {
					b.Fatal("rejected")
				}
			}
		})
	}
}

// TestWatcherWithMiddleware runs the whole router side: a record in the
// bucket, a Watcher, admission's Middleware.
func TestWatcherWithMiddleware(t *testing.T) {
	t.Parallel()
	kv, serve := watchTestMiddleware(t)
	status := func() int { s, _ := serve(""); return s }
	if s := status(); s != 200 {
		t.Fatalf("unknown model: %d", s)
	}
	watchTestPut(t, kv, watchTestSet("Qwen/Qwen3-0.6B", time.Now().UnixNano(), nil, []uint64{1, 2}))
	natstest.WaitFor(t, 5*time.Second, "503 once all busy", func() bool { return status() == 503 })
	watchTestPut(t, kv, watchTestSet("Qwen/Qwen3-0.6B", time.Now().UnixNano(), []uint64{2}, []uint64{1}))
	natstest.WaitFor(t, 5*time.Second, "200 once a worker is free", func() bool { return status() == 200 })
}

// watchTestMiddleware runs the whole router side: a server with the busy
// bucket, a Watcher of it, admission's Middleware in front of a handler
// answering 200. It returns the bucket and serve, which sends a request for
// model Qwen/Qwen3-0.6B with the given priority header (none when empty) and
// returns the status and body.
func watchTestMiddleware(t *testing.T) (jetstream.KeyValue, func(priority string) (int, string)) {
	t.Helper()
	env := watchTestStart(t)
	kv := env.bucket(t, events.BusyBucket)
	w := watchTestNew(t, env.js)
	watchTestWaitReady(t, w)
	m, err := admission.NewMiddleware(w, admission.WithModelFunc(admission.ModelFromHeader("X-Model")))
	if err != nil {
		t.Fatal(err)
	}
	h := m.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }))
	return kv, func(priority string) (int, string) {
		req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader("{}"))
		req.Header.Set("X-Model", "Qwen/Qwen3-0.6B")
		if priority != "" {
			req.Header.Set(admission.PriorityHeader, priority)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code, rec.Body.String()
	}
}

// admitTestWatcher is a Watcher holding recs, received now. A nil clock
// makes it timed, as NewWatcher without WithClock: records turn stale by
// timer, and Decide reads no clock.
func admitTestWatcher(failOpen bool, now func() time.Time, recs ...events.BusySet) *Watcher {
	w := &Watcher{policy: admission.Policy{StaleAfter: DefaultStaleListAfter, FailOpen: failOpen}, now: now}
	if now == nil {
		w.now, w.timed = time.Now, true
	}
	s := (*watcherSink)(w)
	s.Reset()
	for _, r := range recs {
		s.state.Edit()[r.Model] = w.newEntry(r, w.now())
	}
	s.Publish()
	return w
}

// TestDecideTimedStaleness: a timed Watcher marks a record stale when its
// receipt or its updated_at is older than the stale-list-after, by timer:
// Decide then answers stale without reading a clock.
func TestDecideTimedStaleness(t *testing.T) {
	t.Parallel()
	now := time.Now()
	fresh := watchTestSet("fresh/model", now.UnixNano(), []uint64{1}, nil)
	old := watchTestSet("old/model", now.Add(-time.Hour).UnixNano(), []uint64{1}, nil)
	w := admitTestWatcher(false, nil, fresh, old)
	// Long enough that the record is still fresh when first asked on a
	// loaded machine; for the entries armed from now on.
	const staleAfter = time.Second
	w.policy.StaleAfter = staleAfter
	s := (*watcherSink)(w)
	s.state.Edit()["fresh/model"] = w.newEntry(fresh, time.Now())
	s.Publish()
	if d := w.Decide("old/model"); d.Reason != admission.ReasonStale || d.Admit {
		t.Fatalf("a record updated an hour ago: %+v, want stale and rejected (fail closed)", d)
	}
	if d := w.Decide("fresh/model"); d.Reason != admission.ReasonFree {
		t.Fatalf("a fresh record: %+v", d)
	}
	natstest.WaitFor(t, 10*time.Second, "the record turned stale", func() bool {
		return w.Decide("fresh/model").Reason == admission.ReasonStale
	})
	// Measured from the record's updated_at (now), the earliest moment it
	// can turn stale from: a delay before the first Decide cannot make it
	// look early. The margin covers the wall clock the timer is set by.
	if el := time.Since(now); el < staleAfter-50*time.Millisecond {
		t.Fatalf("stale %v after its updated_at, before the %v stale-list-after", el, staleAfter)
	}
}

// TestFullRewatchStopsReplacedTimers: a full re-watch replaces the whole
// snapshot; the staleness timers of the entries it replaced stop when the
// new snapshot is published — not before, as routers read the old one
// until then — and those of a pending map never published stop when the
// next re-watch drops it. They were left armed, one per model and
// re-watch.
func TestFullRewatchStopsReplacedTimers(t *testing.T) {
	t.Parallel()
	w := &Watcher{now: time.Now, timed: true}
	w.policy.StaleAfter = time.Hour
	s := (*watcherSink)(w)
	const model = "Qwen/Qwen3-0.6B"
	put := func(rev uint64) {
		t.Helper()
		rec := watchTestSet(model, time.Now().UnixNano(), []uint64{1}, []uint64{2})
		b, err := events.MarshalBusySet(&rec)
		if err != nil {
			t.Fatal(err)
		}
		// A hand-written entry (lease_test.go's: the sink reads no bucket name).
		if err := s.Apply(leaseEntry{key: events.ModelKey(model), value: b, rev: rev, op: jetstream.KeyValuePut}, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	armed := func(e *busyEntry) bool { // Reset reports whether it was armed, and re-arms it
		return e.timer.Reset(time.Hour)
	}
	s.Reset()
	put(1)
	s.Publish()
	first := w.state.Load()[model]

	s.Reset() // a re-watch that ends before its initial values
	put(2)
	aborted := w.state.View()[model]
	if !armed(first) {
		t.Error("the published entry's timer stopped before its snapshot was replaced")
	}
	s.Reset() // the next one
	put(3)
	if armed(aborted) {
		t.Error("the timer of an entry never published is still armed after the re-watch dropped it")
	}
	s.Publish()
	if armed(first) {
		t.Error("the replaced entry's timer is still armed after the new snapshot was published")
	}
}
