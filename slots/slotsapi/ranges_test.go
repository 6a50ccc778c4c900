package slotsapi

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/slots"
)

// TestRegisterRangeEndingAt2To32: POST /register of a range that ends
// exactly at 2^32 answers 201 and its rank 4294967295 is loaded, added to
// and unregistered; a range past 2^32 answers 400 (contract §3, issue 23
// item 16: the walk of its ranks wrapped and never answered).
func TestRegisterRangeEndingAt2To32(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(Handler(tr))
	// A request that never answers fails here, not at the test's timeout;
	// then its handler still runs and Close would wait for it.
	t.Cleanup(func() {
		if !t.Failed() {
			srv.Close()
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	const ok = `{"status":"ok"}`
	for _, step := range []struct {
		method, path, body string
		status             int
		want               string // a substring of the answer
	}{
		{"POST", "/register", `{"worker_id":8,"model_name":"m1","block_size":16,"dp_start":4294967295,"dp_size":1}`, 201, ok},
		{"POST", "/add", `{"model_name":"m1","request_id":"a","worker_id":8,"dp_rank":4294967295,"sequence_hashes":[1],"new_isl_tokens":5}`, 201, ok},
		{"GET", "/loads", "", 200, `"worker_id":8,"dp_rank":4294967295,"active_prefill_tokens":5,"active_decode_blocks":1}]`},
		{"POST", "/potential_loads", `{"model_name":"m1","sequence_hashes":[1,2]}`, 200, `"dp_rank":4294967295,"potential_prefill_tokens":5,"potential_decode_blocks":2}]`},
		{"POST", "/register", `{"worker_id":8,"model_name":"m1","block_size":16,"dp_start":4294967294,"dp_size":2}`, 201, ok},
		{"POST", "/register", `{"worker_id":9,"model_name":"m1","block_size":16,"dp_start":4294967295,"dp_size":2}`, 400, "overflows"},
		{"POST", "/register", `{"worker_id":9,"model_name":"m1","block_size":16,"dp_start":4294967200,"dp_size":1000}`, 400, "overflows"},
		{"POST", "/unregister", `{"worker_id":8,"model_name":"m1"}`, 200, ok},
		{"GET", "/loads", "", 200, "[]"},
	} {
		req, err := http.NewRequestWithContext(ctx, step.method, srv.URL+step.path, strings.NewReader(step.body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s %s: %v", step.method, step.path, step.body, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != step.status || !strings.Contains(string(b), step.want) {
			t.Errorf("%s %s %s: %d %s, want %d with %s", step.method, step.path, step.body, resp.StatusCode, b, step.status, step.want)
		}
	}
	if s := tr.Stats(); s.Workers != 0 || s.Ranks != 0 || s.Requests != 0 {
		t.Errorf("left %+v", s)
	}
}

// TestAddSaturates: /add with new_isl_tokens 2^64-1 then 2 leaves
// active_prefill_tokens at 2^64-1 (it wrapped to 1; issue 23 item 23).
func TestAddSaturates(t *testing.T) {
	t.Parallel()
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(Handler(tr))
	t.Cleanup(srv.Close)
	for _, step := range []struct {
		method, path, body string
		status             int
		want               string
	}{
		{"POST", "/register", `{"worker_id":1,"model_name":"m","block_size":16,"dp_size":1}`, 201, `{"status":"ok"}`},
		{"POST", "/add", `{"model_name":"m","request_id":"a","worker_id":1,"sequence_hashes":[],"new_isl_tokens":18446744073709551615}`, 201, `{"status":"ok"}`},
		{"POST", "/add", `{"model_name":"m","request_id":"b","worker_id":1,"sequence_hashes":[],"new_isl_tokens":2}`, 201, `{"status":"ok"}`},
		{"GET", "/loads", "", 200, `"active_prefill_tokens":18446744073709551615,`},
		{"POST", "/potential_loads", `{"model_name":"m","new_isl_tokens":7}`, 200, `"potential_prefill_tokens":18446744073709551615,`},
	} {
		req, _ := http.NewRequestWithContext(t.Context(), step.method, srv.URL+step.path, strings.NewReader(step.body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != step.status || !strings.Contains(string(b), step.want) {
			t.Errorf("%s %s %s: %d %s, want %d with %s", step.method, step.path, step.body, resp.StatusCode, b, step.status, step.want)
		}
	}
}
