package monitor

import (
	"math"

	"github.com/workermon/workermon/events"
)

// Reason says why a rank or worker is busy; the zero value means not busy.
type Reason uint8

// Busy reasons, combinable.
const (
	ReasonKV Reason = 1 << iota
	ReasonPrefill
)

// String returns the contract's spelling: "kv", "prefill", "kv+prefill", or
// "" when not busy.
func (r Reason) String() string {
	switch r {
	case ReasonKV:
		return events.ReasonKV
	case ReasonPrefill:
		return events.ReasonPrefill
	case ReasonKV | ReasonPrefill:
		return events.ReasonKVPrefill
	}
	return ""
}

// RankLoad is one rank's load as the busy rules see it: for each signal the
// maximum over fresh sources, for each capacity the smallest positive value
// (0 = unknown).
type RankLoad struct {
	ActiveDecodeBlocks  uint64
	KVTotalBlocks       uint64
	ActivePrefillTokens uint64
	MaxNumBatchedTokens uint64
}

// RankBusy applies the busy rules of the contract (§5) to one rank. Every
// comparison is strict; an unset threshold is a check that is off.
func RankBusy(t events.Thresholds, l RankLoad) Reason {
	var r Reason
	if t.ActiveDecodeBlocks != nil && l.KVTotalBlocks > 0 &&
		float64(l.ActiveDecodeBlocks) > *t.ActiveDecodeBlocks*float64(l.KVTotalBlocks) {
		r |= ReasonKV
	}
	if t.ActivePrefillTokens != nil && l.ActivePrefillTokens > *t.ActivePrefillTokens {
		r |= ReasonPrefill
	}
	if t.ActivePrefillTokensFrac != nil {
		capacity := l.MaxNumBatchedTokens
		if capacity == 0 {
			capacity = events.DefaultMaxNumBatchedTokens
		}
		if float64(l.ActivePrefillTokens) > math.Trunc(*t.ActivePrefillTokensFrac*float64(capacity)) {
			r |= ReasonPrefill
		}
	}
	return r
}

// Class is a worker's place in a record.
type Class uint8

// Worker classes. A worker that said goodbye is in no list.
const (
	ClassNone Class = iota
	ClassFree
	ClassBusy
	ClassStale
)

// String returns the class as the record's list name.
func (c Class) String() string {
	switch c {
	case ClassFree:
		return "free"
	case ClassBusy:
		return "busy"
	case ClassStale:
		return "stale"
	}
	return "none"
}
