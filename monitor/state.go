package monitor

import (
	"cmp"
	"container/heap"
	"maps"
	"math"
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
	// The leading signals of contract §21: the request counts and the
	// counters are the engine's only (a router's are not kept).
	sigWaiting
	sigRunning
	sigPreemptions
	sigPrefilled
	sigCommitted
	numSignals
)

// reportSignals returns r's load fields in the order of rankState.load.
func reportSignals(r *events.LoadReport) [numSignals]events.Optional {
	return [numSignals]events.Optional{r.ActiveDecodeBlocks, r.KVTotalBlocks, r.ActivePrefillTokens, r.MaxNumBatchedTokens,
		r.WaitingRequests, r.RunningRequests, r.Preemptions, r.PrefilledTokens, r.KVCommittedBlocks}
}

// counterNames are the fields that are counters per boot_id (contract
// §21), by signal: a report in which one goes down has that field dropped.
var counterNames = [numSignals]string{sigPreemptions: "preemptions", sigPrefilled: "prefilled_tokens"}

// engineOnly are the signals kept only from sources that are not routers.
var engineOnly = [numSignals]bool{sigWaiting: true, sigRunning: true, sigPreemptions: true, sigPrefilled: true}

// rankState is one (worker, rank, source) state.
type rankState struct {
	rank  uint32
	load  [numSignals]events.Optional
	heard time.Time // monitor clock
	// subject is the subject the rank was last heard on. It was checked
	// against a report of the same model, worker, rank and source, so a
	// report on the same subject matches it too.
	subject string
}

// sourceState is what one source of a worker has said, per rank.
type sourceState struct {
	name        string
	bootID      uint64
	seq         uint64
	sentAt      int64
	start, size uint32 // declared ranks [start, start+size)
	router      bool   // a router's estimate (router/*), summed with other routers
	heard       time.Time
	// ranks are the ranks heard, sorted by rank. An engine has a handful;
	// a slice spares every report a map's hashing, and every evaluation a
	// map iterator.
	ranks []rankState
}

// find returns the state of rank r, or nil.
func (src *sourceState) find(r uint32) *rankState {
	if i, ok := src.search(r); ok {
		return &src.ranks[i]
	}
	return nil
}

// rank returns the state of rank r, adding it when absent. The pointer is
// valid until the next rank is added or removed.
func (src *sourceState) rank(r uint32) *rankState {
	i, ok := src.search(r)
	if !ok {
		src.ranks = slices.Insert(src.ranks, i, rankState{rank: r})
	}
	return &src.ranks[i]
}

// search returns where rank r is in src.ranks, or would be.
func (src *sourceState) search(r uint32) (int, bool) {
	lo, hi := 0, len(src.ranks)
	for lo < hi {
		h := int(uint(lo+hi) >> 1)
		if src.ranks[h].rank < r {
			lo = h + 1
		} else {
			hi = h
		}
	}
	return lo, lo < len(src.ranks) && src.ranks[lo].rank == r
}

// worker is one engine instance of a model.
type worker struct {
	id     uint64
	idText string // id in decimal, the key of the record's reasons
	model  *model
	// sources are the worker's sources: the engine and a few routers at
	// most (MaxSourcesPerWorker), found by a scan.
	sources []*sourceState
	class   Class
	reason  Reason
	// level is the worker's level (contract §15): free or amber when class
	// is ClassFree, busy or hard when ClassBusy, free otherwise.
	level Level

	// latch holds, per rank, the checks that held at each level at the
	// last evaluation: with a release margin they hold until the load falls
	// to their release level (contract §12, §15). seedLatch is what a
	// previous writer's record said, for the ranks not evaluated yet.
	latch     map[uint32]Latch
	seedLatch Latch

	// leading are the derived values of the ranks (contract §21), sorted
	// by rank, of the engine's boot leadingBoot; kept while the ranks are
	// stale, forgotten when the engine restarts.
	leading     []rankLeading
	leadingBoot uint64
	// saturation is the worker's saturation at its last evaluation; when
	// satCounted (fresh and not cordoned), it is in its model's mean.
	saturation float64
	satCounted bool

	// A goodbye from the engine source leaves a tombstone: reports of the
	// same boot, or of an older one, are dropped until the worker is removed.
	left       bool
	leftBoot   uint64
	leftSentAt int64
	leftAt     time.Time

	deadline  time.Time // next freshness check; see state.schedule
	heapIndex int       // position in state.timers, -1 when not scheduled
}

// source returns w's source named name, or nil.
func (w *worker) source(name string) *sourceState {
	for _, src := range w.sources {
		if src.name == name {
			return src
		}
	}
	return nil
}

// dropSource forgets w's source named name.
func (w *worker) dropSource(name string) {
	w.sources = slices.DeleteFunc(w.sources, func(src *sourceState) bool { return src.name == name })
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
	amber, hard       []uint64          // free workers at amber, busy workers at hard (§15)
	reasons           map[string]string // of the busy workers, by decimal id
	// routerHeard is when each router/* source last reported on a worker
	// of the model, fresh ones only; routers is their number in the record
	// (contract §17).
	routerHeard map[string]time.Time
	routers     int
	// rq are the routers' queues of the model (contract §22, rq.go).
	rq      rqState
	allBusy bool // in the last record flushed
	metrics modelMetrics
	dirty   bool // the record changed since the last flush
	queued  bool // in state.dirty
	// satSum and satN are the sum, in satUnits, and number of the
	// saturations of the workers counted in the model's mean (contract
	// §21); satQueued: the mean changed since the last flush (in
	// state.satDirty); satGiven: the rounded mean last handed to the sink.
	satSum    int64
	satN      int
	satQueued bool
	satGiven  float64
}

// satUnit is the fixed point of the saturations a model sums: 2^-40, so
// that adding and taking out a worker's saturation leaves no rounding
// behind however often it changes, and a sum of up to 2 million workers at
// the cap of 4 fits an int64. A saturation is exact to 2^-41.
const satUnit = 1 << 40

// toSatUnits converts a saturation in [0, MaxSaturation] to satUnits.
func toSatUnits(sat float64) int64 { return int64(math.Round(sat * satUnit)) }

// saturation is the mean saturation of m's fresh, uncordoned workers, 0
// with none (contract §21).
func (m *model) saturation() float64 {
	if m.satN == 0 {
		return 0
	}
	return float64(m.satSum) / satUnit / float64(m.satN)
}

// setSaturation puts w's saturation in m's mean (counted) or takes it out,
// and reports whether the mean changed.
func (m *model) setSaturation(w *worker, counted bool, sat float64) bool {
	if !counted {
		sat = 0
	}
	if w.satCounted == counted && w.saturation == sat {
		return false
	}
	if w.satCounted {
		m.satSum -= toSatUnits(w.saturation)
		m.satN--
	}
	if counted {
		m.satSum += toSatUnits(sat)
		m.satN++
	}
	w.saturation, w.satCounted = sat, counted
	return true
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

// setClass moves w to class c with reason r at level lvl, keeping the
// lists sorted. lvl is clamped to what c allows: amber at most when free,
// busy or hard when busy, free otherwise.
func (m *model) setClass(w *worker, c Class, r Reason, lvl Level) {
	switch c {
	case ClassFree:
		lvl = min(lvl, LevelAmber)
	case ClassBusy:
		lvl = max(lvl, LevelBusy)
	default:
		lvl = LevelFree
	}
	if w.class == c && w.reason == r && w.level == lvl {
		return
	}
	if w.class != c {
		if l := m.list(w.class); l != nil {
			remove(l, w.id)
		}
		if l := m.list(c); l != nil {
			insert(l, w.id)
		}
	}
	if was, is := w.level == LevelAmber, lvl == LevelAmber; was != is {
		if is {
			insert(&m.amber, w.id)
		} else {
			remove(&m.amber, w.id)
		}
	}
	if was, is := w.level == LevelHard, lvl == LevelHard; was != is {
		if is {
			insert(&m.hard, w.id)
		} else {
			remove(&m.hard, w.id)
		}
	}
	if c == ClassBusy {
		m.reasons[w.idText] = r.String()
	} else if w.class == ClassBusy {
		delete(m.reasons, w.idText)
	}
	w.class, w.reason, w.level = c, r, lvl
	m.dirty = true
}

// insert adds id to the sorted list l.
func insert(l *[]uint64, id uint64) {
	if i, ok := slices.BinarySearch(*l, id); !ok {
		*l = slices.Insert(*l, i, id)
	}
}

// remove deletes id from the sorted list l.
func remove(l *[]uint64, id uint64) {
	if i, ok := slices.BinarySearch(*l, id); ok {
		*l = slices.Delete(*l, i, i+1)
	}
}

// record returns the content of the model's record. Everything in it is
// freshly allocated: the Sink keeps it.
func (m *model) record() events.BusySet {
	m.satGiven = events.RoundSaturation(m.saturation())
	queuedBy, queued := m.queuedRecord()
	return events.BusySet{
		Model:      m.name,
		Busy:       slices.Clone(m.busy),
		Free:       slices.Clone(m.free),
		Stale:      slices.Clone(m.stale),
		AllBusy:    len(m.free) == 0 && len(m.busy) > 0,
		Amber:      slices.Clone(m.amber),
		Hard:       slices.Clone(m.hard),
		Reasons:    maps.Clone(m.reasons),
		Thresholds: m.thresholds,
		Routers:    uint64(m.routers),
		Saturation: m.satGiven,
		QueuedBy:   queuedBy,
		Queued:     queued,
	}
}

// heardRouter notes a report of the router source name on a worker of m at
// now, and recounts m's routers when that source was not fresh.
func (s *state) heardRouter(m *model, name string, now time.Time) {
	prev, ok := m.routerHeard[name]
	if m.routerHeard == nil {
		m.routerHeard = make(map[string]time.Time)
	}
	m.routerHeard[name] = now
	if !ok || !prev.After(now.Add(-s.cfg.StaleAfter)) {
		s.recountRouters(m, now)
	}
}

// recountRouters forgets the router sources of m not heard within
// stale-after and marks m's record dirty when their number changed: the
// routers with a fresh estimate, and those with a queue report kept
// (contract §22). It costs one step per router, not per worker.
func (s *state) recountRouters(m *model, now time.Time) {
	staleBefore := now.Add(-s.cfg.StaleAfter)
	maps.DeleteFunc(m.routerHeard, func(_ string, t time.Time) bool { return !t.After(staleBefore) })
	if n := len(m.routerHeard) + m.queuedRouters(); n != m.routers {
		m.routers = n
		m.dirty = true
		s.markDirty(m)
	}
}

// span is a half-open range of ranks.
type span struct{ lo, hi uint64 }

// scratch holds buffers reused across worker evaluations.
type scratch struct {
	spans []span
	ranks map[uint32]rankAgg
	latch map[uint32]Latch
}

// rankAgg aggregates one rank across fresh sources (contract §3, §11):
// each signal is the larger of the engine's value (the largest over the
// sources that are not routers) and the sum over router/* sources, since
// each router sees only its share of the traffic; capacities by smallest
// positive value. Read the result with load.
type rankAgg struct {
	RankLoad
	routerDecode, routerPrefill, routerCommitted uint64
	committed                                    bool // a source sent kv_committed_blocks
	// The engine's request counts and counters (contract §21): the
	// largest over the sources that are not routers.
	waiting, running, preemptions, prefilled events.Optional
}

func (a *rankAgg) add(rs *rankState, router bool) {
	l := &rs.load
	if router {
		a.routerDecode = addSaturating(a.routerDecode, l[sigDecode])
		a.routerPrefill = addSaturating(a.routerPrefill, l[sigPrefill])
		a.routerCommitted = addSaturating(a.routerCommitted, l[sigCommitted])
		a.committed = a.committed || l[sigCommitted].Set
	} else {
		if l[sigDecode].Set {
			a.ActiveDecodeBlocks = max(a.ActiveDecodeBlocks, l[sigDecode].Value)
		}
		if l[sigPrefill].Set {
			a.ActivePrefillTokens = max(a.ActivePrefillTokens, l[sigPrefill].Value)
		}
		if l[sigCommitted].Set {
			a.KVCommittedBlocks = max(a.KVCommittedBlocks, l[sigCommitted].Value)
			a.committed = true
		}
		a.waiting = maxOptional(a.waiting, l[sigWaiting])
		a.running = maxOptional(a.running, l[sigRunning])
		a.preemptions = maxOptional(a.preemptions, l[sigPreemptions])
		a.prefilled = maxOptional(a.prefilled, l[sigPrefilled])
	}
	a.KVTotalBlocks = minPositive(a.KVTotalBlocks, l[sigKVTotal])
	a.MaxNumBatchedTokens = minPositive(a.MaxNumBatchedTokens, l[sigMaxBatched])
}

// load is the rank's load for the busy rules.
func (a *rankAgg) load() RankLoad {
	l := a.RankLoad
	l.ActiveDecodeBlocks = max(l.ActiveDecodeBlocks, a.routerDecode)
	l.ActivePrefillTokens = max(l.ActivePrefillTokens, a.routerPrefill)
	l.KVCommittedBlocks = max(l.KVCommittedBlocks, a.routerCommitted)
	return l
}

// sample is what the rank's leading values derive from (contract §21).
func (a *rankAgg) sample() leadingSample {
	return leadingSample{prefilled: a.prefilled, preemptions: a.preemptions,
		activePrefill: max(a.ActivePrefillTokens, a.routerPrefill)}
}

// maxOptional is the larger of two optional values, set when either is.
func maxOptional(a, b events.Optional) events.Optional {
	if !b.Set || a.Set && a.Value >= b.Value {
		return a
	}
	return b
}

// addSaturating adds o to sum when it is set, stopping at the largest
// uint64: estimates from the network must not wrap to a small load.
func addSaturating(sum uint64, o events.Optional) uint64 {
	if !o.Set {
		return sum
	}
	if s := sum + o.Value; s >= sum {
		return s
	}
	return math.MaxUint64
}

// aggregate fills ranks with w's fresh ranks, each aggregated over w's
// fresh sources. ranks is cleared first.
func aggregate(w *worker, freshAfter time.Time, ranks map[uint32]rankAgg) {
	clear(ranks)
	for _, src := range w.sources {
		if !src.heard.After(freshAfter) {
			continue
		}
		for i := range src.ranks {
			if rs := &src.ranks[i]; rs.heard.After(freshAfter) {
				a := ranks[rs.rank]
				a.add(rs, src.router)
				ranks[rs.rank] = a
			}
		}
	}
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

// classify applies the busy rules to one worker: in no list while only
// routers have spoken of it, stale when no engine source (one not
// router/*) has fresh state, busy when every declared rank (the union of
// the fresh sources' ranges) is busy, free otherwise: routers' estimates add
// load, never liveness. Its level (contract §15) is the lowest of its
// declared ranks' levels, a declared rank without fresh state being free.
// With a release margin, each rank's checks are latched per level in
// w.latch (contract §12). Each fresh rank's leading values (contract §21)
// take a sample at now in w.leading, over rate windows of window, and the
// worker's saturation is the smallest of its declared ranks' (0 when one
// has no fresh state). It reads the sources and writes only w.latch,
// w.leading and sc.
func classify(t events.Thresholds, f Fractions, w *worker, margin float64, now, freshAfter time.Time, window time.Duration,
	sc *scratch) (Class, Reason, Level, float64) {
	sc.spans = sc.spans[:0]
	var only *sourceState
	engine, engineFresh := false, false
	for _, src := range w.sources {
		engine = engine || !src.router
		if src.heard.After(freshAfter) {
			only = src
			engineFresh = engineFresh || !src.router
			sc.spans = append(sc.spans, span{uint64(src.start), uint64(src.start) + uint64(src.size)})
		}
	}
	switch {
	case !engine && len(w.sources) > 0:
		// Only routers speak of it: no engine has reported; not listed.
		return ClassNone, 0, LevelFree, 0
	case !engineFresh:
		// A router's estimates never keep a silent engine alive.
		return ClassStale, 0, LevelFree, 0
	}
	if len(w.leading) > 0 {
		w.checkLeadingBoot()
	}
	maxGap := now.Sub(freshAfter)
	declared := unionSize(sc.spans)
	var amber, busy, hard uint64 // ranks at that level or above
	var reason Reason
	seeding := !w.seedLatch.IsZero()
	var evaluated uint64
	sat := math.Inf(1)
	rank := func(r uint32, a *rankAgg) {
		l := a.load()
		// A rank whose engine sends neither counter has nothing to derive
		// (a sample without them counts for nothing): its reports skip
		// the derived state altogether.
		if a.prefilled.Set || a.preemptions.Set {
			d := w.leadingRank(r)
			d.observe(now, a.sample(), window, maxGap)
			l.QueueDelayMs, l.QueueDelayKnown = d.queueDelay(l.ActivePrefillTokens, window)
		}
		sat = min(sat, RankSaturation(t, l))
		var c Latch
		if margin == 0 {
			c = RankLevels(t, l, f, 0, Latch{})
		} else {
			latched, ok := w.latch[r]
			if !ok {
				latched = w.seedLatch
			}
			c = RankLevels(t, l, f, margin, latched)
			if sc.latch == nil {
				sc.latch = make(map[uint32]Latch)
			}
			// While the seed lasts, a rank that had it is remembered even
			// released, so that it is not seeded again.
			if !c.IsZero() || seeding {
				sc.latch[r] = c
			}
		}
		evaluated++
		switch c.Level() {
		case LevelHard:
			hard++
			fallthrough
		case LevelBusy:
			busy++
			reason |= c.Busy.Reason()
			fallthrough
		case LevelAmber:
			amber++
		}
	}
	if len(sc.spans) == 1 {
		for i := range only.ranks {
			rs := &only.ranks[i]
			if !rs.heard.After(freshAfter) {
				continue
			}
			var a rankAgg
			a.add(rs, only.router)
			rank(rs.rank, &a)
		}
	} else {
		if sc.ranks == nil {
			sc.ranks = make(map[uint32]rankAgg)
		}
		aggregate(w, freshAfter, sc.ranks)
		for r, a := range sc.ranks {
			rank(r, &a)
		}
	}
	if margin > 0 {
		// The ranks just evaluated replace the latch; the seed is used up
		// once every declared rank has had it (contract §12: a worker
		// listed busy starts latched busy on its ranks, not only on the
		// first to report after a takeover).
		w.latch, sc.latch = sc.latch, w.latch
		clear(sc.latch)
		if evaluated >= declared {
			w.seedLatch = Latch{}
		}
	}
	if evaluated < declared || math.IsInf(sat, 1) {
		sat = 0 // a declared rank without fresh state counts 0
	}
	switch {
	case busy >= declared && hard >= declared:
		return ClassBusy, reason, LevelHard, sat
	case busy >= declared:
		return ClassBusy, reason, LevelBusy, sat
	case amber >= declared:
		return ClassFree, 0, LevelAmber, sat
	}
	return ClassFree, 0, LevelFree, sat
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
