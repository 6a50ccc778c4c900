package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/natsconn"
)

// routerTestStart starts `workermon router` wiring against natsURL on a
// random loopback port, stopped at the end of the test.
func routerTestStart(t *testing.T, natsURL string, mutate func(*routerOptions)) *routerService {
	t.Helper()
	o := defaultRouterOptions()
	o.natsURL = natsURL
	o.httpAddr = "127.0.0.1:0"
	if mutate != nil {
		mutate(&o)
	}
	svc, err := startRouter(o, slog.New(slog.DiscardHandler), newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, svc.Close)
	return svc
}

func routerTestGet(t *testing.T, url string) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func routerTestPost(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// routerTestPut writes a key, retrying while the bucket is being created.
func routerTestPut(t *testing.T, js jetstream.JetStream, bucket, key string, data []byte) {
	t.Helper()
	natstest.WaitFor(t, 5*time.Second, "put "+key, func() bool {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		kv, err := kvbucket.Open(ctx, js, bucket, 1)
		if err != nil {
			return false
		}
		_, err = kv.Put(ctx, key, data)
		return err == nil
	})
}

func TestRouterCommandEndToEnd(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	svc := routerTestStart(t, srv.ClientURL(), nil)
	base := "http://" + svc.httpAddr
	natstest.WaitFor(t, 10*time.Second, "router ready", func() bool {
		code, _ := routerTestGet(t, base+"/readyz")
		return code == http.StatusOK
	})

	const model = "Qwen/Qwen3-0.6B"
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"cmpl-1","choices":[{"text":"ok","finish_reason":"stop"}]}`)
	}))
	t.Cleanup(engine.Close)
	entry, _ := json.Marshal(events.WorkerEntry{Model: model, WorkerID: 1, Endpoint: engine.URL, DPSize: 1, BootID: 1,
		RegisteredAt: time.Now().UnixNano()})
	routerTestPut(t, js, events.WorkersBucket, events.RegistryKey(model, 1), entry)
	putRecord := func(free, busy []uint64) {
		rec, err := events.MarshalBusySet(&events.BusySet{Model: model, Free: free, Busy: busy,
			AllBusy: len(free) == 0 && len(busy) > 0, UpdatedAt: time.Now().UnixNano(), MonitorID: "test", Epoch: 1})
		if err != nil {
			t.Fatal(err)
		}
		routerTestPut(t, js, events.BusyBucket, events.ModelKey(model), rec)
	}
	putRecord([]uint64{1}, nil)
	natstest.WaitFor(t, 5*time.Second, "request routed", func() bool {
		resp, body := routerTestPost(t, base+"/v1/completions", `{"model":"`+model+`","prompt":"x"}`)
		return resp.StatusCode == http.StatusOK && strings.Contains(body, `"ok"`)
	})

	putRecord(nil, []uint64{1})
	natstest.WaitFor(t, 5*time.Second, "request rejected", func() bool {
		resp, body := routerTestPost(t, base+"/v1/completions", `{"model":"`+model+`","prompt":"x"}`)
		ms, _ := strconv.Atoi(resp.Header.Get("Retry-After-Ms"))
		return resp.StatusCode == http.StatusServiceUnavailable && body == string(admission.RejectBody(503)) &&
			ms >= 1000 && resp.Header.Get("Retry-After") != ""
	})

	code, body := routerTestGet(t, base+"/v1/models")
	if code != http.StatusOK || !strings.Contains(body, `"id":"`+model+`"`) {
		t.Errorf("models: %d %s", code, body)
	}
	code, body = routerTestGet(t, base+"/metrics")
	for _, name := range []string{"workermon_router_admissions_total", "workermon_router_requests_rejected_total",
		"workermon_router_request_duration_seconds", "workermon_router_cancellations_total",
		"workermon_router_upstream_errors_total", "workermon_router_watch_ready"} {
		if !strings.Contains(body, name) {
			t.Errorf("/metrics (%d) lacks %s", code, name)
		}
	}
}

func TestRouterStartsWithoutNATS(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "nats://" + ln.Addr().String()
	_ = ln.Close()
	svc := routerTestStart(t, url, func(o *routerOptions) { o.nats.ConnectTimeout = 200 * time.Millisecond })
	base := "http://" + svc.httpAddr
	if code, _ := routerTestGet(t, base+"/healthz"); code != http.StatusOK {
		t.Errorf("healthz %d", code)
	}
	code, body := routerTestGet(t, base+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "NATS not connected") {
		t.Errorf("readyz %d %q", code, body)
	}
	// Failing open with nothing loaded: admitted, but no worker is known.
	resp, body := routerTestPost(t, base+"/v1/chat/completions", `{"model":"m","messages":[]}`)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, "no workers available") {
		t.Errorf("request without NATS: %d %s", resp.StatusCode, body)
	}
}

func TestRouterOptions(t *testing.T) {
	t.Setenv("WORKERMON_MIGRATION_LIMIT", "2")
	t.Setenv("WORKERMON_FAIL_OPEN", "false")
	t.Setenv("NATS_URL", "nats://example:4222")
	o := defaultRouterOptions()
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	o.flags(fs)
	if err := parseFlags(fs, []string{"--reject-status", "429", "--stale-list-after", "3s", "--queue-max-wait", "2s",
		"--queue-max-requests", "10", "--queue-max-bytes", "8388608", "--queue-pace", "5ms"}, io.Discard,
		map[string]string{"NATS_URL": "nats-url"}); err != nil {
		t.Fatal(err)
	}
	if o.router.MigrationLimit != 2 || o.failOpen || o.router.RejectStatus != 429 || o.staleListAfter != 3*time.Second ||
		o.natsURL != "nats://example:4222" || o.router.QueueMaxWait != 2*time.Second || o.router.QueueMaxRequests != 10 ||
		o.router.QueuePace != 5*time.Millisecond || o.router.QueueMaxBytes != 8<<20 {
		t.Errorf("options %+v", o)
	}
	if err := o.validate(); err != nil {
		t.Errorf("validate: %v", err)
	}

	d := defaultRouterOptions()
	if d.httpAddr != "127.0.0.1:8080" || d.router.RejectStatus != 503 || d.router.MigrationLimit != 0 || !d.failOpen ||
		d.staleListAfter != 10*time.Second || d.router.MaxBodyBytes != 4<<20 || d.router.RouterID == "" ||
		d.router.QueueMaxWait != 0 || d.router.QueueMaxRequests != 1024 || d.router.QueuePace != 20*time.Millisecond ||
		d.router.QueueMaxBytes != 256<<20 {
		t.Errorf("defaults %+v", d)
	}
	d.natsURL = ""
	if got := d.resolvedNATS().URL; got != natsconn.DefaultURL {
		t.Errorf("empty --nats-url resolves to %q, want %q", got, natsconn.DefaultURL)
	}

	for name, mutate := range map[string]func(*routerOptions){
		"reject status":    func(o *routerOptions) { o.router.RejectStatus = 500 },
		"stale-list-after": func(o *routerOptions) { o.staleListAfter = 0 },
		"retry-after":      func(o *routerOptions) { o.router.RetryAfter = 0 },
		"migration limit":  func(o *routerOptions) { o.router.MigrationLimit = -1 },
		"nats url":         func(o *routerOptions) { o.natsURL = "ftp://x" },
		"replicas":         func(o *routerOptions) { o.replicas = 9 },
		"queue max wait":   func(o *routerOptions) { o.router.QueueMaxWait = -time.Second },
		"queue pace": func(o *routerOptions) {
			o.router.QueueMaxWait, o.router.QueuePace = time.Second, 0
		},
		"queue max requests": func(o *routerOptions) {
			o.router.QueueMaxWait, o.router.QueueMaxRequests = time.Second, 0
		},
		"queue max bytes": func(o *routerOptions) {
			o.router.QueueMaxWait, o.router.QueueMaxBytes = time.Second, o.router.MaxBodyBytes-1
		},
	} {
		o := defaultRouterOptions()
		mutate(&o)
		if err := o.validate(); !errors.Is(err, errUsage) {
			t.Errorf("%s: validate() = %v, want a usage error", name, err)
		}
	}

	var out, errOut strings.Builder
	if code := run([]string{"router", "--reject-status", "500"}, &out, &errOut); code != 2 {
		t.Errorf("bad --reject-status: exit %d (%s)", code, errOut.String())
	}
}

// TestRouterChecksLateServer: contract §14 refuses a server without
// JetStream with exit 1 and one line. A router starts before NATS (it fails
// open), so the server it first reaches later, as in a pod restart or a
// compose stack, is checked then: without JetStream the command ends with
// ErrServerUnsupported; with it, the router runs on and becomes ready.
func TestRouterChecksLateServer(t *testing.T) {
	t.Parallel()
	for _, jetStream := range []bool{false, true} {
		t.Run(fmt.Sprintf("jetstream=%v", jetStream), func(t *testing.T) {
			t.Parallel()
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			addr := ln.Addr().(*net.TCPAddr)
			_ = ln.Close()
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			done := make(chan error, 1)
			var stdout, stderr syncbuf.Buffer
			go func() {
				done <- runRouter(ctx, []string{"--nats-url", "nats://" + addr.String(), "--http-addr", "127.0.0.1:0"}, &stdout, &stderr)
			}()
			// The router is up, NATS not yet.
			for deadline := time.Now().Add(10 * time.Second); !strings.Contains(stdout.String(), "workermon router:"); {
				if time.Now().After(deadline) {
					t.Fatalf("router not up after 10s; its log:\n%s", stderr.String())
				}
				time.Sleep(10 * time.Millisecond)
			}
			opts := natstest.Options(t)
			opts.Host, opts.Port, opts.JetStream = "127.0.0.1", addr.Port, jetStream
			natstest.Start(t, opts)
			if !jetStream {
				select {
				case err := <-done:
					if !errors.Is(err, natsconn.ErrServerUnsupported) {
						t.Errorf("router stopped with %v, want ErrServerUnsupported", err)
					}
				case <-time.After(15 * time.Second):
					t.Errorf("router still running 15s after the server without JetStream came up; its log:\n%s", stderr.String())
				}
				return
			}
			_, base, _ := strings.Cut(stdout.String(), "proxy http://")
			base, _, _ = strings.Cut(base, ",")
			for deadline := time.Now().Add(15 * time.Second); ; {
				if code, _ := routerTestGet(t, "http://"+base+"/readyz"); code == http.StatusOK {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("router not ready 15s after the server came up; its log:\n%s", stderr.String())
				}
				time.Sleep(50 * time.Millisecond)
			}
			select {
			case err := <-done:
				t.Fatalf("router stopped with %v on a server with JetStream", err)
			default:
			}
			cancel()
			if err := <-done; err != nil {
				t.Errorf("router after Ctrl-C: %v", err)
			}
		})
	}
}
