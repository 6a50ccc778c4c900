package sim

import (
	"context"
	"log/slog"
	"slices"
	"sync/atomic"
)

// RankStats is one rank's load and queue.
type RankStats struct {
	Rank                uint32
	ActiveDecodeBlocks  uint64
	KVTotalBlocks       uint64
	ActivePrefillTokens uint64
	MaxNumBatchedTokens uint64
	Waiting             int    // requests in the waiting queue, preempted ones included
	Running             int    // requests admitted: prefilling or decoding
	Preemptions         uint64 // requests preempted since the start
}

// WorkerStats is a snapshot of a Worker for a live summary.
type WorkerStats struct {
	WorkerID  uint64
	Model     string
	Endpoint  string
	State     State
	BootID    uint64 // of the current publisher; 0 while muted or after the end
	Served    uint64 // requests completed
	Cancelled uint64 // requests whose client went away before the end
	Rejected  uint64 // requests refused with an error status
	Migrated  uint64 // streams cut at the rescheduler's request
	InFlight  int    // requests waiting or running
	Ranks     []RankStats
}

// engineStats is what the engine loop publishes after every step.
type engineStats struct {
	served, cancelled uint64
	inFlight          int
	ranks             []RankStats
}

// Stats returns a snapshot of the worker's counters and load. The engine
// loop stores it after every step, so it may trail by one step an answer
// that a client already has.
func (w *Worker) Stats() WorkerStats {
	s := w.stats.Load()
	return WorkerStats{
		WorkerID:  w.cfg.WorkerID,
		Model:     w.cfg.Model,
		Endpoint:  w.endpoint,
		State:     w.State(),
		BootID:    w.bootID.Load(),
		Served:    s.served,
		Cancelled: s.cancelled,
		Rejected:  w.rejected.Load(),
		Migrated:  w.migrated.Load(),
		InFlight:  s.inFlight,
		Ranks:     slices.Clone(s.ranks),
	}
}

// snapshot returns the engine's stats; only the engine loop (or NewWorker
// before it starts) may call it.
func (w *Worker) snapshot() *engineStats {
	s := &engineStats{
		served:    w.eng.completed,
		cancelled: w.eng.cancelled,
		ranks:     make([]RankStats, len(w.eng.ranks)),
	}
	for i := range w.eng.ranks {
		rk := &w.eng.ranks[i]
		l := rk.eng.Load()
		s.inFlight += l.Waiting + l.Running
		s.ranks[i] = RankStats{
			Rank:                w.cfg.DPStart + uint32(i),
			ActiveDecodeBlocks:  uint64(l.BlocksUsed),
			KVTotalBlocks:       uint64(l.KVBlocks),
			ActivePrefillTokens: uint64(l.PrefillTokens),
			MaxNumBatchedTokens: uint64(rk.cfg.MaxBatchedTokens),
			Waiting:             l.Waiting,
			Running:             l.Running,
			Preemptions:         l.Preemptions,
		}
	}
	return s
}

// quietHandler passes records to h until quiet is set.
type quietHandler struct {
	h     slog.Handler
	quiet *atomic.Bool
}

func (q quietHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return !q.quiet.Load() && q.h.Enabled(ctx, l)
}

func (q quietHandler) Handle(ctx context.Context, r slog.Record) error {
	if q.quiet.Load() {
		return nil
	}
	return q.h.Handle(ctx, r)
}

func (q quietHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return quietHandler{h: q.h.WithAttrs(attrs), quiet: q.quiet}
}

func (q quietHandler) WithGroup(name string) slog.Handler {
	return quietHandler{h: q.h.WithGroup(name), quiet: q.quiet}
}
