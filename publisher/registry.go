package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
)

// registryTimeout bounds each registry request.
const registryTimeout = 2 * time.Second

// Backoff between failed registry writes: doubling from registryBackoffMin
// up to registryBackoffMax, and never longer than the refresh interval.
const (
	registryBackoffMin = 100 * time.Millisecond
	registryBackoffMax = 5 * time.Second
)

// registry keeps the worker's entry in the registry bucket (contract §7b).
type registry struct {
	nc       *nats.Conn
	js       jetstream.JetStream
	key      string
	entry    events.WorkerEntry // RegisteredAt is set on every write
	refresh  time.Duration
	replicas int
	now      func() time.Time

	// Owned by run, then by remove once run has stopped.
	kv  jetstream.KeyValue // nil until the bucket is opened, and after a failure
	log *retry.ErrLog
}

func newRegistry(p *Publisher) (*registry, error) {
	js, err := jetstream.New(p.nc)
	if err != nil {
		return nil, fmt.Errorf("publisher: open jetstream: %w", err)
	}
	return &registry{
		nc:  p.nc,
		js:  js,
		key: events.RegistryKey(p.model, p.workerID),
		entry: events.WorkerEntry{
			Model:    p.model,
			WorkerID: p.workerID,
			Endpoint: p.opts.endpoint,
			DPStart:  p.opts.dpStart,
			DPSize:   p.opts.dpSize,
			BootID:   p.bootID,
		},
		refresh:  p.opts.refresh,
		replicas: p.opts.replicas,
		now:      p.opts.now,
		log:      retry.NewErrLog(p.log.With("endpoint", p.opts.endpoint), slog.LevelWarn, "workermon publisher: write registry entry"),
	}, nil
}

// run writes the entry at once, then every refresh interval, and at once
// after a reconnect, until ctx ends. Failures retry with capped backoff;
// they never touch load publishing. connected receives the connection's
// CONNECTED events.
func (r *registry) run(ctx context.Context, connected chan nats.Status) {
	defer r.nc.RemoveStatusListener(connected)

	timer := time.NewTimer(0)
	defer timer.Stop()
	bo := retry.NewBackoff(registryBackoffMin, registryBackoffMax)
	for {
		select {
		case <-ctx.Done():
			return
		case _, ok := <-connected:
			if !ok {
				connected = nil // never closed by nats.go; be safe anyway
				continue
			}
			// The server may have restarted without its store: write now.
		case <-timer.C:
		}
		err := r.put(ctx)
		if ctx.Err() != nil {
			return
		}
		r.log.Result(err)
		wait := r.refresh
		if err != nil {
			wait = min(bo.Next(), r.refresh)
		} else {
			bo.Reset()
		}
		timer.Reset(wait)
	}
}

// put writes the entry, opening (or creating) the bucket first if needed.
func (r *registry) put(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, registryTimeout)
	defer cancel()
	if r.kv == nil {
		kv, err := busylist.OpenBucket(ctx, r.js, events.WorkersBucket, r.replicas)
		if err != nil {
			return fmt.Errorf("publisher: open registry: %w", err)
		}
		r.kv = kv
	}
	e := r.entry
	e.RegisteredAt = r.now().UnixNano()
	data, err := json.Marshal(&e)
	if err != nil {
		return fmt.Errorf("publisher: encode registry entry: %w", err)
	}
	if _, err := r.kv.Put(ctx, r.key, data); err != nil {
		// Open the bucket again next time: it may have been lost with a
		// server's store.
		r.kv = nil
		return fmt.Errorf("publisher: write registry entry %s: %w", r.key, err)
	}
	return nil
}

// remove deletes the entry. A missing bucket means there is nothing to
// delete.
func (r *registry) remove(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, registryTimeout)
	defer cancel()
	kv := r.kv
	if kv == nil {
		var err error
		kv, err = r.js.KeyValue(ctx, events.WorkersBucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("publisher: delete registry entry %s: %w", r.key, err)
		}
	}
	if err := kv.Delete(ctx, r.key); err != nil {
		return fmt.Errorf("publisher: delete registry entry %s: %w", r.key, err)
	}
	return nil
}
