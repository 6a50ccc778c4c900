package slotsapi

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/slots"
)

// writesRecorder records a handler's answer and the size of its largest
// Write; after block writes, each Write waits for release.
type writesRecorder struct {
	*httptest.ResponseRecorder
	largest, writes int
	block           int
	blocked         chan struct{} // closed at the first blocked Write
	release         chan struct{}
}

func (w *writesRecorder) Write(p []byte) (int, error) {
	w.writes++
	if w.block > 0 && w.writes > w.block {
		if w.writes == w.block+1 {
			close(w.blocked)
		}
		<-w.release
	}
	w.largest = max(w.largest, len(p))
	return w.ResponseRecorder.Write(p)
}

// TestListsStreamed: GET /loads and GET /workers write encoding/json's
// bytes a bounded piece at a time, without holding the tracker while they
// write (issue 23 item 17: the whole answer, 40 MB of /loads at the caps,
// was encoded in memory for each client, and 30 clients that did not read
// took 1.8 GB).
func TestListsStreamed(t *testing.T) {
	t.Parallel()
	cfg := slots.DefaultConfig()
	tr, err := slots.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("m", slots.MaxNameLen-8)
	names := []string{long + "<&>\u2028", long + "\xff\"\\", "b"}
	for i, name := range names {
		for w := range uint64(4) {
			if err := tr.Register(slots.Worker{WorkerID: w, Model: name, Tenant: names[(i+1)%3], BlockSize: 16,
				DPStart: uint32(w) * 1024, DPSize: slots.MaxRanks}); err != nil {
				t.Fatal(err)
			}
		}
		for w := range uint64(1000) {
			if err := tr.Register(slots.Worker{WorkerID: 1000 + w, Model: name, Tenant: names[(i+1)%3], BlockSize: 16,
				DPStart: uint32(w), DPSize: 1}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tr.Add(slots.Request{Model: "b", Tenant: names[0], ID: "r", WorkerID: 3, DPRank: 3500, Hashes: []uint64{1}, NewISLTokens: 9}); err != nil {
		t.Fatal(err)
	}
	h := Handler(tr)
	get := func(path string, rec *writesRecorder) {
		t.Helper()
		h.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, path, nil))
	}
	for _, q := range []struct{ query, model, tenant string }{
		{"", "", ""}, {"?model_name=b", "b", ""}, {"?tenant_id=b", "", "b"}, {"?model_name=none", "none", ""},
	} {
		for path, list := range map[string]any{"/loads": tr.Loads(q.model, q.tenant), "/workers": tr.Workers(q.model, q.tenant)} {
			rec := &writesRecorder{ResponseRecorder: httptest.NewRecorder()}
			get(path+q.query, rec)
			var want bytes.Buffer
			if err := json.NewEncoder(&want).Encode(list); err != nil {
				t.Fatal(err)
			}
			if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "application/json" || !bytes.Equal(rec.Body.Bytes(), want.Bytes()) {
				t.Errorf("GET %s%s: %d %q, %d bytes, not encoding/json's %d", path, q.query, rec.Code, rec.Header().Get("Content-Type"),
					rec.Body.Len(), want.Len())
			}
			// 15,288 ranks of long names are about 7 MB, 3,012 workers 1.3 MB:
			// written in pieces of about listFlush bytes.
			if rec.largest > listFlush+1024 {
				t.Errorf("GET %s%s: a write of %d bytes, more than %d: the answer is not streamed", path, q.query, rec.largest, listFlush+1024)
			}
		}
	}
	// A reader that stops reading does not hold the tracker.
	rec := &writesRecorder{ResponseRecorder: httptest.NewRecorder(), block: 2, blocked: make(chan struct{}), release: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		get("/loads", rec)
	}()
	select {
	case <-rec.blocked:
	case <-done:
		t.Fatalf("GET /loads answered in %d writes, not streamed", rec.writes)
	}
	registered := make(chan error, 1)
	go func() {
		registered <- tr.Register(slots.Worker{WorkerID: 99, Model: "b", Tenant: names[0], BlockSize: 16, DPSize: 1})
	}()
	select {
	case err := <-registered:
		if err != nil {
			t.Error(err)
		}
	case <-time.After(10 * time.Second):
		t.Error("a registration waited for a blocked GET /loads")
	}
	close(rec.release)
	<-done
}
