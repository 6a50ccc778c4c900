package overrides_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/overrides"
)

// threshStore returns a store of the thresholds bucket over js.
func threshStore(t *testing.T, js jetstream.JetStream) *overrides.ThresholdStore {
	t.Helper()
	cfg := overrides.DefaultThresholdStoreConfig()
	cfg.JetStream = js
	s, err := overrides.NewThresholdStore(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// threshChange is one OnChange call.
type threshChange struct {
	model   string
	t       events.Thresholds
	deleted bool
}

// threshWatch runs a watcher over js until the end of the test and returns
// it with the channel of its changes.
func threshWatch(t *testing.T, e *testEnv, js jetstream.JetStream) (*overrides.ThresholdWatcher, chan threshChange) {
	t.Helper()
	changes := make(chan threshChange, 100)
	cfg := overrides.DefaultThresholdWatcherConfig()
	cfg.JetStream = js
	cfg.RetryMin, cfg.RetryMax = 10*time.Millisecond, 100*time.Millisecond
	cfg.Logger = e.logger(t)
	cfg.Registerer = e.reg
	cfg.OnChange = func(model string, t events.Thresholds, deleted bool) {
		changes <- threshChange{model, t, deleted}
	}
	w, err := overrides.NewThresholdWatcher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	natstest.Go(t, testWait, w.Run)
	return w, changes
}

// threshNext returns the next change, failing after testWait.
func threshNext(t *testing.T, changes <-chan threshChange) threshChange {
	t.Helper()
	select {
	case c := <-changes:
		return c
	case <-time.After(testWait):
		t.Fatal("no change delivered")
		return threshChange{}
	}
}

// threshExpect checks the next change.
func threshExpect(t *testing.T, changes <-chan threshChange, model string, want events.Thresholds, deleted bool) {
	t.Helper()
	c := threshNext(t, changes)
	if c.model != model || c.deleted != deleted || !c.t.Equal(want) {
		t.Fatalf("change = %s %+v deleted=%v, want %s %+v deleted=%v", c.model, c.t, c.deleted, model, want, deleted)
	}
}

// threshSynced waits for the watcher's initial values.
func threshSynced(t *testing.T, w *overrides.ThresholdWatcher) {
	t.Helper()
	select {
	case <-w.Synced():
	case <-time.After(testWait):
		t.Fatal("watcher not synced")
	}
}

func TestThresholdConfigValidate(t *testing.T) {
	t.Parallel()
	store := overrides.DefaultThresholdStoreConfig()
	store.JetStream = fakeJS{}
	watcher := overrides.DefaultThresholdWatcherConfig()
	watcher.JetStream = fakeJS{}
	watcher.OnChange = func(string, events.Thresholds, bool) {}
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"store defaults", store.Validate(), ""},
		{"watcher defaults", watcher.Validate(), ""},
		{"store zero", (overrides.ThresholdStoreConfig{}).Validate(), "timeout"},
		{"watcher zero", (overrides.ThresholdWatcherConfig{}).Validate(), "OnChange is nil"},
		{"watcher retry", func() error {
			c := watcher
			c.RetryMax = -1
			return c.Validate()
		}(), "retry maximum"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			switch {
			case tt.want == "" && tt.err != nil:
				t.Fatalf("Validate: %v", tt.err)
			case tt.want != "" && (tt.err == nil || !strings.Contains(tt.err.Error(), tt.want)):
				t.Fatalf("Validate = %v, want an error about %q", tt.err, tt.want)
			}
		})
	}
}

func TestThresholdStore(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	s := threshStore(t, e.js)
	ctx := t.Context()
	const model = "Qwen/Qwen3-0.6B"

	if _, found, err := s.Get(ctx, model); err != nil || found {
		t.Fatalf("Get of no override = found %v, %v", found, err)
	}
	set := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.9)}
	if err := s.Set(ctx, model, set); err != nil {
		t.Fatal(err)
	}
	got, found, err := s.Get(ctx, model)
	if err != nil || !found || !got.Equal(set) {
		t.Fatalf("Get = %+v, %v, %v; want %+v", got, found, err, set)
	}

	// Merge keeps what the patch does not set.
	merged, err := s.Merge(ctx, model, events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](512)})
	want := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.9), ActivePrefillTokens: events.Ptr[uint64](512)}
	if err != nil || !merged.Equal(want) {
		t.Fatalf("Merge = %+v, %v; want %+v", merged, err, want)
	}
	if got, _, _ := s.Get(ctx, model); !got.Equal(want) {
		t.Fatalf("Get after Merge = %+v, want %+v", got, want)
	}
	// The thresholds of contract §21 merge like the others, and are stored
	// under their contract names.
	merged, err = s.Merge(ctx, model, events.Thresholds{KVCommitted: events.Ptr(1.5), QueueDelayMs: events.Ptr[uint64](250)})
	want.KVCommitted, want.QueueDelayMs = events.Ptr(1.5), events.Ptr[uint64](250)
	if err != nil || !merged.Equal(want) {
		t.Fatalf("Merge = %+v, %v; want %+v", merged, err, want)
	}
	if e, err := e.bucket(t, events.ThresholdsBucket).Get(ctx, events.ModelKey(model)); err != nil ||
		!strings.Contains(string(e.Value()), `"kv_committed_threshold":1.5,"queue_delay_threshold_ms":250`) {
		t.Fatalf("stored %s, %v", e.Value(), err)
	}
	// A patch that sets nothing is a get.
	if got, err := s.Merge(ctx, model, events.Thresholds{}); err != nil || !got.Equal(want) {
		t.Fatalf("empty Merge = %+v, %v", got, err)
	}
	// Set replaces the whole override.
	if err := s.Set(ctx, model, events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.5)}); err != nil {
		t.Fatal(err)
	}
	if got, _, _ := s.Get(ctx, model); got.ActiveDecodeBlocks != nil || got.ActivePrefillTokensFrac == nil {
		t.Fatalf("Get after Set = %+v, want only the frac", got)
	}
	// Merge of a model without an override creates it.
	if got, err := s.Merge(ctx, "other", events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](0)}); err != nil ||
		got.ActivePrefillTokens == nil || *got.ActivePrefillTokens != 0 {
		t.Fatalf("Merge of a new model = %+v, %v", got, err)
	}

	list, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[model].ActivePrefillTokensFrac == nil || list["other"].ActivePrefillTokens == nil {
		t.Fatalf("List = %+v", list)
	}

	if err := s.Delete(ctx, model); err != nil {
		t.Fatal(err)
	}
	if _, found, err := s.Get(ctx, model); err != nil || found {
		t.Fatalf("Get after Delete = found %v, %v", found, err)
	}
	// Merge after a delete creates the key again.
	if _, err := s.Merge(ctx, model, events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.1)}); err != nil {
		t.Fatalf("Merge after Delete: %v", err)
	}

	// Invalid input is rejected before any write.
	bad := []struct {
		name  string
		model string
		t     events.Thresholds
		want  error
	}{
		{"empty model", "", events.Thresholds{}, events.ErrInvalidModel},
		{"decode above 1", model, events.Thresholds{ActiveDecodeBlocks: events.Ptr(1.5)}, events.ErrOutOfRange},
		{"negative frac", model, events.Thresholds{ActivePrefillTokensFrac: events.Ptr(-0.1)}, events.ErrOutOfRange},
		{"committed above 4", model, events.Thresholds{KVCommitted: events.Ptr(4.5)}, events.ErrOutOfRange},
	}
	for _, tt := range bad {
		if err := s.Set(ctx, tt.model, tt.t); !errors.Is(err, tt.want) {
			t.Errorf("Set %s = %v, want %v", tt.name, err, tt.want)
		}
		if _, err := s.Merge(ctx, tt.model, tt.t); !errors.Is(err, tt.want) {
			t.Errorf("Merge %s = %v, want %v", tt.name, err, tt.want)
		}
	}

	// A value that is not an override: Get says so, List skips it, Merge
	// replaces it.
	kv := e.bucket(t, events.ThresholdsBucket)
	if _, err := kv.PutString(ctx, "junk", `{"active_decode_blocks_threshold":"high"}`); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Get(ctx, "junk"); !errors.Is(err, overrides.ErrBadOverride) {
		t.Errorf("Get of junk = %v, want ErrBadOverride", err)
	}
	if list, err := s.List(ctx); err != nil || len(list) != 2 {
		t.Errorf("List with junk = %+v, %v; want the 2 valid overrides", list, err)
	}
	if got, err := s.Merge(ctx, "junk", events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](1)}); err != nil ||
		got.ActiveDecodeBlocks != nil || got.ActivePrefillTokens == nil {
		t.Errorf("Merge over junk = %+v, %v", got, err)
	}
}

func TestThresholdStoreConcurrentMerge(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	// Three stores on three connections, as three monitor replicas.
	stores := []*overrides.ThresholdStore{
		threshStore(t, e.js),
		threshStore(t, testJetStream(t, natstest.Connect(t, e.srv))),
		threshStore(t, testJetStream(t, natstest.Connect(t, e.srv))),
	}
	patches := []func(i int) events.Thresholds{
		func(i int) events.Thresholds {
			return events.Thresholds{ActiveDecodeBlocks: events.Ptr(float64(i) / 100)}
		},
		func(i int) events.Thresholds { return events.Thresholds{ActivePrefillTokens: events.Ptr(uint64(i))} },
		func(i int) events.Thresholds {
			return events.Thresholds{ActivePrefillTokensFrac: events.Ptr(float64(i))}
		},
	}
	const rounds = 20
	var wg sync.WaitGroup
	for k := range stores {
		wg.Go(func() {
			for i := 1; i <= rounds; i++ {
				if _, err := stores[k].Merge(t.Context(), "m", patches[k](i)); err != nil {
					t.Errorf("Merge: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
	got, _, err := stores[0].Get(t.Context(), "m")
	want := events.Thresholds{
		ActiveDecodeBlocks:      events.Ptr(float64(rounds) / 100),
		ActivePrefillTokens:     events.Ptr(uint64(rounds)),
		ActivePrefillTokensFrac: events.Ptr(float64(rounds)),
	}
	if err != nil || !got.Equal(want) {
		t.Fatalf("after concurrent merges = %+v, %v; want %+v (no field lost)", got, err, want)
	}
}

func TestThresholdWatcher(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	// The writes come from a second connection.
	js2 := testJetStream(t, natstest.Connect(t, e.srv))
	s := threshStore(t, js2)
	pre := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](7)}
	if err := s.Set(ctx, "pre", pre); err != nil {
		t.Fatal(err)
	}

	w, changes := threshWatch(t, e, e.js)
	threshSynced(t, w)
	// The initial value came before Synced.
	select {
	case c := <-changes:
		if c.model != "pre" || c.deleted || !c.t.Equal(pre) {
			t.Fatalf("initial change = %+v", c)
		}
	default:
		t.Fatal("initial value not delivered before Synced")
	}

	a := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
	if err := s.Set(ctx, "a", a); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "a", a, false)
	if err := s.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "a", events.Thresholds{}, true)

	// Invalid entries are counted and skipped.
	kv := e.bucket(t, events.ThresholdsBucket)
	if _, err := kv.PutString(ctx, "bad", "{not json"); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.PutString(ctx, "range", `{"active_decode_blocks_threshold":2}`); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.PutString(ctx, "x=zz", "{}"); err != nil { // not a canonical model key
		t.Fatal(err)
	}
	// JSON null inherits everything.
	if _, err := kv.PutString(ctx, "null", "null"); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "null", events.Thresholds{}, false)
	b := events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.25)}
	if err := s.Set(ctx, "b/model", b); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "b/model", b, false)
	if err := kv.Purge(ctx, events.ModelKey("b/model")); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "b/model", events.Thresholds{}, true)

	if got := testMetric(t, e.reg, "workermon_threshold_watcher_invalid_total"); got != 3 {
		t.Errorf("invalid = %v, want 3", got)
	}
	if got := testMetric(t, e.reg, "workermon_threshold_watcher_updates_total", "op", "put"); got != 4 {
		t.Errorf("puts = %v, want 4", got)
	}
	if got := testMetric(t, e.reg, "workermon_threshold_watcher_updates_total", "op", "delete"); got != 2 {
		t.Errorf("deletes = %v, want 2", got)
	}
	if err := w.Run(ctx); !errors.Is(err, overrides.ErrThresholdWatcherRunning) {
		t.Errorf("second Run = %v, want ErrThresholdWatcherRunning", err)
	}
}

func TestThresholdWatcherResumesAfterRestart(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	w, changes := threshWatch(t, e, e.js)
	threshSynced(t, w)

	nc2 := natstest.Connect(t, e.srv)
	s := threshStore(t, testJetStream(t, nc2))
	a := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](1)}
	if err := s.Set(ctx, "a", a); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "a", a, false)

	natstest.Restart(t, e.srv, e.opts)
	// Written once NATS and JetStream are back; the watcher must see it well
	// inside the 10–20 s a stalled watch would take.
	b := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](2)}
	natstest.WaitFor(t, testWait, "a write after the restart", func() bool {
		ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		return s.Set(ctx, "b", b) == nil
	})
	setAt := time.Now()
	// b is next: a is not delivered again.
	threshExpect(t, changes, "b", b, false)
	// A stalled watch recovers only after 10–20 s: anything under 8 s is
	// the rewatch at work, however loaded the machine.
	if took := time.Since(setAt); took > 8*time.Second {
		t.Errorf("change seen %v after the write", took)
	}
	if got := testMetric(t, e.reg, "workermon_threshold_watcher_rewatches_total", "reason", "reconnect") +
		testMetric(t, e.reg, "workermon_threshold_watcher_rewatches_total", "reason", "closed"); got < 1 {
		t.Errorf("rewatches = %v, want ≥ 1", got)
	}
}

func TestThresholdWatcherRewatch(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	s := threshStore(t, e.js)
	w, changes := threshWatch(t, e, e.js)
	threshSynced(t, w)

	a := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](1)}
	if err := s.Set(ctx, "a", a); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "a", a, false)
	w.Rewatch()
	natstest.WaitFor(t, testWait, "the rewatch", func() bool {
		return testMetric(t, e.reg, "workermon_threshold_watcher_rewatches_total", "reason", "manual") == 1
	})
	b := events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](2)}
	if err := s.Set(ctx, "b", b); err != nil {
		t.Fatal(err)
	}
	threshExpect(t, changes, "b", b, false) // not a again
}

func TestThresholdWatcherBucketReset(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	ctx := t.Context()
	s := threshStore(t, e.js)
	for _, m := range []string{"a", "b", "c"} {
		if err := s.Set(ctx, m, events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](1)}); err != nil {
			t.Fatal(err)
		}
	}
	w, changes := threshWatch(t, e, e.js)
	threshSynced(t, w)
	for range 3 {
		threshNext(t, changes)
	}

	// The bucket is deleted and made again: revisions start over.
	if err := e.js.DeleteKeyValue(ctx, events.ThresholdsBucket); err != nil {
		t.Fatal(err)
	}
	d := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.3)}
	natstest.WaitFor(t, testWait, "d written in the new bucket", func() bool {
		return threshStore(t, e.js).Set(ctx, "d", d) == nil
	})
	w.Rewatch()

	var got []string
	for range 4 {
		c := threshNext(t, changes)
		switch {
		case c.model == "d" && !c.deleted && c.t.Equal(d):
			got = append(got, "put d")
		case c.deleted:
			got = append(got, "delete "+c.model)
		default:
			t.Fatalf("unexpected change %+v", c)
		}
	}
	slices.Sort(got)
	if want := []string{"delete a", "delete b", "delete c", "put d"}; !slices.Equal(got, want) {
		t.Fatalf("changes after the reset = %q, want %q", got, want)
	}
}
