// Package busylist holds all of workermon's JetStream KV code: the
// monitor-side Writer of busy-set records, the threshold-override store, the
// router-side Watcher and admission decision, and the worker registry.
package busylist

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// RegistryTTL is the max age of a worker registry entry; publishers refresh
// theirs every RegistryRefresh.
const (
	RegistryTTL     = 30 * time.Second
	RegistryRefresh = 10 * time.Second
)

// BucketConfig returns the configuration workermon creates a bucket with:
// history 1, and the registry's TTL for the workers bucket. replicas below 1
// count as 1.
func BucketConfig(name string, replicas int) jetstream.KeyValueConfig {
	cfg := jetstream.KeyValueConfig{
		Bucket:   name,
		History:  1,
		Storage:  jetstream.FileStorage,
		Replicas: max(replicas, 1),
	}
	if name == events.WorkersBucket {
		// Limit markers make an expired key reach watchers as a purge.
		cfg.TTL = RegistryTTL
		cfg.LimitMarkerTTL = RegistryTTL
	}
	return cfg
}

// OpenBucket returns the bucket, creating it with BucketConfig when it does
// not exist. An existing bucket's settings are left alone.
func OpenBucket(ctx context.Context, js jetstream.JetStream, name string, replicas int) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, name)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("busylist: open bucket %s: %w", name, err)
	}
	kv, err = js.CreateKeyValue(ctx, BucketConfig(name, replicas))
	if errors.Is(err, jetstream.ErrBucketExists) {
		// Someone else created it first.
		kv, err = js.KeyValue(ctx, name)
	}
	if err != nil {
		return nil, fmt.Errorf("busylist: create bucket %s: %w", name, err)
	}
	return kv, nil
}
