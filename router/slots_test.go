package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/slots"
)

func TestParsePrompt(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, route, body  string
		isl                uint64
		tokenSeqs          int
		seqs               []uint64
		maxTokens, choices uint64
	}{
		{"text", routeCompletions, `{"model":"m","prompt":"abcdefgh"}`, 2, 0, []uint64{2}, 0, 1},
		{"texts", routeCompletions, `{"model":"m","prompt":["abcd","abcde"],"max_tokens":7}`, 3, 0, []uint64{1, 2}, 7, 1},
		{"token ids", routeCompletions, `{"model":"m","prompt":[1,2,3,4,5],"max_tokens":0}`, 5, 1, []uint64{5}, 0, 1},
		{"token id batches", routeCompletions, `{"model":"m","prompt":[[1,2],[3,4,5]],"n":3}`, 5, 2, []uint64{2, 3}, 0, 3},
		{"negative token", routeCompletions, `{"model":"m","prompt":[1,-2],"max_tokens":9}`, 0, 0, []uint64{0}, 9, 1},
		{"no prompt", routeCompletions, `{"model":"m"}`, 0, 0, nil, 0, 1},
		{"bounds that are no count", routeCompletions, `{"model":"m","prompt":"abcd","max_tokens":-1,"n":2.5}`, 1, 0, []uint64{1}, 0, 1},
		{"n 0, n huge", routeCompletions, `{"model":"m","prompt":"abcd","n":0}`, 1, 0, []uint64{1}, 0, 1},
		{"n capped", routeCompletions, `{"model":"m","prompt":"abcd","n":100000}`, 1, 0, []uint64{1}, 0, maxChoices},
		{"chat", routeChatCompletions, `{"model":"m","messages":[{"role":"user","content":"abcd"},{"role":"user","content":[{"type":"text","text":"abcdefgh"}]}],"max_tokens":5}`, 3, 0, []uint64{3}, 5, 1},
		{"chat: max_completion_tokens wins over max_tokens", routeChatCompletions, `{"model":"m","messages":[{"content":"abcd"}],"max_tokens":50,"max_completion_tokens":6,"n":2}`, 1, 0, []uint64{1}, 6, 2},
		{"chat not an array", routeChatCompletions, `{"model":"m","messages":3,"max_tokens":4}`, 0, 0, nil, 4, 1},
		{"completions with odd messages", routeCompletions, `{"model":"m","prompt":[1,2],"messages":3}`, 2, 1, []uint64{2}, 0, 1},
		{"not JSON", routeCompletions, `{"model":`, 0, 0, nil, 0, 1},
	} {
		p := parsePrompt(tt.route, []byte(tt.body))
		if p.isl != tt.isl || len(p.tokens) != tt.tokenSeqs || !slices.Equal(p.seqs, tt.seqs) || p.maxTokens != tt.maxTokens || p.choices != tt.choices {
			t.Errorf("%s: isl %d, %d token sequences, seqs %v, max %d, n %d; want %d, %d, %v, %d, %d", tt.name, p.isl, len(p.tokens),
				p.seqs, p.maxTokens, p.choices, tt.isl, tt.tokenSeqs, tt.seqs, tt.maxTokens, tt.choices)
		}
	}
}

func TestCommittedBlocks(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name      string
		p         promptLoad
		blockSize uint32
		want      uint64
		ok        bool
	}{
		{"block size unknown", promptLoad{seqs: []uint64{100}, maxTokens: 10, choices: 1}, 0, 0, false},
		{"ceil((prompt + output) / block size)", promptLoad{seqs: []uint64{100}, maxTokens: 10, choices: 1}, 16, 7, true},
		{"exact blocks", promptLoad{seqs: []uint64{6}, maxTokens: 10, choices: 1}, 16, 1, true},
		{"per sequence", promptLoad{seqs: []uint64{1, 1, 1}, maxTokens: 1, choices: 1}, 16, 3, true},
		{"n outputs share the prompt", promptLoad{seqs: []uint64{10}, maxTokens: 8, choices: 3}, 16, 3, true},
		{"no output bound: the prompt alone", promptLoad{seqs: []uint64{33}, choices: 1}, 16, 3, true},
		{"no prompt read: the output alone", promptLoad{maxTokens: 17, choices: 1}, 16, 2, true},
		{"nothing at all", promptLoad{}, 16, 0, true},
		{"saturated", promptLoad{seqs: []uint64{math.MaxUint64, 5}, maxTokens: math.MaxUint64, choices: 128}, 1, math.MaxUint64, true},
	} {
		got, ok := tt.p.committedBlocks(tt.blockSize)
		if got != tt.want || ok != tt.ok {
			t.Errorf("%s: %d, %v; want %d, %v", tt.name, got, ok, tt.want, tt.ok)
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

// putEntry writes a worker's registry entry as given and waits until the
// router sees it.
func putEntry(t *testing.T, e *testEnv, w events.WorkerEntry) {
	t.Helper()
	w.BootID, w.RegisteredAt = 7, time.Now().UnixNano()
	data, err := json.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.workers.Put(t.Context(), events.RegistryKey(w.Model, w.WorkerID), data); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 5*time.Second, "worker seen by the router", func() bool {
		got, ok := e.registry.Lookup(w.Model, w.WorkerID)
		return ok && got.Endpoint == w.Endpoint && got.BlockSize == w.BlockSize
	})
}

// TestSlotsCommittedBlocks: a request sent to a worker adds the blocks it
// would hold at its expected length (contract §21) in the block size of
// the worker's registry entry, text prompts included, until it ends; a
// worker whose entry names no block size gets none (Committed false).
func TestSlotsCommittedBlocks(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for id := uint64(1); id <= 2; id++ {
		if err := tr.Register(slots.Worker{WorkerID: id, Model: "m", BlockSize: 4, DPSize: 1}); err != nil {
			t.Fatal(err)
		}
	}
	e := newTestEnv(t, envOptions{config: func(c *Config) { c.Slots, c.RouterID = tr, "rt" }})
	release := make(chan struct{})
	eng := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"stop"}]}`))
	})
	putEntry(t, e, events.WorkerEntry{Model: "m", WorkerID: 1, Endpoint: eng.srv.URL, DPSize: 1, BlockSize: 4})
	e.putRecord(t, "m", []uint64{1}, nil, time.Now())

	worker := func(id uint64) slots.Load {
		for _, l := range tr.Loads("m", "") {
			if l.WorkerID == id {
				return l
			}
		}
		t.Fatalf("worker %d not in the tracker", id)
		return slots.Load{}
	}
	waitCommitted := func(what string, id, blocks uint64, committed bool) {
		t.Helper()
		natstest.WaitFor(t, 5*time.Second, what, func() bool {
			l := worker(id)
			return l.KVCommittedBlocks == blocks && l.Committed == committed
		})
	}
	var wg sync.WaitGroup
	send := func(path, body string) {
		wg.Go(func() {
			resp := e.post(t, path, body)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}

	// 5 token ids + 10 output tokens in blocks of 4: ceil(15 / 4) = 4.
	send(PathCompletions, `{"model":"m","prompt":[1,2,3,4,5],"max_tokens":10}`)
	waitCommitted("the token-id request's 4 committed blocks", 1, 4, true)
	// A chat request of 12 characters (3 tokens) with n 2 and
	// max_completion_tokens 6 (its max_tokens ignored): ceil((3 + 12) / 4) = 4.
	send(PathChatCompletions, `{"model":"m","messages":[{"role":"user","content":"abcdefghijkl"}],"n":2,"max_tokens":99,"max_completion_tokens":6}`)
	waitCommitted("and the chat request's 4", 1, 8, true)
	close(release)
	wg.Wait()
	waitCommitted("freed at their end", 1, 0, false)

	// Worker 2's entry names no block size: its requests add their prefill
	// tokens, never committed blocks.
	release2 := make(chan struct{})
	eng2 := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		select {
		case <-release2:
		case <-r.Context().Done():
		}
	})
	putEntry(t, e, events.WorkerEntry{Model: "m", WorkerID: 2, Endpoint: eng2.srv.URL, DPSize: 1})
	e.putRecord(t, "m", []uint64{2}, []uint64{1}, time.Now())
	send(PathCompletions, `{"model":"m","prompt":[1,2,3,4,5],"max_tokens":10}`)
	natstest.WaitFor(t, 5*time.Second, "worker 2's request tracked", func() bool { return worker(2).ActivePrefillTokens == 5 })
	if l := worker(2); l.Committed || l.KVCommittedBlocks != 0 {
		t.Errorf("worker 2 without a block size: %+v, want no committed blocks", l)
	}
	close(release2)
	wg.Wait()
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
		`{"messages":[{"content":"x"},{"content":[{"type":"text","text":"yy"}]}]}`, `{"prompt":[-1]}`, `[`, `{"prompt":null}`,
		`{"prompt":"abcd","max_tokens":18446744073709551615,"n":128}`, `{"messages":[],"max_completion_tokens":3,"n":"2"}`} {
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
		// Committed blocks hold at least every sequence's prompt, and
		// more blocks per sequence never fewer committed.
		blocks, ok := p.committedBlocks(16)
		if !ok {
			t.Fatal("committed blocks unknown with a block size")
		}
		var least uint64
		for _, seq := range p.seqs {
			least += (seq + 15) / 16
		}
		if blocks < least || p.choices < 1 || p.choices > maxChoices {
			t.Fatalf("%d committed blocks for sequences %v (at least %d), n %d", blocks, p.seqs, least, p.choices)
		}
	})
}
