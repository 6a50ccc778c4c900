package busylist

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// Registry keeps the worker registry (bucket workermon-workers, contract
// §7b) in memory: for every model, its registered workers and their
// endpoints.
//
// It shares the Watcher's watch loop (watchloop.go): same reconnect, re-watch
// and recreated-bucket handling, same lock-free immutable snapshots. An entry
// goes away when its key is deleted or purged, and when it was received more
// than the bucket's TTL ago (RegistryTTL when workermon created the bucket):
// without limit markers on the bucket a TTL expiry reaches no watcher, so the
// Registry expires entries on its own, by the router's clock. A worker that
// refreshes its entry (every RegistryRefresh) never expires.
//
// An entry whose JSON cannot be decoded, whose key is not
// <model_key>.<worker_id>, whose model or worker_id disagrees with its key or
// whose endpoint is empty is logged (rate-limited), counted in
// workermon_router_watch_bad_records_total and removed from the snapshot.
type Registry struct {
	state watchState[*registryModel]
	loop  *watchLoop

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

// NewRegistry starts watching the workers bucket through js, in the
// background like NewWatcher. It accepts the WatchOptions that are not
// Watcher-only (WithStaleListAfter and WithFailOpen are rejected).
func NewRegistry(js jetstream.JetStream, opts ...WatchOption) (*Registry, error) {
	if js == nil {
		return nil, fmt.Errorf("busylist: new registry: %w: nil JetStream", ErrInvalidOption)
	}
	o, err := watchApplyOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("busylist: new registry: %w", err)
	}
	if len(o.watcherOnly) > 0 {
		return nil, fmt.Errorf("busylist: new registry: %w: %s applies to a Watcher only",
			ErrInvalidOption, strings.Join(o.watcherOnly, ", "))
	}
	m, err := newWatchMetrics(o.reg)
	if err != nil {
		return nil, fmt.Errorf("busylist: new registry: %w", err)
	}
	r := &Registry{seen: make(map[string]registrySeen), owned: make(map[string]bool)}
	r.loop = newWatchLoop(o.loopConfig(js, events.WorkersBucket), r, m.forBucket(events.WorkersBucket))
	r.loop.start()
	return r, nil
}

// Ready reports whether the initial values have arrived.
func (r *Registry) Ready() bool { return r.state.cur.Load() != nil }

// WaitReady waits until the initial values have arrived, ctx is done
// (returning its error) or the Registry is closed (ErrWatcherClosed).
func (r *Registry) WaitReady(ctx context.Context) error { return r.loop.waitReady(ctx) }

// Close stops the watch and waits for its goroutine, like Watcher.Close. It
// is idempotent and always returns nil; the last snapshot stays readable.
func (r *Registry) Close() error {
	r.loop.close()
	return nil
}

// Endpoints returns the model's registered workers, sorted by worker id, or
// nil. The slice is shared with the snapshot: read only. It takes no lock and
// allocates nothing.
func (r *Registry) Endpoints(model string) []events.WorkerEntry {
	if m := r.state.load()[model]; m != nil {
		return m.workers
	}
	return nil
}

// Lookup returns a worker's entry.
func (r *Registry) Lookup(model string, worker uint64) (events.WorkerEntry, bool) {
	ws := r.Endpoints(model)
	i, ok := slices.BinarySearchFunc(ws, worker, registryCompareID)
	if !ok {
		return events.WorkerEntry{}, false
	}
	return ws[i], true
}

// Models returns the models with at least one registered worker, sorted.
func (r *Registry) Models() []string {
	return slices.Sorted(maps.Keys(r.state.load()))
}

// watchReset, watchApply, watchSweep and watchPublish make the Registry a
// watchSink and a watchSweeper; only the loop's goroutine calls them.

func (r *Registry) watchReset() {
	r.state.reset()
	clear(r.seen)
	clear(r.owned)
}

func (r *Registry) watchPublish() int {
	clear(r.owned)
	return r.state.publish()
}

func (r *Registry) watchApply(e jetstream.KeyValueEntry, now time.Time) error {
	key := e.Key()
	model, worker, err := registryParseKey(key)
	if err != nil {
		delete(r.seen, key)
		return &watchRecordError{reason: "bad_key", err: err}
	}
	if e.Operation() != jetstream.KeyValuePut {
		r.remove(key, model, worker)
		return nil
	}
	var ent events.WorkerEntry
	if err := json.Unmarshal(e.Value(), &ent); err != nil {
		r.remove(key, model, worker)
		return &watchRecordError{reason: "malformed", err: fmt.Errorf("busylist: registry entry %s: %w", key, err)}
	}
	switch {
	case ent.Model != model || ent.WorkerID != worker:
		r.remove(key, model, worker)
		return &watchRecordError{reason: "mismatch", err: fmt.Errorf(
			"busylist: registry entry %s is for model %q worker %d", key, ent.Model, ent.WorkerID)}
	case ent.Endpoint == "":
		r.remove(key, model, worker)
		return &watchRecordError{reason: "no_endpoint", err: fmt.Errorf("busylist: registry entry %s has no endpoint", key)}
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

// watchSweep drops the entries received more than ttl ago.
func (r *Registry) watchSweep(now time.Time, ttl time.Duration) {
	for key, s := range r.seen {
		if now.Sub(s.at) > ttl {
			r.remove(key, s.model, s.worker)
		}
	}
}

// edit returns the model's pending registryModel, a private copy the loop
// may change in place until the next publish.
func (r *Registry) edit(model string) *registryModel {
	m := r.state.edit()
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
func (r *Registry) remove(key, model string, worker uint64) {
	delete(r.seen, key)
	ws := r.state.view()[model]
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
		delete(r.state.edit(), model)
		delete(r.owned, model)
	}
}

func registryCompareID(e events.WorkerEntry, id uint64) int { return cmp.Compare(e.WorkerID, id) }

// registryParseKey splits a registry key, <model_key>.<worker_id>, accepting
// only the canonical forms.
func registryParseKey(key string) (model string, worker uint64, err error) {
	mk, id, ok := strings.Cut(key, ".")
	if !ok || strings.Contains(id, ".") {
		return "", 0, fmt.Errorf("busylist: registry key %q is not <model_key>.<worker_id>", key)
	}
	if model, err = events.ParseModelKey(mk); err != nil {
		return "", 0, fmt.Errorf("busylist: registry key %q: %w", key, err)
	}
	worker, err = strconv.ParseUint(id, 10, 64)
	if err != nil || strconv.FormatUint(worker, 10) != id {
		return "", 0, fmt.Errorf("busylist: registry key %q: worker id %q is not canonical decimal", key, id)
	}
	return model, worker, nil
}
