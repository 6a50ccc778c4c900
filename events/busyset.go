package events

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
)

// Thresholds are a model's busy thresholds; nil means the check is off.
// The same type is the JSON of a per-model override (nil = inherit) and the
// `thresholds` map of a BusySet record (nil = unset, left out).
type Thresholds struct {
	ActiveDecodeBlocks      *float64 `msgpack:"active_decode_blocks_threshold,omitempty" json:"active_decode_blocks_threshold"`
	ActivePrefillTokens     *uint64  `msgpack:"active_prefill_tokens_threshold,omitempty" json:"active_prefill_tokens_threshold"`
	ActivePrefillTokensFrac *float64 `msgpack:"active_prefill_tokens_threshold_frac,omitempty" json:"active_prefill_tokens_threshold_frac"`
	// KVCommitted and QueueDelayMs are the thresholds of the leading
	// signals (contract §21).
	KVCommitted  *float64 `msgpack:"kv_committed_threshold,omitempty" json:"kv_committed_threshold"`
	QueueDelayMs *uint64  `msgpack:"queue_delay_threshold_ms,omitempty" json:"queue_delay_threshold_ms"`
}

// MaxKVCommittedThreshold is the largest kv_committed_threshold: committed
// blocks up to four times the cache (contract §21).
const MaxKVCommittedThreshold = 4

// Validate checks the ranges of the contract: decode threshold finite and in
// [0, 1], frac finite and ≥ 0, kv_committed finite and in [0, 4].
func (t Thresholds) Validate() error {
	if v := t.ActiveDecodeBlocks; v != nil && (math.IsNaN(*v) || *v < 0 || *v > 1) {
		return fmt.Errorf("events: active_decode_blocks_threshold %v is not in [0, 1]: %w", *v, ErrOutOfRange)
	}
	if v := t.ActivePrefillTokensFrac; v != nil && (math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0) {
		return fmt.Errorf("events: active_prefill_tokens_threshold_frac %v is not a finite number ≥ 0: %w", *v, ErrOutOfRange)
	}
	if v := t.KVCommitted; v != nil && (math.IsNaN(*v) || *v < 0 || *v > MaxKVCommittedThreshold) {
		return fmt.Errorf("events: kv_committed_threshold %v is not in [0, %d]: %w", *v, MaxKVCommittedThreshold, ErrOutOfRange)
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
	if o.KVCommitted != nil {
		t.KVCommitted = o.KVCommitted
	}
	if o.QueueDelayMs != nil {
		t.QueueDelayMs = o.QueueDelayMs
	}
	return t
}

// IsZero reports whether no threshold is set.
func (t Thresholds) IsZero() bool {
	return t.ActiveDecodeBlocks == nil && t.ActivePrefillTokens == nil && t.ActivePrefillTokensFrac == nil &&
		t.KVCommitted == nil && t.QueueDelayMs == nil
}

// Equal reports whether two sets of thresholds have the same values.
func (t Thresholds) Equal(o Thresholds) bool {
	return eqPtr(t.ActiveDecodeBlocks, o.ActiveDecodeBlocks) && eqPtr(t.ActivePrefillTokens, o.ActivePrefillTokens) &&
		eqPtr(t.ActivePrefillTokensFrac, o.ActivePrefillTokensFrac) && eqPtr(t.KVCommitted, o.KVCommitted) &&
		eqPtr(t.QueueDelayMs, o.QueueDelayMs)
}

func eqPtr[T comparable](a, b *T) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// Ptr returns a pointer to v, for building Thresholds.
func Ptr[T any](v T) *T { return &v }

// Busy reasons of a BusySet record. A worker busy for several checks has
// their reasons joined by ReasonSep in the order kv, prefill, kv_committed,
// queue_delay (contract §21): "kv+prefill", "prefill+queue_delay".
const (
	ReasonKV          = "kv"
	ReasonPrefill     = "prefill"
	ReasonKVPrefill   = "kv+prefill"
	ReasonKVCommitted = "kv_committed"
	ReasonQueueDelay  = "queue_delay"
	ReasonCordoned    = "cordoned"
	ReasonSep         = "+"
)

// RoundSaturation rounds a saturation to the hundredths a record carries
// (contract §21).
func RoundSaturation(s float64) float64 { return math.Round(s*100) / 100 }

// BusySet is a model's record in the busy bucket (contract §6).
//
// Amber lists the fresh workers at amber level that are not busy, and Hard
// the busy workers at hard level, both ascending (contract §15). Records
// written before §15 have neither key: they decode with both lists empty.
type BusySet struct {
	V          uint64            `msgpack:"v"`
	Model      string            `msgpack:"model"`
	Busy       []uint64          `msgpack:"busy"`
	Free       []uint64          `msgpack:"free"`
	Stale      []uint64          `msgpack:"stale"`
	AllBusy    bool              `msgpack:"all_busy"`
	Amber      []uint64          `msgpack:"amber"`
	Hard       []uint64          `msgpack:"hard"`
	Reasons    map[string]string `msgpack:"reasons"`
	Thresholds Thresholds        `msgpack:"thresholds"`
	// Routers is the number of router/* sources with a fresh estimate for
	// the model (contract §17); absent in older records: 0.
	Routers uint64 `msgpack:"routers"`
	// Saturation is the mean saturation of the model's fresh, uncordoned
	// workers, rounded to 0.01 (contract §21); absent in older records: 0.
	Saturation float64 `msgpack:"saturation"`
	// QueuedBy is, per router source (router/<id>), the requests its queue
	// holds by priority, from the routers' fresh rq reports (contract
	// §22), and Queued their sum by priority; only priorities with a
	// request waiting. Absent in older records: empty.
	QueuedBy  map[string]map[int64]uint64 `msgpack:"queued_by"`
	Queued    map[int64]uint64            `msgpack:"queued"`
	UpdatedAt int64                       `msgpack:"updated_at"`
	MonitorID string                      `msgpack:"monitor_id"`
	Epoch     uint64                      `msgpack:"epoch"`
	Seq       uint64                      `msgpack:"seq"`
}

// MarshalBusySet encodes a record with AppendBusySet. Nil lists and maps
// are written empty, never as nil.
func MarshalBusySet(b *BusySet) ([]byte, error) {
	size := 256 + 10*(len(b.Busy)+len(b.Free)+len(b.Stale)+len(b.Amber)+len(b.Hard)) + 24*len(b.Reasons) +
		32*len(b.QueuedBy) + 12*len(b.Queued)
	return AppendBusySet(make([]byte, 0, size), b), nil
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
	// A record written before contract §15 has no amber or hard list.
	if b.Amber == nil {
		b.Amber = []uint64{}
	}
	if b.Hard == nil {
		b.Hard = []uint64{}
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
	// BlockSize is the engine's tokens per KV block, 0 when it does not
	// say (contract §7b, §11).
	BlockSize uint32 `json:"block_size,omitempty"`
}

// RegistryKey is the key of a worker's registry entry, and of its cordon
// (contract §12): <model_key>.<worker_id>.
func RegistryKey(model string, workerID uint64) string {
	return fmt.Sprintf("%s.%d", ModelKey(model), workerID)
}

// ParseWorkerKey splits a key made by RegistryKey, <model_key>.<worker_id>,
// accepting only the canonical forms.
func ParseWorkerKey(key string) (model string, worker uint64, err error) {
	mk, id, ok := strings.Cut(key, ".")
	if !ok || strings.Contains(id, ".") {
		return "", 0, fmt.Errorf("events: key %q is not <model_key>.<worker_id>: %w", key, ErrInvalidSubject)
	}
	if model, err = ParseModelKey(mk); err != nil {
		return "", 0, fmt.Errorf("events: key %q: %w", key, err)
	}
	worker, err = strconv.ParseUint(id, 10, 64)
	if err != nil || strconv.FormatUint(worker, 10) != id {
		return "", 0, fmt.Errorf("events: key %q: worker id %q is not canonical decimal: %w", key, id, ErrInvalidSubject)
	}
	return model, worker, nil
}
