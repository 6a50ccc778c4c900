package events

import (
	"bytes"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
)

// Thresholds are a model's busy thresholds; nil means the check is off.
// The same type is the JSON of a per-model override (nil = inherit) and the
// `thresholds` map of a BusySet record (nil = unset, left out).
type Thresholds struct {
	ActiveDecodeBlocks      *float64 `msgpack:"active_decode_blocks_threshold,omitempty" json:"active_decode_blocks_threshold"`
	ActivePrefillTokens     *uint64  `msgpack:"active_prefill_tokens_threshold,omitempty" json:"active_prefill_tokens_threshold"`
	ActivePrefillTokensFrac *float64 `msgpack:"active_prefill_tokens_threshold_frac,omitempty" json:"active_prefill_tokens_threshold_frac"`
}

// Validate checks the ranges of the contract: decode threshold finite and in
// [0, 1], frac finite and ≥ 0.
func (t Thresholds) Validate() error {
	if v := t.ActiveDecodeBlocks; v != nil && (math.IsNaN(*v) || *v < 0 || *v > 1) {
		return fmt.Errorf("events: active_decode_blocks_threshold %v is not in [0, 1]: %w", *v, ErrOutOfRange)
	}
	if v := t.ActivePrefillTokensFrac; v != nil && (math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0) {
		return fmt.Errorf("events: active_prefill_tokens_threshold_frac %v is not a finite number ≥ 0: %w", *v, ErrOutOfRange)
	}
	return nil
}

// Merge returns t with every field that o sets replaced by o's value.
func (t Thresholds) Merge(o Thresholds) Thresholds {
	if o.ActiveDecodeBlocks != nil {
		t.ActiveDecodeBlocks = o.ActiveDecodeBlocks
	}
	if o.ActivePrefillTokens != nil {
		t.ActivePrefillTokens = o.ActivePrefillTokens
	}
	if o.ActivePrefillTokensFrac != nil {
		t.ActivePrefillTokensFrac = o.ActivePrefillTokensFrac
	}
	return t
}

// IsZero reports whether no threshold is set.
func (t Thresholds) IsZero() bool {
	return t.ActiveDecodeBlocks == nil && t.ActivePrefillTokens == nil && t.ActivePrefillTokensFrac == nil
}

// Equal reports whether two sets of thresholds have the same values.
func (t Thresholds) Equal(o Thresholds) bool {
	return eqPtr(t.ActiveDecodeBlocks, o.ActiveDecodeBlocks) && eqPtr(t.ActivePrefillTokens, o.ActivePrefillTokens) &&
		eqPtr(t.ActivePrefillTokensFrac, o.ActivePrefillTokensFrac)
}

func eqPtr[T comparable](a, b *T) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// Ptr returns a pointer to v, for building Thresholds.
func Ptr[T any](v T) *T { return &v }

// Busy reasons of a BusySet record.
const (
	ReasonKV        = "kv"
	ReasonPrefill   = "prefill"
	ReasonKVPrefill = "kv+prefill"
)

// BusySet is a model's record in the busy bucket (contract §6).
type BusySet struct {
	V          uint64            `msgpack:"v"`
	Model      string            `msgpack:"model"`
	Busy       []uint64          `msgpack:"busy"`
	Free       []uint64          `msgpack:"free"`
	Stale      []uint64          `msgpack:"stale"`
	AllBusy    bool              `msgpack:"all_busy"`
	Reasons    map[string]string `msgpack:"reasons"`
	Thresholds Thresholds        `msgpack:"thresholds"`
	UpdatedAt  int64             `msgpack:"updated_at"`
	MonitorID  string            `msgpack:"monitor_id"`
	Epoch      uint64            `msgpack:"epoch"`
	Seq        uint64            `msgpack:"seq"`
}

// MarshalBusySet encodes a record. Nil lists and maps are written empty,
// never as nil.
func MarshalBusySet(b *BusySet) ([]byte, error) {
	rec := *b
	rec.V = SchemaVersion
	if rec.Busy == nil {
		rec.Busy = []uint64{}
	}
	if rec.Free == nil {
		rec.Free = []uint64{}
	}
	if rec.Stale == nil {
		rec.Stale = []uint64{}
	}
	if rec.Reasons == nil {
		rec.Reasons = map[string]string{}
	}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true)
	e.SetSortMapKeys(true)
	if err := e.Encode(&rec); err != nil {
		return nil, fmt.Errorf("events: marshal busy set: %w", err)
	}
	return buf.Bytes(), nil
}

// DecodeBusySet decodes and checks a record.
func DecodeBusySet(data []byte) (BusySet, error) {
	var b BusySet
	if len(data) == 0 {
		return b, fmt.Errorf("events: decode busy set: %w", ErrEmpty)
	}
	if err := msgpack.Unmarshal(data, &b); err != nil {
		return BusySet{}, fmt.Errorf("events: decode busy set: %w: %v", ErrMalformed, err)
	}
	if b.V != SchemaVersion {
		return BusySet{}, fmt.Errorf("events: decode busy set: v=%d: %w", b.V, ErrVersion)
	}
	if err := ValidateModel(b.Model); err != nil {
		return BusySet{}, err
	}
	return b, nil
}

// WorkerEntry is a worker's entry in the registry bucket (contract §7b), JSON.
type WorkerEntry struct {
	Model        string `json:"model"`
	WorkerID     uint64 `json:"worker_id"`
	Endpoint     string `json:"endpoint"`
	DPStart      uint32 `json:"dp_start"`
	DPSize       uint32 `json:"dp_size"`
	BootID       uint64 `json:"boot_id"`
	RegisteredAt int64  `json:"registered_at"`
}

// RegistryKey is the key of a worker's registry entry: <model_key>.<worker_id>.
func RegistryKey(model string, workerID uint64) string {
	return fmt.Sprintf("%s.%d", ModelKey(model), workerID)
}
