//go:build integration

package main_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// The NATS server versions of the matrix (contract §14): the oldest line
// workermon supports and the one after it, built from the module proxy
// (cached between runs); the embedded server's version is what every other
// test runs on.
var matrixVersions = []string{"v2.10.29", "v2.11.17"}

// refusedVersion is a server older than workermon needs, built from the
// module proxy like the others so that the refusal is always tested: the
// last 2.9 release (Debian bookworm's nats-server package is 2.9.10).
const refusedVersion = "v2.9.25"

// debianNATS is where Debian's nats-server package (2.9 on bookworm)
// installs the server; where it is installed, it is refused too.
const debianNATS = "/usr/sbin/nats-server"

// natsServerBinary returns a nats-server of the given version, built with
// `go install` into the user's cache directory on first use.
func natsServerBinary(t *testing.T, version string) string {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "workermon-test", "nats-server", version)
	bin := filepath.Join(dir, "nats-server")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	start := time.Now()
	cmd := exec.Command("go", "install", "github.com/nats-io/nats-server/v2@"+version)
	cmd.Dir = t.TempDir() // outside this module
	cmd.Env = append(os.Environ(), "GOBIN="+dir, "CGO_ENABLED=0", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go install nats-server@%s: %v\n%s", version, err, out)
	}
	t.Logf("built nats-server %s in %v (cached in %s)", version, time.Since(start).Round(time.Second), dir)
	return bin
}

// natsProc is a nats-server process with JetStream on a loopback port,
// carrying the subject mapping of the given partitions.
type natsProc struct {
	cmd  *exec.Cmd
	out  *syncBuf
	url  string
	done chan struct{}
}

func startNATSProc(t *testing.T, bin string, partitions int) *natsProc {
	t.Helper()
	dir := t.TempDir()
	conf := filepath.Join(dir, "nats.conf")
	// The mappings block `workermon nats-config` prints.
	code, mappings, errOut := runWM(t, "nats-config", "--partitions", fmt.Sprint(partitions))
	if code != 0 {
		t.Fatalf("nats-config: exit %d: %s", code, errOut)
	}
	if err := os.WriteFile(conf, []byte(mappings), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	host, port, _ := strings.Cut(addr, ":")
	p := &natsProc{out: &syncBuf{}, url: "nats://" + addr, done: make(chan struct{})}
	p.cmd = exec.Command(bin, "-c", conf, "-a", host, "-p", port, "-js", "-sd", filepath.Join(dir, "store"))
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("---- nats-server output ----\n%s", p.out.tail(3000))
		}
	})
	natstest.WaitFor(t, 15*time.Second, "nats-server "+bin+" to listen", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	})
	return p
}

// runWM runs the workermon binary to its end.
func runWM(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(wmBinary(t), args...)
	var stdout, stderr syncBuf
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return exit.ExitCode(), stdout.String(), stderr.String()
	case err != nil:
		t.Fatalf("workermon %s: %v", strings.Join(args, " "), err)
	}
	return 0, stdout.String(), stderr.String()
}

// TestNATSVersions runs serve (two monitors on two partitions), sim and
// router on each NATS server version workermon supports, as separate
// processes: the router admits, rejects with the all-busy body under
// overload, and admits again; a killed worker's registry entry expires;
// the monitor holding a partition is killed and the other takes it over;
// every process reports the server's version (log, /healthz or /health,
// workermon_nats_server_info). On 2.9 every command that uses NATS refuses
// to start: exit status 1 and one line naming the version needed.
func TestNATSVersions(t *testing.T) {
	for _, v := range matrixVersions {
		t.Run(v, func(t *testing.T) {
			t.Parallel()
			testSupportedNATS(t, natsServerBinary(t, v), strings.TrimPrefix(v, "v"))
		})
	}
	t.Run(refusedVersion, func(t *testing.T) {
		t.Parallel()
		testRefusedNATS(t, natsServerBinary(t, refusedVersion), strings.TrimPrefix(refusedVersion, "v"))
	})
	out, err := exec.Command(debianNATS, "--version").Output()
	version, _ := strings.CutPrefix(strings.TrimSpace(string(out)), "nats-server: v")
	if err != nil || !strings.HasPrefix(version, "2.9.") {
		// The module build above stands for 2.9; Debian's build adds nothing
		// the test could see.
		t.Logf("Debian's nats-server 2.9 is not installed here (%s: %v %q): 2.9 tested on %s only",
			debianNATS, err, strings.TrimSpace(string(out)), refusedVersion)
		return
	}
	t.Run("debian-"+version, func(t *testing.T) {
		t.Parallel()
		testRefusedNATS(t, debianNATS, version)
	})
}

func testSupportedNATS(t *testing.T, bin, version string) {
	const (
		model = "versions/model-1"
		other = "versions/model-2"
	)
	ns := startNATSProc(t, bin, 2)
	c := connect(t, ns.url)
	monFlags := func(id string) monOpt {
		return monOpt{natsURL: ns.url, flags: []string{"--monitor-id", id, "--partitions", "2", "--lease-ttl", "1s",
			"--active-decode-blocks-threshold", "0.4"}}
	}
	monA, monB := startMonitor(t, monFlags("mon-a")), startMonitor(t, monFlags("mon-b"))
	sim := startProc(t, "sim", "sim", "--nats-url", ns.url, "--model", model, "--workers", "2",
		"--kv-blocks", "64", "--decode-speed", "20")
	victim := startProc(t, "sim-victim", "sim", "--nats-url", ns.url, "--model", other, "--workers", "1",
		"--worker-id-base", "10")
	rt := startRouter(t, ns.url)
	slotsAddr := freeAddr(t)
	slots := startProc(t, "slots", "slots", "--from-registry", "--nats-url", ns.url, "--http-addr", slotsAddr)
	waitHTTP(t, slots, "http://"+slotsAddr+"/health", 15*time.Second)

	// Every process reports the server's version: in its log at connect,
	// on its health page, and as workermon_nats_server_info.
	simBase := "http://" + simHTTPAddr(t, sim)
	for _, p := range []struct {
		proc            *proc
		health, metrics string
	}{
		{monA.proc, monA.base + "/healthz", monA.base + "/metrics"},
		{rt.proc, rt.base + "/healthz", rt.base + "/metrics"},
		{sim, simBase + "/healthz", simBase + "/metrics"},
		{slots, "http://" + slotsAddr + "/healthz", "http://" + slotsAddr + "/metrics"},
	} {
		checkVersionReported(t, p.proc, p.health, p.metrics, version)
	}

	// Admit.
	waitStatus(t, rt.base, "/v1/completions", model, http.StatusOK, 30*time.Second)

	// Overload until the all-busy rejection, then admit again.
	ctx, stop := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var allBusy atomic.Pointer[httpResp]
	prompt := strings.Repeat("x", 2000)
	for range 16 {
		wg.Go(func() {
			body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":32}`, model, prompt)
			for ctx.Err() == nil {
				h, err := postJSON(ctx, rt.base+"/v1/completions", body)
				if err != nil {
					continue
				}
				if h.code == http.StatusServiceUnavailable && strings.Contains(string(h.body), "All workers are busy") {
					allBusy.CompareAndSwap(nil, &h)
				}
			}
		})
	}
	natstest.WaitFor(t, 60*time.Second, "an all-busy rejection under overload", func() bool { return allBusy.Load() != nil })
	stop()
	wg.Wait()
	checkAllBusy(t, "overload", *allBusy.Load(), http.StatusServiceUnavailable)
	waitStatus(t, rt.base, "/v1/completions", model, http.StatusOK, 60*time.Second)

	// A killed worker's registry entry expires (bucket max age, no limit
	// markers), and the router stops answering for its model.
	wkv := c.kv(t, events.WorkersBucket)
	key := events.ModelKey(other) + ".10"
	natstest.WaitFor(t, 20*time.Second, "the victim registered", func() bool {
		_, err := wkv.Get(t.Context(), key)
		return err == nil
	})
	victim.kill()
	killed := time.Now()
	natstest.WaitFor(t, 60*time.Second, "the victim's registry entry expired", func() bool {
		_, err := wkv.Get(t.Context(), key)
		return errors.Is(err, jetstream.ErrKeyNotFound)
	})
	t.Logf("registry entry of the killed worker gone %v after the kill", time.Since(killed).Round(time.Second))
	h := waitStatus(t, rt.base, "/v1/completions", other, http.StatusServiceUnavailable, 30*time.Second)
	checkNoWorkers(t, "killed worker's model", h)

	// Kill the monitor holding the model's partition: the other takes it.
	holder, survivor := monA, monB
	if !holds(t, monA, events.PartitionOfKey(events.ModelKey(model), 2)) {
		holder, survivor = monB, monA
	}
	holder.kill()
	killed = time.Now()
	natstest.WaitFor(t, 20*time.Second, "the survivor holding both partitions", func() bool {
		return holds(t, survivor, 0) && holds(t, survivor, 1)
	})
	bkv := c.busyKV(t)
	natstest.WaitFor(t, 20*time.Second, "a record from the survivor", func() bool {
		e, err := bkv.Get(t.Context(), events.ModelKey(model))
		if err != nil {
			return false
		}
		rec, err := events.DecodeBusySet(e.Value())
		return err == nil && rec.UpdatedAt > killed.UnixNano() && len(rec.Free)+len(rec.Busy) == 2
	})
	t.Logf("partitions taken over %v after the kill", time.Since(killed).Round(time.Millisecond))
	waitStatus(t, rt.base, "/v1/completions", model, http.StatusOK, 30*time.Second)
}

// simHTTPAddr waits for the address `workermon sim` prints for its /healthz
// and /metrics.
func simHTTPAddr(t *testing.T, p *proc) string {
	t.Helper()
	var addr string
	natstest.WaitFor(t, 15*time.Second, "the sim's HTTP address", func() bool {
		for line := range strings.Lines(p.out.String()) {
			if rest, ok := strings.CutPrefix(line, "workermon sim: http://"); ok {
				addr, _, _ = strings.Cut(rest, " ")
				return true
			}
		}
		return false
	})
	return addr
}

// checkVersionReported checks that a process logged the server's version
// at connect, shows it on its health page and exports it as
// workermon_nats_server_info.
func checkVersionReported(t *testing.T, p *proc, health, metrics, version string) {
	t.Helper()
	logged := false
	for line := range strings.Lines(p.out.String()) {
		if strings.Contains(line, `msg="nats: connected"`) && strings.Contains(line, "server_version="+version) {
			logged = true
		}
	}
	if !logged {
		t.Errorf("%s: no log line nats: connected with server_version=%s", p.name, version)
	}
	if code, body := getBody(t, health); code != http.StatusOK || !strings.Contains(body, "nats_server_version "+version+"\n") {
		t.Errorf("%s: %s answered %d %q, want nats_server_version %s", p.name, health, code, body, version)
	}
	if code, body := getBody(t, metrics); code != http.StatusOK ||
		!strings.Contains(body, `workermon_nats_server_info{version="`+version+`"} 1`) {
		t.Errorf("%s: %s has no workermon_nats_server_info{version=%q} 1 (status %d)", p.name, metrics, version, code)
	}
}

// testRefusedNATS: on a server older than 2.10, every command that uses
// NATS (serve, router, sim, slots with --from-registry) refuses to start:
// exit status 1, nothing on stdout, and exactly one line naming the version
// needed, `workermon <command>: unsupported NATS server: nats-server
// <version> at <url> is too old: workermon needs NATS server 2.10.0 or
// later`, with no warning or error logged besides (no loop of warnings).
func testRefusedNATS(t *testing.T, bin, version string) {
	ns := startNATSProc(t, bin, 1)
	for _, args := range [][]string{
		{"serve", "--nats-url", ns.url, "--http-addr", freeAddr(t), "--data-dir", t.TempDir()},
		{"router", "--nats-url", ns.url, "--http-addr", freeAddr(t)},
		{"sim", "--nats-url", ns.url, "--workers", "2"},
		{"slots", "--from-registry", "--nats-url", ns.url, "--http-addr", freeAddr(t)},
	} {
		done := make(chan struct{})
		var code int
		var out, errOut string
		go func() {
			defer close(done)
			code, out, errOut = runWM(t, args...)
		}()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("workermon %s still running 30s after start on an unsupported server", args[0])
		}
		want := "workermon " + args[0] + ": unsupported NATS server: nats-server " + version + " at " + ns.url +
			" is too old: workermon needs NATS server 2.10.0 or later\n"
		var naming, warnings []string
		for line := range strings.Lines(errOut) {
			if strings.Contains(line, "2.10") {
				naming = append(naming, line)
			}
			if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") {
				warnings = append(warnings, line)
			}
		}
		if code != 1 || out != "" || len(naming) != 1 || naming[0] != want || len(warnings) != 0 {
			t.Errorf("workermon %s on NATS %s: exit %d, stdout %q, lines naming 2.10: %q, warnings: %q;\n"+
				"want exit 1, no output, the one line %q and no warning\n%s",
				args[0], version, code, out, naming, warnings, want, errOut)
			continue
		}
		t.Logf("workermon %s on NATS %s: exit 1, %s", args[0], version, strings.TrimSpace(naming[0]))
	}
}

// holds reports whether the monitor holds partition p.
func holds(t *testing.T, m *monitor, p int) bool {
	t.Helper()
	code, body := getBody(t, m.base+"/partitions")
	if code != http.StatusOK {
		return false
	}
	var reply api.PartitionsReply
	if err := json.Unmarshal([]byte(body), &reply); err != nil {
		t.Fatalf("partitions: %v: %s", err, body)
	}
	for _, h := range reply.Held {
		if h == p {
			return true
		}
	}
	return false
}

// getBody GETs url: its status and body (0 when it does not answer).
func getBody(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// postJSON POSTs a JSON body, bounded by ctx.
func postJSON(ctx context.Context, url, body string) (httpResp, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return httpResp{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return httpResp{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return httpResp{code: resp.StatusCode, header: resp.Header, body: b}, err
}
