package router

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/workermon/workermon/admission"
)

// Error types of the router's error bodies.
const (
	typeInvalidRequest     = "invalid_request_error"
	typeNotFound           = "not_found_error"
	typeServiceUnavailable = "service_unavailable"
	typeUpstream           = "upstream_error"
	typeUpstreamTimeout    = "upstream_timeout"
)

// writeError writes an error body with the given status.
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	body := admission.ErrorBody(status, typ, msg)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// writeNoWorkers answers 503 "no workers available" (never the all-busy
// body), with retry-after-ms and Retry-After: the floor, jittered (no
// request of the model will end to free a slot).
func (rt *Router) writeNoWorkers(w http.ResponseWriter, model, why string) {
	rt.metrics.noWorkers.Inc()
	rt.retry.SetFloor(w.Header())
	writeError(w, http.StatusServiceUnavailable, typeServiceUnavailable,
		fmt.Sprintf("no workers available for model %.256q: %s", model, why))
}

// modelList is the answer of GET /v1/models (OpenAI's shape).
type modelList struct {
	Object string      `json:"object"`
	Data   []modelInfo `json:"data"`
}

type modelInfo struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// serveModels lists the models that have registered workers or a busy-list
// record, sorted.
func (rt *Router) serveModels(w http.ResponseWriter, _ *http.Request) {
	names := slices.Concat(rt.cfg.Registry.Models(), rt.cfg.BusyList.Models()) // never append to a slice of theirs
	slices.Sort(names)
	names = slices.Compact(names)
	list := modelList{Object: "list", Data: make([]modelInfo, 0, len(names))}
	for _, n := range names {
		list.Data = append(list.Data, modelInfo{ID: n, Object: "model", OwnedBy: "workermon"})
	}
	body, err := json.Marshal(list)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "internal_error", err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// serveReady answers 200 once the busy list and the registry are loaded and
// ReadyCheck passes, 503 with the reasons otherwise.
func (rt *Router) serveReady(w http.ResponseWriter, _ *http.Request) {
	var problems []string
	if rt.cfg.ReadyCheck != nil {
		if err := rt.cfg.ReadyCheck(); err != nil {
			problems = append(problems, err.Error())
		}
	}
	if !rt.cfg.BusyList.Ready() {
		problems = append(problems, "busy list not loaded yet")
	}
	if !rt.cfg.Registry.Ready() {
		problems = append(problems, "worker registry not loaded yet")
	}
	if len(problems) > 0 {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = fmt.Fprintln(w, strings.Join(problems, "\n"))
		return
	}
	_, _ = w.Write([]byte("ready\n"))
}

// serveNotFound answers every other request: 405 on a known path, 404
// otherwise.
func (rt *Router) serveNotFound(w http.ResponseWriter, r *http.Request) {
	allow := ""
	switch r.URL.Path {
	case PathCompletions, PathChatCompletions:
		allow = http.MethodPost
	case PathModels, PathQueues, "/healthz", "/readyz":
		allow = "GET, HEAD"
	}
	if allow != "" {
		w.Header().Set("Allow", allow)
		writeError(w, http.StatusMethodNotAllowed, typeInvalidRequest,
			fmt.Sprintf("method %s not allowed on %s", r.Method, r.URL.Path))
		return
	}
	writeError(w, http.StatusNotFound, typeNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
}
