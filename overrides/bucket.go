package overrides

import (
	"context"
	"sync"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/internal/kvbucket"
)

// lazyBucket opens its bucket (creating it when missing) on first use, so
// that a store made while NATS is away works once it is back. Safe for
// concurrent use.
type lazyBucket struct {
	js       jetstream.JetStream
	name     string
	replicas int

	mu sync.Mutex
	kv jetstream.KeyValue
}

// get returns the bucket, opening it the first time.
func (b *lazyBucket) get(ctx context.Context) (jetstream.KeyValue, error) {
	b.mu.Lock()
	kv := b.kv
	b.mu.Unlock()
	if kv != nil {
		return kv, nil
	}
	kv, err := kvbucket.Open(ctx, b.js, b.name, b.replicas)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.kv == nil {
		b.kv = kv
	}
	return b.kv, nil
}
