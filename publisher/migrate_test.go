package publisher_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

// migrateRequest sends a migrate request for worker of model and returns
// the answer.
func migrateRequest(t *testing.T, nc *nats.Conn, model string, worker uint64, req events.MigrateRequest) (events.MigrateReply, error) {
	t.Helper()
	data, err := events.MarshalMigrateRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := nc.Request(events.MigrateSubject(events.DefaultSubjectPrefix, model, worker), data, 2*time.Second)
	if err != nil {
		return events.MigrateReply{}, err
	}
	return events.DecodeMigrateReply(msg.Data)
}

// TestMigrateHandler: a migrate request reaches the handler and is answered
// with its count (capped at max_requests); a request of an older epoch, for
// another worker, or that does not decode is answered 0 without calling the
// handler.
func TestMigrateHandler(t *testing.T) {
	t.Parallel()
	const model = "Qwen/Qwen3-0.6B"
	e := newEnv(t)
	var mu sync.Mutex
	var got []events.MigrateRequest
	e.start(t, model, 7, publisher.WithMigrateHandler(func(ctx context.Context, req events.MigrateRequest) int {
		if _, ok := ctx.Deadline(); !ok {
			t.Error("handler context without a deadline")
		}
		mu.Lock()
		defer mu.Unlock()
		got = append(got, req)
		return 5 // more than asked: capped
	}))
	// The subscription is in place once New returns and the server has it.
	if err := e.pub.Flush(); err != nil {
		t.Fatal(err)
	}
	base := events.MigrateRequest{Model: model, Src: 7, Dst: 8, DstEndpoint: "http://w8", MaxRequests: 2,
		Reason: events.MigrateReasonDecodeLoad, Epoch: 3}
	reply, err := migrateRequest(t, e.obs, model, 7, base)
	if err != nil || reply.Migrated != 2 {
		t.Fatalf("answer %+v, %v: want 2 migrated", reply, err)
	}
	old := base
	old.Epoch = 2
	if reply, err = migrateRequest(t, e.obs, model, 7, old); err != nil || reply.Migrated != 0 {
		t.Errorf("older epoch: answer %+v, %v: want 0", reply, err)
	}
	// A payload for another worker on this worker's subject.
	other := base
	other.Src = 9
	if reply, err = migrateRequest(t, e.obs, model, 7, other); err != nil || reply.Migrated != 0 {
		t.Errorf("another worker's request: answer %+v, %v: want 0", reply, err)
	}
	msg, err := e.obs.Request(events.MigrateSubject(events.DefaultSubjectPrefix, model, 7), []byte("\xc1 not msgpack"), 2*time.Second)
	if err != nil {
		t.Fatalf("garbage: %v", err)
	}
	if r, err := events.DecodeMigrateReply(msg.Data); err != nil || r.Migrated != 0 {
		t.Errorf("garbage: answer %+v, %v: want 0", r, err)
	}
	newer := base
	newer.Epoch = 4
	newer.Reason = events.MigrateReasonFailover
	if reply, err = migrateRequest(t, e.obs, model, 7, newer); err != nil || reply.Migrated != 2 {
		t.Errorf("newer epoch: answer %+v, %v: want 2", reply, err)
	}
	mu.Lock()
	defer mu.Unlock()
	base.V, newer.V = events.SchemaVersion, events.SchemaVersion
	if len(got) != 2 || got[0] != base || got[1] != newer {
		t.Errorf("handler saw %+v, want the two valid requests", got)
	}
}

// TestNoMigrateHandler: without the option nobody listens, and after Close
// nobody does either.
func TestNoMigrateHandler(t *testing.T) {
	t.Parallel()
	const model = "Qwen/Qwen3-0.6B"
	e := newEnv(t)
	e.start(t, model, 1)
	req := events.MigrateRequest{Model: model, Src: 1, MaxRequests: 1, Reason: events.MigrateReasonDecodeLoad, Epoch: 1}
	if _, err := migrateRequest(t, e.obs, model, 1, req); !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("without a handler: %v, want no responders", err)
	}
	p := e.start(t, model, 2, publisher.WithMigrateHandler(func(context.Context, events.MigrateRequest) int { return 1 }))
	if err := e.pub.Flush(); err != nil {
		t.Fatal(err)
	}
	req.Src = 2
	if r, err := migrateRequest(t, e.obs, model, 2, req); err != nil || r.Migrated != 1 {
		t.Fatalf("with a handler: %+v %v", r, err)
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := migrateRequest(t, e.obs, model, 2, req); !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("after Close: %v, want no responders", err)
	}
	if _, err := publisher.New(e.pub, model, 3, publisher.WithSource("router/r1"),
		publisher.WithMigrateHandler(func(context.Context, events.MigrateRequest) int { return 0 })); !errors.Is(err, publisher.ErrInvalidConfig) {
		t.Errorf("a router source with a migrate handler: %v, want ErrInvalidConfig", err)
	}
}
