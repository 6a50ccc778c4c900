// Package overrides is the operator's state kept in KV buckets, which every
// monitor replica watches and every restart finds again: the per-model
// threshold overrides (bucket workermon-thresholds, contract §8), set with
// compare-and-set by the monitor's API (ThresholdStore) and applied by every
// monitor (ThresholdWatcher), the cordoned workers (bucket
// workermon-cordons, contract §12), set by the API (CordonStore) and
// applied by every monitor (CordonWatcher), and the SLOs with their
// controllers' status (bucket workermon-slo, contract §18: SLOStore,
// SLOWatcher).
//
// Users: workermon serve and its HTTP API (package api).
package overrides

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/retry"
)

// Sentinel errors of the package.
var (
	// ErrThresholdWatcherRunning is returned by ThresholdWatcher.Run when the
	// watcher has already been run.
	ErrThresholdWatcherRunning = errors.New("overrides: threshold watcher already started")
	// ErrCordonWatcherRunning is returned by CordonWatcher.Run when the
	// watcher has already been run.
	ErrCordonWatcherRunning = errors.New("overrides: cordon watcher already started")
	// ErrThresholdConflict is returned by ThresholdStore.Merge when the
	// override kept changing under it.
	ErrThresholdConflict = errors.New("overrides: threshold override changed concurrently")
	// ErrBadOverride marks a stored threshold override that is not a JSON
	// object of the three thresholds within their ranges.
	ErrBadOverride = errors.New("overrides: invalid threshold override")
	// ErrTooManyCordons is returned by CordonStore.Cordon when the bucket
	// already holds CordonStoreConfig.Max cordons.
	ErrTooManyCordons = errors.New("overrides: too many cordons")
	// ErrTooManySLOs is returned by SLOStore.Put when the bucket already
	// holds SLOStoreConfig.Max SLOs, and by the SLO controller when it
	// controls its most models.
	ErrTooManySLOs = errors.New("overrides: too many slos")
	// ErrBadSLO marks a stored SLO or status that does not decode or check.
	ErrBadSLO = errors.New("overrides: invalid slo")
	// ErrStatusConflict is returned by SLOStore.PutStatus when the status
	// key changed since it was read.
	ErrStatusConflict = errors.New("overrides: slo status changed concurrently")
	// ErrSLOWatcherRunning is returned by SLOWatcher.Run when the watcher
	// has already been run.
	ErrSLOWatcherRunning = errors.New("overrides: slo watcher already started")
)

// Defaults of the configurations.
const (
	// DefaultTimeout bounds every single KV operation of the store and of
	// the watcher.
	DefaultTimeout = 2 * time.Second
	// DefaultRetryMin is the first delay before the watcher retries a
	// failed watch.
	DefaultRetryMin = 50 * time.Millisecond
	// DefaultRetryMax caps the delay between retries of a failed watch.
	DefaultRetryMax = 2 * time.Second
	// DefaultProbeInterval is how often the ThresholdWatcher asks the server
	// about its bucket, to notice a deleted or recreated bucket and a
	// stalled watch.
	DefaultProbeInterval = 5 * time.Second
)

// threshMergeAttempts bounds the compare-and-set attempts of Merge.
const threshMergeAttempts = 16

// ThresholdStoreConfig configures a ThresholdStore.
type ThresholdStoreConfig struct {
	// JetStream is the connection's JetStream context. Required.
	JetStream jetstream.JetStream
	// Bucket is the overrides bucket, events.ThresholdsBucket by default.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist; 0 means 1.
	Replicas int
	// Timeout bounds each method call, on top of the caller's ctx. Must be > 0.
	Timeout time.Duration
}

// DefaultThresholdStoreConfig returns a ThresholdStoreConfig with every
// default set; the caller must still set JetStream.
func DefaultThresholdStoreConfig() ThresholdStoreConfig {
	return ThresholdStoreConfig{Bucket: events.ThresholdsBucket, Replicas: 1, Timeout: DefaultTimeout}
}

// Validate reports every problem of the configuration, joined.
func (c ThresholdStoreConfig) Validate() error {
	errs := kvbucket.Check("overrides: threshold store", c.JetStream, c.Bucket, c.Replicas)
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("overrides: threshold store: timeout %v is not positive", c.Timeout))
	}
	return errors.Join(errs...)
}

// ThresholdStore reads and writes the per-model threshold overrides of the
// thresholds bucket (contract §8): key model_key, value a JSON object of
// events.Thresholds where absent or null means inherit the default.
//
// The store holds overrides only; the effective thresholds are the
// defaults merged with them, which is the caller's business. Set replaces a
// model's whole override, Merge sets only the fields given. The bucket is
// opened (created if missing) on first use, so a store made while NATS is
// away works once it is back. Safe for concurrent use.
type ThresholdStore struct {
	cfg    ThresholdStoreConfig
	bucket lazyBucket
}

// NewThresholdStore checks cfg and returns a store. It does no I/O.
func NewThresholdStore(cfg ThresholdStoreConfig) (*ThresholdStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &ThresholdStore{cfg: cfg, bucket: lazyBucket{js: cfg.JetStream, name: cfg.Bucket, replicas: cfg.Replicas}}, nil
}

// Get returns a model's override and whether it has one. A stored value
// that is not a valid override is an error wrapping ErrBadOverride.
func (s *ThresholdStore) Get(ctx context.Context, model string) (events.Thresholds, bool, error) {
	if err := events.ValidateModel(model); err != nil {
		return events.Thresholds{}, false, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	t, _, found, err := s.get(ctx, model)
	return t, found, err
}

// get returns a model's override with its revision (0 when absent).
func (s *ThresholdStore) get(ctx context.Context, model string) (events.Thresholds, uint64, bool, error) {
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return events.Thresholds{}, 0, false, err
	}
	e, err := kv.Get(ctx, events.ModelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return events.Thresholds{}, 0, false, nil
	}
	if err != nil {
		return events.Thresholds{}, 0, false, fmt.Errorf("overrides: get thresholds of %q: %w", model, err)
	}
	t, err := threshDecode(e.Value())
	if err != nil {
		return events.Thresholds{}, e.Revision(), true, fmt.Errorf("overrides: get thresholds of %q: %w", model, err)
	}
	return t, e.Revision(), true, nil
}

// Set replaces a model's override with t (its nil fields inherit).
func (s *ThresholdStore) Set(ctx context.Context, model string, t events.Thresholds) error {
	data, err := threshEncode(model, t)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return err
	}
	if _, err := kv.Put(ctx, events.ModelKey(model), data); err != nil {
		return fmt.Errorf("overrides: set thresholds of %q: %w", model, err)
	}
	return nil
}

// Merge sets the fields patch sets in a model's override, keeping the
// others, with compare-and-set so that concurrent writers (several monitor
// replicas) lose no field, and returns the override now stored. A patch
// setting nothing is a Get and writes nothing. A stored value that is not a
// valid override is replaced. It gives up with ErrThresholdConflict when the
// key keeps changing.
func (s *ThresholdStore) Merge(ctx context.Context, model string, patch events.Thresholds) (events.Thresholds, error) {
	if _, err := threshEncode(model, patch); err != nil {
		return events.Thresholds{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	for attempt := range threshMergeAttempts {
		if attempt > 0 && !retry.Sleep(ctx, rand.N(time.Duration(attempt)*2*time.Millisecond)) {
			return events.Thresholds{}, fmt.Errorf("overrides: merge thresholds of %q: %w", model, ctx.Err())
		}
		cur, rev, _, err := s.get(ctx, model)
		if err != nil && !errors.Is(err, ErrBadOverride) {
			return events.Thresholds{}, err
		}
		if patch.IsZero() {
			return cur, nil
		}
		next := cur.Merge(patch)
		data, err := threshEncode(model, next)
		if err != nil {
			return events.Thresholds{}, err
		}
		kv, err := s.bucket.get(ctx)
		if err != nil {
			return events.Thresholds{}, err
		}
		key := events.ModelKey(model)
		if rev == 0 {
			_, err = kv.Create(ctx, key, data)
		} else {
			_, err = kv.Update(ctx, key, data, rev)
		}
		switch {
		case err == nil:
			return next, nil
		case errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyRevisionMismatch):
			continue // someone else wrote it: read again after a jittered pause
		default:
			return events.Thresholds{}, fmt.Errorf("overrides: merge thresholds of %q: %w", model, err)
		}
	}
	return events.Thresholds{}, fmt.Errorf("overrides: merge thresholds of %q: %w", model, ErrThresholdConflict)
}

// Delete drops a model's override: it inherits every default again.
func (s *ThresholdStore) Delete(ctx context.Context, model string) error {
	if err := events.ValidateModel(model); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return err
	}
	if err := kv.Delete(ctx, events.ModelKey(model)); err != nil {
		return fmt.Errorf("overrides: delete thresholds of %q: %w", model, err)
	}
	return nil
}

// List returns every override in the bucket by model. Keys that are not
// model keys and values that are not valid overrides are left out.
func (s *ThresholdStore) List(ctx context.Context) (map[string]events.Thresholds, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	kv, err := s.bucket.get(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]events.Thresholds)
	err = kvbucket.ReadAll(ctx, kv, func(e jetstream.KeyValueEntry) {
		model, err := events.ParseModelKey(e.Key())
		if err != nil {
			return
		}
		if t, err := threshDecode(e.Value()); err == nil {
			out[model] = t
		}
	})
	if err != nil {
		return nil, fmt.Errorf("overrides: list thresholds: %w", err)
	}
	return out, nil
}

// threshEncode checks a model and an override and encodes the override.
func threshEncode(model string, t events.Thresholds) ([]byte, error) {
	if err := events.ValidateModel(model); err != nil {
		return nil, err
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	data, err := json.Marshal(t)
	if err != nil {
		return nil, fmt.Errorf("overrides: encode thresholds of %q: %w", model, err)
	}
	return data, nil
}

// threshDecode decodes and checks a stored override. Unknown fields are
// ignored; JSON null is the empty override.
func threshDecode(data []byte) (events.Thresholds, error) {
	var t events.Thresholds
	if err := json.Unmarshal(data, &t); err != nil {
		return events.Thresholds{}, fmt.Errorf("%w: %v", ErrBadOverride, err)
	}
	if err := t.Validate(); err != nil {
		return events.Thresholds{}, fmt.Errorf("%w: %w", ErrBadOverride, err)
	}
	return t, nil
}

// ThresholdWatcherConfig configures a ThresholdWatcher.
type ThresholdWatcherConfig struct {
	WatchSettings
	// OnChange receives every change of an override, in revision order, on
	// the watcher's goroutine: the model, its override, and whether the
	// override was deleted (t is then empty). It must not block for long:
	// entries queue behind it. Required.
	OnChange func(model string, t events.Thresholds, deleted bool)
}

// DefaultThresholdWatcherConfig returns a ThresholdWatcherConfig with every
// default set; the caller must still set JetStream and OnChange.
func DefaultThresholdWatcherConfig() ThresholdWatcherConfig {
	return ThresholdWatcherConfig{WatchSettings: defaultWatchSettings(events.ThresholdsBucket)}
}

// Validate reports every problem of the configuration, joined.
func (c ThresholdWatcherConfig) Validate() error {
	errs := c.check("overrides: threshold watcher")
	if c.OnChange == nil {
		errs = append(errs, errors.New("overrides: threshold watcher: OnChange is nil"))
	}
	return errors.Join(errs...)
}

// ThresholdWatcher follows the thresholds bucket and hands every change to
// OnChange. Run owns the watch: it opens the bucket (creating it if needed,
// retrying while NATS is away), delivers the overrides already there, closes
// Synced, then delivers each put, delete and purge; see bucketWatcher for
// how it survives restarts and stalls.
type ThresholdWatcher struct{ *bucketWatcher }

// NewThresholdWatcher checks cfg and returns a watcher, with its metrics
// (workermon_threshold_watcher_*) registered.
func NewThresholdWatcher(cfg ThresholdWatcherConfig) (*ThresholdWatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	w, err := newBucketWatcher(cfg.WatchSettings, "threshold", ErrThresholdWatcherRunning, thresholdSink(cfg.OnChange))
	if err != nil {
		return nil, err
	}
	return &ThresholdWatcher{w}, nil
}

// thresholdSink turns the thresholds bucket's entries into OnChange calls.
func thresholdSink(onChange func(string, events.Thresholds, bool)) sinkFuncs[events.Thresholds] {
	return sinkFuncs[events.Thresholds]{
		parseKey: func(key string) error {
			if _, err := events.ParseModelKey(key); err != nil {
				return fmt.Errorf("overrides: threshold key %q: %w", key, err)
			}
			return nil
		},
		decode: func(key string, value []byte) (events.Thresholds, error) {
			t, err := threshDecode(value)
			if err != nil {
				return t, fmt.Errorf("overrides: thresholds under %q: %w", key, err)
			}
			return t, nil
		},
		onChange: func(key string, t events.Thresholds, deleted bool) {
			model, _ := events.ParseModelKey(key) // checked by parseKey
			onChange(model, t, deleted)
		},
	}
}
