package main

import (
	"bytes"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestHealthcheck(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("GET /ok", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /down", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "busy bucket not open yet", http.StatusServiceUnavailable)
	})
	mux.HandleFunc("GET /hang", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })

	// An address nobody listens on: bind a port, then free it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String() + "/healthz"
	_ = ln.Close()

	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantOut  string // in stdout on success, in stderr on failure
	}{
		{"2xx is healthy", []string{"--url", srv.URL + "/ok"}, 0, "200 OK ok"},
		{"503 is unhealthy", []string{"--url", srv.URL + "/down"}, 1, "503 Service Unavailable: busy bucket not open yet"},
		{"404 is unhealthy", []string{"--url", srv.URL + "/nothing"}, 1, "404"},
		{"nobody listening", []string{"--url", closed}, 1, "connection refused"},
		{"timeout", []string{"--url", srv.URL + "/hang", "--timeout", "100ms"}, 1, "deadline exceeded"},
		{"not http", []string{"--url", "ftp://127.0.0.1/x"}, 2, "want http://"},
		{"zero timeout", []string{"--url", srv.URL + "/ok", "--timeout", "0s"}, 2, "must be positive"},
		{"stray argument", []string{"--url", srv.URL + "/ok", "extra"}, 2, "unexpected arguments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			start := time.Now()
			code := run(append([]string{"healthcheck"}, tt.args...), &stdout, &stderr)
			if code != tt.wantCode {
				t.Fatalf("exit code %d, want %d; stdout %q, stderr %q", code, tt.wantCode, stdout.String(), stderr.String())
			}
			out := stderr.String()
			if code == 0 {
				out = stdout.String()
			}
			if !strings.Contains(out, tt.wantOut) {
				t.Errorf("output %q does not contain %q", out, tt.wantOut)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("took %v", d)
			}
		})
	}
}

func TestHealthcheckFromEnv(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/readyz" {
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	t.Setenv("WORKERMON_URL", srv.URL+"/readyz")
	err := runHealthcheck(t.Context(), nil, &bytes.Buffer{}, &bytes.Buffer{})
	if err != nil {
		t.Fatalf("WORKERMON_URL not used: %v", err)
	}
	if err := runHealthcheck(t.Context(), []string{"--url", srv.URL + "/other"}, &bytes.Buffer{}, &bytes.Buffer{}); err == nil {
		t.Fatal("the command line did not win over the environment")
	}
	t.Setenv("WORKERMON_TIMEOUT", "soon")
	if err := runHealthcheck(t.Context(), nil, &bytes.Buffer{}, &bytes.Buffer{}); !errors.Is(err, errUsage) {
		t.Fatalf("bad WORKERMON_TIMEOUT: %v, want a usage error", err)
	}
}
