package busylist

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

// RejectBody returns the body of a rejection with the given status:
// {"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":<status>}.
func RejectBody(status int) []byte {
	return []byte(`{"message":"` + admitRejectMessage + `","type":"service_unavailable","code":` +
		strconv.Itoa(status) + `}`)
}

// Decider takes the admission decision for a model; *Watcher is one.
type Decider interface {
	Decide(model string) Decision
}

var _ Decider = (*Watcher)(nil)

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
// OpenAI-style request). It reads at most limit bytes (DefaultModelPeekLimit
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

// admitJSONModel finds the top-level "model" string in a JSON object, or a
// prefix of one.
func admitJSONModel(buf []byte) string {
	dec := json.NewDecoder(bytes.NewReader(buf))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return ""
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return ""
		}
		if key, _ := t.(string); key == "model" {
			t, err := dec.Token()
			if s, ok := t.(string); ok && err == nil {
				return s
			}
			return ""
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return ""
		}
	}
	return ""
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
	retryAfter time.Duration
	model      ModelFunc
	metrics    *AdmissionMetrics
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

// WithRetryAfter sets the Retry-After of a rejection, rounded up to whole
// seconds (default DefaultRetryAfter). It must be positive.
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

// WithAdmissionMetrics counts the decisions in m (default: not counted).
func WithAdmissionMetrics(m *AdmissionMetrics) MiddlewareOption {
	return func(o *middlewareOptions) error {
		o.metrics = m
		return nil
	}
}

// Middleware applies the admission decision to HTTP requests, in front of a
// handler of a Go router or reverse proxy (see Wrap).
type Middleware struct {
	d       Decider
	model   ModelFunc
	status  int
	metrics *AdmissionMetrics

	// The rejection, computed once.
	body          []byte
	contentType   []string
	retryAfter    []string
	contentLength []string
}

// NewMiddleware returns a Middleware asking d, usually a *Watcher.
func NewMiddleware(d Decider, opts ...MiddlewareOption) (*Middleware, error) {
	o := middlewareOptions{status: DefaultRejectStatus, retryAfter: DefaultRetryAfter}
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
		return nil, fmt.Errorf("busylist: new middleware: %w", errors.Join(errs...))
	}
	if o.model == nil {
		o.model = DefaultModelFunc()
	}
	secs := int64((o.retryAfter + time.Second - 1) / time.Second)
	body := RejectBody(o.status)
	return &Middleware{
		d:       d,
		model:   o.model,
		status:  o.status,
		metrics: o.metrics,
		body:    body,
		// Full slice expressions: a later Header.Add must not write into
		// the shared arrays.
		contentType:   []string{"application/json"}[:1:1],
		retryAfter:    []string{strconv.FormatInt(max(secs, 1), 10)}[:1:1],
		contentLength: []string{strconv.Itoa(len(body))}[:1:1],
	}, nil
}

// Wrap returns a handler that finds the request's model, asks the Decider
// and either rejects the request (see Reject) or passes it to next. A request
// that names no model goes to next. Decisions are counted when the Middleware
// has AdmissionMetrics.
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
		d := m.d.Decide(model)
		if m.metrics != nil {
			m.metrics.Observe(model, d)
		}
		if !d.Admit {
			m.Reject(w)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Reject writes the rejection: the configured status, Content-Type
// application/json, Retry-After in whole seconds (at least 1), and
// RejectBody(status).
func (m *Middleware) Reject(w http.ResponseWriter) {
	h := w.Header()
	h["Content-Type"] = m.contentType
	h["Retry-After"] = m.retryAfter
	h["Content-Length"] = m.contentLength
	w.WriteHeader(m.status)
	_, _ = w.Write(m.body)
}
