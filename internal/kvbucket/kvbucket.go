// Package kvbucket holds how workermon creates, opens and reads its
// JetStream KV buckets: the settings a bucket is created with (history 1,
// the registry's max age), opening with create-if-missing, checking a
// bucket's configuration fields, reading a bucket's live entries once, and
// stopping a watch without leaking its delivery goroutine.
//
// The packages that own a bucket (busylist, registry, overrides) and the
// shared watch loop (internal/kvwatch) use it; it imports nothing of
// workermon's but the wire contract.
package kvbucket

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// RegistryTTL is the max age of a worker registry entry; publishers refresh
// theirs every RegistryRefresh (contract §7b).
const (
	RegistryTTL     = 30 * time.Second
	RegistryRefresh = 10 * time.Second
)

// LeasesMaxAge is the max age of the leases bucket's keys, so that the
// entries of dead monitors go away (contract §10).
const LeasesMaxAge = 60 * time.Second

// MaxReplicas is the largest replica count JetStream accepts for a stream.
const MaxReplicas = 5

// stopWatchDrainTimeout bounds the draining of a stopped watch's channel.
const stopWatchDrainTimeout = 2 * time.Second

// Config returns the configuration workermon creates a bucket with: history
// 1, the registry's TTL for the workers bucket and a max age for the
// leases bucket. replicas below 1 count
// as 1.
func Config(name string, replicas int) jetstream.KeyValueConfig {
	cfg := jetstream.KeyValueConfig{
		Bucket:   name,
		History:  1,
		Storage:  jetstream.FileStorage,
		Replicas: max(replicas, 1),
	}
	if name == events.LeasesBucket {
		cfg.TTL = LeasesMaxAge
	}
	if name == events.WorkersBucket {
		// A max age only: limit markers (per-key TTLs) need NATS 2.11, and
		// readers expire entries by their own clock (contract §7b, §14).
		cfg.TTL = RegistryTTL
	}
	return cfg
}

// Open returns the bucket, creating it with Config when it does not exist.
// An existing bucket's settings are left alone.
func Open(ctx context.Context, js jetstream.JetStream, name string, replicas int) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, name)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("open bucket %s: %w", name, err)
	}
	kv, err = js.CreateKeyValue(ctx, Config(name, replicas))
	if errors.Is(err, jetstream.ErrBucketExists) {
		// Someone else created it first.
		kv, err = js.KeyValue(ctx, name)
	}
	if err != nil {
		return nil, fmt.Errorf("create bucket %s: %w", name, err)
	}
	return kv, nil
}

// Check checks the bucket settings every configuration has; who names the
// configuration in the messages ("busylist: writer").
func Check(who string, js jetstream.JetStream, bucket string, replicas int) []error {
	var errs []error
	if js == nil {
		errs = append(errs, fmt.Errorf("%s: JetStream is nil", who))
	}
	if bucket == "" {
		errs = append(errs, fmt.Errorf("%s: bucket name is empty", who))
	}
	if replicas < 0 || replicas > MaxReplicas {
		errs = append(errs, fmt.Errorf("%s: replicas %d not in [0, %d]", who, replicas, MaxReplicas))
	}
	return errs
}

// ReadAll calls fn with each live entry of kv, the initial values of a
// watch, and returns once they are all in, or with ctx's error.
func ReadAll(ctx context.Context, kv jetstream.KeyValue, fn func(jetstream.KeyValueEntry)) error {
	wctx, cancel := context.WithCancel(ctx)
	watch, err := kv.WatchAll(wctx, jetstream.IgnoreDeletes())
	if err != nil {
		cancel()
		return err
	}
	defer StopWatch(watch, cancel)
	for {
		select {
		case e, ok := <-watch.Updates():
			if !ok {
				return errors.New("watch closed")
			}
			if e == nil {
				return nil
			}
			fn(e)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// StopWatch ends a KV watch by cancelling the context it was started with,
// then drains its channel until nats.go closes it, so that the
// subscription's delivery goroutine, which may be blocked on the full
// channel, can finish. The drain is bounded. (KeyWatcher.Stop is not
// called: it also deletes the consumer, a JetStream request that waits out
// its timeout while NATS is away; on a cancelled context nats.go does that
// on a goroutine of its own.)
func StopWatch(w jetstream.KeyWatcher, cancel context.CancelFunc) {
	cancel()
	if w == nil {
		return
	}
	t := time.NewTimer(stopWatchDrainTimeout)
	defer t.Stop()
	for {
		select {
		case _, ok := <-w.Updates():
			if !ok {
				return
			}
		case <-t.C:
			return
		}
	}
}
