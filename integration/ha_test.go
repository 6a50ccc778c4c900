//go:build integration

package integration

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestMonitorTakeover runs two monitors on a three-node NATS cluster, the
// buckets at three replicas (docs/ha.md): the one that holds
// the partition is killed with SIGKILL under steady traffic. The standby
// takes the partition over; throughout, the router never fails open (no
// stale list), every request is served (no 503 caused by the takeover),
// and the busy list is right afterwards.
func TestMonitorTakeover(t *testing.T) {
	// heartbeat + lease TTL + warm-up is 3.5 s here: the router's
	// stale-list-after must be above it (with the defaults: 2 + 3 + 2 s
	// against 10 s).
	s := startStack(t, stackOptions{natsNodes: 3, replicas: 3, sims: 2, router: true, monitors: 2,
		routerStaleListAfter: 6 * time.Second})
	obs, rc, first := s.routing(20 * time.Second)
	holder := first.rec.MonitorID
	alias := strings.TrimSuffix(holder, "-it")
	victim := s.monitors[alias]
	if victim == nil {
		t.Fatalf("the record's writer %q is none of the monitors", holder)
	}
	staleOpen := func() float64 {
		return counter(rc.metrics(), "workermon_router_admissions_total", map[string]string{"outcome": "stale_open"})
	}
	openBefore := staleOpen()

	// Steady traffic, one small request every 50 ms, until stopped.
	ctx, stop := context.WithCancel(t.Context())
	var (
		mu       sync.Mutex
		answers  int
		failures []string
		done     = make(chan struct{})
	)
	go func() {
		defer close(done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			a := rc.complete(rctx, 64, 4)
			cancel()
			if ctx.Err() != nil {
				return
			}
			mu.Lock()
			answers++
			if a.err != nil || a.status != 200 {
				failures = append(failures, a.String())
			}
			mu.Unlock()
		}
	}()

	time.Sleep(time.Second)
	kill(t, alias+" (the partition's holder)", victim)
	killed := time.Now()
	after := obs.waitRecord(20*time.Second, "a record of the standby", func(e entry) bool {
		return e.rec.MonitorID != holder && e.rec.UpdatedAt > killed.UnixNano() && freeAre(e.rec, 1, 2)
	})
	t.Logf("the standby (%s, epoch %d) wrote its first record %v after the kill; the old epoch was %d",
		after.rec.MonitorID, after.rec.Epoch, time.Unix(0, after.rec.UpdatedAt).Sub(killed).Round(time.Millisecond), first.rec.Epoch)
	if after.rec.Epoch <= first.rec.Epoch {
		t.Errorf("epoch after the takeover %d, not above %d", after.rec.Epoch, first.rec.Epoch)
	}
	time.Sleep(2 * time.Second) // traffic after the takeover too
	stop()
	<-done

	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d requests during the takeover, %d not served", answers, len(failures))
	for _, f := range failures {
		t.Errorf("request not served during the takeover: %s", f)
	}
	if answers < 20 {
		t.Errorf("only %d requests sent during the takeover", answers)
	}
	if d := staleOpen() - openBefore; d != 0 {
		t.Errorf("the router failed open %v times: it saw a stale list during the takeover", d)
	}
}
