package busylist

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/kvwatch"
	"github.com/workermon/workermon/internal/watchmetrics"
)

// This file holds the router side's Watcher of the busy bucket and its
// options. The watch loop is internal/kvwatch's; the decision it answers is
// package admission's.

// Defaults of the watch options.
const (
	// DefaultStaleListAfter is how long a busy-set record stays fresh for the
	// router: a record with no put received within this time, or with an
	// updated_at older than this by the router's clock, is stale (contract §7,
	// --stale-list-after).
	DefaultStaleListAfter = 10 * time.Second
	// DefaultProbeInterval is how often a watcher asks the server about its
	// bucket, to notice a deleted or recreated bucket and a stalled watcher.
	DefaultProbeInterval = 5 * time.Second
	// DefaultFailOpen is whether a Watcher admits requests when it cannot
	// trust its list (stale record, initial values not loaded yet).
	DefaultFailOpen = true
)

const (
	// watchBackoffMin is the first delay before re-watching after a failure.
	watchBackoffMin = 50 * time.Millisecond
	// watchBackoffMax caps the delay between re-watch attempts.
	watchBackoffMax = 5 * time.Second
	// watchOpTimeout bounds every single request to the server: opening the
	// bucket and each probe.
	watchOpTimeout = 5 * time.Second
)

// WatchOption configures a Watcher.
type WatchOption func(*watchOptions) error

type watchOptions struct {
	log        *slog.Logger
	reg        prometheus.Registerer
	now        func() time.Time
	ownClock   bool // WithClock was given: staleness is judged by it per call
	staleAfter time.Duration
	failOpen   bool
	probeEvery time.Duration
	replicas   int
}

func watchApplyOptions(opts []WatchOption) (watchOptions, error) {
	o := watchOptions{
		log:        slog.New(slog.DiscardHandler),
		now:        time.Now,
		staleAfter: DefaultStaleListAfter,
		failOpen:   DefaultFailOpen,
		probeEvery: DefaultProbeInterval,
		replicas:   1,
	}
	var errs []error
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&o); err != nil {
			errs = append(errs, err)
		}
	}
	return o, errors.Join(errs...)
}

// loopConfig is the configuration of the watch loop of a bucket.
func (o *watchOptions) loopConfig(js jetstream.JetStream, bucket string) kvwatch.Config {
	return kvwatch.Config{
		JS:         js,
		Bucket:     bucket,
		Replicas:   o.replicas,
		Log:        o.log,
		ErrLevel:   slog.LevelWarn,
		Now:        o.now,
		OpTimeout:  watchOpTimeout,
		ProbeEvery: o.probeEvery,
		RetryMin:   watchBackoffMin,
		RetryMax:   watchBackoffMax,
	}
}

// WithLogger sets the logger (default: discard).
func WithLogger(l *slog.Logger) WatchOption {
	return func(o *watchOptions) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = l
		return nil
	}
}

// WithRegisterer registers the metrics on reg (default: not registered).
// Collectors already registered there (by another Watcher or a
// registry.Watcher) are shared.
func WithRegisterer(reg prometheus.Registerer) WatchOption {
	return func(o *watchOptions) error {
		o.reg = reg
		return nil
	}
}

// WithClock sets the clock (default time.Now) used for receive times and for
// staleness.
func WithClock(now func() time.Time) WatchOption {
	return func(o *watchOptions) error {
		if now == nil {
			return fmt.Errorf("%w: nil clock", ErrInvalidOption)
		}
		o.now, o.ownClock = now, true
		return nil
	}
}

// WithStaleListAfter sets how long a record stays fresh (default
// DefaultStaleListAfter).Watcher only.
func WithStaleListAfter(d time.Duration) WatchOption {
	return func(o *watchOptions) error {
		if d <= 0 {
			return fmt.Errorf("%w: stale-list-after %v is not positive", ErrInvalidOption, d)
		}
		o.staleAfter = d
		return nil
	}
}

// WithFailOpen sets whether requests are admitted when the list cannot be
// trusted: a stale record, or no initial values yet (default true).
func WithFailOpen(open bool) WatchOption {
	return func(o *watchOptions) error {
		o.failOpen = open
		return nil
	}
}

// WithProbeInterval sets how often the bucket is probed for deletion,
// recreation and a stalled watcher (default DefaultProbeInterval).
func WithProbeInterval(d time.Duration) WatchOption {
	return func(o *watchOptions) error {
		if d <= 0 {
			return fmt.Errorf("%w: probe interval %v is not positive", ErrInvalidOption, d)
		}
		o.probeEvery = d
		return nil
	}
}

// WithBucketReplicas sets the replica count the bucket is created with when
// the watcher finds it missing (default 1). An existing bucket is left alone.
func WithBucketReplicas(n int) WatchOption {
	return func(o *watchOptions) error {
		if n < 1 || n > kvbucket.MaxReplicas {
			return fmt.Errorf("%w: replicas %d not in [1, %d]", ErrInvalidOption, n, kvbucket.MaxReplicas)
		}
		o.replicas = n
		return nil
	}
}

// Watcher keeps the busy sets of every model (bucket workermon-busy) in
// memory and answers admission decisions from them (see Decide).
//
// It owns one goroutine, started by NewWatcher and stopped by Close. Readers
// (Decide, Record, Ready) take no lock: they load an immutable snapshot,
// replaced as a whole on every change. Until the bucket's initial values have
// arrived there is no snapshot (Ready is false).
//
// A record that cannot be decoded, whose model does not match its key, or
// whose all_busy disagrees with its lists, is logged (rate-limited), counted
// in workermon_router_watch_bad_records_total, and removes the model from the
// snapshot, as a delete or a purge of the key does.
type Watcher struct {
	state  kvwatch.State[*busyEntry]
	policy admission.Policy
	now    func() time.Time
	// timed: records are marked stale by a timer, so Decide reads no clock
	// (a clock read costs 50-60 ns on some virtual machines, more than the
	// rest of Decide). Off with WithClock, whose clock Decide then reads.
	timed bool
	loop  *kvwatch.Loop
	// replaced is the published map a full re-watch (Reset) is replacing:
	// its entries' timers stop when the new map is published, not before,
	// since routers read it until then. The loop's goroutine only.
	replaced map[string]*busyEntry
	// queuedRecords is the number of records in the loop's view that list
	// a router's queue (contract §22); anyQueued says whether the
	// published map has any, so that a router's look at the queues costs
	// one atomic load while no record lists one (queued.go).
	queuedRecords int
	anyQueued     atomic.Bool
}

// busyEntry is one model's record as the router keeps it.
type busyEntry struct {
	rec events.BusySet
	// classes are rec's candidate lists by priority class (contract §15),
	// computed once here so that a decision allocates nothing.
	classes admission.ClassLists
	// queued are rec's routers' queues (contract §22), by source, computed
	// once here so that a router's look at them allocates nothing
	// (queued.go).
	queued []RouterQueued
	// received is the router's clock when the put was received.
	received time.Time
	// stale is set by timer when the record turns stale (timed Watchers).
	stale atomic.Bool
	timer *time.Timer
}

// newEntry returns the entry of a record received at received; a timed
// Watcher arms its staleness timer.
func (w *Watcher) newEntry(rec events.BusySet, received time.Time) *busyEntry {
	e := &busyEntry{rec: rec, received: received}
	e.classes = admission.PrepareClasses(&e.rec)
	e.queued = routerQueuedOf(&e.rec)
	if w.timed {
		if wait := time.Until(w.policy.StaleAt(&e.rec, received)); wait <= 0 {
			e.stale.Store(true)
		} else {
			e.timer = time.AfterFunc(wait, func() { e.stale.Store(true) })
		}
	}
	return e
}

// stop stops the entry's timer, if any; nil-safe.
func (e *busyEntry) stop() {
	if e != nil && e.timer != nil {
		e.timer.Stop()
	}
}

// NewWatcher starts watching the busy bucket through js. It does not wait
// for the server: the bucket is opened (created when missing) and watched in
// the background, with retries. Use WaitReady to wait for the initial values.
func NewWatcher(js jetstream.JetStream, opts ...WatchOption) (*Watcher, error) {
	if js == nil {
		return nil, fmt.Errorf("busylist: new watcher: %w: nil JetStream", ErrInvalidOption)
	}
	o, err := watchApplyOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("busylist: new watcher: %w", err)
	}
	m, err := watchmetrics.New(o.reg)
	if err != nil {
		return nil, fmt.Errorf("busylist: new watcher: %w", err)
	}
	w := &Watcher{policy: admission.Policy{StaleAfter: o.staleAfter, FailOpen: o.failOpen}, now: o.now, timed: !o.ownClock}
	w.loop = kvwatch.New(o.loopConfig(js, events.BusyBucket), (*watcherSink)(w), m.Bucket(events.BusyBucket))
	w.loop.Start()
	return w, nil
}

// Ready reports whether the initial values have arrived.
func (w *Watcher) Ready() bool { return w.state.Load() != nil }

// WaitReady waits until the initial values have arrived, ctx is done
// (returning its error) or the Watcher is closed (ErrWatcherClosed).
func (w *Watcher) WaitReady(ctx context.Context) error {
	if err := w.loop.WaitReady(ctx); err != nil {
		if errors.Is(err, kvwatch.ErrClosed) {
			return ErrWatcherClosed
		}
		return err
	}
	return nil
}

// Close stops the watch and waits for its goroutine, which ends within a few
// seconds at most (each server request has a timeout). It is idempotent and
// always returns nil. The last snapshot stays readable: Decide keeps
// answering from it (records turn stale as time passes).
func (w *Watcher) Close() error {
	w.loop.Close()
	// The loop has returned: stop every staleness timer.
	for _, m := range []map[string]*busyEntry{w.state.Load(), w.state.View(), w.replaced} {
		for _, e := range m {
			e.stop()
		}
	}
	return nil
}

// Record returns a model's last record, when the router has one, and the
// router's clock when it was received. The record's slices and map are
// shared: do not modify them.
func (w *Watcher) Record(model string) (rec events.BusySet, received time.Time, ok bool) {
	e := w.state.Load()[model]
	if e == nil {
		return events.BusySet{}, time.Time{}, false
	}
	return e.rec, e.received, true
}

// Routers returns the routers field of a model's record (contract §17):
// the number of routers sharing its workers; 0 without a record. Lock-free.
func (w *Watcher) Routers(model string) uint64 {
	if e := w.state.Load()[model]; e != nil {
		return e.rec.Routers
	}
	return 0
}

// Models returns the models that have a record, sorted.
func (w *Watcher) Models() []string {
	return slices.Sorted(maps.Keys(w.state.Load()))
}

// watcherSink is the Watcher as its loop sees it: a kvwatch.Sink and
// Sweeper. Only the loop's goroutine calls its methods.
type watcherSink Watcher

var (
	_ kvwatch.Sink    = (*watcherSink)(nil)
	_ kvwatch.Sweeper = (*watcherSink)(nil)
)

// Reset starts a full re-watch. The entries of a pending map that was
// never published are dropped now (their timers stopped); those of the
// published map when it is replaced (Publish).
func (w *watcherSink) Reset() {
	pub := w.state.Load()
	for model, e := range w.state.View() {
		if pub[model] != e {
			e.stop()
		}
	}
	if w.replaced == nil {
		w.replaced = pub
	}
	w.state.Reset()
	w.queuedRecords = 0
}

// Publish makes the pending changes the routers' snapshot; after a full
// re-watch it stops the timers of the entries it replaced.
func (w *watcherSink) Publish() int {
	n := w.state.Publish()
	w.anyQueued.Store(w.queuedRecords > 0)
	if w.replaced != nil {
		cur := w.state.Load()
		for model, e := range w.replaced {
			if cur[model] != e {
				e.stop()
			}
		}
		w.replaced = nil
	}
	return n
}

func (w *watcherSink) Apply(e jetstream.KeyValueEntry, now time.Time) error {
	model, err := events.ParseModelKey(e.Key())
	if err != nil {
		return &kvwatch.RecordError{Reason: "bad_key", Err: err}
	}
	if e.Operation() != jetstream.KeyValuePut {
		w.remove(model)
		return nil
	}
	rec, err := events.DecodeBusySet(e.Value())
	if err == nil {
		err = watchCheckBusySet(model, &rec)
	}
	if err != nil {
		w.remove(model)
		if re, ok := errors.AsType[*kvwatch.RecordError](err); ok {
			return re
		}
		return &kvwatch.RecordError{Reason: events.Reason(err), Err: err}
	}
	old := w.state.View()[model]
	old.stop()
	entry := (*Watcher)(w).newEntry(rec, now)
	w.queuedRecords += entry.listsQueues() - old.listsQueues()
	w.state.Edit()[model] = entry
	return nil
}

// remove drops a model's record and stops its timer.
func (w *watcherSink) remove(model string) {
	old := w.state.View()[model]
	old.stop()
	w.queuedRecords -= old.listsQueues()
	w.state.Remove(model)
}

// watchCheckBusySet checks what the router relies on and sorts the worker
// lists if a writer left them unsorted.
func watchCheckBusySet(model string, rec *events.BusySet) error {
	if rec.Model != model {
		return &kvwatch.RecordError{Reason: "mismatch",
			Err: fmt.Errorf("busylist: record of model %q under the key of %q", rec.Model, model)}
	}
	if rec.AllBusy != (len(rec.Free) == 0 && len(rec.Busy) > 0) {
		return &kvwatch.RecordError{Reason: "inconsistent",
			Err: fmt.Errorf("busylist: record of %q: all_busy=%v with %d free and %d busy workers",
				model, rec.AllBusy, len(rec.Free), len(rec.Busy))}
	}
	for _, s := range [][]uint64{rec.Busy, rec.Free, rec.Stale, rec.Amber, rec.Hard} {
		if !slices.IsSorted(s) {
			slices.Sort(s)
		}
	}
	return nil
}

// Sweep drops records older than the bucket's TTL, if it has one.
func (w *watcherSink) Sweep(now time.Time, ttl time.Duration) {
	for model, e := range w.state.Load() {
		if now.Sub(e.received) > ttl {
			w.remove(model)
		}
	}
}

// Decide applies the router contract (§7, admission.Policy.Decide) to one
// request for model; before the bucket's initial values are in it answers
// admission.ReasonNotReady, admitted when failing open.
//
// It reads the current snapshot without a lock and allocates nothing; it is
// safe for any number of goroutines. It is not written as DecideClass for
// the standard class: that costs the copy of a larger Decision, measured
// 47–53 ns against 24–28 ns.
func (w *Watcher) Decide(model string) admission.Decision {
	m := w.state.Load()
	if m == nil {
		return w.policy.NotReady()
	}
	e := m[model]
	if e == nil {
		return w.policy.Decide(nil, time.Time{}, time.Time{})
	}
	if w.timed {
		return w.policy.DecideRecord(&e.rec, e.stale.Load())
	}
	return w.policy.Decide(&e.rec, e.received, w.now())
}

// DecideClass is Decide for a request of priority class c (contract §15,
// admission.Policy.DecideClassRecord): sheddable requests go to free
// workers that are not amber, critical ones to free workers and then to busy
// ones that are not hard. Every class is admitted without a record, and
// with a stale one when failing open. Lock-free and allocation-free, like
// Decide.
func (w *Watcher) DecideClass(model string, c admission.Class) admission.Decision {
	m := w.state.Load()
	if m == nil {
		d := w.policy.NotReady()
		d.Class = c
		return d
	}
	e := m[model]
	if e == nil {
		return admission.Decision{Admit: true, Reason: admission.ReasonUnknownModel, Class: c}
	}
	if w.timed {
		return w.policy.DecideClassRecord(&e.rec, &e.classes, c, e.stale.Load())
	}
	return w.policy.DecideClassRecord(&e.rec, &e.classes, c, w.policy.Stale(&e.rec, e.received, w.now()))
}

var _ admission.ClassDecider = (*Watcher)(nil)
