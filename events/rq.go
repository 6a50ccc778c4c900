package events

import (
	"fmt"
	"math"
	"slices"
)

// MaxQueuedPriorities bounds the priorities of one router-queue report
// (contract §22): a router with requests at more priorities reports the
// highest ones.
const MaxQueuedPriorities = 64

// QueuedLevel is one priority of a router's queue: N requests wait at
// Priority (contract §15's integer), the oldest of them for OldestMs.
type QueuedLevel struct {
	Priority int64
	N        uint64
	OldestMs uint64
}

// RouterQueue is one router's queue of one model (contract §22), published
// on <prefix>.rq.<model_key> by a router with flow control on. Msgpack map
// {"v","model","source","boot_id","seq","queued","oldest_ms","sent_at"};
// queued and oldest_ms are maps keyed by the priority as a msgpack integer,
// holding only the priorities with a request waiting. seq and boot_id
// follow contract §3 per source.
type RouterQueue struct {
	Model  string
	Source string // router/<id>
	BootID uint64
	Seq    uint64
	// Queued are the priorities with a request waiting, highest first,
	// each once, every N above 0; empty when the queue is empty.
	Queued []QueuedLevel
	SentAt int64 // publisher clock, Unix nanoseconds
}

// Validate checks a hand-built report: names, and at most
// MaxQueuedPriorities levels, highest priority first, each once, each
// holding a request.
func (r *RouterQueue) Validate() error {
	if err := ValidateModel(r.Model); err != nil {
		return err
	}
	if err := ValidateSource(r.Source); err != nil {
		return err
	}
	if len(r.Queued) > MaxQueuedPriorities {
		return fieldError("queued", fmt.Errorf("%d priorities, at most %d: %w", len(r.Queued), MaxQueuedPriorities, ErrOutOfRange))
	}
	for i, l := range r.Queued {
		if l.N == 0 {
			return fieldError("queued", fmt.Errorf("priority %d holds no request: %w", l.Priority, ErrOutOfRange))
		}
		if i > 0 && l.Priority >= r.Queued[i-1].Priority {
			return fieldError("queued", fmt.Errorf("priorities not descending at %d: %w", l.Priority, ErrOutOfRange))
		}
	}
	return nil
}

// Match checks a decoded report against its subject: an rq subject of the
// payload's model, and a router's source (contract §22).
func (r *RouterQueue) Match(s Subject) error {
	if s.Kind != KindRq || !matchModel(s.ModelKey, r.Model) {
		return fmt.Errorf("events: router queue of %q on subject token %q: %w", r.Model, s.ModelKey, ErrMismatch)
	}
	if !IsRouterSource(r.Source) {
		return fmt.Errorf("events: source %q on an rq subject: %w", r.Source, ErrSourceNotAllowed)
	}
	return nil
}

// Keys of a router-queue report beyond the common ones.
const (
	keyRqQueued = iota + keyCommitted + 1
	keyRqOldest
)

// rqKeyOf returns the number of a router-queue report's own key.
func rqKeyOf(key int, raw []byte) int {
	if key != keyUnknown {
		return key
	}
	switch string(raw) {
	case "queued":
		return keyRqQueued
	case "oldest_ms":
		return keyRqOldest
	}
	return keyUnknown
}

// DecodeRouterQueue decodes one router-queue report with a fresh Decoder.
func DecodeRouterQueue(data []byte) (RouterQueue, error) {
	return NewDecoder().RouterQueue(data)
}

// RouterQueue decodes and validates a router-queue report. Unknown keys are
// ignored; v, model, source, boot_id, seq, queued and sent_at are
// required. A count of 0 is dropped; a priority given twice, a negative
// count or age, or more than MaxQueuedPriorities entries in a map is
// rejected. An age of a priority not in queued is ignored; a priority
// without one has age 0.
func (dec *Decoder) RouterQueue(data []byte) (RouterQueue, error) {
	var r RouterQueue
	n, err := dec.begin(data)
	defer dec.end()
	seen, source, queued := 0, false, false
	var oldest []QueuedLevel
	dec.model, dec.source = 0, 0
	for i := 0; i < n && err == nil; i++ {
		var key, bits int
		var raw []byte
		if key, raw, err = dec.keyRaw(); err != nil {
			break
		}
		switch key = rqKeyOf(key, raw); key {
		case keyRqQueued:
			queued = true
			r.Queued, err = dec.priorityMap("queued", nil)
		case keyRqOldest:
			if oldest, err = dec.priorityMap("oldest_ms", dec.ages[:0]); oldest != nil {
				dec.ages = oldest[:0]
			}
		case keySource:
			var ok bool
			ok, err = dec.stringValue(key, &r.Source, &dec.source)
			source = source || ok
		case keyWorker, keyDPRank, keyDPStart, keyDPSize, keyDecode, keyKVTotal, keyPrefill, keyMaxBatched,
			keyWaiting, keyRunning, keyPreemptions, keyPrefilled, keyCommitted:
			err = dec.skip(1) // not keys of a router-queue report
		default:
			bits, err = dec.commonField(key, &r.Model, nil, nil, &r.BootID, &r.Seq, &r.SentAt)
			seen |= bits
		}
	}
	if err == nil {
		err = dec.finish()
	}
	if err == nil {
		for i, name := range requiredNames {
			if bit := 1 << i; bit != hasWorker && seen&bit == 0 {
				err = fieldError(name, ErrMissingField)
				break
			}
		}
	}
	switch {
	case err != nil:
	case !source:
		err = fieldError("source", ErrMissingField)
	case !queued:
		err = fieldError("queued", ErrMissingField)
	}
	if err == nil {
		err = dec.validNames(r.Model, r.Source)
	}
	if err != nil {
		return RouterQueue{}, err
	}
	r.Queued = slices.DeleteFunc(r.Queued, func(l QueuedLevel) bool { return l.N == 0 })
	if len(r.Queued) == 0 {
		r.Queued = nil
	}
	for i := range r.Queued {
		if j := slices.IndexFunc(oldest, func(o QueuedLevel) bool { return o.Priority == r.Queued[i].Priority }); j >= 0 {
			r.Queued[i].OldestMs = oldest[j].N
		}
	}
	return r, nil
}

// priorityMap decodes a map {priority: non-negative integer} of a
// router-queue report into dst's array, highest priority first, each value
// in N; nil is empty.
func (dec *Decoder) priorityMap(name string, dst []QueuedLevel) ([]QueuedLevel, error) {
	n, err := dec.fieldMap(name)
	if n == 0 || err != nil {
		return nil, err
	}
	if n > MaxQueuedPriorities {
		return nil, fieldError(name, fmt.Errorf("%d priorities, at most %d: %w", n, MaxQueuedPriorities, ErrOutOfRange))
	}
	out := dst[:0]
	if cap(out) < n {
		out = make([]QueuedLevel, 0, n)
	}
	for range n {
		p, err := dec.rqInt(name, "priority", true)
		if err != nil {
			return nil, err
		}
		v, err := dec.rqInt(name, "value", false)
		if err != nil {
			return nil, err
		}
		if slices.ContainsFunc(out, func(l QueuedLevel) bool { return l.Priority == p }) {
			return nil, fieldError(name, fmt.Errorf("priority %d twice: %w", p, ErrMalformed))
		}
		out = append(out, QueuedLevel{Priority: p, N: uint64(v)})
	}
	slices.SortFunc(out, func(a, b QueuedLevel) int {
		switch {
		case a.Priority > b.Priority:
			return -1
		case a.Priority < b.Priority:
			return 1
		}
		return 0
	})
	return out, nil
}

// rqInt decodes an integer of a priority map: a priority (signed, within
// int64) or a value (not negative, at most MaxInt64). what names it in
// errors.
func (dec *Decoder) rqInt(name, what string, signed bool) (int64, error) {
	c, err := dec.peek()
	if err != nil {
		return 0, err
	}
	if !isUnsigned(c) && !isSigned(c) {
		return 0, fieldError(name, fmt.Errorf("%s: want an integer, got code 0x%02x: %w", what, c, ErrWrongType))
	}
	v, negative, err := dec.integer()
	if err != nil {
		return 0, err
	}
	switch {
	case !negative && v > math.MaxInt64:
		return 0, fieldError(name, fmt.Errorf("%s %d overflows int64: %w", what, v, ErrOutOfRange))
	case negative && !signed:
		return 0, fieldError(name, fmt.Errorf("negative %s %d: %w", what, int64(v), ErrOutOfRange))
	}
	return int64(v), nil
}

// RouterQueue validates and encodes r.
func (enc *Encoder) RouterQueue(r *RouterQueue) ([]byte, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	enc.buf.Reset()
	e := enc.e
	_ = e.EncodeMapLen(8)
	enc.uint("v", SchemaVersion)
	enc.str("model", r.Model)
	enc.str("source", r.Source)
	enc.uint("boot_id", r.BootID)
	enc.uint("seq", r.Seq)
	_ = e.EncodeString("queued")
	_ = e.EncodeMapLen(len(r.Queued))
	for _, l := range r.Queued {
		_ = e.EncodeInt(l.Priority)
		_ = e.EncodeUint(l.N)
	}
	_ = e.EncodeString("oldest_ms")
	_ = e.EncodeMapLen(len(r.Queued))
	for _, l := range r.Queued {
		_ = e.EncodeInt(l.Priority)
		_ = e.EncodeUint(l.OldestMs)
	}
	_ = e.EncodeString("sent_at")
	_ = e.EncodeInt(r.SentAt)
	return enc.buf.Bytes(), nil
}

// MarshalRouterQueue encodes r into a new slice.
func MarshalRouterQueue(r *RouterQueue) ([]byte, error) {
	b, err := NewEncoder().RouterQueue(r)
	if err != nil {
		return nil, fmt.Errorf("events: marshal router queue: %w", err)
	}
	return b, nil
}
