package busylist

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

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
		pub, err = jetstream.New(w.cfg.JetStream.Conn(), jetstream.WithPublishAsyncAckHandler(w.onAck),
			jetstream.WithPublishAsyncErrHandler(w.onErr), jetstream.WithPublishAsyncTimeout(w.cfg.WriteTimeout))
		if err != nil {
			w.log.Warn("busylist: writing without asynchronous puts", "err", err)
			pub = nil
		}
	}
	w.mu.Lock()
	w.kv, w.pub, w.putPre = r.kv, pub, "$KV."+w.cfg.Bucket+"."
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
// p < 0): their keys become orphans until set, and their highest epoch is
// returned.
func (r *writerRun) scan(ctx context.Context, p int) (n int, maxEpoch uint64, err error) {
	w := r.w
	sctx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	defer cancel()
	r.found = r.found[:0]
	err = kvbucket.ReadAll(sctx, r.kv, func(e jetstream.KeyValueEntry) {
		model, err := events.ParseModelKey(e.Key())
		if err != nil {
			w.log.Warn("busylist: ignoring a key that is not a model key", "key", e.Key(), "err", err)
			return
		}
		if p >= 0 && events.Partition(model, len(w.parts)) != p {
			return
		}
		if epoch, ok := r.epochOf(e); ok {
			maxEpoch = max(maxEpoch, epoch)
		}
		n++
		if set, err := events.DecodeBusySet(e.Value()); err == nil && set.Model == model {
			r.found = append(r.found, set)
		}
		w.mu.Lock()
		rec := w.recordLocked(model)
		rec.rev, rec.orphan = e.Revision(), !rec.has
		w.known[model] = struct{}{}
		w.mu.Unlock()
	})
	if err != nil {
		return 0, 0, fmt.Errorf("busylist: read bucket %s: %w", w.cfg.Bucket, err)
	}
	return n, maxEpoch, nil
}

// learn adds the models with a record in the bucket to the known ones.
func (r *writerRun) learn(ctx context.Context) (int, error) {
	w := r.w
	sctx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	defer cancel()
	n := 0
	err := kvbucket.ReadAll(sctx, r.kv, func(e jetstream.KeyValueEntry) {
		if model, err := events.ParseModelKey(e.Key()); err == nil {
			n++
			w.mu.Lock()
			w.known[model] = struct{}{}
			w.mu.Unlock()
		}
	})
	return n, err
}

// epochOf returns the epoch of a record found in the bucket. Only the epoch
// is decoded, leniently, so that a record this version cannot fully decode
// still counts.
func (r *writerRun) epochOf(e jetstream.KeyValueEntry) (uint64, bool) {
	epoch, err := RecordEpoch(e.Value())
	if err != nil {
		r.w.metrics.badRecords.Inc()
		r.w.log.Warn("busylist: cannot read the epoch of a record", "key", e.Key(), "err", err)
		return 0, false
	}
	return epoch, true
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
// the record as found again when the compare-and-set fails. From then on a
// late put of the old writer fails. A claim that finds a higher epoch gives
// the partition up. The partition is not written until its claims are done.
func (r *writerRun) acquire(ctx context.Context, p int, epoch uint64) {
	w := r.w
	if p < 0 || p >= len(w.parts) {
		return
	}
	if _, _, err := r.scan(ctx, p); err != nil {
		w.log.Warn("busylist: cannot read the partition's records; claiming them as they are met", "partition", p, "err", err)
	}
	claimed := r.found
	r.found = nil
	r.hold(p, epoch, true)
	w.mu.Lock()
	w.seq = max(w.seq, 1) // the claims write seq 1; later writes of the epoch follow
	w.mu.Unlock()
	// The claims are in flight together (writerMaxInFlight at most), all
	// within one WriteTimeout: this goroutine writes no other partition
	// meanwhile. A record not claimed by then is written after the warm-up.
	cctx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
	oks, errs := make([]bool, len(claimed)), make([]error, len(claimed))
	slots := make(chan struct{}, writerMaxInFlight)
	var wg sync.WaitGroup
	for i, set := range claimed {
		w.mu.Lock()
		rec := w.recordLocked(set.Model)
		w.mu.Unlock()
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if oks[i], errs[i] = r.claim(cctx, set, rec, epoch); !oks[i] {
				cancel() // a higher epoch: the partition is given up
			}
		})
	}
	wg.Wait()
	cancel()
	var kept []events.BusySet
	var failed int
	var failure error
	for i, set := range claimed {
		switch {
		case !oks[i]:
			r.lose(p, epoch)
			return
		case errs[i] != nil:
			w.metrics.errors.WithLabelValues(writerKindClaim).Inc()
			failed, failure = failed+1, cmp.Or(failure, fmt.Errorf("%s: %w", set.Model, errs[i]))
		}
		kept = append(kept, set)
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

// claim re-puts one record, whose state is rec, under the new epoch. It
// reports false when a record with a higher epoch was found. Claims of
// different records run together: it touches only rec. No other write of
// rec's key runs meanwhile: its partition is claiming.
func (r *writerRun) claim(ctx context.Context, set events.BusySet, rec *writerRecord, epoch uint64) (bool, error) {
	w := r.w
	setRev := func(rev uint64) {
		w.mu.Lock()
		rec.rev = rev
		w.mu.Unlock()
	}
	for range writerClaimAttempts {
		if set.Epoch > epoch {
			return false, nil // another writer's term is later than ours
		}
		out := set
		out.MonitorID, out.Epoch, out.Seq = w.cfg.MonitorID, epoch, 1
		data, err := events.MarshalBusySet(&out)
		if err != nil {
			return true, err
		}
		w.mu.Lock()
		last := rec.rev
		w.mu.Unlock()
		octx, cancel := context.WithTimeout(ctx, w.cfg.WriteTimeout)
		rev, err := r.kv.Update(octx, rec.key, data, last)
		cancel()
		if err == nil {
			setRev(rev)
			w.metrics.writes.WithLabelValues(writerKindClaim).Inc()
			return true, nil
		}
		if !writerConflict(err) {
			return true, err
		}
		// The record changed since it was read: claim it as it is now.
		e, err := r.get(ctx, rec.key)
		if err != nil {
			return true, err
		}
		if e == nil {
			setRev(0)
			return true, nil // deleted meanwhile: nothing to claim
		}
		setRev(e.Revision())
		if found, err := RecordEpoch(e.Value()); err == nil && found > epoch {
			return false, nil
		}
		if set, err = events.DecodeBusySet(e.Value()); err != nil {
			return true, err
		}
	}
	return true, errors.New("busylist: claim: the record kept changing")
}

// get reads a key; nil when it has no record.
func (r *writerRun) get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	octx, cancel := context.WithTimeout(ctx, r.w.cfg.WriteTimeout)
	defer cancel()
	e, err := r.kv.Get(octx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, nil
	}
	return e, err
}

// lose gives up partition p after finding a record with an epoch above
// ours.
func (r *writerRun) lose(p int, epoch uint64) {
	w := r.w
	w.log.Warn("busylist: found a record with a higher epoch; no longer writing the partition",
		"partition", p, "epoch", epoch)
	w.metrics.fenced.Inc()
	r.unhold(p, "higher epoch found")
	if w.cfg.OnLost != nil {
		w.cfg.OnLost(p)
	}
}
