//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/testcontainers/testcontainers-go"
)

// Overload: the simulated ranks have 64 KV blocks of 16 tokens; a request of
// 2,000 bytes (501 prompt tokens) and 32 new tokens holds 32 to 34 blocks,
// more than 40% of a rank, for 1.6 s at 20 tokens/s. So one request per rank
// makes it busy, and four in flight make both workers busy.
var (
	overloadMonitorArgs = []string{"--active-decode-blocks-threshold", "0.4"}
	overloadSimArgs     = []string{"--kv-blocks", "64", "--decode-speed", "20"}
)

const (
	overloadPromptBytes = 2000
	overloadMaxTokens   = 32
	overloadClients     = 16
)

// The rejection body of the contract (section 7) at status 503.
var rejectionBody = map[string]any{
	"message": "Service temporarily unavailable: All workers are busy, please retry later",
	"type":    "service_unavailable",
	"code":    float64(503),
	"error": map[string]any{
		"message": "Service temporarily unavailable: All workers are busy, please retry later",
		"type":    "service_unavailable",
		"param":   nil,
		"code":    float64(503),
	},
}

// TestOverloadRejectedThenRecovers closes the loop through the containers:
// load from the test through the router makes the simulated workers busy,
// their reports reach the monitor, the monitor's record says all_busy, the
// router answers 503 with the contract's body; when the load stops the
// workers are free again and the router admits.
func TestOverloadRejectedThenRecovers(t *testing.T) {
	s := startStack(t, stackOptions{natsNodes: 1, sims: 2, router: true,
		monitorArgs: overloadMonitorArgs, simArgs: overloadSimArgs})
	obs, rc, _ := s.routing(15 * time.Second)

	t.Logf("overload: %d clients, each a loop of %d-byte prompts and max_tokens %d", overloadClients, overloadPromptBytes, overloadMaxTokens)
	ctx, stopLoad := context.WithCancel(t.Context())
	defer stopLoad()
	var (
		mu         sync.Mutex
		counts     = map[string]int{}
		rejections []answer
		firstAt    time.Duration
		wg         sync.WaitGroup
	)
	start := time.Now()
	for range overloadClients {
		wg.Go(func() {
			for ctx.Err() == nil {
				a := rc.complete(ctx, overloadPromptBytes, overloadMaxTokens)
				if ctx.Err() != nil {
					return // cut by the end of the load, not an answer
				}
				mu.Lock()
				switch {
				case a.err != nil:
					counts["error"]++
					t.Errorf("request during overload: %v", a)
				default:
					counts[strconv.Itoa(a.status)]++
				}
				if a.status == http.StatusServiceUnavailable {
					if len(rejections) == 0 {
						firstAt = time.Since(start)
					}
					rejections = append(rejections, a)
				}
				mu.Unlock()
				if a.status != http.StatusOK {
					// Rejections come back at once: pace the retries.
					select {
					case <-ctx.Done():
					case <-time.After(50 * time.Millisecond):
					}
				}
			}
		})
	}
	busy := obs.waitRecord(20*time.Second, "the monitor's record says every worker is busy", func(e entry) bool { return e.rec.AllBusy })
	if !slices.Equal(busy.rec.Busy, []uint64{1, 2}) || len(busy.rec.Free) != 0 {
		t.Errorf("all_busy record lists busy %v free %v, want busy [1 2] and none free", busy.rec.Busy, busy.rec.Free)
	}
	for _, id := range []string{"1", "2"} {
		if r := busy.rec.Reasons[id]; r != "kv" && r != "kv+prefill" {
			t.Errorf("worker %s busy for %q, want kv or kv+prefill", id, r)
		}
	}
	// Until some requests were rejected and some admitted ones completed:
	// the loop sheds load, it does not stop serving.
	waitFor(t, 20*time.Second, "the router rejecting requests while serving others", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return counts["503"] >= 10 && counts["200"] >= 4, "answers so far: " + countsString(counts)
	})
	stopLoad()
	wg.Wait()
	mu.Lock()
	t.Logf("load ran %v: %s; first 503 after %v", time.Since(start).Round(time.Millisecond), countsString(counts), firstAt.Round(time.Millisecond))
	first := rejections[0]
	mu.Unlock()

	// The rejection is the contract's.
	t.Logf("first rejection: %d, Content-Type %q, Retry-After %q, body %s", first.status, first.ctype, first.retryAfter, first.body)
	if first.ctype != "application/json" {
		t.Errorf("rejection Content-Type %q, want application/json", first.ctype)
	}
	if n, err := strconv.Atoi(first.retryAfter); err != nil || n < 1 {
		t.Errorf("rejection Retry-After %q, want whole seconds >= 1", first.retryAfter)
	}
	var body map[string]any
	if err := json.Unmarshal([]byte(first.body), &body); err != nil || !reflect.DeepEqual(body, rejectionBody) {
		t.Errorf("rejection body %s, want %v", first.body, rejectionBody)
	}
	if counts["200"] == 0 {
		t.Error("no request was served during the load")
	}

	// Recovery.
	obs.waitRecord(30*time.Second, "workers free again after the load", func(e entry) bool { return freeAre(e.rec, 1, 2) })
	rc.untilOK(15*time.Second, "the router admitting again")
	mfs := rc.metrics()
	rejected := counter(mfs, "workermon_router_requests_rejected_total", map[string]string{"model": model})
	t.Logf("router metrics: workermon_router_requests_rejected_total{model=%q} = %v", model, rejected)
	if int(rejected) < len(rejections) {
		t.Errorf("router counted %v rejections, the test saw %d", rejected, len(rejections))
	}
}

// TestNATSRestart stops the NATS server and starts it again: the monitor,
// the workers and the router reconnect by themselves, fresh records follow,
// and none of them crashed or restarted.
func TestNATSRestart(t *testing.T) {
	s := startStack(t, stackOptions{natsNodes: 1, sims: 2, router: true})
	obs, rc, before := s.routing(15 * time.Second)
	survivors := s.survivors()
	obs.close()

	stopped := time.Now()
	timeout := 5 * time.Second
	if err := s.nats[0].Stop(t.Context(), &timeout); err != nil {
		t.Fatalf("stop NATS: %v", err)
	}
	t.Logf("NATS stopped in %v; keeping it down for 3s", time.Since(stopped).Round(time.Millisecond))
	time.Sleep(3 * time.Second)
	restarted := time.Now()
	if err := s.nats[0].Start(t.Context()); err != nil {
		t.Fatalf("start NATS: %v", err)
	}
	t.Logf("NATS started again and healthy after %v (down %v)", time.Since(restarted).Round(time.Millisecond),
		time.Since(stopped).Round(time.Millisecond))

	obs = s.observe() // the mapped port changed with the restart
	after := obs.waitRecord(20*time.Second, "a fresh record written after the restart", func(e entry) bool {
		return e.rec.UpdatedAt > restarted.UnixNano() && freeAre(e.rec, 1, 2)
	})
	if after.rec.UpdatedAt <= before.rec.UpdatedAt || after.rev <= before.rev {
		t.Errorf("record did not move on: before %v, after %v", before, after)
	}
	if after.rec.Epoch != before.rec.Epoch {
		t.Errorf("epoch changed from %d to %d: the monitor restarted", before.rec.Epoch, after.rec.Epoch)
	}
	// More puts follow: heartbeats resumed, not one lucky put.
	obs.waitRecord(5*time.Second, "heartbeats resumed", func(e entry) bool { return e.rec.UpdatedAt > after.rec.UpdatedAt })
	rc.untilOK(20*time.Second, "the router routing after the restart")
	s.requireSurvivors(survivors)
}

// TestMonitorRestart stops the monitor and starts it again: the record in
// the bucket keeps its lists and updated_at through the new monitor's
// warm-up (the takeover's claim re-puts it under the new epoch, contract
// §10; no record from a partial view), then records follow with a higher
// epoch and every worker in them.
func TestMonitorRestart(t *testing.T) {
	s := startStack(t, stackOptions{natsNodes: 1, sims: 2})
	obs := s.observe()
	first := obs.waitBothFree(15 * time.Second)
	entries, stopWatch := obs.watch()

	timeout := 5 * time.Second
	if err := s.monitor.Stop(t.Context(), &timeout); err != nil {
		t.Fatalf("stop monitor: %v", err)
	}
	last, ok, err := obs.record()
	if err != nil || !ok {
		t.Fatalf("record after the monitor stopped: ok=%v err=%v", ok, err)
	}
	t.Logf("monitor stopped; the record it left: %v", last)
	time.Sleep(time.Second)

	if err := s.monitor.Start(t.Context()); err != nil {
		t.Fatalf("start monitor: %v", err)
	}
	started := startedAt(t, s.monitor)
	// The lease is taken one --lease-ttl after the start (the previous one
	// was released on SIGTERM), then the warm-up runs.
	warmEnd := started.Add(leaseTTL + warmup)
	t.Logf("monitor started again at %s and ready; warm-up until %s", started.Format(time.RFC3339Nano), warmEnd.Format(time.RFC3339Nano))
	polls := 0
	for time.Until(warmEnd) > 200*time.Millisecond {
		e, ok, err := obs.record()
		if err != nil || !ok {
			t.Fatalf("record during warm-up: ok=%v err=%v", ok, err)
		}
		claimed := e.rec
		claimed.MonitorID, claimed.Epoch, claimed.Seq = last.rec.MonitorID, last.rec.Epoch, last.rec.Seq
		if !reflect.DeepEqual(claimed, last.rec) {
			t.Fatalf("record changed during the warm-up: %v, was %v", e, last)
		}
		polls++
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("during the warm-up the record kept its lists and updated_at (%d reads)", polls)

	next := obs.waitRecord(10*time.Second, "a record of the new monitor", func(e entry) bool { return e.rec.Epoch > first.rec.Epoch })
	if next.rec.Epoch != first.rec.Epoch+1 {
		t.Errorf("new epoch %d, want %d", next.rec.Epoch, first.rec.Epoch+1)
	}
	// Watch a few heartbeats of the new monitor before judging them all.
	time.Sleep(2 * heartbeat)
	stopWatch()
	var fresh []entry
	for _, e := range entries() {
		claim := e.rec.Seq == 1 && e.rec.UpdatedAt == last.rec.UpdatedAt
		if e.rev > last.rev && !claim {
			fresh = append(fresh, e)
		}
	}
	if len(fresh) == 0 {
		t.Fatal("the watch saw no record after the restart")
	}
	firstWrite := time.Unix(0, fresh[0].rec.UpdatedAt)
	t.Logf("first record after the restart, %v after the start: %v", firstWrite.Sub(started).Round(time.Millisecond), fresh[0])
	if firstWrite.Before(warmEnd) {
		t.Errorf("first write at %s, before the warm-up ended at %s", firstWrite.Format(time.RFC3339Nano), warmEnd.Format(time.RFC3339Nano))
	}
	for _, e := range fresh {
		if e.rec.Epoch != first.rec.Epoch+1 || !listed(e.rec, 1) || !listed(e.rec, 2) || len(e.rec.Stale) != 0 {
			t.Errorf("partial or foreign record after the restart: %v", e)
		}
	}
	t.Logf("%d records after the restart, every one of epoch %d with both workers", len(fresh), first.rec.Epoch+1)
}

// TestWorkerKilled kills a worker's container: the record marks it stale,
// then drops it, and the router stops sending it requests.
func TestWorkerKilled(t *testing.T) {
	s := startStack(t, stackOptions{natsNodes: 1, sims: 2, router: true})
	obs, rc, _ := s.routing(15 * time.Second)
	t.Logf("before the fault, 16 requests were served by %s", servedString(rc.spread(16, 8, 400, 8)))

	killed := time.Now()
	kill(t, "sim2", s.sims[2])
	s.expectWorkerLeaves(obs, rc, killed)
}

// TestWorkerPartitioned cuts a worker from the network: the record marks it
// stale, then drops it, and the router stops sending it requests; once back
// on the network it is free again and served requests again.
func TestWorkerPartitioned(t *testing.T) {
	s := startStack(t, stackOptions{natsNodes: 1, sims: 2, router: true})
	obs, rc, _ := s.routing(15 * time.Second)
	survivors := s.survivors()

	cut := time.Now()
	s.disconnect("sim2", s.sims[2])
	s.expectWorkerLeaves(obs, rc, cut)

	healed := time.Now()
	s.reconnect("sim2", s.sims[2])
	obs.waitRecord(30*time.Second, "worker 2 free again after the partition healed", func(e entry) bool { return freeAre(e.rec, 1, 2) })
	waitFor(t, 20*time.Second, "worker 2 serving requests through the router again", func() (bool, string) {
		served := rc.spread(8, 4, 400, 8)
		return served[2] > 0, "served by " + servedString(served)
	})
	t.Logf("partition healed: worker 2 back %v after the reconnect", time.Since(healed).Round(time.Millisecond))
	s.requireSurvivors(survivors)
}

// expectWorkerLeaves follows worker 2 out after a fault at since: stale
// within about --stale-after, gone within about --gone-after, and while it
// is out the router serves every request from worker 1 without touching
// worker 2 (its upstream error count does not move).
func (s *stack) expectWorkerLeaves(obs *observer, rc *routerClient, since time.Time) {
	t := s.t
	t.Helper()
	stale := obs.waitRecord(staleAfter+5*time.Second, "worker 2 stale", func(e entry) bool {
		return slices.Equal(e.rec.Stale, []uint64{2}) && slices.Equal(e.rec.Free, []uint64{1})
	})
	t.Logf("worker 2 stale %v after the fault (--stale-after %v)", time.Since(since).Round(time.Millisecond), staleAfter)
	if stale.rec.AllBusy {
		t.Errorf("all_busy with a free worker: %v", stale)
	}
	errsBefore := upstreamFailures(rc.metrics())
	served := rc.spread(12, 4, 400, 8)
	t.Logf("with worker 2 stale, 12 requests were served by %s", servedString(served))
	if served[2] != 0 || served[1] != 12 {
		t.Errorf("requests went to %v, want all 12 to worker 1", served)
	}

	obs.waitRecord(goneAfter+5*time.Second, "worker 2 gone from the record", func(e entry) bool {
		return !listed(e.rec, 2) && slices.Equal(e.rec.Free, []uint64{1})
	})
	t.Logf("worker 2 gone %v after the fault (--gone-after %v)", time.Since(since).Round(time.Millisecond), goneAfter)
	served = rc.spread(12, 4, 400, 8)
	t.Logf("with worker 2 gone, 12 requests were served by %s", servedString(served))
	if served[2] != 0 || served[1] != 12 {
		t.Errorf("requests went to %v, want all 12 to worker 1", served)
	}
	errsAfter := upstreamFailures(rc.metrics())
	t.Logf("router upstream errors+retries: %v before, %v after", errsBefore, errsAfter)
	if errsAfter != errsBefore {
		t.Errorf("the router tried worker 2: upstream errors+retries went from %v to %v", errsBefore, errsAfter)
	}
}

// TestNATSClusterNodeLoss runs the loop on a three-node NATS cluster with
// the buckets at three replicas and kills the node that leads the busy
// bucket: records keep being written and the router keeps routing.
func TestNATSClusterNodeLoss(t *testing.T) {
	s := startStack(t, stackOptions{natsNodes: 3, replicas: 3, sims: 2, router: true})
	obs, rc, _ := s.routing(20 * time.Second)
	leader := obs.waitReplicasCurrent(20*time.Second, "KV_workermon-busy", 3)
	obs.waitReplicasCurrent(20*time.Second, "KV_workermon-workers", 3)
	survivors := s.survivors()

	idx := slices.Index(s.natsIDs, leader)
	if idx < 0 {
		t.Fatalf("leader %q is none of %v", leader, s.natsIDs)
	}
	killed := time.Now()
	kill(t, leader+" (leader of the busy bucket)", s.nats[idx])

	after := obs.waitRecord(20*time.Second, "a record written after the node loss", func(e entry) bool {
		return e.rec.UpdatedAt > killed.UnixNano() && freeAre(e.rec, 1, 2)
	})
	t.Logf("first record after the node loss %v after the kill", time.Unix(0, after.rec.UpdatedAt).Sub(killed).Round(time.Millisecond))
	newLeader := obs.waitReplicasCurrent(20*time.Second, "KV_workermon-busy", 2)
	if newLeader == leader {
		t.Errorf("the busy bucket is still led by the dead node %s", leader)
	}
	// Records keep coming, at heartbeat pace.
	prev := after
	for i := range 3 {
		prev = obs.waitRecord(5*time.Second, "record "+strconv.Itoa(i+2)+" after the node loss", func(e entry) bool {
			return e.rec.UpdatedAt > prev.rec.UpdatedAt && freeAre(e.rec, 1, 2)
		})
	}
	rc.untilOK(20*time.Second, "the router routing after the node loss")
	served := rc.spread(8, 4, 400, 8)
	t.Logf("after the node loss, 8 requests were served by %s", servedString(served))
	s.requireSurvivors(survivors)
}

// waitReplicasCurrent waits until the stream has a leader and want peers in
// all (leader included) that are current, and returns the leader's name.
func (o *observer) waitReplicasCurrent(timeout time.Duration, stream string, want int) string {
	o.t.Helper()
	var leader string
	waitFor(o.t, timeout, stream+" with "+strconv.Itoa(want)+" current replicas", func() (bool, string) {
		ctx, cancel := context.WithTimeout(o.t.Context(), opTimeout)
		defer cancel()
		st, err := o.js.Stream(ctx, stream)
		if err != nil {
			return false, err.Error()
		}
		info, err := st.Info(ctx)
		if err != nil {
			return false, err.Error()
		}
		c := info.Cluster
		if c == nil || c.Leader == "" {
			return false, "no leader"
		}
		current := 1
		var peers []string
		for _, p := range c.Replicas {
			peers = append(peers, p.Name+" current="+strconv.FormatBool(p.Current)+" offline="+strconv.FormatBool(p.Offline))
			if p.Current && !p.Offline {
				current++
			}
		}
		leader = c.Leader
		return current >= want, "leader " + c.Leader + ", peers " + joinComma(peers)
	})
	return leader
}

// survivors notes the lifecycle of the containers that must survive a fault
// that is not theirs.
func (s *stack) survivors() map[string]lifecycle {
	m := map[string]lifecycle{"monitor": inspectLifecycle(s.t, s.monitor)}
	for id, c := range s.sims {
		m["sim"+strconv.FormatUint(id, 10)] = inspectLifecycle(s.t, c)
	}
	if s.router != nil {
		m["router"] = inspectLifecycle(s.t, s.router)
	}
	return m
}

func (s *stack) requireSurvivors(before map[string]lifecycle) {
	s.t.Helper()
	for _, name := range slices.Sorted(maps.Keys(before)) {
		requireSurvived(s.t, name, s.container(name), before[name])
	}
}

func (s *stack) container(name string) *testcontainers.DockerContainer {
	switch name {
	case "monitor":
		return s.monitor
	case "router":
		return s.router
	}
	id, _ := strconv.ParseUint(name[len("sim"):], 10, 64)
	return s.sims[id]
}

// startedAt is when a container's current process started.
func startedAt(t *testing.T, c *testcontainers.DockerContainer) time.Time {
	t.Helper()
	ts, err := time.Parse(time.RFC3339Nano, inspectLifecycle(t, c).startedAt)
	if err != nil {
		t.Fatalf("start time: %v", err)
	}
	return ts
}

// upstreamFailures is the router's count of failed and repeated attempts
// to reach workers.
func upstreamFailures(mfs map[string]*dto.MetricFamily) float64 {
	return counter(mfs, "workermon_router_upstream_errors_total", nil) +
		counter(mfs, "workermon_router_upstream_retries_total", nil)
}
