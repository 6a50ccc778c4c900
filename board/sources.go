package board

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/slots"
)

// Monitor is what MonitorSource reads of the monitor; *monitor.Monitor
// implements it. Both calls run on the monitor's own goroutine (no lock)
// and return copies.
type Monitor interface {
	// Records returns every model's busy set as the monitor holds it now.
	Records(ctx context.Context, model string) ([]events.BusySet, error)
	// Loads returns every rank's aggregated load.
	Loads(ctx context.Context, model string) ([]monitor.LoadRow, error)
}

var _ Monitor = (*monitor.Monitor)(nil)

// Counter returns the router's admission counts: requests rejected by
// model, and every decision by outcome. GatheredCounts reads them from a
// router's metrics.
type Counter func() (rejected, outcomes map[string]uint64, err error)

// QueueCounter returns the requests waiting in a router's queues by model
// (contract §17). GatheredQueues reads them from a router's metrics.
type QueueCounter func() (map[string]uint64, error)

// MonitorSource shows a monitor's own view: each model's busy set and every
// rank's load as the busy rules see it.
type MonitorSource struct {
	Monitor Monitor
	// ID names the monitor in the page's header.
	ID string
	// Counts, when set, adds a router's rejection counts (workermon demo
	// runs both in one process); a monitor alone has none.
	Counts Counter
	// Queues, when set, adds the depth of a router's queues.
	Queues QueueCounter
	// SLOs, when set, describes each model's SLO in one line (contract
	// §18), by model.
	SLOs func(ctx context.Context) map[string]string
}

// Snapshot implements Source.
func (s *MonitorSource) Snapshot(ctx context.Context) (Snapshot, error) {
	snap := Snapshot{Kind: KindMonitor, Name: s.ID, Models: []Model{}}
	records, err := s.Monitor.Records(ctx, "")
	if err != nil {
		return snap, fmt.Errorf("board: read the monitor's records: %w", err)
	}
	loads, err := s.Monitor.Loads(ctx, "")
	if err != nil {
		return snap, fmt.Errorf("board: read the monitor's loads: %w", err)
	}
	var rejected map[string]uint64
	if s.Counts != nil {
		if rejected, snap.Admissions, err = s.Counts(); err != nil {
			return snap, fmt.Errorf("board: read the router's counts: %w", err)
		}
	}
	queued, err := readQueues(s.Queues)
	if err != nil {
		return snap, err
	}
	var slos map[string]string
	if s.SLOs != nil {
		slos = s.SLOs(ctx)
	}
	// Both lists are sorted by model (then worker and rank): one merge.
	i := 0
	for _, rec := range records {
		m := Model{Name: rec.Model, AllBusy: rec.AllBusy, Rejecting: rec.AllBusy, Thresholds: rec.Thresholds, SLO: slos[rec.Model],
			Saturation: events.Ptr(rec.Saturation)}
		m.Workers, m.Counts = recordWorkers(&rec)
		if rejected != nil {
			n := rejected[rec.Model]
			m.Rejected = &n
		}
		if queued != nil {
			n := queued[rec.Model]
			m.Queued = &n
		}
		for i < len(loads) && loads[i].Model < rec.Model {
			i++
		}
		w := 0
		for ; i < len(loads) && loads[i].Model == rec.Model; i++ {
			row := &loads[i]
			for w < len(m.Workers) && m.Workers[w].ID < row.WorkerID {
				w++
			}
			if w == len(m.Workers) || m.Workers[w].ID != row.WorkerID {
				continue // not listed (left, or not evaluated yet)
			}
			r := Rank{Rank: row.DPRank, KVUsed: row.ActiveDecodeBlocks, KVTotal: row.KVTotalBlocks,
				Prefill: row.ActivePrefillTokens, Busy: row.Busy, Reason: row.Reason, Stale: row.Stale,
				PrefillRate: roundTo(row.PrefillRate, 1), QueueDelayMs: roundTo(row.QueueDelayMs, 1),
				PreemptionRate: roundTo(row.PreemptionRate, 100)}
			rankThresholds(&r, rec.Thresholds, row.MaxNumBatchedTokens)
			m.Workers[w].Ranks = append(m.Workers[w].Ranks, r)
		}
		snap.Models = append(snap.Models, m)
	}
	return snap, nil
}

// BusyList is what RouterSource reads of the busy list;
// *busylist.Watcher implements it.
type BusyList interface {
	// Models returns the models that have a record, sorted.
	Models() []string
	// Record returns a model's last record (shared: read only).
	Record(model string) (rec events.BusySet, received time.Time, ok bool)
	// Decide is the router's decision for a request for model now.
	Decide(model string) admission.Decision
	// Ready reports whether the bucket's initial values are in.
	Ready() bool
}

// Registry is what RouterSource reads of the worker registry;
// *registry.Watcher implements it.
type Registry interface {
	// Models returns the models with a registered worker.
	Models() []string
	// Endpoints returns the model's registered workers, sorted by id.
	Endpoints(model string) []events.WorkerEntry
}

// Tracker is what RouterSource reads of the router's slot tracker;
// *slots.Tracker implements it.
type Tracker interface {
	// Loads lists every registered rank's estimated load, filtered by model
	// and tenant when not empty, sorted.
	Loads(model, tenant string) []slots.Load
}

var _ Tracker = (*slots.Tracker)(nil)

// RouterSource shows a router's view: the records it decides with, the
// workers it may send to, how many requests it rejected and, with a
// Tracker, its own estimate of each rank's load.
type RouterSource struct {
	BusyList BusyList
	// Registry is optional: its workers that the record does not list are
	// shown as unlisted.
	Registry Registry
	// Tracker is optional: the ranks' loads, as this router estimates them.
	Tracker Tracker
	// Counts is optional: the router's admission counts.
	Counts Counter
	// Queues is optional: the depth of the router's queues by model.
	Queues QueueCounter
	// ID names the router in the page's header.
	ID string
}

// Snapshot implements Source.
func (s *RouterSource) Snapshot(_ context.Context) (Snapshot, error) {
	snap := Snapshot{Kind: KindRouter, Name: s.ID, Models: []Model{}, Estimates: s.Tracker != nil}
	var rejected map[string]uint64
	if s.Counts != nil {
		var err error
		if rejected, snap.Admissions, err = s.Counts(); err != nil {
			return snap, fmt.Errorf("board: read the router's counts: %w", err)
		}
	}
	queued, err := readQueues(s.Queues)
	if err != nil {
		return snap, err
	}
	if !s.BusyList.Ready() {
		snap.Note = "the busy list (KV bucket " + events.BusyBucket + ") is not loaded yet: every request is admitted or rejected by --fail-open"
	}
	names := s.BusyList.Models()
	if s.Registry != nil {
		names = append(names, s.Registry.Models()...)
		slices.Sort(names)
		names = slices.Compact(names)
	}
	var loads []slots.Load
	if s.Tracker != nil {
		loads = s.Tracker.Loads("", "")
		// Summed over tenants below; sorted by model, worker, rank.
		slices.SortStableFunc(loads, func(a, b slots.Load) int {
			return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.WorkerID, b.WorkerID), cmp.Compare(a.DPRank, b.DPRank))
		})
	}
	now := time.Now()
	for _, name := range names {
		m := Model{Name: name}
		if rec, received, ok := s.BusyList.Record(name); ok {
			m.AllBusy, m.Thresholds, m.UpdatedAt = rec.AllBusy, rec.Thresholds, rec.UpdatedAt/int64(time.Millisecond)
			m.Saturation = events.Ptr(rec.Saturation)
			m.Workers, _ = recordWorkers(&rec)
			if queued != nil {
				m.QueuedOthers = queuedOthers(&rec, events.RouterSourcePrefix+s.ID, received, now)
			}
		}
		d := s.BusyList.Decide(name)
		m.ListStale, m.Rejecting = d.Reason == admission.ReasonStale, !d.Admit
		if s.Registry != nil {
			m.Workers = addRegistered(m.Workers, s.Registry.Endpoints(name))
		}
		if rejected != nil {
			n := rejected[name]
			m.Rejected = &n
		}
		if queued != nil {
			n := queued[name]
			m.Queued = &n
		}
		loads = addEstimates(m.Workers, m.Thresholds, name, loads)
		for _, w := range m.Workers {
			m.Counts.add(w)
		}
		snap.Models = append(snap.Models, m)
	}
	return snap, nil
}

// queuedFreshFor is how long a record's queued_by counts for a router
// (busylist.QueuedFreshFor, contract §22).
const queuedFreshFor = 3 * time.Second

// queuedOthers returns the requests the routers other than own hold queued
// by rec, received at received (contract §22); nil when it lists none, or
// when the record is older than queuedFreshFor by now (then the router's
// admission and pacing do not count them either).
func queuedOthers(rec *events.BusySet, own string, received, now time.Time) *uint64 {
	if now.Sub(received) >= queuedFreshFor || now.UnixNano()-rec.UpdatedAt >= int64(queuedFreshFor) {
		return nil
	}
	var n uint64
	for src, q := range rec.QueuedBy {
		if src == own {
			continue
		}
		for _, c := range q {
			n += c
		}
	}
	if n == 0 {
		return nil
	}
	return &n
}

// addRegistered sets the endpoints of the registered workers and adds those
// the record does not list, keeping the order by id.
func addRegistered(workers []Worker, entries []events.WorkerEntry) []Worker {
	n := len(workers)
	for _, e := range entries {
		if i, ok := slices.BinarySearchFunc(workers[:n], e.WorkerID, func(w Worker, id uint64) int { return cmp.Compare(w.ID, id) }); ok {
			workers[i].Endpoint = e.Endpoint
			continue
		}
		workers = append(workers, Worker{ID: e.WorkerID, State: StateUnlisted, Endpoint: e.Endpoint})
	}
	if len(workers) > n {
		sortWorkers(workers)
	}
	return workers
}

// addEstimates gives the workers of model their ranks' estimated loads from
// loads (sorted by model, worker, rank; several tenants of a rank summed)
// and returns the loads of the models after it.
func addEstimates(workers []Worker, t events.Thresholds, model string, loads []slots.Load) []slots.Load {
	for len(loads) > 0 && loads[0].Model < model {
		loads = loads[1:]
	}
	w := 0
	for ; len(loads) > 0 && loads[0].Model == model; loads = loads[1:] {
		l := loads[0]
		for w < len(workers) && workers[w].ID < l.WorkerID {
			w++
		}
		if w == len(workers) || workers[w].ID != l.WorkerID {
			continue
		}
		ranks := workers[w].Ranks
		if k := len(ranks) - 1; k >= 0 && ranks[k].Rank == l.DPRank {
			ranks[k].KVUsed = slots.SaturatingAdd(ranks[k].KVUsed, l.ActiveDecodeBlocks)
			ranks[k].Prefill = slots.SaturatingAdd(ranks[k].Prefill, l.ActivePrefillTokens)
			continue
		}
		r := Rank{Rank: l.DPRank, KVUsed: l.ActiveDecodeBlocks, Prefill: l.ActivePrefillTokens}
		rankThresholds(&r, t, 0)
		workers[w].Ranks = append(ranks, r)
	}
	return loads
}

// readQueues calls q when set; nil otherwise.
func readQueues(q QueueCounter) (map[string]uint64, error) {
	if q == nil {
		return nil, nil
	}
	queued, err := q()
	if err != nil {
		return nil, fmt.Errorf("board: read the router's queues: %w", err)
	}
	return queued, nil
}

// Metric families GatheredCounts and GatheredQueues read.
const (
	rejectedFamily   = "workermon_router_requests_rejected_total"
	admissionsFamily = "workermon_router_admissions_total"
	queueDepthFamily = "workermon_router_queue_depth"
)

// GatheredQueues returns a QueueCounter that reads a router's
// workermon_router_queue_depth from g, summed over the classes. Models
// beyond the router's label cap are counted under "other".
func GatheredQueues(g prometheus.Gatherer) QueueCounter {
	return func() (map[string]uint64, error) {
		families, err := g.Gather()
		if err != nil && len(families) == 0 {
			return nil, fmt.Errorf("board: gather the router's metrics: %w", err)
		}
		queued := map[string]uint64{}
		for _, f := range families {
			if f.GetName() != queueDepthFamily {
				continue
			}
			for _, m := range f.GetMetric() {
				for _, lp := range m.GetLabel() {
					if lp.GetName() == "model" {
						queued[lp.GetValue()] += uint64(max(m.GetGauge().GetValue(), 0))
					}
				}
			}
		}
		return queued, nil
	}
}

// GatheredCounts returns a Counter that reads a router's admission
// counters (workermon_router_requests_rejected_total by model,
// workermon_router_admissions_total by outcome) from g, summing over any
// other label. Models beyond the router's label cap are counted under
// "other".
func GatheredCounts(g prometheus.Gatherer) Counter {
	return func() (map[string]uint64, map[string]uint64, error) {
		families, err := g.Gather()
		if err != nil && len(families) == 0 {
			return nil, nil, fmt.Errorf("board: gather the router's metrics: %w", err)
		}
		rejected, outcomes := map[string]uint64{}, map[string]uint64{}
		for _, f := range families {
			var into map[string]uint64
			var label string
			switch f.GetName() {
			case rejectedFamily:
				into, label = rejected, "model"
			case admissionsFamily:
				into, label = outcomes, "outcome"
			default:
				continue
			}
			for _, m := range f.GetMetric() {
				for _, lp := range m.GetLabel() {
					if lp.GetName() == label {
						into[lp.GetValue()] += uint64(m.GetCounter().GetValue())
					}
				}
			}
		}
		return rejected, outcomes, nil
	}
}

// sortWorkers sorts workers by id.
func sortWorkers(ws []Worker) {
	slices.SortFunc(ws, func(a, b Worker) int { return cmp.Compare(a.ID, b.ID) })
}

// idSet returns the ids as a set.
func idSet(ids []uint64) map[uint64]struct{} {
	out := make(map[uint64]struct{}, len(ids))
	for _, id := range ids {
		out[id] = struct{}{}
	}
	return out
}

// uintKey is a worker id as a record's reasons map keys it.
func uintKey(id uint64) string { return strconv.FormatUint(id, 10) }
