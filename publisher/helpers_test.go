package publisher_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/publisher"
)

// waitTimeout bounds every wait for something to arrive over the network.
const waitTimeout = 10 * time.Second

// message is one report or goodbye as a subscriber received it, decoded and
// checked against its subject.
type message struct {
	subject string
	report  *events.LoadReport
	bye     *events.Goodbye
}

// inbox subscribes to everything under a prefix.
type inbox struct {
	prefix string
	ch     chan *nats.Msg
}

// subscribe returns an inbox of every message under prefix, subscribed on
// the server before it returns.
func subscribe(t *testing.T, nc *nats.Conn, prefix string) *inbox {
	t.Helper()
	in := &inbox{prefix: prefix, ch: make(chan *nats.Msg, 1<<14)}
	sub, err := nc.ChanSubscribe(prefix+".>", in.ch)
	if err != nil {
		t.Fatalf("subscribe: %v", err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.FlushTimeout(waitTimeout); err != nil {
		t.Fatalf("flush subscription: %v", err)
	}
	return in
}

// next returns the next message, failing the test if none arrives in time
// or if it does not decode or match its subject.
func (in *inbox) next(t *testing.T) message {
	t.Helper()
	select {
	case m := <-in.ch:
		return in.decode(t, m)
	case <-time.After(waitTimeout):
		t.Fatalf("no message under %s.> within %v", in.prefix, waitTimeout)
		return message{}
	}
}

// waitReport returns the first report for which ok holds, failing the test
// if a goodbye comes first or none arrives in time.
func (in *inbox) waitReport(t *testing.T, ok func(events.LoadReport) bool) events.LoadReport {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		m := in.next(t)
		if m.report == nil {
			t.Fatalf("got a goodbye on %s while waiting for a report", m.subject)
		}
		if ok(*m.report) {
			return *m.report
		}
	}
	t.Fatalf("no matching report within %v", waitTimeout)
	return events.LoadReport{}
}

// empty reports whether no message is waiting.
func (in *inbox) empty() bool { return len(in.ch) == 0 }

func (in *inbox) decode(t *testing.T, m *nats.Msg) message {
	t.Helper()
	s, err := events.ParseSubject(in.prefix, m.Subject)
	if err != nil {
		t.Fatalf("parse subject: %v", err)
	}
	out := message{subject: m.Subject}
	switch s.Kind {
	case events.KindLoad, events.KindEst:
		r, err := events.DecodeLoadReport(m.Data)
		if err != nil {
			t.Fatalf("decode report on %s: %v", m.Subject, err)
		}
		if err := r.Match(s); err != nil {
			t.Fatalf("report on %s: %v", m.Subject, err)
		}
		out.report = &r
	case events.KindBye, events.KindEstBye:
		g, err := events.DecodeGoodbye(m.Data)
		if err != nil {
			t.Fatalf("decode goodbye on %s: %v", m.Subject, err)
		}
		if err := g.Match(s); err != nil {
			t.Fatalf("goodbye on %s: %v", m.Subject, err)
		}
		out.bye = &g
	}
	return out
}

// env is a server with a connection for the publisher and one for the test.
type env struct {
	srv  *server.Server
	opts *server.Options
	pub  *nats.Conn // the publisher's connection
	obs  *nats.Conn // the observer's connection
}

// newEnv starts a server with natstest.Options, changed by configure.
func newEnv(t testing.TB, configure ...func(*server.Options)) *env {
	t.Helper()
	opts := natstest.Options(t)
	for _, c := range configure {
		c(opts)
	}
	s := natstest.Start(t, opts)
	return &env{srv: s, opts: opts, pub: natstest.Connect(t, s), obs: natstest.Connect(t, s)}
}

// start returns a new Publisher closed at the end of the test.
func (e *env) start(t testing.TB, model string, worker uint64, opts ...publisher.Option) *publisher.Publisher {
	t.Helper()
	p, err := publisher.New(e.pub, model, worker, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	// t.Context is already cancelled when cleanups run.
	t.Cleanup(func() { _ = p.Close(context.Background()) })
	return p
}

// load builds a Load from the four fields; a negative value leaves the field
// unset.
func load(activeDecode, kvTotal, activePrefill, maxBatched int64) publisher.Load {
	opt := func(v int64) events.Optional {
		if v < 0 {
			return events.Optional{}
		}
		return events.Some(uint64(v))
	}
	return publisher.Load{
		ActiveDecodeBlocks:  opt(activeDecode),
		KVTotalBlocks:       opt(kvTotal),
		ActivePrefillTokens: opt(activePrefill),
		MaxNumBatchedTokens: opt(maxBatched),
	}
}

// leading builds a Load from the five fields of contract §21; a negative
// value leaves the field unset.
func leading(waiting, running, preemptions, prefilled, committed int64) publisher.Load {
	l := publisher.Load{}
	for _, f := range []struct {
		dst *events.Optional
		v   int64
	}{{&l.WaitingRequests, waiting}, {&l.RunningRequests, running}, {&l.Preemptions, preemptions},
		{&l.PrefilledTokens, prefilled}, {&l.KVCommittedBlocks, committed}} {
		if f.v >= 0 {
			*f.dst = events.Some(uint64(f.v))
		}
	}
	return l
}

// loadOf returns the load fields of a report.
func loadOf(r events.LoadReport) publisher.Load {
	return publisher.Load{
		ActiveDecodeBlocks:  r.ActiveDecodeBlocks,
		KVTotalBlocks:       r.KVTotalBlocks,
		ActivePrefillTokens: r.ActivePrefillTokens,
		MaxNumBatchedTokens: r.MaxNumBatchedTokens,
		WaitingRequests:     r.WaitingRequests,
		RunningRequests:     r.RunningRequests,
		Preemptions:         r.Preemptions,
		PrefilledTokens:     r.PrefilledTokens,
		KVCommittedBlocks:   r.KVCommittedBlocks,
	}
}

// logRecorder is a slog.Handler that keeps the messages logged through it,
// safe for concurrent use.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *logRecorder) WithGroup(string) slog.Handler            { return h }

func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.msgs = append(h.msgs, r.Message)
	return nil
}

// count returns how many times msg was logged.
func (h *logRecorder) count(msg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, m := range h.msgs {
		if m == msg {
			n++
		}
	}
	return n
}
