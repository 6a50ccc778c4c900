package busylist

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/retry"
)

// What the Writer's Run does with the bucket itself: opening it, reading
// the records in it, claiming a partition's records and giving a partition
// up.

// open opens the bucket and, without Leased, reads the records in it and
// takes every partition, retrying until it succeeds or ctx is done.
func (r *writerRun) open(ctx context.Context) error {
	w := r.w
	for {
		kv, err := writerOpenBucket(ctx, w.cfg.JetStream, w.cfg.Bucket, w.cfg.Replicas, w.cfg.WriteTimeout,
			&r.bo, r.elog, func(error) { w.metrics.errors.WithLabelValues(writerKindOpen).Inc() })
		if err != nil {
			return err
		}
		r.kv = kv
		if w.cfg.Leased {
			// The models with a record are known (Models) on a standby too;
			// the records themselves are read when a partition is taken.
			n, err := r.learn(ctx)
			if err != nil {
				w.log.Warn("busylist: cannot list the records in the bucket", "err", err)
			}
			r.bo.Reset()
			r.opened(ctx)
			w.log.Info("busylist: writer started, waiting for partitions", "monitor_id", w.cfg.MonitorID,
				"partitions", len(w.parts), "records", n, "asynchronous_puts", w.pub != nil)
			return nil
		}
		n, maxEpoch, err := r.scan(ctx, -1)
		if err == nil {
			epoch := maxEpoch + 1
			r.bo.Reset()
			r.elog.OK()
			for p := range w.parts {
				r.hold(p, epoch, false)
			}
			r.opened(ctx)
			w.log.Info("busylist: writer started", "epoch", epoch, "records", n,
				"monitor_id", w.cfg.MonitorID, "warmup", w.cfg.Warmup, "asynchronous_puts", w.pub != nil)
			r.existing()
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		w.metrics.errors.WithLabelValues(writerKindOpen).Inc()
		r.elog.Fail(err)
		if !retry.Sleep(ctx, r.bo.Next()) {
			return ctx.Err()
		}
	}
}

// opened lets writes start on the open bucket, with asynchronous puts
// where they write what the KV API's Update would: a bucket of the
// connection's own JetStream (no domain, no API prefix) that is not a
// mirror.
func (r *writerRun) opened(ctx context.Context) {
	w := r.w
	var pub jetstream.JetStream
	if opts := w.cfg.JetStream.Options(); opts.APIPrefix == "" && opts.Domain == "" && !r.mirror(ctx) {
		var err error
		// At most one put of a key is in flight, so the puts pending are
		// bounded by the keys; past the library's default of 4000 a publish
		// would stall its caller (Set, on the monitor's loop) for up to
		// 200 ms, and Set must never block.
		pub, err = jetstream.New(w.cfg.JetStream.Conn(), jetstream.WithPublishAsyncAckHandler(w.onAck),
			jetstream.WithPublishAsyncErrHandler(w.onErr), jetstream.WithPublishAsyncTimeout(w.cfg.WriteTimeout),
			jetstream.WithPublishAsyncMaxPending(math.MaxInt32))
		if err != nil {
			w.log.Warn("busylist: writing without asynchronous puts", "err", err)
			pub = nil
		}
	}
	stream, err := bucketStream(ctx, w.cfg.JetStream, r.kv, w.cfg.WriteTimeout)
	if err != nil {
		// Markers are then read through the KV API, as absent.
		w.log.Warn("busylist: cannot open the bucket's stream; writing through the KV API", "err", err)
	}
	if stream == nil {
		pub = nil // the markers' epochs could not be read back
	}
	w.mu.Lock()
	w.kv, w.pub, w.putPre, w.stream = r.kv, pub, "$KV."+w.cfg.Bucket+".", stream
	w.mu.Unlock()
}

// mirror reports whether the bucket is a mirror (or cannot be told): its
// puts then go elsewhere, which only the KV API knows.
func (r *writerRun) mirror(ctx context.Context) bool {
	sctx, cancel := context.WithTimeout(ctx, r.w.cfg.WriteTimeout)
	defer cancel()
	st, err := r.kv.Status(sctx)
	if err != nil {
		return true
	}
	s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo })
	return !ok || s.StreamInfo() == nil || s.StreamInfo().Config.Mirror != nil
}

// hold starts holding partition p under epoch: writes begin after the
// warm-up (and, when claiming, once its records are claimed), orphans go
// after OrphanAfter.
func (r *writerRun) hold(p int, epoch uint64, claiming bool) {
	w := r.w
	now := time.Now()
	w.mu.Lock()
	w.parts[p] = writerPart{holds: true, claiming: claiming, epoch: epoch, warmUntil: now.Add(w.cfg.Warmup),
		orphansAt: now.Add(w.cfg.OrphanAfter)}
	w.mu.Unlock()
	if epoch > w.epoch.Load() {
		w.epoch.Store(epoch)
		w.metrics.epoch.Set(float64(epoch))
	}
}

// unhold stops writing partition p; its records' pending changes stay, to
// be written if it is held again. Writes in flight complete.
func (r *writerRun) unhold(p int, why string) {
	w := r.w
	w.mu.Lock()
	defer w.mu.Unlock()
	w.unholdLocked(p, why)
}

func (w *Writer) unholdLocked(p int, why string) {
	if p < 0 || p >= len(w.parts) || !w.parts[p].holds {
		return
	}
	w.parts[p] = writerPart{}
	for _, rec := range w.recs {
		if rec.part == p {
			rec.orphan, rec.hbDue = false, false
		}
	}
	w.log.Info("busylist: stopped writing a partition", "partition", p, "why", why)
}

// existing hands the records found to OnExisting.
func (r *writerRun) existing() {
	if r.w.cfg.OnExisting != nil && len(r.found) > 0 {
		r.w.cfg.OnExisting(r.found)
	}
	r.found = nil
}

// writerOpenBucket opens (creating if needed) a bucket, retrying with
// backoff and rate-limited error logs until it succeeds or ctx is done. Each
// attempt is bounded by timeout. It returns ctx's error when ctx ends first.
func writerOpenBucket(ctx context.Context, js jetstream.JetStream, bucket string, replicas int,
	timeout time.Duration, bo *retry.Backoff, elog *retry.ErrLog, onErr func(error),
) (jetstream.KeyValue, error) {
	for {
		octx, cancel := context.WithTimeout(ctx, timeout)
		kv, err := kvbucket.Open(octx, js, bucket, replicas)
		cancel()
		if err == nil {
			elog.OK()
			return kv, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if onErr != nil {
			onErr(err)
		}
		elog.Fail(err, "bucket", bucket)
		if !retry.Sleep(ctx, bo.Next()) {
			return nil, ctx.Err()
		}
	}
}

// scan reads the records in the bucket of partition p (every partition when
// p < 0): their keys become orphans until set, and the highest epoch among
// them and the delete markers (a later create must not find a marker of a
// higher epoch) is returned. Each batch of the read, not the whole, is
// bounded by WriteTimeout.
func (r *writerRun) scan(ctx context.Context, p int) (n int, maxEpoch uint64, err error) {
	w := r.w
	r.found = r.found[:0]
	heads, err := scanRecords(ctx, w.cfg.JetStream, r.kv, len(w.parts), func(q int) bool { return p < 0 || q == p },
		w.cfg.WriteTimeout)
	if err != nil {
		return 0, 0, fmt.Errorf("busylist: read bucket %s: %w", w.cfg.Bucket, err)
	}
	for _, h := range heads {
		if h.epochKnown {
			maxEpoch = max(maxEpoch, h.epoch)
		}
		if h.deleted {
			continue
		}
		if !h.epochKnown {
			w.metrics.badRecords.Inc()
			w.log.Warn("busylist: cannot read the epoch of a record", "key", h.key)
		}
		n++
		if set, err := events.DecodeBusySet(h.data); err == nil && set.Model == h.model {
			r.found = append(r.found, set)
		}
		w.mu.Lock()
		rec := w.recordLocked(h.model)
		rec.rev, rec.orphan = h.rev, !rec.has
		w.known[h.model] = struct{}{}
		w.mu.Unlock()
	}
	return n, maxEpoch, nil
}

// learn adds the models with a record in the bucket to the known ones. It
// lists the bucket's headers only.
func (r *writerRun) learn(ctx context.Context) (int, error) {
	w := r.w
	heads, err := scanHeads(ctx, w.cfg.JetStream, r.kv, len(w.parts), nil, w.cfg.WriteTimeout)
	n := 0
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, h := range heads {
		if !h.deleted {
			n++
			w.known[h.model] = struct{}{}
		}
	}
	return n, err
}

// RecordEpoch decodes only the epoch of a busy-set record, leniently, so
// that a record this version cannot fully decode still counts.
func RecordEpoch(data []byte) (uint64, error) {
	var rec struct {
		Epoch uint64 `msgpack:"epoch"`
	}
	if err := msgpack.Unmarshal(data, &rec); err != nil {
		return 0, fmt.Errorf("busylist: read epoch: %w", err)
	}
	return rec.Epoch, nil
}

// acquire claims partition p under epoch (contract §10, takeover): every
// record of the partition is re-put as found, with this writer's monitor_id,
// the new epoch, seq 1 and updated_at kept, by compare-and-set, retried with
// the record as found again when the compare-and-set fails. A record that
// does not decode is re-put as it is, and a delete marker is put again,
// both under this writer's epoch (headers mode). From then on a late write
// of the old writer, put, delete or create, fails. A record or marker of an
// epoch not below the claim's (a higher epoch: a later holder; the same:
// the epoch given was read before another holder used it) gives the
// partition up. The partition is not written until its claims are done.
//
// Only the headers of the bucket are listed, and the values of the
// partition's records read: the work is the partition's, not the bucket's.
func (r *writerRun) acquire(ctx context.Context, p int, epoch uint64) {
	w := r.w
	if p < 0 || p >= len(w.parts) {
		return
	}
	scan := scanHeads
	if len(w.parts) <= scanRecordsUpTo {
		scan = scanRecords
	}
	heads, err := scan(ctx, w.cfg.JetStream, r.kv, len(w.parts), func(q int) bool { return q == p }, w.cfg.WriteTimeout)
	if err != nil {
		w.log.Warn("busylist: cannot list the partition's records; claiming them as they are met", "partition", p, "err", err)
	}
	for i := range heads {
		if h := &heads[i]; h.epochKnown && h.epoch >= epoch {
			w.log.Warn("busylist: the partition has a record of an epoch not below the lease's", "partition", p,
				"model", h.model, "found", h.epoch, "by", h.monitor)
			r.lose(p, epoch)
			return
		}
	}
	r.hold(p, epoch, true)
	w.mu.Lock()
	w.seq = max(w.seq, 1) // the claims write seq 1; later writes of the epoch follow
	kv, stream, headers := w.kv, w.stream, w.pub != nil
	w.mu.Unlock()
	// The claims are in flight together (writerMaxInFlight at most), all
	// within one WriteTimeout: this goroutine writes no other partition
	// meanwhile. A record not claimed by then is written after the warm-up.
	cctx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	var mu sync.Mutex
	var kept []events.BusySet
	var failed int
	var failure error
	higher := false
	fetchEach(cctx, kv, stream, heads, func(h *keyHead) bool { return !h.deleted || headers }, w.cfg.WriteTimeout,
		func(h *keyHead, m *rawRecord, err error) {
			var set *events.BusySet
			ok := true
			if err == nil {
				set, ok, err = r.claim(cctx, h, m, epoch)
			}
			mu.Lock()
			defer mu.Unlock()
			switch {
			case !ok:
				higher = true
				cancel() // the partition is given up
			case err != nil:
				w.metrics.errors.WithLabelValues(writerKindClaim).Inc()
				failed, failure = failed+1, cmp.Or(failure, fmt.Errorf("%s: %w", h.model, err))
			case set != nil:
				kept = append(kept, *set)
			}
		})
	cancel()
	if higher {
		r.lose(p, epoch)
		return
	}
	if failed > 0 {
		w.log.Warn("busylist: cannot claim records; they are written after the warm-up", "partition", p,
			"records", failed, "err", failure)
	}
	w.mu.Lock()
	w.parts[p].claiming = false
	w.mu.Unlock()
	w.log.Info("busylist: partition claimed", "partition", p, "epoch", epoch, "records", len(kept), "warmup", w.cfg.Warmup)
	r.found = kept
	r.existing()
}

// claim re-puts under epoch the last message of one key of the partition,
// m (nil: read it), listed as h: a record as found, with this writer's
// monitor_id, seq 1 and updated_at kept (one that does not decode as it
// is), a marker as a marker. It returns the record claimed (nil for a
// marker, or a record that does not decode), and false when a record or
// marker of a higher epoch, or of this epoch by another monitor, was found.
// Claims of different keys run together: it touches only its key's state.
// No other write of the key runs meanwhile: its partition is claiming.
func (r *writerRun) claim(ctx context.Context, h *keyHead, m *rawRecord, epoch uint64) (*events.BusySet, bool, error) {
	w := r.w
	w.mu.Lock()
	kv, stream, headers := w.kv, w.stream, w.pub != nil
	w.mu.Unlock()
	for attempt := range writerClaimAttempts {
		if m == nil && (attempt > 0 || !h.deleted) {
			var err error
			if m, err = readLast(ctx, kv, stream, h.key, w.cfg.WriteTimeout); err != nil {
				return nil, true, err
			}
			if m == nil {
				return nil, true, nil // purged meanwhile: nothing to claim
			}
		} else if m == nil {
			m = &rawRecord{head: *h}
		}
		if w.outranks(&m.head, epoch) || m.head.epochKnown && m.head.epoch > epoch {
			return nil, false, nil // another writer's term is later than ours
		}
		if m.head.deleted && !headers {
			return nil, true, nil // a marker written through the KV API carries no epoch
		}
		var set *events.BusySet
		data := m.data // a record that does not decode is claimed as it is
		if !m.head.deleted {
			if s, err := events.DecodeBusySet(m.data); err == nil && s.Model == h.model {
				s.MonitorID, s.Epoch, s.Seq = w.cfg.MonitorID, epoch, 1
				// The routers' queues are written only from reports this
				// writer received itself (contract §22).
				s.QueuedBy, s.Queued = nil, nil
				if data, err = events.MarshalBusySet(&s); err != nil {
					return nil, true, err
				}
				set = &s
			} else {
				w.metrics.badRecords.Inc()
				w.log.Warn("busylist: claiming a record that does not decode as it is", "model", h.model, "err", err)
			}
		}
		rev, err := r.put(ctx, h.key, data, m.head.deleted, epoch, m.head.rev)
		if err == nil {
			w.mu.Lock()
			if m.head.deleted {
				if rec := w.recs[h.model]; rec != nil {
					rec.rev = rev // a create goes over the claimed marker
				}
			} else {
				rec := w.recordLocked(h.model)
				rec.rev, rec.orphan = rev, !rec.has
				w.known[h.model] = struct{}{}
			}
			w.mu.Unlock()
			w.metrics.writes.WithLabelValues(writerKindClaim).Inc()
			return set, true, nil
		}
		if !writerConflict(err) {
			return nil, true, err
		}
		m = nil // changed since it was read: claim it as it is now
	}
	return nil, true, errors.New("busylist: claim: the record kept changing")
}

// put writes a record (or with del a delete marker) of key under epoch by
// compare-and-set on rev, and waits for the answer: in headers mode a
// publish with the writer's headers, else through the KV API (no marker
// then).
func (r *writerRun) put(ctx context.Context, key string, data []byte, del bool, epoch, rev uint64) (uint64, error) {
	w := r.w
	octx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	defer cancel()
	w.mu.Lock()
	pub := w.pub
	var msg *nats.Msg
	if pub != nil {
		msg = w.recordMsg(key, epoch, del)
	}
	w.mu.Unlock()
	if pub == nil {
		return r.kv.Update(octx, key, data, rev)
	}
	msg.Data = data
	ack, err := pub.PublishMsg(octx, msg, jetstream.WithExpectLastSequencePerSubject(rev))
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// lose gives up partition p, held (or about to be) under epoch, after
// finding a record with an epoch above it. It may run on a conflict's
// goroutine: a partition held since under another epoch is left alone.
func (r *writerRun) lose(p int, epoch uint64) {
	w := r.w
	w.mu.Lock()
	if pt := w.parts[p]; pt.holds && pt.epoch != epoch {
		w.mu.Unlock()
		return // taken again since, under another epoch
	}
	w.unholdLocked(p, "higher epoch found")
	w.mu.Unlock()
	w.log.Warn("busylist: found a record with a higher epoch; no longer writing the partition",
		"partition", p, "epoch", epoch)
	w.metrics.fenced.Inc()
	if w.cfg.OnLost != nil {
		w.cfg.OnLost(p)
	}
}
