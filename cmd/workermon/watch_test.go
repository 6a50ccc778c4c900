package main

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/natsconn"
)

// TestWatchLines runs `workermon watch` with its output not a terminal
// against a real NATS server whose busy bucket a busylist.Writer writes,
// heartbeats included: one line per change of a record, none per
// heartbeat, one per deletion; --model filters.
func TestWatchLines(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	nc := natstest.Connect(t, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	wcfg := busylist.DefaultWriterConfig()
	wcfg.JetStream, wcfg.MonitorID = js, "test-monitor"
	wcfg.Warmup, wcfg.Heartbeat = 0, 50*time.Millisecond
	writer, err := busylist.NewWriter(wcfg)
	if err != nil {
		t.Fatal(err)
	}
	wctx, stopWriter := context.WithCancel(t.Context())
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		_ = writer.Run(wctx)
	}()
	t.Cleanup(func() { stopWriter(); <-writerDone })
	const model, other = "Qwen/Qwen3-0.6B", "other model"
	thresholds := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}
	writer.Set(events.BusySet{Model: model, Free: []uint64{11, 12}, Thresholds: thresholds})

	start := func(args ...string) (*syncbuf.Buffer, *syncbuf.Buffer, func() error) {
		var out, errOut syncbuf.Buffer
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- runWatch(ctx, append([]string{"--nats-url", srv.ClientURL()}, args...), &out, &errOut) }()
		var once sync.Once
		var runErr error
		stop := func() error {
			once.Do(func() { cancel(); runErr = <-done })
			return runErr
		}
		t.Cleanup(func() { _ = stop() })
		return &out, &errOut, stop
	}
	out, errOut, stop := start()
	filtered, _, stopFiltered := start("--model", other)

	waitLine := func(what string, n int, want ...string) {
		t.Helper()
		natstest.WaitFor(t, 10*time.Second, what, func() bool {
			lines := out.Lines()
			if len(lines) < n {
				return false
			}
			for _, w := range want {
				if !strings.Contains(lines[n-1], w) {
					return false
				}
			}
			return true
		})
	}
	waitLine("the first record", 1, "model=Qwen/Qwen3-0.6B all_busy=false busy=[] free=[11 12] stale=[]", "thresholds=[kv>0.8]")
	writer.Set(events.BusySet{Model: model, Busy: []uint64{11}, Free: []uint64{12}, Reasons: map[string]string{"11": "kv"},
		Thresholds: thresholds})
	waitLine("worker 11 busy", 2, "all_busy=false busy=[11] free=[12]", "reasons=[11:kv]")
	writer.Set(events.BusySet{Model: other, Busy: []uint64{1}, AllBusy: true, Reasons: map[string]string{"1": "prefill"}})
	waitLine("the other model, all busy", 3, `model="other model" all_busy=true busy=[1]`, "reasons=[1:prefill]")
	writer.Set(events.BusySet{Model: model, Busy: []uint64{11, 12}, AllBusy: true, Reasons: map[string]string{"11": "kv", "12": "kv"},
		Thresholds: thresholds})
	waitLine("all busy", 4, "model=Qwen/Qwen3-0.6B all_busy=true busy=[11 12] free=[]")
	writer.Delete(model)
	waitLine("deleted", 5, "model=Qwen/Qwen3-0.6B deleted")

	// Every record is re-put every 50ms: no line for those. Let a few go by.
	kv, err := js.KeyValue(t.Context(), events.BusyBucket)
	if err != nil {
		t.Fatal(err)
	}
	seqOf := func() uint64 {
		e, err := kv.Get(t.Context(), events.ModelKey(other))
		if err != nil {
			t.Fatal(err)
		}
		rec, err := events.DecodeBusySet(e.Value())
		if err != nil {
			t.Fatal(err)
		}
		return rec.Seq
	}
	seq := seqOf()
	natstest.WaitFor(t, 10*time.Second, "three heartbeats", func() bool { return seqOf() >= seq+3 })
	if err := stop(); err != nil {
		t.Fatalf("watch ended with %v", err)
	}
	lines := out.Lines()
	if len(lines) != 5 {
		t.Fatalf("%d lines, want one per change (5):\n%s", len(lines), strings.Join(lines, "\n"))
	}
	for _, l := range lines {
		if _, err := time.Parse("2006-01-02T15:04:05.000Z07:00", strings.Fields(l)[0]); err != nil {
			t.Errorf("line does not begin with its time: %q", l)
		}
	}
	if !strings.Contains(errOut.String(), "nats: connected") || !strings.Contains(errOut.String(), "server_version=") {
		t.Errorf("the connection and the server's version are not logged:\n%s", errOut.String())
	}
	if err := stopFiltered(); err != nil {
		t.Fatal(err)
	}
	if got := filtered.Lines(); len(got) != 1 || !strings.Contains(got[0], `model="other model" all_busy=true`) {
		t.Errorf("--model %q wrote:\n%s", other, strings.Join(got, "\n"))
	}
}

func TestWatchUsage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--model", strings.Repeat("m", 257)},
		{"--nats-url", "ftp://x"},
		{"--monitor-url", "ftp://admin:s3cret-pass@x"},
		{"extra"},
	} {
		err := runWatch(t.Context(), args, &syncbuf.Buffer{}, &syncbuf.Buffer{})
		if !errors.Is(err, errUsage) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
		if err != nil && strings.Contains(err.Error(), "s3cret-pass") {
			t.Errorf("%v: the error shows the password: %v", args, err)
		}
	}
}

// TestWatchComposeUsers runs `workermon watch` against a real NATS server
// with the users and permissions of deploy/nats/compose.conf: without
// credentials, and with a wrong password, the error says what to try (the
// router's user); with the router's user, as docs/operations.md says, it
// shows the busy sets.
func TestWatchComposeUsers(t *testing.T) {
	// t.Setenv: compose.conf reads the passwords from the environment.
	const routerPassword, monitorPassword = "router-test-password", "monitor-test-password"
	for _, v := range []string{"ENGINE_1", "ENGINE_2", "ENGINE_3", "ENGINE_4"} {
		t.Setenv("WORKERMON_NATS_"+v+"_PASSWORD", strings.ToLower(v)+"-test-password")
	}
	t.Setenv("WORKERMON_NATS_ROUTER_PASSWORD", routerPassword)
	t.Setenv("WORKERMON_NATS_MONITOR_PASSWORD", monitorPassword)
	opts, err := server.ProcessConfigFile(filepath.Join("..", "..", "deploy", "nats", "compose.conf"))
	if err != nil {
		t.Fatal(err)
	}
	opts.Host, opts.Port, opts.HTTPPort = "127.0.0.1", -1, 0
	opts.StoreDir, opts.NoLog, opts.NoSigs = t.TempDir(), true, true
	srv := natstest.Start(t, opts)

	// The monitor's user creates the bucket and writes a record.
	nc := natstest.Connect(t, srv, nats.UserInfo("monitor", monitorPassword))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := kvbucket.Open(t.Context(), js, events.BusyBucket, 1)
	if err != nil {
		t.Fatal(err)
	}
	rec := events.BusySet{Model: "Qwen/Qwen3-0.6B", Free: []uint64{1, 2}, MonitorID: "monitor", Epoch: 1, Seq: 1,
		UpdatedAt: time.Now().UnixNano()}
	b, err := events.MarshalBusySet(&rec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(t.Context(), events.ModelKey(rec.Model), b); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"no credentials", nil, []string{"Authorization Violation", "The server wants credentials", "--nats-user and --nats-password",
			"--nats-user router --nats-password router-demo-password", "docs/operations.md"}},
		{"wrong password", []string{"--nats-user", "router", "--nats-password", "wrong"},
			[]string{"Authorization Violation", `refused the credentials given (user "router")`, "--nats-user router"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut syncbuf.Buffer
			err := runWatch(t.Context(), append([]string{"--nats-url", srv.ClientURL()}, tc.args...), &out, &errOut)
			if !errors.Is(err, natsconn.ErrUnauthorized) {
				t.Fatalf("watch ended with %v, want an error matching natsconn.ErrUnauthorized", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the error lacks %q:\n%v", w, err)
				}
			}
		})
	}

	t.Run("an engine's user", func(t *testing.T) {
		var out, errOut syncbuf.Buffer
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- runWatch(ctx, []string{"--nats-url", srv.ClientURL(), "--nats-user", "engine-1", "--nats-password", "engine_1-test-password"}, &out, &errOut)
		}()
		natstest.WaitFor(t, 15*time.Second, "a permissions error logged", func() bool {
			return strings.Contains(strings.ToLower(errOut.String()), "permission")
		})
		cancel()
		err := <-done
		t.Logf("watch ended with %v; stderr:\n%s", err, errOut.String())
		if out.String() != "" {
			t.Errorf("an engine's user saw the busy sets:\n%s", out.String())
		}
	})

	t.Run("the router's user", func(t *testing.T) {
		var out, errOut syncbuf.Buffer
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- runWatch(ctx, []string{"--nats-url", srv.ClientURL(), "--nats-user", "router", "--nats-password", routerPassword}, &out, &errOut)
		}()
		natstest.WaitFor(t, 10*time.Second, "the record's line", func() bool {
			return strings.Contains(out.String(), "model=Qwen/Qwen3-0.6B all_busy=false busy=[] free=[1 2]")
		})
		cancel()
		if err := <-done; err != nil {
			t.Errorf("watch ended with %v\n%s", err, errOut.String())
		}
	})
}

// TestWatchLeadingValues runs `workermon watch --monitor-url` against a
// real monitor (`serve` in process): each line of a change carries the
// workers' leading values as GET /loads serves them, "–" for a worker
// whose engine sends no counters (never 0). A monitor URL that cannot be
// reached is logged once, with its credentials hidden, and the watch goes
// on with the bucket.
func TestWatchLeadingValues(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { longLived(o); o.adminToken = e2eToken })
	nc, _ := connect(t, svc.natsURL)

	// Worker 1 sends no counters: its values stay unknown. Worker 2 has
	// 4000 tokens waiting and computes 250 every 50 ms or slower (at most
	// 5000 tokens/s), with a preemption every third report.
	w1 := &leadingPub{t: t, nc: nc, worker: 1}
	w1.send(events.LoadReport{ActiveDecodeBlocks: events.Some(10)})
	w2 := &leadingPub{t: t, nc: nc, worker: 2}
	var prefilled uint64
	for i := range 20 {
		w2.send(events.LoadReport{ActiveDecodeBlocks: events.Some(10), ActivePrefillTokens: events.Some(4000),
			PrefilledTokens: events.Some(prefilled), Preemptions: events.Some(uint64(i / 3))})
		prefilled += 250
		time.Sleep(50 * time.Millisecond) // pacing the engine, not waiting for an outcome
	}
	natstest.WaitFor(t, 10*time.Second, "worker 2's queue delay and preemption rate in GET /loads", func() bool {
		code, _, body := call(t, svc, "GET", "/loads?model="+e2eModel, "", "")
		var reply struct{ Loads []monitor.LoadRow }
		if code != http.StatusOK || json.Unmarshal(body, &reply) != nil {
			return false
		}
		return slices.ContainsFunc(reply.Loads, func(r monitor.LoadRow) bool {
			return r.WorkerID == 2 && r.QueueDelayMs != nil && r.PreemptionRate != nil
		})
	})

	run := func(args ...string) (*syncbuf.Buffer, *syncbuf.Buffer) {
		var out, errOut syncbuf.Buffer
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- runWatch(ctx, append([]string{"--nats-url", svc.natsURL, "--model", e2eModel}, args...), &out, &errOut)
		}()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("watch %v ended with %v\n%s", args, err, errOut.String())
			}
		})
		return &out, &errOut
	}
	out, errOut := run("--monitor-url", "http://"+svc.httpAddr)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	ln.Close()
	badOut, badErr := run("--monitor-url", "http://admin:s3cret-pass@"+refused)

	// A line is written on a change of the record: flip worker 2 between
	// busy for queue_delay and free until a line carries the values the
	// watch read (its first line may come before its first reading).
	leading := regexp.MustCompile(`queue_delay=\[1:– 2:(\d+ms|\d+(\.\d)?s)\] prefill_rate=\[1:– 2:(\d+)tok/s\] preemption_rate=\[1:– 2:\d+\.\d\d/s\]$`)
	var match []string
	flips, seen := 0, 0
	natstest.WaitFor(t, 20*time.Second, "a line with worker 2's leading values", func() bool {
		lines := out.Lines()
		for _, l := range lines {
			if match = leading.FindStringSubmatch(l); match != nil {
				return true
			}
		}
		if len(lines) > seen { // the last flip is written: flip again
			seen = len(lines)
			flips++
			body := `{"model":"` + e2eModel + `","queue_delay_threshold_ms":null}`
			if flips%2 == 1 {
				body = `{"model":"` + e2eModel + `","queue_delay_threshold_ms":1}`
			}
			if code, _, reply := call(t, svc, "POST", "/busy_threshold", e2eToken, body); code != http.StatusOK {
				t.Fatalf("POST /busy_threshold %s = %d %s", body, code, reply)
			}
		}
		return false
	})
	t.Logf("the line: %s", match[0])
	if rate, err := strconv.Atoi(match[3]); err != nil || rate <= 0 || rate > 5050 {
		t.Errorf("worker 2's prefill rate on the line is %q, want 1 to 5000 tokens/s: %s", match[3], match[0])
	}
	if strings.Contains(errOut.String(), "cannot read the monitor's loads") {
		t.Errorf("the watch of a live monitor logged a failure:\n%s", errOut.String())
	}

	// The unreachable monitor: the lines go on with unknown values, one
	// log says why, and the password is nowhere.
	natstest.WaitFor(t, 10*time.Second, "the unreachable monitor logged", func() bool {
		return strings.Contains(badErr.String(), "cannot read the monitor's loads")
	})
	natstest.WaitFor(t, 10*time.Second, "a line of the watch of the unreachable monitor", func() bool {
		return slices.ContainsFunc(badOut.Lines(), func(l string) bool {
			return strings.HasSuffix(l, "queue_delay=[1:– 2:–] prefill_rate=[1:– 2:–] preemption_rate=[1:– 2:–]")
		})
	})
	if n := strings.Count(badErr.String(), "cannot read the monitor's loads"); n != 1 {
		t.Errorf("%d failure logs, want 1:\n%s", n, badErr.String())
	}
	if s := badErr.String() + badOut.String(); strings.Contains(s, "s3cret-pass") || !strings.Contains(s, "admin:"+redact.Mark+"@") {
		t.Errorf("the monitor URL's password is not hidden:\n%s", s)
	}
}
