package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/workermon/workermon/internal/redact"
)

// trap is a TCP listener that stands for every address a command could
// connect to or listen on: its port is taken (a bind fails) and it counts
// the connections it accepts (a connection attempt shows).
type trap struct {
	ln       net.Listener
	accepted atomic.Int64
}

func newTrap(t *testing.T) *trap {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := &trap{ln: ln}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			tr.accepted.Add(1)
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return tr
}

func (tr *trap) addr() string { return tr.ln.Addr().String() }

func (tr *trap) port() string {
	_, p, _ := net.SplitHostPort(tr.addr())
	return p
}

// runCheck runs a command in this process and returns its exit code and
// output.
func runCheck(args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	code := run(args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// TestCheckEveryCommand runs every command with --check against addresses
// that are taken and where nothing answers: each must exit 0 with its
// configuration as JSON, connect nowhere, bind nothing, start no embedded
// server and create no directory.
func TestCheckEveryCommand(t *testing.T) {
	tr := newTrap(t)
	dir := t.TempDir()
	absent := filepath.Join(dir, "absent", "store")
	// bench and demo would make their stores under TMPDIR.
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", tmp)
	addr, natsURL, httpURL := tr.addr(), "nats://"+tr.addr(), "http://"+tr.addr()

	tests := []struct {
		name string
		args []string
		want map[string]any // some flags and their expected values
	}{
		{"serve", []string{"serve", "--http-addr", addr, "--embedded-nats-addr", addr, "--data-dir", absent, "--partitions", "8", "--monitor-id", "m-0"},
			map[string]any{"http-addr": addr, "data-dir": absent, "partitions": 8.0, "monitor-id": "m-0", "nats-url": ""}},
		{"serve with NATS", []string{"serve", "--http-addr", addr, "--nats-url", natsURL, "--data-dir", absent},
			map[string]any{"nats-url": natsURL}},
		{"router", []string{"router", "--http-addr", addr, "--nats-url", natsURL}, map[string]any{"nats-url": natsURL, "http-addr": addr}},
		{"sim", []string{"sim", "--nats-url", natsURL, "--http-addr", addr, "--port-base", tr.port(), "--workers", "1"},
			map[string]any{"workers": 1.0}},
		{"load", []string{"load", "--target", httpURL, "--rps", "5"}, map[string]any{"target": httpURL, "rps": 5.0}},
		{"status", []string{"status", "--monitor-url", httpURL}, map[string]any{"monitor-url": httpURL}},
		{"watch", []string{"watch", "--nats-url", natsURL}, map[string]any{"nats-url": natsURL}},
		{"thresholds get", []string{"thresholds", "get", "--monitor-url", httpURL}, nil},
		{"thresholds set", []string{"thresholds", "set", "--monitor-url", httpURL, "--model", "m", "--active-decode-blocks-threshold", "0.8",
			"--active-prefill-tokens-threshold", "4096"},
			map[string]any{"model": "m", "active-decode-blocks-threshold": "0.8", "active-prefill-tokens-threshold": "4096"}},
		{"thresholds unset", []string{"thresholds", "unset", "--monitor-url", httpURL, "--model", "m"}, nil},
		{"slots", []string{"slots", "--http-addr", addr, "--from-registry", "--publish", "--nats-url", natsURL}, map[string]any{"from-registry": true}},
		{"scrape", []string{"scrape", "--engine", "vllm", "--metrics-url", httpURL + "/metrics", "--model", "m", "--worker-id", "7",
			"--http-addr", addr, "--nats-url", natsURL}, map[string]any{"worker-id": "7", "engine": "vllm"}},
		{"cordon", []string{"cordon", "--monitor-url", httpURL, "--model", "m", "--worker-id", "3"}, map[string]any{"worker-id": 3.0}},
		{"cordon list", []string{"cordon", "--monitor-url", httpURL}, nil},
		{"uncordon", []string{"uncordon", "--monitor-url", httpURL, "--model", "m", "--worker-id", "3"}, nil},
		{"slo get", []string{"slo", "get", "--monitor-url", httpURL}, nil},
		{"slo set", []string{"slo", "set", "--monitor-url", httpURL, "--model", "m", "--itl-ms", "50"}, map[string]any{"model": "m"}},
		{"slo delete", []string{"slo", "delete", "--monitor-url", httpURL, "--model", "m"}, nil},
		{"bench", []string{"bench", "--reports", "10", "--rounds", "1"}, map[string]any{"reports": 10.0}},
		{"bench goodput", []string{"bench", "goodput", "--quick", "--seeds", "3", "--policies", "thresholds-best,slo", "--scenarios", "ramp",
			"--capacity", "12.5", "--capacity-documents", "1.4", "--router-shares", "60,30,10", "--parallel", "1"},
			map[string]any{"quick": true, "seeds": 3.0, "policies": "thresholds-best,slo", "scenarios": "ramp", "capacity": 12.5,
				"capacity-documents": 1.4, "router-shares": "60,30,10", "parallel": 1.0}},
		{"nats-config", []string{"nats-config", "--partitions", "8"}, map[string]any{"partitions": 8.0}},
		{"healthcheck", []string{"healthcheck", "--url", httpURL + "/healthz"}, map[string]any{"url": httpURL + "/healthz"}},
		{"demo", []string{"demo", "--embedded-nats-addr", addr, "--monitor-addr", addr, "--router-addr", addr, "--data-dir", absent},
			map[string]any{"router-addr": addr}},
	}
	seen := map[string]bool{}
	for _, tt := range tests {
		seen[tt.args[0]] = true
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := runCheck(append(tt.args, "--check")...)
			if code != 0 {
				t.Fatalf("exit %d, want 0; stderr:\n%s", code, stderr)
			}
			var r checkReport
			dec := json.NewDecoder(strings.NewReader(stdout))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&r); err != nil {
				t.Fatalf("stdout is not one check report: %v\n%s", err, stdout)
			}
			if dec.More() {
				t.Errorf("more than one JSON value on stdout:\n%s", stdout)
			}
			wantName := tt.args[0]
			if tt.args[0] == "thresholds" || tt.args[0] == "slo" || (tt.args[0] == "bench" && len(tt.args) > 1 && tt.args[1] == "goodput") {
				wantName += " " + tt.args[1]
			}
			if r.Command != wantName || !r.Valid {
				t.Errorf("command %q valid %v, want %q true", r.Command, r.Valid, wantName)
			}
			if _, ok := r.Flags[checkFlag]; ok {
				t.Error("the report lists --check itself")
			}
			for k, v := range tt.want {
				if got, ok := r.Flags[k]; !ok || got != v {
					t.Errorf("flag %s = %#v (present %v), want %#v", k, got, ok, v)
				}
			}
			if n := tr.accepted.Load(); n != 0 {
				t.Errorf("%d connections to %s: a check connects nowhere", n, addr)
			}
			if _, err := os.Stat(filepath.Dir(absent)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s exists (err %v): a check creates no directory", filepath.Dir(absent), err)
			}
			if entries, _ := os.ReadDir(tmp); len(entries) > 0 {
				t.Errorf("%d entries made in TMPDIR, e.g. %s: a check creates no directory", len(entries), entries[0].Name())
			}
		})
	}
	for _, c := range commands() {
		if !seen[c.name] {
			t.Errorf("command %s has no --check case here", c.name)
		}
	}
}

// TestCheckInvalid: a configuration a start would refuse makes --check exit
// 2 with the reason on stderr and nothing on stdout.
func TestCheckInvalid(t *testing.T) {
	tests := []struct {
		name   string
		args   []string
		env    map[string]string
		reason string
	}{
		{"serve partitions", []string{"serve", "--partitions", "0"}, nil, "--partitions"},
		{"serve from the environment", []string{"serve"}, map[string]string{"WORKERMON_LEASE_TTL": "0s"}, "--lease-ttl"},
		{"serve bad env value", []string{"serve"}, map[string]string{"WORKERMON_PARTITIONS": "many"}, "WORKERMON_PARTITIONS"},
		{"serve monitor id", []string{"serve", "--monitor-id", "a.b"}, nil, "--monitor-id"},
		{"serve two NATS auths", []string{"serve", "--nats-url", "nats://127.0.0.1:1", "--nats-token", "t", "--nats-user", "u", "--nats-password", "p"}, nil, "authentication"},
		{"router status", []string{"router", "--reject-status", "200"}, nil, "200"},
		{"router creds missing", []string{"router", "--nats-creds", "/nonexistent/x.creds"}, nil, "x.creds"},
		{"sim workers", []string{"sim", "--workers", "0"}, nil, "Workers"},
		{"load api", []string{"load", "--api", "telepathy"}, nil, "telepathy"},
		{"load retries", []string{"load", "--retries", "-1"}, nil, "Retries"},
		{"status timeout", []string{"status", "--timeout", "0s"}, nil, "--timeout"},
		{"watch model", []string{"watch", "--model", "\xff"}, nil, "--model"},
		{"thresholds set without model", []string{"thresholds", "set", "--active-decode-blocks-threshold", "0.5"}, nil, "--model"},
		{"slots NATS", []string{"slots", "--from-registry", "--nats-url", ""}, nil, "URL"},
		{"scrape engine", []string{"scrape", "--worker-id", "1", "--metrics-url", "http://127.0.0.1:1/metrics", "--model", "m"}, nil, "--engine"},
		{"cordon without worker", []string{"cordon", "--model", "m"}, nil, "--worker-id"},
		{"uncordon without model", []string{"uncordon", "--worker-id", "1"}, nil, "--model"},
		{"slo set without target", []string{"slo", "set", "--model", "m"}, nil, "--itl-ms"},
		{"bench reports", []string{"bench", "--reports", "0"}, nil, "--reports"},
		{"bench goodput seeds", []string{"bench", "goodput", "--seeds", "0"}, nil, "--seeds"},
		{"bench goodput policies", []string{"bench", "goodput", "--policies", "thresholds,fifo"}, nil, "fifo"},
		{"bench goodput scenarios", []string{"bench", "goodput", "--scenarios", "storm"}, nil, "storm"},
		{"bench goodput capacity", []string{"bench", "goodput", "--capacity", "-1"}, nil, "--capacity"},
		{"bench goodput capacity documents", []string{"bench", "goodput", "--capacity-documents", "NaN"}, nil, "--capacity-documents"},
		{"bench goodput two router shares", []string{"bench", "goodput", "--router-shares", "60,40"}, nil, "want 3 shares"},
		{"bench goodput a router share of 0", []string{"bench", "goodput", "--router-shares", "60,0,40"}, nil, `share "0"`},
		{"bench goodput a router share not a number", []string{"bench", "goodput", "--router-shares", "60,x,40"}, nil, `share "x"`},
		{"bench goodput parallel", []string{"bench", "goodput", "--parallel", "0"}, nil, "--parallel"},
		{"nats-config partitions", []string{"nats-config", "--partitions", "0"}, nil, "--partitions"},
		{"nats-config partitions from the environment", []string{"nats-config"}, map[string]string{"WORKERMON_PARTITIONS": "0"}, "--partitions"},
		{"nats-config account", []string{"nats-config", "--partitions", "4", "--account", "a b}"}, nil, "--account"},
		{"nats-config global account", []string{"nats-config", "--partitions", "4", "--account", "$G"}, nil, "--account"},
		{"healthcheck url", []string{"healthcheck", "--url", "ftp://x/"}, nil, "--url"},
		{"demo workers", []string{"demo", "--workers", "0"}, nil, "Workers"},
		{"serve listen address", []string{"serve", "--http-addr", "garbage"}, nil, "--http-addr"},
		{"serve listen port", []string{"serve", "--http-addr", "127.0.0.1:99999"}, nil, "--http-addr"},
		{"router listen address", []string{"router", "--http-addr", "garbage"}, nil, "--http-addr"},
		{"router listen address from the environment", []string{"router"}, map[string]string{"WORKERMON_HTTP_ADDR": "127.0.0.1:-1"}, "--http-addr"},
		{"slots listen port", []string{"slots", "--http-addr", "127.0.0.1:99999"}, nil, "--http-addr"},
		{"sim listen address", []string{"sim", "--http-addr", "garbage"}, nil, "--http-addr"},
		{"scrape listen port", []string{"scrape", "--engine", "vllm", "--worker-id", "1", "--metrics-url", "http://127.0.0.1:1/metrics",
			"--model", "m", "--http-addr", "127.0.0.1:65536"}, nil, "--http-addr"},
		{"demo monitor address", []string{"demo", "--monitor-addr", "garbage"}, nil, "--monitor-addr"},
		{"demo router address", []string{"demo", "--router-addr", "127.0.0.1:99999"}, nil, "--router-addr"},
		{"watch stale list after", []string{"watch", "--stale-list-after", "0s"}, nil, "--stale-list-after"},
		{"demo queue share", []string{"demo", "--queue-share", "2"}, nil, "--queue-share"},
		{"demo queue share NaN", []string{"demo", "--queue-share", "NaN"}, nil, "--queue-share"},
		{"unknown flag", []string{"serve", "--no-such-flag"}, nil, "no-such-flag"},
		{"log level", []string{"router", "--log-level", "loud"}, nil, "--log-level"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			code, stdout, stderr := runCheck(append(tt.args, "--check")...)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stdout:\n%s\nstderr:\n%s", code, stdout, stderr)
			}
			if stdout != "" {
				t.Errorf("stdout %q, want nothing", stdout)
			}
			if !strings.Contains(stderr, tt.reason) {
				t.Errorf("stderr does not name %q:\n%s", tt.reason, stderr)
			}
		})
	}
}

// TestCheckRedactsSecrets: passwords, tokens and the admin token, from
// flags, the environment or a URL, never reach the output; a credentials
// file shows as its path, not its content.
func TestCheckRedactsSecrets(t *testing.T) {
	dir := t.TempDir()
	creds := filepath.Join(dir, "user.creds")
	if err := os.WriteFile(creds, []byte("-----BEGIN USER NKEY SEED-----\nSUACREDSSEEDSECRET\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	secrets := []string{"pw-in-url", "flag-password", "env-token", "admin-secret", "SUACREDSSEEDSECRET", "url-token"}
	tests := []struct {
		name string
		args []string
		env  map[string]string
	}{
		{"serve", []string{"serve", "--nats-url", "nats://alice:pw-in-url@127.0.0.1:1,nats://bob:pw-in-url@127.0.0.2:1",
			"--admin-token", "admin-secret"}, nil},
		{"router", []string{"router", "--nats-user", "alice", "--nats-password", "flag-password"}, nil},
		{"watch", []string{"watch"}, map[string]string{"WORKERMON_NATS_TOKEN": "env-token"}},
		{"scrape", []string{"scrape", "--engine", "vllm", "--worker-id", "1", "--model", "m", "--metrics-url", "http://127.0.0.1:1/metrics",
			"--nats-creds", creds}, nil},
		{"sim token in URL", []string{"sim", "--nats-url", "url-token@127.0.0.1:1"}, nil},
		{"thresholds", []string{"thresholds", "set", "--model", "m", "--active-prefill-tokens-threshold", "10"},
			map[string]string{"WORKERMON_ADMIN_TOKEN": "admin-secret"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			code, stdout, stderr := runCheck(append(tt.args, "--check")...)
			if code != 0 {
				t.Fatalf("exit %d; stderr:\n%s", code, stderr)
			}
			for _, s := range secrets {
				if strings.Contains(stdout+stderr, s) {
					t.Errorf("output shows the secret %q:\n%s", s, stdout)
				}
			}
			// The scrape case has a credentials file only: a path.
			if tt.name != "scrape" && !strings.Contains(stdout, redact.Mark) {
				t.Errorf("nothing marked %s:\n%s", redact.Mark, stdout)
			}
		})
	}
	code, stdout, _ := runCheck("scrape", "--engine", "vllm", "--worker-id", "1", "--model", "m",
		"--metrics-url", "http://127.0.0.1:1/metrics", "--nats-creds", creds, "--check")
	if code != 0 || !strings.Contains(stdout, creds) {
		t.Errorf("exit %d; the credentials file's path is not shown:\n%s", code, stdout)
	}
}

// TestCheckNotFromEnvironment: WORKERMON_CHECK does not turn a start into
// a check.
func TestCheckNotFromEnvironment(t *testing.T) {
	t.Setenv("WORKERMON_CHECK", "true")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	check := newCheck(fs, "x")
	if err := parseFlags(fs, nil, io.Discard, nil); err != nil {
		t.Fatal(err)
	}
	if check.on {
		t.Error("WORKERMON_CHECK set --check")
	}
}
