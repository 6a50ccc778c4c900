package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
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

// This file holds the engine side: a worker's Registration.

// Registration keeps one worker's entry in the registry bucket (contract
// §7b): written at once, again every refresh interval and after every
// reconnect, and deleted by Remove. The publisher runs one for an engine
// given an endpoint.
type Registration struct {
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

// RegistrationConfig is what a Registration needs.
type RegistrationConfig struct {
	// Conn is the engine's NATS connection. Required.
	Conn *nats.Conn
	// Entry is the worker's entry; RegisteredAt is set on every write.
	// Model, WorkerID and Endpoint are required.
	Entry events.WorkerEntry
	// Refresh is how often the entry is written again: positive and below
	// TTL (default Refresh).
	Refresh time.Duration
	// Replicas is what the bucket is created with when it is missing (0 = 1).
	Replicas int
	// Now is the clock of RegisteredAt (default time.Now).
	Now func() time.Time
	// Log receives write failures, rate-limited (default: discard).
	Log *slog.Logger
}

// NewRegistration returns the registration of cfg.Entry; Run keeps it.
func NewRegistration(cfg RegistrationConfig) (*Registration, error) {
	var errs []error
	if cfg.Conn == nil {
		errs = append(errs, errors.New("nil connection"))
	}
	if err := events.ValidateModel(cfg.Entry.Model); err != nil {
		errs = append(errs, err)
	}
	if cfg.Entry.Endpoint == "" {
		errs = append(errs, errors.New("empty endpoint"))
	}
	if cfg.Refresh == 0 {
		cfg.Refresh = Refresh
	}
	if cfg.Refresh < 0 || cfg.Refresh >= TTL {
		errs = append(errs, fmt.Errorf("refresh %v is not in (0, %v)", cfg.Refresh, TTL))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("registry: new registration: %w: %w", ErrInvalidOption, err)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return nil, fmt.Errorf("registry: new registration: %w", err)
	}
	return &Registration{
		nc:       cfg.Conn,
		js:       js,
		key:      events.RegistryKey(cfg.Entry.Model, cfg.Entry.WorkerID),
		entry:    cfg.Entry,
		refresh:  cfg.Refresh,
		replicas: cfg.Replicas,
		now:      cfg.Now,
		log:      retry.NewErrLog(cfg.Log.With("endpoint", cfg.Entry.Endpoint), slog.LevelWarn, "registry: write entry"),
	}, nil
}

// Run writes the entry at once, then every refresh interval, and at once
// after a reconnect, until ctx ends. Failures retry with capped backoff;
// they never touch the engine's load publishing. connected receives the
// connection's CONNECTED events (nats.Conn.StatusChanged); Run removes the
// listener when it returns.
func (r *Registration) Run(ctx context.Context, connected chan nats.Status) {
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
func (r *Registration) put(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, registryTimeout)
	defer cancel()
	if r.kv == nil {
		kv, err := kvbucket.Open(ctx, r.js, events.WorkersBucket, r.replicas)
		if err != nil {
			return fmt.Errorf("registry: open bucket: %w", err)
		}
		r.kv = kv
	}
	e := r.entry
	e.RegisteredAt = r.now().UnixNano()
	data, err := json.Marshal(&e)
	if err != nil {
		return fmt.Errorf("registry: encode entry: %w", err)
	}
	if _, err := r.kv.Put(ctx, r.key, data); err != nil {
		// Open the bucket again next time: it may have been lost with a
		// server's store.
		r.kv = nil
		return fmt.Errorf("registry: write entry %s: %w", r.key, err)
	}
	return nil
}

// Remove deletes the entry. A missing bucket means there is nothing to
// delete.
func (r *Registration) Remove(ctx context.Context) error {
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
			return fmt.Errorf("registry: delete entry %s: %w", r.key, err)
		}
	}
	if err := kv.Delete(ctx, r.key); err != nil {
		return fmt.Errorf("registry: delete entry %s: %w", r.key, err)
	}
	return nil
}
