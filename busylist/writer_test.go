package busylist_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/monitor"
)

// The Writer is the monitor's Sink; the assertion lives here so that the
// package itself does not import the monitor.
var _ monitor.PendingSink = (*busylist.Writer)(nil)

// writerWait is how long the tests wait for something over the network.
const writerWait = 5 * time.Second

// writerEnv is a NATS server with JetStream, a client of it and a metrics
// registry.
type writerEnv struct {
	opts *server.Options
	srv  *server.Server
	nc   *nats.Conn
	js   jetstream.JetStream
	reg  *prometheus.Registry
	logs *writerLogBuf
}

func newWriterEnv(t *testing.T) *writerEnv {
	t.Helper()
	e := &writerEnv{opts: natstest.Options(t), reg: prometheus.NewRegistry(), logs: &writerLogBuf{out: t.Output()}}
	e.srv = natstest.Start(t, e.opts)
	e.nc = natstest.Connect(t, e.srv)
	e.js = writerJetStream(t, e.nc)
	return e
}

func writerJetStream(t *testing.T, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream.New: %v", err)
	}
	return js
}

func (e *writerEnv) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// config returns a writer configuration for tests: no warm-up, a heartbeat
// too long to interfere, short timeouts and retries.
func (e *writerEnv) config() busylist.WriterConfig {
	cfg := busylist.DefaultWriterConfig()
	cfg.JetStream = e.js
	cfg.MonitorID = "test-monitor"
	cfg.Heartbeat = time.Hour
	cfg.Warmup = 0
	cfg.WriteTimeout = time.Second
	cfg.OrphanAfter = time.Hour
	cfg.RetryMin = 10 * time.Millisecond
	cfg.RetryMax = 100 * time.Millisecond
	cfg.Logger = e.logger()
	cfg.Registerer = e.reg
	return cfg
}

// run starts a writer until the end of the test and waits until it is ready.
func (e *writerEnv) run(t *testing.T, cfg busylist.WriterConfig) *busylist.Writer {
	t.Helper()
	w, err := busylist.NewWriter(cfg)
	if err != nil {
		t.Fatalf("NewWriter: %v", err)
	}
	natstest.Go(t, writerWait, w.Run)
	select {
	case <-w.Ready():
	case <-time.After(writerWait):
		t.Fatal("writer not ready")
	}
	return w
}

// bucket opens the busy bucket.
func (e *writerEnv) bucket(t *testing.T, name string) jetstream.KeyValue {
	t.Helper()
	kv, err := kvbucket.Open(t.Context(), e.js, name, 1)
	if err != nil {
		t.Fatalf("OpenBucket: %v", err)
	}
	return kv
}

// writerGet reads a model's record; ok is false when there is none.
func writerGet(t *testing.T, kv jetstream.KeyValue, model string) (rec events.BusySet, rev uint64, ok bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	e, err := kv.Get(ctx, events.ModelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return events.BusySet{}, 0, false
	}
	if err != nil {
		return events.BusySet{}, 0, false // NATS away: the poll tries again
	}
	rec, err = events.DecodeBusySet(e.Value())
	if err != nil {
		t.Fatalf("decode record of %s: %v", model, err)
	}
	return rec, e.Revision(), true
}

// writerEventually polls cond until it holds or writerWait passes.
func writerEventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	natstest.WaitFor(t, writerWait, what, cond)
}

// writerMetric returns the value of a counter or gauge, or the sample count
// of a histogram, with the given label pairs, from the registry.
func writerMetric(t *testing.T, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	v, ok := promtest.Value(t, g, name, want)
	if !ok {
		t.Fatalf("metric %s %v not found", name, labels)
	}
	return v
}

// writerLogBuf keeps the logs for inspection and copies them to the test
// output.
type writerLogBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
	out io.Writer
}

func (b *writerLogBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	return b.out.Write(p)
}

func (b *writerLogBuf) contains(s string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Contains(b.buf.String(), s)
}

// writerSet is a busy set with the given busy and free workers.
func writerSet(model string, busy, free []uint64) events.BusySet {
	s := events.BusySet{Model: model, Busy: busy, Free: free, Stale: []uint64{}, Reasons: map[string]string{}}
	for _, id := range busy {
		s.Reasons[strconv.FormatUint(id, 10)] = events.ReasonKV
	}
	s.AllBusy = len(busy) > 0 && len(free) == 0
	return s
}

// writerPut puts a record as another monitor would have.
func writerPut(t *testing.T, kv jetstream.KeyValue, rec events.BusySet) uint64 {
	t.Helper()
	data, err := events.MarshalBusySet(&rec)
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Put(t.Context(), events.ModelKey(rec.Model), data)
	if err != nil {
		t.Fatal(err)
	}
	return rev
}

// writerFakeJS stands for a JetStream in configuration tests.
type writerFakeJS struct{ jetstream.JetStream }

func TestWriterConfigValidate(t *testing.T) {
	t.Parallel()
	valid := busylist.DefaultWriterConfig()
	valid.JetStream = writerFakeJS{}
	valid.MonitorID = "m"
	tests := []struct {
		name   string
		mutate func(*busylist.WriterConfig)
		want   string // substring of the error; "" = valid
	}{
		{"defaults", func(*busylist.WriterConfig) {}, ""},
		{"no warm-up", func(c *busylist.WriterConfig) { c.Warmup = 0 }, ""},
		{"no JetStream", func(c *busylist.WriterConfig) { c.JetStream = nil }, "JetStream is nil"},
		{"no bucket", func(c *busylist.WriterConfig) { c.Bucket = "" }, "bucket name is empty"},
		{"replicas", func(c *busylist.WriterConfig) { c.Replicas = 6 }, "replicas"},
		{"no monitor id", func(c *busylist.WriterConfig) { c.MonitorID = "" }, "monitor id"},
		{"zero heartbeat", func(c *busylist.WriterConfig) { c.Heartbeat = 0 }, "heartbeat"},
		{"negative warm-up", func(c *busylist.WriterConfig) { c.Warmup = -time.Second }, "warm-up"},
		{"zero write timeout", func(c *busylist.WriterConfig) { c.WriteTimeout = 0 }, "write timeout"},
		{"zero orphan-after", func(c *busylist.WriterConfig) { c.OrphanAfter = 0 }, "orphan-after"},
		{"zero retry", func(c *busylist.WriterConfig) { c.RetryMin = 0 }, "retry minimum"},
		{"retry bounds swapped", func(c *busylist.WriterConfig) { c.RetryMin, c.RetryMax = time.Second, time.Millisecond }, "above the maximum"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := valid
			tt.mutate(&cfg)
			err := cfg.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate = %v, want an error about %q", err, tt.want)
			}
			if _, err := busylist.NewWriter(cfg); err == nil {
				t.Fatal("NewWriter accepted an invalid config")
			}
		})
	}
	t.Run("every problem joined", func(t *testing.T) {
		t.Parallel()
		err := (busylist.WriterConfig{}).Validate()
		var joined interface{ Unwrap() []error }
		if !errors.As(err, &joined) || len(joined.Unwrap()) < 7 {
			t.Fatalf("Validate of the zero config = %v, want every problem joined", err)
		}
	})
}

func TestWriterMetricsRegisteredOnce(t *testing.T) {
	t.Parallel()
	cfg := busylist.DefaultWriterConfig()
	cfg.JetStream = writerFakeJS{}
	cfg.MonitorID = "m"
	cfg.Registerer = prometheus.NewRegistry()
	if _, err := busylist.NewWriter(cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := busylist.NewWriter(cfg); err == nil {
		t.Fatal("a second writer registered the same metrics")
	}
}

func TestWriterCreatesBucket(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	if _, err := e.js.KeyValue(t.Context(), events.BusyBucket); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatalf("bucket before the writer: %v", err)
	}
	w := e.run(t, e.config())
	kv, err := e.js.KeyValue(t.Context(), events.BusyBucket)
	if err != nil {
		t.Fatalf("bucket after the writer: %v", err)
	}
	st, err := kv.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.History() != 1 {
		t.Errorf("history = %d, want 1", st.History())
	}
	if w.Epoch() != 1 {
		t.Errorf("epoch of an empty bucket = %d, want 1", w.Epoch())
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_epoch"); got != 1 {
		t.Errorf("epoch gauge = %v, want 1", got)
	}
	if err := w.Run(t.Context()); !errors.Is(err, busylist.ErrWriterRunning) {
		t.Errorf("second Run = %v, want ErrWriterRunning", err)
	}
}

func TestWriterWarmupKeepsExistingRecords(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	old := writerSet("Qwen/Qwen3-0.6B", []uint64{1}, nil)
	old.MonitorID, old.Epoch, old.Seq = "old-monitor", 4, 99
	oldRev := writerPut(t, kv, old)
	other := writerSet("other", nil, []uint64{2})
	other.MonitorID, other.Epoch = "older-monitor", 2
	otherRev := writerPut(t, kv, other)
	if _, err := kv.Put(t.Context(), "garbage", []byte("not msgpack")); err != nil {
		t.Fatal(err)
	}

	const warmup = 400 * time.Millisecond
	cfg := e.config()
	cfg.Warmup = warmup
	cfg.Heartbeat = 100 * time.Millisecond
	w, err := busylist.NewWriter(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Sets before Run are kept too.
	w.Set(writerSet("Qwen/Qwen3-0.6B", nil, []uint64{1, 3}))
	natstest.Go(t, writerWait, w.Run)
	select {
	case <-w.Ready():
	case <-time.After(writerWait):
		t.Fatal("writer not ready")
	}
	readyAt := time.Now()
	w.Set(writerSet("new", []uint64{7}, []uint64{8}))

	if got := w.Epoch(); got != 5 {
		t.Errorf("epoch = %d, want 1 + the highest epoch in the bucket = 5", got)
	}
	if got, want := w.Models(), []string{"Qwen/Qwen3-0.6B", "garbage", "new", "other"}; !slices.Equal(got, want) {
		t.Errorf("Models = %q, want %q", got, want)
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_unreadable_records_total"); got != 1 {
		t.Errorf("unreadable records = %v, want 1", got)
	}
	// Still warming up: the old records are as they were, nothing new.
	if rec, rev, _ := writerGet(t, kv, old.Model); rev != oldRev || rec.MonitorID != "old-monitor" {
		t.Fatalf("record rewritten during the warm-up: rev %d (want %d), %+v", rev, oldRev, rec)
	}
	if _, _, ok := writerGet(t, kv, "new"); ok {
		t.Fatal("record written during the warm-up")
	}

	var rec events.BusySet
	writerEventually(t, "the first write", func() bool {
		var ok bool
		rec, _, ok = writerGet(t, kv, "new")
		return ok
	})
	if waited := time.Since(readyAt); waited < warmup-100*time.Millisecond {
		t.Errorf("first write %v after start, want after the %v warm-up", waited, warmup)
	}
	if rec.Epoch != 5 || rec.MonitorID != "test-monitor" || !slices.Equal(rec.Busy, []uint64{7}) {
		t.Errorf("new record = %+v", rec)
	}
	writerEventually(t, "the existing record rewritten", func() bool {
		rec, _, _ = writerGet(t, kv, old.Model)
		return rec.Epoch == 5
	})
	if !slices.Equal(rec.Free, []uint64{1, 3}) || len(rec.Busy) != 0 || rec.AllBusy {
		t.Errorf("rewritten record = %+v, want the content set before Run", rec)
	}
	// A record never set again is left alone (until OrphanAfter).
	if _, rev, ok := writerGet(t, kv, "other"); !ok || rev != otherRev {
		t.Errorf("record of a model not set: rev %d ok %v, want untouched rev %d", rev, ok, otherRev)
	}
}

func TestWriterWritesOnlyChanges(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	w := e.run(t, e.config())
	kv := e.bucket(t, events.BusyBucket)

	w.Set(writerSet("a", []uint64{1, 2}, []uint64{3}))
	var first events.BusySet
	var rev1 uint64
	writerEventually(t, "a written", func() bool {
		var ok bool
		first, rev1, ok = writerGet(t, kv, "a")
		return ok
	})

	// The same content in new slices, and nil where it was empty, then b:
	// once b is written, the second set of a has been seen.
	same := writerSet("a", []uint64{1, 2}, []uint64{3})
	same.Stale = nil
	w.Set(same)
	w.Set(writerSet("b", nil, []uint64{4}))
	writerEventually(t, "b written", func() bool { _, _, ok := writerGet(t, kv, "b"); return ok })
	if _, rev, _ := writerGet(t, kv, "a"); rev != rev1 {
		t.Fatalf("unchanged set rewrote a: revision %d → %d", rev1, rev)
	}

	changed := writerSet("a", []uint64{1}, []uint64{2, 3})
	changed.Thresholds.ActivePrefillTokens = events.Ptr[uint64](100)
	w.Set(changed)
	var rec events.BusySet
	writerEventually(t, "a rewritten", func() bool {
		var rev uint64
		rec, rev, _ = writerGet(t, kv, "a")
		return rev > rev1
	})
	if !slices.Equal(rec.Busy, []uint64{1}) || !slices.Equal(rec.Free, []uint64{2, 3}) ||
		rec.Thresholds.ActivePrefillTokens == nil || *rec.Thresholds.ActivePrefillTokens != 100 {
		t.Errorf("a = %+v, want the changed content", rec)
	}
	if rec.Seq <= first.Seq {
		t.Errorf("seq %d after %d, want it to increase", rec.Seq, first.Seq)
	}
	// Puts are asynchronous: a watcher can see a record before the writer
	// has its acknowledgement and counts the write, so wait for the ack.
	writerEventually(t, "the third put acknowledged", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_pending_records") == 0 &&
			writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_change") >= 3
	})
	if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_change"); got != 3 {
		t.Errorf("put_change writes = %v, want 3", got)
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_heartbeat"); got != 0 {
		t.Errorf("put_heartbeat writes = %v, want 0", got)
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_write_duration_seconds"); got != 3 {
		t.Errorf("write duration samples = %v, want 3", got)
	}
	if got := writerMetric(t, e.reg, "workermon_busy_writer_pending_records"); got != 0 {
		t.Errorf("pending = %v, want 0", got)
	}
}

// TestWriterWritesQueueChanges: a change of the routers' queues alone
// (contract §22) is a change of content: written.
func TestWriterWritesQueueChanges(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	w := e.run(t, e.config())
	kv := e.bucket(t, events.BusyBucket)
	w.Set(writerSet("a", nil, []uint64{1}))
	var rev1 uint64
	writerEventually(t, "a written", func() bool { _, rev, ok := writerGet(t, kv, "a"); rev1 = rev; return ok })
	queued := writerSet("a", nil, []uint64{1})
	queued.QueuedBy, queued.Queued = map[string]map[int64]uint64{"router/r": {0: 3}}, map[int64]uint64{0: 3}
	w.Set(queued)
	writerEventually(t, "a rewritten with its queues", func() bool {
		rec, rev, _ := writerGet(t, kv, "a")
		return rev > rev1 && rec.QueuedBy["router/r"][0] == 3 && rec.Queued[0] == 3
	})
}

func TestWriterHeartbeat(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	const heartbeat = 100 * time.Millisecond
	cfg := e.config()
	cfg.Heartbeat = heartbeat
	base := time.Unix(1_800_000_000, 0)
	var ticks atomic.Int64
	cfg.Now = func() time.Time { return base.Add(time.Duration(ticks.Add(1)) * time.Millisecond) }
	w := e.run(t, cfg)
	kv := e.bucket(t, events.BusyBucket)

	watch, err := kv.Watch(t.Context(), events.ModelKey("hb"), jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Stop()
	want := writerSet("hb", []uint64{1}, []uint64{2})
	w.Set(want)

	var prev events.BusySet
	var prevAt time.Time
	for i := range 5 {
		var entry jetstream.KeyValueEntry
		select {
		case entry = <-watch.Updates():
		case <-time.After(writerWait):
			t.Fatalf("put %d not seen", i)
		}
		at := time.Now()
		rec, err := events.DecodeBusySet(entry.Value())
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(rec.Busy, want.Busy) || !slices.Equal(rec.Free, want.Free) {
			t.Fatalf("put %d = %+v, want the unchanged content", i, rec)
		}
		if rec.UpdatedAt <= base.UnixNano() {
			t.Fatalf("updated_at %d not from the injected clock", rec.UpdatedAt)
		}
		if i > 0 {
			if rec.Seq <= prev.Seq || rec.UpdatedAt <= prev.UpdatedAt {
				t.Fatalf("put %d: seq %d updated_at %d after seq %d updated_at %d, want both to increase",
					i, rec.Seq, rec.UpdatedAt, prev.Seq, prev.UpdatedAt)
			}
			// Generous: the bound is the heartbeat plus scheduling under -race.
			if gap := at.Sub(prevAt); gap > 5*heartbeat {
				t.Errorf("put %d came %v after the previous one, heartbeat %v", i, gap, heartbeat)
			}
		}
		prev, prevAt = rec, at
	}
	// The watch may see a put before the writer has its ack.
	writerEventually(t, "4 heartbeats counted", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "put_heartbeat") >= 4
	})
}

func TestWriterDelete(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	w := e.run(t, e.config())
	kv := e.bucket(t, events.BusyBucket)

	w.Set(writerSet("a", nil, []uint64{1}))
	w.Set(writerSet("b", nil, []uint64{2}))
	writerEventually(t, "a and b written", func() bool {
		_, _, a := writerGet(t, kv, "a")
		_, _, b := writerGet(t, kv, "b")
		return a && b
	})
	w.Delete("a")
	writerEventually(t, "a deleted", func() bool { _, _, ok := writerGet(t, kv, "a"); return !ok })
	if _, _, ok := writerGet(t, kv, "b"); !ok {
		t.Fatal("b deleted too")
	}
	// A model never written: nothing to delete. c is the barrier.
	w.Delete("never")
	w.Set(writerSet("c", nil, []uint64{3}))
	writerEventually(t, "c written", func() bool { _, _, ok := writerGet(t, kv, "c"); return ok })
	// The delete's answer may reach the writer after the watcher saw it.
	writerEventually(t, "the delete counted", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "delete") >= 1
	})
	if got := writerMetric(t, e.reg, "workermon_busy_writer_writes_total", "kind", "delete"); got != 1 {
		t.Errorf("deletes = %v, want 1", got)
	}
	if got, want := w.Models(), []string{"b", "c"}; !slices.Equal(got, want) {
		t.Errorf("Models = %q, want %q", got, want)
	}
	// Set again after a delete: written again.
	w.Set(writerSet("a", nil, []uint64{1}))
	writerEventually(t, "a written again", func() bool { _, _, ok := writerGet(t, kv, "a"); return ok })
}

func TestWriterEncodesEmptyListsAsArrays(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	w := e.run(t, e.config())
	kv := e.bucket(t, events.BusyBucket)

	w.Set(events.BusySet{Model: "empty"}) // nil lists and map
	var raw []byte
	writerEventually(t, "record written", func() bool {
		entry, err := kv.Get(t.Context(), "empty")
		if err == nil {
			raw = entry.Value()
		}
		return err == nil
	})
	var m map[string]any
	if err := msgpack.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"busy", "free", "stale"} {
		if l, ok := m[key].([]any); !ok || l == nil || len(l) != 0 {
			t.Errorf("%s = %#v, want an empty array", key, m[key])
		}
	}
	if r, ok := m["reasons"].(map[string]any); !ok || r == nil || len(r) != 0 {
		t.Errorf("reasons = %#v, want an empty map", m["reasons"])
	}
	if th, ok := m["thresholds"].(map[string]any); !ok || len(th) != 0 {
		t.Errorf("thresholds = %#v, want an empty map (all unset)", m["thresholds"])
	}
	for key, want := range map[string]any{"v": int64(1), "epoch": int64(1), "seq": int64(1)} {
		if got, ok := writerInt(m[key]); !ok || got != want {
			t.Errorf("%s = %#v, want %v", key, m[key], want)
		}
	}
	if m["model"] != "empty" || m["monitor_id"] != "test-monitor" || m["all_busy"] != false {
		t.Errorf("record = %#v", m)
	}
	if _, ok := writerInt(m["updated_at"]); !ok {
		t.Errorf("updated_at = %#v, want an integer", m["updated_at"])
	}
}

// writerInt converts any msgpack integer to int64.
func writerInt(v any) (int64, bool) {
	switch x := v.(type) {
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	case uint64:
		return int64(x), true
	}
	return 0, false
}

func TestWriterSurvivesNATSRestart(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	cfg := e.config()
	cfg.Heartbeat = 100 * time.Millisecond
	cfg.WriteTimeout = 200 * time.Millisecond
	w := e.run(t, cfg)
	kv := e.bucket(t, events.BusyBucket)

	w.Set(writerSet("a", nil, []uint64{1}))
	writerEventually(t, "a written", func() bool { _, _, ok := writerGet(t, kv, "a"); return ok })

	port := e.srv.Addr().(*net.TCPAddr).Port
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
	w.Set(writerSet("a", []uint64{1}, nil))
	w.Set(writerSet("b", nil, []uint64{2}))
	writerEventually(t, "failed writes", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_errors_total", "kind", "put_change")+
			writerMetric(t, e.reg, "workermon_busy_writer_errors_total", "kind", "put_heartbeat") > 0
	})
	// A failed write goes back to pending after its error is counted.
	writerEventually(t, "records pending while NATS is away", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_pending_records") >= 1
	})

	opts := e.opts.Clone()
	opts.Port = port
	natstest.Start(t, opts)
	writerEventually(t, "catch-up after the restart", func() bool {
		a, _, _ := writerGet(t, kv, "a")
		_, _, b := writerGet(t, kv, "b")
		return b && a.AllBusy
	})
	writerEventually(t, "recovery logged", func() bool { return e.logs.contains("recovered") })
	_, rev, _ := writerGet(t, kv, "a")
	writerEventually(t, "heartbeats after the restart", func() bool {
		_, now, _ := writerGet(t, kv, "a")
		return now > rev
	})
}

func TestWriterStop(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		warmup  time.Duration
		written bool
	}{
		{"final flush", 0, true},
		{"nothing during the warm-up", time.Hour, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newWriterEnv(t)
			cfg := e.config()
			cfg.Warmup = tt.warmup
			w, err := busylist.NewWriter(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- w.Run(ctx) }()
			select {
			case <-w.Ready():
			case <-time.After(writerWait):
				t.Fatal("writer not ready")
			}
			w.Set(writerSet("a", nil, []uint64{1}))
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("Run = %v", err)
				}
			case <-time.After(writerWait):
				t.Fatal("Run did not return")
			}
			_, _, ok := writerGet(t, e.bucket(t, events.BusyBucket), "a")
			if ok != tt.written {
				t.Errorf("record written = %v, want %v", ok, tt.written)
			}
		})
	}
}

func TestWriterDeletesOrphans(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	writerPut(t, kv, writerSet("orphan", nil, []uint64{1}))
	writerPut(t, kv, writerSet("adopted", nil, []uint64{2}))

	cfg := e.config()
	cfg.Heartbeat = 50 * time.Millisecond
	cfg.OrphanAfter = 200 * time.Millisecond
	w := e.run(t, cfg)
	w.Set(writerSet("adopted", []uint64{2}, nil))

	writerEventually(t, "the orphan deleted", func() bool { _, _, ok := writerGet(t, kv, "orphan"); return !ok })
	rec, _, ok := writerGet(t, kv, "adopted")
	if !ok || rec.MonitorID != "test-monitor" || !rec.AllBusy {
		t.Errorf("adopted record = %+v (ok %v), want this writer's", rec, ok)
	}
	if got, want := w.Models(), []string{"adopted"}; !slices.Equal(got, want) {
		t.Errorf("Models = %q, want %q", got, want)
	}
}

func TestWriterHoldsUntilReleased(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	cfg := e.config()
	cfg.Warmup = 0
	hold := make(chan struct{})
	cfg.HoldUntil = hold
	w := e.run(t, cfg)
	w.Set(writerSet("m", []uint64{1}, nil))
	// The loop has taken the change in and holds it: a writer that did not
	// hold would have written it in the same pass and shown nothing pending.
	writerEventually(t, "the change pending", func() bool {
		return writerMetric(t, e.reg, "workermon_busy_writer_pending_records") == 1
	})
	if _, _, ok := writerGet(t, kv, "m"); ok {
		t.Fatal("record written while held")
	}
	close(hold)
	writerEventually(t, "record written once released", func() bool {
		_, _, ok := writerGet(t, kv, "m")
		return ok
	})
}

// TestWriterNotPendingDuringWarmup: a record handed over during the warm-up
// is not reported pending (monitor.PendingSink), so the monitor keeps
// replacing it and the first write carries its latest view; once the
// warm-up is over an unwritten record is pending again.
func TestWriterNotPendingDuringWarmup(t *testing.T) {
	t.Parallel()
	e := newWriterEnv(t)
	kv := e.bucket(t, events.BusyBucket)
	const warmup = 500 * time.Millisecond
	cfg := e.config()
	cfg.Warmup = warmup
	w := e.run(t, cfg)
	const model = "Qwen/Qwen3-0.6B"
	w.Set(writerSet(model, nil, nil)) // a partial view: nothing heard yet
	if w.Pending(model) {
		t.Error("a record set during the warm-up is reported pending: the monitor would defer the next one")
	}
	w.Set(writerSet(model, []uint64{1}, []uint64{2})) // the view the warm-up built
	var rec events.BusySet
	writerEventually(t, "the first write", func() bool {
		var ok bool
		rec, _, ok = writerGet(t, kv, model)
		return ok
	})
	if !slices.Equal(rec.Busy, []uint64{1}) || !slices.Equal(rec.Free, []uint64{2}) {
		t.Errorf("first write after the warm-up %+v, want the latest view busy [1] free [2]", rec)
	}
	if w.Pending(model) {
		t.Error("a written record is still pending")
	}
}

// readFailJS is a JetStream whose streams fail every read of a subject's
// last message while fail is set, as every request does at once while the
// connection reconnects with its buffer off (ReconnectBufSize(-1), natsconn).
type readFailJS struct {
	jetstream.JetStream
	fail  *atomic.Bool
	reads *atomic.Int64 // reads failed
}

func (j readFailJS) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	s, err := j.JetStream.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return readFailStream{Stream: s, fail: j.fail, reads: j.reads}, nil
}

type readFailStream struct {
	jetstream.Stream
	fail  *atomic.Bool
	reads *atomic.Int64
}

func (s readFailStream) GetLastMsgForSubject(ctx context.Context, subject string) (*jetstream.RawStreamMsg, error) {
	if s.fail.Load() {
		s.reads.Add(1)
		return nil, errors.New("nats: outbound buffer limit exceeded")
	}
	return s.Stream.GetLastMsgForSubject(ctx, subject)
}

// TestWriterConflictReadBacksOff: a key whose write failed its
// compare-and-set is read back; while that read fails (NATS away) it is
// tried again after the key's backoff, not at once (it was: 26,000 reads
// of one key in half a second, a core spinning for the whole outage), and
// the record is written once reads work again. RetryMin 10 ms and RetryMax
// 100 ms allow about 8 reads in half a second; the bound is loose so that
// a slow machine cannot fail it.
func TestWriterConflictReadBacksOff(t *testing.T) {
	e := newWriterEnv(t)
	fail, reads := new(atomic.Bool), new(atomic.Int64)
	cfg := e.config()
	cfg.JetStream = readFailJS{JetStream: e.js, fail: fail, reads: reads}
	w := e.run(t, cfg)
	kv := e.bucket(t, events.BusyBucket)
	const model = "org/resolve"
	w.Set(writerSet(model, nil, []uint64{1}))
	writerEventually(t, "first record written", func() bool {
		_, _, ok := writerGet(t, kv, model)
		return ok
	})
	// Another put changes the key's revision: the writer's next write
	// fails its compare-and-set, and its read back fails.
	writerPut(t, kv, writerSet(model, nil, []uint64{9}))
	fail.Store(true)
	w.Set(writerSet(model, []uint64{1}, nil))
	writerEventually(t, "the read after the conflict", func() bool { return reads.Load() > 0 })
	time.Sleep(500 * time.Millisecond)
	n := reads.Load()
	fail.Store(false)
	if n > 50 {
		t.Fatalf("%d failed reads of one key in 0.5 s: the read after a conflict is retried without backoff", n)
	}
	writerEventually(t, "the record written once reads work", func() bool {
		rec, _, ok := writerGet(t, kv, model)
		return ok && slices.Equal(rec.Busy, []uint64{1})
	})
}
