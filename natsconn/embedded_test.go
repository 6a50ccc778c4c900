package natsconn

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// embeddedConfig returns a config for a server on a random loopback port
// storing under a fresh temporary directory.
func embeddedConfig(t *testing.T) EmbeddedConfig {
	t.Helper()
	cfg := DefaultEmbeddedConfig()
	cfg.Addr = "127.0.0.1:0"
	cfg.DataDir = filepath.Join(t.TempDir(), "data")
	cfg.ServerName = "natsconn-test"
	return cfg
}

// startEmbedded starts a server closed at the end of the test.
func startEmbedded(t *testing.T, cfg EmbeddedConfig) *Embedded {
	t.Helper()
	e, err := StartEmbedded(t.Context(), cfg)
	if err != nil {
		t.Fatalf("StartEmbedded: %v", err)
	}
	t.Cleanup(e.Close)
	return e
}

func TestStartEmbedded(t *testing.T) {
	t.Parallel()
	logs := newCapture(slog.LevelInfo)
	cfg := embeddedConfig(t)
	cfg.DataDir = filepath.Join(t.TempDir(), "a", "b") // parents are created too
	cfg.MonitorAddr = "127.0.0.1:0"
	cfg.Logger = logs.logger()
	e := startEmbedded(t, cfg)

	u, err := url.Parse(e.ClientURL())
	if err != nil || u.Scheme != "nats" || u.Hostname() != "127.0.0.1" || u.Port() == "0" || u.Port() == "4222" {
		t.Fatalf("ClientURL = %q", e.ClientURL())
	}
	if !e.Server().Running() || e.Server().Name() != "natsconn-test" {
		t.Errorf("server running %v, name %q", e.Server().Running(), e.Server().Name())
	}

	info, err := os.Stat(cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	if perm := info.Mode().Perm(); perm&0o077 != 0 {
		t.Errorf("data dir mode %v, want no group or other access", perm)
	}

	// JetStream works: a KV bucket round trip, stored under DataDir.
	nc := connectT(t, testConfig(e.ClientURL()), nil)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "natsconn-test", Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatalf("create bucket: %v", err)
	}
	if _, err := kv.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if ent, err := kv.Get(ctx, "k"); err != nil || string(ent.Value()) != "v" {
		t.Fatalf("get = %v, %v", ent, err)
	}
	if _, err := os.Stat(filepath.Join(cfg.DataDir, "jetstream")); err != nil {
		t.Errorf("store not under the data dir: %v", err)
	}

	// Monitoring.
	if !strings.HasPrefix(e.MonitorURL(), "http://127.0.0.1:") {
		t.Fatalf("MonitorURL = %q", e.MonitorURL())
	}
	resp, err := http.Get(e.MonitorURL() + "/varz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/varz: %s", resp.Status)
	}

	// nats-server's logs reach slog, tagged.
	var fromServer bool
	for _, r := range logs.all() {
		if r.Attrs["component"] == "nats-server" && r.Level == slog.LevelInfo {
			fromServer = true
		}
	}
	if !fromServer {
		t.Error("no Info log from nats-server")
	}
	rec := logs.waitFor(t, slog.LevelInfo, "embedded NATS server ready")
	if rec.Attrs["url"] != e.ClientURL() {
		t.Errorf("ready log attrs = %v", rec.Attrs)
	}
	if len(logs.records(slog.LevelWarn, "embedded NATS server listens beyond loopback without authentication: anyone who reaches it can publish load reports and change the buckets")) != 0 {
		t.Error("warned about a loopback address")
	}
}

func TestStartEmbeddedNoMonitor(t *testing.T) {
	t.Parallel()
	e := startEmbedded(t, embeddedConfig(t))
	if e.MonitorURL() != "" || e.Server().MonitorAddr() != nil {
		t.Errorf("monitoring is on: %q", e.MonitorURL())
	}
}

func TestStartEmbeddedKeepsData(t *testing.T) {
	t.Parallel()
	cfg := embeddedConfig(t)
	put := func(e *Embedded) jetstream.KeyValue {
		nc := connectT(t, testConfig(e.ClientURL()), nil)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		kv, err := js.CreateOrUpdateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "keep"})
		if err != nil {
			t.Fatal(err)
		}
		return kv
	}
	e := startEmbedded(t, cfg)
	if _, err := put(e).Put(t.Context(), "k", []byte("kept")); err != nil {
		t.Fatal(err)
	}
	e.Close()

	e = startEmbedded(t, cfg)
	ent, err := put(e).Get(t.Context(), "k")
	if err != nil || string(ent.Value()) != "kept" {
		t.Fatalf("after restart: %v, %v", ent, err)
	}
}

func TestStartEmbeddedAddrInUse(t *testing.T) {
	t.Parallel()
	t.Run("another workermon", func(t *testing.T) {
		t.Parallel()
		first := startEmbedded(t, embeddedConfig(t))
		cfg := embeddedConfig(t)
		cfg.Addr = strings.TrimPrefix(first.ClientURL(), "nats://")
		start := time.Now()
		e, err := StartEmbedded(t.Context(), cfg)
		if err == nil {
			e.Close()
			t.Fatal("second server started on the same address")
		}
		if !errors.Is(err, ErrAddrInUse) || !strings.Contains(err.Error(), cfg.Addr) {
			t.Errorf("StartEmbedded = %v, want ErrAddrInUse naming %s", err, cfg.Addr)
		}
		// Failing fast, not after the ready timeout (10 s) ran out.
		if d := time.Since(start); d > DefaultReadyTimeout/2 {
			t.Errorf("took %v to fail", d)
		}
		// The first one is untouched.
		roundTrip(t, connectT(t, testConfig(first.ClientURL()), nil))
	})
	t.Run("another workermon with the same config", func(t *testing.T) {
		t.Parallel()
		cfg := embeddedConfig(t)
		first := startEmbedded(t, cfg)
		cfg.Addr = strings.TrimPrefix(first.ClientURL(), "nats://")
		if _, err := StartEmbedded(t.Context(), cfg); !errors.Is(err, ErrAddrInUse) {
			t.Errorf("StartEmbedded = %v, want ErrAddrInUse", err)
		}
	})
	t.Run("monitoring port", func(t *testing.T) {
		t.Parallel()
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		cfg := embeddedConfig(t)
		cfg.MonitorAddr = l.Addr().String()
		if _, err := StartEmbedded(t.Context(), cfg); !errors.Is(err, ErrAddrInUse) {
			t.Errorf("StartEmbedded = %v, want ErrAddrInUse", err)
		}
	})
}

func TestStartEmbeddedDataDirInUse(t *testing.T) {
	t.Parallel()
	cfg := embeddedConfig(t)
	first := startEmbedded(t, cfg)
	e, err := StartEmbedded(t.Context(), cfg) // another random port, same store
	if err == nil {
		e.Close()
		t.Fatal("second server started on the same data dir")
	}
	if !errors.Is(err, ErrDataDirInUse) {
		t.Errorf("StartEmbedded = %v, want ErrDataDirInUse", err)
	}
	// Free again after Close.
	first.Close()
	startEmbedded(t, cfg)
}

func TestStartEmbeddedErrors(t *testing.T) {
	t.Parallel()
	t.Run("invalid config", func(t *testing.T) {
		t.Parallel()
		cfg := embeddedConfig(t)
		cfg.ReadyTimeout = 0
		if _, err := StartEmbedded(t.Context(), cfg); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("StartEmbedded = %v, want ErrInvalidConfig", err)
		}
	})
	t.Run("canceled", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if _, err := StartEmbedded(ctx, embeddedConfig(t)); !errors.Is(err, context.Canceled) {
			t.Errorf("StartEmbedded = %v, want context.Canceled", err)
		}
	})
	t.Run("data dir is a file", func(t *testing.T) {
		t.Parallel()
		cfg := embeddedConfig(t)
		cfg.DataDir = writeFile(t, t.TempDir(), "file", nil)
		if _, err := StartEmbedded(t.Context(), cfg); err == nil || !strings.Contains(err.Error(), "data dir") {
			t.Errorf("StartEmbedded = %v, want a data dir error", err)
		}
	})
}

func TestEmbeddedCloseIdempotent(t *testing.T) {
	t.Parallel()
	logs := newCapture(slog.LevelInfo)
	cfg := embeddedConfig(t)
	cfg.Logger = logs.logger()
	e, err := StartEmbedded(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(e.Close)
	}
	wg.Wait()
	e.Close()
	if e.Server().Running() {
		t.Error("server still running after Close")
	}
	if n := len(logs.records(slog.LevelInfo, "embedded NATS server stopped")); n != 1 {
		t.Errorf("logged stop %d times", n)
	}
	// The port is free again.
	l, err := net.Listen("tcp", strings.TrimPrefix(e.ClientURL(), "nats://"))
	if err != nil {
		t.Fatalf("port still taken after Close: %v", err)
	}
	l.Close()
}

func TestBeyondLoopback(t *testing.T) {
	t.Parallel()
	for host, want := range map[string]bool{
		"127.0.0.1": false, "127.0.0.2": false, "::1": false, "localhost": false,
		"": true, "0.0.0.0": true, "::": true, "10.1.2.3": true, "nats.example.com": true,
	} {
		if got := beyondLoopback(host); got != want {
			t.Errorf("beyondLoopback(%q) = %v, want %v", host, got, want)
		}
	}
}

func TestLoopbackIfUnspecified(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"0.0.0.0:4222":  "127.0.0.1:4222",
		"[::]:4222":     "[::1]:4222",
		"10.0.0.1:4222": "10.0.0.1:4222",
	} {
		a, err := net.ResolveTCPAddr("tcp", in)
		if err != nil {
			t.Fatal(err)
		}
		if got := loopbackIfUnspecified(a).String(); got != want {
			t.Errorf("loopbackIfUnspecified(%s) = %s, want %s", in, got, want)
		}
	}
}
