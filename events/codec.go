package events

import (
	"bytes"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// maxInterned bounds the strings a Decoder remembers (see Decoder.intern).
const maxInterned = 1024

// Decoder decodes and validates reports and goodbyes. It reuses its buffers
// between calls, so one Decoder belongs to one goroutine; the zero value is
// not usable, call NewDecoder.
//
// A steady stream of reports decodes without allocating: keys are matched in
// place (knownKey) and model and source names are interned (intern).
type Decoder struct {
	r    bytes.Reader
	d    *msgpack.Decoder
	data []byte            // the payload being decoded, nil between calls
	strs map[string]string // interned names, at most maxInterned
}

// NewDecoder returns a Decoder ready for use.
func NewDecoder() *Decoder {
	dec := &Decoder{strs: make(map[string]string)}
	// bytes.Reader is an io.ByteScanner, so msgpack reads it without a
	// buffer of its own: dec.r's position is always the decoder's, which
	// rawString relies on.
	dec.d = msgpack.NewDecoder(&dec.r)
	return dec
}

// DecodeLoadReport decodes one report with a fresh Decoder.
func DecodeLoadReport(data []byte) (LoadReport, error) { return NewDecoder().LoadReport(data) }

// DecodeGoodbye decodes one goodbye with a fresh Decoder.
func DecodeGoodbye(data []byte) (Goodbye, error) { return NewDecoder().Goodbye(data) }

// field bits for required-field bookkeeping.
const (
	hasV = 1 << iota
	hasModel
	hasWorker
	hasBoot
	hasSeq
	hasSentAt

	requiredReport = hasV | hasModel | hasWorker | hasBoot | hasSeq | hasSentAt
)

var requiredNames = [...]string{"v", "model", "worker_id", "boot_id", "seq", "sent_at"}

// knownKey returns the constant string equal to key when key is one of the
// contract's (§3, §4), and "" for any other key, without allocating: the
// compiler does not copy key for a string conversion that is only switched
// on. Every key LoadReport and commonField decode must be listed here.
func knownKey(key []byte) string {
	switch string(key) {
	case "v":
		return "v"
	case "model":
		return "model"
	case "worker_id":
		return "worker_id"
	case "source":
		return "source"
	case "boot_id":
		return "boot_id"
	case "seq":
		return "seq"
	case "sent_at":
		return "sent_at"
	case "dp_rank":
		return "dp_rank"
	case "dp_start":
		return "dp_start"
	case "dp_size":
		return "dp_size"
	case "active_decode_blocks":
		return "active_decode_blocks"
	case "kv_total_blocks":
		return "kv_total_blocks"
	case "active_prefill_tokens":
		return "active_prefill_tokens"
	case "max_num_batched_tokens":
		return "max_num_batched_tokens"
	}
	return ""
}

// LoadReport decodes and validates a LoadReport payload. Unknown keys are
// ignored; a nil load field counts as absent.
func (dec *Decoder) LoadReport(data []byte) (LoadReport, error) {
	r := LoadReport{DPSize: 1, Source: SourceEngine}
	seen, err := dec.decodeMap(data, func(key string) (int, error) {
		switch key {
		case "dp_rank":
			return 0, dec.uint32Field(key, &r.DPRank)
		case "dp_start":
			return 0, dec.uint32Field(key, &r.DPStart)
		case "dp_size":
			return 0, dec.uint32Field(key, &r.DPSize)
		case "active_decode_blocks":
			return 0, dec.optionalField(key, &r.ActiveDecodeBlocks)
		case "kv_total_blocks":
			return 0, dec.optionalField(key, &r.KVTotalBlocks)
		case "active_prefill_tokens":
			return 0, dec.optionalField(key, &r.ActivePrefillTokens)
		case "max_num_batched_tokens":
			return 0, dec.optionalField(key, &r.MaxNumBatchedTokens)
		}
		return dec.commonField(key, &r.Model, &r.WorkerID, &r.Source, &r.BootID, &r.Seq, &r.SentAt)
	})
	if err != nil {
		return LoadReport{}, err
	}
	if err := checkRequired(seen); err != nil {
		return LoadReport{}, err
	}
	if err := r.Validate(); err != nil {
		return LoadReport{}, err
	}
	return r, nil
}

// Goodbye decodes and validates a Goodbye payload.
func (dec *Decoder) Goodbye(data []byte) (Goodbye, error) {
	g := Goodbye{Source: SourceEngine}
	seen, err := dec.decodeMap(data, func(key string) (int, error) {
		return dec.commonField(key, &g.Model, &g.WorkerID, &g.Source, &g.BootID, &g.Seq, &g.SentAt)
	})
	if err != nil {
		return Goodbye{}, err
	}
	if err := checkRequired(seen); err != nil {
		return Goodbye{}, err
	}
	if err := g.Validate(); err != nil {
		return Goodbye{}, err
	}
	return g, nil
}

// decodeMap walks the top-level map of data, calling field for every string
// key with the decoder positioned at its value; a key that knownKey does not
// know is passed as "". field returns the required bits it saw; it must
// consume the value unless it returns an error.
func (dec *Decoder) decodeMap(data []byte, field func(key string) (int, error)) (int, error) {
	switch {
	case len(data) == 0:
		return 0, fmt.Errorf("events: decode: %w", ErrEmpty)
	case len(data) > MaxPayloadSize:
		return 0, fmt.Errorf("events: decode: %d bytes, limit %d: %w", len(data), MaxPayloadSize, ErrTooLarge)
	}
	dec.r.Reset(data)
	dec.d.Reset(&dec.r)
	dec.data = data
	defer func() { dec.data = nil }()
	c := data[0]
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return 0, fmt.Errorf("events: decode: first byte 0x%02x: %w", c, ErrNotMap)
	}
	n, err := dec.d.DecodeMapLen()
	if err != nil {
		return 0, malformed(err)
	}
	seen := 0
	for range n {
		c, err := dec.d.PeekCode()
		if err != nil {
			return 0, malformed(err)
		}
		if !msgpcode.IsString(c) {
			// Not a key of ours: skip the key and its value.
			if err := dec.skip(2); err != nil {
				return 0, err
			}
			continue
		}
		key, err := dec.rawString()
		if err != nil {
			return 0, err
		}
		bits, err := field(knownKey(key))
		if err != nil {
			return 0, err
		}
		seen |= bits
	}
	if dec.r.Len() != 0 {
		return 0, fmt.Errorf("events: decode: %d bytes after the map: %w", dec.r.Len(), ErrMalformed)
	}
	return seen, nil
}

// commonField decodes the fields reports and goodbyes share; any other key is
// skipped.
func (dec *Decoder) commonField(key string, model *string, worker *uint64, source *string,
	boot, seq *uint64, sentAt *int64) (int, error) {
	switch key {
	case "v":
		var v uint64
		ok, err := dec.uintValue(key, &v)
		if err != nil || !ok {
			return 0, err
		}
		if v != SchemaVersion {
			return 0, fieldError(key, fmt.Errorf("%d: %w", v, ErrVersion))
		}
		return hasV, nil
	case "model":
		ok, err := dec.stringValue(key, model)
		return bit(ok, hasModel), err
	case "worker_id":
		ok, err := dec.uintValue(key, worker)
		return bit(ok, hasWorker), err
	case "source":
		_, err := dec.stringValue(key, source)
		return 0, err
	case "boot_id":
		ok, err := dec.uintValue(key, boot)
		return bit(ok, hasBoot), err
	case "seq":
		ok, err := dec.uintValue(key, seq)
		return bit(ok, hasSeq), err
	case "sent_at":
		ok, err := dec.intValue(key, sentAt)
		return bit(ok, hasSentAt), err
	}
	return 0, dec.skip(1)
}

func bit(ok bool, b int) int {
	if ok {
		return b
	}
	return 0
}

func checkRequired(seen int) error {
	for i, name := range requiredNames {
		if seen&(1<<i) == 0 {
			return fieldError(name, ErrMissingField)
		}
	}
	return nil
}

// skip consumes n values.
func (dec *Decoder) skip(n int) error {
	for range n {
		if err := dec.d.Skip(); err != nil {
			return malformed(err)
		}
	}
	return nil
}

func malformed(err error) error {
	return fmt.Errorf("events: decode: %w: %v", ErrMalformed, err)
}

// isNil consumes a nil value if one is next.
func (dec *Decoder) isNil() (bool, error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return false, malformed(err)
	}
	if c != msgpcode.Nil {
		return false, nil
	}
	if err := dec.d.DecodeNil(); err != nil {
		return false, malformed(err)
	}
	return true, nil
}

func isSigned(c byte) bool {
	return c >= msgpcode.NegFixedNumLow || c >= msgpcode.Int8 && c <= msgpcode.Int64
}

func isUnsigned(c byte) bool {
	return c <= msgpcode.PosFixedNumHigh || c >= msgpcode.Uint8 && c <= msgpcode.Uint64
}

// uintValue decodes a non-negative integer of any msgpack width. A nil leaves
// dst alone and returns false.
func (dec *Decoder) uintValue(key string, dst *uint64) (bool, error) {
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	c, _ := dec.d.PeekCode()
	switch {
	case isUnsigned(c):
		v, err := dec.d.DecodeUint64()
		if err != nil {
			return false, malformed(err)
		}
		*dst = v
	case isSigned(c):
		v, err := dec.d.DecodeInt64()
		if err != nil {
			return false, malformed(err)
		}
		if v < 0 {
			return false, fieldError(key, fmt.Errorf("negative value %d: %w", v, ErrOutOfRange))
		}
		*dst = uint64(v)
	default:
		return false, fieldError(key, fmt.Errorf("want an integer, got code 0x%02x: %w", c, ErrWrongType))
	}
	return true, nil
}

// intValue decodes an integer that fits int64.
func (dec *Decoder) intValue(key string, dst *int64) (bool, error) {
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	c, _ := dec.d.PeekCode()
	switch {
	case isSigned(c):
		v, err := dec.d.DecodeInt64()
		if err != nil {
			return false, malformed(err)
		}
		*dst = v
	case isUnsigned(c):
		v, err := dec.d.DecodeUint64()
		if err != nil {
			return false, malformed(err)
		}
		if v > math.MaxInt64 {
			return false, fieldError(key, fmt.Errorf("%d overflows int64: %w", v, ErrOutOfRange))
		}
		*dst = int64(v)
	default:
		return false, fieldError(key, fmt.Errorf("want an integer, got code 0x%02x: %w", c, ErrWrongType))
	}
	return true, nil
}

func (dec *Decoder) uint32Field(key string, dst *uint32) error {
	var v uint64
	ok, err := dec.uintValue(key, &v)
	if err != nil || !ok {
		return err
	}
	if v > math.MaxUint32 {
		return fieldError(key, fmt.Errorf("%d overflows uint32: %w", v, ErrOutOfRange))
	}
	*dst = uint32(v)
	return nil
}

// optionalField decodes a load field. A nil makes it absent, also when the
// key came before with a value.
func (dec *Decoder) optionalField(key string, dst *Optional) error {
	var v uint64
	ok, err := dec.uintValue(key, &v)
	if err != nil {
		return err
	}
	*dst = Optional{Value: v, Set: ok}
	return nil
}

// stringValue decodes a str value. A nil leaves dst alone and returns false.
func (dec *Decoder) stringValue(key string, dst *string) (bool, error) {
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	c, _ := dec.d.PeekCode()
	if !msgpcode.IsString(c) {
		return false, fieldError(key, fmt.Errorf("want a string, got code 0x%02x: %w", c, ErrWrongType))
	}
	b, err := dec.rawString()
	if err != nil {
		return false, err
	}
	*dst = dec.intern(b)
	return true, nil
}

// rawString consumes the str value that comes next and returns its bytes in
// place in dec.data, without copying them. The caller has checked that a str
// comes next.
func (dec *Decoder) rawString() ([]byte, error) {
	n, err := dec.d.DecodeBytesLen()
	if err != nil {
		return nil, malformed(err)
	}
	if n < 0 || n > dec.r.Len() {
		return nil, malformed(io.ErrUnexpectedEOF)
	}
	start := len(dec.data) - dec.r.Len()
	if _, err := dec.r.Seek(int64(n), io.SeekCurrent); err != nil {
		return nil, malformed(err)
	}
	return dec.data[start : start+n], nil
}

// intern returns b as a string, reusing the string of an equal earlier value
// so that the model and source names of a steady stream of reports cost no
// allocation. Only strings short enough to be a valid name are kept, at most
// maxInterned of them.
func (dec *Decoder) intern(b []byte) string {
	if s, ok := dec.strs[string(b)]; ok {
		return s
	}
	s := string(b)
	if len(s) <= max(MaxModelLen, MaxSourceLen) {
		if len(dec.strs) >= maxInterned {
			clear(dec.strs)
		}
		dec.strs[s] = s
	}
	return s
}
