package busylist

import (
	"context"
	"errors"
	"fmt"
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
// write of the key when something was given meanwhile. A put of a key with a
// known revision is an asynchronous publish whose answer comes back on the
// connection's goroutine; a create, a delete, and every write where
// asynchronous puts are not used (a JetStream domain or API prefix, a
// mirrored bucket) waits on a goroutine of its own, bounded by WriteTimeout.

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
		op.set.Epoch = w.parts[rec.part].epoch
		op.set.Seq = w.seq
		if op.rev != 0 && w.pub != nil {
			op.msg = nats.NewMsg(w.putPre + rec.key)
			w.puts[op.msg] = op
		}
	}
	rec.writing, rec.hbDue, rec.pending = true, false, false
	w.inflight++
	return op
}

// startAll starts every write that is due and may start, of partition p
// (every partition when p is negative), and returns the earliest time a
// key's backoff ends (zero when none runs).
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
		} else if (rec.changed || rec.hbDue) && !rec.writing && rec.retryAt.After(now) &&
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

// wait does op and waits for its answer, bounded by WriteTimeout: a
// create, a delete, or a put where asynchronous puts are not used. The
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
			rec.rev = 0 // deleted; set again since: created again
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

// resolveConflicts reads the keys of partition p (every partition when p is
// negative) whose last write failed its compare-and-set: the key holds
// another revision than the one this writer last saw. A record with a
// higher epoch means another writer took the partition over; otherwise (our
// own write whose answer was lost, or a record deleted meanwhile) the
// revision found is adopted and the write retried after the key's backoff.
func (r *writerRun) resolveConflicts(ctx context.Context, p int) {
	w := r.w
	w.mu.Lock()
	var recs []*writerRecord
	for _, rec := range w.recs {
		if rec.conflict && !rec.writing && (p < 0 || rec.part == p) {
			recs = append(recs, rec)
		}
	}
	w.mu.Unlock()
	for _, rec := range recs {
		e, err := r.get(ctx, rec.key)
		lost := -1
		var lostEpoch uint64
		w.mu.Lock()
		now := time.Now()
		switch {
		case w.recs[rec.model] != rec:
			// Dropped meanwhile.
		case err != nil:
			w.elog.Fail(fmt.Errorf("read after a conflict: %w", err), "model", rec.model)
			rec.retryAt = now.Add(rec.bo.Next())
		case e == nil:
			rec.rev, rec.conflict = 0, false
			if rec.del {
				w.dropLocked(rec) // already gone
			} else {
				rec.retryAt = now.Add(rec.bo.Next())
			}
		default:
			rec.rev, rec.conflict = e.Revision(), false
			pt := w.parts[rec.part]
			if epoch, err := RecordEpoch(e.Value()); err == nil && pt.holds && epoch > pt.epoch {
				lost, lostEpoch = rec.part, pt.epoch
			} else {
				rec.retryAt = now.Add(rec.bo.Next())
			}
		}
		w.mu.Unlock()
		if lost >= 0 {
			r.lose(lost, lostEpoch)
		}
	}
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
