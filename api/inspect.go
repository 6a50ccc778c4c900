package api

import (
	"context"
	"net/http"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
)

// The inspection endpoints read the monitor's own state. The optional query
// parameter model selects one model; without it every model is listed. A
// model the monitor does not track gives an empty list, not 404: a model can
// be known (an override, an old record) and have no worker right now.

// loads answers GET /loads: one row per worker and rank.
func (h *handler) loads() http.HandlerFunc {
	return inspect(h, h.cfg.Monitor.Loads, func(rows []monitor.LoadRow) any { return LoadsReply{Loads: rows} })
}

// workers answers GET /workers: one row per worker.
func (h *handler) workers() http.HandlerFunc {
	return inspect(h, h.cfg.Monitor.Workers, func(rows []monitor.WorkerRow) any { return WorkersReply{Workers: rows} })
}

// records answers GET /busy: the busy set of each model.
func (h *handler) records() http.HandlerFunc {
	return inspect(h, h.cfg.Monitor.Records, func(sets []events.BusySet) any {
		reply := RecordsReply{Records: make([]Record, 0, len(sets))}
		for _, b := range sets {
			reply.Records = append(reply.Records, recordOf(b))
		}
		return reply
	})
}

// inspect returns the handler of an inspection endpoint: it asks the monitor
// with query for the model of the query string (every model without one)
// and answers with the reply built of the rows, an empty list rather than
// null.
func inspect[T any](h *handler, query func(context.Context, string) ([]T, error), reply func([]T) any) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		model, herr := queryModel(r, false)
		if herr != nil {
			herr.write(w)
			return
		}
		ctx, cancel := h.context(r)
		defer cancel()
		rows, err := query(ctx, model)
		if err != nil {
			monitorError(err).write(w)
			return
		}
		if rows == nil {
			rows = []T{}
		}
		writeJSON(w, http.StatusOK, reply(rows))
	}
}

// PartitionsReply is the body of the monitor's GET /partitions (contract
// §10): the partitions, who holds each as this monitor observes the leases
// bucket, and what this monitor holds.
type PartitionsReply struct {
	Partitions int    `json:"partitions"`
	MonitorID  string `json:"monitor_id"`
	Instance   string `json:"instance"`
	LeaseTTL   string `json:"lease_ttl"`
	Held       []int  `json:"held"`
	// Unmapped counts the reports that arrived on plain subjects while
	// partitions are configured: the NATS servers lack the mapping.
	Unmapped uint64                   `json:"unmapped_reports"`
	List     []busylist.PartitionInfo `json:"list"`
}
