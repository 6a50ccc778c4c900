// Package publisher is the engine side of workermon: the library an
// inference engine links to publish the load of its data-parallel ranks to
// NATS (contract §3–§4) and, given its endpoint, to register itself in the
// worker registry that routers read (contract §7b).
//
// The engine calls Update whenever a rank's load changes; the call only
// records the value. A goroutine of the Publisher publishes each changed rank
// after a short debounce, carrying the rank's full last known state, and
// publishes every rank again as a heartbeat when nothing changed. Pause and
// Resume silence a rank (and, when every rank is paused, the registry
// refresh) without a goodbye, for an adapter whose engine stopped answering.
// Close says goodbye and removes the registry entry.
//
// Beside the KV blocks and prefill tokens of contract §3, a Load carries the
// leading signals of §21 the engine knows: its waiting and running
// requests, its preemptions and prefilled prompt tokens (running totals,
// published as counters of the Publisher's boot id that never go down), and
// the KV blocks its requests would hold at their expected length. A value
// the engine does not know is left unset, never sent as 0.
//
//	p, err := publisher.New(nc, "Qwen/Qwen3-0.6B", workerID, publisher.WithRanks(0, 2))
//	...
//	p.Update(1, publisher.Load{ActiveDecodeBlocks: events.Some(used), KVTotalBlocks: events.Some(total)})
//	...
//	p.Close(ctx)
package publisher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
	"github.com/workermon/workermon/registry"
)

// Sentinel errors of New and Update. Errors of Close wrap the NATS or
// JetStream error that caused them.
var (
	// ErrInvalidConfig: an argument or option of New is missing, out of
	// range, or conflicts with another.
	ErrInvalidConfig = errors.New("invalid configuration")
	// ErrRankOutOfRange: Update was given a rank outside the declared range.
	ErrRankOutOfRange = errors.New("rank outside the declared range")
	// ErrClosed: the Publisher is closed.
	ErrClosed = errors.New("publisher closed")
)

// Load is one rank's load as the engine measures it. A field left unset
// keeps the value the rank already has; a field set to zero sets it to zero.
// A field never set is left out of the reports (the monitor treats it as
// unknown): an engine that does not know a value leaves it unset, never
// sends 0 for it.
type Load struct {
	ActiveDecodeBlocks  events.Optional // KV-cache blocks in use
	KVTotalBlocks       events.Optional // KV-cache blocks in total
	ActivePrefillTokens events.Optional // tokens being prefilled
	MaxNumBatchedTokens events.Optional // batch-token capacity

	// The leading signals of contract §21. The monitor takes
	// WaitingRequests, RunningRequests, Preemptions and PrefilledTokens
	// from the engine source only.

	// WaitingRequests is the requests waiting to be scheduled, preempted
	// ones included (vLLM's num_requests_waiting).
	WaitingRequests events.Optional
	// RunningRequests is the requests scheduled (vLLM's
	// num_requests_running).
	RunningRequests events.Optional
	// Preemptions is the engine's count of preemptions, a counter: see
	// Publisher.Update for how a counter is published.
	Preemptions events.Optional
	// PrefilledTokens is the engine's count of prompt tokens computed,
	// recomputation after a preemption included where the engine can tell,
	// a counter like Preemptions.
	PrefilledTokens events.Optional
	// KVCommittedBlocks is the blocks the rank's running and waiting
	// requests would hold together at their expected length: the sum of
	// ceil((prompt + expected output) / block size).
	KVCommittedBlocks events.Optional
}

// merge returns l with every field that u sets replaced by u's value.
func (l Load) merge(u Load) Load {
	set := func(dst *events.Optional, src events.Optional) {
		if src.Set {
			*dst = src
		}
	}
	set(&l.ActiveDecodeBlocks, u.ActiveDecodeBlocks)
	set(&l.KVTotalBlocks, u.KVTotalBlocks)
	set(&l.ActivePrefillTokens, u.ActivePrefillTokens)
	set(&l.MaxNumBatchedTokens, u.MaxNumBatchedTokens)
	set(&l.WaitingRequests, u.WaitingRequests)
	set(&l.RunningRequests, u.RunningRequests)
	set(&l.Preemptions, u.Preemptions)
	set(&l.PrefilledTokens, u.PrefilledTokens)
	set(&l.KVCommittedBlocks, u.KVCommittedBlocks)
	return l
}

// rankState is the last known load of one rank.
type rankState struct {
	load Load // as published: counters are the publisher's sums
	// The counters of the rank, which turn the engine's values into the
	// published ones.
	preemptions, prefilled counter
	known                  bool // Update was called for this rank: it is published
	dirty                  bool // changed since it was last published
	paused                 bool // Pause was called: nothing is published until Resume
}

// Publisher publishes the load of one worker's ranks for one source. Its
// methods are safe for concurrent use.
type Publisher struct {
	nc       *nats.Conn
	model    string
	workerID uint64
	bootID   uint64
	opts     options
	log      *slog.Logger
	subjects []string // load or est subject of each rank, by rank - dpStart
	bye      string   // bye or est bye subject

	mu      sync.Mutex
	ranks   []rankState // by rank - dpStart
	pending bool        // a wake-up is on its way to the loop
	closed  bool
	wake    chan struct{}

	// Owned by the run loop, then by Close once the loop has stopped.
	enc    *events.Encoder
	seq    uint64
	sentAt []time.Time // when each rank was last published, zero if never
	batch  []rankLoad
	pubLog *retry.ErrLog

	reg       *registry.Registration // nil without an endpoint
	regs      registryRunner         // runs reg; stopped while every rank is paused
	migrator  *migrator              // nil without a migrate handler
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error
}

// New starts a Publisher of worker workerID serving model over nc. It checks
// every argument and option and returns an error wrapping ErrInvalidConfig
// that names all the problems found. New does no network I/O: the first
// reports go out after the first Update, and the registry entry, if any, is
// written in the background.
func New(nc *nats.Conn, model string, workerID uint64, opts ...Option) (*Publisher, error) {
	o, optErr := newOptions(opts)
	errs := []error{optErr} // errors.Join skips a nil
	switch {
	case nc == nil:
		errs = append(errs, fmt.Errorf("publisher: check connection: nil: %w", ErrInvalidConfig))
	case nc.IsClosed():
		errs = append(errs, fmt.Errorf("publisher: check connection: closed: %w", ErrInvalidConfig))
	}
	if err := events.ValidateModel(model); err != nil {
		errs = append(errs, fmt.Errorf("publisher: check model: %w: %w", ErrInvalidConfig, err))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}

	p := &Publisher{
		nc:       nc,
		model:    model,
		workerID: workerID,
		bootID:   newBootID(),
		opts:     o,
		log:      o.logger.With("model", model, "worker_id", workerID, "source", o.source),
		subjects: make([]string, o.dpSize),
		bye:      events.ByeSubject(o.prefix, model, workerID),
		ranks:    make([]rankState, o.dpSize),
		wake:     make(chan struct{}, 1),
		enc:      events.NewEncoder(),
		sentAt:   make([]time.Time, o.dpSize),
		batch:    make([]rankLoad, 0, o.dpSize),
	}
	// A router's estimates and goodbye go on est subjects, an engine's on
	// load and bye subjects: the monitor accepts each source only on its own
	// (contract §11).
	loadSubject := events.LoadSubject
	if events.IsRouterSource(o.source) {
		loadSubject, p.bye = events.EstSubject, events.EstByeSubject(o.prefix, model, workerID)
	}
	for i := range p.subjects {
		p.subjects[i] = loadSubject(o.prefix, model, workerID, o.dpStart+uint32(i))
	}
	p.pubLog = retry.NewErrLog(p.log, slog.LevelWarn, "workermon publisher: publish report")
	if o.endpoint != "" {
		reg, err := registry.NewRegistration(registry.RegistrationConfig{
			Conn: nc,
			Entry: events.WorkerEntry{
				Model:     model,
				WorkerID:  workerID,
				Endpoint:  o.endpoint,
				DPStart:   o.dpStart,
				DPSize:    o.dpSize,
				BootID:    p.bootID,
				BlockSize: o.blockSize,
			},
			Refresh:  o.refresh,
			Replicas: o.replicas,
			Now:      o.now,
			Log:      p.log,
		})
		if err != nil {
			return nil, fmt.Errorf("publisher: %w", err)
		}
		p.reg = reg
	}

	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	if o.migrate != nil {
		if err := p.startMigrator(ctx); err != nil {
			cancel()
			return nil, err
		}
	}
	p.wg.Add(1)
	go p.run(ctx, nc.StatusChanged(nats.CONNECTED))
	p.regs.start(p.reg, nc)
	return p, nil
}

// newBootID returns a random, non-zero boot id.
func newBootID() uint64 {
	for {
		if id := rand.Uint64(); id != 0 {
			return id
		}
	}
}

// BootID returns the boot id of this Publisher's reports, random per
// Publisher.
func (p *Publisher) BootID() uint64 { return p.bootID }

// Update records rank's load: every field that load sets replaces the rank's
// value, the others keep theirs. A change is published after the debounce;
// an Update that changes nothing publishes nothing (the heartbeat keeps the
// rank alive). Update never blocks on the network and is safe to call from
// many goroutines.
//
// Preemptions and PrefilledTokens take the engine's running totals. The
// reports carry, per rank, a counter of this Publisher's boot id (contract
// §21) that never goes down: the first value as given, then the sum of the
// increases since. A value below the previous one means the engine's count
// restarted from zero (an engine restarted under a sidecar), so the whole
// value counts as the increase, as Prometheus counts a counter reset. It fails with ErrRankOutOfRange for a rank outside the
// declared range and with ErrClosed once Close has begun.
func (p *Publisher) Update(rank uint32, load Load) error {
	start := p.opts.dpStart
	if rank < start || uint64(rank) >= uint64(start)+uint64(p.opts.dpSize) {
		return fmt.Errorf("publisher: update rank %d: not in [%d, %d): %w",
			rank, start, uint64(start)+uint64(p.opts.dpSize), ErrRankOutOfRange)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fmt.Errorf("publisher: update rank %d: %w", rank, ErrClosed)
	}
	r := &p.ranks[rank-start]
	if load.Preemptions.Set {
		load.Preemptions.Value = r.preemptions.add(load.Preemptions.Value)
	}
	if load.PrefilledTokens.Set {
		load.PrefilledTokens.Value = r.prefilled.add(load.PrefilledTokens.Value)
	}
	merged := r.load.merge(load)
	if r.known && merged == r.load {
		p.mu.Unlock()
		return nil
	}
	r.load, r.known, r.dirty = merged, true, true
	wake := !p.pending
	p.pending = true
	p.mu.Unlock()
	if wake {
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
	return nil
}

// Close stops the Publisher: it publishes the updates still waiting for
// their debounce, then the Goodbye, flushes the connection so the server has
// them, and deletes the registry entry. Close does not close nc. It returns
// when done or when ctx ends, and within DefaultCloseTimeout in any case;
// every goroutine of the Publisher has stopped when it returns. Further
// calls return the first call's result.
func (p *Publisher) Close(ctx context.Context) error {
	p.closeOnce.Do(func() { p.closeErr = p.close(ctx) })
	return p.closeErr
}

func (p *Publisher) close(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, DefaultCloseTimeout)
	defer cancel()

	// Stop intake, then the loops; from here on this goroutine owns the
	// loop's state.
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.migrator.stop()
	p.regs.close()
	p.cancel()
	p.wg.Wait()

	var errs []error
	if err := p.flush(false); err != nil {
		errs = append(errs, err)
	}
	if err := p.publishGoodbye(); err != nil {
		errs = append(errs, err)
	}
	if err := p.nc.FlushWithContext(ctx); err != nil {
		errs = append(errs, fmt.Errorf("publisher: flush connection: %w", err))
	}
	if p.reg != nil {
		if err := p.reg.Remove(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
