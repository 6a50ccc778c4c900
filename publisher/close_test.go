package publisher_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

// Close publishes the update still waiting for its debounce, then the
// goodbye; afterwards Update fails and Close is idempotent.
func TestCloseFlushesAndSaysGoodbye(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "Qwen/Qwen3-0.6B", 9, publisher.WithRanks(2, 2), publisher.WithSource("router/r1"),
		publisher.WithDebounce(500*time.Millisecond))
	if err := p.Update(3, load(42, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	if err := p.Close(t.Context()); err != nil {
		t.Fatalf("Close: %v", err)
	}

	m := in.next(t)
	if m.report == nil || m.report.DPRank != 3 || m.report.ActiveDecodeBlocks != events.Some(42) {
		t.Fatalf("first message %+v, want the pending report of rank 3", m)
	}
	bye := in.next(t)
	if bye.bye == nil {
		t.Fatalf("second message %+v, want the goodbye", bye)
	}
	want := events.Goodbye{Model: "Qwen/Qwen3-0.6B", WorkerID: 9, Source: "router/r1", BootID: p.BootID(),
		Seq: m.report.Seq + 1, SentAt: bye.bye.SentAt}
	if *bye.bye != want {
		t.Errorf("goodbye %+v, want %+v", *bye.bye, want)
	}
	// A router's goodbye goes on its est subject (contract §11).
	if wantSubj := events.EstByeSubject(events.DefaultSubjectPrefix, "Qwen/Qwen3-0.6B", 9); bye.subject != wantSubj {
		t.Errorf("goodbye subject %q, want %q", bye.subject, wantSubj)
	}

	if err := p.Update(3, load(1, -1, -1, -1)); !errors.Is(err, publisher.ErrClosed) {
		t.Errorf("Update after Close = %v, want ErrClosed", err)
	}
	if err := p.Close(t.Context()); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
	// Nothing more: no heartbeat after the goodbye.
	if err := e.obs.FlushTimeout(waitTimeout); err != nil {
		t.Fatalf("flush: %v", err)
	}
	if !in.empty() {
		t.Errorf("message after the goodbye: %+v", in.next(t))
	}
}

// Close returns within its context's deadline when the server is gone, and
// reports why it could not say goodbye.
func TestCloseIsBoundedWithoutServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	p := e.start(t, "m", 1, publisher.WithEndpoint("http://engine:8000"))
	if err := p.Update(0, load(1, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	e.srv.Shutdown()

	const limit = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(t.Context(), limit)
	defer cancel()
	start := time.Now()
	err := p.Close(ctx)
	if took := time.Since(start); took > limit+time.Second {
		t.Errorf("Close took %v with a %v deadline", took, limit)
	}
	if err == nil {
		t.Errorf("Close = nil without a server, want an error")
	}
}
