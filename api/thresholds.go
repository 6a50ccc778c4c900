package api

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/overrides"
)

// listThresholds answers GET /busy_threshold: every known model with its
// configured thresholds (defaults merged with the bucket's override).
func (h *handler) listThresholds(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := h.context(r)
	defer cancel()
	overrides, err := h.cfg.Store.List(ctx)
	if err != nil {
		storeError(err).write(w)
		return
	}
	seen, err := h.cfg.Monitor.Thresholds(ctx)
	if err != nil {
		monitorError(err).write(w)
		return
	}
	names := make(map[string]struct{}, len(seen)+len(overrides))
	for name := range seen {
		names[name] = struct{}{}
	}
	for name := range overrides {
		names[name] = struct{}{}
	}
	if h.cfg.RecordModels != nil {
		for _, name := range h.cfg.RecordModels() {
			names[name] = struct{}{}
		}
	}
	reply := ThresholdsReply{Thresholds: make([]ModelThresholds, 0, len(names))}
	controlledAll, herr := h.sloControlAll(ctx)
	if herr != nil {
		herr.write(w)
		return
	}
	for _, name := range slices.Sorted(maps.Keys(names)) {
		if applied, controlled := controlledAll[name]; controlled {
			reply.Thresholds = append(reply.Thresholds, h.controlledThresholds(ctx, name, applied))
			continue
		}
		reply.Thresholds = append(reply.Thresholds, h.effective(name, overrides[name]))
	}
	writeJSON(w, http.StatusOK, reply)
}

// postThresholds answers POST /busy_threshold: a set (merge) when the body
// sets a threshold, else a get of one model.
func (h *handler) postThresholds(w http.ResponseWriter, r *http.Request) {
	members, herr := h.readObject(w, r)
	if herr != nil {
		herr.write(w)
		return
	}
	set := isSet(members)
	if set {
		if herr := h.authorize(r); herr != nil {
			h.unauthorized(w, r, herr)
			return
		}
	}
	req, herr := decodeRequest(members)
	if herr != nil {
		herr.write(w)
		return
	}
	ctx, cancel := h.context(r)
	defer cancel()
	action := "ask for its thresholds"
	if set {
		action = "set its thresholds"
	}
	controlled, applied, herr := h.sloControl(ctx, req.model)
	if herr != nil {
		herr.write(w)
		return
	}
	if controlled && set {
		sloConflict(req.model).write(w)
		return
	}
	if controlled {
		writeJSON(w, http.StatusOK, h.controlledThresholds(ctx, req.model, applied))
		return
	}
	override, _, herr := h.lookup(ctx, req.model, action)
	if herr != nil {
		herr.write(w)
		return
	}
	if !set {
		writeJSON(w, http.StatusOK, h.effective(req.model, override))
		return
	}
	merged, err := h.cfg.Store.Merge(ctx, req.model, req.patch)
	if err != nil {
		storeError(err).write(w)
		return
	}
	if err := h.cfg.Monitor.SetOverride(ctx, req.model, &merged); err != nil {
		// The override is stored: the bucket's watcher applies it later.
		monitorError(fmt.Errorf("the override is stored in the thresholds bucket but not applied yet: %w", err)).write(w)
		return
	}
	eff := h.effective(req.model, merged)
	h.log.Info("api: threshold override set", "model", req.model, "override", describe(merged),
		"effective", describe(eff.Thresholds), "remote", r.RemoteAddr)
	writeJSON(w, http.StatusOK, eff)
}

// deleteThresholds answers DELETE /busy_threshold?model=NAME: the model's
// override is dropped, and the reply is its thresholds now (the defaults).
func (h *handler) deleteThresholds(w http.ResponseWriter, r *http.Request) {
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
	if controlled, _, herr := h.sloControl(ctx, model); herr != nil || controlled {
		if herr == nil {
			herr = sloConflict(model)
		}
		herr.write(w)
		return
	}
	_, stored, herr := h.lookup(ctx, model, "delete its override")
	if herr != nil {
		herr.write(w)
		return
	}
	if stored {
		if err := h.cfg.Store.Delete(ctx, model); err != nil {
			storeError(err).write(w)
			return
		}
	}
	if err := h.cfg.Monitor.SetOverride(ctx, model, nil); err != nil {
		monitorError(fmt.Errorf("the override is deleted from the thresholds bucket but the monitor still applies it: %w", err)).write(w)
		return
	}
	h.log.Info("api: threshold override deleted", "model", model, "had_override", stored, "remote", r.RemoteAddr)
	writeJSON(w, http.StatusOK, h.effective(model, events.Thresholds{}))
}

// lookup returns a model's stored override and whether it has one, or 404
// when the model is not known: not seen by the monitor, without a record in
// the busy bucket and without an override. A stored override that is not
// valid counts as present but empty (a set replaces it).
func (h *handler) lookup(ctx context.Context, model, action string) (events.Thresholds, bool, *httpError) {
	override, stored, err := h.cfg.Store.Get(ctx, model)
	if errors.Is(err, overrides.ErrBadOverride) {
		h.log.Warn("api: the stored override is not valid; treating it as empty", "model", model, "err", err)
		override, stored, err = events.Thresholds{}, true, nil
	}
	if err != nil {
		return events.Thresholds{}, false, storeError(err)
	}
	if stored {
		return override, true, nil
	}
	if h.cfg.RecordModels != nil && slices.Contains(h.cfg.RecordModels(), model) {
		return events.Thresholds{}, false, nil
	}
	known, err := h.cfg.Monitor.Known(ctx, model)
	if err != nil {
		return events.Thresholds{}, false, monitorError(err)
	}
	if !known {
		return events.Thresholds{}, false, errorf(http.StatusNotFound, fmt.Sprintf(
			"model %q is not known: no worker has reported it since this monitor started, and it has no record "+
				"in the busy bucket and no override; check the name (GET /busy_threshold lists the known models) "+
				"or start a worker of it before you %s", model, action))
	}
	return events.Thresholds{}, false, nil
}

// effective returns a model's thresholds: the defaults merged with override.
func (h *handler) effective(model string, override events.Thresholds) ModelThresholds {
	return ModelThresholds{Model: model, Thresholds: h.cfg.Defaults.Merge(override)}
}

// authorize checks the bearer token of a mutating request, in constant
// time. Without a configured token everything is allowed.
func (h *handler) authorize(r *http.Request) *httpError {
	if h.cfg.AdminToken == "" {
		return nil
	}
	auth := r.Header.Get("Authorization")
	if auth == "" {
		return errorf(http.StatusUnauthorized, "this monitor requires the admin token to change thresholds: send the header Authorization: Bearer <token>")
	}
	scheme, token, found := strings.Cut(auth, " ")
	if !found {
		// Not echoed: a header without a scheme is likely the bare token.
		return errorf(http.StatusUnauthorized, "the Authorization header has no scheme: send Authorization: Bearer <token>")
	}
	if !strings.EqualFold(scheme, "Bearer") {
		return errorf(http.StatusUnauthorized, fmt.Sprintf("authorization scheme %q is not supported: send Authorization: Bearer <token>", scheme))
	}
	got := sha256.Sum256([]byte(strings.TrimSpace(token)))
	if subtle.ConstantTimeCompare(got[:], h.tokenHash[:]) != 1 {
		return errorf(http.StatusUnauthorized, "the admin token is not valid")
	}
	return nil
}

// unauthorized answers 401 with the WWW-Authenticate challenge of RFC 6750.
func (h *handler) unauthorized(w http.ResponseWriter, r *http.Request, herr *httpError) {
	challenge := `Bearer realm="workermon"`
	if scheme, _, _ := strings.Cut(r.Header.Get("Authorization"), " "); strings.EqualFold(scheme, "Bearer") {
		challenge += `, error="invalid_token"` // a bearer token was presented, and is wrong
	}
	w.Header().Set("WWW-Authenticate", challenge)
	h.log.Info("api: refused a threshold change without a valid admin token", "method", r.Method, "remote", r.RemoteAddr)
	herr.write(w)
}

// queryModel returns the model query parameter; absent is allowed unless
// required. More than one, an empty one, a query string that does not
// decode (?model=%zz) or an invalid name is 400: none of them may widen the
// answer to every model.
func queryModel(r *http.Request, required bool) (string, *httpError) {
	query, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return "", errorf(http.StatusBadRequest, "the query string does not decode: "+err.Error())
	}
	values, given := query[fieldModel]
	switch {
	case len(values) > 1:
		return "", errorf(http.StatusBadRequest, "give the model query parameter once")
	case (!given || values[0] == "") && required:
		return "", errorf(http.StatusBadRequest, fmt.Sprintf("the model query parameter is required: %s %s?model=<name>", r.Method, r.URL.Path))
	case !given:
		return "", nil
	case values[0] == "":
		return "", errorf(http.StatusBadRequest, fmt.Sprintf("the model query parameter is empty: %s %s?model=<name>, or no model parameter for every model", r.Method, r.URL.Path))
	}
	return values[0], checkModel(values[0])
}

// storeError answers a failure of the thresholds bucket.
func storeError(err error) *httpError {
	if errors.Is(err, overrides.ErrThresholdConflict) {
		return errorf(http.StatusConflict, "the override was changed by others at the same time, too often; retry")
	}
	return errorf(http.StatusServiceUnavailable, "the thresholds bucket cannot be reached (is NATS up?): "+err.Error())
}

// monitorError answers a failure to reach the monitor loop.
func monitorError(err error) *httpError {
	return errorf(http.StatusServiceUnavailable, "the monitor is not answering (shutting down?): "+err.Error())
}

// describe renders thresholds for a log line.
func describe(t events.Thresholds) string {
	f := func(name string, v string, set bool) string {
		if !set {
			return name + "=unset"
		}
		return name + "=" + v
	}
	var dec, pre, frac string
	if t.ActiveDecodeBlocks != nil {
		dec = fmt.Sprint(*t.ActiveDecodeBlocks)
	}
	if t.ActivePrefillTokens != nil {
		pre = fmt.Sprint(*t.ActivePrefillTokens)
	}
	if t.ActivePrefillTokensFrac != nil {
		frac = fmt.Sprint(*t.ActivePrefillTokensFrac)
	}
	return f("decode", dec, t.ActiveDecodeBlocks != nil) + " " + f("prefill", pre, t.ActivePrefillTokens != nil) + " " +
		f("prefill_frac", frac, t.ActivePrefillTokensFrac != nil)
}
