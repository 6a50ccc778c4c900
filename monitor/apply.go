package monitor

import (
	"container/heap"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/workermon/workermon/events"
)

// Rejection reasons of the monitor itself, beside events.Reason's labels.
const (
	rejectDuplicate    = "duplicate"
	rejectDeadBoot     = "dead_boot"
	rejectAfterGoodbye = "after_goodbye"
	rejectUnknown      = "unknown_worker"
	rejectModels       = "too_many_models"
	rejectWorkers      = "too_many_workers"
	rejectSources      = "too_many_sources"
	rejectRanks        = "too_many_ranks"
	rejectPartition    = "wrong_partition"
	// rejectFuture: sent_at more than --stale-after ahead of the monitor's
	// clock (contract §3): accepted, a new boot_id would lock the worker's
	// real reports out as a dead boot.
	rejectFuture = "future_sent_at"
	// rejectStaleWindow: a latency window sent more than --stale-after
	// before the monitor's clock (contract §18 merges fresh windows only):
	// a connection that buffered it while disconnected delivers it late,
	// with a burst of others, and its samples and rejections are not the
	// current interval's.
	rejectStaleWindow = "stale_window"
)

// fromFuture reports whether a message sent at sentAt (Unix nanoseconds)
// is more than --stale-after ahead of now.
func (s *state) fromFuture(sentAt int64, now time.Time) bool {
	return sentAt > now.UnixNano()+int64(s.cfg.StaleAfter)
}

// rejectLogEvery limits how often rejections are logged.
const rejectLogEvery = 10 * time.Second

// state is everything the loop owns.
type state struct {
	cfg       Config
	sink      Sink
	metrics   *metrics
	log       *slog.Logger
	models    map[string]*model
	overrides map[string]events.Thresholds
	// controlled are the thresholds the SLO controller set (contract §18),
	// in force instead of the defaults and the override.
	controlled map[string]events.Thresholds
	// lat are the latency windows since the last DrainLatency, latEntries
	// their number of (model, worker, source).
	lat        map[string]*latModel
	latEntries int
	cordons    map[string]map[uint64]struct{} // by model, then worker id
	seen       map[string]struct{}            // models seen in a report since start, bounded
	timers     timers
	rqTimers   modelQueueTimers // models by their routers' queues' next deadline (rq.go)
	dirty      []*model         // models with dirty set, each once
	satDirty   []*model         // models with satQueued set, each once
	deferred   []*model         // scratch of flushRecords
	sc         scratch

	lastRejectLog time.Time
	rejectsSince  int
	// The reports on a mapped subject of another partition, logged apart
	// at the same limited rate: they mean a misconfigured NATS server.
	lastPartLog time.Time
	partSince   int
}

func newState(cfg Config, sink Sink, m *metrics, log *slog.Logger) *state {
	return &state{
		cfg:        cfg,
		sink:       sink,
		metrics:    m,
		log:        log,
		models:     make(map[string]*model),
		overrides:  make(map[string]events.Thresholds),
		controlled: make(map[string]events.Thresholds),
		lat:        make(map[string]*latModel),
		cordons:    make(map[string]map[uint64]struct{}),
		seen:       make(map[string]struct{}),
	}
}

// decodeMessage parses a message's subject and decodes and checks its
// payload with dec.
//
// An engine's load report, most of the traffic, is decoded first, and its
// subject left for the state to check (message.unchecked): the state knows
// the subject each rank was last heard on, and parses and matches a subject
// only when it is new for the rank. Any other message, and a load report
// that does not decode, takes the full path, so every error is reported as
// it would be there.
//
// With parts > 0, a subject of the mapped form whose partition is not the
// model key's among parts is an error matching ErrWrongPartition.
func decodeMessage(prefix string, parts int, dec *events.Decoder, subject string, data []byte) message {
	msg := message{subject: subject}
	if isLoadSubject(prefix, subject) {
		if r, err := dec.LoadReport(data); err == nil {
			msg.kind, msg.report, msg.unchecked = events.KindLoad, r, true
			return msg
		}
	}
	subj, err := events.ParseSubject(prefix, subject)
	if err != nil {
		msg.err = err
		return msg
	}
	if err := checkPartition(subj, parts); err != nil {
		msg.err = err
		return msg
	}
	msg.kind = subj.Kind
	switch subj.Kind {
	case events.KindLoad, events.KindEst:
		if msg.report, err = dec.LoadReport(data); err == nil {
			err = msg.report.Match(subj)
		}
	case events.KindBye, events.KindEstBye:
		if msg.bye, err = dec.Goodbye(data); err == nil {
			err = msg.bye.Match(subj)
		}
	case events.KindLat, events.KindLatr:
		if msg.lat, err = dec.LatencyReport(data); err == nil {
			err = msg.lat.Match(subj)
		}
	case events.KindRq:
		if msg.rq, err = dec.RouterQueue(data); err == nil {
			err = msg.rq.Match(subj)
		}
	}
	msg.err = err
	return msg
}

// isLoadSubject reports whether subject starts with prefix + ".load.", or
// with the form a partition mapping gives, prefix + ".part.<p>.load."
// (contract §10; with P > 1 every report arrives so): an engine's load
// report if it parses (events.ParseSubject), which checkSubject does.
func isLoadSubject(prefix, subject string) bool {
	const kind, part = ".load.", ".part."
	rest, ok := strings.CutPrefix(subject, prefix)
	if !ok {
		return false
	}
	if p, ok := strings.CutPrefix(rest, part); ok {
		i := strings.IndexByte(p, '.')
		if i < 0 {
			return false
		}
		rest = p[i:]
	}
	return len(rest) > len(kind) && rest[:len(kind)] == kind
}

// checkSubject checks the subject of an unchecked load report whose source
// state is src (nil when none): at once when the report's rank was last
// heard on the same subject, else by parsing it and matching it with the
// report.
func (s *state) checkSubject(r *events.LoadReport, subject string, src *sourceState) error {
	if src != nil {
		if rs := src.find(r.DPRank); rs != nil && rs.subject == subject {
			return nil
		}
	}
	subj, err := events.ParseSubject(s.cfg.SubjectPrefix, subject)
	if err != nil {
		return err
	}
	if err := checkPartition(subj, s.cfg.Partitions); err != nil {
		return err
	}
	return r.Match(subj)
}

// checkPartition checks that a mapped subject's partition is its model
// key's among parts (contract §10); parts 0 checks nothing. A mismatch
// means a NATS server maps with another partition count: its reports
// reach a monitor that does not own their models.
func checkPartition(subj events.Subject, parts int) error {
	if !subj.Mapped || parts == 0 {
		return nil
	}
	if want := events.PartitionOfKey(subj.ModelKey, parts); subj.Partition != want {
		return fmt.Errorf("monitor: partition %d in the subject, %d of %d for model key %q: %w",
			subj.Partition, want, parts, subj.ModelKey, ErrWrongPartition)
	}
	return nil
}

// rejectReason is the rejection label of a parse, decode or check error.
func rejectReason(err error) string {
	if errors.Is(err, ErrWrongPartition) {
		return rejectPartition
	}
	return events.Reason(err)
}

// handle applies one decoded message, or rejects it.
func (s *state) handle(msg *message, now time.Time) {
	if msg.err != nil {
		s.reject(rejectReason(msg.err), msg.subject, msg.err)
		return
	}
	switch msg.kind {
	case events.KindLoad, events.KindEst:
		if reason, err := s.applyReport(&msg.report, msg.subject, msg.unchecked, now); reason != "" {
			s.reject(reason, msg.subject, err)
			return
		}
		s.metrics.acceptedLoad.Inc()
		s.metrics.lag.Observe(max(0, float64(now.UnixNano()-msg.report.SentAt)/1e9))
	case events.KindBye, events.KindEstBye:
		if reason := s.applyGoodbye(&msg.bye, now); reason != "" {
			s.reject(reason, msg.subject, nil)
			return
		}
		s.metrics.acceptedBye.Inc()
	case events.KindLat, events.KindLatr:
		if reason := s.applyLatency(&msg.lat, now); reason != "" {
			s.reject(reason, msg.subject, nil)
			return
		}
		s.metrics.accepted.WithLabelValues("latency").Inc()
	case events.KindRq:
		if reason := s.applyRouterQueue(&msg.rq, now); reason != "" {
			s.reject(reason, msg.subject, nil)
			return
		}
		s.metrics.accepted.WithLabelValues("rq").Inc()
	}
}

// reject counts a rejected message and logs at a limited rate.
func (s *state) reject(reason, subject string, err error) {
	s.metrics.rejected.WithLabelValues(reason).Inc()
	if reason == rejectPartition {
		// Logged apart, so that other rejections do not hide it.
		s.partSince++
		if now := time.Now(); now.Sub(s.lastPartLog) >= rejectLogEvery {
			s.log.Error("report on a subject mapped with another partition count: a NATS server's mapping does not match --partitions (workermon nats-config)",
				"subject", subject, "partitions", s.cfg.Partitions, "err", err, "since_last_log", s.partSince)
			s.lastPartLog, s.partSince = now, 0
		}
		return
	}
	s.rejectsSince++
	if now := time.Now(); now.Sub(s.lastRejectLog) >= rejectLogEvery {
		s.log.Warn("message rejected", "reason", reason, "subject", subject, "err", err,
			"rejected_since_last_log", s.rejectsSince)
		s.lastRejectLog, s.rejectsSince = now, 0
	}
}

// applyReport applies a decoded report received on subject; it returns a
// rejection reason, with the error behind it when there is one, or "".
// When unchecked, the subject is checked first (checkSubject), before
// anything is created.
func (s *state) applyReport(r *events.LoadReport, subject string, unchecked bool, now time.Time) (string, error) {
	m := s.models[r.Model]
	var w *worker
	if m != nil {
		w = m.workers[r.WorkerID]
	}
	var src *sourceState
	if w != nil {
		src = w.source(r.Source)
	}
	if unchecked {
		if err := s.checkSubject(r, subject, src); err != nil {
			return rejectReason(err), err
		}
	}
	if r.DPSize > uint32(s.cfg.MaxRanksPerWorker) {
		return rejectRanks, nil
	}
	if s.fromFuture(r.SentAt, now) {
		return rejectFuture, nil
	}
	if m == nil {
		if len(s.models) >= s.cfg.MaxModels {
			return rejectModels, nil
		}
		m = s.addModel(r.Model)
	}
	if w == nil {
		if len(m.workers) >= s.cfg.MaxWorkersPerModel {
			return rejectWorkers, nil
		}
		w = s.newWorker(m, r.WorkerID)
	}
	if w.left {
		if r.Source != events.SourceEngine || r.BootID == w.leftBoot || r.SentAt <= w.leftSentAt {
			return rejectAfterGoodbye, nil
		}
		w.left = false // a new boot: the worker is back
	}
	switch {
	case src == nil:
		if len(w.sources) >= s.cfg.MaxSourcesPerWorker {
			return rejectSources, nil
		}
		src = &sourceState{name: r.Source, bootID: r.BootID, router: events.IsRouterSource(r.Source)}
		w.sources = append(w.sources, src)
	case src.bootID != r.BootID:
		if r.SentAt <= src.sentAt {
			return rejectDeadBoot, nil
		}
		// The publisher restarted: its old state goes (the ranks' array is
		// reused, cleared so that it holds no old subject).
		clear(src.ranks)
		*src = sourceState{name: src.name, bootID: r.BootID, router: src.router, ranks: src.ranks[:0]}
	case r.Seq <= src.seq:
		return rejectDuplicate, nil
	}
	if src.start != r.DPStart || src.size != r.DPSize {
		lo, hi := uint64(r.DPStart), uint64(r.DPStart)+uint64(r.DPSize)
		src.ranks = slices.DeleteFunc(src.ranks, func(rs rankState) bool {
			return uint64(rs.rank) < lo || uint64(rs.rank) >= hi
		})
		src.start, src.size = r.DPStart, r.DPSize
	}
	src.seq, src.sentAt, src.heard = r.Seq, r.SentAt, now
	rs := src.rank(r.DPRank)
	if rs.subject != subject {
		rs.subject = subject
	}
	for i, o := range reportSignals(r) {
		switch {
		case !o.Set, engineOnly[i] && src.router:
			continue
		case counterNames[i] != "" && rs.load[i].Set && o.Value < rs.load[i].Value:
			// A counter that goes down within a boot (contract §21): this
			// field of the report is dropped, the rest applies.
			s.metrics.counterDecreases[i].Inc()
			continue
		}
		rs.load[i] = o
	}
	rs.heard = now
	if src.router {
		s.heardRouter(m, r.Source, now)
	}
	s.evaluate(w, now)
	s.timers.scheduleBy(w, now.Add(s.cfg.StaleAfter))
	return "", nil
}

// applyGoodbye applies a goodbye; it returns a rejection reason or "".
func (s *state) applyGoodbye(g *events.Goodbye, now time.Time) string {
	m := s.models[g.Model]
	if m == nil || m.workers[g.WorkerID] == nil {
		return rejectUnknown
	}
	w := m.workers[g.WorkerID]
	if s.fromFuture(g.SentAt, now) {
		return rejectFuture // it would keep the next boot out for gone-after
	}
	if w.left {
		return rejectAfterGoodbye
	}
	src := w.source(g.Source)
	if src != nil && src.bootID != g.BootID && g.SentAt <= src.sentAt {
		return rejectDeadBoot
	}
	if g.Source != events.SourceEngine {
		if src == nil {
			return rejectUnknown
		}
		heard := w.lastHeard()
		w.dropSource(g.Source)
		s.evaluate(w, now)
		if len(w.sources) == 0 {
			// Nothing left to hear from: stale, and removed after gone-after
			// of silence like any other.
			s.timers.scheduleAt(w, heard.Add(s.cfg.GoneAfter))
		}
		return ""
	}
	w.sources = nil
	w.left, w.leftBoot, w.leftSentAt, w.leftAt = true, g.BootID, g.SentAt, now
	m.setClass(w, ClassNone, 0, LevelFree)
	s.setSaturation(w, false, 0)
	s.markDirty(m)
	s.timers.scheduleAt(w, now.Add(s.cfg.GoneAfter))
	return ""
}

func (s *state) newWorker(m *model, id uint64) *worker {
	w := &worker{id: id, idText: strconv.FormatUint(id, 10), model: m, heapIndex: -1}
	m.workers[id] = w
	return w
}

func (s *state) addModel(name string) *model {
	if len(s.seen) < maxSeenModels {
		s.seen[name] = struct{}{}
	}
	m := &model{name: name, workers: make(map[uint64]*worker), reasons: make(map[string]string), rq: rqState{index: -1}}
	m.thresholds = s.thresholdsOf(name)
	s.models[name] = m
	s.metrics.models.Set(float64(len(s.models)))
	return m
}

func (s *state) thresholdsOf(model string) events.Thresholds {
	if t, ok := s.controlled[model]; ok {
		return t
	}
	return s.cfg.Defaults.Merge(s.overrides[model])
}

// evaluate reclassifies w and marks its model dirty when w's place changed.
func (s *state) evaluate(w *worker, now time.Time) {
	if w.left {
		return
	}
	c, r, lvl, sat := classify(w.model.thresholds, s.cfg.fractions(), w, s.cfg.ReleaseMargin, now,
		now.Add(-s.cfg.StaleAfter), s.cfg.RateWindow, &s.sc)
	counted := c == ClassFree || c == ClassBusy
	if counted && s.cordoned(w.model.name, w.id) {
		// A cordoned worker gets nothing new, critical requests included
		// (contract §12): it is listed busy and hard, and left out of the
		// model's saturation (§21).
		c, r, lvl, counted = ClassBusy, ReasonCordoned, LevelHard, false
	}
	w.model.setClass(w, c, r, lvl)
	s.markDirty(w.model)
	s.setSaturation(w, counted, sat)
}

// setSaturation puts w's saturation in its model's mean (counted) or takes
// it out; a change of the mean alone is handed over at the next flush
// without a record build (contract §21: never written on its own).
func (s *state) setSaturation(w *worker, counted bool, sat float64) {
	m := w.model
	if m.setSaturation(w, counted, sat) && !m.satQueued {
		m.satQueued = true
		s.satDirty = append(s.satDirty, m)
	}
}

// markDirty queues m for the next flush if its record changed.
func (s *state) markDirty(m *model) {
	if m.dirty && !m.queued {
		m.queued = true
		s.dirty = append(s.dirty, m)
	}
}

// nextDeadline returns the time of the earliest freshness check, or of
// the earliest deadline of the routers' queues (rq.go).
func (s *state) nextDeadline() (time.Time, bool) {
	var next time.Time
	if len(s.timers) > 0 {
		next = s.timers[0].deadline
	}
	if len(s.rqTimers) > 0 && (next.IsZero() || s.rqTimers[0].rq.deadline.Before(next)) {
		next = s.rqTimers[0].rq.deadline
	}
	return next, !next.IsZero()
}

// expire runs every freshness check that is due: states not heard for
// gone-after are dropped, workers are reclassified, and workers with nothing
// left are removed.
func (s *state) expire(now time.Time) {
	for len(s.timers) > 0 && !s.timers[0].deadline.After(now) {
		w := heap.Pop(&s.timers).(*worker)
		s.check(w, now)
	}
	s.expireQueuesDue(now)
}

func (s *state) check(w *worker, now time.Time) {
	if w.left {
		if now.Sub(w.leftAt) >= s.cfg.GoneAfter {
			s.removeWorker(w)
		} else {
			s.timers.scheduleAt(w, w.leftAt.Add(s.cfg.GoneAfter))
		}
		return
	}
	goneBefore := now.Add(-s.cfg.GoneAfter)
	staleBefore := now.Add(-s.cfg.StaleAfter)
	var next time.Time
	for _, src := range w.sources {
		src.ranks = slices.DeleteFunc(src.ranks, func(rs rankState) bool { return !rs.heard.After(goneBefore) })
		for i := range src.ranks {
			if rs := &src.ranks[i]; rs.heard.After(staleBefore) {
				if t := rs.heard.Add(s.cfg.StaleAfter); next.IsZero() || t.Before(next) {
					next = t
				}
			}
		}
	}
	w.sources = slices.DeleteFunc(w.sources, func(src *sourceState) bool { return len(src.ranks) == 0 })
	if len(w.sources) == 0 {
		s.removeWorker(w)
		return
	}
	s.evaluate(w, now)
	s.recountRouters(w.model, now)
	if next.IsZero() {
		// Nothing fresh: check again when the oldest state is gone.
		next = oldestHeard(w).Add(s.cfg.GoneAfter)
	}
	s.timers.scheduleAt(w, next)
}

func oldestHeard(w *worker) time.Time {
	var t time.Time
	for _, src := range w.sources {
		for i := range src.ranks {
			if rs := &src.ranks[i]; t.IsZero() || rs.heard.Before(t) {
				t = rs.heard
			}
		}
	}
	return t
}

func (s *state) removeWorker(w *worker) {
	m := w.model
	s.timers.remove(w)
	m.setClass(w, ClassNone, 0, LevelFree)
	s.setSaturation(w, false, 0)
	delete(m.workers, w.id)
	if len(m.workers) == 0 {
		// flush deletes the record. setClass did not mark it when w had
		// said goodbye: w was in no list already.
		m.dirty = true
	}
	s.markDirty(m)
}

// seed adds the workers of records not known yet, without state: stale,
// and removed after gone-after.
func (s *state) seed(records []events.BusySet, now time.Time) {
	for _, rec := range records {
		if events.ValidateModel(rec.Model) != nil {
			continue
		}
		m := s.models[rec.Model]
		if m == nil {
			if len(s.models) >= s.cfg.MaxModels {
				continue
			}
			m = s.addModel(rec.Model)
		}
		for _, list := range [][]uint64{rec.Busy, rec.Free, rec.Stale} {
			for _, id := range list {
				if m.workers[id] != nil || len(m.workers) >= s.cfg.MaxWorkersPerModel {
					continue
				}
				w := s.newWorker(m, id)
				if s.cfg.ReleaseMargin > 0 {
					w.seedLatch = seedLatchOf(&rec, id, w.idText)
				}
				s.evaluate(w, now)
				s.timers.scheduleAt(w, now.Add(s.cfg.GoneAfter))
			}
		}
	}
}

// seedLatchOf is what rec says of worker id's checks at each level, to seed
// the latch of a new writer (contract §12, §15): a busy worker starts
// latched busy and amber on the checks of its reason, and hard on them too
// when the record lists it hard; an amber worker starts latched amber on
// every check (the record does not say which held).
func seedLatchOf(rec *events.BusySet, id uint64, idText string) Latch {
	if _, ok := slices.BinarySearch(rec.Busy, id); ok {
		c := latchOf(rec.Reasons[idText])
		l := Latch{Amber: c, Busy: c}
		if _, ok := slices.BinarySearch(rec.Hard, id); ok {
			l.Hard = c
		}
		return l
	}
	if _, ok := slices.BinarySearch(rec.Amber, id); ok {
		return Latch{Amber: checkAll}
	}
	return Latch{}
}

// cordoned reports whether an operator cordoned the worker.
func (s *state) cordoned(model string, worker uint64) bool {
	_, ok := s.cordons[model][worker]
	return ok
}

// setCordon records a cordon (on) or its removal and re-evaluates the
// worker when it is known.
func (s *state) setCordon(model string, worker uint64, on bool, now time.Time) {
	ws := s.cordons[model]
	if on {
		if ws == nil {
			ws = make(map[uint64]struct{})
			s.cordons[model] = ws
		}
		ws[worker] = struct{}{}
	} else {
		delete(ws, worker)
		if len(ws) == 0 {
			delete(s.cordons, model)
		}
	}
	if m := s.models[model]; m != nil {
		if w := m.workers[worker]; w != nil {
			s.evaluate(w, now)
		}
	}
}

// setOverride replaces a model's override (nil clears it) and recomputes
// its workers.
func (s *state) setOverride(model string, t *events.Thresholds) {
	if t == nil {
		delete(s.overrides, model)
	} else {
		s.overrides[model] = *t
	}
	s.recomputeThresholds(model)
}

// recomputeThresholds puts model's thresholds in force and recomputes its
// workers.
func (s *state) recomputeThresholds(model string) {
	m := s.models[model]
	if m == nil {
		return
	}
	m.thresholds = s.thresholdsOf(model)
	m.dirty = true
	s.markDirty(m)
	now := time.Now()
	for _, w := range m.workers {
		s.evaluate(w, now)
	}
}

// SaturationSink is a Sink that takes a change of a model's saturation
// alone (contract §21): it keeps the value for the record's next write,
// the next heartbeat or the next other change, and writes nothing for it.
// Without it, a record carries the saturation of its last build.
type SaturationSink interface {
	Sink
	SetSaturation(model string, saturation float64)
}

// flushSaturation exports the mean saturation of the models whose mean
// changed and hands a changed rounded value to a SaturationSink. A model
// with a record still to build is left to it.
func (s *state) flushSaturation() {
	ss, _ := s.sink.(SaturationSink)
	for _, m := range s.satDirty {
		m.satQueued = false
		if s.models[m.name] != m || !m.metrics.resolved {
			continue // gone, or without a record yet
		}
		mean := m.saturation()
		m.metrics.saturation.Set(mean)
		if r := events.RoundSaturation(mean); ss != nil && !m.dirty && r != m.satGiven {
			m.satGiven = r
			ss.SetSaturation(m.name, r)
		}
	}
	clear(s.satDirty)
	s.satDirty = s.satDirty[:0]
}

// flush hands the changed records to the Sink (see flushRecords), and
// deletes the records of models with no worker left.
func (s *state) flush(now time.Time) { s.flushRecords(false, now) }

// flushAll hands every changed record to the sink, deferring none.
func (s *state) flushAll(now time.Time) { s.flushRecords(true, now) }

// flushRecords hands the changed records to the sink at now, the loop's
// clock. Unless all, a model whose previous record a PendingSink has not
// taken yet stays queued: its record is built at the next flush after
// Monitor.Kick.
func (s *state) flushRecords(all bool, now time.Time) {
	ps, _ := s.sink.(PendingSink)
	deferred := s.deferred[:0]
	for _, m := range s.dirty {
		if len(m.workers) > 0 && !all && ps != nil && ps.Pending(m.name) {
			deferred = append(deferred, m)
			continue
		}
		m.dirty, m.queued = false, false
		if len(m.workers) == 0 {
			delete(s.models, m.name)
			s.dropQueues(m)
			s.sink.Delete(m.name)
			s.metrics.forgetModel(m.name)
			continue
		}
		if !m.metrics.resolved {
			m.metrics = s.metrics.forModel(m.name)
		}
		rec := m.record()
		m.queuesGiven(now)
		if rec.AllBusy != m.allBusy {
			m.allBusy = rec.AllBusy
			m.metrics.allBusyChanges.Inc()
		}
		s.sink.Set(rec)
		m.metrics.setWorkers(m)
		m.metrics.saturation.Set(m.saturation())
	}
	s.flushSaturation()
	clear(s.dirty)
	s.dirty = append(s.dirty[:0], deferred...)
	clear(deferred)
	s.deferred = deferred[:0]
	s.metrics.models.Set(float64(len(s.models)))
}
