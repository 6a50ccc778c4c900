package events

import (
	"fmt"
	"math"
	"strconv"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// LatencyMaxBucket is the last latency bucket (contract §18): bucket k
// counts samples in [2^(k/8), 2^((k+1)/8)) ms, k from 0 to 150.
const LatencyMaxBucket = 150

// LatencyBucket is one non-empty bucket of a latency window.
type LatencyBucket struct {
	K uint8  // bucket number, 0 to LatencyMaxBucket
	N uint64 // samples
}

// LatencyReport is one worker's latency window as one source measured it
// (contract §18): an engine's on <prefix>.lat.<model_key>.<worker_id>, a
// router's (source router/<id>) on <prefix>.latr.<model_key>.<worker_id>.
// Msgpack map {"v","model","worker_id","source","window_ms","ttft","itl",
// "rejected","queued","sent_at"}; ttft and itl are sparse maps keyed by the
// bucket number as a msgpack integer.
type LatencyReport struct {
	Model    string
	WorkerID uint64
	Source   string
	WindowMs uint64
	// TTFT and ITL are the non-empty buckets, ascending, each K once.
	TTFT, ITL []LatencyBucket
	// Rejected and Queued are the router's answers for the whole model in
	// the window (0 from an engine).
	Rejected uint64
	Queued   uint64
	SentAt   int64 // publisher clock, Unix nanoseconds
}

// Validate checks a hand-built report: names, a positive window, buckets in
// range, ascending and distinct.
func (r *LatencyReport) Validate() error {
	if err := ValidateModel(r.Model); err != nil {
		return err
	}
	if err := ValidateSource(r.Source); err != nil {
		return err
	}
	if r.WindowMs == 0 {
		return fieldError("window_ms", fmt.Errorf("must be positive: %w", ErrOutOfRange))
	}
	for _, f := range [...]struct {
		name string
		b    []LatencyBucket
	}{{"ttft", r.TTFT}, {"itl", r.ITL}} {
		for i, b := range f.b {
			if b.K > LatencyMaxBucket {
				return fieldError(f.name, fmt.Errorf("bucket %d past %d: %w", b.K, LatencyMaxBucket, ErrOutOfRange))
			}
			if i > 0 && b.K <= f.b[i-1].K {
				return fieldError(f.name, fmt.Errorf("buckets not ascending at %d: %w", b.K, ErrOutOfRange))
			}
		}
	}
	return nil
}

// Match checks a decoded report against its subject: kind lat carries only
// the engine's source, latr only a router's (contract §18), and the tokens
// must be the payload's.
func (r *LatencyReport) Match(s Subject) error {
	if (s.Kind != KindLat && s.Kind != KindLatr) || !matchModel(s.ModelKey, r.Model) || !matchUint(s.WorkerID, r.WorkerID) {
		return fmt.Errorf("events: latency report of worker %d of %q on subject tokens %q.%q: %w",
			r.WorkerID, r.Model, s.ModelKey, s.WorkerID, ErrMismatch)
	}
	if (s.Kind == KindLatr) != IsRouterSource(r.Source) {
		return fmt.Errorf("events: source %q on a %s subject: %w", r.Source, s.Kind, ErrSourceNotAllowed)
	}
	return nil
}

// LatSubject is the subject of an engine's latency window:
// <prefix>.lat.<model_key>.<worker_id>.
func LatSubject(prefix, model string, workerID uint64) string {
	return prefix + ".lat." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10)
}

// LatrSubject is the subject of a router's latency window:
// <prefix>.latr.<model_key>.<worker_id>.
func LatrSubject(prefix, model string, workerID uint64) string {
	return prefix + ".latr." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10)
}

// Keys of a latency report beyond the common ones.
const (
	keyWindow = iota + keyMaxBatched + 1
	keyTTFT
	keyITL
	keyRejected
	keyQueued
)

// latKeyNames names the keys of a latency report for errors.
var latKeyNames = map[int]string{
	keyWindow: "window_ms", keyTTFT: "ttft", keyITL: "itl", keyRejected: "rejected", keyQueued: "queued",
}

// latKeyOf returns the number of a latency report's own key.
func latKeyOf(key int, raw []byte) int {
	if key != keyUnknown {
		return key
	}
	switch string(raw) {
	case "window_ms":
		return keyWindow
	case "ttft":
		return keyTTFT
	case "itl":
		return keyITL
	case "rejected":
		return keyRejected
	case "queued":
		return keyQueued
	}
	return keyUnknown
}

// DecodeLatencyReport decodes one latency report with a fresh Decoder.
func DecodeLatencyReport(data []byte) (LatencyReport, error) {
	return NewDecoder().LatencyReport(data)
}

// LatencyReport decodes and validates a latency report. Unknown keys are
// ignored; v, model, worker_id, window_ms and sent_at are required.
func (dec *Decoder) LatencyReport(data []byte) (LatencyReport, error) {
	r := LatencyReport{Source: SourceEngine}
	n, err := dec.begin(data)
	defer dec.end()
	seen, window := 0, false
	dec.model, dec.source = 0, validSource
	for i := 0; i < n && err == nil; i++ {
		var key, bits int
		var raw []byte
		if key, raw, err = dec.keyRaw(); err != nil {
			break
		}
		switch key = latKeyOf(key, raw); key {
		case keyWindow:
			window, err = dec.latUint(key, &r.WindowMs)
		case keyRejected:
			_, err = dec.latUint(key, &r.Rejected)
		case keyQueued:
			_, err = dec.latUint(key, &r.Queued)
		case keyTTFT:
			r.TTFT, err = dec.buckets(key)
		case keyITL:
			r.ITL, err = dec.buckets(key)
		case keyBoot, keySeq, keyDPRank, keyDPStart, keyDPSize, keyDecode, keyKVTotal, keyPrefill, keyMaxBatched:
			err = dec.skip(1) // not keys of a latency report
		default:
			bits, err = dec.commonField(key, &r.Model, &r.WorkerID, &r.Source, nil, nil, &r.SentAt)
			seen |= bits
		}
	}
	if err == nil {
		err = dec.finish()
	}
	if err == nil {
		for i, name := range requiredNames {
			if bit := 1 << i; bit != hasBoot && bit != hasSeq && seen&bit == 0 {
				err = fieldError(name, ErrMissingField)
				break
			}
		}
	}
	if err == nil && !window {
		err = fieldError("window_ms", ErrMissingField)
	}
	if err == nil {
		err = dec.validNames(r.Model, r.Source)
	}
	if err == nil && r.WindowMs == 0 {
		err = fieldError("window_ms", fmt.Errorf("must be positive: %w", ErrOutOfRange))
	}
	if err != nil {
		return LatencyReport{}, err
	}
	return r, nil
}

// keyRaw is key, also returning the raw bytes of a string key that is not
// one of keyOf's.
func (dec *Decoder) keyRaw() (int, []byte, error) {
	c, err := dec.peek()
	if err != nil {
		return 0, nil, err
	}
	if !msgpcode.IsString(c) {
		return keyUnknown, nil, dec.skip(1)
	}
	raw, err := dec.rawString()
	if err != nil {
		return 0, nil, err
	}
	return keyOf(raw), raw, nil
}

// latUint decodes an unsigned field of a latency report; nil leaves dst
// alone and returns false.
func (dec *Decoder) latUint(key int, dst *uint64) (bool, error) {
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	c := dec.data[dec.pos]
	if !isUnsigned(c) && !isSigned(c) {
		return false, fieldError(latKeyNames[key], fmt.Errorf("want an integer, got code 0x%02x: %w", c, ErrWrongType))
	}
	v, negative, err := dec.integer()
	if err != nil {
		return false, err
	}
	if negative {
		return false, fieldError(latKeyNames[key], fmt.Errorf("negative value %d: %w", int64(v), ErrOutOfRange))
	}
	*dst = v
	return true, nil
}

// buckets decodes a sparse bucket map {k: count}; nil is empty. Zero
// counts are dropped; a key out of range or given twice is rejected.
func (dec *Decoder) buckets(key int) ([]LatencyBucket, error) {
	name := latKeyNames[key]
	n, err := dec.fieldMap(name)
	if n == 0 || err != nil {
		return nil, err
	}
	var seen [LatencyMaxBucket + 1]bool
	var out []LatencyBucket
	for range n {
		c, err := dec.peek()
		if err != nil {
			return nil, err
		}
		if !isUnsigned(c) && !isSigned(c) {
			return nil, fieldError(name, fmt.Errorf("bucket key: want an integer, got code 0x%02x: %w", c, ErrWrongType))
		}
		k, negative, err := dec.integer()
		if err != nil {
			return nil, err
		}
		if negative || k > LatencyMaxBucket {
			return nil, fieldError(name, fmt.Errorf("bucket %d out of 0..%d: %w", int64(k), LatencyMaxBucket, ErrOutOfRange))
		}
		if seen[k] {
			return nil, fieldError(name, fmt.Errorf("bucket %d twice: %w", k, ErrMalformed))
		}
		seen[k] = true
		var count uint64
		ok, err := dec.latUint(key, &count)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fieldError(name, fmt.Errorf("bucket %d: nil count: %w", k, ErrWrongType))
		}
		if count > 0 {
			out = append(out, LatencyBucket{K: uint8(k), N: count})
		}
	}
	sortBuckets(out)
	return out, nil
}

// sortBuckets sorts a few buckets by K (insertion sort: usually sorted).
func sortBuckets(b []LatencyBucket) {
	for i := 1; i < len(b); i++ {
		for j := i; j > 0 && b[j].K < b[j-1].K; j-- {
			b[j], b[j-1] = b[j-1], b[j]
		}
	}
}

// LatencyReport validates and encodes r.
func (enc *Encoder) LatencyReport(r *LatencyReport) ([]byte, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	enc.buf.Reset()
	e := enc.e
	_ = e.EncodeMapLen(10)
	enc.uint("v", SchemaVersion)
	enc.str("model", r.Model)
	enc.uint("worker_id", r.WorkerID)
	enc.str("source", r.Source)
	enc.uint("window_ms", r.WindowMs)
	for _, f := range [...]struct {
		name string
		b    []LatencyBucket
	}{{"ttft", r.TTFT}, {"itl", r.ITL}} {
		_ = e.EncodeString(f.name)
		_ = e.EncodeMapLen(len(f.b))
		for _, b := range f.b {
			_ = e.EncodeUint(uint64(b.K))
			_ = e.EncodeUint(b.N)
		}
	}
	enc.uint("rejected", r.Rejected)
	enc.uint("queued", r.Queued)
	_ = e.EncodeString("sent_at")
	_ = e.EncodeInt(r.SentAt)
	return enc.buf.Bytes(), nil
}

// MarshalLatencyReport encodes r into a new slice.
func MarshalLatencyReport(r *LatencyReport) ([]byte, error) {
	b, err := NewEncoder().LatencyReport(r)
	if err != nil {
		return nil, fmt.Errorf("events: marshal latency report: %w", err)
	}
	return b, nil
}

// LatencyBucketOf is the bucket of a latency of ms milliseconds (samples
// under 1 ms in bucket 0, past the last bucket in the last).
func LatencyBucketOf(ms float64) uint8 {
	if !(ms >= 1) {
		return 0
	}
	k := math.Floor(8 * math.Log2(ms))
	if k >= LatencyMaxBucket {
		return LatencyMaxBucket
	}
	return uint8(k)
}
