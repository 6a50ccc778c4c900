package api

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
)

// ModelThresholds is one model's effective thresholds: the defaults merged
// with its override; a nil field is unset (that check is off). It is an
// element of ThresholdsReply and the whole reply of a POST or a DELETE.
type ModelThresholds struct {
	Model string `json:"model"`
	events.Thresholds
	// ControlledBy is "slo" while an enforced SLO sets the model's
	// thresholds (contract §18); absent otherwise.
	ControlledBy string `json:"controlled_by,omitempty"`
}

// ThresholdsReply is the reply of GET /busy_threshold, sorted by model.
type ThresholdsReply struct {
	Thresholds []ModelThresholds `json:"thresholds"`
}

// LoadsReply is the reply of GET /loads, sorted by model, worker and rank.
type LoadsReply struct {
	Loads []monitor.LoadRow `json:"loads"`
}

// WorkersReply is the reply of GET /workers, sorted by model and worker.
type WorkersReply struct {
	Workers []monitor.WorkerRow `json:"workers"`
}

// Record is a model's busy set as the monitor holds it now: the content of
// its record in the busy bucket, without the writer's fields (updated_at,
// monitor_id, epoch, seq).
type Record struct {
	Model   string   `json:"model"`
	Busy    []uint64 `json:"busy"`
	Free    []uint64 `json:"free"`
	Stale   []uint64 `json:"stale"`
	AllBusy bool     `json:"all_busy"`
	// Amber are the free workers near their thresholds, Hard the busy
	// workers beyond them (priority classes, contract §15).
	Amber []uint64 `json:"amber"`
	Hard  []uint64 `json:"hard"`
	// Reasons says why each busy worker is busy, keyed by its id in
	// decimal: cordoned, or kv, prefill, kv_committed, queue_delay joined
	// by "+" in that order.
	Reasons map[string]string `json:"reasons"`
	// Thresholds are those the busy set was computed with.
	Thresholds events.Thresholds `json:"thresholds"`
	// Routers is the number of routers with a fresh estimate for the model
	// (contract §17): their queues pace themselves by it.
	Routers uint64 `json:"routers"`
	// Saturation is the mean saturation of the model's fresh, uncordoned
	// workers, rounded to 0.01 (contract §21).
	Saturation float64 `json:"saturation"`
	// QueuedBy are the requests each router holds queued, by priority, and
	// Queued their sum (contract §22); empty when none.
	QueuedBy map[string]map[int64]uint64 `json:"queued_by"`
	Queued   map[int64]uint64            `json:"queued"`
}

// RecordsReply is the reply of GET /busy, sorted by model.
type RecordsReply struct {
	Records []Record `json:"records"`
}

// ErrorReply is the body of every error.
type ErrorReply struct {
	Error string `json:"error"`
}

// recordOf converts a monitor record, with empty lists and maps, never nil.
func recordOf(b events.BusySet) Record {
	r := Record{Model: b.Model, Busy: b.Busy, Free: b.Free, Stale: b.Stale, AllBusy: b.AllBusy,
		Amber: b.Amber, Hard: b.Hard, Reasons: b.Reasons, Thresholds: b.Thresholds, Routers: b.Routers,
		Saturation: b.Saturation, QueuedBy: b.QueuedBy, Queued: b.Queued}
	for _, l := range []*[]uint64{&r.Busy, &r.Free, &r.Stale, &r.Amber, &r.Hard} {
		if *l == nil {
			*l = []uint64{}
		}
	}
	if r.Reasons == nil {
		r.Reasons = map[string]string{}
	}
	if r.QueuedBy == nil {
		r.QueuedBy = map[string]map[int64]uint64{}
	}
	if r.Queued == nil {
		r.Queued = map[int64]uint64{}
	}
	return r
}

// writeJSON writes v as the JSON reply with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		// Only a bug can get here: every reply type encodes.
		status = http.StatusInternalServerError
		buf.Reset()
		buf.WriteString(`{"error":"internal error: cannot encode the reply"}` + "\n")
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// writeError writes {"error": msg} with status.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, ErrorReply{Error: msg})
}

// httpError is an error the API answers with: a status and a message for a
// person.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func errorf(status int, msg string) *httpError { return &httpError{status: status, msg: msg} }

func (e *httpError) write(w http.ResponseWriter) { writeError(w, e.status, e.msg) }
