package main

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestHTTPShutdown: a connection that never sent a request does not count
// as a cut request; a request still running at the deadline does.
func TestHTTPShutdown(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	started := make(chan struct{})
	s, err := startHTTP("test", "127.0.0.1:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			close(started)
			<-release
		}
	}), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	idle, err := net.Dial("tcp", s.addr) // connected, no request
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	go func() {
		resp, err := http.Get("http://" + s.addr + "/slow")
		if err == nil {
			resp.Body.Close()
		}
	}()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err = s.shutdown(ctx)
	close(release)
	if err == nil || !strings.Contains(err.Error(), "1 requests still in flight") {
		t.Errorf("shutdown with a running request: %v", err)
	}

	s2, err := startHTTP("test", "127.0.0.1:0", http.NotFoundHandler(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	idle2, err := net.Dial("tcp", s2.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer idle2.Close()
	time.Sleep(50 * time.Millisecond) // accepted: StateNew
	ctx2, cancel2 := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel2()
	if err := s2.shutdown(ctx2); err != nil {
		t.Errorf("shutdown with only a connection that sent nothing: %v", err)
	}
}

// TestInterruptWhileConnectingExitsZero: run documents exit 0 on interrupt.
// Ctrl-C or a pod's SIGTERM while a command still waits for an unreachable
// NATS server is one too, not exit 1 with "context canceled".
func TestInterruptWhileConnectingExitsZero(t *testing.T) {
	t.Parallel()
	const dead = "nats://127.0.0.1:1" // nothing listens there
	tests := [][]string{
		{"sim", "--nats-url", dead, "--http-addr", ""},
		{"scrape", "--nats-url", dead, "--engine", "vllm", "--metrics-url", "http://127.0.0.1:1/metrics",
			"--model", "m", "--worker-id", "1", "--http-addr", ""},
		{"serve", "--nats-url", dead, "--http-addr", "127.0.0.1:0"},
		{"slots", "--from-registry", "--nats-url", dead, "--http-addr", "127.0.0.1:0"},
		{"watch", "--nats-url", dead},
	}
	for _, args := range tests {
		t.Run(args[0], func(t *testing.T) {
			t.Parallel()
			var c command
			for _, c = range commands() {
				if c.name == args[0] {
					break
				}
			}
			// As signal.NotifyContext does on SIGINT: a cancel, not a deadline.
			ctx, cancel := context.WithCancel(t.Context())
			time.AfterFunc(time.Second, cancel)
			var stdout, stderr bytes.Buffer
			if code := runCommand(ctx, c, args[1:], &stdout, &stderr); code != 0 {
				t.Errorf("interrupted while waiting for NATS: exit %d, want 0; stderr:\n%s", code, stderr.String())
			}
		})
	}
}
