package sim

import (
	"context"
	"net/http"
	"slices"

	"github.com/workermon/workermon/events"
)

// Migrations (contract §12). A streamed request that the router marked
// continuable (X-Workermon-Migratable: 1) is registered while it runs; the
// rescheduler's migrate request, through the publisher's handler, cuts the
// newest of them — those with the most tokens still to generate, so the cut
// frees the most of the KV cache's future — by ending their streams without
// [DONE] or a finish reason and cancelling them in the engine, which frees
// their blocks at once. The router continues each on another worker.

// markedMigratable reports whether the router may continue r's stream.
func markedMigratable(r *http.Request) bool {
	return r.Header.Get(events.MigratableHeader) == "1"
}

// registerCuttable adds a running stream and returns its cut channel and
// the function that removes it.
func (w *Worker) registerCuttable() (<-chan struct{}, func()) {
	w.cutMu.Lock()
	defer w.cutMu.Unlock()
	cut := make(chan struct{})
	w.cuttables = append(w.cuttables, cut)
	return cut, func() {
		w.cutMu.Lock()
		defer w.cutMu.Unlock()
		w.cuttables = slices.DeleteFunc(w.cuttables, func(c chan struct{}) bool { return c == cut })
	}
}

// migrate is the publisher's MigrateHandler: it cuts up to
// req.MaxRequests of the newest marked streams and returns how many.
func (w *Worker) migrate(_ context.Context, req events.MigrateRequest) int {
	w.cutMu.Lock()
	defer w.cutMu.Unlock()
	n := 0
	for n < int(min(req.MaxRequests, uint64(len(w.cuttables)))) {
		last := len(w.cuttables) - 1 // registered last: the newest
		close(w.cuttables[last])
		w.cuttables = w.cuttables[:last]
		n++
	}
	w.migrated.Add(uint64(n))
	if n > 0 {
		w.log.Debug("sim: cut streams for migration", "count", n, "reason", req.Reason, "dst", req.Dst)
	}
	return n
}
