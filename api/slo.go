package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

// SLOStore is the SLO bucket (contract §18); *overrides.SLOStore
// implements it.
type SLOStore interface {
	Get(ctx context.Context, model string) (overrides.SLO, bool, error)
	Put(ctx context.Context, v overrides.SLO) error
	Delete(ctx context.Context, model string) error
	List(ctx context.Context) (map[string]overrides.SLO, map[string]overrides.SLOStatus, error)
	Status(ctx context.Context, model string) (overrides.SLOStatus, uint64, error)
}

var _ SLOStore = (*overrides.SLOStore)(nil)

// SLOReply is one model's SLO with its controller's state: the reply of
// POST /slo, DELETE /slo and GET /slo?model=, and an element of SLOsReply.
type SLOReply struct {
	Model      string          `json:"model"`
	TTFTms     *float64        `json:"ttft_ms"`
	ITLms      *float64        `json:"itl_ms"`
	Percentile float64         `json:"percentile"`
	Mode       string          `json:"mode"`
	State      slo.State       `json:"state"`
	Applied    *slo.Thresholds `json:"applied"`
	Suggested  *slo.Thresholds `json:"suggested"`
	Measured   *slo.Measured   `json:"measured"`
	UpdatedAt  int64           `json:"updated_at"`
	// Observed is the best latency the model's fleet has shown on this
	// monitor; nil when it has measured none.
	Observed *ObservedReply `json:"observed"`
}

// ObservedReply is the best latency a model's fleet has shown since this
// monitor first heard its latency windows (slo.Observed): per signal, the
// lowest latency in ms at each percentile ("p50", "p90", "p95", "p99") of
// any one --slo-interval's window that held enough samples to judge that
// percentile; a percentile no window could judge is left out.
type ObservedReply struct {
	Windows uint64             `json:"windows"`
	TTFTms  map[string]float64 `json:"ttft_ms"`
	ITLms   map[string]float64 `json:"itl_ms"`
}

// TTFTFloor and ITLFloor are slo.Best.Floor over the reply's values: the
// lowest latency the windows showed at percentile p, or at the largest
// kept percentile below it; ok is false when there is none.
func (o *ObservedReply) TTFTFloor(p float64) (ms, at float64, ok bool) {
	if o == nil {
		return 0, 0, false
	}
	return bestOf(o.TTFTms).Floor(p)
}

func (o *ObservedReply) ITLFloor(p float64) (ms, at float64, ok bool) {
	if o == nil {
		return 0, 0, false
	}
	return bestOf(o.ITLms).Floor(p)
}

// observedKeys name slo.ObservedPercentiles in ObservedReply.
var observedKeys = [len(slo.ObservedPercentiles)]string{"p50", "p90", "p95", "p99"}

func bestOf(m map[string]float64) slo.Best {
	var b slo.Best
	for i, k := range observedKeys {
		b[i] = m[k]
	}
	return b
}

func observedReply(o slo.Observed) *ObservedReply {
	r := &ObservedReply{Windows: o.Windows, TTFTms: map[string]float64{}, ITLms: map[string]float64{}}
	for i, k := range observedKeys {
		for _, s := range []struct {
			b slo.Best
			m map[string]float64
		}{{o.TTFT, r.TTFTms}, {o.ITL, r.ITLms}} {
			if s.b[i] > 0 {
				s.m[k] = math.Round(s.b[i]*10) / 10
			}
		}
	}
	return r
}

// sloReply is sloReply with the model's observed latency.
func (h *handler) sloReply(v overrides.SLO, st *overrides.SLOStatus) SLOReply {
	r := sloReply(v, st)
	if h.cfg.Observed != nil {
		if o, ok := h.cfg.Observed(v.Model); ok {
			r.Observed = observedReply(o)
		}
	}
	return r
}

// SLOsReply is the reply of GET /slo, sorted by model.
type SLOsReply struct {
	SLOs []SLOReply `json:"slos"`
}

// sloReply joins an SLO and its status (st nil: none written yet).
func sloReply(v overrides.SLO, st *overrides.SLOStatus) SLOReply {
	r := SLOReply{Model: v.Model, TTFTms: v.TTFTms, ITLms: v.ITLms, Percentile: v.Percentile, Mode: v.Mode,
		State: slo.StateNoData, UpdatedAt: v.UpdatedAt}
	if st != nil {
		r.State, r.Applied, r.UpdatedAt = st.State, st.Applied, st.UpdatedAt
		sug, m := st.Suggested, st.Measured
		r.Suggested, r.Measured = &sug, &m
		if !v.Enforced() {
			r.Applied = nil
		}
	}
	return r
}

// JSON field names of an SLO request.
const (
	fieldTTFT       = "ttft_ms"
	fieldITL        = "itl_ms"
	fieldPercentile = "percentile"
	fieldMode       = "mode"
	sloFieldList    = "model, ttft_ms, itl_ms, percentile and mode"
	exampleSLO      = `{"model":"Qwen/Qwen3-0.6B","ttft_ms":500,"itl_ms":50,"percentile":0.9,"mode":"enforce"}`
)

// getSLO answers GET /slo and GET /slo?model=NAME.
func (h *handler) getSLO(w http.ResponseWriter, r *http.Request) {
	model, herr := queryModel(r, false)
	if herr != nil {
		herr.write(w)
		return
	}
	ctx, cancel := h.context(r)
	defer cancel()
	slos, statuses, err := h.cfg.SLOs.List(ctx)
	if err != nil {
		sloStoreError(err).write(w)
		return
	}
	if model != "" {
		v, ok := slos[model]
		if !ok {
			writeError(w, http.StatusNotFound, fmt.Sprintf("model %q has no SLO; POST /slo sets one, e.g. %s", model, exampleSLO))
			return
		}
		writeJSON(w, http.StatusOK, h.sloReply(v, statusOf(statuses, model)))
		return
	}
	reply := SLOsReply{SLOs: make([]SLOReply, 0, len(slos))}
	for _, name := range slices.Sorted(maps.Keys(slos)) {
		reply.SLOs = append(reply.SLOs, h.sloReply(slos[name], statusOf(statuses, name)))
	}
	writeJSON(w, http.StatusOK, reply)
}

func statusOf(statuses map[string]overrides.SLOStatus, model string) *overrides.SLOStatus {
	if st, ok := statuses[model]; ok {
		return &st
	}
	return nil
}

// postSLO answers POST /slo: the model's SLO is replaced.
func (h *handler) postSLO(w http.ResponseWriter, r *http.Request) {
	members, herr := h.readObject(w, r)
	if herr != nil {
		herr.write(w)
		return
	}
	if herr := h.authorize(r); herr != nil {
		h.unauthorized(w, r, herr)
		return
	}
	v, herr := decodeSLO(members)
	if herr != nil {
		herr.write(w)
		return
	}
	v.UpdatedAt = time.Now().UnixNano()
	ctx, cancel := h.context(r)
	defer cancel()
	if err := h.cfg.SLOs.Put(ctx, v); err != nil {
		if errors.Is(err, overrides.ErrTooManySLOs) {
			tooManySLOs("the SLO bucket holds the most SLOs allowed").write(w)
			return
		}
		sloStoreError(err).write(w)
		return
	}
	if h.cfg.OnSLOChange != nil {
		if err := h.cfg.OnSLOChange(ctx, v.Model, v, false); err != nil {
			if errors.Is(err, overrides.ErrTooManySLOs) {
				tooManySLOs("the SLO is stored, but the monitor's controller has the most SLOs allowed and does not control it").write(w)
				return
			}
			monitorError(fmt.Errorf("the SLO is stored but not applied yet: %w", err)).write(w)
			return
		}
	}
	h.log.Info("api: slo set", "model", v.Model, "ttft_ms", fmtPtr(v.TTFTms), "itl_ms", fmtPtr(v.ITLms),
		"percentile", v.Percentile, "mode", v.Mode, "remote", r.RemoteAddr)
	st, rev, err := h.cfg.SLOs.Status(ctx, v.Model)
	var stp *overrides.SLOStatus
	if err == nil && rev != 0 {
		stp = &st
	}
	writeJSON(w, http.StatusOK, h.sloReply(v, stp))
}

// deleteSLO answers DELETE /slo?model=NAME.
func (h *handler) deleteSLO(w http.ResponseWriter, r *http.Request) {
	if herr := h.authorize(r); herr != nil {
		h.unauthorized(w, r, herr)
		return
	}
	model, herr := queryModel(r, true)
	if herr != nil {
		herr.write(w)
		return
	}
	ctx, cancel := h.context(r)
	defer cancel()
	v, ok, err := h.cfg.SLOs.Get(ctx, model)
	if err != nil && !errors.Is(err, overrides.ErrBadSLO) {
		sloStoreError(err).write(w)
		return
	}
	if !ok && err == nil {
		writeError(w, http.StatusNotFound, fmt.Sprintf("model %q has no SLO to delete", model))
		return
	}
	// The controller lets go first, so that no round of it writes the
	// status again between the two deletes; it takes the SLO back if the
	// delete fails.
	if h.cfg.OnSLOChange != nil {
		if err := h.cfg.OnSLOChange(ctx, model, overrides.SLO{}, true); err != nil {
			monitorError(fmt.Errorf("the SLO is not deleted: the monitor did not answer: %w", err)).write(w)
			return
		}
	}
	if err := h.cfg.SLOs.Delete(ctx, model); err != nil {
		if h.cfg.OnSLOChange != nil && ok {
			_ = h.cfg.OnSLOChange(ctx, model, v, false)
		}
		sloStoreError(err).write(w)
		return
	}
	h.log.Info("api: slo deleted", "model", model, "remote", r.RemoteAddr)
	v.Model = model
	writeJSON(w, http.StatusOK, h.sloReply(v, nil))
}

// decodeSLO checks the members of a POST /slo body.
func decodeSLO(members map[string]json.RawMessage) (overrides.SLO, *httpError) {
	v := overrides.SLO{Percentile: slo.DefaultPercentile, Mode: slo.ModeEnforce}
	for key := range members {
		switch key {
		case fieldModel, fieldTTFT, fieldITL, fieldPercentile, fieldMode:
		default:
			return v, errorf(http.StatusBadRequest, fmt.Sprintf("unknown field %q: the fields are %s", key, sloFieldList))
		}
	}
	model, herr := decodeModel(members[fieldModel])
	if herr != nil {
		return v, herr
	}
	v.Model = model
	positive := func(x float64) bool { return x > 0 }
	if v.TTFTms, herr = decodeFloat(members[fieldTTFT], fieldTTFT, "a positive number of milliseconds", positive); herr != nil {
		return v, herr
	}
	if v.ITLms, herr = decodeFloat(members[fieldITL], fieldITL, "a positive number of milliseconds", positive); herr != nil {
		return v, herr
	}
	if v.TTFTms == nil && v.ITLms == nil {
		return v, errorf(http.StatusBadRequest, "give at least one of ttft_ms and itl_ms, e.g. "+exampleSLO)
	}
	p, herr := decodeFloat(members[fieldPercentile], fieldPercentile, "a number between 0 and 1, both excluded",
		func(x float64) bool { return x > 0 && x < 1 })
	if herr != nil {
		return v, herr
	}
	if p != nil {
		v.Percentile = *p
	}
	if raw := members[fieldMode]; !isNull(raw) {
		if raw[0] != '"' {
			return v, errorf(http.StatusUnprocessableEntity, fmt.Sprintf(`field "mode" must be a string, not %s`, jsonType(raw)))
		}
		if err := json.Unmarshal(raw, &v.Mode); err != nil {
			return v, errorf(http.StatusBadRequest, `field "mode" does not decode: `+err.Error())
		}
		if v.Mode != slo.ModeEnforce && v.Mode != slo.ModeShadow {
			return v, errorf(http.StatusBadRequest, fmt.Sprintf(`field "mode" is %s: it must be "enforce" or "shadow"`, strconv.Quote(v.Mode)))
		}
	}
	if err := v.Validate(); err != nil { // the store's own check, as a last guard
		return v, errorf(http.StatusBadRequest, err.Error())
	}
	return v, nil
}

// sloControl reports whether an enforced SLO controls model's thresholds,
// and the thresholds it applies (from its status; nil before the first).
func (h *handler) sloControl(ctx context.Context, model string) (bool, *slo.Thresholds, *httpError) {
	if h.cfg.SLOs == nil {
		return false, nil, nil
	}
	v, ok, err := h.cfg.SLOs.Get(ctx, model)
	if err != nil && !errors.Is(err, overrides.ErrBadSLO) {
		return false, nil, sloStoreError(err)
	}
	if !ok || !v.Enforced() {
		return false, nil, nil
	}
	st, rev, err := h.cfg.SLOs.Status(ctx, model)
	if err != nil || rev == 0 {
		return true, nil, nil
	}
	return true, st.Applied, nil
}

// sloControlAll is sloControl for every model: the enforced ones, with
// the thresholds each applies (nil before the controller's first round).
func (h *handler) sloControlAll(ctx context.Context) (map[string]*slo.Thresholds, *httpError) {
	out := map[string]*slo.Thresholds{}
	if h.cfg.SLOs == nil {
		return out, nil
	}
	slos, statuses, err := h.cfg.SLOs.List(ctx)
	if err != nil {
		return nil, sloStoreError(err)
	}
	for model, v := range slos {
		if v.Enforced() {
			var applied *slo.Thresholds
			if st, ok := statuses[model]; ok {
				applied = st.Applied
			}
			out[model] = applied
		}
	}
	return out, nil
}

// controlledThresholds is a model's reply under an enforced SLO: decode,
// prefill, kv_committed and queue_delay as the controller applies them,
// _frac null.
func (h *handler) controlledThresholds(ctx context.Context, model string, applied *slo.Thresholds) ModelThresholds {
	mt := ModelThresholds{Model: model, ControlledBy: "slo"}
	if applied == nil {
		// Before the controller's first round: the monitor's view.
		if all, err := h.cfg.Monitor.Thresholds(ctx); err == nil {
			mt.Thresholds = all[model]
		}
		mt.ActivePrefillTokensFrac = nil
		return mt
	}
	mt.ActiveDecodeBlocks = events.Ptr(applied.Decode)
	mt.ActivePrefillTokens = events.Ptr(applied.Prefill)
	if applied.KVCommitted > 0 { // 0: a status of before §21, none held
		mt.KVCommitted = events.Ptr(applied.KVCommitted)
	}
	if applied.QueueDelayMs > 0 {
		mt.QueueDelayMs = events.Ptr(applied.QueueDelayMs)
	}
	return mt
}

// sloConflict is the 409 of a threshold change under an enforced SLO.
func sloConflict(model string) *httpError {
	return errorf(http.StatusConflict, fmt.Sprintf("model %q is under an enforced SLO (GET /slo?model=%s): the SLO controller sets its "+
		"thresholds; delete the SLO or set its mode to shadow first (its stored override is kept and applies again then)", model, model))
}

// tooManySLOs is the 429 of an SLO beyond --max-slos: each SLO costs a
// status write every --slo-interval and metric series.
func tooManySLOs(what string) *httpError {
	return errorf(http.StatusTooManyRequests, "too many SLOs: "+what+
		" (--max-slos of workermon serve); delete an SLO first (GET /slo lists them) or raise --max-slos")
}

// sloStoreError answers a failure of the SLO bucket.
func sloStoreError(err error) *httpError {
	if errors.Is(err, slo.ErrInvalidTarget) || errors.Is(err, events.ErrInvalidModel) {
		return errorf(http.StatusBadRequest, err.Error())
	}
	return errorf(http.StatusServiceUnavailable, "the SLO bucket cannot be reached (is NATS up?): "+err.Error())
}

func fmtPtr(p *float64) string {
	if p == nil {
		return "unset"
	}
	return strconv.FormatFloat(*p, 'g', -1, 64)
}
