package busylist

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
)

// How a write travels: startLocked decides it and takes what it writes
// (under Writer.mu), send encodes it and hands it to NATS (without the
// lock, on the goroutine that started it: Set's or Delete's caller, a
// completion, or Run), and complete applies its result and starts the next
// write of the key when something was given meanwhile.
//
// Where asynchronous puts are used (no JetStream domain or API prefix, no
// mirrored bucket: "headers mode") every write, put or delete, is an
// asynchronous publish whose answer comes back on the connection's
// goroutine, and carries the writer's epoch and monitor id in headers
// (headerEpoch, headerMonitor). A delete marker carries them too: a key
// with no revision known is written with an expected last revision of 0,
// which fails on a marker as on a record, and the writer then reads the
// marker's epoch before it writes over it (resolve). So a writer of a lower
// epoch cannot bring back a record that one of a higher epoch deleted
// (contract §10: a record's epoch never decreases). Elsewhere every write
// uses the KV API and waits on a goroutine of its own, bounded by
// WriteTimeout; its markers carry no epoch.

// writerOp is one KV operation on one key.
type writerOp struct {
	rec  *writerRecord
	kind string
	gen  uint64 // rec.gen when it started
	rev  uint64 // the compare-and-set revision
	del  bool
	set  events.BusySet // what a put writes
	took bool           // it took a record given by Set or Delete (monitor.PendingSink)
	msg  *nats.Msg      // an asynchronous put's message
	// start is when it was handed to NATS, monotonic.
	start time.Time
}

// startLocked starts the next write of rec if one is due and may start
// now: a change or delete not written, or a heartbeat (unless
// onlyChanged), of a partition that may be written, with no write of the
// key in flight nor a backoff running. It returns the operation for send,
// or nil.
func (w *Writer) startLocked(rec *writerRecord, now time.Time, onlyChanged bool) *writerOp {
	if rec.writing || rec.conflict || w.kv == nil || now.Before(rec.retryAt) ||
		!rec.changed && (onlyChanged || !rec.hbDue) {
		return nil
	}
	if !w.writableLocked(rec.part, now) {
		if !w.parts[rec.part].holds {
			rec.hbDue = false // a heartbeat of a partition no longer held
		}
		return nil
	}
	epoch := w.parts[rec.part].epoch
	op := &writerOp{rec: rec, gen: rec.gen, rev: rec.rev, took: rec.pending}
	if rec.del {
		if rec.rev == 0 {
			w.dropLocked(rec) // never written: nothing to delete
			return nil
		}
		op.kind, op.del = writerKindDelete, true
	} else {
		op.kind = writerKindHeartbeat
		if rec.changed {
			op.kind = writerKindChange
		}
		w.seq++
		op.set = rec.content
		op.set.V = events.SchemaVersion
		op.set.UpdatedAt = w.now().UnixNano()
		op.set.MonitorID = w.cfg.MonitorID
		op.set.Epoch = epoch
		op.set.Seq = w.seq
	}
	if w.pub != nil {
		op.msg = w.recordMsg(rec.key, epoch, op.del)
		w.puts[op.msg] = op
	}
	rec.writing, rec.hbDue, rec.pending = true, false, false
	w.inflight++
	return op
}

// startAll starts every write that is due and may start, of partition p
// (every partition when p is negative), and returns the earliest time a
// key's backoff ends (zero when none runs), a write's or a conflict's read.
func (w *Writer) startAll(p int, onlyChanged bool) time.Time {
	w.mu.Lock()
	now := time.Now()
	var ops []*writerOp
	var next time.Time
	for _, rec := range w.recs {
		if p >= 0 && rec.part != p {
			continue
		}
		if op := w.startLocked(rec, now, onlyChanged); op != nil {
			ops = append(ops, op)
		} else if (rec.changed || rec.hbDue || rec.conflict) && !rec.writing && rec.retryAt.After(now) &&
			(next.IsZero() || rec.retryAt.Before(next)) {
			next = rec.retryAt
		}
	}
	w.mu.Unlock()
	w.sendAll(ops)
	return next
}

// sendAll sends ops and tells the monitor when one took a record it gave.
func (w *Writer) sendAll(ops []*writerOp) {
	took := false
	for _, op := range ops {
		took = took || op.took
		w.send(op)
	}
	if took && w.cfg.OnTaken != nil {
		w.cfg.OnTaken()
	}
}

// send encodes op and hands it to NATS.
func (w *Writer) send(op *writerOp) {
	var data []byte
	if !op.del {
		data, _ = events.MarshalBusySet(&op.set) // Set checked the model
	}
	op.start = time.Now()
	if op.msg == nil {
		go w.wait(op, data)
		return
	}
	op.msg.Data = data
	if _, err := w.pub.PublishMsgAsync(op.msg, jetstream.WithExpectLastSequencePerSubject(op.rev)); err != nil {
		w.mu.Lock()
		_, ok := w.puts[op.msg]
		delete(w.puts, op.msg)
		w.mu.Unlock()
		if ok { // not already completed by the error handler
			w.complete(op, 0, err)
		}
	}
}

// recordMsg is the message of a write of key under epoch in headers mode:
// a put, or with del a delete marker.
func (w *Writer) recordMsg(key string, epoch uint64, del bool) *nats.Msg {
	m := nats.NewMsg(w.putPre + key)
	m.Header.Set(headerEpoch, strconv.FormatUint(epoch, 10))
	m.Header.Set(headerMonitor, w.cfg.MonitorID)
	if del {
		m.Header.Set(headerKVOp, "DEL")
	}
	return m
}

// wait does op and waits for its answer, bounded by WriteTimeout, where
// asynchronous puts are not used (the KV API: its create goes over a
// delete marker whatever wrote it). The
// goroutine it runs on ends with the operation; Run waits for it before it
// returns.
func (w *Writer) wait(op *writerOp, data []byte) {
	ctx, cancel := context.WithTimeout(context.Background(), w.cfg.WriteTimeout)
	defer cancel()
	var rev uint64
	var err error
	switch {
	case op.del:
		err = w.kv.Delete(ctx, op.rec.key, jetstream.LastRevision(op.rev))
	case op.rev == 0:
		rev, err = w.kv.Create(ctx, op.rec.key, data)
	default:
		rev, err = w.kv.Update(ctx, op.rec.key, data, op.rev)
	}
	w.complete(op, rev, err)
}

// onAck and onErr are the answers of the asynchronous puts, on the
// connection's goroutine.
func (w *Writer) onAck(_ jetstream.JetStream, m *nats.Msg, ack *jetstream.PubAck) {
	if op := w.takePut(m); op != nil {
		w.complete(op, ack.Sequence, nil)
	}
}

func (w *Writer) onErr(_ jetstream.JetStream, m *nats.Msg, err error) {
	if op := w.takePut(m); op != nil {
		w.complete(op, 0, err)
	}
}

// takePut returns the put of message m, and forgets it.
func (w *Writer) takePut(m *nats.Msg) *writerOp {
	w.mu.Lock()
	defer w.mu.Unlock()
	op := w.puts[m]
	delete(w.puts, m)
	return op
}

// complete applies the result of op, and starts the key's next write when
// one is due.
func (w *Writer) complete(op *writerOp, rev uint64, err error) {
	w.metrics.duration.Observe(time.Since(op.start).Seconds())
	rec := op.rec
	w.mu.Lock()
	now := time.Now()
	rec.writing = false
	w.inflight--
	if err == nil {
		w.metrics.writes.WithLabelValues(op.kind).Inc()
		rec.bo.Reset()
		w.elog.OK()
		switch {
		case !op.del:
			rec.rev, rec.lastPut = rev, op.start
			if rec.gen == op.gen {
				w.clearChangedLocked(rec)
			}
		case rec.del && rec.gen == op.gen && w.recs[rec.model] == rec:
			w.dropLocked(rec)
		default:
			// Deleted; set again since: created over the marker (its
			// revision; 0 through the KV API, which creates).
			rec.rev = rev
		}
	} else {
		w.metrics.errors.WithLabelValues(op.kind).Inc()
		switch {
		case errors.Is(err, jetstream.ErrInvalidKey):
			w.log.Error("busylist: cannot write a model's record, dropping it", "model", rec.model, "err", err)
			w.dropLocked(rec)
		case writerConflict(err):
			rec.conflict = true
			w.signal()
		default:
			w.elog.Fail(err, "model", rec.model, "kind", op.kind)
			rec.retryAt = now.Add(rec.bo.Next())
			w.signal()
		}
	}
	next := w.startLocked(rec, now, false)
	w.progressLocked()
	w.mu.Unlock()
	if next != nil {
		w.sendAll([]*writerOp{next})
	}
}

// progressLocked wakes those waiting for a write to complete.
func (w *Writer) progressLocked() {
	if w.waiting {
		close(w.progress)
		w.progress, w.waiting = make(chan struct{}), false
	}
}

// resolveConflicts starts reading the keys of partition p (every partition
// when p is negative) whose last write failed its compare-and-set, each on
// a goroutine of its own (resolve), so that a slow read holds up no other
// key's writes; a key whose last read failed waits out its backoff first.
// It never waits on NATS.
func (r *writerRun) resolveConflicts(ctx context.Context, p int) {
	w := r.w
	w.mu.Lock()
	now := time.Now()
	var recs []*writerRecord
	for _, rec := range w.recs {
		if rec.conflict && !rec.writing && !rec.resolving && !now.Before(rec.retryAt) && (p < 0 || rec.part == p) {
			rec.resolving = true
			recs = append(recs, rec)
		}
	}
	w.mu.Unlock()
	for _, rec := range recs {
		r.resolvers.Go(func() { r.resolve(ctx, rec) })
	}
}

// resolve reads a key whose last write failed its compare-and-set: it
// holds another revision than the one this writer last saw, a record or a
// delete marker. One written under a higher epoch, or under this writer's
// epoch by another monitor (two holders given one epoch, contract §10),
// means another writer took the partition over: this one stops writing it.
// Otherwise (our own write whose answer was lost, a record of an older
// epoch, a marker) the revision found is adopted and the write retried:
// after the key's backoff, or at once over a marker.
func (r *writerRun) resolve(ctx context.Context, rec *writerRecord) {
	w := r.w
	w.mu.Lock()
	kv, stream := w.kv, w.stream
	w.mu.Unlock()
	m, err := readLast(ctx, kv, stream, rec.key, w.cfg.WriteTimeout)
	lost := -1
	var lostEpoch uint64
	w.mu.Lock()
	now := time.Now()
	rec.resolving = false
	switch {
	case w.recs[rec.model] != rec:
		// Dropped meanwhile.
	case err != nil:
		w.elog.Fail(fmt.Errorf("read after a conflict: %w", err), "model", rec.model)
		rec.retryAt = now.Add(rec.bo.Next())
	case m == nil:
		rec.rev, rec.conflict = 0, false
		if rec.del {
			w.dropLocked(rec) // already gone
		} else {
			rec.retryAt = now.Add(rec.bo.Next())
		}
	default:
		rec.rev, rec.conflict = m.head.rev, false
		pt := w.parts[rec.part]
		switch {
		case pt.holds && w.outranks(&m.head, pt.epoch):
			lost, lostEpoch = rec.part, pt.epoch
		case m.head.deleted && rec.del:
			w.dropLocked(rec) // already gone
		case m.head.deleted:
			// Created over the marker, by compare-and-set on it.
		default:
			rec.retryAt = now.Add(rec.bo.Next())
		}
	}
	w.progressLocked()
	w.mu.Unlock()
	if lost >= 0 {
		r.lose(lost, lostEpoch)
	}
	w.signal()
}

// outranks reports whether a record or marker found in the bucket, h, was
// written by a writer that the one holding a partition under epoch must
// give way to: a higher epoch, or with leases the same epoch and another
// monitor id (two holders given one epoch: the second stops, contract §10).
func (w *Writer) outranks(h *keyHead, epoch uint64) bool {
	if !h.epochKnown {
		return false
	}
	return h.epoch > epoch || w.cfg.Leased && h.epoch == epoch && h.monitor != "" && h.monitor != w.cfg.MonitorID
}

// markChangedLocked notes that rec has something to write.
func (w *Writer) markChangedLocked(rec *writerRecord) {
	if !rec.changed {
		rec.changed = true
		w.changed++
		w.metrics.pending.Set(float64(w.changed))
	}
}

func (w *Writer) clearChangedLocked(rec *writerRecord) {
	if rec.changed {
		rec.changed = false
		w.changed--
		w.metrics.pending.Set(float64(w.changed))
	}
}

// dropLocked forgets a model's key.
func (w *Writer) dropLocked(rec *writerRecord) {
	w.clearChangedLocked(rec)
	if w.recs[rec.model] == rec {
		delete(w.recs, rec.model)
	}
}

// recordLocked returns a model's record state, creating it.
func (w *Writer) recordLocked(model string) *writerRecord {
	rec := w.recs[model]
	if rec == nil {
		rec = &writerRecord{model: model, key: events.ModelKey(model), part: events.Partition(model, len(w.parts)),
			bo: newKeyBackoff(w.cfg)}
		w.recs[model] = rec
	}
	return rec
}

// writerConflict tells a failed compare-and-set: a synchronous write's
// error, or the server's answer to an asynchronous put (wrong last
// sequence: 10071, or 10164 on a replicated stream).
func writerConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) &&
		(apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// newKeyBackoff is the backoff of one key's failed writes.
func newKeyBackoff(cfg WriterConfig) retry.Backoff {
	return retry.NewBackoff(cfg.RetryMin, cfg.RetryMax)
}
