package main_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// haBusyWatch watches the busy bucket like a router and checks what the
// contract promises across takeovers: a key's epoch never goes down, and
// within an epoch its seq goes up.
type haBusyWatch struct {
	mu    sync.Mutex
	last  map[string]events.BusySet // by model
	puts  []events.BusySet          // every put, in order
	worst time.Duration             // oldest record held at any moment
	errs  []string
}

func watchBusy(t *testing.T, js jetstream.JetStream) *haBusyWatch {
	t.Helper()
	kv, err := js.CreateOrUpdateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: events.BusyBucket, History: 1})
	if err != nil {
		t.Fatal(err)
	}
	w := &haBusyWatch{last: map[string]events.BusySet{}}
	ctx, cancel := context.WithCancel(t.Context())
	kw, err := kv.WatchAll(ctx, jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(25 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case e, ok := <-kw.Updates():
				if !ok {
					return
				}
				if e == nil || e.Operation() != jetstream.KeyValuePut {
					continue
				}
				rec, err := events.DecodeBusySet(e.Value())
				w.mu.Lock()
				if err != nil {
					w.errs = append(w.errs, fmt.Sprintf("%s: %v", e.Key(), err))
				} else {
					if prev, ok := w.last[rec.Model]; ok {
						if rec.Epoch < prev.Epoch {
							w.errs = append(w.errs, fmt.Sprintf("%s: epoch went down %d (%s) -> %d (%s)",
								rec.Model, prev.Epoch, prev.MonitorID, rec.Epoch, rec.MonitorID))
						} else if rec.Epoch == prev.Epoch && rec.Seq <= prev.Seq {
							w.errs = append(w.errs, fmt.Sprintf("%s: seq %d after %d in epoch %d", rec.Model, rec.Seq, prev.Seq, rec.Epoch))
						}
					}
					w.last[rec.Model] = rec
					w.puts = append(w.puts, rec)
				}
				w.mu.Unlock()
			case now := <-tick.C:
				w.mu.Lock()
				for _, rec := range w.last {
					w.worst = max(w.worst, now.Sub(time.Unix(0, rec.UpdatedAt)))
				}
				w.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return w
}

// writers returns the monitor id of each model's last record.
func (w *haBusyWatch) writers() map[string]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string]string{}
	for m, rec := range w.last {
		out[m] = rec.MonitorID
	}
	return out
}

// TestHAProcesses runs two `workermon serve` processes with four partitions
// on one NATS server carrying the partition mapping, under steady reports:
// a monitor paused with SIGSTOP past its lease TTL loses its partitions to
// the other and, resumed, never writes again under its old epochs; a
// monitor killed with SIGKILL has its partitions taken over. Throughout, a
// router watching the bucket sees no epoch go down and no record older
// than a few heartbeats, and the lists stay right.
func TestHAProcesses(t *testing.T) {
	t.Parallel()
	const (
		parts  = 4
		models = 8
		ttl    = time.Second
	)
	opts := natstest.Options(t)
	srv := natstest.Start(t, opts)
	for _, m := range events.PartitionMappings(prefix, parts) {
		if err := srv.GlobalAccount().AddMapping(m.From, m.To); err != nil {
			t.Fatal(err)
		}
	}
	url := srv.ClientURL()
	c := connect(t, url)
	obs := watchBusy(t, c.js)

	start := func(id string) *monitor {
		return startMonitor(t, monOpt{natsURL: url, flags: []string{"--monitor-id", id, "--partitions", fmt.Sprint(parts),
			"--lease-ttl", ttl.String(), "--gone-after", "60s", "--stale-after", "3s",
			"--active-prefill-tokens-threshold", "100"}})
	}
	a, b := start("mon-a"), start("mon-b")
	names := make([]string, models)
	for i := range names {
		names[i] = fmt.Sprintf("ha/model-%d", i)
		newPub(t, c, names[i], 1).keepAlive(map[string]any{"active_prefill_tokens": 150})
		newPub(t, c, names[i], 2).keepAlive(map[string]any{"active_prefill_tokens": 50})
	}
	right := func() bool {
		obs.mu.Lock()
		defer obs.mu.Unlock()
		for _, m := range names {
			rec, ok := obs.last[m]
			if !ok || fmt.Sprint(rec.Busy) != "[1]" || fmt.Sprint(rec.Free) != "[2]" {
				return false
			}
		}
		return true
	}
	natstest.WaitFor(t, 30*time.Second, "both monitors writing right lists", func() bool {
		ws := obs.writers()
		seen := map[string]bool{}
		for _, id := range ws {
			seen[id] = true
		}
		return right() && seen["mon-a"] && seen["mon-b"]
	})

	// SIGSTOP mon-a past its TTL.
	aEpochs := map[string]uint64{}
	obs.mu.Lock()
	for m, rec := range obs.last {
		if rec.MonitorID == "mon-a" {
			aEpochs[m] = rec.Epoch
		}
	}
	obs.worst = 0
	obs.mu.Unlock()
	if err := a.proc.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	natstest.WaitFor(t, 10*time.Second, "mon-b writing mon-a's models", func() bool {
		for m := range aEpochs {
			if obs.writers()[m] != "mon-b" {
				return false
			}
		}
		return true
	})
	t.Logf("mon-b took mon-a's %d models %v after SIGSTOP (lease TTL %v)", len(aEpochs), time.Since(paused), ttl)
	// mon-a stays paused until mon-b holds every lease and has renewed each
	// since: whatever mon-a sends when it resumes meets changed keys.
	leases, err := c.js.KeyValue(t.Context(), events.LeasesBucket)
	if err != nil {
		t.Fatal(err)
	}
	taken := haLeases(t, leases, parts)
	natstest.WaitFor(t, 10*time.Second, "mon-b holding and renewing every lease", func() bool {
		for p, l := range haLeases(t, leases, parts) {
			if l.MonitorID != "mon-b" || taken[p].MonitorID != "mon-b" || l.rev == taken[p].rev {
				taken[p] = l
				return false
			}
		}
		return true
	})
	obs.mu.Lock()
	mark := len(obs.puts)
	obs.mu.Unlock()
	if err := a.proc.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// Resumed, mon-a may take partitions again (fair share), but only under
	// new epochs.
	natstest.WaitFor(t, 20*time.Second, "both monitors writing again after the resume", func() bool {
		seen := map[string]bool{}
		for _, id := range obs.writers() {
			seen[id] = true
		}
		return right() && seen["mon-a"] && seen["mon-b"]
	})
	obs.mu.Lock()
	for _, rec := range obs.puts[mark:] {
		if old, ok := aEpochs[rec.Model]; ok && rec.MonitorID == "mon-a" && rec.Epoch <= old {
			t.Errorf("mon-a wrote %s under epoch %d after its pause (its epoch before: %d)", rec.Model, rec.Epoch, old)
		}
	}
	obs.mu.Unlock()

	// SIGKILL mon-b: mon-a takes everything.
	b.proc.kill()
	killed := time.Now()
	natstest.WaitFor(t, 10*time.Second, "mon-a writing every model", func() bool {
		for _, m := range names {
			if obs.writers()[m] != "mon-a" {
				return false
			}
		}
		return right()
	})
	t.Logf("mon-a writes every model %v after mon-b's SIGKILL", time.Since(killed))

	obs.mu.Lock()
	defer obs.mu.Unlock()
	for _, e := range obs.errs {
		t.Error(e)
	}
	t.Logf("oldest record a router held during the takeovers: %v", obs.worst)
	// Not a wait: the contract's promise that a router never holds a record
	// older than its stale-list-after across a takeover. heartbeat + TTL +
	// warm-up is 1.6 s here; staleListAfter plays a router's setting for
	// these intervals: 2.5 times that, as in the busylist HA tests, room for
	// the renewal period, the claims and a loaded machine, doubled for a
	// CPU hog beside the test (still below the default 10 s).
	const staleListAfter = 8 * time.Second
	if obs.worst > staleListAfter {
		t.Errorf("a router held a record %v old, more than its stale-list-after %v", obs.worst, staleListAfter)
	}
	if !strings.Contains(a.proc.out.String(), "partition lost") && !strings.Contains(a.proc.out.String(), "no longer writing") {
		t.Errorf("mon-a never said it lost or stopped writing a partition")
	}
}

// haLease is a lease key as read, with its revision.
type haLease struct {
	MonitorID string `json:"monitor_id"`
	Instance  string `json:"instance"`
	rev       uint64
}

// haLeases reads the lease of each of parts partitions (zero when absent).
func haLeases(t *testing.T, kv jetstream.KeyValue, parts int) []haLease {
	t.Helper()
	out := make([]haLease, parts)
	for p := range parts {
		e, err := kv.Get(t.Context(), fmt.Sprintf("p.%d.%d", parts, p))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(e.Value(), &out[p]); err != nil {
			t.Fatal(err)
		}
		out[p].rev = e.Revision()
	}
	return out
}

// TestHADuplicateMonitorID: a second `workermon serve` with the id of a
// running one is refused at its start (exit 1, saying why) and takes
// nothing; the running one keeps running and ready, holding its partitions,
// and counts the other in workermon_lease_duplicate_monitors_total.
func TestHADuplicateMonitorID(t *testing.T) {
	t.Parallel()
	const parts = 2
	srv := natstest.Start(t, natstest.Options(t))
	for _, m := range events.PartitionMappings(prefix, parts) {
		if err := srv.GlobalAccount().AddMapping(m.From, m.To); err != nil {
			t.Fatal(err)
		}
	}
	url := srv.ClientURL()
	// A TTL long enough that the newcomer sees the running monitor
	// re-announce itself (every TTL/3) well within its first TTL.
	flags := []string{"--monitor-id", "mon-same", "--partitions", fmt.Sprint(parts), "--lease-ttl", "1s"}
	a := startMonitor(t, monOpt{natsURL: url, flags: flags})
	c := connect(t, url)
	leases, err := c.js.KeyValue(t.Context(), events.LeasesBucket)
	if err != nil {
		t.Fatal(err)
	}
	holdsAll := func() bool {
		for _, l := range haLeases(t, leases, parts) {
			if l.MonitorID != "mon-same" {
				return false
			}
		}
		return true
	}
	natstest.WaitFor(t, 10*time.Second, "the first monitor holding both partitions", holdsAll)
	before := haLeases(t, leases, parts)

	args := append([]string{"serve", "--http-addr", freeAddr(t), "--data-dir", t.TempDir(), "--nats-url", url}, flags...)
	started := time.Now()
	b := startProcEnv(t, "second monitor", nil, args...)
	select {
	case <-b.exited:
		t.Logf("the second monitor exited %v after its start", time.Since(started))
	case <-time.After(20 * time.Second):
		t.Fatal("the second monitor with the same id still runs 20s after its start")
	}
	var exit *exec.ExitError
	if !errors.As(b.err, &exit) || exit.ExitCode() != 1 || !strings.Contains(b.out.String(), "same id") {
		t.Errorf("second monitor: %v, want exit 1 saying the id is taken; output:\n%s", b.err, b.out.tail(2000))
	}
	if !a.proc.alive() {
		t.Fatalf("the running monitor exited when the second one started:\n%s", a.proc.out.tail(3000))
	}
	natstest.WaitFor(t, 5*time.Second, "the running monitor counting the other", func() bool {
		_, body := haGet(a.base + "/metrics")
		return strings.Contains(body, "workermon_lease_duplicate_monitors_total 1")
	})
	// Still holding and renewing both leases, under the same instance.
	natstest.WaitFor(t, 5*time.Second, "both leases renewed by the running monitor", func() bool {
		for p, l := range haLeases(t, leases, parts) {
			if l.Instance != before[p].Instance || l.rev == before[p].rev {
				return false
			}
		}
		return true
	})
	if code, _ := haGet(a.base + "/readyz"); code != http.StatusOK || !a.proc.alive() {
		t.Errorf("running monitor: /readyz %d, alive %v", code, a.proc.alive())
	}
}

// haGet GETs url: its status and body (0 and the error when it does not
// answer).
func haGet(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestHATwinAfterPause: a monitor paused past its lease TTL (SIGSTOP) is
// replaced by a process with the same id, which passes its start (the
// paused one does not announce) and takes its partitions. When the paused
// one resumes beside its replacement it stands down: it exits 1, saying
// so, without taking anything back; the replacement keeps running, ready
// and holding every partition (issue 22, item 14).
func TestHATwinAfterPause(t *testing.T) {
	t.Parallel()
	const parts = 2
	srv := natstest.Start(t, natstest.Options(t))
	for _, m := range events.PartitionMappings(prefix, parts) {
		if err := srv.GlobalAccount().AddMapping(m.From, m.To); err != nil {
			t.Fatal(err)
		}
	}
	url := srv.ClientURL()
	flags := []string{"--monitor-id", "mon-twin", "--partitions", fmt.Sprint(parts), "--lease-ttl", "1s"}
	a := startMonitor(t, monOpt{natsURL: url, flags: flags})
	c := connect(t, url)
	leases, err := c.js.KeyValue(t.Context(), events.LeasesBucket)
	if err != nil {
		t.Fatal(err)
	}
	heldBy := func() map[string]int {
		out := map[string]int{}
		for _, l := range haLeases(t, leases, parts) {
			out[l.Instance]++
		}
		return out
	}
	var first string
	natstest.WaitFor(t, 10*time.Second, "the first process holding both partitions", func() bool {
		for inst, n := range heldBy() {
			if inst != "" && n == parts {
				first = inst
				return true
			}
		}
		return false
	})
	if err := a.proc.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	b := startMonitor(t, monOpt{natsURL: url, flags: flags})
	var second string
	natstest.WaitFor(t, 15*time.Second, "the replacement holding both partitions", func() bool {
		for inst, n := range heldBy() {
			if inst != "" && inst != first && n == parts {
				second = inst
				return true
			}
		}
		return false
	})
	if err := a.proc.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.proc.exited:
	case <-time.After(20 * time.Second):
		t.Fatalf("the resumed process still runs 20s beside its replacement:\n%s", a.proc.out.tail(3000))
	}
	var exit *exec.ExitError
	if !errors.As(a.proc.err, &exit) || exit.ExitCode() != 1 || !strings.Contains(a.proc.out.String(), "stands down") {
		t.Errorf("resumed process: %v, want exit 1 saying it stands down; output:\n%s", a.proc.err, a.proc.out.tail(3000))
	}
	if got := heldBy(); got[second] != parts {
		t.Errorf("leases held by %v after the stand-down, want both by the replacement %s", got, second)
	}
	if code, body := haGet(b.base + "/readyz"); code != http.StatusOK || !b.proc.alive() {
		t.Errorf("replacement: /readyz %d %s, alive %v", code, body, b.proc.alive())
	}
}
