package publisher

import (
	"context"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/registry"
)

// Pause stops publishing rank without a goodbye: no report and no heartbeat
// of it goes out until Resume, so the monitor sees the rank go stale, as it
// would for a silent engine. While every declared rank is paused the
// registry entry is not refreshed either (it expires after registry.TTL, as
// a dead worker's does); it is not deleted. Update still records the rank's
// load meanwhile. Pausing a paused rank does nothing. Pause fails with
// ErrRankOutOfRange for a rank outside the declared range and with
// ErrClosed once Close has begun.
func (p *Publisher) Pause(rank uint32) error { return p.setPaused("pause", rank, true) }

// Resume publishes rank again: its last known load goes out after the
// debounce (a rank never updated waits for its first Update), and the
// registry entry is written at once if it had stopped. Resuming a rank that
// is not paused does nothing. Resume fails like Pause.
func (p *Publisher) Resume(rank uint32) error { return p.setPaused("resume", rank, false) }

func (p *Publisher) setPaused(verb string, rank uint32, paused bool) error {
	start := p.opts.dpStart
	if rank < start || uint64(rank) >= uint64(start)+uint64(p.opts.dpSize) {
		return fmt.Errorf("publisher: %s rank %d: not in [%d, %d): %w",
			verb, rank, start, uint64(start)+uint64(p.opts.dpSize), ErrRankOutOfRange)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fmt.Errorf("publisher: %s rank %d: %w", verb, rank, ErrClosed)
	}
	r := &p.ranks[rank-start]
	if r.paused == paused {
		p.mu.Unlock()
		return nil
	}
	r.paused = paused
	wake := false
	if !paused && r.known {
		// Published again at once: the monitor has been without it.
		r.dirty = true
		wake = !p.pending
		p.pending = true
	}
	p.mu.Unlock()
	if wake {
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
	p.regs.sync(p.allPaused)
	return nil
}

// allPaused reports whether every declared rank is paused.
func (p *Publisher) allPaused() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range p.ranks {
		if !p.ranks[i].paused {
			return false
		}
	}
	return true
}

// registryRunner runs a Registration on a goroutine of its own, stops it
// while the worker is paused, and starts it again (which writes the entry
// at once) when it is not.
type registryRunner struct {
	mu     sync.Mutex
	reg    *registry.Registration // nil: nothing to run
	nc     *nats.Conn
	closed bool
	cancel context.CancelFunc // nil when not running
	done   chan struct{}
}

// start records reg and runs it; a nil reg runs nothing.
func (r *registryRunner) start(reg *registry.Registration, nc *nats.Conn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reg, r.nc = reg, nc
	r.runLocked()
}

// sync runs the registration unless paused says every rank is paused, in
// which case it stops it. paused is read under r.mu, so that concurrent
// Pause and Resume calls leave the state of the last one.
func (r *registryRunner) sync(paused func() bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if paused() {
		r.stopLocked()
	} else {
		r.runLocked()
	}
}

// close stops the registration for good; Close then deletes the entry.
func (r *registryRunner) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	r.stopLocked()
}

func (r *registryRunner) runLocked() {
	if r.reg == nil || r.closed || r.cancel != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	r.cancel, r.done = cancel, done
	go func(reg *registry.Registration, connected chan nats.Status) {
		defer close(done)
		reg.Run(ctx, connected)
	}(r.reg, r.nc.StatusChanged(nats.CONNECTED))
}

// stopLocked stops the running registration and waits for it: it returns
// promptly, a write in flight being cancelled.
func (r *registryRunner) stopLocked() {
	if r.cancel == nil {
		return
	}
	r.cancel()
	<-r.done
	r.cancel, r.done = nil, nil
}
