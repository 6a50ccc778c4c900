package overrides

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
)

// Cordon is a cordoned worker: the JSON value of key
// <model_key>.<worker_id> in the cordons bucket (contract §12). A cordoned
// fresh worker is listed busy with reason "cordoned": routers send it
// nothing new, and the rescheduler's failover moves its running work off.
type Cordon struct {
	Model      string `json:"model"`
	WorkerID   uint64 `json:"worker_id"`
	CordonedAt int64  `json:"cordoned_at"` // Unix nanoseconds
}

// CordonStoreConfig configures a CordonStore.
type CordonStoreConfig struct {
	// JetStream is the connection's JetStream context. Required.
	JetStream jetstream.JetStream
	// Bucket is the cordons bucket, events.CordonsBucket by default.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist; 0 means 1.
	Replicas int
	// Timeout bounds each method call, on top of the caller's ctx. Must be > 0.
	Timeout time.Duration
	// Now is the clock of cordoned_at; nil means time.Now.
	Now func() time.Time
	// Max bounds the cordons the bucket holds: a cordon may name a worker
	// not seen yet (contract §12), so nothing else bounds them. A new cordon
	// beyond it is refused with ErrTooManyCordons. Must be > 0.
	Max int
}

// DefaultMaxCordons is CordonStoreConfig.Max by default: far more workers
// than an operator cordons by hand, and a few hundred KiB of names at most.
const DefaultMaxCordons = 1024

// DefaultCordonStoreConfig returns a CordonStoreConfig with every default
// set; the caller must still set JetStream.
func DefaultCordonStoreConfig() CordonStoreConfig {
	return CordonStoreConfig{Bucket: events.CordonsBucket, Replicas: 1, Timeout: DefaultTimeout, Max: DefaultMaxCordons}
}

// Validate reports every problem of the configuration, joined.
func (c CordonStoreConfig) Validate() error {
	errs := kvbucket.Check("overrides: cordon store", c.JetStream, c.Bucket, c.Replicas)
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("overrides: cordon store: timeout %v is not positive", c.Timeout))
	}
	if c.Max <= 0 {
		errs = append(errs, fmt.Errorf("overrides: cordon store: max %d is not positive", c.Max))
	}
	return errors.Join(errs...)
}

// CordonStore reads and writes the cordons bucket. A cordon may name a
// worker no monitor has seen yet. Safe for concurrent use.
type CordonStore struct {
	cfg    CordonStoreConfig
	bucket lazyBucket
}

// NewCordonStore checks cfg and returns a store. It does no I/O.
func NewCordonStore(cfg CordonStoreConfig) (*CordonStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &CordonStore{cfg: cfg, bucket: lazyBucket{js: cfg.JetStream, name: cfg.Bucket, replicas: cfg.Replicas}}, nil
}

// Cordon cordons a worker and returns its cordon. Cordoning a worker again
// keeps the first cordon (and its time). A new cordon when the bucket holds
// Max already is refused with ErrTooManyCordons (several monitors creating
// cordons at once may pass Max by a few).
func (s *CordonStore) Cordon(ctx context.Context, model string, worker uint64) (Cordon, error) {
	if err := events.ValidateModel(model); err != nil {
		return Cordon{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return Cordon{}, err
	}
	key := events.RegistryKey(model, worker)
	e, err := kv.Get(ctx, key)
	switch {
	case err == nil:
		if old, derr := cordonDecode(key, e.Value()); derr == nil {
			return old, nil
		}
	case !errors.Is(err, jetstream.ErrKeyNotFound):
		return Cordon{}, fmt.Errorf("overrides: cordon %s worker %d: %w", model, worker, err)
	default:
		n := 0
		if err := kvbucket.ReadAll(ctx, kv, func(jetstream.KeyValueEntry) { n++ }); err != nil {
			return Cordon{}, fmt.Errorf("overrides: count cordons: %w", err)
		}
		if n >= s.cfg.Max {
			return Cordon{}, fmt.Errorf("overrides: cordon %.80q worker %d: the bucket holds %d cordons, the most allowed: %w",
				model, worker, n, ErrTooManyCordons)
		}
	}
	c := Cordon{Model: model, WorkerID: worker, CordonedAt: s.cfg.Now().UnixNano()}
	data, err := json.Marshal(c)
	if err != nil {
		return Cordon{}, fmt.Errorf("overrides: cordon: %w", err)
	}
	_, err = kv.Create(ctx, key, data)
	if errors.Is(err, jetstream.ErrKeyExists) {
		e, gerr := kv.Get(ctx, key)
		if gerr == nil {
			if old, derr := cordonDecode(key, e.Value()); derr == nil {
				return old, nil
			}
		}
		_, err = kv.Put(ctx, key, data) // unreadable: replaced
	}
	if err != nil {
		return Cordon{}, fmt.Errorf("overrides: cordon %s worker %d: %w", model, worker, err)
	}
	return c, nil
}

// Uncordon removes a worker's cordon; it reports whether there was one.
func (s *CordonStore) Uncordon(ctx context.Context, model string, worker uint64) (bool, error) {
	if err := events.ValidateModel(model); err != nil {
		return false, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return false, err
	}
	key := events.RegistryKey(model, worker)
	if _, err := kv.Get(ctx, key); errors.Is(err, jetstream.ErrKeyNotFound) {
		return false, nil
	}
	if err := kv.Delete(ctx, key); err != nil {
		return false, fmt.Errorf("overrides: uncordon %s worker %d: %w", model, worker, err)
	}
	return true, nil
}

// List returns every cordon, sorted by model and worker. Entries that are
// not valid cordons are left out.
func (s *CordonStore) List(ctx context.Context) ([]Cordon, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return nil, err
	}
	out := []Cordon{}
	err = kvbucket.ReadAll(ctx, kv, func(e jetstream.KeyValueEntry) {
		if c, err := cordonDecode(e.Key(), e.Value()); err == nil {
			out = append(out, c)
		}
	})
	if err != nil {
		return nil, fmt.Errorf("overrides: list cordons: %w", err)
	}
	slices.SortFunc(out, func(a, b Cordon) int {
		return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.WorkerID, b.WorkerID))
	})
	return out, nil
}

// cordonDecode decodes a stored cordon and checks it against its key.
func cordonDecode(key string, data []byte) (Cordon, error) {
	model, worker, err := events.ParseWorkerKey(key)
	if err != nil {
		return Cordon{}, fmt.Errorf("overrides: cordon key: %w", err)
	}
	var c Cordon
	if err := json.Unmarshal(data, &c); err != nil {
		return Cordon{}, fmt.Errorf("overrides: cordon %q: %w", key, err)
	}
	if c.Model != model || c.WorkerID != worker {
		return Cordon{}, fmt.Errorf("overrides: cordon under %q is for model %q worker %d", key, c.Model, c.WorkerID)
	}
	return c, nil
}

// CordonWatcherConfig configures a CordonWatcher.
type CordonWatcherConfig struct {
	WatchSettings
	// OnChange receives every cordon set (cordoned true) and removed
	// (cordoned false), in revision order, on the watcher's goroutine. It
	// must not block for long. Required.
	OnChange func(model string, worker uint64, cordoned bool)
}

// DefaultCordonWatcherConfig returns a CordonWatcherConfig with every
// default set; the caller must still set JetStream and OnChange.
func DefaultCordonWatcherConfig() CordonWatcherConfig {
	return CordonWatcherConfig{WatchSettings: defaultWatchSettings(events.CordonsBucket)}
}

// Validate reports every problem of the configuration, joined.
func (c CordonWatcherConfig) Validate() error {
	errs := c.check("overrides: cordon watcher")
	if c.OnChange == nil {
		errs = append(errs, errors.New("overrides: cordon watcher: OnChange is nil"))
	}
	return errors.Join(errs...)
}

// CordonWatcher follows the cordons bucket, as ThresholdWatcher follows the
// thresholds bucket, and hands every cordon and uncordon to OnChange.
type CordonWatcher struct{ *bucketWatcher }

// NewCordonWatcher checks cfg and returns a watcher, with its metrics
// (workermon_cordon_watcher_*) registered.
func NewCordonWatcher(cfg CordonWatcherConfig) (*CordonWatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	w, err := newBucketWatcher(cfg.WatchSettings, "cordon", ErrCordonWatcherRunning, sinkFuncs[Cordon]{
		parseKey: func(key string) error {
			_, _, err := events.ParseWorkerKey(key)
			return err
		},
		decode: cordonDecode,
		onChange: func(key string, _ Cordon, deleted bool) {
			model, worker, _ := events.ParseWorkerKey(key) // checked by parseKey
			cfg.OnChange(model, worker, !deleted)
		},
	})
	if err != nil {
		return nil, err
	}
	return &CordonWatcher{w}, nil
}
