package monitor

import (
	"cmp"
	"container/heap"
	"maps"
	"slices"
	"time"

	"github.com/workermon/workermon/events"
)

// Signals of a rank's load, in the order of rankState.load.
const (
	sigDecode = iota
	sigKVTotal
	sigPrefill
	sigMaxBatched
	numSignals
)

// rankState is one (worker, rank, source) state.
type rankState struct {
	load  [numSignals]events.Optional
	heard time.Time // monitor clock
}

// sourceState is what one source of a worker has said, per rank.
type sourceState struct {
	bootID      uint64
	seq         uint64
	sentAt      int64
	start, size uint32 // declared ranks [start, start+size)
	heard       time.Time
	ranks       map[uint32]*rankState
}

// worker is one engine instance of a model.
type worker struct {
	id      uint64
	idText  string // id in decimal, the key of the record's reasons
	model   *model
	sources map[string]*sourceState
	class   Class
	reason  Reason

	// A goodbye from the engine source leaves a tombstone: reports of the
	// same boot, or of an older one, are dropped until the worker is removed.
	left       bool
	leftBoot   uint64
	leftSentAt int64
	leftAt     time.Time

	deadline  time.Time // next freshness check; see state.schedule
	heapIndex int       // position in state.timers, -1 when not scheduled
}

// lastHeard is the latest time any source of w was heard.
func (w *worker) lastHeard() time.Time {
	var t time.Time
	for _, src := range w.sources {
		if src.heard.After(t) {
			t = src.heard
		}
	}
	return t
}

// model is the state of one model and the lists of its record, kept sorted
// so that a record is a copy, not a sort.
type model struct {
	name              string
	thresholds        events.Thresholds // in force: defaults merged with the override
	workers           map[uint64]*worker
	busy, free, stale []uint64
	reasons           map[string]string // of the busy workers, by decimal id
	dirty             bool              // the record changed since the last flush
	queued            bool              // in state.dirty
}

func (m *model) list(c Class) *[]uint64 {
	switch c {
	case ClassBusy:
		return &m.busy
	case ClassFree:
		return &m.free
	case ClassStale:
		return &m.stale
	}
	return nil
}

// setClass moves w to class c with reason r, keeping the lists sorted.
func (m *model) setClass(w *worker, c Class, r Reason) {
	if w.class == c && w.reason == r {
		return
	}
	if w.class != c {
		if l := m.list(w.class); l != nil {
			if i, ok := slices.BinarySearch(*l, w.id); ok {
				*l = slices.Delete(*l, i, i+1)
			}
		}
		if l := m.list(c); l != nil {
			i, _ := slices.BinarySearch(*l, w.id)
			*l = slices.Insert(*l, i, w.id)
		}
	}
	if c == ClassBusy {
		m.reasons[w.idText] = r.String()
	} else if w.class == ClassBusy {
		delete(m.reasons, w.idText)
	}
	w.class, w.reason = c, r
	m.dirty = true
}

// record returns the content of the model's record. Everything in it is
// freshly allocated: the Sink keeps it.
func (m *model) record() events.BusySet {
	return events.BusySet{
		Model:      m.name,
		Busy:       slices.Clone(m.busy),
		Free:       slices.Clone(m.free),
		Stale:      slices.Clone(m.stale),
		AllBusy:    len(m.free) == 0 && len(m.busy) > 0,
		Reasons:    maps.Clone(m.reasons),
		Thresholds: m.thresholds,
	}
}

// span is a half-open range of ranks.
type span struct{ lo, hi uint64 }

// scratch holds buffers reused across worker evaluations.
type scratch struct {
	spans []span
	ranks map[uint32]rankAgg
}

// rankAgg aggregates one rank across fresh sources: signals by maximum,
// capacities by smallest positive value.
type rankAgg struct{ RankLoad }

func (a *rankAgg) add(rs *rankState) {
	l := &rs.load
	if l[sigDecode].Set {
		a.ActiveDecodeBlocks = max(a.ActiveDecodeBlocks, l[sigDecode].Value)
	}
	if l[sigPrefill].Set {
		a.ActivePrefillTokens = max(a.ActivePrefillTokens, l[sigPrefill].Value)
	}
	a.KVTotalBlocks = minPositive(a.KVTotalBlocks, l[sigKVTotal])
	a.MaxNumBatchedTokens = minPositive(a.MaxNumBatchedTokens, l[sigMaxBatched])
}

func minPositive(cur uint64, o events.Optional) uint64 {
	if !o.Set || o.Value == 0 {
		return cur
	}
	if cur == 0 || o.Value < cur {
		return o.Value
	}
	return cur
}

// classify applies the busy rules to one worker: stale when no source has
// fresh state, busy when every declared rank (the union of the fresh
// sources' ranges) is busy, free otherwise. It reads the sources and writes
// only sc.
func classify(t events.Thresholds, sources map[string]*sourceState, freshAfter time.Time, sc *scratch) (Class, Reason) {
	sc.spans = sc.spans[:0]
	var only *sourceState
	for _, src := range sources {
		if src.heard.After(freshAfter) {
			only = src
			sc.spans = append(sc.spans, span{uint64(src.start), uint64(src.start) + uint64(src.size)})
		}
	}
	if len(sc.spans) == 0 {
		return ClassStale, 0
	}
	declared := unionSize(sc.spans)
	var busy uint64
	var reason Reason
	if len(sc.spans) == 1 {
		for _, rs := range only.ranks {
			if !rs.heard.After(freshAfter) {
				continue
			}
			var a rankAgg
			a.add(rs)
			if r := RankBusy(t, a.RankLoad); r != 0 {
				busy++
				reason |= r
			}
		}
	} else {
		if sc.ranks == nil {
			sc.ranks = make(map[uint32]rankAgg)
		}
		clear(sc.ranks)
		for _, src := range sources {
			if !src.heard.After(freshAfter) {
				continue
			}
			for rank, rs := range src.ranks {
				if rs.heard.After(freshAfter) {
					a := sc.ranks[rank]
					a.add(rs)
					sc.ranks[rank] = a
				}
			}
		}
		for _, a := range sc.ranks {
			if r := RankBusy(t, a.RankLoad); r != 0 {
				busy++
				reason |= r
			}
		}
	}
	if busy >= declared {
		return ClassBusy, reason
	}
	return ClassFree, 0
}

// unionSize returns the number of ranks covered by spans, which it sorts.
func unionSize(spans []span) uint64 {
	if len(spans) == 1 {
		return spans[0].hi - spans[0].lo
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
	var n, end uint64
	for _, s := range spans {
		lo := max(s.lo, end)
		if s.hi > lo {
			n += s.hi - lo
			end = s.hi
		}
	}
	return n
}

// timers is a min-heap of workers by their next freshness check.
type timers []*worker

func (h timers) Len() int           { return len(h) }
func (h timers) Less(i, j int) bool { return h[i].deadline.Before(h[j].deadline) }
func (h timers) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIndex, h[j].heapIndex = i, j
}
func (h *timers) Push(x any) {
	w := x.(*worker)
	w.heapIndex = len(*h)
	*h = append(*h, w)
}
func (h *timers) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	w.heapIndex = -1
	*h = old[:len(old)-1]
	return w
}

// scheduleBy makes sure w is checked no later than at.
func (h *timers) scheduleBy(w *worker, at time.Time) {
	switch {
	case w.heapIndex < 0:
		w.deadline = at
		heap.Push(h, w)
	case at.Before(w.deadline):
		w.deadline = at
		heap.Fix(h, w.heapIndex)
	}
}

// scheduleAt sets w's next check to exactly at.
func (h *timers) scheduleAt(w *worker, at time.Time) {
	w.deadline = at
	if w.heapIndex < 0 {
		heap.Push(h, w)
		return
	}
	heap.Fix(h, w.heapIndex)
}

func (h *timers) remove(w *worker) {
	if w.heapIndex >= 0 {
		heap.Remove(h, w.heapIndex)
	}
}
