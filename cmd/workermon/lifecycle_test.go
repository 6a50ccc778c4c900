package main

import (
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
