package main

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
)

// TestSlotsHealthVersion: the slot tracker's /health (Dynamo's, 200) names
// the NATS server's version, and /metrics exports it, when the tracker uses
// NATS; "none" when it does not. A wrong method still gets 405.
func TestSlotsHealthVersion(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	for _, tc := range []struct {
		name     string
		registry bool
		want     string
	}{
		{"without NATS", false, "ok\nnats_server_version none\n"},
		{"with --from-registry", true, "ok\nnats_server_version " + server.VERSION + "\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			o := defaultSlotsOptions()
			o.httpAddr = "127.0.0.1:0"
			o.fromRegistry = tc.registry
			o.natsURL = srv.ClientURL()
			reg := newRegistry()
			svc, err := startSlots(t.Context(), o, slog.New(slog.DiscardHandler), reg)
			if err != nil {
				t.Fatal(err)
			}
			closeAtCleanup(t, svc.close)
			base := "http://" + svc.http.addr
			if status, _, body := slotsTestDo(t, "GET", base+"/healthz", ""); status != http.StatusOK || body != tc.want {
				t.Errorf("GET /healthz: %d %q, want 200 %q", status, body, tc.want)
			}
			if status, allow, _ := slotsTestDo(t, "POST", base+"/healthz", ""); status != http.StatusMethodNotAllowed || allow != "GET, HEAD" {
				t.Errorf("POST /healthz: %d, Allow %q; want 405 GET, HEAD", status, allow)
			}
			// Dynamo's /health: 200 with an empty body, nothing of ours.
			if status, _, body := slotsTestDo(t, "GET", base+"/health", ""); status != http.StatusOK || body != "" {
				t.Errorf("GET /health: %d %q, want 200 and an empty body", status, body)
			}
			_, _, metrics := slotsTestDo(t, "GET", base+"/metrics", "")
			info := `workermon_nats_server_info{version="` + server.VERSION + `"} 1`
			if got := strings.Contains(metrics, info); got != tc.registry {
				t.Errorf("/metrics has %s: %v, want %v", info, got, tc.registry)
			}
		})
	}
}

// TestSimReportsVersion: `workermon sim` logs the NATS server's version at
// connect, prints the address of its /healthz and /metrics, names the
// version there and exports workermon_nats_server_info; with --publish=false
// it uses no NATS and says so.
func TestSimReportsVersion(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	for _, tc := range []struct {
		name    string
		args    []string
		health  string
		metrics bool
	}{
		{"publishing", nil, "ok\nnats_server_version " + server.VERSION + "\n", true},
		{"off NATS", []string{"--publish=false"}, "ok\nnats_server_version none\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(t.Context())
			var stdout, stderr syncbuf.Buffer
			done := make(chan error, 1)
			args := append([]string{"--nats-url", srv.ClientURL(), "--workers", "1", "--port-base", "0"}, tc.args...)
			go func() { done <- runSim(ctx, args, &stdout, &stderr) }()
			var base string
			natstest.WaitFor(t, 15*time.Second, "the sim's HTTP address on stdout", func() bool {
				for line := range strings.Lines(stdout.String()) {
					if rest, ok := strings.CutPrefix(line, "workermon sim: http://"); ok {
						addr, _, _ := strings.Cut(rest, " ")
						base = "http://" + addr
						return true
					}
				}
				return false
			})
			if status, _, body := slotsTestDo(t, "GET", base+"/healthz", ""); status != http.StatusOK || body != tc.health {
				t.Errorf("GET /healthz: %d %q, want 200 %q", status, body, tc.health)
			}
			_, _, metrics := slotsTestDo(t, "GET", base+"/metrics", "")
			info := `workermon_nats_server_info{version="` + server.VERSION + `"} 1`
			if got := strings.Contains(metrics, info); got != tc.metrics {
				t.Errorf("/metrics has %s: %v, want %v", info, got, tc.metrics)
			}
			logged := strings.Contains(stderr.String(), `msg="nats: connected" component=nats`) &&
				strings.Contains(stderr.String(), "server_version="+server.VERSION)
			if logged != tc.metrics {
				t.Errorf("the sim's own connection logged with its server version: %v, want %v\n%s", logged, tc.metrics, stderr.String())
			}
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("runSim: %v", err)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("runSim did not return 15s after its context ended")
			}
		})
	}
}
