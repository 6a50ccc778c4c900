package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/slots"
)

func TestParsePrompt(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, route, body string
		isl               uint64
		seqs              int
	}{
		{"text", routeCompletions, `{"model":"m","prompt":"abcdefgh"}`, 2, 0},
		{"texts", routeCompletions, `{"model":"m","prompt":["abcd","abcde"]}`, 3, 0},
		{"token ids", routeCompletions, `{"model":"m","prompt":[1,2,3,4,5]}`, 5, 1},
		{"token id batches", routeCompletions, `{"model":"m","prompt":[[1,2],[3,4,5]]}`, 5, 2},
		{"negative token", routeCompletions, `{"model":"m","prompt":[1,-2]}`, 0, 0},
		{"no prompt", routeCompletions, `{"model":"m"}`, 0, 0},
		{"chat", routeChatCompletions, `{"model":"m","messages":[{"role":"user","content":"abcd"},{"role":"user","content":[{"type":"text","text":"abcdefgh"}]}]}`, 3, 0},
		{"chat not an array", routeChatCompletions, `{"model":"m","messages":3}`, 0, 0},
	} {
		p := parsePrompt(tt.route, []byte(tt.body))
		if p.isl != tt.isl || len(p.tokens) != tt.seqs {
			t.Errorf("%s: isl %d, %d token sequences; want %d, %d", tt.name, p.isl, len(p.tokens), tt.isl, tt.seqs)
		}
	}
}

// TestSlotsFollowRequests: with a tracker, a request is on its worker's
// slots from dispatch: its prompt tokens until the worker's first bytes,
// its blocks (token-id prompts only, in the registered block size) until
// the answer ends; a client that goes away frees it too. /loads and
// /potential_loads answer from the same tracker.
// A prompt of several sequences sharing a prefix holds the prefix's blocks
// once on a rank (contract §11), so its hashes list them once.
func TestPromptHashesDistinct(t *testing.T) {
	t.Parallel()
	prefix := make([]uint32, 64)
	for i := range prefix {
		prefix[i] = uint32(i)
	}
	a := append(slices.Clone(prefix), 1000, 1001, 1002, 1003)
	b := append(slices.Clone(prefix), 2000, 2001, 2002, 2003)
	p := promptLoad{tokens: [][]uint32{a, b}}
	got := p.hashes(4)
	want := slots.BlockHashes(a, 4)
	for _, h := range slots.BlockHashes(b, 4) {
		if !slices.Contains(want, h) {
			want = append(want, h)
		}
	}
	if len(got) != len(want) || len(want) != 18 {
		t.Fatalf("%d hashes, want the %d distinct blocks of two sequences sharing 16 (of 17 each)", len(got), len(want))
	}
	for _, h := range want {
		if !slices.Contains(got, h) {
			t.Fatalf("hash %x of the prompt missing", h)
		}
	}
}

func TestSlotsFollowRequests(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(tr.Register(slots.Worker{WorkerID: 1, Model: "m", BlockSize: 2, DPStart: 0, DPSize: 2}))
	e := newTestEnv(t, envOptions{config: func(c *Config) { c.Slots, c.RouterID = tr, "rt" }})

	firstToken, finish := make(chan struct{}), make(chan struct{})
	eng := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush() // headers only: no token yet
		select {
		case <-firstToken:
		case <-r.Context().Done():
			return
		}
		_, _ = w.Write([]byte(sseEvent(completionChunk("c", "x", "", nil))))
		w.(http.Flusher).Flush()
		select {
		case <-finish:
		case <-r.Context().Done():
			return
		}
		_, _ = w.Write([]byte(sseEvent(completionChunk("c", "y", "stop", nil)) + "data: [DONE]\n\n"))
	})
	e.putWorker(t, "m", 1, eng.srv.URL)
	e.putRecord(t, "m", []uint64{1}, nil, time.Now())

	load := func() slots.Load {
		var sum slots.Load
		for _, l := range tr.Loads("m", "") {
			sum.ActivePrefillTokens += l.ActivePrefillTokens
			sum.ActiveDecodeBlocks += l.ActiveDecodeBlocks
		}
		return sum
	}
	waitLoad := func(what string, prefill, blocks uint64) {
		t.Helper()
		natstest.WaitFor(t, 5*time.Second, what, func() bool {
			l := load()
			return l.ActivePrefillTokens == prefill && l.ActiveDecodeBlocks == blocks
		})
	}

	// Five token ids in blocks of 2: two complete blocks.
	done := make(chan *http.Response, 1)
	go func() { done <- e.post(t, PathCompletions, `{"model":"m","prompt":[1,2,3,4,5],"stream":true}`) }()
	waitLoad("the request's 5 prompt tokens and 2 blocks", 5, 2)

	// /loads and /potential_loads of the router read the same tracker.
	resp, err := e.front.Client().Get(e.front.URL + "/loads?model_name=m")
	must(err)
	var rows []slots.Load
	must(json.NewDecoder(resp.Body).Decode(&rows))
	resp.Body.Close()
	if len(rows) != 2 || rows[0].ActivePrefillTokens+rows[1].ActivePrefillTokens != 5 {
		t.Fatalf("GET /loads: %+v", rows)
	}
	resp = e.post(t, "/potential_loads", `{"model_name":"m","sequence_hashes":[],"new_isl_tokens":10}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /potential_loads: %d", resp.StatusCode)
	}
	resp.Body.Close()
	// A wrong method is the API's 405, not the router's 404.
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodPost, "/loads", "GET, HEAD"},
		{http.MethodGet, "/potential_loads", "POST"},
	} {
		req, _ := http.NewRequestWithContext(t.Context(), c.method, e.front.URL+c.path, strings.NewReader("{}"))
		resp, err := e.front.Client().Do(req)
		must(err)
		body := string(readAll(t, resp))
		if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != c.allow || !strings.HasPrefix(body, `{"error":`) {
			t.Errorf("%s %s: %d, Allow %q, %s; want 405, Allow %q, {\"error\": ...}", c.method, c.path, resp.StatusCode,
				resp.Header.Get("Allow"), body, c.allow)
		}
	}

	close(firstToken)
	waitLoad("prefill complete at the first token: 0 tokens, the blocks stay", 0, 2)
	close(finish)
	resp = <-done
	if body := string(readAll(t, resp)); !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream: %q", body)
	}
	waitLoad("freed at the end", 0, 0)

	// A text prompt adds its estimated tokens and no blocks; the client
	// going away frees it.
	firstToken, finish = make(chan struct{}), make(chan struct{})
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.front.URL+PathCompletions,
			strings.NewReader(`{"model":"m","prompt":"abcdefghijkl","stream":true}`))
		if resp, err := e.front.Client().Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body) // until the cancel
			resp.Body.Close()
		}
	}()
	waitLoad("the text request's 3 estimated tokens, no blocks", 3, 0)
	cancel()
	waitLoad("freed when the client went away", 0, 0)
}

// refusingTransport is a Transport to the workers that refuses the hosts
// named *.unreachable.invalid, as a refused connection, after calling
// onRefuse with the host, and sends the others on.
type refusingTransport struct {
	onRefuse func(host string)
	next     *http.Transport
}

func (rt *refusingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.HasSuffix(r.URL.Hostname(), ".unreachable.invalid") {
		rt.onRefuse(r.URL.Hostname())
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	return rt.next.RoundTrip(r)
}

// TestSlotsFreedOnFailure: a request is on the tracker while a worker has
// it, and off it once a worker's 5xx answer is relayed, or as soon as the
// worker cannot be reached: before the next worker is tried.
func TestSlotsFreedOnFailure(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for id := range uint64(2) {
		if err := tr.Register(slots.Worker{WorkerID: id + 1, Model: "m", BlockSize: 2, DPSize: 1}); err != nil {
			t.Fatal(err)
		}
	}
	// loads are the (one-rank) workers' prompt tokens and blocks.
	loads := func() string {
		var out []string
		for _, l := range tr.Loads("m", "") {
			out = append(out, fmt.Sprintf("worker %d: %d tokens, %d blocks", l.WorkerID, l.ActivePrefillTokens, l.ActiveDecodeBlocks))
		}
		return strings.Join(out, ", ")
	}
	// 5 tokens, 2 blocks of 2.
	const body = `{"model":"m","prompt":[1,2,3,4,5]}`
	// What the tracker holds while a worker has the request.
	holding := map[string]string{
		"1": "worker 1: 5 tokens, 2 blocks, worker 2: 0 tokens, 0 blocks",
		"2": "worker 1: 0 tokens, 0 blocks, worker 2: 5 tokens, 2 blocks",
	}
	const idle = "worker 1: 0 tokens, 0 blocks, worker 2: 0 tokens, 0 blocks"
	var mu sync.Mutex
	var seen []string // "<worker>: <loads>" at each attempt
	record := func(worker string) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, worker+": "+loads())
	}
	failing := newEngine(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		record("2")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(`{"error":{"message":"engine failure"}}`))
	})
	next := &http.Transport{}
	t.Cleanup(next.CloseIdleConnections)
	transport := &refusingTransport{next: next, onRefuse: func(host string) { record(strings.TrimPrefix(strings.Split(host, ".")[0], "w")) }}
	e := newTestEnv(t, envOptions{config: func(c *Config) { c.Slots, c.RouterID, c.Transport = tr, "rt", transport }})
	e.putRecord(t, "m", []uint64{1, 2}, nil, time.Now())

	for _, tc := range []struct {
		name      string
		endpoints map[uint64]string // registered before the request
		status    int
		attempts  []string // the workers that had the request, in any order
	}{
		// Worker 2 alone in the registry answers 500: relayed, and its
		// slot freed.
		{"5xx", map[uint64]string{2: failing.srv.URL}, http.StatusInternalServerError, []string{"2"}},
		// Neither can be reached: 502; each one held the slot only while it
		// was tried.
		{"unreachable", map[uint64]string{1: "http://w1.unreachable.invalid:8000", 2: "http://w2.unreachable.invalid:8000"},
			http.StatusBadGateway, []string{"1", "2"}},
	} {
		for id, endpoint := range tc.endpoints {
			e.putWorker(t, "m", id, endpoint)
		}
		mu.Lock()
		seen = nil
		mu.Unlock()
		resp := e.post(t, PathCompletions, body)
		if got := readAll(t, resp); resp.StatusCode != tc.status {
			t.Fatalf("%s: status %d %s, want %d", tc.name, resp.StatusCode, got, tc.status)
		}
		natstest.WaitFor(t, 5*time.Second, tc.name+": the slot freed", func() bool {
			return tr.Stats().Requests == 0 && loads() == idle
		})
		mu.Lock()
		got := slices.Clone(seen)
		mu.Unlock()
		var want []string
		for _, w := range tc.attempts {
			want = append(want, w+": "+holding[w])
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("%s: the tracker during the attempts\n%s\nwant\n%s", tc.name, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
}

// TestPickLeastPotential: with PickLeastPotential the request goes to the
// worker the tracker projects lowest, here the one not holding another
// request's prompt tokens, whatever the requests in flight say.
func TestPickLeastPotential(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for id := range uint64(2) {
		if err := tr.Register(slots.Worker{WorkerID: id + 1, Model: "m", BlockSize: 4, DPSize: 1}); err != nil {
			t.Fatal(err)
		}
	}
	// Worker 1 holds 1,000 prompt tokens of a request this router did not
	// send (another router's, say).
	if err := tr.Add(slots.Request{Model: "m", ID: "elsewhere", WorkerID: 1, NewISLTokens: 1000}); err != nil {
		t.Fatal(err)
	}
	e := newTestEnv(t, envOptions{config: func(c *Config) { c.Slots, c.PickLeastPotential = tr, true }})
	one, two := jsonEngine(t, "one"), jsonEngine(t, "two")
	e.putWorker(t, "m", 1, one.srv.URL)
	e.putWorker(t, "m", 2, two.srv.URL)
	e.putRecord(t, "m", []uint64{1, 2}, nil, time.Now())
	for range 5 {
		resp := e.post(t, PathCompletions, `{"model":"m","prompt":[1,2,3,4,5,6,7,8]}`)
		readAll(t, resp)
		if got := resp.Header.Get("X-Engine"); got != "two" {
			t.Fatalf("request went to %q, want two (worker 1 holds 1,000 prompt tokens)", got)
		}
	}
	if one.hits.Load() != 0 {
		t.Fatalf("worker 1 got %d requests", one.hits.Load())
	}
}

// FuzzParsePrompt: any body is read without a panic, and what it yields is
// consistent: a token-id prompt's tokens are its length.
func FuzzParsePrompt(f *testing.F) {
	for _, b := range []string{`{"prompt":"abcd"}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1],[2,3]]}`, `{"prompt":["a","b"]}`,
		`{"messages":[{"content":"x"},{"content":[{"type":"text","text":"yy"}]}]}`, `{"prompt":[-1]}`, `[`, `{"prompt":null}`} {
		f.Add(b, false)
		f.Add(b, true)
	}
	f.Fuzz(func(t *testing.T, body string, chat bool) {
		route := routeCompletions
		if chat {
			route = routeChatCompletions
		}
		p := parsePrompt(route, []byte(body))
		if len(p.tokens) > 0 {
			var n uint64
			for _, seq := range p.tokens {
				n += uint64(len(seq))
			}
			if n != p.isl {
				t.Fatalf("%d token ids counted as %d tokens", n, p.isl)
			}
			_ = p.hashes(16)
		}
	})
}
