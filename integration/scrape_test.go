//go:build integration

package integration

import (
	"context"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/moby/moby/client"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

// The scrape sidecar's HTTP port in these tests (and in docker-compose.yml).
const scrapePort = "8093/tcp"

// startStockEngine starts worker id as a stock engine would run: `workermon
// sim --publish=false` (no NATS; a vLLM-shaped /metrics) under alias
// sim<id>, and its `workermon scrape` sidecar under alias scrape<id>,
// publishing and registering as the worker's NATS user.
func (s *stack) startStockEngine(id uint64) (sim, sidecar *testcontainers.DockerContainer) {
	s.t.Helper()
	name := "sim" + strconv.FormatUint(id, 10)
	cmd := append([]string{"sim", "--publish=false", "--model", model, "--workers", "1", "--ranks", "2",
		"--worker-id-base", strconv.FormatUint(id, 10), "--host", "0.0.0.0", "--port-base", "8000"},
		s.opts.simArgs...)
	sim = s.run(name, workermonImage, cmd, []string{"8000/tcp"}, wait.ForHTTP("/health").WithPort("8000/tcp"), nil)
	user := engineUser(id)
	sidecar = s.run("scrape"+strconv.FormatUint(id, 10), workermonImage, []string{"scrape",
		"--engine", "vllm", "--metrics-url", "http://" + name + ":8000/metrics", "--model", model,
		"--worker-id", strconv.FormatUint(id, 10), "--endpoint", "http://" + name + ":8000",
		"--interval", "100ms", "--nats-url", s.natsURL, "--http-addr", "0.0.0.0:8093", "--log-level", "debug"},
		[]string{scrapePort}, wait.ForHTTP("/healthz").WithPort(scrapePort), map[string]string{
			"WORKERMON_NATS_USER": user, "WORKERMON_NATS_PASSWORD": passwords[user]})
	if s.t.Failed() {
		s.t.FailNow()
	}
	return sim, sidecar
}

// TestScrapeAdapterEndToEnd runs the adapter path through the containers: a
// simulated engine that does not publish, its `workermon scrape` sidecar,
// the monitor and the router. The worker shows up free and routable (its
// endpoint registered by the sidecar); load through the router fills its
// KV cache, which the sidecar reads from /metrics, and the monitor's record
// says busy, so the router answers 503; when the load stops it is free
// again. When the engine dies the worker goes stale, never free, and the
// sidecar's own shutdown says goodbye.
func TestScrapeAdapterEndToEnd(t *testing.T) {
	const id = 3
	s := startStack(t, stackOptions{natsNodes: 1, router: true,
		monitorArgs: overloadMonitorArgs, simArgs: overloadSimArgs})
	sim, sidecar := s.startStockEngine(id)
	obs := s.observe()
	rc := s.routerClient()

	obs.waitRecord(20*time.Second, "the scraped worker free", func(e entry) bool { return freeAre(e.rec, id) })
	if a := rc.untilOK(15*time.Second, "a request routed to the scraped worker"); a.worker != id {
		t.Fatalf("served by worker %d, want %d (registered by the sidecar)", a.worker, id)
	}

	ctx, stopLoad := context.WithCancel(t.Context())
	defer stopLoad()
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		wg     sync.WaitGroup
	)
	for range 8 {
		wg.Go(func() {
			for ctx.Err() == nil {
				a := rc.complete(ctx, overloadPromptBytes, overloadMaxTokens)
				if ctx.Err() != nil {
					return
				}
				mu.Lock()
				counts[strconv.Itoa(a.status)]++
				mu.Unlock()
				if a.status != http.StatusOK {
					select {
					case <-ctx.Done():
					case <-time.After(50 * time.Millisecond):
					}
				}
			}
		})
	}
	busy := obs.waitRecord(20*time.Second, "the scraped worker busy from its /metrics", func(e entry) bool {
		return e.rec.AllBusy && slices.Equal(e.rec.Busy, []uint64{id})
	})
	if r := busy.rec.Reasons[strconv.Itoa(id)]; r != "kv" {
		t.Errorf("worker %d busy for %q, want kv (the scraped page carries no prefill)", id, r)
	}
	waitFor(t, 20*time.Second, "the router rejecting while the scraped worker is busy", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return counts["503"] >= 5 && counts["200"] >= 2, "answers so far: " + countsString(counts)
	})
	stopLoad()
	wg.Wait()
	obs.waitRecord(20*time.Second, "the scraped worker free after the load", func(e entry) bool { return freeAre(e.rec, id) })

	// The engine stops answering (its container frozen): the sidecar's
	// scrapes time out, it stops publishing after 2 × 100 ms + 1 s, and the
	// monitor lists the worker stale, not free, after --stale-after. Thawed,
	// it is free again under the same boot.
	pause(t, "sim3", sim, true)
	stale := obs.waitRecord(20*time.Second, "the silent engine's worker stale", func(e entry) bool {
		return slices.Contains(e.rec.Stale, id)
	})
	if slices.Contains(stale.rec.Free, id) || slices.Contains(stale.rec.Busy, id) || stale.rec.AllBusy {
		t.Errorf("record %v lists the silent engine's worker free or busy", stale)
	}
	pause(t, "sim3", sim, false)
	obs.waitRecord(20*time.Second, "the worker free again once the engine answers", func(e entry) bool { return freeAre(e.rec, id) })

	// The sidecar's graceful stop says goodbye: the worker leaves the record
	// without ever being listed stale, as it would be had it just gone
	// silent.
	revisions, stop := obs.watch()
	stopCtx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	grace := 10 * time.Second
	if err := sidecar.Stop(stopCtx, &grace); err != nil {
		t.Fatalf("stop the sidecar: %v", err)
	}
	obs.waitRecord(20*time.Second, "the worker gone after the sidecar's goodbye", func(e entry) bool { return !listed(e.rec, id) })
	stop()
	for _, e := range revisions() {
		if slices.Contains(e.rec.Stale, id) {
			t.Errorf("after the sidecar's stop the record listed the worker stale (%v): no goodbye", e)
		}
	}
}

// pause freezes (or thaws) a container: its processes stop answering
// without closing anything.
func pause(t *testing.T, name string, c *testcontainers.DockerContainer, freeze bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var err error
	if freeze {
		_, err = docker.ContainerPause(ctx, c.GetContainerID(), client.ContainerPauseOptions{})
	} else {
		_, err = docker.ContainerUnpause(ctx, c.GetContainerID(), client.ContainerUnpauseOptions{})
	}
	if err != nil {
		t.Fatalf("pause %s (%v): %v", name, freeze, err)
	}
	t.Logf("%s %s", map[bool]string{true: "froze", false: "thawed"}[freeze], name)
}
