package sim_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/sim"
)

// waitTimeout bounds every wait for something to happen over the network.
const waitTimeout = 10 * time.Second

// testHeartbeat is the publishers' heartbeat in these tests, short so that
// silence is quick to tell.
const testHeartbeat = 100 * time.Millisecond

// workerConfig returns a one-rank worker of s's server with a fast engine
// and a short heartbeat.
func workerConfig(s *server.Server) sim.WorkerConfig {
	cfg := sim.DefaultWorkerConfig()
	cfg.Ranks = 1
	cfg.NATS.URL = s.ClientURL()
	cfg.NATS.ReconnectWait = 50 * time.Millisecond
	cfg.Publish.Heartbeat = testHeartbeat
	cfg.Publish.Debounce = 2 * time.Millisecond
	cfg.Engine.PrefillSpeed = 1_000_000
	cfg.Engine.DecodeSpeed = 2000
	return cfg
}

// startWorker starts a worker closed at the end of the test.
func startWorker(t *testing.T, cfg sim.WorkerConfig) *sim.Worker {
	t.Helper()
	w, err := sim.NewWorker(t.Context(), cfg, nil)
	if err != nil {
		t.Fatalf("NewWorker: %v", err)
	}
	// t.Context is already cancelled when cleanups run.
	t.Cleanup(func() { _ = w.Close(context.Background()) })
	return w
}

// env is a NATS server and an observer's connection to it.
type env struct {
	srv *server.Server
	obs *nats.Conn
}

func newEnv(t *testing.T) *env {
	t.Helper()
	s := natstest.Start(t, nil)
	return &env{srv: s, obs: natstest.Connect(t, s)}
}

// waitUntil polls cond until it holds, failing the test after waitTimeout.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	natstest.WaitFor(t, waitTimeout, what, cond)
}

// message is a decoded report or goodbye.
type message struct {
	report *events.LoadReport
	bye    *events.Goodbye
}

// inbox receives every report and goodbye under the default prefix.
type inbox struct {
	ch chan *nats.Msg
}

// subscribe returns an inbox subscribed on the server before it returns.
func subscribe(t *testing.T, nc *nats.Conn) *inbox {
	t.Helper()
	in := &inbox{ch: make(chan *nats.Msg, 1<<14)}
	sub, err := nc.ChanSubscribe(events.DefaultSubjectPrefix+".>", in.ch)
	if err != nil {
		t.Fatalf("subscribe: %v", err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.FlushTimeout(waitTimeout); err != nil {
		t.Fatalf("flush subscription: %v", err)
	}
	return in
}

// next returns the next message, or false when none arrives within d.
func (in *inbox) next(t *testing.T, d time.Duration) (message, bool) {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case m := <-in.ch:
		return decode(t, m), true
	case <-timer.C:
		return message{}, false
	}
}

func decode(t *testing.T, m *nats.Msg) message {
	t.Helper()
	s, err := events.ParseSubject(events.DefaultSubjectPrefix, m.Subject)
	if err != nil {
		t.Fatalf("parse subject: %v", err)
	}
	switch s.Kind {
	case events.KindLoad:
		r, err := events.DecodeLoadReport(m.Data)
		if err != nil {
			t.Fatalf("decode report on %s: %v", m.Subject, err)
		}
		if err := r.Match(s); err != nil {
			t.Fatal(err)
		}
		return message{report: &r}
	default:
		g, err := events.DecodeGoodbye(m.Data)
		if err != nil {
			t.Fatalf("decode goodbye on %s: %v", m.Subject, err)
		}
		if err := g.Match(s); err != nil {
			t.Fatal(err)
		}
		return message{bye: &g}
	}
}

// waitReport returns the first report for which ok holds, skipping others.
func (in *inbox) waitReport(t *testing.T, what string, ok func(events.LoadReport) bool) events.LoadReport {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		m, got := in.next(t, time.Until(deadline))
		if !got {
			t.Fatalf("no report with %s within %v", what, waitTimeout)
		}
		if m.report != nil && ok(*m.report) {
			return *m.report
		}
	}
}

// waitBye returns the first goodbye, skipping reports.
func (in *inbox) waitBye(t *testing.T) events.Goodbye {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		m, got := in.next(t, time.Until(deadline))
		if !got {
			t.Fatalf("no goodbye within %v", waitTimeout)
		}
		if m.bye != nil {
			return *m.bye
		}
	}
}

// settle drains the inbox until it has been silent for quiet, and returns
// what it drained.
func (in *inbox) settle(t *testing.T, quiet time.Duration) []message {
	t.Helper()
	var got []message
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		m, ok := in.next(t, quiet)
		if !ok {
			return got
		}
		got = append(got, m)
	}
	t.Fatalf("messages still arriving after %v", waitTimeout)
	return nil
}

// post sends body as JSON to url and returns the response, failing the
// test on a transport error. Only the test's goroutine may call it.
func post(t *testing.T, ctx context.Context, url string, body any) *http.Response {
	t.Helper()
	resp, err := tryPost(ctx, url, body)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// tryPost sends body ([]byte as is, anything else as JSON) to url.
func tryPost(ctx context.Context, url string, body any) (*http.Response, error) {
	data, ok := body.([]byte)
	if !ok {
		var err error
		if data, err = json.Marshal(body); err != nil {
			return nil, err
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return http.DefaultClient.Do(req)
}

// decodeJSON reads resp's body into a generic map and closes it.
func decodeJSON(t *testing.T, resp *http.Response) map[string]any {
	t.Helper()
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatalf("decode body: %v", err)
	}
	return m
}

// readEvents returns the data of every SSE event of r, until EOF.
func readEvents(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, data)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("read events: %v", err)
	}
	return out
}

// path walks a decoded JSON value along keys (strings) and indexes (ints).
func path(v any, steps ...any) any {
	for _, s := range steps {
		switch k := s.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				return nil
			}
			v = m[k]
		case int:
			a, ok := v.([]any)
			if !ok || k >= len(a) {
				return nil
			}
			v = a[k]
		}
	}
	return v
}
