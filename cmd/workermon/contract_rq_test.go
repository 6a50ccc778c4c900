package main_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/workermon/workermon/internal/natstest"
)

// rqReport is a router's queue report (contract §22) as it goes on the
// wire.
type rqReport struct {
	V        uint64           `msgpack:"v"`
	Model    string           `msgpack:"model"`
	Source   string           `msgpack:"source"`
	BootID   uint64           `msgpack:"boot_id"`
	Seq      uint64           `msgpack:"seq"`
	Queued   map[int64]uint64 `msgpack:"queued"`
	OldestMs map[int64]uint64 `msgpack:"oldest_ms"`
	SentAt   int64            `msgpack:"sent_at"`
}

// rqSubscriber collects the reports on <prefix>.rq.>.
type rqSubscriber struct {
	mu  sync.Mutex
	got []rqReport
	bad []string
}

func subscribeRq(t *testing.T, nc *nats.Conn, model string) *rqSubscriber {
	t.Helper()
	s := &rqSubscriber{}
	sub, err := nc.Subscribe("workermon.rq.>", func(m *nats.Msg) {
		var r rqReport
		err := msgpack.Unmarshal(m.Data, &r)
		s.mu.Lock()
		defer s.mu.Unlock()
		switch {
		case err != nil:
			s.bad = append(s.bad, fmt.Sprintf("%s: %v", m.Subject, err))
		case m.Subject != "workermon.rq."+modelKey(model) || r.Model != model:
			s.bad = append(s.bad, fmt.Sprintf("report of %q on %s", r.Model, m.Subject))
		default:
			s.got = append(s.got, r)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return s
}

// waitFor waits for a report that ok accepts and returns it.
func (s *rqSubscriber) waitFor(t *testing.T, what string, ok func(r rqReport) bool) rqReport {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		s.mu.Lock()
		if len(s.bad) > 0 {
			t.Fatalf("bad reports: %v", s.bad)
		}
		for _, r := range s.got {
			if ok(r) {
				s.mu.Unlock()
				return r
			}
		}
		n := len(s.got)
		var last any
		if n > 0 {
			last = s.got[n-1]
		}
		s.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no report with %s in 15 s (%d reports, last %+v)", what, n, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestContractRouterPublishesItsQueue (contract §22): a router with flow
// control on publishes {"queued":{0:3}} on its rq subject while it holds
// three standard requests, under its source router/<id>, and an empty map
// once they have left.
func TestContractRouterPublishesItsQueue(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	model := newModel(t)
	lr := keepRecord(t, bkv, model, u64s(1), nil)
	c := connect(t, natsURL)
	sub := subscribeRq(t, c.nc, model)
	r := startRouter(t, natsURL, "--queue-max-wait", "30s", "--router-id", "rq-contract")
	// Registered once the router runs: the registration lives 30 s, and
	// the router's first start waits for its binary to build.
	registerEngines(t, wkv, model, newEngine(t, 1, nil))
	// A request that may not wait gets the all-busy rejection at once once
	// the router has the record and the registration (without the
	// registration it gets a 503 too, but one of no worker registered).
	body := []byte(fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":5}`, model))
	natstest.WaitFor(t, 15*time.Second, "the router rejects a request that may not wait as all busy", func() bool {
		h := doHTTP(t, "POST", r.base+"/v1/completions", "application/json", body, "X-Workermon-Max-Wait", "0")
		return h.code == http.StatusServiceUnavailable && string(h.body) == allBusyBody
	})
	answers := make(chan httpResp, 3)
	for range 3 {
		go func() { answers <- completion(t, r.base, "/v1/completions", model) }()
	}
	held := sub.waitFor(t, "three standard requests", func(r rqReport) bool { return len(r.Queued) == 1 && r.Queued[0] == 3 })
	if held.Source != "router/rq-contract" || held.V != 1 || held.BootID == 0 || held.Seq == 0 || held.SentAt == 0 {
		t.Fatalf("report %+v", held)
	}
	if _, ok := held.OldestMs[0]; !ok || len(held.OldestMs) != 1 {
		t.Fatalf("oldest_ms %v, want priority 0's", held.OldestMs)
	}
	lr.set(nil, u64s(1)) // the worker frees
	for range 3 {
		if a := <-answers; a.code != http.StatusOK || a.header.Get("X-Workermon-Queued") == "" {
			t.Fatalf("queued request: %d %s, X-Workermon-Queued %q", a.code, a.body, a.header.Get("X-Workermon-Queued"))
		}
	}
	empty := sub.waitFor(t, "an empty queue after the three", func(r rqReport) bool { return r.Seq > held.Seq && len(r.Queued) == 0 })
	if empty.Queued == nil || empty.BootID != held.BootID {
		t.Fatalf("last report %+v: want an empty map, the same boot", empty)
	}
}

// keepQueuedRecord re-puts by hand, every 200 ms with a fresh updated_at, a
// record listing free workers and the queues of other routers (contract
// §22) until the test ends.
func keepQueuedRecord(t *testing.T, bkv jetstream.KeyValue, model string, free []uint64, queuedBy map[string]map[int64]uint64) {
	t.Helper()
	queued := map[int64]uint64{}
	for _, q := range queuedBy {
		for p, n := range q {
			queued[p] += n
		}
	}
	put := func(ctx context.Context, seq uint64) error {
		rec := map[string]any{"v": 1, "model": model, "busy": []uint64{}, "free": free, "stale": []uint64{},
			"all_busy": false, "amber": []uint64{}, "hard": []uint64{}, "reasons": map[string]string{}, "thresholds": map[string]any{},
			"routers": uint64(2), "queued_by": queuedBy, "queued": queued,
			"updated_at": time.Now().UnixNano(), "monitor_id": "contract-test", "epoch": uint64(1), "seq": seq}
		b, err := msgpack.Marshal(rec)
		if err != nil {
			return err
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err = bkv.Put(pctx, modelKey(model), b)
		return err
	}
	if err := put(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(200 * time.Millisecond)
		defer tk.Stop()
		for seq := uint64(2); ; seq++ {
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
				_ = put(ctx, seq)
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// TestContractRouterQueuesBehindOtherRouters (contract §22): given a record
// (written by hand) whose queued shows another router's standard requests
// and a free worker, a standard newcomer waits in this router's queue (its
// answer carries X-Workermon-Queued), one that may not wait gets the
// queue's 429 at once, and a critical one goes straight to the worker.
func TestContractRouterQueuesBehindOtherRouters(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	model := newModel(t)
	keepQueuedRecord(t, bkv, model, u64s(1), map[string]map[int64]uint64{"router/other": {0: 3}})
	r := startRouter(t, natsURL, "--queue-max-wait", "10s", "--router-id", "me")
	// Registered once the router runs, as above.
	registerEngines(t, wkv, model, newEngine(t, 1, nil))
	body := []byte(fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":5}`, model))
	url := r.base + "/v1/completions"
	// Once the router has the record, a standard newcomer waits.
	var std httpResp
	natstest.WaitFor(t, 15*time.Second, "a standard request waits", func() bool {
		std = doHTTP(t, "POST", url, "application/json", body)
		return std.header.Get("X-Workermon-Queued") != ""
	})
	if std.code != http.StatusOK {
		t.Fatalf("standard newcomer: %d %s; want 200 after waiting in the queue", std.code, std.body)
	}
	crit := doHTTP(t, "POST", url, "application/json", body, "X-Workermon-Priority", "1")
	if crit.code != http.StatusOK || crit.header.Get("X-Workermon-Queued") != "" {
		t.Fatalf("critical newcomer: %d %s, X-Workermon-Queued %q; want 200 at once", crit.code, crit.body, crit.header.Get("X-Workermon-Queued"))
	}
	noWait := doHTTP(t, "POST", url, "application/json", body, "X-Workermon-Max-Wait", "0")
	if noWait.code != http.StatusTooManyRequests || noWait.header.Get("X-Workermon-Queued") != "0" {
		t.Fatalf("standard newcomer that may not wait: %d %s, X-Workermon-Queued %q; want the queue's 429",
			noWait.code, noWait.body, noWait.header.Get("X-Workermon-Queued"))
	}
}
