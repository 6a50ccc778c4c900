package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/httplimit"
	"github.com/workermon/workermon/internal/natstest"
)

// shortLimits are HTTP deadlines a test can wait out.
var shortLimits = httplimit.Limits{BodyRead: 200 * time.Millisecond, Write: 200 * time.Millisecond}

// endlessBody sends a POST to addr whose chunked body trickles for ever
// and reports how the server ended it: its status, or 0 when it closed the
// connection without one. It fails the test when the server holds on for
// 20 s, a bound far above the limits that only turns a hang into a failure.
func endlessBody(t *testing.T, addr, path string) int {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n", path)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				if _, err := io.WriteString(c, "1\r\n \r\n"); err != nil {
					return
				}
			}
		}
	}()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("POST %s with a body that never ends: no answer and the connection still open after 20s", path)
	}
	if err != nil {
		return 0 // closed, or reset while the client was still sending
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
	resp.Body.Close()
	t.Logf("POST %s with a body that never ends: %d %s", path, resp.StatusCode, b)
	return resp.StatusCode
}

// TestRouterHTTPDeadlines: the router cuts a request body that never ends
// (issue 23, item 22), while a streamed completion that lasts six times
// both limits is relayed whole (item 17).
func TestRouterHTTPDeadlines(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	svc := routerTestStart(t, srv.ClientURL(), func(o *routerOptions) { o.httpLimits = shortLimits })
	base := "http://" + svc.httpAddr
	natstest.WaitFor(t, 10*time.Second, "router ready", func() bool {
		code, _ := routerTestGet(t, base+"/readyz")
		return code == http.StatusOK
	})

	const model, chunks = "deadline/model", 12
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range chunks {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			finish := "null"
			if i == chunks-1 {
				finish = `"stop"`
			}
			fmt.Fprintf(w, "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"t%d\",\"finish_reason\":%s}]}\n\n", i, finish)
			_ = rc.Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(engine.Close)
	entry, _ := json.Marshal(events.WorkerEntry{Model: model, WorkerID: 1, Endpoint: engine.URL, DPSize: 1, BootID: 1,
		RegisteredAt: time.Now().UnixNano()})
	routerTestPut(t, js, events.WorkersBucket, events.RegistryKey(model, 1), entry)
	natstest.WaitFor(t, 5*time.Second, "worker registered", func() bool {
		return len(svc.registry.Endpoints(model)) == 1
	})

	resp, body := routerTestPost(t, base+"/v1/completions", `{"model":"`+model+`","prompt":"x","stream":true}`)
	if resp.StatusCode != http.StatusOK || strings.Count(body, `"text":"t`) != chunks || !strings.Contains(body, "data: [DONE]") {
		t.Errorf("a stream of %d × 100 ms with 200 ms limits: %d\n%s", chunks, resp.StatusCode, body)
	}

	if code := endlessBody(t, svc.httpAddr, "/v1/completions"); code != 0 && code != http.StatusRequestTimeout {
		t.Errorf("a body that never ends: status %d, want 408 or the connection closed", code)
	}
}

// TestMonitorHTTPDeadlines: the monitor cuts a request body that never
// ends (issue 23, item 22).
func TestMonitorHTTPDeadlines(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { o.httpLimits = shortLimits })
	for _, path := range []string{"/busy_threshold", "/cordon"} {
		if code := endlessBody(t, svc.httpAddr, path); code != 0 && code != http.StatusRequestTimeout {
			t.Errorf("%s, a body that never ends: status %d, want 408 or the connection closed", path, code)
		}
	}
}
