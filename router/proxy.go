package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
)

// exchange is one proxied request, from its arrival to the end of its
// response. Only the request's goroutine uses it.
type exchange struct {
	rt    *Router
	w     http.ResponseWriter
	r     *http.Request
	rc    *http.ResponseController
	route string
	model string
	// class is the request's priority class (contract §15).
	class admission.Class
	// code is the status written to the client, 0 until then.
	code int
	// tried are the workers that failed this request (unreachable, or cut).
	tried []uint64
	// cancelled is set once the client is known to be gone.
	cancelled bool
	// prompt is what the request adds to a worker's slots; empty without
	// a tracker.
	prompt promptLoad
	// preferred is the worker of the first attempt, chosen by the queue's
	// dispatcher; nil otherwise.
	preferred *events.WorkerEntry
	// lat times the stream for the latency windows (contract §18); zero
	// when not timed.
	lat latStream
	// decision and registered are what the request was admitted on: when
	// every candidate fails, the next tier of the decision is tried, or
	// the request is rejected as its class would be without them (see
	// forward).
	decision   admission.Decision
	registered []events.WorkerEntry
}

// serveInference proxies a POST /v1/completions or /v1/chat/completions.
func (rt *Router) serveInference(w http.ResponseWriter, r *http.Request, route string) {
	start := time.Now()
	rt.metrics.inFlight.Inc()
	ex := &exchange{rt: rt, w: w, r: r, rc: http.NewResponseController(w), route: route}
	defer func() {
		rt.metrics.inFlight.Dec()
		code := ex.code
		if code == 0 {
			code = statusClientClosed
		}
		rt.metrics.observe(route, code, start)
	}()
	ex.serve()
}

func (ex *exchange) serve() {
	rt := ex.rt
	body, ok := ex.readBody()
	if !ok {
		return
	}
	model, msg := requestModel(body)
	if msg != "" {
		ex.writeError(http.StatusBadRequest, typeInvalidRequest, msg)
		return
	}
	ex.model = model
	class, err := admission.ClassFromRequest(ex.r)
	if err != nil {
		ex.writeError(http.StatusBadRequest, typeInvalidRequest, admission.BadPriorityMessage(err))
		return
	}
	ex.class = class
	qh, msg := parseQueueHeaders(ex.r)
	if msg != "" {
		ex.writeError(http.StatusBadRequest, typeInvalidRequest, msg)
		return
	}

	// A model nobody serves is answered "no workers available", never with
	// the all-busy rejection (contract §7c), whatever its record says.
	registered := rt.cfg.Registry.Endpoints(model)
	if len(registered) == 0 {
		ex.code = http.StatusServiceUnavailable
		why := "no worker is registered"
		// Not "nobody serves it" when the registry cannot be read: its
		// watcher logs why, and so does the router, rate-limited.
		switch {
		case !rt.cfg.Registry.Ready():
			why = "the worker registry (KV bucket " + events.WorkersBucket + ") has not been read yet; see the router's log"
			rt.registryLog.warn("router: no worker known for the model: the worker registry has not been read yet",
				"model", model, "bucket", events.WorkersBucket)
		case !rt.cfg.Registry.Live():
			why = "the worker registry (KV bucket " + events.WorkersBucket +
				") cannot be read now (NATS down or not answering), so workers registered since are unknown; see the router's log"
			rt.registryLog.warn("router: no worker known for the model, and the worker registry cannot be read",
				"model", model, "bucket", events.WorkersBucket)
		}
		rt.writeNoWorkers(ex.w, model, why)
		return
	}
	d := rt.cfg.BusyList.DecideClass(model, class)
	var buf [8]events.WorkerEntry
	cands := d.Candidates(buf[:0], registered)
	if d.Admit && len(cands) == 0 {
		d = rt.unroutable(model, d, registered)
	}
	ex.decision, ex.registered = d, registered
	if rt.queue.waits(ex.r, model, d, qh) {
		var ok bool
		if cands, ok = ex.queued(d, cands, qh, int64(len(body))); !ok {
			return
		}
		ex.forward(body, cands)
		return
	}
	// Counted once the outcome is known: an admission has a candidate.
	rt.admission.Observe(model, d)
	if !d.Admit {
		rt.latency.reject(model)
		ex.code = rt.reject.RejectStatus(d)
		rt.reject.RejectModel(ex.w, model, rt.queueAhead(model), d)
		return
	}
	ex.forward(body, cands)
}

// forward sends an admitted request to one of cands and relays the answer.
func (ex *exchange) forward(body []byte, cands []events.WorkerEntry) {
	rt := ex.rt
	if rt.slots != nil {
		ex.prompt = parsePrompt(ex.route, body)
	}
	var mig *migration
	if ex.route == routeCompletions && rt.cfg.MigrationLimit > 0 {
		mig = newMigration(body)
	}
	dispatched := time.Now()
	up, err := ex.dispatch(body, cands, mig != nil, mig != nil, true)
	if err != nil {
		if errors.Is(err, ErrNoneAnswered) && ex.r.Context().Err() == nil && ex.busyLeft() {
			// Every worker the request could use failed (an engine just
			// killed is listed free until it goes stale) and the others
			// are busy: answer what the class gets once the dead ones are
			// stale, the rejection, not a 502 (docs/router.md).
			d := rt.unroutable(ex.model, ex.decision, ex.registered)
			rt.latency.reject(ex.model)
			ex.code = rt.reject.RejectStatus(d)
			rt.reject.RejectModel(ex.w, ex.model, rt.queueAhead(ex.model), d)
			return
		}
		ex.dispatchFailed(err)
		return
	}
	// Once answered, the request frees its slot: the rate of the retry
	// estimate (retryafter.go).
	defer rt.retry.Done(ex.model)
	if up.isEventStream() {
		ex.lat = rt.latency.begin(ex.model, up.worker.WorkerID, ex.class, dispatched)
		defer ex.lat.end()
		ex.stream(up, mig)
		return
	}
	ex.copyRaw(up)
}

// readBody reads the request body, answering 413 when it is larger than
// MaxBodyBytes.
func (ex *exchange) readBody() ([]byte, bool) {
	limit := ex.rt.cfg.MaxBodyBytes
	tooLarge := func() {
		ex.writeError(http.StatusRequestEntityTooLarge, typeInvalidRequest,
			fmt.Sprintf("request body larger than %d bytes", limit))
	}
	if ex.r.ContentLength > limit {
		tooLarge()
		return nil, false
	}
	body, err := io.ReadAll(http.MaxBytesReader(ex.w, ex.r.Body, limit))
	if err == nil {
		return body, true
	}
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
		tooLarge()
		return nil, false
	}
	// Before the context: net/http cancels it when a read of the body
	// times out, but the client is still there to be told.
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		ex.writeError(http.StatusRequestTimeout, typeInvalidRequest, "the request body did not arrive in time")
		return nil, false
	}
	if ex.r.Context().Err() != nil {
		ex.clientGone()
		return nil, false
	}
	ex.writeError(http.StatusBadRequest, typeInvalidRequest, "reading the request body: "+err.Error())
	return nil, false
}

// unroutable turns an admitted decision none of whose workers is
// registered into the rejection of contract §15: the shed rejection for a
// sheddable request a standard one would have got through (its registered
// workers are all amber), the all-busy one otherwise (the registered
// workers are all busy, or all hard for a critical request). Only a fresh
// record's decision can lack a candidate when workers are registered.
func (rt *Router) unroutable(model string, d admission.Decision, registered []events.WorkerEntry) admission.Decision {
	d.Admit, d.Reason = false, admission.ReasonAllBusy
	if d.Class == admission.ClassSheddable {
		var buf [8]events.WorkerEntry
		std := rt.cfg.BusyList.DecideClass(model, admission.ClassStandard)
		if len(std.Candidates(buf[:0], registered)) > 0 {
			d.Reason = admission.ReasonShed
		}
	}
	return d
}

// requestModel returns the body's top-level "model", or the message of a 400
// when the body is not a JSON object with a non-empty string model.
//
// The model is the last top-level key "model" exactly, as engines read it
// (admission.ModelValue); encoding/json would also take "Model" or "MODEL"
// and decide on another model than the one served.
func requestModel(body []byte) (model, msg string) {
	var obj struct{}
	if err := json.Unmarshal(body, &obj); err != nil {
		return "", "request body is not a JSON object: " + err.Error()
	}
	raw := admission.ModelValue(body)
	if len(raw) == 0 || string(raw) == "null" {
		return "", `request body has no "model"`
	}
	if raw[0] != '"' || json.Unmarshal(raw, &model) != nil {
		return "", `"model" must be a string`
	}
	// The name itself is never echoed here: it may be megabytes long.
	switch {
	case model == "":
		return "", `"model" is empty`
	case len(model) > events.MaxModelLen:
		return "", fmt.Sprintf(`"model" is %d bytes long: a model name is at most %d bytes`, len(model), events.MaxModelLen)
	case !utf8.Valid(raw):
		// json.Unmarshal turns invalid bytes into U+FFFD: check them raw.
		return "", `"model" is not valid UTF-8`
	}
	return model, ""
}

// writeError writes an error body, unless the response has started.
func (ex *exchange) writeError(status int, typ, msg string) {
	if ex.code != 0 {
		return
	}
	ex.code = status
	writeError(ex.w, status, typ, msg)
}

// clientGone counts the request as cancelled by its client, once.
func (ex *exchange) clientGone() {
	if ex.cancelled {
		return
	}
	ex.cancelled = true
	ex.rt.metrics.cancellations.WithLabelValues(ex.route).Inc()
	ex.rt.log.Debug("router: client went away; upstream request cancelled", "model", ex.model, "route", ex.route)
}

// write sends p to the client and flushes it; false means the client is
// gone.
func (ex *exchange) write(p []byte) bool {
	if _, err := ex.w.Write(p); err != nil {
		ex.clientGone()
		return false
	}
	if err := ex.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		ex.clientGone()
		return false
	}
	return true
}

// upstream is a worker's response being relayed.
type upstream struct {
	resp    *http.Response
	worker  events.WorkerEntry
	load    *atomic.Int64
	slot    *slot // nil when not tracked
	cancel  context.CancelCauseFunc
	release sync.Once
}

// close closes the response, cancels its request and gives back its load
// count and its slot; idempotent.
func (u *upstream) close() {
	u.release.Do(func() {
		_ = u.resp.Body.Close()
		u.cancel(nil)
		u.load.Add(-1)
		u.slot.release()
	})
}

// isEventStream reports whether the response is a successful, uncompressed
// server-sent event stream: those are relayed event by event.
func (u *upstream) isEventStream() bool {
	if u.resp.StatusCode != http.StatusOK {
		return false
	}
	ce := u.resp.Header.Get("Content-Encoding")
	if ce != "" && !strings.EqualFold(ce, "identity") {
		return false
	}
	ct := u.resp.Header.Get("Content-Type")
	mt, _, _ := strings.Cut(ct, ";")
	return strings.EqualFold(strings.TrimSpace(mt), "text/event-stream")
}

// dispatch sends body to one of cands and returns the first response, of
// whatever status. A worker that cannot be reached is added to ex.tried and
// another one tried, at most MaxRetries times; a failure on a reused
// connection (the engine may have closed it while idle) is first retried once
// on the same worker. identity asks the worker for an uncompressed response.
// With fallBack, once every candidate has failed, dispatch goes on once with
// the decision's next tier (nextTier). The error matches ErrNoneAnswered, ErrUpstreamTimeout, or the request
// context's error when the client went away.
func (ex *exchange) dispatch(body []byte, cands []events.WorkerEntry, identity, continuable, fallBack bool) (*upstream, error) {
	rt := ex.rt
	var lastErr error
	failures, sameRetried := 0, false
	var same *events.WorkerEntry
attempts:
	for failures <= rt.cfg.MaxRetries {
		var worker events.WorkerEntry
		switch {
		case same != nil:
			worker, same = *same, nil
		case ex.preferred != nil:
			// Chosen by the queue's dispatcher (contract §17).
			worker, ex.preferred = *ex.preferred, nil
		default:
			var ok bool
			if worker, ok = ex.pick(cands); !ok && fallBack {
				fallBack = false
				if cands = ex.nextTier(); len(cands) > 0 {
					worker, ok = ex.pick(cands)
				}
			}
			if !ok {
				break attempts
			}
		}
		if lastErr != nil {
			rt.metrics.retries.Inc()
		}
		up, reused, err := ex.send(worker, body, identity, continuable)
		if err == nil {
			return up, nil
		}
		if ctxErr := ex.r.Context().Err(); ctxErr != nil {
			return nil, ctxErr
		}
		if errors.Is(err, ErrUpstreamTimeout) {
			rt.metrics.upstream.WithLabelValues(upstreamTimeout).Inc()
			rt.upstreamLog.warn("router: worker did not answer in time", "model", ex.model,
				"worker", worker.WorkerID, "endpoint", worker.Endpoint, "timeout", rt.cfg.UpstreamTimeout)
			return nil, err
		}
		kind := upstreamConnect
		if errors.Is(err, errBadEndpoint) {
			kind = upstreamEndpoint
		}
		rt.metrics.upstream.WithLabelValues(kind).Inc()
		rt.upstreamLog.warn("router: worker unreachable", "model", ex.model, "worker", worker.WorkerID,
			"endpoint", worker.Endpoint, "reused_conn", reused, "err", err)
		lastErr = err
		if reused && !sameRetried {
			sameRetried = true
			same = &worker
			continue
		}
		ex.tried = append(ex.tried, worker.WorkerID)
		failures++
	}
	if lastErr == nil {
		lastErr = ErrNoCandidates
	}
	return nil, fmt.Errorf("%w: %w", ErrNoneAnswered, lastErr)
}

// nextTier returns the registered workers not tried yet that the
// request's decision allows once its first candidates have all failed:
// for a critical request, the busy workers that are not hard (contract
// §15: free, then busy minus hard); for any, the registered workers the
// record does not list busy (§7). Empty when there are none.
func (ex *exchange) nextTier() []events.WorkerEntry {
	return ex.decision.Candidates(nil, ex.untried())
}

// busyLeft reports whether a registered worker that was not tried is one
// the record lists busy for the request's class.
func (ex *exchange) busyLeft() bool {
	return slices.ContainsFunc(ex.untried(), func(e events.WorkerEntry) bool { return ex.decision.IsBusy(e.WorkerID) })
}

// untried returns the registered workers the request has not been sent to.
// Only a request whose candidates have all failed asks.
func (ex *exchange) untried() []events.WorkerEntry {
	return slices.DeleteFunc(slices.Clone(ex.registered), func(e events.WorkerEntry) bool { return slices.Contains(ex.tried, e.WorkerID) })
}

// pick chooses the worker of the next attempt among the candidates not
// tried: by the slot tracker's projection with Config.PickLeastPotential,
// else (or when the tracker knows none of them) by the power of two choices
// on requests in flight.
func (ex *exchange) pick(cands []events.WorkerEntry) (events.WorkerEntry, bool) {
	rt := ex.rt
	if rt.cfg.PickLeastPotential && rt.slots != nil {
		if w, ok := rt.slots.leastPotential(ex.model, cands, ex.tried, &ex.prompt, rt.loads.inFlight); ok {
			return w, true
		}
	}
	return rt.loads.pick(cands, ex.tried)
}

// dispatchFailed answers a request that reached no worker.
func (ex *exchange) dispatchFailed(err error) {
	switch {
	case ex.r.Context().Err() != nil:
		ex.clientGone()
	case errors.Is(err, ErrUpstreamTimeout):
		ex.writeError(http.StatusGatewayTimeout, typeUpstreamTimeout,
			fmt.Sprintf("the worker for model %.256q sent no response headers within %v", ex.model, ex.rt.cfg.UpstreamTimeout))
	default:
		ex.writeError(http.StatusBadGateway, typeUpstream,
			fmt.Sprintf("no worker for model %.256q could be reached: %v", ex.model, err))
	}
}

// errBadEndpoint: a registered endpoint is not an http(s) base URL.
var errBadEndpoint = errors.New("router: bad endpoint")

// send sends one request to worker. reused tells whether it went on a
// reused connection. The returned upstream holds a load count on the
// worker's endpoint until closed.
// continuable marks the request with X-Workermon-Migratable: 1 (contract
// §12): the router can continue its stream elsewhere, so the engine may cut
// it when the rescheduler asks.
func (ex *exchange) send(worker events.WorkerEntry, body []byte, identity, continuable bool) (_ *upstream, reused bool, _ error) {
	rt := ex.rt
	target, err := upstreamURL(worker.Endpoint, ex.r.URL)
	if err != nil {
		return nil, false, err
	}
	ctx, cancel := context.WithCancelCause(ex.r.Context())
	var reusedConn atomic.Bool
	trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reusedConn.Store(i.Reused) }}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		cancel(nil)
		return nil, false, fmt.Errorf("%w: %q: %w", errBadEndpoint, worker.Endpoint, err)
	}
	copyRequestHeader(req.Header, ex.r)
	if identity {
		req.Header.Set("Accept-Encoding", "identity")
	}
	if continuable {
		req.Header.Set(events.MigratableHeader, "1")
	}
	load := rt.loads.counter(worker.Endpoint)
	load.Add(1)
	sl := rt.slots.add(ex.model, worker, &ex.prompt)
	timer := time.AfterFunc(rt.cfg.UpstreamTimeout, func() { cancel(ErrUpstreamTimeout) })
	resp, err := rt.transport.RoundTrip(req)
	if !timer.Stop() && err == nil {
		// The timeout fired as the headers arrived: the body is cancelled.
		_ = resp.Body.Close()
		err = ErrUpstreamTimeout
	}
	if err != nil {
		load.Add(-1)
		sl.release()
		timedOut := errors.Is(context.Cause(ctx), ErrUpstreamTimeout)
		cancel(nil)
		if timedOut {
			return nil, false, ErrUpstreamTimeout
		}
		return nil, reusedConn.Load(), fmt.Errorf("router: send to worker %d at %s: %w", worker.WorkerID, worker.Endpoint, err)
	}
	if sl != nil {
		resp.Body = &firstRead{ReadCloser: resp.Body, slot: sl}
	}
	return &upstream{resp: resp, worker: worker, load: load, slot: sl, cancel: cancel}, reusedConn.Load(), nil
}

// upstreamURL joins a worker's base URL (without /v1) and the request's
// path and query.
func upstreamURL(endpoint string, in *url.URL) (string, error) {
	u, err := url.Parse(endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%w: %q is not an http(s) base URL", errBadEndpoint, endpoint)
	}
	u.Path = strings.TrimRight(u.Path, "/") + in.Path
	u.RawPath = ""
	u.RawQuery = in.RawQuery
	u.Fragment = ""
	return u.String(), nil
}

// hopHeaders are the hop-by-hop headers a proxy does not forward (RFC 9110
// §7.6.1), and the ones it sets itself.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// removeHopHeaders deletes the hop-by-hop headers of h, and those its
// Connection header names.
func removeHopHeaders(h http.Header) {
	for _, f := range h["Connection"] {
		for name := range strings.SplitSeq(f, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, name := range hopHeaders {
		h.Del(name)
	}
}

// copyRequestHeader copies the client's headers to an upstream request,
// without the hop-by-hop ones, and adds X-Forwarded-For, -Host and -Proto.
func copyRequestHeader(dst http.Header, r *http.Request) {
	for k, vv := range r.Header {
		dst[k] = slices.Clone(vv)
	}
	removeHopHeaders(dst)
	dst.Del("Expect")
	dst.Del("Content-Length")
	// Only the router says whether it can continue a stream.
	dst.Del(events.MigratableHeader)
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if prior := dst.Values("X-Forwarded-For"); len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		dst.Set("X-Forwarded-For", ip)
	}
	if dst.Get("X-Forwarded-Host") == "" && r.Host != "" {
		dst.Set("X-Forwarded-Host", r.Host)
	}
	if dst.Get("X-Forwarded-Proto") == "" {
		proto := "http"
		if r.TLS != nil {
			proto = "https"
		}
		dst.Set("X-Forwarded-Proto", proto)
	}
}

// copyResponseHeader copies a worker's response headers to the client's,
// without the hop-by-hop ones.
func copyResponseHeader(dst, src http.Header) {
	for k, vv := range src {
		dst[k] = slices.Clone(vv)
	}
	removeHopHeaders(dst)
}

// copyRaw relays a response that is not an event stream as it arrives: one
// write and one flush per read. A body cut by the worker aborts the client's
// response, so the client sees it incomplete rather than ended.
func (ex *exchange) copyRaw(up *upstream) {
	defer up.close()
	copyResponseHeader(ex.w.Header(), up.resp.Header)
	ex.code = up.resp.StatusCode
	ex.w.WriteHeader(up.resp.StatusCode)
	bp := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(bp)
	buf := *bp
	for {
		n, err := up.resp.Body.Read(buf)
		if n > 0 && !ex.write(buf[:n]) {
			return
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, io.EOF):
			return
		case ex.r.Context().Err() != nil:
			ex.clientGone()
			return
		}
		ex.rt.metrics.upstream.WithLabelValues(upstreamStream).Inc()
		ex.rt.streamLog.warn("router: worker's response cut", "model", ex.model, "worker", up.worker.WorkerID,
			"endpoint", up.worker.Endpoint, "err", err)
		up.close()
		panic(http.ErrAbortHandler)
	}
}

var copyBuffers = sync.Pool{New: func() any {
	b := make([]byte, copyBufferSize)
	return &b
}}
