package monitor

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/resched"
)

// maxSeenModels bounds the names remembered as "seen since start" beyond
// the models currently tracked.
const maxSeenModels = 4 * DefaultMaxModels

// SourceLoad is one source's view of a rank, as the inspection API shows it.
// Absent fields are nil.
type SourceLoad struct {
	ActiveDecodeBlocks  *uint64 `json:"active_decode_blocks"`
	KVTotalBlocks       *uint64 `json:"kv_total_blocks"`
	ActivePrefillTokens *uint64 `json:"active_prefill_tokens"`
	MaxNumBatchedTokens *uint64 `json:"max_num_batched_tokens"`
	// The fields of contract §21, as this source sent them.
	WaitingRequests   *uint64 `json:"waiting_requests,omitempty"`
	RunningRequests   *uint64 `json:"running_requests,omitempty"`
	Preemptions       *uint64 `json:"preemptions,omitempty"`
	PrefilledTokens   *uint64 `json:"prefilled_tokens,omitempty"`
	KVCommittedBlocks *uint64 `json:"kv_committed_blocks,omitempty"`
	BootID            uint64  `json:"boot_id"`
	Seq               uint64  `json:"seq"`
	AgeSeconds        float64 `json:"age_seconds"`
	Stale             bool    `json:"stale"`
}

// LoadRow is one rank of one worker: the load the busy rules see (maximum
// over fresh sources, smallest positive capacity) and each source's values.
type LoadRow struct {
	Model               string `json:"model"`
	WorkerID            uint64 `json:"worker_id"`
	DPRank              uint32 `json:"dp_rank"`
	ActiveDecodeBlocks  uint64 `json:"active_decode_blocks"`
	KVTotalBlocks       uint64 `json:"kv_total_blocks"`
	ActivePrefillTokens uint64 `json:"active_prefill_tokens"`
	MaxNumBatchedTokens uint64 `json:"max_num_batched_tokens"`
	// The leading signals of contract §21, merged over the fresh sources
	// (null when no fresh source sends them), and the values the monitor
	// derives from them: the prefill rate in tokens per second, the
	// predicted queue delay in milliseconds (both null while the rate is
	// unknown), the preemptions per second, and the rank's saturation.
	KVCommittedBlocks *uint64               `json:"kv_committed_blocks"`
	WaitingRequests   *uint64               `json:"waiting_requests"`
	RunningRequests   *uint64               `json:"running_requests"`
	Preemptions       *uint64               `json:"preemptions"`
	PrefilledTokens   *uint64               `json:"prefilled_tokens"`
	PrefillRate       *float64              `json:"prefill_rate"`
	QueueDelayMs      *float64              `json:"queue_delay_ms"`
	PreemptionRate    *float64              `json:"preemption_rate"`
	Saturation        float64               `json:"saturation"`
	Sources           map[string]SourceLoad `json:"sources"`
	Busy              bool                  `json:"busy"`
	Reason            string                `json:"reason,omitempty"`
	// Level is the rank's level of contract §15 (free, amber, busy, hard),
	// without hysteresis; empty when the rank is stale.
	Level      string  `json:"level,omitempty"`
	Stale      bool    `json:"stale"`
	AgeSeconds float64 `json:"age_seconds"`
}

// WorkerRow is one worker as the inspection API shows it.
type WorkerRow struct {
	Model    string `json:"model"`
	WorkerID uint64 `json:"worker_id"`
	State    string `json:"state"` // busy, free, stale, or left (said goodbye)
	Reason   string `json:"reason,omitempty"`
	// Level is the worker's level of contract §15 (free, amber, busy or
	// hard), as in the record; empty when the worker is stale or left.
	Level      string   `json:"level,omitempty"`
	Sources    []string `json:"sources"`
	Ranks      []uint32 `json:"ranks"` // ranks with state, ascending
	AgeSeconds float64  `json:"age_seconds"`
}

// Known reports whether the monitor knows model: it has state for it, has
// seen it in a report since start, or holds an override for it.
func (m *Monitor) Known(ctx context.Context, model string) (bool, error) {
	var ok bool
	err := m.do(ctx, func(s *state) {
		_, seen := s.seen[model]
		_, over := s.overrides[model]
		ok = seen || over || s.models[model] != nil
	})
	return ok, err
}

// Thresholds returns the thresholds in force for every model the monitor
// knows (see Known), by model name.
func (m *Monitor) Thresholds(ctx context.Context) (map[string]events.Thresholds, error) {
	out := map[string]events.Thresholds{}
	err := m.do(ctx, func(s *state) {
		for name := range s.seen {
			out[name] = s.thresholdsOf(name)
		}
		for name := range s.overrides {
			out[name] = s.thresholdsOf(name)
		}
		// The models tracked too: seen stops growing at maxSeenModels,
		// and a model tracked after it was full is known all the same.
		for name := range s.models {
			out[name] = s.thresholdsOf(name)
		}
	})
	return out, err
}

// ThresholdsOf returns the thresholds in force for model.
func (m *Monitor) ThresholdsOf(ctx context.Context, model string) (events.Thresholds, error) {
	var t events.Thresholds
	err := m.do(ctx, func(s *state) { t = s.thresholdsOf(model) })
	return t, err
}

// Records returns the current content of the records of model, or of every
// model when model is empty, sorted by model.
func (m *Monitor) Records(ctx context.Context, model string) ([]events.BusySet, error) {
	var out []events.BusySet
	err := m.do(ctx, func(s *state) {
		for _, md := range s.selected(model) {
			out = append(out, md.record())
		}
	})
	return out, err
}

// Workers returns the workers of model (every model when empty), sorted by
// model and worker id.
func (m *Monitor) Workers(ctx context.Context, model string) ([]WorkerRow, error) {
	var out []WorkerRow
	err := m.do(ctx, func(s *state) {
		now := time.Now()
		for _, md := range s.selected(model) {
			for _, id := range slices.Sorted(maps.Keys(md.workers)) {
				w := md.workers[id]
				row := WorkerRow{Model: md.name, WorkerID: id, State: w.class.String(), Reason: w.reason.String(),
					Sources: sourceNames(w), Ranks: []uint32{}}
				if w.class == ClassFree || w.class == ClassBusy {
					row.Level = w.level.String()
				}
				if w.left {
					row.State = "left"
					row.AgeSeconds = now.Sub(w.leftAt).Seconds()
				} else if heard := w.lastHeard(); !heard.IsZero() {
					row.AgeSeconds = now.Sub(heard).Seconds()
				}
				ranks := map[uint32]struct{}{}
				for _, src := range w.sources {
					for _, rs := range src.ranks {
						ranks[rs.rank] = struct{}{}
					}
				}
				row.Ranks = append(row.Ranks, slices.Sorted(maps.Keys(ranks))...)
				out = append(out, row)
			}
		}
	})
	return out, err
}

// sourceNames returns the names of w's sources, sorted.
func sourceNames(w *worker) []string {
	names := make([]string, 0, len(w.sources))
	for _, src := range w.sources {
		names = append(names, src.name)
	}
	slices.Sort(names)
	return names
}

// Loads returns one row per worker and rank of model (every model when
// empty), sorted by model, worker id and rank.
func (m *Monitor) Loads(ctx context.Context, model string) ([]LoadRow, error) {
	var out []LoadRow
	err := m.do(ctx, func(s *state) {
		now := time.Now()
		freshAfter := now.Add(-s.cfg.StaleAfter)
		for _, md := range s.selected(model) {
			for _, id := range slices.Sorted(maps.Keys(md.workers)) {
				out = append(out, loadRows(md, md.workers[id], s.cfg.fractions(), s.cfg.RateWindow, now, freshAfter)...)
			}
		}
	})
	return out, err
}

func loadRows(md *model, w *worker, f Fractions, window time.Duration, now, freshAfter time.Time) []LoadRow {
	rows := map[uint32]*LoadRow{}
	aggs := map[uint32]*rankAgg{}
	for _, src := range w.sources {
		name := src.name
		for i := range src.ranks {
			rs := &src.ranks[i]
			rank := rs.rank
			row := rows[rank]
			if row == nil {
				row = &LoadRow{Model: md.name, WorkerID: w.id, DPRank: rank, Sources: map[string]SourceLoad{}, Stale: true,
					AgeSeconds: now.Sub(rs.heard).Seconds()}
				rows[rank] = row
				aggs[rank] = &rankAgg{}
			}
			fresh := rs.heard.After(freshAfter)
			row.Sources[name] = SourceLoad{
				ActiveDecodeBlocks: optPtr(rs.load[sigDecode]), KVTotalBlocks: optPtr(rs.load[sigKVTotal]),
				ActivePrefillTokens: optPtr(rs.load[sigPrefill]), MaxNumBatchedTokens: optPtr(rs.load[sigMaxBatched]),
				WaitingRequests: optPtr(rs.load[sigWaiting]), RunningRequests: optPtr(rs.load[sigRunning]),
				Preemptions: optPtr(rs.load[sigPreemptions]), PrefilledTokens: optPtr(rs.load[sigPrefilled]),
				KVCommittedBlocks: optPtr(rs.load[sigCommitted]),
				BootID:            src.bootID, Seq: src.seq, AgeSeconds: now.Sub(rs.heard).Seconds(), Stale: !fresh,
			}
			row.AgeSeconds = min(row.AgeSeconds, now.Sub(rs.heard).Seconds())
			if fresh {
				row.Stale = false
				aggs[rank].add(rs, src.router)
			}
		}
	}
	out := make([]LoadRow, 0, len(rows))
	for rank, row := range rows {
		agg := aggs[rank]
		a := agg.load()
		row.ActiveDecodeBlocks, row.KVTotalBlocks = a.ActiveDecodeBlocks, a.KVTotalBlocks
		row.ActivePrefillTokens, row.MaxNumBatchedTokens = a.ActivePrefillTokens, a.MaxNumBatchedTokens
		row.WaitingRequests, row.RunningRequests = optPtr(agg.waiting), optPtr(agg.running)
		row.Preemptions, row.PrefilledTokens = optPtr(agg.preemptions), optPtr(agg.prefilled)
		if agg.committed {
			row.KVCommittedBlocks = &a.KVCommittedBlocks
		}
		if d := w.findLeading(rank); d != nil {
			if r, ok := d.prefillRate(window); ok {
				row.PrefillRate = &r
			}
			if ms, ok := d.queueDelay(a.ActivePrefillTokens, window); ok {
				a.QueueDelayMs, a.QueueDelayKnown = ms, true
				row.QueueDelayMs = &ms
			}
			if r, ok := d.preemptionRate(window); ok {
				row.PreemptionRate = &r
			}
		}
		if !row.Stale {
			r := RankBusy(md.thresholds, a)
			row.Busy, row.Reason = r != 0, r.String()
			row.Level = RankLevel(md.thresholds, a, f).String()
			row.Saturation = RankSaturation(md.thresholds, a)
		}
		out = append(out, *row)
	}
	slices.SortFunc(out, func(a, b LoadRow) int { return cmp.Compare(a.DPRank, b.DPRank) })
	return out
}

func optPtr(o events.Optional) *uint64 {
	if !o.Set {
		return nil
	}
	v := o.Value
	return &v
}

// selected returns the model named, or every model sorted by name.
func (s *state) selected(name string) []*model {
	if name != "" {
		if md := s.models[name]; md != nil {
			return []*model{md}
		}
		return nil
	}
	names := slices.Sorted(maps.Keys(s.models))
	out := make([]*model, len(names))
	for i, n := range names {
		out[i] = s.models[n]
	}
	return out
}

// RescheduleSnapshot is the view a rescheduling round plans on (contract
// §12): every model's workers with their usage — the mean over their fresh
// ranks of KV blocks in use over total blocks, each rank aggregated over
// its fresh sources as the busy rules do — their KV blocks in total, their
// committed usage and request counts when every such rank has them
// (contract §21), and whether they are fresh, free and cordoned.
func (m *Monitor) RescheduleSnapshot(ctx context.Context) (resched.Snapshot, error) {
	var snap resched.Snapshot
	err := m.do(ctx, func(s *state) {
		now := time.Now()
		snap.Now = now
		freshAfter := now.Add(-s.cfg.StaleAfter)
		ranks := map[uint32]rankAgg{}
		for _, name := range slices.Sorted(maps.Keys(s.models)) {
			md := s.models[name]
			rm := resched.Model{Name: name}
			for _, id := range slices.Sorted(maps.Keys(md.workers)) {
				w := md.workers[id]
				rw := resched.Worker{ID: id, Fresh: !w.left && w.class != ClassStale && w.class != ClassNone,
					Free: w.class == ClassFree, Cordoned: s.cordoned(name, id)}
				aggregate(w, freshAfter, ranks)
				// Usage over the ranks with a known cache; committed usage
				// (contract §21) when every one of them has a committed
				// value, and the requests each counts (running; running and
				// waiting for committed), when every one has them.
				var sum, committed float64
				var n int
				var running, queued uint64
				allCommitted, allCounts := true, true
				for _, agg := range ranks {
					a := agg.load()
					if a.KVTotalBlocks == 0 {
						continue
					}
					sum += float64(a.ActiveDecodeBlocks) / float64(a.KVTotalBlocks)
					committed += float64(a.KVCommittedBlocks) / float64(a.KVTotalBlocks)
					rw.TotalBlocks = addCapped(rw.TotalBlocks, a.KVTotalBlocks)
					n++
					allCommitted = allCommitted && agg.committed
					allCounts = allCounts && agg.running.Set && agg.waiting.Set
					running = addCapped(running, agg.running.Value)
					queued = addCapped(queued, agg.waiting.Value)
				}
				if n > 0 {
					rw.Usage, rw.HasUsage = sum/float64(n), true
					if allCommitted {
						rw.Committed, rw.HasCommitted = committed/float64(n), true
					}
					if allCounts {
						rw.Requests = running
						if rw.HasCommitted {
							rw.Requests = addCapped(rw.Requests, queued)
						}
					}
				}
				rm.Workers = append(rm.Workers, rw)
			}
			snap.Models = append(snap.Models, rm)
		}
	})
	return snap, err
}
