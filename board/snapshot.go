package board

import (
	"context"
	"math"

	"github.com/workermon/workermon/events"
)

// Source is where a Board reads what it shows. MonitorSource (the
// monitor's own state) and RouterSource (a router's busy list, registry and
// admission counts) implement it.
//
// Snapshot is called from the Board's publishing goroutine, at most once
// per Config.Interval and only while a client watches; from its sampler,
// about once per Config.HistoryInterval; and for GET /board/snapshot: calls
// may run at once. It must not return anything it keeps and modifies later.
// ctx bounds the call.
type Source interface {
	Snapshot(ctx context.Context) (Snapshot, error)
}

// Worker states of a Worker.
const (
	StateBusy     = "busy"     // listed busy: every declared rank busy
	StateFree     = "free"     // listed free
	StateStale    = "stale"    // no fresh state: neither busy nor free
	StateCordoned = "cordoned" // listed busy with reason cordoned (contract §12)
	// StateUnlisted: registered with the router, but not in the model's
	// record (the monitor has not listed it yet, or it has no record).
	StateUnlisted = "unlisted"
)

// Levels of a Worker (contract §15).
const (
	LevelAmber = "amber" // free, but near its thresholds: sheddable requests avoid it
	LevelHard  = "hard"  // busy past its critical level: even critical requests avoid it
)

// Sources of a Snapshot.
const (
	KindMonitor = "monitor"
	KindRouter  = "router"
)

// Snapshot is everything the page shows at one moment. It carries no
// clock reading (no ages), so that two snapshots of an unchanged state
// encode alike and nothing is sent.
type Snapshot struct {
	// Kind is KindMonitor or KindRouter; Name the monitor's or router's id.
	Kind string `json:"kind"`
	Name string `json:"name"`
	// Note is a line for the page's header, e.g. that the busy list is not
	// loaded yet.
	Note string `json:"note,omitempty"`
	// Error is set when the source could not be read; Models is then empty.
	Error string `json:"error,omitempty"`
	// Estimates: the ranks' loads are the router's own estimates (its slot
	// tracker), not the engines' reports.
	Estimates bool `json:"estimates,omitempty"`
	// Admissions counts the router's admission decisions by outcome
	// (admitted, rejected, stale_open, …); nil when the source has none.
	Admissions map[string]uint64 `json:"admissions,omitempty"`
	Models     []Model           `json:"models"`
}

// Model is one model's busy set and workers.
type Model struct {
	Name    string `json:"name"`
	AllBusy bool   `json:"all_busy"`
	// ListStale: the router holds the record but no longer trusts it (no
	// put within stale-list-after): it admits every request (--fail-open,
	// the default) or rejects every one.
	ListStale bool `json:"list_stale,omitempty"`
	// Rejecting: a request of priority 0 for the model is rejected now (the
	// router's decision; on the monitor, AllBusy).
	Rejecting bool `json:"rejecting"`
	// UpdatedAt is the record's updated_at in Unix milliseconds, 0 when the
	// source does not know it (the monitor shows its current content).
	UpdatedAt  int64             `json:"updated_at,omitempty"`
	Thresholds events.Thresholds `json:"thresholds"`
	// SLO describes the model's SLO and its controller's state (contract
	// §18) in one line; empty without an SLO.
	SLO    string `json:"slo,omitempty"`
	Counts Counts `json:"counts"`
	// Rejected counts the requests for this model the router rejected
	// since it started; nil when the source has no router counts.
	Rejected *uint64 `json:"rejected,omitempty"`
	// Queued is the number of requests for this model waiting in the
	// router's queue now (contract §17); nil when the source has no router
	// queues.
	Queued *uint64 `json:"queued,omitempty"`
	// Saturation is the record's saturation (contract §21): the mean over
	// the fresh, uncordoned workers of load ÷ limit, 1 at the busy line;
	// nil when the source has no record of the model.
	Saturation *float64 `json:"saturation,omitempty"`
	// QueuedOthers is the number of requests for this model the other
	// routers hold queued, by a fresh record's queued_by (contract §22);
	// nil when none, or when the source has no router queues.
	QueuedOthers *uint64  `json:"queued_others,omitempty"`
	Workers      []Worker `json:"workers"`
}

// Counts are the sizes of a model's lists.
type Counts struct {
	Busy     int `json:"busy"`
	Free     int `json:"free"`
	Stale    int `json:"stale"`
	Cordoned int `json:"cordoned"`
	Amber    int `json:"amber"`
	Hard     int `json:"hard"`
	Unlisted int `json:"unlisted,omitempty"`
}

// Worker is one worker's tile.
type Worker struct {
	// ID is a JSON string: JavaScript numbers lose uint64 precision.
	ID    uint64 `json:"id,string"`
	State string `json:"state"`
	// Level is LevelAmber, LevelHard or empty.
	Level string `json:"level,omitempty"`
	// Reason is why a busy worker is busy: kv, prefill, kv+prefill or
	// cordoned.
	Reason string `json:"reason,omitempty"`
	// Endpoint is the worker's registered URL (router only).
	Endpoint string `json:"endpoint,omitempty"`
	Ranks    []Rank `json:"ranks,omitempty"`
}

// Rank is one data-parallel rank's load against the thresholds in force.
type Rank struct {
	Rank uint32 `json:"rank"`
	// KVUsed and KVTotal are KV-cache blocks in use and in total (0:
	// unknown); KVThreshold is the model's decode threshold as a fraction
	// of the total, nil when that check is off.
	KVUsed      uint64   `json:"kv_used"`
	KVTotal     uint64   `json:"kv_total"`
	KVThreshold *float64 `json:"kv_threshold,omitempty"`
	// Prefill is the tokens being prefilled; PrefillLimit the level above
	// which the rank is busy for prefill (the smaller of the token
	// threshold and frac × max_num_batched_tokens), nil when no prefill
	// check is on.
	Prefill      uint64  `json:"prefill"`
	PrefillLimit *uint64 `json:"prefill_limit,omitempty"`
	// The leading values the monitor derives (contract §21), nil when
	// unknown (and always on a router's board): PrefillRate in tokens per
	// second, QueueDelayMs the predicted queue delay (prefill ÷ rate), both
	// rounded to whole units, and PreemptionRate per second, rounded to
	// hundredths, so that noise below what the page shows sends nothing.
	// DelayLimit is the model's queue-delay threshold in ms, nil when that
	// check is off.
	PrefillRate    *float64 `json:"prefill_rate,omitempty"`
	QueueDelayMs   *float64 `json:"queue_delay_ms,omitempty"`
	DelayLimit     *uint64  `json:"delay_limit,omitempty"`
	PreemptionRate *float64 `json:"preemption_rate,omitempty"`
	// Busy and Reason: the rank is over a threshold, and which (monitor
	// only). Stale: no fresh source.
	Busy   bool   `json:"busy,omitempty"`
	Reason string `json:"reason,omitempty"`
	Stale  bool   `json:"stale,omitempty"`
}

// unknownMaxBatched is max_num_batched_tokens when an engine does not say
// (contract §5).
const unknownMaxBatched = 10_000_000

// PrefillLimit returns the prefill level above which a rank is busy under t
// (contract §5): the token threshold, or trunc(frac × max_num_batched_tokens)
// with 10,000,000 for an unknown maximum, whichever is smaller; ok is false
// when neither check is on.
func PrefillLimit(t events.Thresholds, maxBatched uint64) (limit uint64, ok bool) {
	if t.ActivePrefillTokens != nil {
		limit, ok = *t.ActivePrefillTokens, true
	}
	if t.ActivePrefillTokensFrac != nil {
		if maxBatched == 0 {
			maxBatched = unknownMaxBatched
		}
		f := math.Trunc(*t.ActivePrefillTokensFrac * float64(maxBatched))
		v := uint64(math.MaxUint64)
		if f < math.MaxUint64 {
			v = uint64(f)
		}
		if !ok || v < limit {
			limit, ok = v, true
		}
	}
	return limit, ok
}

// rankThresholds fills the thresholds in force into r.
func rankThresholds(r *Rank, t events.Thresholds, maxBatched uint64) {
	r.KVThreshold = t.ActiveDecodeBlocks
	if lim, ok := PrefillLimit(t, maxBatched); ok {
		r.PrefillLimit = &lim
	}
	r.DelayLimit = t.QueueDelayMs
}

// roundTo returns *v rounded to a multiple of 1/per (per 100:
// hundredths), nil for nil.
func roundTo(v *float64, per float64) *float64 {
	if v == nil {
		return nil
	}
	x := math.Round(*v*per) / per
	return &x
}

// recordWorkers returns the workers a record lists, ascending by id, with
// their state, level and reason, and the model's counts.
func recordWorkers(rec *events.BusySet) ([]Worker, Counts) {
	amber := idSet(rec.Amber)
	hard := idSet(rec.Hard)
	out := make([]Worker, 0, len(rec.Busy)+len(rec.Free)+len(rec.Stale))
	var c Counts
	add := func(ids []uint64, state string) {
		for _, id := range ids {
			w := Worker{ID: id, State: state}
			if state == StateBusy {
				w.Reason = rec.Reasons[uintKey(id)]
				if w.Reason == events.ReasonCordoned {
					w.State = StateCordoned
				}
				if _, ok := hard[id]; ok {
					w.Level = LevelHard
				}
			} else if _, ok := amber[id]; ok && state == StateFree {
				w.Level = LevelAmber
			}
			out = append(out, w)
		}
	}
	add(rec.Busy, StateBusy)
	add(rec.Free, StateFree)
	add(rec.Stale, StateStale)
	sortWorkers(out)
	for _, w := range out {
		c.add(w)
	}
	return out, c
}

// add counts w in c.
func (c *Counts) add(w Worker) {
	switch w.State {
	case StateBusy:
		c.Busy++
	case StateCordoned:
		c.Busy++
		c.Cordoned++
	case StateFree:
		c.Free++
	case StateStale:
		c.Stale++
	case StateUnlisted:
		c.Unlisted++
	}
	switch w.Level {
	case LevelAmber:
		c.Amber++
	case LevelHard:
		c.Hard++
	}
}
