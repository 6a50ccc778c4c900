package publisher_test

import (
	"context"
	"log"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

// An engine with two data-parallel ranks publishes its load and registers
// its endpoint for the routers.
func Example() {
	nc, err := nats.Connect("nats://127.0.0.1:4222",
		nats.MaxReconnects(-1), nats.PingInterval(5*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()

	p, err := publisher.New(nc, "Qwen/Qwen3-0.6B", 7,
		publisher.WithRanks(0, 2),
		publisher.WithEndpoint("http://10.0.0.7:8000"),
		publisher.WithLogger(slog.Default()))
	if err != nil {
		log.Fatal(err)
	}

	// After each scheduler step, for each rank. The first update gives the
	// capacities; later ones only what changed.
	_ = p.Update(0, publisher.Load{
		ActiveDecodeBlocks:  events.Some(812),
		KVTotalBlocks:       events.Some(4096),
		ActivePrefillTokens: events.Some(2048),
		MaxNumBatchedTokens: events.Some(8192),
	})
	_ = p.Update(1, publisher.Load{ActiveDecodeBlocks: events.Some(40), KVTotalBlocks: events.Some(4096)})
	_ = p.Update(0, publisher.Load{ActiveDecodeBlocks: events.Some(830), ActivePrefillTokens: events.Some(0)})

	// The leading signals the engine knows (contract §21): its queues, its
	// running totals of preemptions and prompt tokens computed, and the
	// blocks its requests would hold at their expected length.
	_ = p.Update(0, publisher.Load{
		WaitingRequests:   events.Some(4),
		RunningRequests:   events.Some(31),
		Preemptions:       events.Some(2),
		PrefilledTokens:   events.Some(918_204),
		KVCommittedBlocks: events.Some(3900),
	})

	// On shutdown: the goodbye takes the worker out of the busy set at once.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := p.Close(ctx); err != nil {
		log.Print(err)
	}
}

// A router publishes its own estimate of a worker's load under its own
// source; the monitor takes the larger of the router's and the engine's.
func ExampleWithSource() {
	nc, err := nats.Connect("nats://127.0.0.1:4222")
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()

	p, err := publisher.New(nc, "Qwen/Qwen3-0.6B", 7, publisher.WithSource("router/gw-1"))
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close(context.Background())

	_ = p.Update(0, publisher.Load{ActivePrefillTokens: events.Some(12000)})
}
