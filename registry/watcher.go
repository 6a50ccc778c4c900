package registry

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvwatch"
)

// This file holds the router side: the Watcher of the workers bucket.

// Watcher keeps the worker registry (bucket workermon-workers, contract
// §7b) in memory: for every model, its registered workers and their
// endpoints.
//
// It runs on internal/kvwatch's loop, like busylist.Watcher: same reconnect, re-watch
// and recreated-bucket handling, same lock-free immutable snapshots. An entry
// goes away when its key is deleted or purged, and when it was received more
// than the bucket's TTL ago (TTL when workermon created the bucket):
// without limit markers on the bucket a TTL expiry reaches no watcher, so the
// Watcher expires entries on its own, by the router's clock. A worker that
// refreshes its entry (every Refresh) never expires. Expiry counts only the
// time the registry can be read (Live): while NATS is down or does not
// answer about the bucket, no entry expires, and when the watch is current
// again every entry has one more TTL to be refreshed in, so that an outage
// longer than the TTL does not leave the router without workers.
//
// An entry whose JSON cannot be decoded, whose key is not
// <model_key>.<worker_id>, whose model or worker_id disagrees with its key,
// whose endpoint is empty or whose rank range passes 2^32 (dp_start +
// dp_size, a dp_size of 0 read as 1; a range may end at 2^32) is logged
// (rate-limited), counted in workermon_router_watch_bad_records_total and
// removed from the snapshot.
type Watcher struct {
	state kvwatch.State[*registryModel]
	loop  *kvwatch.Loop

	// Owned by the loop's goroutine.
	seen  map[string]registrySeen // registry key → when its entry was received
	owned map[string]bool         // models whose pending registryModel is a fresh copy
}

// registryModel is one model's registered workers, sorted by worker id.
type registryModel struct {
	workers []events.WorkerEntry
}

type registrySeen struct {
	model  string
	worker uint64
	at     time.Time
}

// NewWatcher starts watching the workers bucket through js. It does not
// wait for the server: the bucket is opened (created when missing) and
// watched in the background, with retries. Use WaitReady to wait for the
// initial values.
func NewWatcher(js jetstream.JetStream, opts ...Option) (*Watcher, error) {
	if js == nil {
		return nil, fmt.Errorf("registry: new watcher: %w: nil JetStream", ErrInvalidOption)
	}
	o, err := applyOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("registry: new watcher: %w", err)
	}
	r := &Watcher{seen: make(map[string]registrySeen), owned: make(map[string]bool)}
	r.loop = kvwatch.New(o.loopConfig(js), (*watcherSink)(r), o.stats)
	r.loop.Start()
	return r, nil
}

// Ready reports whether the initial values have arrived.
func (r *Watcher) Ready() bool { return r.state.Load() != nil }

// Live reports whether the registry is being read: the watch's values are in
// and current, the NATS connection is up and the server answered the last
// question about the bucket. While it is not, the Watcher keeps the entries
// it has (none expires) and knows of no change. Lock-free.
func (r *Watcher) Live() bool { return r.loop.Live() }

// WaitReady waits until the initial values have arrived, ctx is done
// (returning its error) or the Watcher is closed (ErrWatcherClosed).
func (r *Watcher) WaitReady(ctx context.Context) error {
	if err := r.loop.WaitReady(ctx); err != nil {
		if errors.Is(err, kvwatch.ErrClosed) {
			return ErrWatcherClosed
		}
		return err
	}
	return nil
}

// Close stops the watch and waits for its goroutine, which ends within a few
// seconds at most (each server request has a timeout). It is idempotent and
// always returns nil; the last snapshot stays readable.
func (r *Watcher) Close() error {
	r.loop.Close()
	return nil
}

// Endpoints returns the model's registered workers, sorted by worker id, or
// nil. The slice is shared with the snapshot: read only. It takes no lock and
// allocates nothing.
func (r *Watcher) Endpoints(model string) []events.WorkerEntry {
	if m := r.state.Load()[model]; m != nil {
		return m.workers
	}
	return nil
}

// Lookup returns a worker's entry.
func (r *Watcher) Lookup(model string, worker uint64) (events.WorkerEntry, bool) {
	ws := r.Endpoints(model)
	i, ok := slices.BinarySearchFunc(ws, worker, registryCompareID)
	if !ok {
		return events.WorkerEntry{}, false
	}
	return ws[i], true
}

// Models returns the models with at least one registered worker, sorted.
func (r *Watcher) Models() []string {
	return slices.Sorted(maps.Keys(r.state.Load()))
}

// watcherSink is the Watcher as its loop sees it: a kvwatch.Sink and
// Sweeper. Only the loop's goroutine calls its methods.
type watcherSink Watcher

var (
	_ kvwatch.Sink    = (*watcherSink)(nil)
	_ kvwatch.Sweeper = (*watcherSink)(nil)
)

func (r *watcherSink) Reset() {
	r.state.Reset()
	clear(r.seen)
	clear(r.owned)
}

func (r *watcherSink) Publish() int {
	clear(r.owned)
	return r.state.Publish()
}

func (r *watcherSink) Apply(e jetstream.KeyValueEntry, now time.Time) error {
	key := e.Key()
	model, worker, err := events.ParseWorkerKey(key)
	if err != nil {
		delete(r.seen, key)
		return &kvwatch.RecordError{Reason: "bad_key", Err: err}
	}
	if e.Operation() != jetstream.KeyValuePut {
		r.remove(key, model, worker)
		return nil
	}
	var ent events.WorkerEntry
	if err := json.Unmarshal(e.Value(), &ent); err != nil {
		r.remove(key, model, worker)
		return &kvwatch.RecordError{Reason: "malformed", Err: fmt.Errorf("registry: entry %s: %w", key, err)}
	}
	switch {
	case ent.Model != model || ent.WorkerID != worker:
		r.remove(key, model, worker)
		return &kvwatch.RecordError{Reason: "mismatch", Err: fmt.Errorf(
			"registry: entry %s is for model %q worker %d", key, ent.Model, ent.WorkerID)}
	case ent.Endpoint == "":
		r.remove(key, model, worker)
		return &kvwatch.RecordError{Reason: "no_endpoint", Err: fmt.Errorf("registry: entry %s has no endpoint", key)}
	case uint64(ent.DPStart)+uint64(max(ent.DPSize, 1)) > math.MaxUint32+1:
		// A range may end at 2^32 (rank 4294967295 is legal), never past it
		// (contract §3); dp_size 0 is read as 1.
		r.remove(key, model, worker)
		return &kvwatch.RecordError{Reason: "bad_range", Err: fmt.Errorf(
			"registry: entry %s: dp_start %d + dp_size %d passes 2^32", key, ent.DPStart, ent.DPSize)}
	}
	ws := r.edit(model)
	i, found := slices.BinarySearchFunc(ws.workers, worker, registryCompareID)
	if found {
		ws.workers[i] = ent
	} else {
		ws.workers = slices.Insert(ws.workers, i, ent)
	}
	r.seen[key] = registrySeen{model: model, worker: worker, at: now}
	return nil
}

// Sweep drops the entries received more than ttl ago.
func (r *watcherSink) Sweep(now time.Time, ttl time.Duration) {
	for key, s := range r.seen {
		if now.Sub(s.at) > ttl {
			r.remove(key, s.model, s.worker)
		}
	}
}

// edit returns the model's pending registryModel, a private copy the loop
// may change in place until the next publish.
func (r *watcherSink) edit(model string) *registryModel {
	m := r.state.Edit()
	ws := m[model]
	if r.owned[model] && ws != nil {
		return ws
	}
	next := &registryModel{}
	if ws != nil {
		next.workers = slices.Clone(ws.workers)
	}
	m[model] = next
	r.owned[model] = true
	return next
}

// remove drops a worker's entry, and the model when it was its last worker.
func (r *watcherSink) remove(key, model string, worker uint64) {
	delete(r.seen, key)
	ws := r.state.View()[model]
	if ws == nil {
		return
	}
	if _, found := slices.BinarySearchFunc(ws.workers, worker, registryCompareID); !found {
		return
	}
	ws = r.edit(model)
	i, _ := slices.BinarySearchFunc(ws.workers, worker, registryCompareID)
	ws.workers = slices.Delete(ws.workers, i, i+1)
	if len(ws.workers) == 0 {
		delete(r.state.Edit(), model)
		delete(r.owned, model)
	}
}

func registryCompareID(e events.WorkerEntry, id uint64) int { return cmp.Compare(e.WorkerID, id) }
