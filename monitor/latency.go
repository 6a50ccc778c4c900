package monitor

import (
	"context"
	"fmt"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/slo"
)

// Latency windows (contract §18): a window sent more than --stale-after
// ago is dropped (rejectStaleWindow); the monitor adds up the windows of each
// (model, worker, source) between two calls of DrainLatency, which the SLO
// controller makes once per --slo-interval; the windows of the models it
// does not control are dropped at each drain too, so nothing grows. A
// drain resets the windows in place and forgets those not heard since the
// previous one.

// latModel is one model's pending latency windows.
type latModel struct {
	workers map[uint64]map[string]*latSource // by worker, then source
	// routers are the router sources heard for the model: their
	// rejections and queueing are for the whole model, the same in every
	// worker's report of one window, so each window counts once.
	routers  map[string]int64 // router source → sent_at of its last window counted
	rejected uint64
	queued   uint64
}

// latSource is one source's windows of one worker since the last drain.
type latSource struct {
	ttft, itl slo.Hist
	samples   bool
}

// maxLatencySources bounds the router sources remembered per model.
const maxLatencySources = 256

// maxLatencyEntries bounds the (model, worker, source) windows held
// between two drains (about 2.4 KiB each), whatever the other limits
// allow.
const maxLatencyEntries = 1 << 14

// applyLatency adds a latency window to the pending ones.
func (s *state) applyLatency(r *events.LatencyReport, now time.Time) string {
	if s.fromFuture(r.SentAt, now) {
		return rejectFuture
	}
	if r.SentAt < now.UnixNano()-int64(s.cfg.StaleAfter) {
		return rejectStaleWindow
	}
	lm := s.lat[r.Model]
	if lm == nil {
		if len(s.lat) >= s.cfg.MaxModels {
			return rejectModels
		}
		lm = &latModel{workers: make(map[uint64]map[string]*latSource), routers: make(map[string]int64)}
		s.lat[r.Model] = lm
	}
	srcs := lm.workers[r.WorkerID]
	if srcs == nil {
		if len(lm.workers) >= s.cfg.MaxWorkersPerModel {
			return rejectWorkers
		}
		srcs = make(map[string]*latSource)
		lm.workers[r.WorkerID] = srcs
	}
	router := events.IsRouterSource(r.Source)
	last, known := lm.routers[r.Source]
	if router && !known && len(lm.routers) >= maxLatencySources {
		return rejectSources // before anything of it counts
	}
	src := srcs[r.Source]
	if src == nil {
		if len(srcs) >= s.cfg.MaxSourcesPerWorker || s.latEntries >= maxLatencyEntries {
			return rejectSources
		}
		src = &latSource{}
		srcs[r.Source] = src
		s.latEntries++
	}
	for _, b := range r.TTFT {
		src.ttft.AddBucket(int(b.K), b.N)
	}
	for _, b := range r.ITL {
		src.itl.AddBucket(int(b.K), b.N)
	}
	src.samples = true
	if router && (!known || r.SentAt != last) {
		lm.routers[r.Source] = r.SentAt
		lm.rejected = slo.AddCount(lm.rejected, r.Rejected)
		lm.queued = slo.AddCount(lm.queued, r.Queued)
	}
	return ""
}

// drainLatency merges model's pending windows (per worker the routers'
// when any router reported for it, else the engine's, never both).
func (s *state) drainLatency(model string) slo.Window {
	var w slo.Window
	if lm := s.lat[model]; lm != nil {
		for _, srcs := range lm.workers {
			routed := false
			for name, src := range srcs {
				if events.IsRouterSource(name) && src.samples {
					routed = true
					break
				}
			}
			for name, src := range srcs {
				if events.IsRouterSource(name) == routed {
					w.TTFT.Add(&src.ttft)
					w.ITL.Add(&src.itl)
				}
			}
		}
		w.Rejected, w.Queued = lm.rejected, lm.queued
	}
	return w
}

// DrainLatency returns the latency windows of every model received since
// the previous call, merged per model (contract §18), and starts new ones:
// the SLO controller calls it once per interval.
func (m *Monitor) DrainLatency(ctx context.Context) (map[string]*slo.Window, error) {
	var out map[string]*slo.Window
	err := m.do(ctx, func(s *state) { out = s.drainAllLatency() })
	return out, err
}

// drainAllLatency returns the merged windows of every model heard since
// the previous call and starts new ones. The windows heard are reset in
// place, so that the next report of the same (model, worker, source)
// allocates nothing; those not heard since the previous call are
// forgotten.
func (s *state) drainAllLatency() map[string]*slo.Window {
	out := make(map[string]*slo.Window)
	for model, lm := range s.lat {
		heard := false
		for _, srcs := range lm.workers {
			for _, src := range srcs {
				heard = heard || src.samples
			}
		}
		if heard {
			w := s.drainLatency(model)
			out[model] = &w
		}
		for id, srcs := range lm.workers {
			for name, src := range srcs {
				if !src.samples {
					delete(srcs, name)
					s.latEntries--
					continue
				}
				*src = latSource{}
			}
			if len(srcs) == 0 {
				delete(lm.workers, id)
			}
		}
		if !heard {
			delete(s.lat, model)
			continue
		}
		clear(lm.routers)
		lm.rejected, lm.queued = 0, 0
	}
	return out
}

// SetControlled hands model's decode and prefill thresholds to the SLO
// controller (contract §18): while set they are in force instead of the
// defaults and the override, and the fractional prefill threshold is off;
// nil gives the model back to its override and the defaults. The model's
// record is recomputed at once.
func (m *Monitor) SetControlled(ctx context.Context, model string, t *slo.Thresholds) error {
	if err := events.ValidateModel(model); err != nil {
		return fmt.Errorf("monitor: set controlled thresholds: %w", err)
	}
	var th *events.Thresholds
	if t != nil {
		th = &events.Thresholds{ActiveDecodeBlocks: events.Ptr(t.Decode), ActivePrefillTokens: events.Ptr(t.Prefill)}
		if err := th.Validate(); err != nil {
			return fmt.Errorf("monitor: set controlled thresholds of %q: %w", model, err)
		}
	}
	return m.do(ctx, func(s *state) { s.setControlled(model, th) })
}

// BaseThresholds returns model's thresholds without the SLO controller's:
// the defaults merged with its override.
func (m *Monitor) BaseThresholds(ctx context.Context, model string) (events.Thresholds, error) {
	var t events.Thresholds
	err := m.do(ctx, func(s *state) { t = s.cfg.Defaults.Merge(s.overrides[model]) })
	return t, err
}

// setControlled replaces (nil drops) the controlled thresholds of model
// and recomputes its workers when they changed.
func (s *state) setControlled(model string, t *events.Thresholds) {
	old, had := s.controlled[model]
	switch {
	case t == nil && !had:
		return
	case t == nil:
		delete(s.controlled, model)
	case had && old.Equal(*t):
		return
	default:
		s.controlled[model] = *t
	}
	s.recomputeThresholds(model)
}
