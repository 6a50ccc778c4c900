package slotsapi

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/workermon/workermon/slots"
)

// TestDynamoPage drives the API with the requests of Dynamo's page, in
// order, and checks every status and body.
func TestDynamoPage(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(Handler(tr))
	t.Cleanup(srv.Close)
	const ok = `{"status":"ok"}` + "\n"
	for _, step := range []struct {
		method, path, body string
		status             int
		want               string // exact, or a substring for errors
	}{
		{"GET", "/health", "", 200, ""},
		{"POST", "/register", `{"worker_id":7,"model_name":"llama-3-8b","tenant_id":"default","block_size":16,"dp_start":0,"dp_size":2}`, 201, ok},
		{"GET", "/workers", "", 200, `[{"worker_id":7,"model_name":"llama-3-8b","tenant_id":"default","block_size":16,"dp_start":0,"dp_size":2}]` + "\n"},
		{"POST", "/add", `{"model_name":"llama-3-8b","tenant_id":"default","request_id":"req-123","worker_id":7,"dp_rank":0,"sequence_hashes":[101,-22,303],"new_isl_tokens":48}`, 201, ok},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"req-123","worker_id":7,"dp_rank":1,"sequence_hashes":[]}`, 409, `"error":`},
		{"POST", "/add", `{"model_name":"other","request_id":"x","worker_id":7,"sequence_hashes":[]}`, 404, `"error":`},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"x","worker_id":7,"dp_rank":2,"sequence_hashes":[]}`, 404, `"error":`},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"x","worker_id":7}`, 400, "sequence_hashes are required"},
		{"GET", "/loads", "", 200, `[{"model_name":"llama-3-8b","tenant_id":"default","worker_id":7,"dp_rank":0,"active_prefill_tokens":48,"active_decode_blocks":3},` +
			`{"model_name":"llama-3-8b","tenant_id":"default","worker_id":7,"dp_rank":1,"active_prefill_tokens":0,"active_decode_blocks":0}]` + "\n"},
		{"POST", "/potential_loads", `{"model_name":"llama-3-8b","tenant_id":"default","sequence_hashes":[101,-22,303,404],"new_isl_tokens":48}`, 200,
			`[{"worker_id":7,"dp_rank":0,"potential_prefill_tokens":96,"potential_decode_blocks":4},{"worker_id":7,"dp_rank":1,"potential_prefill_tokens":48,"potential_decode_blocks":4}]` + "\n"},
		{"POST", "/prefill_complete", `{"model_name":"llama-3-8b","tenant_id":"default","request_id":"req-123"}`, 200, ok},
		{"POST", "/prefill_complete", `{"model_name":"llama-3-8b","tenant_id":"default","request_id":"req-123"}`, 200, ok},
		{"POST", "/prefill_complete", `{"model_name":"llama-3-8b","request_id":"nope"}`, 404, `"error":`},
		{"POST", "/free", `{"model_name":"llama-3-8b","tenant_id":"default","request_id":"req-123"}`, 200, ok},
		{"POST", "/free", `{"model_name":"llama-3-8b","request_id":"req-123"}`, 200, ok},
		{"POST", "/free", `{"model_name":"nope","request_id":"req-123"}`, 404, `"error":`},
		{"GET", "/loads?model_name=llama-3-8b&tenant_id=default", "", 200, `"active_prefill_tokens":0,"active_decode_blocks":0}`},
		{"POST", "/unregister", `{"worker_id":7,"model_name":"llama-3-8b","tenant_id":"default"}`, 200, ok},
		{"POST", "/unregister", `{"worker_id":7,"model_name":"llama-3-8b","tenant_id":"default"}`, 404, `"error":`},
		{"GET", "/workers", "", 200, "[]\n"},
		// Hostile and malformed input.
		{"POST", "/register", `{"worker_id":7,"model_name":"m","block_size":0,"dp_size":1}`, 400, "block_size"},
		{"POST", "/register", `{"worker_id":7,"model_name":"m","block_size":16,"dp_size":-1}`, 400, "invalid JSON"},
		{"POST", "/register", `{"worker_id":7,"model_name":"m","block_size":16,"dp_start":4294967295,"dp_size":2}`, 400, "overflows"},
		{"POST", "/register", `{"worker_id":7,"model_name":"m","block_size":16,"dp_size":1,"unknown":true}`, 201, ok},
		{"POST", "/add", `{"model_name":"m","request_id":"h","worker_id":7,"sequence_hashes":[18446744073709551615]}`, 400, "invalid JSON"},
		{"POST", "/add", `{"model_name":"m","request_id":"h","worker_id":7,"sequence_hashes":"nope"}`, 400, "invalid JSON"},
		{"POST", "/add", `{"model_name":`, 400, "invalid JSON"},
		{"POST", "/add", `[]`, 400, "invalid JSON"},
		{"POST", "/add", `{"model_name":"m","request_id":"big","worker_id":7,"sequence_hashes":[` + strings.Repeat("1,", MaxBody/2) + `1]}`, 413, "larger than"},
		// Where the page is silent: more hashes than one request may carry
		// (a body well under 1 MiB) is 413; a block size other than the
		// tracker's is 409; a projection on an unknown tracker is 404.
		{"POST", "/add", `{"model_name":"m","request_id":"many","worker_id":7,"sequence_hashes":[` +
			strings.Repeat("1,", slots.DefaultMaxHashesPerRequest) + `1]}`, 413, "sequence_hashes, more than the 32768 of one request"},
		{"POST", "/potential_loads", `{"model_name":"m","sequence_hashes":[` +
			strings.Repeat("1,", slots.DefaultMaxHashesPerRequest) + `1]}`, 413, "more than the 32768"},
		{"POST", "/add", `{"model_name":"m","request_id":"max","worker_id":7,"sequence_hashes":[` +
			strings.Repeat("1,", slots.DefaultMaxHashesPerRequest-1) + `1]}`, 201, ok},
		{"POST", "/register", `{"worker_id":8,"model_name":"m","block_size":32,"dp_size":1}`, 409, "block_size 32 differs from 16"},
		{"POST", "/add", `{"model_name":"m","request_id":"` + strings.Repeat("r", 257) + `","worker_id":7,"sequence_hashes":[]}`, 400, "more than 256"},
		{"POST", "/register", `{"worker_id":8,"model_name":"` + strings.Repeat("m", 257) + `","block_size":16,"dp_size":1}`, 400, "longer than 256"},
		{"POST", "/potential_loads", `{"model_name":"nope","sequence_hashes":[1]}`, 404, "no tracker"},
		{"GET", "/add", "", 405, "not allowed"},
		{"POST", "/nowhere", "{}", 404, "no route"},
	} {
		req, err := http.NewRequestWithContext(t.Context(), step.method, srv.URL+step.path, strings.NewReader(step.body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got := string(body)
		match := got == step.want
		if step.status >= 400 || strings.HasPrefix(step.path, "/loads?") {
			match = strings.Contains(got, step.want)
		}
		if resp.StatusCode != step.status || !match {
			t.Errorf("%s %s %.80s: %d %s\nwant %d %s", step.method, step.path, step.body, resp.StatusCode, got, step.status, step.want)
		}
		if step.status >= 400 && !strings.HasPrefix(got, `{"error":`) {
			t.Errorf("%s %s: error body %s is not {\"error\": ...}", step.method, step.path, got)
		}
	}
}

// TestPotentialsEncoding: the hand-written encoding of /potential_loads is
// byte for byte what encoding/json writes, empty and extreme values
// included.
func TestPotentialsEncoding(t *testing.T) {
	t.Parallel()
	for _, ps := range [][]slots.Potential{
		{},
		{{WorkerID: 7, DPRank: 0, PotentialPrefillTokens: 96, PotentialDecodeBlocks: 4}},
		{{WorkerID: math.MaxUint64, DPRank: math.MaxUint32, PotentialPrefillTokens: math.MaxUint64, PotentialDecodeBlocks: 0},
			{WorkerID: 1, DPRank: 2, PotentialPrefillTokens: 3, PotentialDecodeBlocks: 4}},
	} {
		var want bytes.Buffer
		if err := json.NewEncoder(&want).Encode(ps); err != nil {
			t.Fatal(err)
		}
		if got := appendPotentials(nil, ps); !bytes.Equal(got, want.Bytes()) {
			t.Errorf("got  %s\nwant %s", got, want.Bytes())
		}
	}
}

// TestMethodNotAllowed: a wrong method on every path of the API is 405
// with Allow and the error body; NotAllowed answers alike for a path a
// server mounts beside the API.
func TestMethodNotAllowed(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", http.NotFoundHandler())
	mux.Handle("/metrics", NotAllowed("GET, HEAD"))
	mux.Handle("/", Handler(tr))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	for _, tc := range []struct{ method, path, allow string }{
		{"POST", "/health", "GET, HEAD"},
		{"GET", "/register", "POST"},
		{"DELETE", "/unregister", "POST"},
		{"POST", "/workers", "GET, HEAD"},
		{"GET", "/add", "POST"},
		{"PUT", "/prefill_complete", "POST"},
		{"GET", "/free", "POST"},
		{"POST", "/loads", "GET, HEAD"},
		{"GET", "/potential_loads", "POST"},
		{"POST", "/metrics", "GET, HEAD"},
	} {
		req, err := http.NewRequestWithContext(t.Context(), tc.method, srv.URL+tc.path, strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var e struct {
			Error string `json:"error"`
		}
		if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != tc.allow ||
			json.Unmarshal(body, &e) != nil || !strings.Contains(e.Error, "not allowed on "+tc.path) {
			t.Errorf("%s %s: %d, Allow %q, %s; want 405, Allow %q, {\"error\": ...}", tc.method, tc.path,
				resp.StatusCode, resp.Header.Get("Allow"), body, tc.allow)
		}
	}
}

// TestCapsAnswer429: a write beyond a cap on what the tracker holds is 429
// with the error body and changes nothing.
func TestCapsAnswer429(t *testing.T) {
	t.Parallel()
	cfg := slots.DefaultConfig()
	cfg.MaxBlocks, cfg.MaxWorkers = 2, 1
	tr, err := slots.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(Handler(tr))
	t.Cleanup(srv.Close)
	post := func(path, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+path, strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b)
	}
	for _, step := range []struct {
		path, body string
		status     int
		want       string
	}{
		{"/register", `{"worker_id":1,"model_name":"m","block_size":16,"dp_size":1}`, 201, `{"status":"ok"}`},
		{"/register", `{"worker_id":2,"model_name":"m","block_size":16,"dp_size":1}`, 429, `{"error":"1 workers: limit reached"}`},
		{"/add", `{"model_name":"m","request_id":"a","worker_id":1,"sequence_hashes":[1,2]}`, 201, `{"status":"ok"}`},
		{"/add", `{"model_name":"m","request_id":"b","worker_id":1,"sequence_hashes":[1]}`, 429, `{"error":"2 block hashes held, 1 more would pass the cap of 2: limit reached"}`},
	} {
		if status, body := post(step.path, step.body); status != step.status || strings.TrimSpace(body) != step.want {
			t.Errorf("POST %s %s: %d %s, want %d %s", step.path, step.body, status, body, step.status, step.want)
		}
	}
	if s := tr.Stats(); s.Workers != 1 || s.Requests != 1 || s.Rejected[slots.RejectedWorkers] != 1 || s.Rejected[slots.RejectedBlocks] != 1 {
		t.Errorf("stats %+v", s)
	}
}
