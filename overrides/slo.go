package overrides

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/slo"
)

// The SLOs of contract §18 live in the bucket workermon-slo (history 1): key
// <model_key> holds a model's SLO, key <model_key>.status the controller's
// state, written by the monitor that holds the model's partition with
// compare-and-set, so that a new holder continues from it.

// SLOBucket is the name of the SLO bucket.
const SLOBucket = events.SLOBucket

// statusSuffix ends the key of a controller's status.
const statusSuffix = ".status"

// SLO is a model's latency target (the JSON value of key <model_key>).
type SLO struct {
	Model      string   `json:"model"`
	TTFTms     *float64 `json:"ttft_ms"`
	ITLms      *float64 `json:"itl_ms"`
	Percentile float64  `json:"percentile"`
	Mode       string   `json:"mode"`
	UpdatedAt  int64    `json:"updated_at"` // Unix nanoseconds
}

// Target is the controller's view of the SLO.
func (s SLO) Target() slo.Target {
	t := slo.Target{Percentile: s.Percentile}
	if s.TTFTms != nil {
		t.TTFTms = *s.TTFTms
	}
	if s.ITLms != nil {
		t.ITLms = *s.ITLms
	}
	return t
}

// Enforced reports whether the controller owns the model's thresholds.
func (s SLO) Enforced() bool { return s.Mode == slo.ModeEnforce }

// Validate checks an SLO as §18 asks.
func (s SLO) Validate() error {
	if err := events.ValidateModel(s.Model); err != nil {
		return err
	}
	for name, v := range map[string]*float64{"ttft_ms": s.TTFTms, "itl_ms": s.ITLms} {
		if v != nil && !(*v > 0 && !math.IsInf(*v, 0)) {
			return fmt.Errorf("%w: %s must be a positive number", slo.ErrInvalidTarget, name)
		}
	}
	if s.Mode != slo.ModeEnforce && s.Mode != slo.ModeShadow {
		return fmt.Errorf("%w: mode %q must be %q or %q", slo.ErrInvalidTarget, s.Mode, slo.ModeEnforce, slo.ModeShadow)
	}
	return s.Target().Validate()
}

// SLOStatus is the controller's state of a model (key <model_key>.status).
type SLOStatus struct {
	Model string    `json:"model"`
	State slo.State `json:"state"`
	// Applied are the thresholds in force under enforce; nil under shadow.
	Applied   *slo.Thresholds `json:"applied"`
	Suggested slo.Thresholds  `json:"suggested"`
	Measured  slo.Measured    `json:"measured"`
	UpdatedAt int64           `json:"updated_at"` // Unix nanoseconds
	MonitorID string          `json:"monitor_id"`
	// Epoch is the writer's partition epoch: a status of a higher epoch
	// than a writer's own means another monitor holds the model now.
	Epoch uint64 `json:"epoch"`
	// Controller is what the next move starts from.
	Controller slo.Status `json:"controller"`
}

// SLOStoreConfig configures an SLOStore.
type SLOStoreConfig struct {
	// JetStream is the connection's JetStream context. Required.
	JetStream jetstream.JetStream
	// Bucket is the SLO bucket, SLOBucket by default.
	Bucket string
	// Replicas is the replica count the bucket is created with when it does
	// not exist (--replicas); 0 means 1.
	Replicas int
	// Timeout bounds each method call, on top of the caller's ctx. > 0.
	Timeout time.Duration
	// Max bounds the SLOs the bucket holds (--max-slos): an SLO may name a
	// model not seen yet, and each costs a status write every interval, so
	// a new SLO beyond it is refused with ErrTooManySLOs. > 0.
	Max int
}

// DefaultMaxSLOs is SLOStoreConfig.Max by default, and --max-slos: the
// monitor's --max-models.
const DefaultMaxSLOs = 1024

// DefaultSLOStoreConfig returns a config with every default set; the
// caller must still set JetStream.
func DefaultSLOStoreConfig() SLOStoreConfig {
	return SLOStoreConfig{Bucket: SLOBucket, Replicas: 1, Timeout: DefaultTimeout, Max: DefaultMaxSLOs}
}

// Validate reports every problem of the configuration, joined.
func (c SLOStoreConfig) Validate() error {
	errs := kvbucket.Check("overrides: slo store", c.JetStream, c.Bucket, c.Replicas)
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("overrides: slo store: timeout %v is not positive", c.Timeout))
	}
	if c.Max <= 0 {
		errs = append(errs, fmt.Errorf("overrides: slo store: max %d is not positive", c.Max))
	}
	return errors.Join(errs...)
}

// SLOStore reads and writes the SLO bucket. Safe for concurrent use.
type SLOStore struct {
	cfg    SLOStoreConfig
	bucket lazyBucket
}

// NewSLOStore checks cfg and returns a store. It does no I/O.
func NewSLOStore(cfg SLOStoreConfig) (*SLOStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &SLOStore{cfg: cfg, bucket: lazyBucket{js: cfg.JetStream, name: cfg.Bucket, replicas: cfg.Replicas}}, nil
}

func (s *SLOStore) kv(ctx context.Context) (jetstream.KeyValue, context.Context, context.CancelFunc, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	kv, err := s.bucket.get(ctx)
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return kv, ctx, cancel, nil
}

// Get returns a model's SLO and whether it has one.
func (s *SLOStore) Get(ctx context.Context, model string) (SLO, bool, error) {
	if err := events.ValidateModel(model); err != nil {
		return SLO{}, false, err
	}
	kv, ctx, cancel, err := s.kv(ctx)
	if err != nil {
		return SLO{}, false, err
	}
	defer cancel()
	e, err := kv.Get(ctx, events.ModelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return SLO{}, false, nil
	}
	if err != nil {
		return SLO{}, false, fmt.Errorf("overrides: get slo of %q: %w", model, err)
	}
	v, err := decodeSLO(model, e.Value())
	return v, err == nil, err
}

// Put replaces a model's SLO. A new SLO when the bucket holds Max already
// is refused with ErrTooManySLOs (several monitors creating SLOs at once
// may pass Max by a few).
func (s *SLOStore) Put(ctx context.Context, v SLO) error {
	if err := v.Validate(); err != nil {
		return err
	}
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("overrides: encode slo of %q: %w", v.Model, err)
	}
	kv, ctx, cancel, err := s.kv(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	key := events.ModelKey(v.Model)
	if _, err := kv.Get(ctx, key); errors.Is(err, jetstream.ErrKeyNotFound) {
		n := 0
		if err := kvbucket.ReadAll(ctx, kv, func(e jetstream.KeyValueEntry) {
			if !strings.HasSuffix(e.Key(), statusSuffix) {
				n++
			}
		}); err != nil {
			return fmt.Errorf("overrides: count slos: %w", err)
		}
		if n >= s.cfg.Max {
			return fmt.Errorf("overrides: slo of %.80q: the bucket holds %d SLOs, the most allowed (--max-slos): %w",
				v.Model, n, ErrTooManySLOs)
		}
	} else if err != nil {
		return fmt.Errorf("overrides: get slo of %q: %w", v.Model, err)
	}
	if _, err := kv.Put(ctx, key, data); err != nil {
		return fmt.Errorf("overrides: put slo of %q: %w", v.Model, err)
	}
	return nil
}

// Delete drops a model's SLO and its status.
func (s *SLOStore) Delete(ctx context.Context, model string) error {
	if err := events.ValidateModel(model); err != nil {
		return err
	}
	kv, ctx, cancel, err := s.kv(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	key := events.ModelKey(model)
	if err := kv.Delete(ctx, key); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("overrides: delete slo of %q: %w", model, err)
	}
	if err := kv.Delete(ctx, key+statusSuffix); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("overrides: delete slo status of %q: %w", model, err)
	}
	return nil
}

// List returns every SLO and every status by model; values that do not
// decode are left out.
func (s *SLOStore) List(ctx context.Context) (map[string]SLO, map[string]SLOStatus, error) {
	kv, ctx, cancel, err := s.kv(ctx)
	if err != nil {
		return nil, nil, err
	}
	defer cancel()
	slos, statuses := map[string]SLO{}, map[string]SLOStatus{}
	err = kvbucket.ReadAll(ctx, kv, func(e jetstream.KeyValueEntry) {
		key, status := strings.CutSuffix(e.Key(), statusSuffix)
		model, err := events.ParseModelKey(key)
		if err != nil {
			return
		}
		if status {
			if st, err := decodeStatus(model, e.Value()); err == nil {
				statuses[model] = st
			}
		} else if v, err := decodeSLO(model, e.Value()); err == nil {
			slos[model] = v
		}
	})
	if err != nil {
		return nil, nil, fmt.Errorf("overrides: list slos: %w", err)
	}
	return slos, statuses, nil
}

// Status returns a model's status with its revision (0 when there is none).
func (s *SLOStore) Status(ctx context.Context, model string) (SLOStatus, uint64, error) {
	kv, ctx, cancel, err := s.kv(ctx)
	if err != nil {
		return SLOStatus{}, 0, err
	}
	defer cancel()
	e, err := kv.Get(ctx, events.ModelKey(model)+statusSuffix)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return SLOStatus{}, 0, nil
	}
	if err != nil {
		return SLOStatus{}, 0, fmt.Errorf("overrides: get slo status of %q: %w", model, err)
	}
	st, err := decodeStatus(model, e.Value())
	return st, e.Revision(), err
}

// PutStatus writes a model's status by compare-and-set on rev (0: the key
// must not exist) and returns the new revision; ErrStatusConflict when the
// key changed since rev.
func (s *SLOStore) PutStatus(ctx context.Context, st SLOStatus, rev uint64) (uint64, error) {
	data, err := json.Marshal(st)
	if err != nil {
		return 0, fmt.Errorf("overrides: encode slo status of %q: %w", st.Model, err)
	}
	kv, ctx, cancel, err := s.kv(ctx)
	if err != nil {
		return 0, err
	}
	defer cancel()
	key := events.ModelKey(st.Model) + statusSuffix
	if rev == 0 {
		rev, err = kv.Create(ctx, key, data)
	} else {
		rev, err = kv.Update(ctx, key, data, rev)
	}
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return 0, fmt.Errorf("overrides: put slo status of %q: %w", st.Model, ErrStatusConflict)
	}
	if err != nil {
		return 0, fmt.Errorf("overrides: put slo status of %q: %w", st.Model, err)
	}
	return rev, nil
}

// decodeSLO decodes the SLO stored under model's key and checks it against
// the key, as a cordon is: a value written under another model's key by
// anybody else would be taken for that model's.
func decodeSLO(model string, data []byte) (SLO, error) {
	var v SLO
	if err := json.Unmarshal(data, &v); err != nil {
		return SLO{}, fmt.Errorf("%w: %v", ErrBadSLO, err)
	}
	if err := v.Validate(); err != nil {
		return SLO{}, fmt.Errorf("%w: %w", ErrBadSLO, err)
	}
	if v.Model != model {
		return SLO{}, fmt.Errorf("%w: stored under the key of %q, for %q", ErrBadSLO, model, v.Model)
	}
	return v, nil
}

// decodeStatus decodes the status stored under model's status key and
// checks it against the key.
func decodeStatus(model string, data []byte) (SLOStatus, error) {
	var st SLOStatus
	if err := json.Unmarshal(data, &st); err != nil {
		return SLOStatus{}, fmt.Errorf("%w: status: %v", ErrBadSLO, err)
	}
	if err := events.ValidateModel(st.Model); err != nil {
		return SLOStatus{}, fmt.Errorf("%w: status: %w", ErrBadSLO, err)
	}
	if st.Model != model {
		return SLOStatus{}, fmt.Errorf("%w: status stored under the key of %q, for %q", ErrBadSLO, model, st.Model)
	}
	return st, nil
}

// SLOWatcherConfig configures an SLOWatcher.
type SLOWatcherConfig struct {
	WatchSettings
	// OnChange receives every change of an SLO (statuses are not changes),
	// in revision order, on the watcher's goroutine; deleted true when the
	// SLO is gone. Required.
	OnChange func(model string, v SLO, deleted bool)
}

// DefaultSLOWatcherConfig returns a config with every default set; the
// caller must still set JetStream and OnChange.
func DefaultSLOWatcherConfig() SLOWatcherConfig {
	return SLOWatcherConfig{WatchSettings: defaultWatchSettings(SLOBucket)}
}

// Validate reports every problem of the configuration, joined.
func (c SLOWatcherConfig) Validate() error {
	errs := c.check("overrides: slo watcher")
	if c.OnChange == nil {
		errs = append(errs, errors.New("overrides: slo watcher: OnChange is nil"))
	}
	return errors.Join(errs...)
}

// SLOWatcher follows the SLO bucket and hands every change of an SLO to
// OnChange, as ThresholdWatcher does for overrides.
type SLOWatcher struct{ *bucketWatcher }

// NewSLOWatcher checks cfg and returns a watcher, with its metrics
// (workermon_slo_watcher_*) registered.
func NewSLOWatcher(cfg SLOWatcherConfig) (*SLOWatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	type entry struct {
		slo    SLO
		status bool
	}
	w, err := newBucketWatcher(cfg.WatchSettings, "slo", ErrSLOWatcherRunning, sinkFuncs[entry]{
		parseKey: func(key string) error {
			key, _ = strings.CutSuffix(key, statusSuffix)
			if _, err := events.ParseModelKey(key); err != nil {
				return fmt.Errorf("overrides: slo key %q: %w", key, err)
			}
			return nil
		},
		decode: func(key string, value []byte) (entry, error) {
			if strings.HasSuffix(key, statusSuffix) {
				return entry{status: true}, nil
			}
			model, _ := events.ParseModelKey(key) // checked by parseKey
			v, err := decodeSLO(model, value)
			if err != nil {
				return entry{}, fmt.Errorf("overrides: slo under %q: %w", key, err)
			}
			return entry{slo: v}, nil
		},
		onChange: func(key string, e entry, deleted bool) {
			if strings.HasSuffix(key, statusSuffix) {
				return
			}
			model, _ := events.ParseModelKey(key)
			cfg.OnChange(model, e.slo, deleted)
		},
	})
	if err != nil {
		return nil, err
	}
	return &SLOWatcher{w}, nil
}
