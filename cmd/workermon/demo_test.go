package main

import (
	"context"
	"encoding/json"
	"flag"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/loadgen"
)

// TestClosedLoop drives load past the thresholds through the router, sees
// the busy set form and the router answer 503, drops the load and sees it
// recover — the whole loop in one process, each step with a time bound.
func TestClosedLoop(t *testing.T) {
	o := defaultDemoOptions()
	o.serve.embedded.Addr = "127.0.0.1:0"
	o.serve.httpAddr, o.router.httpAddr = "127.0.0.1:0", "127.0.0.1:0"
	o.serve.writer.Warmup = 0
	o.serve.writer.Heartbeat = 500 * time.Millisecond
	o.fleet.Workers, o.fleet.Ranks = 2, 1
	o.fleet.Engine.KVBlocks = 64
	o.serve.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
	d, err := startDemo(t.Context(), o, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, d.Close)
	target := "http://" + d.router.httpAddr
	// One process, one name: both boards show the same id.
	var names [2]string
	for i, addr := range []string{d.monitor.httpAddr, d.router.httpAddr} {
		_, body := routerTestGet(t, "http://"+addr+"/board/snapshot")
		var snap struct{ Name string }
		if err := json.Unmarshal([]byte(body), &snap); err != nil {
			t.Fatal(err)
		}
		names[i] = snap.Name
	}
	if names[0] == "" || names[0] != names[1] {
		t.Errorf("the monitor's board names the demo %q, the router's %q: want one id", names[0], names[1])
	}
	natstest.WaitFor(t, 10*time.Second, "router sees both workers free", func() bool {
		rec, _, ok := d.router.watcher.Record(o.fleet.Model)
		return ok && len(rec.Free) == 2
	})
	if code := complete(t, target, o.fleet.Model); code != http.StatusOK {
		t.Fatalf("idle fleet answered %d", code)
	}

	// Overload: far more than two small workers can hold.
	cfg := loadgen.DefaultConfig()
	cfg.Target, cfg.Models, cfg.RPS, cfg.CancelFraction = target, []string{o.fleet.Model}, 80, 0
	gen, err := loadgen.New(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, stopLoad := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = gen.Run(ctx) }()
	start := time.Now()
	natstest.WaitFor(t, 30*time.Second, "all workers busy and the router answering 503", func() bool {
		rec, _, _ := d.router.watcher.Record(o.fleet.Model)
		return rec.AllBusy && gen.Stats().Total.Unavailable > 0
	})
	t.Logf("overloaded after %v: %+v", time.Since(start).Round(time.Millisecond), gen.Stats().Total)

	// Recovery: load gone, work drains, workers free, requests admitted.
	stopLoad()
	<-done
	start = time.Now()
	natstest.WaitFor(t, 30*time.Second, "all workers free again", func() bool {
		rec, _, _ := d.router.watcher.Record(o.fleet.Model)
		return !rec.AllBusy && len(rec.Free) == 2
	})
	t.Logf("recovered after %v", time.Since(start).Round(time.Millisecond))
	if code := complete(t, target, o.fleet.Model); code != http.StatusOK {
		t.Fatalf("after recovery the router answered %d", code)
	}
}

// complete sends one small completion and returns the status.
func complete(t *testing.T, target, model string) int {
	t.Helper()
	body := `{"model":"` + model + `","prompt":"hello","max_tokens":2}`
	resp, err := http.Post(target+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// TestDemoCommandRuns runs `workermon demo` until a summary line shows the
// model's sets, its all_busy changes and the rescheduler's migrations
// (however long a loaded machine takes), then ends it as Ctrl-C does.
func TestDemoCommandRuns(t *testing.T) {
	var out syncbuf.Buffer
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	i := slices.IndexFunc(commands(), func(c command) bool { return c.name == "demo" })
	exit := make(chan int, 1)
	go func() {
		exit <- runCommand(ctx, commands()[i], []string{"--embedded-nats-addr", "127.0.0.1:0", "--monitor-addr", "127.0.0.1:0",
			"--router-addr", "127.0.0.1:0", "--interval", "1s", "--workers", "1", "--max-rps", "5", "--reschedule", "--release-margin", "0.1"},
			&out, io.Discard)
	}()
	natstest.WaitFor(t, 60*time.Second, "a summary line of the model", func() bool {
		s := out.String()
		return strings.Contains(s, "Qwen/Qwen3-0.6B busy") && strings.Contains(s, "all_busy changes") && strings.Contains(s, "migrated ")
	})
	cancel()
	if code := <-exit; code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
	if !strings.HasPrefix(out.String(), "board: http://127.0.0.1:") {
		t.Errorf("the banner does not begin with the board's URL:\n%s", out.String())
	}
	for _, want := range []string{"monitor API", "router", "worker 1", "Qwen/Qwen3-0.6B busy", "all_busy changes", "migrated ", "stopping"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestDemoSustainedAllBusy runs `workermon demo` with its default fleet,
// thresholds and load over a shortened cycle: at the peak every worker
// stays busy for seconds, so the router answers 503 for seconds, the
// summary lines show it ("ALL BUSY 2.0s → 503", "longest 5.1s") and so
// does the board: its snapshots, read every 100 ms, mark the model all
// busy for seconds on end.
func TestDemoSustainedAllBusy(t *testing.T) {
	t.Parallel()
	var out syncbuf.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run([]string{"demo", "--embedded-nats-addr", "127.0.0.1:0", "--monitor-addr", "127.0.0.1:0", "--router-addr", "127.0.0.1:0",
			"--period", "20s", "--duration", "20s", "--interval", "500ms"}, &out, io.Discard)
	}()
	var board string
	natstest.WaitFor(t, 15*time.Second, "the board's URL in the banner", func() bool {
		_, rest, ok := strings.Cut(out.String(), "board: ")
		board, _, _ = strings.Cut(rest, " ")
		return ok && strings.HasSuffix(board, "/")
	})
	// The board's view, as the page gets it: the longest run of snapshots
	// with the model all busy.
	var boardLongest time.Duration
	var since time.Time
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var code int
poll:
	for {
		select {
		case code = <-done:
			break poll
		case now := <-tick.C:
			allBusy, ok := boardAllBusy(board + "board/snapshot")
			switch {
			case !ok:
			case allBusy && since.IsZero():
				since = now
			case allBusy:
				boardLongest = max(boardLongest, now.Sub(since))
			default:
				since = time.Time{}
			}
		}
	}
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
	const want = 2 * time.Second
	var longest, running time.Duration
	for line := range strings.Lines(out.String()) {
		if _, rest, ok := strings.Cut(line, "ALL BUSY "); ok {
			if d, err := time.ParseDuration(strings.Fields(rest)[0]); err == nil {
				running = max(running, d)
			}
		}
		if _, rest, ok := strings.Cut(line, "× longest "); ok {
			if d, err := time.ParseDuration(strings.Fields(rest)[0]); err == nil {
				longest = max(longest, d)
			}
		}
	}
	if running < want || longest < want {
		t.Errorf("the summary lines show all busy for at most %v (under way) and %v (longest), want %v or more:\n%s",
			running, longest, want, out.String())
	}
	if boardLongest < want {
		t.Errorf("the board showed the model all busy for at most %v on end, want %v or more", boardLongest, want)
	}
	t.Logf("all busy for up to %v in the summary lines, %v on the board", longest, boardLongest)

	// The peak shows both faces of the router (contract §17): requests
	// waiting in its queue while the rest meet the all-busy 503.
	both := false
	for _, summary := range demoSummaries(out.String()) {
		_, q, ok := strings.Cut(summary, "| queued ")
		if !ok || !strings.Contains(summary, "ALL BUSY") {
			continue
		}
		_, r, _ := strings.Cut(summary, " 503 ")
		if n, err := strconv.Atoi(strings.Fields(q)[0]); err == nil && n > 0 && !strings.HasPrefix(strings.TrimSpace(r), "0.0/s") {
			both = true
		}
	}
	if !both {
		t.Errorf("no summary line shows requests queued and 503s answered at once:\n%s", out.String())
	}
}

// demoSummaries splits the demo's output into its summaries, each the
// lines from one "t=" line to the next, joined with " | ".
func demoSummaries(out string) []string {
	var all []string
	for line := range strings.Lines(out) {
		line = strings.TrimRight(line, "\n")
		switch {
		case strings.HasPrefix(line, "t="):
			all = append(all, line)
		case strings.HasPrefix(line, demoIndent) && len(all) > 0:
			all[len(all)-1] += " | " + strings.TrimPrefix(line, demoIndent)
		}
	}
	return all
}

// boardAllBusy reads a board snapshot and reports whether its first model
// is all busy; ok is false when it could not be read.
func boardAllBusy(url string) (allBusy, ok bool) {
	resp, err := http.Get(url)
	if err != nil {
		return false, false
	}
	defer resp.Body.Close()
	var snap struct {
		Models []struct {
			AllBusy bool `json:"all_busy"`
		} `json:"models"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&snap) != nil || len(snap.Models) == 0 {
		return false, false
	}
	return snap.Models[0].AllBusy, true
}

// TestDemoFlagsAsDocumented: the demo's monitor runs the SLO controller, so
// demo takes serve's --slo-* flags; every flag docs/configuration.md lists
// for `workermon demo` is one demo has, and demo has each one it lists.
func TestDemoFlagsAsDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(doc), "\n### workermon demo\n")
	section, _, _ = strings.Cut(section, "\n### ")
	documented := map[string]bool{}
	for _, line := range strings.Split(section, "\n") {
		if name, ok := strings.CutPrefix(line, "| `--"); ok {
			name, _, _ = strings.Cut(name, "`")
			documented[name] = true
		}
	}
	o := defaultDemoOptions()
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	o.flags(fs)
	fs.VisitAll(func(f *flag.Flag) {
		if !documented[f.Name] {
			t.Errorf("demo has --%s, docs/configuration.md does not list it for demo", f.Name)
		}
		delete(documented, f.Name)
	})
	for name := range documented {
		t.Errorf("docs/configuration.md lists --%s for demo, demo has no such flag", name)
	}

	code, stdout, stderr := runCheck("demo", "--slo-interval", "3s", "--slo-decode-range", "0.3-0.9",
		"--slo-prefill-range", "1024-2048", "--check")
	if code != 0 {
		t.Fatalf("demo with --slo-* flags --check: exit %d: %s", code, stderr)
	}
	var r checkReport
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]any{"slo-interval": "3s", "slo-decode-range": "0.3-0.9", "slo-prefill-range": "1024-2048"} {
		if got := r.Flags[name]; got != want {
			t.Errorf("--%s = %#v, want %#v", name, got, want)
		}
	}
	if code, _, stderr := runCheck("demo", "--slo-interval", "0s", "--check"); code != 2 || !strings.Contains(stderr, "--slo-interval") {
		t.Errorf("demo --slo-interval 0s --check: exit %d, want 2 naming --slo-interval: %s", code, stderr)
	}
}
