package admission

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Defaults of the Middleware.
const (
	// DefaultRejectStatus is the status of a rejected request (contract §7);
	// WithRejectStatus allows 429 and 529 instead.
	DefaultRejectStatus = http.StatusServiceUnavailable
	// DefaultRetryAfter is the Retry-After of a rejected request.
	DefaultRetryAfter = time.Second
	// DefaultModelHeader is the request header DefaultModelFunc reads the
	// model from first.
	DefaultModelHeader = "X-Workermon-Model"
	// DefaultModelPeekLimit is how much of a JSON body DefaultModelFunc reads,
	// at most, looking for its top-level "model" field.
	DefaultModelPeekLimit = 1 << 20
)

// admitStatusSiteOverloaded is the unofficial 529 some APIs answer when
// overloaded.
const admitStatusSiteOverloaded = 529

// admitRejectMessage is the message of the rejection body (contract §7).
const admitRejectMessage = "Service temporarily unavailable: All workers are busy, please retry later"

// RejectType is the type of the rejection body.
const RejectType = "service_unavailable"

// RejectBody returns the body of a rejection with the given status (contract
// §7): ErrorBody(status, "service_unavailable", "Service temporarily
// unavailable: All workers are busy, please retry later").
func RejectBody(status int) []byte {
	return ErrorBody(status, RejectType, admitRejectMessage)
}

// ShedBody returns the body of the rejection of a sheddable request
// (contract §15): ErrorBody(status, "service_unavailable", ShedMessage).
func ShedBody(status int) []byte {
	return ErrorBody(status, RejectType, ShedMessage)
}

// Decider takes the admission decision for a model, for a standard request
// (priority 0); *busylist.Watcher is one. See ClassDecider for the other
// classes.
type Decider interface {
	Decide(model string) Decision
}

// ModelFunc returns the model a request is for, or "" when it names none:
// such a request is let through (and counted as no_model). A ModelFunc that
// reads the body must leave the body complete for the next handler.
type ModelFunc func(r *http.Request) string

// ModelFromHeader reads the model from a request header.
func ModelFromHeader(name string) ModelFunc {
	name = http.CanonicalHeaderKey(name)
	return func(r *http.Request) string { return r.Header.Get(name) }
}

// ModelFromJSONBody reads the top-level "model" string of a JSON body (an
// OpenAI-style request); of several, the last, as engines decode it. It reads at most limit bytes (DefaultModelPeekLimit
// when limit ≤ 0) and puts them back in front of the rest of the body, so the
// next handler reads the whole body unchanged. A body whose Content-Type is
// set and not JSON is not read. A model field beyond the limit, or after a
// syntax error, is not found: the request names no model and goes through.
func ModelFromJSONBody(limit int64) ModelFunc {
	if limit <= 0 {
		limit = DefaultModelPeekLimit
	}
	return func(r *http.Request) string {
		if r.Body == nil || r.Body == http.NoBody {
			return ""
		}
		if ct := r.Header.Get("Content-Type"); ct != "" && !strings.Contains(strings.ToLower(ct), "json") {
			return ""
		}
		buf, err := io.ReadAll(io.LimitReader(r.Body, limit))
		r.Body = admitPeekedBody{Reader: io.MultiReader(bytes.NewReader(buf), r.Body), Closer: r.Body}
		if err != nil {
			return ""
		}
		return admitJSONModel(buf)
	}
}

// admitPeekedBody is a request body with its first bytes read and put back.
type admitPeekedBody struct {
	io.Reader
	io.Closer
}

// ModelValue returns the value of the last top-level "model" key of a JSON
// object, or of a prefix of one, as it is in buf (a string still quoted, or
// any other value); nil when there is none. Of a key given more than once
// the last counts, and only the key "model" itself (no other case), as in
// Python's json, which engines decode the body with:
// {"model":"free","model":"busy"} and {"model":"busy","Model":"free"} are
// both served as "busy". In a prefix, or before a syntax error, the last
// one before it counts. It scans buf itself and allocates nothing (but for
// keys with escapes): the values it skips are not checked further than
// their extent, so a caller that needs a valid body checks it apart.
func ModelValue(buf []byte) []byte {
	i := admitSpace(buf, 0)
	if i >= len(buf) || buf[i] != '{' {
		return nil
	}
	var model []byte // the last "model" value, as it is in buf
	for i = admitSpace(buf, i+1); i < len(buf) && buf[i] == '"'; i = admitSpace(buf, i+1) {
		end, ok := admitStringEnd(buf, i)
		if !ok {
			break
		}
		key := buf[i:end]
		if i = admitSpace(buf, end); i >= len(buf) || buf[i] != ':' {
			break
		}
		i = admitSpace(buf, i+1)
		if end, ok = admitValueEnd(buf, i); !ok {
			break
		}
		if admitIsModelKey(key) {
			model = buf[i:end]
		}
		if i = admitSpace(buf, end); i >= len(buf) || buf[i] != ',' {
			break
		}
	}
	return model
}

// admitJSONModel finds the top-level "model" string in a JSON object, or a
// prefix of one (ModelValue), allocating only the model it returns (and
// when a key or the model has escapes).
func admitJSONModel(buf []byte) string {
	model := ModelValue(buf)
	if len(model) < 2 || model[0] != '"' {
		return ""
	}
	if inner := model[1 : len(model)-1]; bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		return string(inner)
	}
	var s string
	if json.Unmarshal(model, &s) != nil {
		return ""
	}
	return s
}

// admitIsModelKey reports whether the string token key is "model".
func admitIsModelKey(key []byte) bool {
	if string(key) == `"model"` {
		return true
	}
	if bytes.IndexByte(key, '\\') < 0 {
		return false
	}
	var k string
	return json.Unmarshal(key, &k) == nil && k == "model"
}

// admitSpace returns the index of the first byte from i that is not JSON
// white space.
func admitSpace(buf []byte, i int) int {
	for i < len(buf) && (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\n' || buf[i] == '\r') {
		i++
	}
	return i
}

// admitStringEnd returns the index after the string that starts at buf[i]
// (a quote); false when buf ends first.
func admitStringEnd(buf []byte, i int) (int, bool) {
	for j := i + 1; ; {
		k := bytes.IndexByte(buf[j:], '"')
		if k < 0 {
			return 0, false
		}
		j += k
		n := 0 // backslashes before the quote
		for n < j-i-1 && buf[j-1-n] == '\\' {
			n++
		}
		j++
		if n%2 == 0 {
			return j, true
		}
	}
}

// admitValueEnd returns the index after the value that starts at buf[i];
// false when buf ends first or no value starts there.
func admitValueEnd(buf []byte, i int) (int, bool) {
	if i >= len(buf) {
		return 0, false
	}
	switch buf[i] {
	case '"':
		return admitStringEnd(buf, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(buf); {
			switch buf[j] {
			case '"':
				end, ok := admitStringEnd(buf, j)
				if !ok {
					return 0, false
				}
				j = end
				continue
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1, true
				}
			}
			j++
		}
		return 0, false
	case ',', ':', '}', ']':
		return 0, false
	}
	// A number or a literal: it ends at a delimiter, which a prefix may
	// not have reached.
	for j := i; j < len(buf); j++ {
		switch buf[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return j, true
		}
	}
	return 0, false
}

// DefaultModelFunc reads the model from the DefaultModelHeader header, and
// when it is absent from the JSON body (ModelFromJSONBody with
// DefaultModelPeekLimit).
func DefaultModelFunc() ModelFunc {
	header := ModelFromHeader(DefaultModelHeader)
	body := ModelFromJSONBody(DefaultModelPeekLimit)
	return func(r *http.Request) string {
		if m := header(r); m != "" {
			return m
		}
		return body(r)
	}
}

// MiddlewareOption configures a Middleware.
type MiddlewareOption func(*middlewareOptions) error

type middlewareOptions struct {
	status     int
	shedStatus int
	retryAfter time.Duration
	model      ModelFunc
	metrics    *Metrics
}

// WithRejectStatus sets the status of a rejection: 503 (the default), 429 or
// 529. The body's code follows it.
func WithRejectStatus(status int) MiddlewareOption {
	return func(o *middlewareOptions) error {
		switch status {
		case http.StatusServiceUnavailable, http.StatusTooManyRequests, admitStatusSiteOverloaded:
			o.status = status
			return nil
		}
		return fmt.Errorf("%w: reject status %d is not 503, 429 or 529", ErrInvalidOption, status)
	}
}

// WithShedStatus sets the status of the rejection of a sheddable request
// that a standard one would have got through (contract §15): 429 (the
// default), 503 or 529. The body's code follows it.
func WithShedStatus(status int) MiddlewareOption {
	return func(o *middlewareOptions) error {
		switch status {
		case http.StatusServiceUnavailable, http.StatusTooManyRequests, admitStatusSiteOverloaded:
			o.shedStatus = status
			return nil
		}
		return fmt.Errorf("%w: shed status %d is not 429, 503 or 529", ErrInvalidOption, status)
	}
}

// WithRetryAfter sets the floor of the wait a rejection asks for (default
// DefaultRetryAfter): its retry-after-ms and Retry-After come from an
// estimate of when the model has a free slot again (RetryEstimator), never
// below d. It must be positive.
func WithRetryAfter(d time.Duration) MiddlewareOption {
	return func(o *middlewareOptions) error {
		if d <= 0 {
			return fmt.Errorf("%w: retry-after %v is not positive", ErrInvalidOption, d)
		}
		o.retryAfter = d
		return nil
	}
}

// WithModelFunc sets how the model is found in a request (default
// DefaultModelFunc()).
func WithModelFunc(f ModelFunc) MiddlewareOption {
	return func(o *middlewareOptions) error {
		if f == nil {
			return fmt.Errorf("%w: nil ModelFunc", ErrInvalidOption)
		}
		o.model = f
		return nil
	}
}

// WithMetrics counts the decisions in m (default: not counted).
func WithMetrics(m *Metrics) MiddlewareOption {
	return func(o *middlewareOptions) error {
		o.metrics = m
		return nil
	}
}

// Middleware applies the admission decision to HTTP requests, in front of a
// handler of a Go router or reverse proxy (see Wrap).
type Middleware struct {
	d       Decider
	cd      ClassDecider // d, when it decides by class; nil otherwise
	model   ModelFunc
	metrics *Metrics

	// The rejections, computed once: all busy (§7) and shed (§15).
	busy, shed  rejection
	contentType []string
	retry       *RetryEstimator
}

// rejection is one rejection's status and body.
type rejection struct {
	status        int
	body          []byte
	contentLength []string
}

func newRejection(status int, body []byte) rejection {
	// Full slice expression: a later Header.Add must not write into the
	// shared array.
	return rejection{status: status, body: body, contentLength: []string{strconv.Itoa(len(body))}[:1:1]}
}

// NewMiddleware returns a Middleware asking d, usually a *Watcher.
func NewMiddleware(d Decider, opts ...MiddlewareOption) (*Middleware, error) {
	o := middlewareOptions{status: DefaultRejectStatus, shedStatus: DefaultShedStatus, retryAfter: DefaultRetryAfter}
	var errs []error
	if d == nil {
		errs = append(errs, fmt.Errorf("%w: nil Decider", ErrInvalidOption))
	}
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&o); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("admission: new middleware: %w", errors.Join(errs...))
	}
	if o.model == nil {
		o.model = DefaultModelFunc()
	}
	retry, err := NewRetryEstimator(o.retryAfter)
	if err != nil {
		return nil, fmt.Errorf("admission: new middleware: %w", err)
	}
	cd, _ := d.(ClassDecider)
	return &Middleware{
		d:       d,
		cd:      cd,
		model:   o.model,
		metrics: o.metrics,
		busy:    newRejection(o.status, RejectBody(o.status)),
		shed:    newRejection(o.shedStatus, ShedBody(o.shedStatus)),
		// Full slice expressions: a later Header.Add must not write into
		// the shared arrays.
		contentType: []string{"application/json"}[:1:1],
		retry:       retry,
	}, nil
}

// Estimator returns the estimate of when a model has a free slot again
// that the rejections' retry headers come from. A router that answers
// rejections of its own (a queue's) sets their headers from it, and tells
// it when a request it let through ends (RetryEstimator.Done).
func (m *Middleware) Estimator() *RetryEstimator { return m.retry }

// DecideClass takes the decision for a request of class c: the Decider's
// DecideClass when it has one, else its Decide (every class treated as
// standard).
func (m *Middleware) DecideClass(model string, c Class) Decision {
	if m.cd != nil {
		return m.cd.DecideClass(model, c)
	}
	d := m.d.Decide(model)
	d.Class = c
	return d
}

// Wrap returns a handler that finds the request's model and priority class
// (PriorityHeader, contract §15), asks the Decider and either rejects the
// request (see RejectDecision) or passes it to next. A request that names no
// model goes to next; one that names a model with a priority that is not an
// integer is answered 400 (BadPriority). Decisions are counted when the
// Middleware has Metrics.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		model := m.model(r)
		if model == "" {
			if m.metrics != nil {
				m.metrics.ObserveNoModel()
			}
			next.ServeHTTP(w, r)
			return
		}
		class, err := ClassFromRequest(r)
		if err != nil {
			BadPriority(w, err)
			return
		}
		d := m.DecideClass(model, class)
		if m.metrics != nil {
			m.metrics.Observe(model, d)
		}
		if !d.Admit {
			m.RejectModel(w, model, 0, d)
			return
		}
		next.ServeHTTP(w, r)
		if d.Reason == ReasonFree {
			// A request of a model with a record has ended: a slot is
			// free again (the estimate of the retry headers).
			m.retry.Done(model)
		}
	})
}

// Reject writes the all-busy rejection (contract §7): the configured
// status, Content-Type application/json, retry-after-ms and Retry-After
// (whole seconds, at least 1; contract §23), and RejectBody(status). The
// wait is estimated over every model; RejectModel estimates it for the
// request's.
func (m *Middleware) Reject(w http.ResponseWriter) { m.write(w, &m.busy, "", 0) }

// RejectDecision writes the rejection of d: for ReasonShed the shed status
// with ShedBody (contract §15), else the all-busy rejection (Reject). Both
// carry retry-after-ms and Retry-After, estimated over every model.
func (m *Middleware) RejectDecision(w http.ResponseWriter, d Decision) { m.RejectModel(w, "", 0, d) }

// RejectModel writes the rejection of d (RejectDecision) for a request of
// model with ahead requests waiting before it in the router's queue (0
// without one): its retry-after-ms and Retry-After tell when the model
// should have a free slot for it (RetryEstimator). It allocates nothing
// once the model has been seen.
func (m *Middleware) RejectModel(w http.ResponseWriter, model string, ahead int, d Decision) {
	if d.Reason == ReasonShed {
		m.write(w, &m.shed, model, ahead)
		return
	}
	m.write(w, &m.busy, model, ahead)
}

// RejectStatus returns the status RejectDecision writes for d.
func (m *Middleware) RejectStatus(d Decision) int {
	if d.Reason == ReasonShed {
		return m.shed.status
	}
	return m.busy.status
}

func (m *Middleware) write(w http.ResponseWriter, rj *rejection, model string, ahead int) {
	h := w.Header()
	h["Content-Type"] = m.contentType
	m.retry.Set(h, model, ahead)
	h["Content-Length"] = rj.contentLength
	w.WriteHeader(rj.status)
	_, _ = w.Write(rj.body)
}

// BadPriorityMessage is the message of the 400 answering err from
// ParsePriority, e.g. `X-Workermon-Priority "high" is not an integer
// (higher is more important; default 0)`.
func BadPriorityMessage(err error) string {
	msg := err.Error()
	if errors.Is(err, ErrInvalidPriority) {
		msg = strings.TrimPrefix(msg, ErrInvalidPriority.Error()+": ")
	}
	return msg + " (higher is more important; default 0)"
}

// BadPriority answers 400 for a request whose priority header is not an
// integer, with the routers' error body (type invalid_request_error) naming
// the problem.
func BadPriority(w http.ResponseWriter, err error) {
	body := ErrorBody(http.StatusBadRequest, "invalid_request_error", BadPriorityMessage(err))
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusBadRequest)
	_, _ = w.Write(body)
}
