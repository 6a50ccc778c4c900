package router

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
)

// Latency windows (contract §18). The Router times each relayed stream of
// a request of priority ≥ 0 from dispatch: TTFT to the first event with
// text, ITL as the gaps between later text events, on the first worker
// only (a migrated stream's gap would be the migration's). The samples go
// into per-(model, worker) bucket counts, and RunLatency publishes them
// every window as one report per worker on
// <prefix>.latr.<model_key>.<worker_id>, source router/<id>, with the
// model's rejections (and queued requests) of the window.

// DefaultLatencyWindow is how often RunLatency publishes.
const DefaultLatencyWindow = time.Second

// maxLatencyEntries bounds the (model, worker) pairs timed.
const maxLatencyEntries = 1 << 14

// latKey names one worker of one model.
type latKey struct {
	model  string
	worker uint64
}

// latEntry is one worker's samples since the last window. A stream adds
// to the counts without a lock; mu is taken by the drain only.
type latEntry struct {
	mu        sync.Mutex
	ttft, itl [events.LatencyMaxBucket + 1]atomic.Uint64
	samples   atomic.Bool
	// streams is the number of streams timing into the entry: the drain
	// keeps an entry with any, so that a stream's first text, however
	// late, is not counted in a forgotten entry.
	streams atomic.Int64
}

// latModel counts a model's answers that never reached a worker.
type latModel struct {
	rejected, queued latCounter
}

// latCounter is a count of a model's window. The drain takes it with one
// swap, so that a count is in exactly one window; when it forgets an idle
// model it marks both counters forgotten (under latencyBook.mu), and a
// count that finds its counter so, taken from the map before the model went
// out of it, is made again on the model as the map now has it.
type latCounter struct{ n atomic.Uint64 }

// latForgotten marks a counter of a model the drain has forgotten: no count
// goes into it any more. A window's count never comes near it.
const latForgotten = 1 << 63

// add counts one, unless the counter is forgotten.
func (c *latCounter) add() bool {
	for {
		n := c.n.Load()
		if n&latForgotten != 0 {
			return false
		}
		if c.n.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// take returns the count and starts the next window at 0. Only the drain
// calls it, on models of the map, which are never forgotten.
func (c *latCounter) take() uint64 { return c.n.Swap(0) }

// forget marks the counter forgotten if it is at 0.
func (c *latCounter) forget() bool { return c.n.CompareAndSwap(0, latForgotten) }

// latencyBook holds the windows; its zero value is ready. Safe for
// concurrent use: a stream looks its entry up once, then locks only that
// entry per event; a rejection of a known model takes no lock (models is
// copied on write, and a model stays until a whole window without any).
type latencyBook struct {
	// on is set while RunLatency runs: without it nothing is recorded.
	on      atomic.Bool
	mu      sync.RWMutex // entries; the writers of models
	entries map[latKey]*latEntry
	models  atomic.Pointer[map[string]*latModel] // copied on write under mu
}

// latStream times one relayed stream, held in its exchange; the zero
// value times nothing.
type latStream struct {
	e        *latEntry
	start    time.Time
	last     time.Time
	gotFirst bool
}

// entry returns the entry of (model, worker), counted as timing one more
// stream, or nil when there are too many. The count is taken under mu, so
// that the drain cannot forget the entry in between.
func (b *latencyBook) entry(model string, worker uint64) *latEntry {
	k := latKey{model, worker}
	b.mu.RLock()
	e := b.entries[k]
	if e != nil {
		e.streams.Add(1)
	}
	b.mu.RUnlock()
	if e != nil {
		return e
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.entries == nil {
		b.entries = make(map[latKey]*latEntry)
	}
	if e = b.entries[k]; e == nil {
		if len(b.entries) >= maxLatencyEntries {
			return nil
		}
		e = &latEntry{}
		b.entries[k] = e
	}
	e.streams.Add(1)
	return e
}

// loadModels returns the models map; never write to it.
func (b *latencyBook) loadModels() map[string]*latModel {
	if p := b.models.Load(); p != nil {
		return *p
	}
	return nil
}

// count adds one to the counter of model that c picks, without a lock when
// the model is known and not being forgotten.
func (b *latencyBook) count(model string, c func(*latModel) *latCounter) {
	if m := b.loadModels()[model]; m != nil && c(m).add() {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	// Under mu no model of the map is forgotten: the drain forgets a model
	// and takes it out of the map in one hold of mu.
	old := b.loadModels()
	if m := old[model]; m != nil {
		c(m).add()
		return
	}
	if len(old) >= maxLatencyEntries {
		return
	}
	m := &latModel{}
	c(m).add()
	next := make(map[string]*latModel, len(old)+1)
	maps.Copy(next, old)
	next[model] = m
	b.models.Store(&next)
}

// begin starts timing a stream dispatched at start; the zero latStream
// for a sheddable request (only priority ≥ 0 counts).
func (b *latencyBook) begin(model string, worker uint64, class admission.Class, start time.Time) latStream {
	if class == admission.ClassSheddable || !b.on.Load() {
		return latStream{}
	}
	e := b.entry(model, worker)
	if e == nil {
		return latStream{}
	}
	return latStream{e: e, start: start}
}

// end ends the timing of the stream; call it once the stream is over.
func (s *latStream) end() {
	if s.e != nil {
		s.e.streams.Add(-1)
		s.e = nil
	}
}

// text records an event with text at now: the first is the TTFT, each
// later one an ITL sample.
func (s *latStream) text(now time.Time) {
	if s.e == nil {
		return
	}
	first := !s.gotFirst
	from := s.last
	if first {
		from, s.gotFirst = s.start, true
	}
	s.last = now
	k := events.LatencyBucketOf(float64(now.Sub(from)) / float64(time.Millisecond))
	if first {
		s.e.ttft[k].Add(1)
	} else {
		s.e.itl[k].Add(1)
	}
	s.e.samples.Store(true)
}

// reject counts a rejected request of model.
func (b *latencyBook) reject(model string) {
	if b.on.Load() {
		b.count(model, func(m *latModel) *latCounter { return &m.rejected })
	}
}

// queue counts a request of model that waited in the queue (contract §17).
func (b *latencyBook) queue(model string) {
	if b.on.Load() {
		b.count(model, func(m *latModel) *latCounter { return &m.queued })
	}
}

// drain returns the reports of the window and starts the next one.
// workersOf names the workers to report a model's rejections on when none
// of its workers has samples.
func (b *latencyBook) drain(source string, window time.Duration, now time.Time, workersOf func(string) []uint64) []events.LatencyReport {
	b.mu.RLock()
	keys := make([]latKey, 0, len(b.entries))
	for k := range b.entries {
		keys = append(keys, k)
	}
	b.mu.RUnlock()
	// Rejections and queueing: each count taken once, in one swap, so that
	// one counted meanwhile is in this window or the next, never lost.
	type counts struct{ rejected, queued uint64 }
	models := b.loadModels()
	taken := make(map[string]counts, len(models))
	for name, m := range models {
		taken[name] = counts{m.rejected.take(), m.queued.take()}
	}
	slices.SortFunc(keys, func(a, c latKey) int {
		return cmp.Or(cmp.Compare(a.model, c.model), cmp.Compare(a.worker, c.worker))
	})
	sentAt := now.UnixNano()
	windowMs := uint64(max(window.Milliseconds(), 1))
	var out []events.LatencyReport
	reported := map[string]bool{}
	for _, k := range keys {
		b.mu.RLock()
		e := b.entries[k]
		b.mu.RUnlock()
		e.mu.Lock()
		// A sample counted after the swap of samples, and before that of
		// its bucket, is in this window and marks the next one: that
		// one's report may then be empty.
		if !e.samples.Swap(false) {
			e.mu.Unlock()
			continue
		}
		r := events.LatencyReport{Model: k.model, WorkerID: k.worker, Source: source, WindowMs: windowMs, SentAt: sentAt}
		r.TTFT, r.ITL = sparse(&e.ttft), sparse(&e.itl)
		e.mu.Unlock()
		out = append(out, r)
		reported[k.model] = true
	}
	// Rejections and queueing: the same in every report of the model.
	for i := range out {
		c := taken[out[i].Model]
		out[i].Rejected, out[i].Queued = c.rejected, c.queued
	}
	var idle []string
	for name, c := range taken {
		if c.rejected == 0 && c.queued == 0 {
			idle = append(idle, name)
			continue
		}
		if reported[name] {
			continue
		}
		workers := workersOf(name)
		if len(workers) == 0 {
			continue
		}
		out = append(out, events.LatencyReport{Model: name, WorkerID: workers[0], Source: source, WindowMs: windowMs,
			Rejected: c.rejected, Queued: c.queued, SentAt: sentAt})
	}
	// Entries of a window without samples nor streams in progress are
	// dropped, so that workers gone from the registry do not stay.
	b.mu.Lock()
	for k, e := range b.entries {
		if e.mu.TryLock() {
			if !e.samples.Load() && e.streams.Load() == 0 {
				delete(b.entries, k)
			}
			e.mu.Unlock()
		}
	}
	// The models idle for the whole window are forgotten; the others
	// stay, so that their next rejection does not allocate. One counted
	// since the swap stays too: it is in the next window. A count that
	// finds a forgotten counter waits for mu and is made on a new model.
	var next map[string]*latModel
	for _, name := range idle {
		m := models[name]
		if !m.rejected.forget() {
			continue
		}
		if !m.queued.forget() {
			m.rejected.n.Store(0) // no count went in while it was marked
			continue
		}
		if next == nil {
			next = maps.Clone(b.loadModels())
		}
		delete(next, name)
	}
	if next != nil {
		b.models.Store(&next)
	}
	b.mu.Unlock()
	return out
}

// sparse takes the non-zero buckets of h, zeroing them.
func sparse(h *[events.LatencyMaxBucket + 1]atomic.Uint64) []events.LatencyBucket {
	var out []events.LatencyBucket
	for k := range h {
		if n := h[k].Swap(0); n > 0 {
			out = append(out, events.LatencyBucket{K: uint8(k), N: n})
		}
	}
	return out
}

// RunLatency publishes the Router's latency windows (contract §18) every
// window until ctx ends: one report per worker with samples, on
// <prefix>.latr.<model_key>.<worker_id> with source router/<Config.RouterID>.
// publish sends one message; its errors are logged at a limited rate. It
// should fail rather than buffer while the connection is down (the
// workermon router checks nc.IsConnected): a window buffered in an outage
// would reach the monitors with the reconnect's burst, long after its
// interval.
func (rt *Router) RunLatency(ctx context.Context, prefix string, window time.Duration, publish func(subject string, data []byte) error) error {
	if window <= 0 {
		return fmt.Errorf("router: latency window %v must be positive", window)
	}
	if rt.cfg.RouterID == "" {
		return fmt.Errorf("router: latency windows need a router id")
	}
	source := events.RouterSourcePrefix + rt.cfg.RouterID
	enc := events.NewEncoder()
	workersOf := func(model string) []uint64 {
		var ids []uint64
		for _, w := range rt.cfg.Registry.Endpoints(model) {
			ids = append(ids, w.WorkerID)
		}
		return ids
	}
	rt.latency.on.Store(true)
	defer rt.latency.on.Store(false)
	t := time.NewTicker(window)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case now := <-t.C:
			for _, r := range rt.latency.drain(source, window, now, workersOf) {
				data, err := enc.LatencyReport(&r)
				if err == nil {
					err = publish(events.LatrSubject(prefix, r.Model, r.WorkerID), data)
				}
				if err != nil {
					rt.streamLog.warn("router: latency window not published", "model", r.Model, "worker", r.WorkerID, "err", err)
				}
			}
		}
	}
}
