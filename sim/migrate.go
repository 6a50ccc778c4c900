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

// cuttable is a marked stream: its cut channel and its request.
type cuttable struct {
	cut chan struct{}
	req *request
}

// running reports whether the request is decoding: it has generated a
// token and not its last one. A request still waiting for its prefill
// holds no KV block, so cutting it frees nothing on this worker; a finished
// one has nothing left to move.
func (c cuttable) running() bool {
	select {
	case <-c.req.done:
		return false
	default:
		return c.req.produced.Load() > 0
	}
}

// registerCuttable adds the stream of req and returns its cut channel and
// the function that removes it.
func (w *Worker) registerCuttable(req *request) (<-chan struct{}, func()) {
	w.cutMu.Lock()
	defer w.cutMu.Unlock()
	cut := make(chan struct{})
	w.cuttables = append(w.cuttables, cuttable{cut: cut, req: req})
	return cut, func() {
		w.cutMu.Lock()
		defer w.cutMu.Unlock()
		w.cuttables = slices.DeleteFunc(w.cuttables, func(c cuttable) bool { return c.cut == cut })
	}
}

// migrate is the publisher's MigrateHandler: it cuts up to
// req.MaxRequests of the newest marked streams that are running (contract
// §12: "marked running streams") and returns how many.
func (w *Worker) migrate(_ context.Context, req events.MigrateRequest) int {
	w.cutMu.Lock()
	defer w.cutMu.Unlock()
	n := 0
	for i := len(w.cuttables) - 1; i >= 0 && uint64(n) < req.MaxRequests; i-- { // the newest first
		if c := w.cuttables[i]; c.running() {
			close(c.cut)
			w.cuttables = slices.Delete(w.cuttables, i, i+1)
			n++
		}
	}
	w.migrated.Add(uint64(n))
	if n > 0 {
		w.log.Debug("sim: cut streams for migration", "count", n, "reason", req.Reason, "dst", req.Dst)
	}
	return n
}
