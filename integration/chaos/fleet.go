package main

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/workermon/workermon/events"
)

// Fleet follows the engines' own load reports (the mapped load and bye
// subjects) to say what a model's record must be: the "equal to what the
// fleet's reports make it" of contract §20's final state. It does not
// replay the monitor: it checks what a fault can break and what does not
// depend on the instant of the comparison (docs/ha.md explains the choice):
//
//   - a worker that reported within stale-after (less a margin) is fresh:
//     in busy or free; one silent for longer than stale-after (plus the
//     margin) is not; one that said goodbye is in no list;
//   - a worker listed free whose engine has reported it busy, by the
//     record's own thresholds, without a break since a second before the
//     record was written is wrong (routers' estimates can only add load,
//     so the other direction is not checked);
//   - a worker listed as fresh that the fleet never reported is wrong.
type Fleet struct {
	staleAfter time.Duration
	start      time.Time

	mu      sync.Mutex
	workers map[fleetKey]*fleetWorker
}

type fleetKey struct {
	model  string
	worker uint64
}

type fleetWorker struct {
	last      time.Time // last engine report received (checker's clock)
	gone      bool      // goodbye after the last report
	blocks    uint64
	total     uint64
	busy      bool      // by the decode threshold below
	changedAt time.Time // when busy last changed
}

// margin keeps the membership checks clear of the stale-after boundary:
// the monitor and the checker hear a report at slightly different times.
const margin = 1500 * time.Millisecond

func newFleet(staleAfter time.Duration, now time.Time) *Fleet {
	return &Fleet{staleAfter: staleAfter, start: now, workers: map[fleetKey]*fleetWorker{}}
}

// decodeThreshold is the monitors' --active-decode-blocks-threshold in
// deploy/chaos/compose.yml; the records carry it, and Check compares.
const decodeThreshold = 0.85

// busyRank is contract §5's decode check, as written.
func busyRank(blocks, total uint64, threshold float64) bool {
	return total > 0 && float64(blocks) > threshold*float64(total)
}

// Report takes an engine's load report received at now.
func (f *Fleet) Report(r events.LoadReport, now time.Time) {
	if r.Source != "" && r.Source != "engine" {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	k := fleetKey{r.Model, r.WorkerID}
	w := f.workers[k]
	if w == nil {
		w = &fleetWorker{changedAt: now}
		f.workers[k] = w
	}
	w.last, w.gone = now, false
	if r.ActiveDecodeBlocks.Set {
		w.blocks = r.ActiveDecodeBlocks.Value
	}
	if r.KVTotalBlocks.Set {
		w.total = r.KVTotalBlocks.Value
	}
	if b := busyRank(w.blocks, w.total, decodeThreshold); b != w.busy {
		w.busy, w.changedAt = b, now
	}
}

// Goodbye takes an engine's goodbye.
func (f *Fleet) Goodbye(g events.Goodbye, now time.Time) {
	if g.Source != "" && g.Source != "engine" {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if w := f.workers[fleetKey{g.Model, g.WorkerID}]; w != nil {
		w.gone = true
	}
}

// Check compares a model's record with the fleet at now; it returns what
// differs, empty when the record is right. Only what the fleet's reports
// make the record is compared: its thresholds and lists. Its saturation
// (contract §21) and the routers' queues, queued and queued_by (§22), are
// the moment's traffic, not the fleet's state: left out (contract §20).
func (f *Fleet) Check(rec events.BusySet, now time.Time) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var bad []string
	if rec.Thresholds.ActiveDecodeBlocks == nil || *rec.Thresholds.ActiveDecodeBlocks != decodeThreshold {
		bad = append(bad, fmt.Sprintf("decode threshold %v, want %v", ptrString(rec.Thresholds.ActiveDecodeBlocks), decodeThreshold))
	}
	listed := map[uint64]string{}
	for _, id := range rec.Busy {
		listed[id] = "busy"
	}
	for _, id := range rec.Free {
		listed[id] = "free"
	}
	updated := time.Unix(0, rec.UpdatedAt)
	for k, w := range f.workers {
		if k.model != rec.Model {
			continue
		}
		silent := now.Sub(w.last)
		list, fresh := listed[k.worker]
		switch {
		case w.gone && fresh:
			bad = append(bad, fmt.Sprintf("worker %d said goodbye but is %s", k.worker, list))
		case w.gone:
		case silent < f.staleAfter-margin && !fresh:
			bad = append(bad, fmt.Sprintf("worker %d reported %v ago but is neither busy nor free", k.worker, silent.Round(time.Millisecond)))
		case silent > f.staleAfter+margin && fresh:
			bad = append(bad, fmt.Sprintf("worker %d silent for %v but %s", k.worker, silent.Round(time.Millisecond), list))
		case list == "free" && w.busy && w.changedAt.Before(updated.Add(-time.Second)):
			bad = append(bad, fmt.Sprintf("worker %d listed free, its engine busy (%d of %d blocks) since %v before the record",
				k.worker, w.blocks, w.total, updated.Sub(w.changedAt).Round(time.Millisecond)))
		}
	}
	if now.Sub(f.start) > f.staleAfter+margin {
		for id, list := range listed {
			if _, ok := f.workers[fleetKey{rec.Model, id}]; !ok {
				bad = append(bad, fmt.Sprintf("worker %d is %s but never reported", id, list))
			}
		}
	}
	slices.Sort(bad)
	return strings.Join(bad, "; ")
}

func ptrString(p *float64) string {
	if p == nil {
		return "unset"
	}
	return fmt.Sprint(*p)
}
