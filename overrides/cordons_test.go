package overrides_test

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/overrides"
)

func TestCordonStore(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	cfg := overrides.DefaultCordonStoreConfig()
	cfg.JetStream = e.js
	at := time.Unix(1_800_000_000, 0)
	cfg.Now = func() time.Time { return at }
	s, err := overrides.NewCordonStore(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	c, err := s.Cordon(ctx, "b/model", 7)
	if err != nil || c != (overrides.Cordon{Model: "b/model", WorkerID: 7, CordonedAt: at.UnixNano()}) {
		t.Fatalf("Cordon = %+v, %v", c, err)
	}
	at = at.Add(time.Hour)
	if again, err := s.Cordon(ctx, "b/model", 7); err != nil || again != c {
		t.Errorf("cordoning again = %+v, %v; want the first cordon %+v", again, err, c)
	}
	if _, err := s.Cordon(ctx, "a/model", 3); err != nil {
		t.Fatal(err)
	}
	// An entry that is not a cordon is left out of the list.
	kv := e.bucket(t, events.CordonsBucket)
	if _, err := kv.Put(ctx, events.RegistryKey("c/model", 1), []byte(`{"model":"other","worker_id":1}`)); err != nil {
		t.Fatal(err)
	}
	list, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range list {
		got = append(got, fmt.Sprintf("%s/%d", c.Model, c.WorkerID))
	}
	if want := []string{"a/model/3", "b/model/7"}; !slices.Equal(got, want) {
		t.Errorf("List = %v, want %v", got, want)
	}
	if ok, err := s.Uncordon(ctx, "b/model", 7); !ok || err != nil {
		t.Errorf("Uncordon = %v, %v", ok, err)
	}
	if ok, err := s.Uncordon(ctx, "b/model", 7); ok || err != nil {
		t.Errorf("Uncordon of a worker not cordoned = %v, %v", ok, err)
	}
	if _, err := s.Cordon(ctx, "", 1); !errors.Is(err, events.ErrInvalidModel) {
		t.Errorf("Cordon of an invalid model = %v", err)
	}
}

func TestCordonWatcher(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	scfg := overrides.DefaultCordonStoreConfig()
	scfg.JetStream = e.js
	s, err := overrides.NewCordonStore(scfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Cordon(t.Context(), "m", 1); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var changes []string
	wcfg := overrides.DefaultCordonWatcherConfig()
	wcfg.JetStream, wcfg.Registerer = e.js, e.reg
	wcfg.OnChange = func(model string, worker uint64, cordoned bool) {
		mu.Lock()
		defer mu.Unlock()
		changes = append(changes, fmt.Sprintf("%s/%d=%v", model, worker, cordoned))
	}
	w, err := overrides.NewCordonWatcher(wcfg)
	if err != nil {
		t.Fatal(err)
	}
	natstest.Go(t, testWait, w.Run)
	select {
	case <-w.Synced():
	case <-time.After(testWait):
		t.Fatal("not synced")
	}
	if _, err := s.Cordon(t.Context(), "m", 2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Uncordon(t.Context(), "m", 1); err != nil {
		t.Fatal(err)
	}
	want := []string{"m/1=true", "m/2=true", "m/1=false"}
	natstest.WaitFor(t, testWait, "the three changes", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Equal(changes, want)
	})
	if v := testMetric(t, e.reg, "workermon_cordon_watcher_updates_total", "op", "delete"); v != 1 {
		t.Errorf("deletes counted: %v", v)
	}
}

// TestCordonStoreMax checks that a new cordon beyond Max is refused, while
// cordoning a cordoned worker again still answers its cordon.
func TestCordonStoreMax(t *testing.T) {
	t.Parallel()
	e := newTestEnv(t)
	cfg := overrides.DefaultCordonStoreConfig()
	cfg.JetStream, cfg.Max = e.js, 2
	s, err := overrides.NewCordonStore(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for _, w := range []uint64{1, 2} {
		if _, err := s.Cordon(ctx, "m", w); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Cordon(ctx, "m", 3); !errors.Is(err, overrides.ErrTooManyCordons) {
		t.Errorf("third cordon = %v, want ErrTooManyCordons", err)
	}
	if _, err := s.Cordon(ctx, "other", 1); !errors.Is(err, overrides.ErrTooManyCordons) {
		t.Errorf("cordon of another model = %v, want ErrTooManyCordons", err)
	}
	if c, err := s.Cordon(ctx, "m", 2); err != nil || c.WorkerID != 2 {
		t.Errorf("cordoning again at the cap = %+v, %v", c, err)
	}
	if _, err := s.Uncordon(ctx, "m", 1); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Cordon(ctx, "m", 3); err != nil {
		t.Errorf("cordon after an uncordon = %v", err)
	}
	cfg.Max = 0
	if _, err := overrides.NewCordonStore(cfg); err == nil {
		t.Error("Max 0 accepted")
	}
}
