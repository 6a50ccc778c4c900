package events

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// maxInterned bounds the strings a Decoder remembers (see Decoder.intern).
const maxInterned = 1024

// Decoder decodes and validates reports and goodbyes. It reuses its buffers
// between calls, so one Decoder belongs to one goroutine; the zero value is
// not usable, call NewDecoder.
//
// It reads the msgpack bytes in place, without a general msgpack decoder: a
// steady stream of reports decodes without allocating, keys are matched in
// place (keyOf) and model and source names are interned (intern).
type Decoder struct {
	data []byte // the payload being decoded, nil between calls
	pos  int    // next byte of data to read
	// model and source are the checks the names of the message being
	// decoded are known to pass (their interned entries').
	model, source uint8
	strs          map[string]interned // interned names, at most maxInterned
	// ages is the scratch of a router-queue report's oldest_ms map,
	// consumed within the call.
	ages []QueuedLevel
}

// interned is a name a Decoder has seen, and the checks it passed.
type interned struct {
	s     string
	valid uint8 // validModel, validSource
}

// Checks an interned name passed.
const (
	validModel = 1 << iota
	validSource
)

// NewDecoder returns a Decoder ready for use.
func NewDecoder() *Decoder {
	return &Decoder{strs: make(map[string]interned)}
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

// Keys of the contract (§3, §4), numbered so that a key is compared as
// bytes once and then switched on as an integer.
const (
	keyUnknown = iota
	keyV
	keyModel
	keyWorker
	keySource
	keyBoot
	keySeq
	keySentAt
	keyDPRank
	keyDPStart
	keyDPSize
	keyDecode
	keyKVTotal
	keyPrefill
	keyMaxBatched
	keyWaiting
	keyRunning
	keyPreemptions
	keyPrefilled
	keyCommitted
)

// keyNames are the keys by number.
var keyNames = [...]string{
	keyV: "v", keyModel: "model", keyWorker: "worker_id", keySource: "source", keyBoot: "boot_id",
	keySeq: "seq", keySentAt: "sent_at", keyDPRank: "dp_rank", keyDPStart: "dp_start", keyDPSize: "dp_size",
	keyDecode: "active_decode_blocks", keyKVTotal: "kv_total_blocks", keyPrefill: "active_prefill_tokens",
	keyMaxBatched: "max_num_batched_tokens", keyWaiting: "waiting_requests", keyRunning: "running_requests",
	keyPreemptions: "preemptions", keyPrefilled: "prefilled_tokens", keyCommitted: "kv_committed_blocks",
}

// keyOf returns the number of key, keyUnknown for a key that is not the
// contract's, without allocating: the compiler does not copy key for a
// string conversion that is only switched on.
func keyOf(key []byte) int {
	switch string(key) {
	case "v":
		return keyV
	case "model":
		return keyModel
	case "worker_id":
		return keyWorker
	case "source":
		return keySource
	case "boot_id":
		return keyBoot
	case "seq":
		return keySeq
	case "sent_at":
		return keySentAt
	case "dp_rank":
		return keyDPRank
	case "dp_start":
		return keyDPStart
	case "dp_size":
		return keyDPSize
	case "active_decode_blocks":
		return keyDecode
	case "kv_total_blocks":
		return keyKVTotal
	case "active_prefill_tokens":
		return keyPrefill
	case "max_num_batched_tokens":
		return keyMaxBatched
	case "waiting_requests":
		return keyWaiting
	case "running_requests":
		return keyRunning
	case "preemptions":
		return keyPreemptions
	case "prefilled_tokens":
		return keyPrefilled
	case "kv_committed_blocks":
		return keyCommitted
	}
	return keyUnknown
}

// LoadReport decodes and validates a LoadReport payload. Unknown keys are
// ignored; a nil load field counts as absent.
func (dec *Decoder) LoadReport(data []byte) (LoadReport, error) {
	r := LoadReport{DPSize: 1, Source: SourceEngine}
	n, err := dec.begin(data)
	defer dec.end()
	seen := 0
	dec.model, dec.source = 0, validSource // the default source is valid
	for i := 0; i < n && err == nil; i++ {
		var key, bits int
		if key, err = dec.key(); err != nil {
			break
		}
		switch key {
		case keyDPRank:
			err = dec.uint32Field(key, &r.DPRank)
		case keyDPStart:
			err = dec.uint32Field(key, &r.DPStart)
		case keyDPSize:
			err = dec.uint32Field(key, &r.DPSize)
		case keyDecode:
			err = dec.optionalField(key, &r.ActiveDecodeBlocks)
		case keyKVTotal:
			err = dec.optionalField(key, &r.KVTotalBlocks)
		case keyPrefill:
			err = dec.optionalField(key, &r.ActivePrefillTokens)
		case keyMaxBatched:
			err = dec.optionalField(key, &r.MaxNumBatchedTokens)
		case keyWaiting:
			err = dec.optionalField(key, &r.WaitingRequests)
		case keyRunning:
			err = dec.optionalField(key, &r.RunningRequests)
		case keyPreemptions:
			err = dec.optionalField(key, &r.Preemptions)
		case keyPrefilled:
			err = dec.optionalField(key, &r.PrefilledTokens)
		case keyCommitted:
			err = dec.optionalField(key, &r.KVCommittedBlocks)
		default:
			bits, err = dec.commonField(key, &r.Model, &r.WorkerID, &r.Source, &r.BootID, &r.Seq, &r.SentAt)
			seen |= bits
		}
	}
	if err == nil {
		err = dec.done(seen, r.Model, r.Source)
	}
	if err == nil {
		err = r.validateRanks()
	}
	if err != nil {
		return LoadReport{}, err
	}
	return r, nil
}

// Goodbye decodes and validates a Goodbye payload.
func (dec *Decoder) Goodbye(data []byte) (Goodbye, error) {
	g := Goodbye{Source: SourceEngine}
	n, err := dec.begin(data)
	defer dec.end()
	seen := 0
	dec.model, dec.source = 0, validSource
	for i := 0; i < n && err == nil; i++ {
		var key, bits int
		if key, err = dec.key(); err == nil {
			bits, err = dec.commonField(key, &g.Model, &g.WorkerID, &g.Source, &g.BootID, &g.Seq, &g.SentAt)
			seen |= bits
		}
	}
	if err == nil {
		err = dec.done(seen, g.Model, g.Source)
	}
	if err != nil {
		return Goodbye{}, err
	}
	return g, nil
}

// begin starts decoding data, which must be a map, and returns its number
// of entries. end must follow, whatever the result.
func (dec *Decoder) begin(data []byte) (int, error) {
	switch {
	case len(data) == 0:
		return 0, fmt.Errorf("events: decode: %w", ErrEmpty)
	case len(data) > MaxPayloadSize:
		return 0, fmt.Errorf("events: decode: %d bytes, limit %d: %w", len(data), MaxPayloadSize, ErrTooLarge)
	}
	c := data[0]
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return 0, fmt.Errorf("events: decode: first byte 0x%02x: %w", c, ErrNotMap)
	}
	dec.data, dec.pos = data, 0
	return dec.mapLen()
}

// end forgets the payload.
func (dec *Decoder) end() { dec.data, dec.pos = nil, 0 }

// done runs the checks a message ends with: the map was the whole
// payload, the required keys were there, the names are valid.
func (dec *Decoder) done(seen int, model, source string) error {
	if err := dec.finish(); err != nil {
		return err
	}
	if err := checkRequired(seen); err != nil {
		return err
	}
	return dec.validNames(model, source)
}

// finish checks that the map was the whole payload.
func (dec *Decoder) finish() error {
	if rest := len(dec.data) - dec.pos; rest != 0 {
		return fmt.Errorf("events: decode: %d bytes after the map: %w", rest, ErrMalformed)
	}
	return nil
}

// key consumes a map key and returns its number: keyUnknown for a string
// key that is not the contract's and for a key that is not a string (which
// it skips). The value of an unknown key is left for commonField to skip.
func (dec *Decoder) key() (int, error) {
	c, err := dec.peek()
	if err != nil {
		return 0, err
	}
	if !msgpcode.IsString(c) {
		return keyUnknown, dec.skip(1)
	}
	key, err := dec.rawString()
	if err != nil {
		return 0, err
	}
	return keyOf(key), nil
}

// commonField decodes the fields reports and goodbyes share; the value of
// any other key is skipped.
func (dec *Decoder) commonField(key int, model *string, worker *uint64, source *string,
	boot, seq *uint64, sentAt *int64) (int, error) {
	switch key {
	case keyV:
		var v uint64
		ok, err := dec.uintValue(key, &v)
		if err != nil || !ok {
			return 0, err
		}
		if v != SchemaVersion {
			return 0, fieldError(keyNames[key], fmt.Errorf("%d: %w", v, ErrVersion))
		}
		return hasV, nil
	case keyModel:
		ok, err := dec.stringValue(key, model, &dec.model)
		return bit(ok, hasModel), err
	case keyWorker:
		ok, err := dec.uintValue(key, worker)
		return bit(ok, hasWorker), err
	case keySource:
		_, err := dec.stringValue(key, source, &dec.source)
		return 0, err
	case keyBoot:
		ok, err := dec.uintValue(key, boot)
		return bit(ok, hasBoot), err
	case keySeq:
		ok, err := dec.uintValue(key, seq)
		return bit(ok, hasSeq), err
	case keySentAt:
		ok, err := dec.intValue(key, sentAt)
		return bit(ok, hasSentAt), err
	}
	return 0, dec.skip(1)
}

// errTruncated is the cause of a payload that ends inside a value.
var errTruncated = fmt.Errorf("events: decode: %w: %w", ErrMalformed, io.ErrUnexpectedEOF)

// peek returns the code of the next value without consuming it.
func (dec *Decoder) peek() (byte, error) {
	if dec.pos >= len(dec.data) {
		return 0, errTruncated
	}
	return dec.data[dec.pos], nil
}

// take consumes n bytes and returns them.
func (dec *Decoder) take(n int) ([]byte, error) {
	if n < 0 || n > len(dec.data)-dec.pos {
		return nil, errTruncated
	}
	b := dec.data[dec.pos : dec.pos+n]
	dec.pos += n
	return b, nil
}

// size consumes a big-endian unsigned integer of n bytes (1, 2, 4 or 8).
func (dec *Decoder) size(n int) (uint64, error) {
	b, err := dec.take(n)
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, x := range b {
		v = v<<8 | uint64(x)
	}
	return v, nil
}

// mapLen consumes the header of a map (the caller checked the code).
func (dec *Decoder) mapLen() (int, error) {
	c := dec.data[dec.pos]
	dec.pos++
	switch c {
	case msgpcode.Map16:
		n, err := dec.size(2)
		return int(n), err
	case msgpcode.Map32:
		n, err := dec.size(4)
		return int(n), err
	}
	return int(c & msgpcode.FixedMapMask), nil
}

// fieldMap consumes the header of a map field named name in errors: nil
// is 0 entries, another type ErrWrongType, and a count of entries the
// bytes left cannot hold (each takes at least two) errTruncated.
func (dec *Decoder) fieldMap(name string) (int, error) {
	if null, err := dec.isNil(); null || err != nil {
		return 0, err
	}
	c := dec.data[dec.pos]
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return 0, fieldError(name, fmt.Errorf("want a map, got code 0x%02x: %w", c, ErrWrongType))
	}
	n, err := dec.mapLen()
	if err != nil {
		return 0, err
	}
	if n > (len(dec.data)-dec.pos)/2 {
		return 0, errTruncated
	}
	return n, nil
}

// skip consumes n values of any type, nested ones included, without
// recursion: a container adds its elements to the count.
func (dec *Decoder) skip(n int) error {
	for ; n > 0; n-- {
		// Every value takes at least one byte: a count beyond the bytes
		// left is a lie, caught before it can grow.
		if n > len(dec.data)-dec.pos {
			return errTruncated
		}
		c := dec.data[dec.pos]
		dec.pos++
		var body, elems uint64 // bytes to skip, values to add
		var err error
		switch {
		case c <= msgpcode.PosFixedNumHigh, c >= msgpcode.NegFixedNumLow,
			c == msgpcode.Nil, c == msgpcode.False, c == msgpcode.True:
		case msgpcode.IsFixedMap(c):
			elems = 2 * uint64(c&msgpcode.FixedMapMask)
		case msgpcode.IsFixedArray(c):
			elems = uint64(c & msgpcode.FixedArrayMask)
		case msgpcode.IsFixedString(c):
			body = uint64(c & msgpcode.FixedStrMask)
		case c == msgpcode.Uint8, c == msgpcode.Int8:
			body = 1
		case c == msgpcode.Uint16, c == msgpcode.Int16:
			body = 2
		case c == msgpcode.Uint32, c == msgpcode.Int32, c == msgpcode.Float:
			body = 4
		case c == msgpcode.Uint64, c == msgpcode.Int64, c == msgpcode.Double:
			body = 8
		case c == msgpcode.FixExt1:
			body = 2
		case c == msgpcode.FixExt2:
			body = 3
		case c == msgpcode.FixExt4:
			body = 5
		case c == msgpcode.FixExt8:
			body = 9
		case c == msgpcode.FixExt16:
			body = 17
		case c == msgpcode.Str8, c == msgpcode.Bin8:
			body, err = dec.size(1)
		case c == msgpcode.Str16, c == msgpcode.Bin16:
			body, err = dec.size(2)
		case c == msgpcode.Str32, c == msgpcode.Bin32:
			body, err = dec.size(4)
		case c == msgpcode.Ext8:
			body, err = dec.size(1)
			body++ // the type byte
		case c == msgpcode.Ext16:
			body, err = dec.size(2)
			body++
		case c == msgpcode.Ext32:
			body, err = dec.size(4)
			body++
		case c == msgpcode.Array16:
			elems, err = dec.size(2)
		case c == msgpcode.Array32:
			elems, err = dec.size(4)
		case c == msgpcode.Map16:
			elems, err = dec.size(2)
			elems *= 2
		case c == msgpcode.Map32:
			elems, err = dec.size(4)
			elems *= 2
		default:
			return malformed(fmt.Errorf("invalid code 0x%02x", c))
		}
		if err != nil {
			return err
		}
		if body > uint64(len(dec.data)-dec.pos) || elems > uint64(len(dec.data)-dec.pos) {
			return errTruncated
		}
		dec.pos += int(body)
		n += int(elems)
	}
	return nil
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

func malformed(err error) error {
	return fmt.Errorf("events: decode: %w: %v", ErrMalformed, err)
}

// isNil consumes a nil value if one is next.
func (dec *Decoder) isNil() (bool, error) {
	c, err := dec.peek()
	if err != nil {
		return false, err
	}
	if c != msgpcode.Nil {
		return false, nil
	}
	dec.pos++
	return true, nil
}

func isSigned(c byte) bool {
	return c >= msgpcode.NegFixedNumLow || c >= msgpcode.Int8 && c <= msgpcode.Int64
}

func isUnsigned(c byte) bool {
	return c <= msgpcode.PosFixedNumHigh || c >= msgpcode.Uint8 && c <= msgpcode.Uint64
}

// integer consumes an integer of any msgpack width. It returns its value
// as the bits of a uint64 and whether it is negative (then the bits are
// those of an int64). The caller checked that an integer comes next.
func (dec *Decoder) integer() (v uint64, negative bool, err error) {
	c := dec.data[dec.pos]
	dec.pos++
	switch {
	case c <= msgpcode.PosFixedNumHigh:
		return uint64(c), false, nil
	case c >= msgpcode.NegFixedNumLow:
		return uint64(int64(int8(c))), true, nil
	case c >= msgpcode.Uint8 && c <= msgpcode.Uint64:
		n := 1 << (c - msgpcode.Uint8)
		if n > len(dec.data)-dec.pos {
			return 0, false, errTruncated
		}
		b := dec.data[dec.pos : dec.pos+n]
		dec.pos += n
		switch n {
		case 1:
			return uint64(b[0]), false, nil
		case 2:
			return uint64(binary.BigEndian.Uint16(b)), false, nil
		case 4:
			return uint64(binary.BigEndian.Uint32(b)), false, nil
		}
		return binary.BigEndian.Uint64(b), false, nil
	}
	// Int8 to Int64: sign-extend.
	n := 1 << (c - msgpcode.Int8)
	if v, err = dec.size(n); err != nil {
		return 0, false, err
	}
	shift := 64 - 8*n
	i := int64(v<<shift) >> shift
	return uint64(i), i < 0, nil
}

// uintValue decodes a non-negative integer of any msgpack width. A nil leaves
// dst alone and returns false.
func (dec *Decoder) uintValue(key int, dst *uint64) (bool, error) {
	if dec.pos < len(dec.data) && dec.data[dec.pos] <= msgpcode.PosFixedNumHigh {
		*dst = uint64(dec.data[dec.pos]) // the common case: a small number
		dec.pos++
		return true, nil
	}
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	c := dec.data[dec.pos]
	if !isUnsigned(c) && !isSigned(c) {
		return false, fieldError(keyNames[key], fmt.Errorf("want an integer, got code 0x%02x: %w", c, ErrWrongType))
	}
	v, negative, err := dec.integer()
	if err != nil {
		return false, err
	}
	if negative {
		return false, fieldError(keyNames[key], fmt.Errorf("negative value %d: %w", int64(v), ErrOutOfRange))
	}
	*dst = v
	return true, nil
}

// intValue decodes an integer that fits int64.
func (dec *Decoder) intValue(key int, dst *int64) (bool, error) {
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	c := dec.data[dec.pos]
	if !isUnsigned(c) && !isSigned(c) {
		return false, fieldError(keyNames[key], fmt.Errorf("want an integer, got code 0x%02x: %w", c, ErrWrongType))
	}
	v, negative, err := dec.integer()
	if err != nil {
		return false, err
	}
	if !negative && v > math.MaxInt64 {
		return false, fieldError(keyNames[key], fmt.Errorf("%d overflows int64: %w", v, ErrOutOfRange))
	}
	*dst = int64(v)
	return true, nil
}

func (dec *Decoder) uint32Field(key int, dst *uint32) error {
	var v uint64
	ok, err := dec.uintValue(key, &v)
	if err != nil || !ok {
		return err
	}
	if v > math.MaxUint32 {
		return fieldError(keyNames[key], fmt.Errorf("%d overflows uint32: %w", v, ErrOutOfRange))
	}
	*dst = uint32(v)
	return nil
}

// optionalField decodes a load field. A nil makes it absent, also when the
// key came before with a value.
func (dec *Decoder) optionalField(key int, dst *Optional) error {
	var v uint64
	ok, err := dec.uintValue(key, &v)
	if err != nil {
		return err
	}
	*dst = Optional{Value: v, Set: ok}
	return nil
}

// stringValue decodes a str value. A nil leaves dst alone and returns false.
func (dec *Decoder) stringValue(key int, dst *string, valid *uint8) (bool, error) {
	if null, err := dec.isNil(); null || err != nil {
		return false, err
	}
	if c := dec.data[dec.pos]; !msgpcode.IsString(c) {
		return false, fieldError(keyNames[key], fmt.Errorf("want a string, got code 0x%02x: %w", c, ErrWrongType))
	}
	b, err := dec.rawString()
	if err != nil {
		return false, err
	}
	*dst, *valid = dec.intern(b)
	return true, nil
}

// rawString consumes the str value that comes next and returns its bytes in
// place in dec.data, without copying them. The caller has checked that a str
// comes next.
func (dec *Decoder) rawString() ([]byte, error) {
	c := dec.data[dec.pos]
	if msgpcode.IsFixedString(c) {
		// Every key and most names: no length bytes to read.
		start, end := dec.pos+1, dec.pos+1+int(c&msgpcode.FixedStrMask)
		if end > len(dec.data) {
			return nil, errTruncated
		}
		dec.pos = end
		return dec.data[start:end], nil
	}
	dec.pos++
	var n uint64
	var err error
	switch c {
	case msgpcode.Str8:
		n, err = dec.size(1)
	case msgpcode.Str16:
		n, err = dec.size(2)
	case msgpcode.Str32:
		n, err = dec.size(4)
	default:
		n = uint64(c & msgpcode.FixedStrMask)
	}
	if err != nil {
		return nil, err
	}
	if n > uint64(len(dec.data)-dec.pos) {
		return nil, errTruncated
	}
	return dec.take(int(n))
}

// intern returns b as a string, reusing the string of an equal earlier value
// so that the model and source names of a steady stream of reports cost no
// allocation, with the checks it passed before. Only strings short enough
// to be a valid name are kept, at most maxInterned of them.
func (dec *Decoder) intern(b []byte) (string, uint8) {
	if e, ok := dec.strs[string(b)]; ok {
		return e.s, e.valid
	}
	s := string(b)
	if len(s) <= max(MaxModelLen, MaxSourceLen) {
		if len(dec.strs) >= maxInterned {
			clear(dec.strs)
		}
		dec.strs[s] = interned{s: s}
	}
	return s, 0
}

// validNames checks the model and source names of the message just
// decoded, unless their interned entries say they passed before, and marks
// the entries of those that pass.
func (dec *Decoder) validNames(model, source string) error {
	if dec.model&validModel == 0 {
		if err := ValidateModel(model); err != nil {
			return err
		}
		dec.mark(model, validModel)
	}
	if dec.source&validSource == 0 {
		if err := ValidateSource(source); err != nil {
			return err
		}
		dec.mark(source, validSource)
	}
	return nil
}

// mark records that the interned name s passed a check.
func (dec *Decoder) mark(s string, check uint8) {
	if e, ok := dec.strs[s]; ok {
		e.valid |= check
		dec.strs[s] = e
	}
}
