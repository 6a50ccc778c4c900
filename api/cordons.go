package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/workermon/workermon/overrides"
)

// Cordons holds the cordons (the workermon-cordons bucket, contract §12);
// *overrides.CordonStore implements it.
type Cordons interface {
	// Cordon stores a cordon of the worker and returns it.
	Cordon(ctx context.Context, model string, worker uint64) (overrides.Cordon, error)
	// Uncordon deletes it and reports whether there was one.
	Uncordon(ctx context.Context, model string, worker uint64) (bool, error)
	// List returns every cordon.
	List(ctx context.Context) ([]overrides.Cordon, error)
}

// CordonMonitor is what the cordon endpoints need of the monitor;
// *monitor.Monitor implements it.
type CordonMonitor interface {
	SetCordon(ctx context.Context, model string, worker uint64, on bool) error
}

// UncordonReply is the answer of POST /uncordon.
type UncordonReply struct {
	Model    string `json:"model"`
	WorkerID uint64 `json:"worker_id"`
	// WasCordoned: the worker was cordoned until this request.
	WasCordoned bool `json:"was_cordoned"`
}

// cordonRequest is the body of POST /cordon and POST /uncordon.
type cordonRequest struct {
	model  string
	worker uint64
}

const fieldWorkerID = "worker_id"

const cordonExample = `{"model":"Qwen/Qwen3-0.6B","worker_id":3}`

// decodeCordon reads and checks a cordon request's body.
func (h *handler) decodeCordon(w http.ResponseWriter, r *http.Request) (cordonRequest, *httpError) {
	var req cordonRequest
	members, herr := h.readObject(w, r)
	if herr != nil {
		return req, herr
	}
	for key := range members {
		if key != fieldModel && key != fieldWorkerID {
			return req, errorf(http.StatusBadRequest, fmt.Sprintf("unknown field %q: send %s", key, cordonExample))
		}
	}
	if isNull(members[fieldModel]) {
		return req, errorf(http.StatusBadRequest, `field "model" is required: send `+cordonExample)
	}
	if req.model, herr = decodeModel(members[fieldModel]); herr != nil {
		return req, herr
	}
	raw := members[fieldWorkerID]
	if isNull(raw) {
		return req, errorf(http.StatusBadRequest, `field "worker_id" is required: send `+cordonExample)
	}
	if jsonType(raw) != "a number" {
		return req, errorf(http.StatusUnprocessableEntity, fmt.Sprintf(`field "worker_id" must be a whole number ≥ 0, not %s`, jsonType(raw)))
	}
	v, err := strconv.ParseUint(string(raw), 10, 64)
	if err != nil {
		// A number out of range (contract §8: 400, as a threshold's).
		return req, errorf(http.StatusBadRequest, fmt.Sprintf(`field "worker_id" is %s: it must be a whole number from 0 to 18446744073709551615`, raw))
	}
	req.worker = v
	return req, nil
}

// setCordon answers POST /cordon (on) and POST /uncordon (off): the
// change is stored in the bucket, which every monitor applies, and applied
// to this monitor at once. POST /cordon replies with the stored cordon,
// POST /uncordon with an UncordonReply.
func (h *handler) setCordon(on bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if herr := h.authorize(r); herr != nil {
			h.unauthorized(w, r, herr)
			return
		}
		req, herr := h.decodeCordon(w, r)
		if herr != nil {
			herr.write(w)
			return
		}
		ctx, cancel := h.context(r)
		defer cancel()
		reply, err := h.storeCordon(ctx, req, on)
		if errors.Is(err, overrides.ErrTooManyCordons) {
			errorf(http.StatusTooManyRequests, "too many cordons: the cordons bucket holds the most it may; "+
				"uncordon workers first (GET /cordons lists them)").write(w)
			return
		}
		if err != nil {
			cordonsUnreachable(err).write(w)
			return
		}
		if err := h.cfg.CordonMonitor.SetCordon(ctx, req.model, req.worker, on); err != nil {
			monitorError(fmt.Errorf("the change is stored in the cordons bucket but not applied yet: %w", err)).write(w)
			return
		}
		h.log.Info("api: cordon set", "model", req.model, "worker_id", req.worker, "cordoned", on, "remote", r.RemoteAddr)
		writeJSON(w, http.StatusOK, reply)
	}
}

// storeCordon stores the cordon (on) or deletes it, and gives the reply.
func (h *handler) storeCordon(ctx context.Context, req cordonRequest, on bool) (any, error) {
	if on {
		return h.cfg.Cordons.Cordon(ctx, req.model, req.worker)
	}
	was, err := h.cfg.Cordons.Uncordon(ctx, req.model, req.worker)
	return UncordonReply{Model: req.model, WorkerID: req.worker, WasCordoned: was}, err
}

// cordonsUnreachable is the reply when the cordons bucket fails.
func cordonsUnreachable(err error) *httpError {
	return errorf(http.StatusServiceUnavailable, "the cordons bucket cannot be reached (is NATS up?): "+err.Error())
}

// listCordons answers GET /cordons: every cordon, as a JSON array.
func (h *handler) listCordons(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := h.context(r)
	defer cancel()
	list, err := h.cfg.Cordons.List(ctx)
	if err != nil {
		cordonsUnreachable(err).write(w)
		return
	}
	if list == nil {
		list = []overrides.Cordon{}
	}
	writeJSON(w, http.StatusOK, list)
}

// rescheduler answers GET /rescheduler with what Config.Rescheduler gives.
func (h *handler) rescheduler(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, h.cfg.Rescheduler())
}
