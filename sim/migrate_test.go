package sim_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/sim"
)

// openStream starts a streamed completion, marked migratable or not, and
// waits for its first chunk.
func openStream(t *testing.T, endpoint, model string, marked bool) (*http.Response, *bufio.Scanner) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": "hi", "max_tokens": 200, "stream": true})
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, endpoint+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if marked {
		req.Header.Set(events.MigratableHeader, "1")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data: ") {
			return resp, sc
		}
	}
	t.Fatalf("no first chunk: %v", sc.Err())
	return nil, nil
}

// rest reads the stream to its end: whether it ended with [DONE] and with a
// finish reason.
func rest(sc *bufio.Scanner) (done, finished bool) {
	for sc.Scan() {
		line := sc.Text()
		done = done || line == "data: [DONE]"
		finished = finished || strings.Contains(line, `"finish_reason":"length"`)
	}
	return done, finished
}

// askMigrate asks w over NATS to migrate up to max requests, under epoch,
// and returns how many it says it cut.
func askMigrate(t *testing.T, e *env, w *sim.Worker, max, epoch uint64) uint64 {
	t.Helper()
	data, err := events.MarshalMigrateRequest(events.MigrateRequest{Model: w.Model(), Src: w.ID(), Dst: 99,
		MaxRequests: max, Reason: events.MigrateReasonDecodeLoad, Epoch: epoch})
	if err != nil {
		t.Fatal(err)
	}
	msg, err := e.obs.Request(events.MigrateSubject(events.DefaultSubjectPrefix, w.Model(), w.ID()), data, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	r, err := events.DecodeMigrateReply(msg.Data)
	if err != nil {
		t.Fatal(err)
	}
	return r.Migrated
}

// TestMigrateCutsMarkedStreams: a migrate request over NATS cuts the newest
// running stream the router marked continuable — it ends without [DONE] or
// a finish reason and its blocks are freed — and never an unmarked one.
func TestMigrateCutsMarkedStreams(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := workerConfig(e.srv)
	cfg.Engine.DecodeSpeed = 100 // 200 tokens: two seconds
	w := startWorker(t, cfg)
	_, plain := openStream(t, w.Endpoint(), w.Model(), false)
	_, older := openStream(t, w.Endpoint(), w.Model(), true)
	_, newer := openStream(t, w.Endpoint(), w.Model(), true)

	ask := func(max uint64, epoch uint64) uint64 { t.Helper(); return askMigrate(t, e, w, max, epoch) }
	if n := ask(1, 1); n != 1 {
		t.Fatalf("migrated %d, want 1", n)
	}
	if done, finished := rest(newer); done || finished {
		t.Errorf("the cut stream ended with [DONE]=%v finish=%v, want neither", done, finished)
	}
	// The older marked stream is next; the unmarked one is never cut.
	if n := ask(5, 1); n != 1 {
		t.Errorf("second request migrated %d, want 1 (only one marked stream left)", n)
	}
	if done, _ := rest(older); done {
		t.Error("the older marked stream was not cut")
	}
	if n := ask(5, 1); n != 0 {
		t.Errorf("third request migrated %d, want 0", n)
	}
	if done, finished := rest(plain); !done || !finished {
		t.Errorf("the unmarked stream ended with [DONE]=%v finish=%v, want both", done, finished)
	}
	if s := w.Stats(); s.Migrated != 2 {
		t.Errorf("stats: %d migrated, want 2", s.Migrated)
	}
	waitUntil(t, "the cut requests' blocks freed", func() bool {
		s := w.Stats()
		return s.InFlight == 0 && s.Ranks[0].ActiveDecodeBlocks == 0
	})
}

// TestMigrateCutsRunningNotWaiting: a migrate request cuts marked streams
// that are running (contract §12), not one still waiting for its prefill,
// which holds no KV block: cutting it freed nothing, and the rescheduler
// was told a request moved.
func TestMigrateCutsRunningNotWaiting(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := workerConfig(e.srv)
	cfg.Engine.DecodeSpeed = 100 // 200 tokens: two seconds
	cfg.Engine.MaxNumSeqs = 1    // the second request waits
	w := startWorker(t, cfg)
	_, running := openStream(t, w.Endpoint(), w.Model(), true)
	waiting := make(chan bool, 1)
	go func() {
		body, _ := json.Marshal(map[string]any{"model": w.Model(), "prompt": "hi", "max_tokens": 20, "stream": true})
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, w.Endpoint()+"/v1/completions", bytes.NewReader(body))
		req.Header.Set(events.MigratableHeader, "1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			waiting <- false
			return
		}
		defer resp.Body.Close()
		done, finished := rest(bufio.NewScanner(resp.Body))
		waiting <- done && finished
	}()
	waitUntil(t, "one request running, one waiting", func() bool {
		r := w.Stats().Ranks[0]
		return r.Running == 1 && r.Waiting == 1
	})
	if n := askMigrate(t, e, w, 1, 1); n != 1 {
		t.Fatalf("migrated %d, want 1", n)
	}
	if done, finished := rest(running); done || finished {
		t.Errorf("the running stream ended with [DONE]=%v finish=%v: want it cut", done, finished)
	}
	if !<-waiting {
		t.Error("the waiting stream was cut: want it served to its end")
	}
}
