package publisher

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
)

// heartbeatSlack lets a heartbeat go out up to 1/heartbeatSlack of the
// interval early, so that ranks falling due at nearly the same time go out
// together instead of each waking the loop.
const heartbeatSlack = 10

// rankLoad is a rank's load taken from under the lock for publishing.
type rankLoad struct {
	i    int // rank - dpStart
	load Load
}

// run publishes changed ranks after the debounce, unchanged ones as
// heartbeats, and every known rank at once after a reconnect, until ctx
// ends. connected receives the connection's CONNECTED events.
func (p *Publisher) run(ctx context.Context, connected chan nats.Status) {
	defer p.wg.Done()
	defer p.nc.RemoveStatusListener(connected)

	debounce := time.NewTimer(p.opts.debounce)
	debounce.Stop()
	defer debounce.Stop()
	armed := false
	heartbeat := time.NewTimer(p.opts.heartbeat)
	defer heartbeat.Stop()

	for {
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
			// The first change starts the wait; later ones join it.
			if !armed {
				debounce.Reset(p.opts.debounce)
				armed = true
			}
		case <-debounce.C:
			armed = false
			_ = p.flush(false)
		case <-heartbeat.C:
			heartbeat.Reset(p.heartbeat(time.Now()))
		case _, ok := <-connected:
			if !ok {
				connected = nil // never closed by nats.go; be safe anyway
				continue
			}
			// nats.go has reconnected: the monitor may have missed reports
			// while we were away, so send the current state now instead of
			// at the next heartbeat.
			p.log.Info("workermon publisher: connection restored, publishing every rank")
			_ = p.flush(true)
		}
	}
}

// flush publishes the changed ranks, or every known rank when all is set,
// paused ranks excepted, and returns the first error.
func (p *Publisher) flush(all bool) error {
	batch := p.batch[:0]
	p.mu.Lock()
	p.pending = false
	for i := range p.ranks {
		r := &p.ranks[i]
		if r.paused {
			continue // stays dirty: published when resumed
		}
		if r.dirty || all && r.known {
			batch = append(batch, rankLoad{i: i, load: r.load})
			r.dirty = false
		}
	}
	p.mu.Unlock()

	var first error
	for _, b := range batch {
		if err := p.publish(b.i, b.load); err != nil && first == nil {
			first = err
		}
	}
	p.batch = batch
	return first
}

// heartbeat publishes the ranks whose last report is a heartbeat old (or
// nearly) and returns the time until the next one falls due.
func (p *Publisher) heartbeat(now time.Time) time.Duration {
	every := p.opts.heartbeat
	next := every
	for i, sent := range p.sentAt {
		if sent.IsZero() {
			// Never published: the debounce publishes it first.
			continue
		}
		due := sent.Add(every).Sub(now)
		if due <= every/heartbeatSlack {
			p.mu.Lock()
			r := &p.ranks[i]
			if r.paused {
				p.mu.Unlock()
				continue // silent until resumed
			}
			load := r.load
			r.dirty = false
			p.mu.Unlock()
			_ = p.publish(i, load)
			due = every
		}
		next = min(next, due)
	}
	return next
}

// publish sends one report of rank index i with the next seq.
func (p *Publisher) publish(i int, load Load) error {
	p.seq++
	r := events.LoadReport{
		Model:               p.model,
		WorkerID:            p.workerID,
		DPRank:              p.opts.dpStart + uint32(i),
		DPStart:             p.opts.dpStart,
		DPSize:              p.opts.dpSize,
		Source:              p.opts.source,
		ActiveDecodeBlocks:  load.ActiveDecodeBlocks,
		KVTotalBlocks:       load.KVTotalBlocks,
		ActivePrefillTokens: load.ActivePrefillTokens,
		MaxNumBatchedTokens: load.MaxNumBatchedTokens,
		WaitingRequests:     load.WaitingRequests,
		RunningRequests:     load.RunningRequests,
		Preemptions:         load.Preemptions,
		PrefilledTokens:     load.PrefilledTokens,
		KVCommittedBlocks:   load.KVCommittedBlocks,
		BootID:              p.bootID,
		Seq:                 p.seq,
		SentAt:              p.opts.now().UnixNano(),
	}
	now := time.Now()
	p.sentAt[i] = now
	data, err := p.enc.LoadReport(&r)
	if err != nil {
		err = fmt.Errorf("publisher: encode report of rank %d: %w", r.DPRank, err)
	} else if err = p.nc.Publish(p.subjects[i], data); err != nil {
		err = fmt.Errorf("publisher: publish report of rank %d: %w", r.DPRank, err)
	}
	p.pubLog.Result(err)
	return err
}

// publishGoodbye sends the Goodbye with the next seq.
func (p *Publisher) publishGoodbye() error {
	p.seq++
	g := events.Goodbye{
		Model:    p.model,
		WorkerID: p.workerID,
		Source:   p.opts.source,
		BootID:   p.bootID,
		Seq:      p.seq,
		SentAt:   p.opts.now().UnixNano(),
	}
	data, err := p.enc.Goodbye(&g)
	if err != nil {
		return fmt.Errorf("publisher: encode goodbye: %w", err)
	}
	if err := p.nc.Publish(p.bye, data); err != nil {
		return fmt.Errorf("publisher: publish goodbye: %w", err)
	}
	return nil
}
