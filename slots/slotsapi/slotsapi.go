// Package slotsapi serves a slots.Tracker over HTTP with the API of Dynamo's
// standalone slot tracker (contract §11): the same paths, bodies and
// statuses. Writes answer {"status":"ok"}, errors {"error":"..."}; where the
// page is silent, malformed JSON or a wrong type is 400, a body over 1 MiB
// or more sequence_hashes than the tracker takes in one request 413, an
// unknown tracker 404 (on /potential_loads too), a block size other than
// the tracker's 409, an unknown path 404, a wrong method 405 with Allow, a
// cap on what the tracker holds 429, and unknown fields are ignored.
// GET /loads and GET /workers are streamed a page of rows at a time, so
// that a client that reads slowly holds a page, not the whole answer.
//
// Users: workermon slots, and workermon router for /loads and
// /potential_loads.
package slotsapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"strconv"
	"sync"

	"github.com/workermon/workermon/slots"
)

// MaxBody is the largest request body accepted.
const MaxBody = 1 << 20

// Handler returns the API over tr.
func Handler(tr *slots.Tracker) http.Handler {
	h := &handler{tr: tr}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("POST /register", h.register)
	mux.HandleFunc("POST /unregister", h.unregister)
	mux.HandleFunc("GET /workers", h.workers)
	mux.HandleFunc("POST /add", h.add)
	mux.HandleFunc("POST /prefill_complete", byRequest(tr.PrefillComplete))
	mux.HandleFunc("POST /free", byRequest(tr.Free))
	mux.HandleFunc("GET /loads", h.loads)
	mux.HandleFunc("POST /potential_loads", h.potentialLoads)
	for path, allow := range map[string]string{"/health": "GET, HEAD", "/register": "POST", "/unregister": "POST",
		"/workers": "GET, HEAD", "/add": "POST", "/prefill_complete": "POST", "/free": "POST", "/loads": "GET, HEAD",
		"/potential_loads": "POST"} {
		mux.Handle(path, NotAllowed(allow))
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no route for "+r.URL.Path)
	})
	return mux
}

// NotAllowed answers every request 405 with the header Allow: allow and
// the API's error body. A server that mounts a path of its own beside the
// API (workermon slots' GET /metrics) answers the path's other methods
// with it, as the API answers its own.
func NotAllowed(allow string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		writeError(w, http.StatusMethodNotAllowed, fmt.Sprintf("method %s not allowed on %s: use %s", r.Method, r.URL.Path, allow))
	})
}

type handler struct{ tr *slots.Tracker }

// decode reads a JSON object into v; false when it answered an error.
func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBody))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body larger than %d bytes", MaxBody))
		} else {
			writeError(w, http.StatusBadRequest, "reading the body: "+err.Error())
		}
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		writeError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return false
	}
	return true
}

// answer writes a write's success, or err with its status.
func answer(w http.ResponseWriter, status int, err error) {
	if err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	writeJSON(w, status, map[string]string{"status": "ok"})
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, slots.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, slots.ErrConflict):
		return http.StatusConflict
	case errors.Is(err, slots.ErrLimit):
		return http.StatusTooManyRequests
	case errors.Is(err, slots.ErrTooLarge):
		return http.StatusRequestEntityTooLarge
	}
	return http.StatusBadRequest
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]string{"error": msg})
}

type registerBody struct {
	WorkerID  *uint64 `json:"worker_id"`
	Model     *string `json:"model_name"`
	Tenant    string  `json:"tenant_id"`
	BlockSize *uint32 `json:"block_size"`
	DPStart   uint32  `json:"dp_start"`
	DPSize    *uint32 `json:"dp_size"`
}

func (h *handler) register(w http.ResponseWriter, r *http.Request) {
	var b registerBody
	if !decode(w, r, &b) {
		return
	}
	if b.WorkerID == nil || b.Model == nil || b.BlockSize == nil || b.DPSize == nil {
		writeError(w, http.StatusBadRequest, "worker_id, model_name, block_size and dp_size are required")
		return
	}
	answer(w, http.StatusCreated, h.tr.Register(slots.Worker{WorkerID: *b.WorkerID, Model: *b.Model, Tenant: b.Tenant,
		BlockSize: *b.BlockSize, DPStart: b.DPStart, DPSize: *b.DPSize}))
}

type unregisterBody struct {
	WorkerID *uint64 `json:"worker_id"`
	Model    string  `json:"model_name"`
	Tenant   string  `json:"tenant_id"`
}

func (h *handler) unregister(w http.ResponseWriter, r *http.Request) {
	var b unregisterBody
	if !decode(w, r, &b) {
		return
	}
	if b.WorkerID == nil || b.Model == "" {
		writeError(w, http.StatusBadRequest, "worker_id and model_name are required")
		return
	}
	answer(w, http.StatusOK, h.tr.Unregister(b.Model, b.Tenant, *b.WorkerID))
}

// workers answers GET /workers streamed, as loads does /loads.
func (h *handler) workers(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var enc names
	stream(w, r, h.tr.WorkerPages(q.Get("model_name"), q.Get("tenant_id"), listPage), func(buf []byte, wk slots.Worker) []byte {
		buf = append(buf, `{"worker_id":`...)
		buf = strconv.AppendUint(buf, wk.WorkerID, 10)
		buf = enc.append(buf, `,"model_name":`, wk.Model, `,"tenant_id":`, wk.Tenant, `,"block_size":`)
		buf = strconv.AppendUint(buf, uint64(wk.BlockSize), 10)
		buf = append(buf, `,"dp_start":`...)
		buf = strconv.AppendUint(buf, uint64(wk.DPStart), 10)
		buf = append(buf, `,"dp_size":`...)
		buf = strconv.AppendUint(buf, uint64(wk.DPSize), 10)
		return append(buf, '}')
	})
}

type addBody struct {
	Model        string   `json:"model_name"`
	Tenant       string   `json:"tenant_id"`
	RequestID    string   `json:"request_id"`
	WorkerID     *uint64  `json:"worker_id"`
	DPRank       uint32   `json:"dp_rank"`
	Hashes       *[]int64 `json:"sequence_hashes"`
	NewISLTokens uint64   `json:"new_isl_tokens"`
}

func unsigned(hashes []int64) []uint64 {
	out := make([]uint64, len(hashes))
	for i, h := range hashes {
		out[i] = slots.HashFromSigned(h)
	}
	return out
}

func (h *handler) add(w http.ResponseWriter, r *http.Request) {
	var b addBody
	if !decode(w, r, &b) {
		return
	}
	if b.Model == "" || b.RequestID == "" || b.WorkerID == nil || b.Hashes == nil {
		writeError(w, http.StatusBadRequest, "model_name, request_id, worker_id and sequence_hashes are required (sequence_hashes may be empty)")
		return
	}
	answer(w, http.StatusCreated, h.tr.Add(slots.Request{Model: b.Model, Tenant: b.Tenant, ID: b.RequestID,
		WorkerID: *b.WorkerID, DPRank: b.DPRank, Hashes: unsigned(*b.Hashes), NewISLTokens: b.NewISLTokens}))
}

type requestBody struct {
	Model     string `json:"model_name"`
	Tenant    string `json:"tenant_id"`
	RequestID string `json:"request_id"`
}

// byRequest answers POST /prefill_complete and POST /free: op is applied
// to the request the body names.
func byRequest(op func(model, tenant, id string) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var b requestBody
		if !decode(w, r, &b) {
			return
		}
		if b.Model == "" || b.RequestID == "" {
			writeError(w, http.StatusBadRequest, "model_name and request_id are required")
			return
		}
		answer(w, http.StatusOK, op(b.Model, b.Tenant, b.RequestID))
	}
}

// Bounds of a streamed answer (GET /loads, GET /workers).
const (
	// listPage is how many rows are copied from the tracker at a time.
	listPage = 256
	// listFlush is how many bytes are encoded before they are written.
	listFlush = 32 << 10
)

// loads answers GET /loads streamed (see stream).
func (h *handler) loads(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var enc names
	stream(w, r, h.tr.LoadPages(q.Get("model_name"), q.Get("tenant_id"), listPage), func(buf []byte, l slots.Load) []byte {
		buf = enc.append(buf, `{"model_name":`, l.Model, `,"tenant_id":`, l.Tenant, `,"worker_id":`)
		buf = strconv.AppendUint(buf, l.WorkerID, 10)
		buf = append(buf, `,"dp_rank":`...)
		buf = strconv.AppendUint(buf, uint64(l.DPRank), 10)
		buf = append(buf, `,"active_prefill_tokens":`...)
		buf = strconv.AppendUint(buf, l.ActivePrefillTokens, 10)
		buf = append(buf, `,"active_decode_blocks":`...)
		buf = strconv.AppendUint(buf, l.ActiveDecodeBlocks, 10)
		return append(buf, '}')
	})
}

// stream answers 200 with the JSON array of the rows of pages, each
// appended by row, as encoding/json's Encoder writes it
// (TestListsStreamed). A page at a time is copied from the tracker (its
// lock held for the copy only), encoded and written about listFlush bytes
// at a time, so that a client that reads slowly holds about that and a
// page, never the whole answer (40 MB of /loads at the caps). A listing
// that changes while it is written may miss a row that came or list one
// that went.
func stream[T any](w http.ResponseWriter, r *http.Request, pages iter.Seq[[]T], row func([]byte, T) []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	bp := buffers.Get().(*[]byte)
	buf := append((*bp)[:0], '[')
	first := true
	for page := range pages {
		for _, v := range page {
			if !first {
				buf = append(buf, ',')
			}
			first = false
			buf = row(buf, v)
			if len(buf) >= listFlush {
				if _, err := w.Write(buf); err != nil {
					return
				}
				buf = buf[:0]
			}
		}
	}
	buf = append(buf, ']', '\n')
	_, _ = w.Write(buf)
	if cap(buf) <= maxPooledBuffer {
		*bp = buf
		buffers.Put(bp)
	}
}

// names appends a row's two names as encoding/json encodes them, between
// the literal keys before, mid and after; their encoding is kept while
// they repeat (the rows of one model and tenant).
type names struct {
	a, b    string
	encoded []byte // before, a, mid, b and after, encoded
	ok      bool
}

func (n *names) append(buf []byte, before, a, mid, b, after string) []byte {
	if !n.ok || a != n.a || b != n.b {
		ja, _ := json.Marshal(a)
		jb, _ := json.Marshal(b)
		n.encoded = append(append(append(append(append(n.encoded[:0], before...), ja...), mid...), jb...), after...)
		n.a, n.b, n.ok = a, b, true
	}
	return append(buf, n.encoded...)
}

type potentialBody struct {
	Model        string  `json:"model_name"`
	Tenant       string  `json:"tenant_id"`
	Hashes       []int64 `json:"sequence_hashes"`
	NewISLTokens uint64  `json:"new_isl_tokens"`
}

func (h *handler) potentialLoads(w http.ResponseWriter, r *http.Request) {
	var b potentialBody
	if !decode(w, r, &b) {
		return
	}
	if b.Model == "" {
		writeError(w, http.StatusBadRequest, "model_name is required")
		return
	}
	out, err := h.tr.PotentialLoads(b.Model, b.Tenant, unsigned(b.Hashes), b.NewISLTokens)
	if err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	// The hot path of a router asking before every request: the rows are
	// appended by hand into a pooled buffer, the same bytes encoding/json
	// writes (TestPotentialsEncoding), at a tenth of its time.
	bp := buffers.Get().(*[]byte)
	buf := appendPotentials((*bp)[:0], out)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(buf)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(buf)
	if cap(buf) <= maxPooledBuffer {
		*bp = buf
		buffers.Put(bp)
	}
}

// maxPooledBuffer is the largest response buffer kept for reuse.
const maxPooledBuffer = 1 << 20

var buffers = sync.Pool{New: func() any { b := make([]byte, 0, 64<<10); return &b }}

// appendPotentials appends ps as encoding/json's Encoder writes it: a JSON
// array of objects in the fields' order, and a newline.
func appendPotentials(buf []byte, ps []slots.Potential) []byte {
	buf = append(buf, '[')
	for i, p := range ps {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = append(buf, `{"worker_id":`...)
		buf = strconv.AppendUint(buf, p.WorkerID, 10)
		buf = append(buf, `,"dp_rank":`...)
		buf = strconv.AppendUint(buf, uint64(p.DPRank), 10)
		buf = append(buf, `,"potential_prefill_tokens":`...)
		buf = strconv.AppendUint(buf, p.PotentialPrefillTokens, 10)
		buf = append(buf, `,"potential_decode_blocks":`...)
		buf = strconv.AppendUint(buf, p.PotentialDecodeBlocks, 10)
		buf = append(buf, '}')
	}
	return append(buf, ']', '\n')
}
