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

// Sentinel errors of the package.
var (
	// ErrWatcherClosed is returned by WaitReady when the Watcher or Registry
	// was closed before its initial values arrived.
	ErrWatcherClosed = errors.New("busylist: watcher closed")
	// ErrInvalidOption is wrapped by the constructors when an option is out
	// of range or does not apply.
	ErrInvalidOption = errors.New("busylist: invalid option")
	// ErrWriterRunning is returned by Writer.Run when the Writer has already
	// been run.
	ErrWriterRunning = errors.New("busylist: writer already started")
	// ErrThresholdWatcherRunning is returned by ThresholdWatcher.Run when the
	// watcher has already been run.
	ErrThresholdWatcherRunning = errors.New("busylist: threshold watcher already started")
	// ErrThresholdConflict is returned by ThresholdStore.Merge when the
	// override kept changing under it.
	ErrThresholdConflict = errors.New("busylist: threshold override changed concurrently")
	// ErrBadOverride marks a stored threshold override that is not a JSON
	// object of the three thresholds within their ranges.
	ErrBadOverride = errors.New("busylist: invalid threshold override")
)

// RegistryTTL is the max age of a worker registry entry; publishers refresh
// theirs every RegistryRefresh.
const (
	RegistryTTL     = 30 * time.Second
	RegistryRefresh = 10 * time.Second
)

// maxReplicas is the largest replica count JetStream accepts for a stream.
const maxReplicas = 5

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

// validateBucket checks the bucket settings every config has; who names the
// config in the messages.
func validateBucket(who string, js jetstream.JetStream, bucket string, replicas int) []error {
	var errs []error
	if js == nil {
		errs = append(errs, fmt.Errorf("busylist: %s: JetStream is nil", who))
	}
	if bucket == "" {
		errs = append(errs, fmt.Errorf("busylist: %s: bucket name is empty", who))
	}
	if replicas < 0 || replicas > maxReplicas {
		errs = append(errs, fmt.Errorf("busylist: %s: replicas %d not in [0, %d]", who, replicas, maxReplicas))
	}
	return errs
}

// readBucket calls fn with each live entry of kv, the initial values of a
// watch, and returns once they are all in, or with ctx's error.
func readBucket(ctx context.Context, kv jetstream.KeyValue, fn func(jetstream.KeyValueEntry)) error {
	wctx, cancel := context.WithCancel(ctx)
	watch, err := kv.WatchAll(wctx, jetstream.IgnoreDeletes())
	if err != nil {
		cancel()
		return err
	}
	defer stopWatch(watch, cancel)
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
