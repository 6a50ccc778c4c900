package slotsnats_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsnats"
)

// fakeRegistry is a registry whose entries the test sets.
type fakeRegistry struct {
	mu      sync.Mutex
	entries map[string][]events.WorkerEntry
}

func (r *fakeRegistry) set(model string, es ...events.WorkerEntry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.entries == nil {
		r.entries = make(map[string][]events.WorkerEntry)
	}
	if len(es) == 0 {
		delete(r.entries, model)
		return
	}
	r.entries[model] = es
}

func (r *fakeRegistry) Models() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for m := range r.entries {
		out = append(out, m)
	}
	return out
}

func (r *fakeRegistry) Endpoints(model string) []events.WorkerEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.entries[model]
}

func newTracker(t *testing.T) *slots.Tracker {
	t.Helper()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// run starts f in a goroutine stopped and awaited at cleanup; the returned
// function stops it earlier.
func run(t *testing.T, f func(ctx context.Context)) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(ctx)
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// runSync runs Sync of reg into tr, a pass every 10 ms, for the test.
func runSync(t *testing.T, tr *slots.Tracker, reg slotsnats.Registry) {
	t.Helper()
	cfg := slotsnats.DefaultSyncConfig()
	cfg.Tracker, cfg.Registry, cfg.Every = tr, reg, 10*time.Millisecond
	run(t, func(ctx context.Context) {
		if err := slotsnats.Sync(ctx, cfg); err != nil {
			t.Errorf("Sync: %v", err)
		}
	})
}

// TestSyncFollowsRegistry: entries become registrations with their block
// size (or the default), a changed range is re-registered, a removed entry
// is unregistered, and a worker the tracker refuses does not stop the rest.
func TestSyncFollowsRegistry(t *testing.T) {
	t.Parallel()
	tr, reg := newTracker(t), &fakeRegistry{}
	reg.set("m", events.WorkerEntry{Model: "m", WorkerID: 1, DPSize: 2, BlockSize: 32},
		events.WorkerEntry{Model: "m", WorkerID: 2, DPSize: 1, BlockSize: 64}) // 64 conflicts with 32
	reg.set("n", events.WorkerEntry{Model: "n", WorkerID: 3, DPStart: 4, DPSize: 1})
	runSync(t, tr, reg)

	workers := func() []slots.Worker { return tr.Workers("", "") }
	natstest.WaitFor(t, 5*time.Second, "workers 1 and 3 registered", func() bool { return len(workers()) == 2 })
	w := workers()
	if w[0] != (slots.Worker{WorkerID: 1, Model: "m", Tenant: "default", BlockSize: 32, DPSize: 2}) ||
		w[1] != (slots.Worker{WorkerID: 3, Model: "n", Tenant: "default", BlockSize: slotsnats.DefaultBlockSize, DPStart: 4, DPSize: 1}) {
		t.Fatalf("registered %+v", w)
	}
	must(t, tr.Add(slots.Request{Model: "m", ID: "r", WorkerID: 1, DPRank: 1, NewISLTokens: 7}))

	reg.set("m", events.WorkerEntry{Model: "m", WorkerID: 1, DPSize: 1, BlockSize: 32})
	natstest.WaitFor(t, 5*time.Second, "worker 1 narrowed to one rank", func() bool {
		w := workers()
		return len(w) == 2 && w[0].DPSize == 1
	})
	if l := tr.Loads("m", ""); len(l) != 1 || l[0].ActivePrefillTokens != 0 {
		t.Fatalf("the request on the dropped rank 1 stayed: %+v", l)
	}
	reg.set("n")
	natstest.WaitFor(t, 5*time.Second, "worker 3 unregistered", func() bool { return len(workers()) == 1 })
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// message is one estimate or goodbye as the monitor would decode it.
type message struct {
	subject events.Subject
	report  events.LoadReport
	bye     events.Goodbye
}

// TestEstimates: every rank of a worker with tracked load is published on
// its est subject with the tracker's load summed over tenants and source
// router/<id>; a change goes out at once; an idle worker is not estimated;
// a worker idle for the linger, and every worker at the end, gets a goodbye
// on its est bye subject.
func TestEstimates(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t))
	nc, obs := natstest.Connect(t, srv), natstest.Connect(t, srv)
	msgs := make(chan message, 1024)
	sub, err := obs.Subscribe("wm.>", func(m *nats.Msg) {
		s, err := events.ParseSubject("wm", m.Subject)
		if err != nil {
			t.Errorf("subject %q: %v", m.Subject, err)
			return
		}
		out := message{subject: s}
		switch s.Kind {
		case events.KindEst:
			if out.report, err = events.DecodeLoadReport(m.Data); err == nil {
				err = out.report.Match(s)
			}
		case events.KindEstBye:
			if out.bye, err = events.DecodeGoodbye(m.Data); err == nil {
				err = out.bye.Match(s)
			}
		default:
			t.Errorf("an estimator published on %q", m.Subject)
		}
		if err != nil {
			t.Errorf("message on %q: %v", m.Subject, err)
		}
		msgs <- out
	})
	must(t, err)
	defer sub.Unsubscribe()
	must(t, obs.Flush())

	tr := newTracker(t)
	must(t, tr.Register(slots.Worker{WorkerID: 7, Model: "m", BlockSize: 16, DPStart: 2, DPSize: 2}))
	must(t, tr.Register(slots.Worker{WorkerID: 7, Model: "m", Tenant: "t2", BlockSize: 16, DPStart: 2, DPSize: 2}))
	must(t, tr.Register(slots.Worker{WorkerID: 8, Model: "m", BlockSize: 16, DPSize: 1}))
	must(t, tr.Add(slots.Request{Model: "m", ID: "a", WorkerID: 7, DPRank: 3, Hashes: []uint64{1, 2}, NewISLTokens: 40}))
	must(t, tr.Add(slots.Request{Model: "m", Tenant: "t2", ID: "b", WorkerID: 7, DPRank: 3, Hashes: []uint64{1}, NewISLTokens: 2}))
	stop := run(t, func(ctx context.Context) {
		cfg := slotsnats.DefaultEstimatesConfig()
		cfg.Conn, cfg.Tracker, cfg.ID, cfg.SubjectPrefix = nc, tr, "r1", "wm"
		cfg.Every, cfg.IdleLinger = 10*time.Millisecond, 100*time.Millisecond
		if err := slotsnats.Estimates(ctx, cfg); err != nil {
			t.Errorf("Estimates: %v", err)
		}
	})

	// next waits for a message matching ok, skipping heartbeats.
	next := func(what string, ok func(message) bool) message {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for {
			select {
			case m := <-msgs:
				if ok(m) {
					return m
				}
			case <-deadline:
				t.Fatalf("no %s within 5s", what)
			}
		}
	}
	rank3 := next("estimate of worker 7 rank 3", func(m message) bool {
		return m.subject.Kind == events.KindEst && m.report.WorkerID == 7 && m.report.DPRank == 3
	}).report
	// Summed over tenants: blocks 2 + 1, prefill 40 + 2.
	if rank3.Source != "router/r1" || rank3.DPStart != 2 || rank3.DPSize != 2 ||
		rank3.ActiveDecodeBlocks != events.Some(3) || rank3.ActivePrefillTokens != events.Some(42) ||
		rank3.KVTotalBlocks.Set || rank3.MaxNumBatchedTokens.Set || rank3.KVCommittedBlocks.Set {
		// No request carries committed blocks (as none of Dynamo's /add
		// does): kv_committed_blocks is left out, never 0.
		t.Fatalf("estimate %+v", rank3)
	}
	must(t, tr.PrefillComplete("m", "", "a"))
	next("rank 3 after prefill complete", func(m message) bool {
		return m.subject.Kind == events.KindEst && m.report.WorkerID == 7 && m.report.DPRank == 3 &&
			m.report.ActivePrefillTokens == events.Some(2) && m.report.ActiveDecodeBlocks == events.Some(3)
	})
	// Worker 8 has had no load: nothing was published for it. With a
	// request it is estimated; idle again, it gets a goodbye after the
	// linger.
	must(t, tr.Add(slots.Request{Model: "m", ID: "c", WorkerID: 8, NewISLTokens: 5}))
	first := next("estimate of worker 8", func(m message) bool {
		return m.subject.Kind == events.KindEst && m.report.WorkerID == 8
	}).report
	if first.ActivePrefillTokens != events.Some(5) {
		t.Fatalf("first estimate of worker 8 %+v, want its request's 5 tokens: it was estimated while idle", first)
	}
	must(t, tr.Free("m", "", "c"))
	bye := next("goodbye of worker 8", func(m message) bool { return m.subject.Kind == events.KindEstBye }).bye
	if bye.WorkerID != 8 || bye.Source != "router/r1" {
		t.Fatalf("goodbye %+v, want worker 8's", bye)
	}
	stop()
	bye = next("goodbye of worker 7 at the end", func(m message) bool { return m.subject.Kind == events.KindEstBye }).bye
	if bye.WorkerID != 7 || bye.Source != "router/r1" {
		t.Fatalf("goodbye %+v, want worker 7's", bye)
	}
}

// TestConfigsValidate: every problem of a configuration is named, and the
// defaults with the required fields pass.
func TestConfigsValidate(t *testing.T) {
	t.Parallel()
	sc := slotsnats.SyncConfig{Every: -time.Second}
	err := sc.Validate()
	for _, want := range []string{"a tracker and a registry", "block size 0", "interval -1s"} {
		if err == nil || !strings.Contains(err.Error(), want) || !errors.Is(err, slotsnats.ErrInvalidConfig) {
			t.Errorf("SyncConfig.Validate() = %v, want it to name %q", err, want)
		}
	}
	ec := slotsnats.DefaultEstimatesConfig()
	ec.ID, ec.SubjectPrefix, ec.Heartbeat = "bad\x00id", "a..b", 0
	err = ec.Validate()
	for _, want := range []string{"NATS connection and a tracker", `id "bad\x00id"`, "a..b", "heartbeat 0s"} {
		if err == nil || !strings.Contains(err.Error(), want) || !errors.Is(err, slotsnats.ErrInvalidConfig) {
			t.Errorf("EstimatesConfig.Validate() = %v, want it to name %q", err, want)
		}
	}
	tr := newTracker(t)
	sc = slotsnats.DefaultSyncConfig()
	sc.Tracker, sc.Registry = tr, &fakeRegistry{}
	if err := sc.Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
}

// TestEstimatesStopDuringOutage: while NATS is away, a worker idle past the
// linger gets its goodbye within the pass's one closeTimeout, and an ended
// context stops the pass: Estimates returns within closeTimeout (5 s) of
// its context ending. The goodbyes went one by one on a context of their
// own, 5 s each: with 3 idle workers it returned 15 s after the cancel, and
// a router's shutdown waited that long.
func TestEstimatesStopDuringOutage(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	s := natstest.Start(t, opts)
	nc := natstest.Connect(t, s, nats.ReconnectBufSize(-1)) // as natsconn connects a router
	tr := newTracker(t)
	const workers = 3
	for w := range workers {
		must(t, tr.Register(slots.Worker{WorkerID: uint64(w), Model: "m", BlockSize: 16, DPSize: 1}))
		must(t, tr.Add(slots.Request{Model: "m", ID: fmt.Sprint("r", w), WorkerID: uint64(w), NewISLTokens: 5}))
	}
	sub, err := nc.SubscribeSync("wm.>")
	must(t, err)
	must(t, nc.Flush())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		cfg := slotsnats.DefaultEstimatesConfig()
		cfg.Conn, cfg.Tracker, cfg.ID, cfg.SubjectPrefix = nc, tr, "r1", "wm"
		cfg.Every, cfg.IdleLinger = 10*time.Millisecond, 50*time.Millisecond
		done <- slotsnats.Estimates(ctx, cfg)
	}()
	returned := false
	defer func() {
		cancel()
		if !returned {
			<-done
		}
	}()
	seen := map[string]bool{}
	for len(seen) < workers {
		m, err := sub.NextMsg(5 * time.Second)
		must(t, err)
		seen[m.Subject] = true
	}

	// NATS goes away; the requests end; the linger passes.
	natstest.Stop(t, s, opts)
	for w := range workers {
		must(t, tr.Free("m", "", fmt.Sprint("r", w)))
	}
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		returned = true
		if err != nil {
			t.Errorf("Estimates: %v", err)
		}
	case <-time.After(8 * time.Second): // closeTimeout and a margin for a slow machine
		t.Fatalf("Estimates has not returned %v after its context ended: the goodbyes wait out a timeout each", time.Since(start).Round(time.Second))
	}
}

// TestSyncFollowsTheTracker: Sync registers again a worker whose entry
// lives but that the tracker lost (POST /unregister: it was never
// registered again, every /add answered 404), and a model's only worker
// whose entry changed its block size (refused as a conflict with itself).
func TestSyncFollowsTheTracker(t *testing.T) {
	t.Parallel()
	tr, reg := newTracker(t), &fakeRegistry{}
	reg.set("m", events.WorkerEntry{Model: "m", WorkerID: 1, DPSize: 1, BlockSize: 16})
	runSync(t, tr, reg)
	natstest.WaitFor(t, 5*time.Second, "worker 1 registered", func() bool { return len(tr.Workers("m", "")) == 1 })
	must(t, tr.Unregister("m", "", 1))
	natstest.WaitFor(t, 5*time.Second, "worker 1 registered again", func() bool { return len(tr.Workers("m", "")) == 1 })
	reg.set("m", events.WorkerEntry{Model: "m", WorkerID: 1, DPSize: 1, BlockSize: 32})
	natstest.WaitFor(t, 5*time.Second, "the new block size", func() bool { return tr.BlockSize("m", "") == 32 })
}
