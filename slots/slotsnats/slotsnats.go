// Package slotsnats connects a slot tracker (package slots) to NATS
// (contract §11): Sync registers and unregisters the tracker's workers from
// the worker registry, and Estimates publishes each rank's load, summed
// over tenants, as a router's estimate the monitor combines with the
// engine's own reports.
//
// Users: workermon slots (--from-registry, --publish) and workermon router,
// which embeds a tracker.
package slotsnats

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/slots"
)

// Defaults.
const (
	// DefaultSyncEvery is how often Sync compares the registry with the
	// tracker. The registry's snapshot is in memory: a pass is cheap.
	DefaultSyncEvery = 250 * time.Millisecond
	// DefaultPublishEvery is how often Estimates reads the tracker; a rank
	// whose load changed is published then, the others once a heartbeat.
	DefaultPublishEvery = 100 * time.Millisecond
	// DefaultBlockSize is the block size of a worker whose registry entry
	// names none: vLLM's and SGLang's default.
	DefaultBlockSize = 16
	// DefaultIdleLinger: a worker whose tracked load fell to zero is
	// estimated this long more (so a next request does not start a new
	// publisher), then said goodbye to.
	DefaultIdleLinger = 2 * time.Second
	// closeTimeout bounds the goodbyes sent when Estimates stops.
	closeTimeout = 5 * time.Second
)

// ErrInvalidConfig is wrapped by Validate for every problem of a SyncConfig
// or an EstimatesConfig.
var ErrInvalidConfig = errors.New("slotsnats: invalid config")

// Registry is what Sync reads; *registry.Watcher is one.
type Registry interface {
	// Models returns the models with at least one registered worker.
	Models() []string
	// Endpoints returns the model's registered workers; read only.
	Endpoints(model string) []events.WorkerEntry
}

type workerKey struct {
	model string
	id    uint64
}

// SyncConfig configures Sync.
type SyncConfig struct {
	// Tracker is kept in step with Registry. Required.
	Tracker *slots.Tracker
	// Registry is read. Required.
	Registry Registry
	// BlockSize is the block size of a worker whose entry names none.
	BlockSize uint32
	// Every is how often the registry is compared with the tracker.
	Every time.Duration
	// Log receives the problems (nil: discard).
	Log *slog.Logger
}

// DefaultSyncConfig returns a SyncConfig with every default set; Tracker
// and Registry are left for the caller.
func DefaultSyncConfig() SyncConfig {
	return SyncConfig{BlockSize: DefaultBlockSize, Every: DefaultSyncEvery}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c SyncConfig) Validate() error {
	var errs []error
	if c.Tracker == nil || c.Registry == nil {
		errs = append(errs, fmt.Errorf("%w: a tracker and a registry are required", ErrInvalidConfig))
	}
	if c.BlockSize == 0 {
		errs = append(errs, fmt.Errorf("%w: block size 0", ErrInvalidConfig))
	}
	if c.Every <= 0 {
		errs = append(errs, fmt.Errorf("%w: interval %v is not positive", ErrInvalidConfig, c.Every))
	}
	return errors.Join(errs...)
}

// Sync keeps the tracker's workers (tenant "default") equal to the
// registry's until ctx ends: a new or changed entry is registered, with the
// entry's block size or else cfg.BlockSize, and a worker whose entry is
// gone (deleted, or expired by the registry watcher's clock) is
// unregistered with its requests. A worker the tracker refuses (a block
// size that differs from the model's other workers, a cap) is logged once
// and tried again on every pass. Sync returns cfg's problems at once, else
// nil when ctx ends.
func Sync(ctx context.Context, cfg SyncConfig) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("slotsnats: sync: %w", err)
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := syncer{tr: cfg.Tracker, reg: cfg.Registry, blockSize: cfg.BlockSize, log: log,
		registered: make(map[workerKey]slots.Worker)}
	t := time.NewTicker(cfg.Every)
	defer t.Stop()
	for {
		s.pass()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

type syncer struct {
	tr         *slots.Tracker
	reg        Registry
	blockSize  uint32
	log        *slog.Logger
	registered map[workerKey]slots.Worker
	refused    map[workerKey]string // the last refusal logged, so it is logged once
}

func (s *syncer) pass() {
	seen := make(map[workerKey]struct{}, len(s.registered))
	for _, model := range s.reg.Models() {
		// What the tracker holds now: a worker unregistered behind Sync's
		// back (POST /unregister) is registered again while its entry lives.
		held := make(map[uint64]slots.Worker)
		for _, w := range s.tr.Workers(model, slots.DefaultTenant) {
			held[w.WorkerID] = w
		}
		for _, e := range s.reg.Endpoints(model) {
			k := workerKey{model, e.WorkerID}
			seen[k] = struct{}{}
			w := slots.Worker{WorkerID: e.WorkerID, Model: model, Tenant: slots.DefaultTenant,
				BlockSize: cmp.Or(e.BlockSize, s.blockSize), DPStart: e.DPStart, DPSize: max(e.DPSize, 1)}
			if old, ok := s.registered[k]; ok && old == w && held[e.WorkerID] == w {
				continue
			}
			if err := s.tr.Register(w); err != nil {
				s.refuse(k, err)
				continue
			}
			delete(s.refused, k)
			s.registered[k] = w
		}
	}
	for k := range s.registered {
		if _, ok := seen[k]; ok {
			continue
		}
		if err := s.tr.Unregister(k.model, slots.DefaultTenant, k.id); err != nil && !errors.Is(err, slots.ErrNotFound) {
			s.log.Warn("slots: unregister a worker gone from the registry", "model", k.model, "worker_id", k.id, "err", err)
		}
		delete(s.registered, k)
	}
	for k := range s.refused {
		if _, ok := seen[k]; !ok {
			delete(s.refused, k)
		}
	}
}

func (s *syncer) refuse(k workerKey, err error) {
	if s.refused == nil {
		s.refused = make(map[workerKey]string)
	}
	if msg := err.Error(); s.refused[k] != msg {
		s.refused[k] = msg
		s.log.Warn("slots: a registered worker cannot be tracked", "model", k.model, "worker_id", k.id, "err", err)
	}
}

// EstimatesConfig configures Estimates.
type EstimatesConfig struct {
	// Conn is the NATS connection the estimates go out on. Required.
	Conn *nats.Conn
	// Tracker is read. Required.
	Tracker *slots.Tracker
	// ID names the estimator: its source is "router/<ID>". Required; one
	// per process, so two routers never share a source.
	ID string
	// SubjectPrefix is the first subject token(s) of the est subjects.
	SubjectPrefix string
	// Every is how often the tracker is read.
	Every time.Duration
	// Heartbeat is the longest time between two reports of a rank; it
	// must stay well below the monitor's --stale-after.
	Heartbeat time.Duration
	// IdleLinger is how long a worker's estimates go on at zero load
	// before their goodbye.
	IdleLinger time.Duration
	// Log receives the problems (nil: discard).
	Log *slog.Logger
}

// DefaultEstimatesConfig returns an EstimatesConfig with every default set;
// Conn, Tracker and ID are left for the caller.
func DefaultEstimatesConfig() EstimatesConfig {
	return EstimatesConfig{SubjectPrefix: events.DefaultSubjectPrefix, Every: DefaultPublishEvery,
		Heartbeat: publisher.DefaultHeartbeat, IdleLinger: DefaultIdleLinger}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c EstimatesConfig) Validate() error {
	var errs []error
	if c.Conn == nil || c.Tracker == nil {
		errs = append(errs, fmt.Errorf("%w: a NATS connection and a tracker are required", ErrInvalidConfig))
	}
	if c.ID == "" {
		errs = append(errs, fmt.Errorf("%w: an id is required: the source is router/<id>", ErrInvalidConfig))
	} else if err := events.ValidateSource(events.RouterSourcePrefix + c.ID); err != nil {
		errs = append(errs, fmt.Errorf("%w: id %q: %w", ErrInvalidConfig, c.ID, err))
	}
	if err := events.ValidatePrefix(c.SubjectPrefix); err != nil {
		errs = append(errs, fmt.Errorf("%w: %w", ErrInvalidConfig, err))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"interval", c.Every}, {"heartbeat", c.Heartbeat}, {"idle linger", c.IdleLinger}} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%w: %s %v is not positive", ErrInvalidConfig, d.name, d.v))
		}
	}
	return errors.Join(errs...)
}

// Estimates publishes the tracker's load of the registered ranks, summed
// over tenants, as LoadReports of source router/<ID> on the est subjects,
// until ctx ends (contract §11): a changed rank at once (within Every), every
// rank at least once a heartbeat. Only workers with tracked load are
// estimated: a worker's reports start with its first tracked request, and
// it gets a goodbye for this source once its load has been zero for
// IdleLinger, when it leaves the tracker, and when ctx ends (within
// closeTimeout). So an idle fleet costs no messages, and a router never
// speaks for a worker it sends nothing to. The reports carry
// active_decode_blocks and active_prefill_tokens, and kv_committed_blocks
// (contract §21) from the first request that carried committed blocks
// (slots.Request.HasCommitted: workermon router's, never Dynamo's /add) to
// the worker's goodbye; the capacities are the engine's to say.
func Estimates(ctx context.Context, cfg EstimatesConfig) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("slotsnats: estimates: %w", err)
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	e := &estimator{cfg: cfg, source: events.RouterSourcePrefix + cfg.ID, pubs: make(map[workerKey]*estPub)}
	defer e.closeAll()
	t := time.NewTicker(cfg.Every)
	defer t.Stop()
	for {
		e.pass(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

type estPub struct {
	p           *publisher.Publisher
	start, size uint32
	idleSince   time.Time // zero while the worker has load
	committed   bool      // the reports carry kv_committed_blocks
}

// rankSum is a rank's load summed over tenants.
type rankSum struct{ blocks, prefill, committed uint64 }

type estimator struct {
	cfg    EstimatesConfig
	source string
	pubs   map[workerKey]*estPub
}

type rankKey struct {
	w    workerKey
	rank uint32
}

// pass publishes every worker's estimates, and says goodbye for the
// workers idle past IdleLinger: those goodbyes share one closeTimeout and
// stop when ctx ends (closeAll says the rest), so that a NATS outage, where
// each waits out its timeout, cannot hold the loop for closeTimeout per
// worker.
func (e *estimator) pass(ctx context.Context) {
	// Ranks as [start, end) in uint64: start+size may be 2^32.
	ranges := make(map[workerKey][2]uint64)
	for _, w := range e.cfg.Tracker.Workers("", "") {
		k := workerKey{w.Model, w.WorkerID}
		start, end := uint64(w.DPStart), uint64(w.DPStart)+uint64(w.DPSize)
		if r, ok := ranges[k]; ok {
			// Tenants may register different ranges: publish their union.
			start, end = min(r[0], start), max(r[1], end)
		}
		// The publisher declares at most MaxRanks ranks, as the monitor accepts.
		ranges[k] = [2]uint64{start, min(end, start+slots.MaxRanks)}
	}
	sums := make(map[rankKey]rankSum)
	loaded := make(map[workerKey]bool)
	committed := make(map[workerKey]bool)
	for _, l := range e.cfg.Tracker.Loads("", "") {
		k := rankKey{workerKey{l.Model, l.WorkerID}, l.DPRank}
		s := sums[k]
		sums[k] = rankSum{blocks: slots.SaturatingAdd(s.blocks, l.ActiveDecodeBlocks),
			prefill:   slots.SaturatingAdd(s.prefill, l.ActivePrefillTokens),
			committed: slots.SaturatingAdd(s.committed, l.KVCommittedBlocks)}
		if l.ActiveDecodeBlocks > 0 || l.ActivePrefillTokens > 0 || l.KVCommittedBlocks > 0 {
			loaded[k.w] = true
		}
		if l.Committed {
			committed[k.w] = true
		}
	}
	now := time.Now()
	cctx, cancel := context.WithTimeout(ctx, closeTimeout)
	defer cancel()
	for k, ep := range e.pubs {
		if ctx.Err() != nil {
			break
		}
		r, ok := ranges[k]
		switch {
		case !ok || r != [2]uint64{uint64(ep.start), uint64(ep.start) + uint64(ep.size)}:
		case loaded[k]:
			ep.idleSince = time.Time{}
			continue
		case ep.idleSince.IsZero():
			ep.idleSince = now
			continue
		case now.Sub(ep.idleSince) < e.cfg.IdleLinger:
			continue
		}
		e.close(cctx, k, ep)
	}
	for k, r := range ranges {
		ep := e.pubs[k]
		if ep == nil {
			if !loaded[k] {
				continue
			}
			var err error
			if ep, err = e.open(k, uint32(r[0]), uint32(r[1]-r[0])); err != nil {
				e.cfg.Log.Warn("slots: cannot publish estimates of a worker", "model", k.model, "worker_id", k.id, "err", err)
				continue
			}
			e.pubs[k] = ep
		}
		// Once a request with committed blocks went to the worker, its
		// reports carry them (0 when none is left): a value the monitor
		// holds is never left standing.
		ep.committed = ep.committed || committed[k]
		for rank := uint64(ep.start); rank < uint64(ep.start)+uint64(ep.size); rank++ {
			s := sums[rankKey{k, uint32(rank)}]
			load := publisher.Load{ActiveDecodeBlocks: events.Some(s.blocks), ActivePrefillTokens: events.Some(s.prefill)}
			if ep.committed {
				load.KVCommittedBlocks = events.Some(s.committed)
			}
			_ = ep.p.Update(uint32(rank), load)
		}
	}
}

func (e *estimator) open(k workerKey, start, size uint32) (*estPub, error) {
	opts := []publisher.Option{publisher.WithSource(e.source), publisher.WithRanks(start, size),
		publisher.WithSubjectPrefix(e.cfg.SubjectPrefix), publisher.WithLogger(e.cfg.Log),
		// Estimates change with every request: a short debounce batches a
		// burst without hiding it.
		publisher.WithDebounce(10 * time.Millisecond), publisher.WithHeartbeat(e.cfg.Heartbeat)}
	p, err := publisher.New(e.cfg.Conn, k.model, k.id, opts...)
	if err != nil {
		return nil, err
	}
	return &estPub{p: p, start: start, size: size}, nil
}

// close says goodbye for the worker's estimates and forgets it.
func (e *estimator) close(ctx context.Context, k workerKey, ep *estPub) {
	if err := ep.p.Close(ctx); err != nil {
		e.cfg.Log.Warn("slots: goodbye for a worker's estimates", "model", k.model, "worker_id", k.id, "err", err)
	}
	delete(e.pubs, k)
}

// closeAll says goodbye for every worker, within closeTimeout in all.
func (e *estimator) closeAll() {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	for k, ep := range e.pubs {
		e.close(ctx, k, ep)
	}
}
