package router

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/workermon/workermon/events"
)

func TestStreamingNotBuffered(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	second := make(chan struct{})
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		fmt.Fprint(w, sseEvent(completionChunk("c1", "one", "", nil)))
		w.(http.Flusher).Flush()
		select {
		case <-second:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, sseEvent(completionChunk("c1", " two", "stop", nil)))
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	env.putWorker(t, model, 1, e.srv.URL)

	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, env.front.URL+PathChatCompletions,
		strings.NewReader(`{"model":"`+model+`","messages":[],"stream":true}`))
	resp, err := env.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" || resp.Header.Get("Cache-Control") != "no-cache" {
		t.Errorf("headers %v", resp.Header)
	}
	br := bufio.NewReader(resp.Body)
	first := readEvent(t, br)
	if !strings.Contains(first, `"one"`) {
		t.Fatalf("first event %q", first)
	}
	// Only now may the engine send the rest.
	close(second)
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	res := parseStream(t, append([]byte(first), rest...))
	if res.text != "one two" || res.done != 1 || len(res.errors) != 0 {
		t.Errorf("stream %q", res.raw)
	}
}

// readEvent reads one event, up to its blank line.
func readEvent(t *testing.T, br *bufio.Reader) string {
	t.Helper()
	var ev strings.Builder
	for {
		line, err := br.ReadString('\n')
		ev.WriteString(line)
		if err != nil {
			t.Fatalf("reading an event: %v (so far %q)", err, ev.String())
		}
		if line == "\n" {
			return ev.String()
		}
	}
}

// migratingEngine streams a completion: a request whose prompt is the
// original one gets the first part and is cut (by abort or by an early end);
// a continuation gets the rest. cuts says how many requests are cut before
// one continues.
type migratingEngine struct {
	cutAbort bool  // cut by aborting the connection, else by ending early
	usage    bool  // send usage in every chunk, counting 3 tokens per chunk
	cuts     int32 // requests to cut before one finishes
	refuse   bool  // answer continuations 503
	n        atomic.Int32
}

func (m *migratingEngine) handle(w http.ResponseWriter, r *http.Request, body map[string]any) {
	prompt, _ := body["prompt"].(string)
	if m.refuse && strings.Contains(prompt, "<") {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprint(w, `{"object":"error","message":"overloaded","code":503}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	k := m.n.Add(1)
	id := fmt.Sprintf("cmpl-%d", k)
	send := func(texts []string, finish string) {
		for i, text := range texts {
			var usage map[string]int
			if m.usage {
				usage = map[string]int{"prompt_tokens": 5 + len(prompt), "completion_tokens": 3 * (i + 1), "total_tokens": 0}
			}
			fr := ""
			if i == len(texts)-1 {
				fr = finish
			}
			fmt.Fprint(w, sseEvent(completionChunk(id, text, fr, usage)))
			w.(http.Flusher).Flush()
		}
	}
	if k <= m.cuts {
		send([]string{fmt.Sprintf("<%d-a>", k), fmt.Sprintf("<%d-b>", k)}, "")
		// Half an event that must never reach the client.
		fmt.Fprint(w, `data: {"id":"x","choices":[{"text":"LOST`)
		w.(http.Flusher).Flush()
		if m.cutAbort {
			panic(http.ErrAbortHandler)
		}
		return
	}
	send([]string{"<end>", ""}, "length")
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func TestMigration(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		cutAbort  bool
		usage     bool
		wantMax   float64 // max_tokens of the continuation
		wantUsage float64 // completion_tokens of the client's last usage
		extra     string  // more fields of the request
		wantSim   any     // sim_output_tokens of the continuation, nil: absent
	}{
		{"read error, tokens by chunk", true, false, 10 - 2, 0, "", nil},
		{"end without [DONE], tokens by chunk", false, false, 10 - 2, 0, "", nil},
		{"read error, engine usage", true, true, 10 - 6, 6 + 6, "", nil},
		{"sim_output_tokens lowered by the chunks", true, false, 10 - 2, 0, `,"sim_output_tokens":7`, float64(7 - 2)},
		{"sim_output_tokens lowered by the usage", true, true, 10 - 6, 6 + 6, `,"sim_output_tokens":9`, float64(9 - 6)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, envOptions{config: func(c *Config) { c.MigrationLimit = 2 }})
			me := &migratingEngine{cutAbort: tc.cutAbort, usage: tc.usage, cuts: 1}
			a, b := newEngine(t, me.handle), newEngine(t, me.handle)
			env.putWorker(t, model, 1, a.srv.URL)
			env.putWorker(t, model, 2, b.srv.URL)
			env.putRecord(t, model, []uint64{1, 2}, nil, time.Now())

			resp := env.post(t, PathCompletions,
				`{"model":"`+model+`","prompt":"Say <&>:","max_tokens":10,"min_tokens":1,"stream":true,"temperature":0`+tc.extra+`}`)
			raw := readAll(t, resp)
			res := parseStream(t, raw)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			if res.text != "<1-a><1-b><end>" || res.done != 1 || len(res.errors) != 0 || strings.Contains(res.raw, "LOST") {
				t.Fatalf("client stream %q", raw)
			}
			if len(slices.Compact(slices.Clone(res.ids))) != 1 || res.ids[0] != "cmpl-1" {
				t.Errorf("ids %v: want the first worker's id throughout", res.ids)
			}
			if !slices.Equal(res.finish, []string{"length"}) {
				t.Errorf("finish reasons %v", res.finish)
			}
			// Every segment may be cut again while migrations remain (§12).
			for _, e := range []*engine{a, b} {
				for _, r := range e.requests() {
					if got := r.header.Get(events.MigratableHeader); got != "1" {
						t.Errorf("engine request %v: %s = %q, want 1", r.body["prompt"], events.MigratableHeader, got)
					}
				}
			}

			// One engine got the original request, the other the continuation.
			first, second := a, b
			if len(a.requests()) == 1 && a.requests()[0].body["prompt"] != "Say <&>:" {
				first, second = b, a
			}
			if len(first.requests()) != 1 || len(second.requests()) != 1 {
				t.Fatalf("requests a=%d b=%d, want one each", len(a.requests()), len(b.requests()))
			}
			cont := second.requests()[0].body
			if cont["prompt"] != "Say <&>:<1-a><1-b>" || cont["max_tokens"] != tc.wantMax || cont["stream"] != true ||
				cont["temperature"] != float64(0) || cont["model"] != model {
				t.Errorf("continuation request %v", cont)
			}
			if cont["min_tokens"] != float64(0) {
				t.Errorf("continuation min_tokens %v, want 0", cont["min_tokens"])
			}
			if cont["sim_output_tokens"] != tc.wantSim {
				t.Errorf("continuation sim_output_tokens %v, want %v", cont["sim_output_tokens"], tc.wantSim)
			}
			if tc.usage {
				last := res.usage[len(res.usage)-1]
				if last["completion_tokens"] != tc.wantUsage || last["prompt_tokens"] != float64(5+len("Say <&>:")) {
					t.Errorf("client's last usage %v", last)
				}
			}
			if got := env.metric(t, "workermon_router_migrations_total", map[string]string{"outcome": migrationContinued}); got != 1 {
				t.Errorf("migrations continued = %v", got)
			}
			if got := env.metric(t, "workermon_router_upstream_errors_total", map[string]string{"kind": upstreamStream}); got != 1 {
				t.Errorf("stream errors = %v", got)
			}
		})
	}
}

func TestMigrationEnds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		limit      int
		path       string
		body       string
		cuts       int32
		refuse     bool
		workers    int
		wantText   string
		wantErr    bool
		wantFinish string // the finish reason the router ends the stream with
		outcome    string
	}{
		{name: "limit reached", limit: 1, path: PathCompletions, cuts: 5, workers: 3,
			body: `{"model":"m","prompt":"p","max_tokens":100,"stream":true}`, wantText: "<1-a><1-b><2-a><2-b>", wantErr: true, outcome: migrationLimit},
		{name: "no other worker", limit: 3, path: PathCompletions, cuts: 5, workers: 1,
			body: `{"model":"m","prompt":"p","stream":true}`, wantText: "<1-a><1-b>", wantErr: true, outcome: migrationFailed},
		{name: "continuation refused", limit: 3, path: PathCompletions, cuts: 5, refuse: true, workers: 2,
			body: `{"model":"m","prompt":"p","stream":true}`, wantText: "<1-a><1-b>", wantErr: true, outcome: migrationFailed},
		{name: "migration off", limit: 0, path: PathCompletions, cuts: 5, workers: 2,
			body: `{"model":"m","prompt":"p","stream":true}`, wantText: "<1-a><1-b>", wantErr: true},
		{name: "chat never migrates", limit: 3, path: PathChatCompletions, cuts: 5, workers: 2,
			body: `{"model":"m","messages":[],"stream":true}`, wantText: "<1-a><1-b>", wantErr: true},
		{name: "prompt list never migrates", limit: 3, path: PathCompletions, cuts: 5, workers: 2,
			body: `{"model":"m","prompt":["p"],"stream":true}`, wantText: "<1-a><1-b>", wantErr: true},
		{name: "max_tokens used up", limit: 3, path: PathCompletions, cuts: 5, workers: 2,
			body: `{"model":"m","prompt":"p","max_tokens":2,"stream":true}`, wantText: "<1-a><1-b>", wantFinish: "length", outcome: migrationFinished},
		{name: "sim_output_tokens used up", limit: 3, path: PathCompletions, cuts: 5, workers: 2,
			body: `{"model":"m","prompt":"p","max_tokens":100,"sim_output_tokens":2,"stream":true}`, wantText: "<1-a><1-b>", wantFinish: "stop", outcome: migrationFinished},
		{name: "both used up: stop", limit: 3, path: PathCompletions, cuts: 5, workers: 2,
			body: `{"model":"m","prompt":"p","max_tokens":2,"sim_output_tokens":2,"stream":true}`, wantText: "<1-a><1-b>", wantFinish: "stop", outcome: migrationFinished},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, envOptions{config: func(c *Config) { c.MigrationLimit = tc.limit }})
			me := &migratingEngine{cutAbort: true, cuts: tc.cuts, refuse: tc.refuse}
			var engines []*engine
			for id := range tc.workers {
				e := newEngine(t, me.handle)
				engines = append(engines, e)
				env.putWorker(t, "m", uint64(id), e.srv.URL)
			}
			resp := env.post(t, tc.path, tc.body)
			raw := readAll(t, resp)
			res := parseStream(t, raw)
			if res.text != tc.wantText || res.done != 1 || strings.Contains(res.raw, "LOST") {
				t.Fatalf("client stream %q", raw)
			}
			if tc.wantErr {
				if len(res.errors) != 1 || res.errors[0]["code"] != float64(502) || res.errors[0]["type"] != typeUpstream ||
					res.errors[0]["message"] == "" {
					t.Errorf("errors %v", res.errors)
				}
			} else if len(res.errors) != 0 {
				t.Errorf("errors %v", res.errors)
			}
			if tc.wantFinish != "" && !slices.Equal(res.finish, []string{tc.wantFinish}) {
				t.Errorf("finish %v", res.finish)
			}
			if tc.outcome != "" {
				if got := env.metric(t, "workermon_router_migrations_total", map[string]string{"outcome": tc.outcome}); got != 1 {
					t.Errorf("migrations{%s} = %v", tc.outcome, got)
				}
			}
		})
	}
}

// TestMigrationTextBounded checks that the text a migratable stream keeps
// for its continuation is bounded: past MaxBodyBytes (a continuation the
// router would not accept itself) it is dropped and a cut stream ends with
// the error event instead of migrating.
func TestMigrationTextBounded(t *testing.T) {
	t.Parallel()
	const maxBody = 256
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.MigrationLimit, c.MaxBodyBytes = 2, maxBody }})
	var served atomic.Int32
	handle := func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		if served.Add(1) > 1 {
			fmt.Fprint(w, sseEvent(completionChunk("c2", "end", "length", nil))+"data: [DONE]\n\n")
			return
		}
		for range 2 * maxBody / 16 {
			fmt.Fprint(w, sseEvent(completionChunk("c1", "0123456789abcdef", "", nil)))
		}
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}
	env.putWorker(t, model, 1, newEngine(t, handle).srv.URL)
	env.putWorker(t, model, 2, newEngine(t, handle).srv.URL)
	raw := readAll(t, env.post(t, PathCompletions, `{"model":"`+model+`","prompt":"p","stream":true}`))
	res := parseStream(t, raw)
	if len(res.text) != 2*maxBody || len(res.errors) != 1 || res.done != 1 {
		t.Errorf("client stream: %d bytes of text, errors %v, %d [DONE]; want %d bytes, one error, one [DONE]",
			len(res.text), res.errors, res.done, 2*maxBody)
	}
	if n := served.Load(); n != 1 {
		t.Errorf("%d requests reached the engines; want 1, no continuation", n)
	}
	if got := env.metric(t, "workermon_router_migrations_total", map[string]string{"outcome": migrationContinued}); got != 0 {
		t.Errorf("migrations continued = %v", got)
	}
}

// TestStreamCutAfterFinish: an engine that loses its connection after its
// last text (finish reason sent) has all but ended the stream: the router
// adds the [DONE] it lacks, once; after its [DONE] too, the client's stream
// had ended, and the router adds nothing and counts no cut.
func TestStreamCutAfterFinish(t *testing.T) {
	t.Parallel()
	for _, done := range []bool{false, true} {
		t.Run(fmt.Sprintf("done sent %v", done), func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, envOptions{})
			e := newEngine(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprint(w, sseEvent(completionChunk("c", "all", "stop", nil)))
				if done {
					fmt.Fprint(w, "data: [DONE]\n\n")
				}
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler) // cut before the chunked body's end
			})
			env.putWorker(t, model, 1, e.srv.URL)
			raw := readAll(t, env.post(t, PathCompletions, `{"model":"`+model+`","prompt":"p","stream":true}`))
			if res := parseStream(t, raw); res.text != "all" || res.done != 1 || len(res.errors) != 0 {
				t.Errorf("client stream %q: want the engine's text, one [DONE]", raw)
			}
			if got := env.metric(t, "workermon_router_upstream_errors_total", map[string]string{"kind": upstreamStream}); done && got != 0 {
				t.Errorf("stream cuts counted = %v, want 0", got)
			}
		})
	}
}

// TestStreamCutAfterErrorEventNotMigrated: an engine that answers an error
// event and [DONE] (how vLLM reports an error inside a stream) and then
// loses its connection has ended the client's stream: it is not continued
// on another worker, even with migration on.
func TestStreamCutAfterErrorEventNotMigrated(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.MigrationLimit = 2 }})
	var served atomic.Int32
	handle := func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		if served.Add(1) > 1 {
			fmt.Fprint(w, sseEvent(completionChunk("c2", "MORE", "stop", nil))+"data: [DONE]\n\n")
			return
		}
		fmt.Fprint(w, sseEvent(completionChunk("c1", "a", "", nil)))
		fmt.Fprint(w, `data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}`+"\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}
	env.putWorker(t, model, 1, newEngine(t, handle).srv.URL)
	env.putWorker(t, model, 2, newEngine(t, handle).srv.URL)
	env.putRecord(t, model, []uint64{1, 2}, nil, time.Now())
	raw := readAll(t, env.post(t, PathCompletions, `{"model":"`+model+`","prompt":"p","stream":true}`))
	if n := served.Load(); n != 1 {
		t.Errorf("%d requests reached the engines; want 1: the stream had ended with an error event and [DONE]", n)
	}
	if res := parseStream(t, raw); res.done != 1 || res.text != "a" || len(res.errors) != 1 {
		t.Errorf("client stream %q: want text %q, the engine's error event and one [DONE]", raw, "a")
	}
}

func TestRawBodyCutAbortsClient(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	e := newEngine(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"x","choices":[`)
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	})
	env.putWorker(t, model, 1, e.srv.URL)
	resp := env.post(t, PathCompletions, `{"model":"`+model+`"}`)
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Error("a cut body reached the client as complete")
	}
}

func TestSSEReader(t *testing.T) {
	t.Parallel()
	stream := ": comment\n\n" +
		"data: {\"a\":1}\n\n" +
		"event: x\r\ndata:{\"b\":\r\ndata: 2}\r\n\r\n" +
		"\n" +
		"data: [DONE]"
	for _, name := range []string{"whole", "one byte at a time"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var r io.Reader = strings.NewReader(stream)
			if name != "whole" {
				r = iotest.OneByteReader(r)
			}
			sr := newSSEReader(r)
			var evs []string
			var datas []string
			for {
				ev, err := sr.next()
				if err != nil {
					if !errors.Is(err, io.EOF) {
						t.Fatal(err)
					}
					if string(ev) != "data: [DONE]" {
						t.Errorf("partial last event %q", ev)
					}
					break
				}
				evs = append(evs, string(ev))
				if d, ok := sseData(ev, nil); ok {
					datas = append(datas, string(d))
				}
			}
			want := []string{": comment\n\n", "data: {\"a\":1}\n\n", "event: x\r\ndata:{\"b\":\r\ndata: 2}\r\n\r\n", "\n"}
			if !slices.Equal(evs, want) {
				t.Errorf("events %q\nwant %q", evs, want)
			}
			if !slices.Equal(datas, []string{`{"a":1}`, "{\"b\":\n2}"}) {
				t.Errorf("data %q", datas)
			}
		})
	}
}

func TestSSEReaderLimits(t *testing.T) {
	t.Parallel()
	sr := newSSEReader(strings.NewReader("data: " + strings.Repeat("x", maxEventBytes+10) + "\n\n"))
	if _, err := sr.next(); !errors.Is(err, errEventTooLarge) {
		t.Errorf("huge event: %v", err)
	}
	boom := errors.New("boom")
	sr = newSSEReader(io.MultiReader(strings.NewReader("data: 1\n"), iotest.ErrReader(boom)))
	if _, err := sr.next(); !errors.Is(err, boom) {
		t.Errorf("read error: %v", err)
	}
}

func TestSSEHelpers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ev, data string
		ok       bool
	}{
		{"data: x\n\n", "x", true},
		{"data:x\n\n", "x", true},
		{"data:  x\n\n", " x", true},
		{"data\n\n", "", true},
		{"datum: x\n\n", "", false},
		{"id: 1\n\n", "", false},
		{": data: x\n\n", "", false},
	} {
		if d, ok := sseData([]byte(tc.ev), nil); string(d) != tc.data || ok != tc.ok {
			t.Errorf("sseData(%q) = %q, %v", tc.ev, d, ok)
		}
	}
	got := sseReplaceData([]byte("id: 7\ndata: a\ndata: b\n\n"), []byte(`{"x":1}`))
	if string(got) != "id: 7\ndata: {\"x\":1}\n\n" {
		t.Errorf("sseReplaceData = %q", got)
	}
	for in, want := range map[string]string{"data: x": "data: x\n\n", "data: x\n": "data: x\n\n", "data: x\n\n": "data: x\n\n"} {
		if got := sseTerminate([]byte(in)); string(got) != want {
			t.Errorf("sseTerminate(%q) = %q", in, got)
		}
	}
}

func TestNewMigration(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		body string
		ok   bool
	}{
		{`{"model":"m","prompt":"p","stream":true}`, true},
		{`{"model":"m","prompt":"p","stream":true,"max_tokens":5,"n":1,"best_of":null,"echo":false}`, true},
		{`{"model":"m","prompt":"p"}`, false},
		{`{"model":"m","prompt":"p","stream":false}`, false},
		{`{"model":"m","prompt":["p"],"stream":true}`, false},
		{`{"model":"m","prompt":[1,2],"stream":true}`, false},
		{`{"model":"m","prompt":null,"stream":true}`, false},
		{`{"model":"m","stream":true}`, false},
		{`{"model":"m","prompt":"p","stream":true,"n":2}`, false},
		{`{"model":"m","prompt":"p","stream":true,"best_of":3}`, false},
		{`{"model":"m","prompt":"p","stream":true,"echo":true}`, false},
		{`{"model":"m","prompt":"p","stream":true,"max_tokens":"5"}`, false},
		{`{"model":"m","prompt":"p","stream":true,"max_tokens":1.5}`, false},
		{`{"model":"m","prompt":"p","stream":true,"sim_output_tokens":3}`, true},
		{`{"model":"m","prompt":"p","stream":true,"sim_output_tokens":"3"}`, false},
		{`{"model":"m","prompt":"p","stream":true,"sim_output_tokens":2.5}`, false},
	} {
		if got := newMigration([]byte(tc.body)) != nil; got != tc.ok {
			t.Errorf("newMigration(%s) eligible = %v, want %v", tc.body, got, tc.ok)
		}
	}
	m := newMigration([]byte(`{"model":"m","prompt":"a\"b","stream":true,"max_tokens":9,"stop":["\n"]}`))
	body, err := m.body([]byte("<c>"), 4, 5)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	if got["prompt"] != `a"b<c>` || got["max_tokens"] != float64(5) || got["stream"] != true ||
		!slices.Equal(got["stop"].([]any), []any{"\n"}) || got["min_tokens"] != nil {
		t.Errorf("continuation body %s", body)
	}
	if !bytes.Contains(body, []byte(`<c>`)) {
		t.Errorf("HTML escaped prompt: %s", body)
	}
	if _, ok := got["sim_output_tokens"]; ok {
		t.Errorf("continuation body %s has a sim_output_tokens the request had not", body)
	}

	// sim_output_tokens goes down with max_tokens.
	m = newMigration([]byte(`{"model":"m","prompt":"p","stream":true,"max_tokens":9,"sim_output_tokens":6}`))
	for _, tc := range []struct {
		produced int
		reached  bool
		want     float64
	}{{0, false, 6}, {4, false, 2}, {5, false, 1}, {6, true, 1}} {
		if got := m.simOutputReached(tc.produced); got != tc.reached {
			t.Errorf("simOutputReached(%d) = %v, want %v", tc.produced, got, tc.reached)
		}
		body, err := m.body(nil, tc.produced, 9-tc.produced)
		if err != nil {
			t.Fatal(err)
		}
		var got map[string]any
		if err := json.Unmarshal(body, &got); err != nil {
			t.Fatal(err)
		}
		if got["sim_output_tokens"] != tc.want || got["max_tokens"] != float64(9-tc.produced) {
			t.Errorf("after %d tokens: continuation body %s, want sim_output_tokens %v", tc.produced, body, tc.want)
		}
	}
}

func TestPickPowerOfTwo(t *testing.T) {
	t.Parallel()
	var l loads
	l.init()
	cands := []events.WorkerEntry{{WorkerID: 1, Endpoint: "http://a"}, {WorkerID: 2, Endpoint: "http://b"}}
	l.counter("http://a").Add(5)
	for range 100 {
		if w, ok := l.pick(cands, nil); !ok || w.WorkerID != 2 {
			t.Fatalf("pick = %d, %v; want the less loaded 2", w.WorkerID, ok)
		}
	}
	if w, ok := l.pick(cands, []uint64{2}); !ok || w.WorkerID != 1 {
		t.Errorf("pick with 2 tried = %d, %v", w.WorkerID, ok)
	}
	if _, ok := l.pick(cands, []uint64{1, 2}); ok {
		t.Error("pick with every candidate tried")
	}
	// With three candidates, the most loaded one is never picked.
	cands = append(cands, events.WorkerEntry{WorkerID: 3, Endpoint: "http://c"})
	l.counter("http://c").Add(1)
	seen := map[uint64]int{}
	for range 300 {
		w, _ := l.pick(cands, nil)
		seen[w.WorkerID]++
	}
	if seen[1] != 0 || seen[2] == 0 || seen[3] == 0 {
		t.Errorf("picks %v", seen)
	}
}

// TestMigrationBackToAnEarlierWorker: two workers cut the stream in turn
// (as a rescheduler may ask each): the stream goes back to a worker that
// cut it before, never to the one that just did, and completes.
func TestMigrationBackToAnEarlierWorker(t *testing.T) {
	t.Parallel()
	const model = "m"
	env := newTestEnv(t, envOptions{config: func(c *Config) { c.MigrationLimit = 4 }})
	me := &migratingEngine{cuts: 3}
	a, b := newEngine(t, me.handle), newEngine(t, me.handle)
	env.putWorker(t, model, 1, a.srv.URL)
	env.putWorker(t, model, 2, b.srv.URL)
	env.putRecord(t, model, []uint64{1, 2}, nil, time.Now())
	resp := env.post(t, PathCompletions, `{"model":"`+model+`","prompt":"Say:","max_tokens":20,"stream":true}`)
	raw := readAll(t, resp)
	res := parseStream(t, raw)
	if res.done != 1 || len(res.errors) != 0 || res.text != "<1-a><1-b><2-a><2-b><3-a><3-b><end>" {
		t.Fatalf("client stream %q", raw)
	}
	// Four segments alternating between the two workers.
	na, nb := len(a.requests()), len(b.requests())
	if na+nb != 4 || na != 2 || nb != 2 {
		t.Errorf("segments: %d on worker 1, %d on worker 2; want 2 and 2, alternating", na, nb)
	}
}
