package api

import (
	"net/http"

	"github.com/workermon/workermon/monitor"
)

// The inspection endpoints read the monitor's own state. The optional query
// parameter model selects one model; without it every model is listed. A
// model the monitor does not track gives an empty list, not 404: a model can
// be known (an override, an old record) and have no worker right now.

// loads answers GET /loads: one row per worker and rank.
func (h *handler) loads(w http.ResponseWriter, r *http.Request) {
	model, herr := queryModel(r, false)
	if herr != nil {
		herr.write(w)
		return
	}
	ctx, cancel := h.context(r)
	defer cancel()
	rows, err := h.cfg.Monitor.Loads(ctx, model)
	if err != nil {
		monitorError(err).write(w)
		return
	}
	if rows == nil {
		rows = []monitor.LoadRow{}
	}
	writeJSON(w, http.StatusOK, LoadsReply{Loads: rows})
}

// workers answers GET /workers: one row per worker.
func (h *handler) workers(w http.ResponseWriter, r *http.Request) {
	model, herr := queryModel(r, false)
	if herr != nil {
		herr.write(w)
		return
	}
	ctx, cancel := h.context(r)
	defer cancel()
	rows, err := h.cfg.Monitor.Workers(ctx, model)
	if err != nil {
		monitorError(err).write(w)
		return
	}
	if rows == nil {
		rows = []monitor.WorkerRow{}
	}
	writeJSON(w, http.StatusOK, WorkersReply{Workers: rows})
}

// records answers GET /busy: the busy set of each model.
func (h *handler) records(w http.ResponseWriter, r *http.Request) {
	model, herr := queryModel(r, false)
	if herr != nil {
		herr.write(w)
		return
	}
	ctx, cancel := h.context(r)
	defer cancel()
	sets, err := h.cfg.Monitor.Records(ctx, model)
	if err != nil {
		monitorError(err).write(w)
		return
	}
	reply := RecordsReply{Records: make([]Record, 0, len(sets))}
	for _, b := range sets {
		reply.Records = append(reply.Records, recordOf(b))
	}
	writeJSON(w, http.StatusOK, reply)
}
