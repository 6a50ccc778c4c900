package events

import (
	"encoding/binary"
	"maps"
	"math"
	"slices"
	"strconv"
)

// AppendBusySet appends the msgpack encoding of a busy-set record (contract
// §6) to b and returns it: the fields in a fixed order, nil lists and maps
// written empty, and, so that a record of 10,000 workers costs no sort, the
// reasons of the busy workers in the order of Busy, any other after them in
// the order of their keys. It is the one encoder of records: MarshalBusySet
// and the busylist Writer use it.
func AppendBusySet(b []byte, r *BusySet) []byte {
	b = appendMapLen(b, 18)
	b = appendStr(b, "v")
	b = appendUint(b, SchemaVersion)
	b = appendStr(b, "model")
	b = appendStr(b, r.Model)
	b = appendStr(b, "busy")
	b = appendUints(b, r.Busy)
	b = appendStr(b, "free")
	b = appendUints(b, r.Free)
	b = appendStr(b, "stale")
	b = appendUints(b, r.Stale)
	b = appendStr(b, "all_busy")
	b = appendBool(b, r.AllBusy)
	b = appendStr(b, "amber")
	b = appendUints(b, r.Amber)
	b = appendStr(b, "hard")
	b = appendUints(b, r.Hard)
	b = appendStr(b, "reasons")
	b = appendReasons(b, r.Busy, r.Reasons)
	b = appendStr(b, "thresholds")
	b = appendThresholds(b, r.Thresholds)
	b = appendStr(b, "routers")
	b = appendUint(b, r.Routers)
	b = appendStr(b, "saturation")
	b = appendFloat(b, r.Saturation)
	b = appendStr(b, "queued_by")
	b = appendQueuedBy(b, r.QueuedBy)
	b = appendStr(b, "queued")
	b = appendQueued(b, r.Queued)
	b = appendStr(b, "updated_at")
	b = appendInt(b, r.UpdatedAt)
	b = appendStr(b, "monitor_id")
	b = appendStr(b, r.MonitorID)
	b = appendStr(b, "epoch")
	b = appendUint(b, r.Epoch)
	b = appendStr(b, "seq")
	b = appendUint(b, r.Seq)
	return b
}

// appendReasons appends the reasons map: those of the busy workers in the
// order of busy, then any other in the order of its key. With a busy list
// that is not strictly ascending, every reason in the order of its key.
func appendReasons(b []byte, busy []uint64, reasons map[string]string) []byte {
	b = appendMapLen(b, len(reasons))
	ascending := true
	for i := 1; i < len(busy) && ascending; i++ {
		ascending = busy[i-1] < busy[i]
	}
	var num [20]byte
	n := 0
	if ascending {
		for _, id := range busy {
			key := strconv.AppendUint(num[:0], id, 10)
			if reason, ok := reasons[string(key)]; ok {
				b = appendStrBytes(b, key)
				b = appendStr(b, reason)
				n++
			}
		}
	}
	if n == len(reasons) {
		return b
	}
	rest := make([]string, 0, len(reasons)-n)
	for key := range reasons {
		if !ascending || !isBusyKey(busy, key) {
			rest = append(rest, key)
		}
	}
	slices.Sort(rest)
	for _, key := range rest {
		b = appendStr(b, key)
		b = appendStr(b, reasons[key])
	}
	return b
}

// isBusyKey reports whether key is the decimal id of a worker of the
// ascending list busy, written as appendReasons writes it.
func isBusyKey(busy []uint64, key string) bool {
	id, err := strconv.ParseUint(key, 10, 64)
	if err != nil || strconv.FormatUint(id, 10) != key {
		return false
	}
	_, ok := slices.BinarySearch(busy, id)
	return ok
}

// appendThresholds appends the thresholds map: the ones set only.
func appendThresholds(b []byte, t Thresholds) []byte {
	n := 0
	for _, set := range [...]bool{t.ActiveDecodeBlocks != nil, t.ActivePrefillTokens != nil, t.ActivePrefillTokensFrac != nil,
		t.KVCommitted != nil, t.QueueDelayMs != nil} {
		if set {
			n++
		}
	}
	b = appendMapLen(b, n)
	if t.ActiveDecodeBlocks != nil {
		b = appendStr(b, "active_decode_blocks_threshold")
		b = appendFloat(b, *t.ActiveDecodeBlocks)
	}
	if t.ActivePrefillTokens != nil {
		b = appendStr(b, "active_prefill_tokens_threshold")
		b = appendUint(b, *t.ActivePrefillTokens)
	}
	if t.ActivePrefillTokensFrac != nil {
		b = appendStr(b, "active_prefill_tokens_threshold_frac")
		b = appendFloat(b, *t.ActivePrefillTokensFrac)
	}
	if t.KVCommitted != nil {
		b = appendStr(b, "kv_committed_threshold")
		b = appendFloat(b, *t.KVCommitted)
	}
	if t.QueueDelayMs != nil {
		b = appendStr(b, "queue_delay_threshold_ms")
		b = appendUint(b, *t.QueueDelayMs)
	}
	return b
}

// appendQueuedBy appends the queued_by map (contract §22): the sources in
// the order of their names, each one's priorities as appendQueued writes
// them.
func appendQueuedBy(b []byte, by map[string]map[int64]uint64) []byte {
	b = appendMapLen(b, len(by))
	if len(by) == 0 {
		return b
	}
	for _, src := range slices.Sorted(maps.Keys(by)) {
		b = appendStr(b, src)
		b = appendQueued(b, by[src])
	}
	return b
}

// appendQueued appends a map {priority: count}, the highest priority
// first.
func appendQueued(b []byte, q map[int64]uint64) []byte {
	b = appendMapLen(b, len(q))
	if len(q) == 0 {
		return b
	}
	ps := slices.Sorted(maps.Keys(q))
	for i := len(ps) - 1; i >= 0; i-- {
		b = appendInt(b, ps[i])
		b = appendUint(b, q[ps[i]])
	}
	return b
}

// The msgpack codes this file writes.
const (
	mpFixMap   = 0x80
	mpFixArray = 0x90
	mpFixStr   = 0xa0
	mpFalse    = 0xc2
	mpTrue     = 0xc3
	mpDouble   = 0xcb
	mpUint8    = 0xcc
	mpUint16   = 0xcd
	mpUint32   = 0xce
	mpUint64   = 0xcf
	mpInt8     = 0xd0
	mpInt16    = 0xd1
	mpInt32    = 0xd2
	mpInt64    = 0xd3
	mpStr8     = 0xd9
	mpStr16    = 0xda
	mpStr32    = 0xdb
	mpArray16  = 0xdc
	mpArray32  = 0xdd
	mpMap16    = 0xde
	mpMap32    = 0xdf
)

// appendUint appends n in the fewest bytes.
func appendUint(b []byte, n uint64) []byte {
	switch {
	case n <= math.MaxInt8:
		return append(b, byte(n))
	case n <= math.MaxUint8:
		return append(b, mpUint8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, mpUint16), uint16(n))
	case n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, mpUint32), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, mpUint64), n)
}

// appendInt appends n in the fewest bytes: unsigned when not negative.
func appendInt(b []byte, n int64) []byte {
	switch {
	case n >= 0:
		return appendUint(b, uint64(n))
	case n >= -32:
		return append(b, byte(n))
	case n >= math.MinInt8:
		return append(b, mpInt8, byte(n))
	case n >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, mpInt16), uint16(n))
	case n >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, mpInt32), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, mpInt64), uint64(n))
}

func appendFloat(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, mpDouble), math.Float64bits(f))
}

func appendBool(b []byte, v bool) []byte {
	if v {
		return append(b, mpTrue)
	}
	return append(b, mpFalse)
}

func appendStr(b []byte, s string) []byte {
	b = appendStrLen(b, len(s))
	return append(b, s...)
}

func appendStrBytes(b []byte, s []byte) []byte {
	b = appendStrLen(b, len(s))
	return append(b, s...)
}

func appendStrLen(b []byte, n int) []byte {
	switch {
	case n < 32:
		return append(b, mpFixStr|byte(n))
	case n <= math.MaxUint8:
		return append(b, mpStr8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, mpStr16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, mpStr32), uint32(n))
}

// appendUints appends a list of integers; nil is an empty list.
func appendUints(b []byte, l []uint64) []byte {
	n := len(l)
	switch {
	case n < 16:
		b = append(b, mpFixArray|byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, mpArray16), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, mpArray32), uint32(n))
	}
	for _, v := range l {
		b = appendUint(b, v)
	}
	return b
}

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, mpFixMap|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, mpMap16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, mpMap32), uint32(n))
}
