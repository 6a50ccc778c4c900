package dispatch_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/resched"
	"github.com/workermon/workermon/resched/dispatch"
)

// fakeSource is a fixed view; it writes the records of "mine" and
// "silent" only, under epoch 5, and loses their leases once asked
// loseAfter times (0: never).
type fakeSource struct {
	snap      resched.Snapshot
	loseAfter int
	asked     *atomic.Int32
}

func (f fakeSource) Snapshot(context.Context) (resched.Snapshot, error) { return f.snap, nil }
func (f fakeSource) Epoch(model string) uint64 {
	if n := f.asked.Add(1); f.loseAfter > 0 && int(n) > f.loseAfter {
		return 0
	}
	if model == "mine" || model == "silent" {
		return 5
	}
	return 0
}

func worker(id uint64, usage float64, free bool) resched.Worker {
	return resched.Worker{ID: id, Usage: usage, HasUsage: true, Fresh: true, Free: free}
}

func TestDispatch(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	nc := natstest.Connect(t, srv)
	engine := natstest.Connect(t, srv)
	got := make(chan events.MigrateRequest, 4)
	// Worker 1 of "mine" answers; nobody listens for "silent".
	if _, err := engine.Subscribe(events.MigrateSubject("wm", "mine", 1), func(m *nats.Msg) {
		r, err := events.DecodeMigrateRequest(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		got <- r
		reply, _ := events.MarshalMigrateReply(events.MigrateReply{Migrated: 7}) // more than the 3 asked
		_ = m.Respond(reply)
	}); err != nil {
		t.Fatal(err)
	}
	if err := engine.Flush(); err != nil {
		t.Fatal(err)
	}
	planner, err := resched.New(resched.RecommendedConfig())
	if err != nil {
		t.Fatal(err)
	}
	// Mean 0.4: worker 1 holds 70 of its 100 blocks in 7 requests and
	// gives 30, 3 requests: the pair asks for 3, below the cap of 8.
	hot := []resched.Worker{worker(1, 0.7, false), worker(2, 0.1, true), worker(3, 0.4, true)}
	hot[0].TotalBlocks, hot[0].Requests = 100, 7
	reg := prometheus.NewRegistry()
	d, err := dispatch.New(dispatch.Config{Conn: nc, Prefix: "wm", Interval: time.Hour, MaxRequests: 8,
		Timeout: 500 * time.Millisecond, Planner: planner, Registerer: reg,
		// The leases are lost right after the models were chosen: the
		// requests still carry the epoch they were chosen under.
		Source: fakeSource{snap: resched.Snapshot{Now: time.Unix(1_800_000_000, 0), Models: []resched.Model{
			{Name: "mine", Workers: hot}, {Name: "silent", Workers: hot}, {Name: "not-mine", Workers: hot}}},
			loseAfter: 3, asked: new(atomic.Int32)},
		Endpoint: func(model string, w uint64) string { return "http://w2:8000" }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Round(t.Context()); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-got:
		want := events.MigrateRequest{V: 1, Model: "mine", Src: 1, Dst: 2, DstEndpoint: "http://w2:8000", MaxRequests: 3,
			Reason: resched.PolicyDecodeLoad, Epoch: 5}
		if r != want {
			t.Errorf("request %+v, want %+v", r, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no request reached the engine")
	}
	rounds := d.Rounds()
	if len(rounds) != 1 || len(rounds[0].Pairs) != 2 {
		t.Fatalf("rounds %+v: want one round of two pairs (mine, silent; not the model this monitor does not write)", rounds)
	}
	results := map[string]string{}
	for _, s := range rounds[0].Pairs {
		results[s.Model] = s.Result
	}
	if results["mine"] != dispatch.ResultOK || results["silent"] != dispatch.ResultNoResponders {
		t.Errorf("results %v", results)
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"workermon_rescheduler_pairs_total", map[string]string{"policy": "decode_load"}, 2},
		{"workermon_rescheduler_answers_total", map[string]string{"policy": "decode_load", "result": "ok"}, 1},
		{"workermon_rescheduler_answers_total", map[string]string{"policy": "decode_load", "result": "no_responders"}, 1},
		{"workermon_rescheduler_migrated_requests_total", map[string]string{"policy": "decode_load"}, 3}, // the engine's 7, capped at the 3 asked
	} {
		if v, _ := promtest.Value(t, reg, c.name, c.labels); v != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, v, c.want)
		}
	}
}
