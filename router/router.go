// Package router is workermon's gateway: an HTTP reverse proxy in front of
// OpenAI-compatible engines that admits, rejects and routes every request
// with the busy list (contract §7, §7c).
//
// For POST /v1/completions and POST /v1/chat/completions a Router reads the
// model from the JSON body, asks the busy list (a busylist.Watcher) for the
// decision, and either rejects the request (the §7 rejection) or forwards it
// to one of the model's registered workers (a registry.Watcher) that the
// decision allows: the free ones, else the ones not listed as busy. Among
// those it picks by the power of two choices on its own count of requests in
// flight per endpoint. The answer is streamed back as it arrives, one write
// and one flush per read (per event for server-sent events).
//
// A worker that cannot be reached (a transport error before the response
// headers) is retried on another one. With a migration limit above 0, a
// streamed completion of one string prompt that an engine cuts mid-way
// continues on another worker from the text already produced. A client that
// goes away cancels the upstream request at once.
//
// The Router also answers GET /v1/models, /healthz and /readyz; /metrics is
// left to the process (cmd/workermon), which owns the registry.
package router

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/registry"
	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsapi"
)

// Defaults of a Config.
const (
	// DefaultRejectStatus is the status of a rejected request (503; 429 and
	// 529 are allowed).
	DefaultRejectStatus = admission.DefaultRejectStatus
	// DefaultRetryAfter is the Retry-After of a rejection and of a "no
	// workers available" answer, rounded up to whole seconds.
	DefaultRetryAfter = admission.DefaultRetryAfter
	// DefaultMaxBodyBytes is the largest request body read; a larger one gets
	// 413.
	DefaultMaxBodyBytes = 4 << 20
	// DefaultUpstreamTimeout bounds the wait for a worker's response headers.
	// An engine sends the headers of a non-streamed completion only when the
	// whole completion is done, so this also bounds non-streamed generations.
	DefaultUpstreamTimeout = 10 * time.Minute
	// DefaultConnectTimeout bounds the TCP connection to a worker; a worker
	// that does not accept within it is retried on another.
	DefaultConnectTimeout = 2 * time.Second
	// DefaultMaxRetries is how many other workers are tried after the first
	// one could not be reached.
	DefaultMaxRetries = 3
	// DefaultMigrationLimit is how many times a cut stream may continue on
	// another worker: 0, migration is off.
	DefaultMigrationLimit = 0
)

const (
	// maxEventBytes is the largest server-sent event forwarded; a larger one
	// ends the stream as cut.
	maxEventBytes = 1 << 20
	// copyBufferSize is the read size of a pass-through copy.
	copyBufferSize = 32 << 10
	// maxIdleConnsPerHost keeps connections to each engine for reuse: many
	// concurrent streams go to the same few engines.
	maxIdleConnsPerHost = 256
	// idleConnTimeout is how long an idle connection to an engine is kept.
	idleConnTimeout = 30 * time.Second
	// maxMigrationAttempts bounds the workers tried for one continuation.
	maxMigrationAttempts = 4
)

// Sentinel errors of the package.
var (
	// ErrInvalidConfig is wrapped by Validate and New for every problem of a
	// Config.
	ErrInvalidConfig = errors.New("router: invalid config")
	// ErrNoneAnswered: no candidate worker could be reached.
	ErrNoneAnswered = errors.New("router: no worker answered")
	// ErrUpstreamTimeout: a worker did not send its response headers within
	// the upstream timeout.
	ErrUpstreamTimeout = errors.New("router: timeout awaiting response headers")
	// ErrNoCandidates: the decision left no registered worker to try.
	ErrNoCandidates = errors.New("router: no workers available")
)

// BusyList is what the Router needs of the busy list; *busylist.Watcher is
// one.
type BusyList interface {
	// Decide applies the router contract (§7) to a request for model.
	Decide(model string) admission.Decision
	// DecideClass applies it to a request of priority class c (§15).
	DecideClass(model string, c admission.Class) admission.Decision
	// Models returns the models that have a record.
	Models() []string
	// Ready reports whether the initial values are loaded.
	Ready() bool
}

// Registry is what the Router needs of the worker registry;
// *registry.Watcher is one.
type Registry interface {
	// Endpoints returns the model's registered workers, sorted by id; read
	// only.
	Endpoints(model string) []events.WorkerEntry
	// Models returns the models with at least one registered worker.
	Models() []string
	// Ready reports whether the initial values are loaded.
	Ready() bool
	// Live reports whether the registry is being read now (its watch is
	// current); while it is not, a model without workers may have some.
	Live() bool
}

var (
	_ BusyList     = (*busylist.Watcher)(nil)
	_ Registry     = (*registry.Watcher)(nil)
	_ http.Handler = (*Router)(nil)
)

// Config configures a Router. Whether a stale list admits (fail open) and
// when a list turns stale are the BusyList's settings
// (busylist.WithFailOpen, busylist.WithStaleListAfter).
type Config struct {
	// BusyList takes the admission decisions. Required.
	BusyList BusyList
	// Registry maps workers to endpoints. Required.
	Registry Registry

	// RejectStatus is the status of a rejection: 503, 429 or 529.
	RejectStatus int
	// ShedStatus is the status of the rejection of a sheddable request
	// that a standard one would have got through (contract §15): 429, 503
	// or 529.
	ShedStatus int
	// RetryAfter is the floor of the wait a rejection asks for in its
	// retry-after-ms and Retry-After, estimated from when the model frees
	// a slot (contract §23, retryafter.go); positive.
	RetryAfter time.Duration
	// MaxBodyBytes is the largest request body read, and the most text a
	// migratable stream keeps for its continuation; positive.
	MaxBodyBytes int64
	// UpstreamTimeout bounds the wait for a worker's response headers;
	// positive.
	UpstreamTimeout time.Duration
	// ConnectTimeout bounds the connection to a worker; positive. Not used
	// with a Transport of the caller's.
	ConnectTimeout time.Duration
	// MaxRetries is how many other workers are tried after one could not be
	// reached; 0 or more.
	MaxRetries int
	// MigrationLimit is how many times a cut streamed completion continues
	// on another worker; 0 (off) or more.
	MigrationLimit int
	// RouterID names this router in its logs and in the ids of the
	// requests it tracks.
	RouterID string
	// Slots, when set, tracks every request sent to a worker (contract §11;
	// see slots.go), and the Router serves GET /loads and POST
	// /potential_loads from it (another method: 405, as slotsapi answers). Its workers are registered by the caller
	// (slotsnats.Sync); a request for a worker it does not know is not
	// tracked.
	Slots *slots.Tracker
	// PickLeastPotential picks the worker whose least loaded rank the
	// tracker projects lowest with the request (prefill tokens over the
	// block size, plus blocks), instead of the power of two choices on
	// requests in flight. Needs Slots.
	PickLeastPotential bool

	// QueueMaxWait is how long a request whose class has no candidate
	// waits in its model's queue (contract §17); 0, flow control is off.
	QueueMaxWait time.Duration
	// QueueMaxRequests is how many requests a model's queue holds;
	// positive.
	QueueMaxRequests int
	// QueueMaxBytes is how many bytes of request bodies the queues of all
	// models hold together; at least MaxBodyBytes. Past either limit a
	// newcomer pushes out what flow.Queue.Join allows, or is turned away.
	QueueMaxBytes int64
	// QueuePace is the pace of dispatch from the queue: this router hands
	// a free worker at most one queued request per QueuePace × max(1, the
	// record's routers); positive.
	QueuePace time.Duration

	// Transport sends the requests to the workers (nil: a Transport of the
	// Router's own, with ConnectTimeout and no compression).
	Transport http.RoundTripper
	// ReadyCheck, when set, is one more condition of /readyz (the NATS
	// connection): a non-nil error makes the router not ready.
	ReadyCheck func() error
	// Logger receives the router's logs (nil: discard).
	Logger *slog.Logger
	// Registerer receives the router's metrics (nil: not registered).
	// Collectors already registered there are shared.
	Registerer prometheus.Registerer
}

// DefaultConfig returns a Config with every default set; BusyList and
// Registry are left for the caller.
func DefaultConfig() Config {
	return Config{
		RejectStatus:    DefaultRejectStatus,
		ShedStatus:      admission.DefaultShedStatus,
		RetryAfter:      DefaultRetryAfter,
		MaxBodyBytes:    DefaultMaxBodyBytes,
		UpstreamTimeout: DefaultUpstreamTimeout,
		ConnectTimeout:  DefaultConnectTimeout,
		MaxRetries:      DefaultMaxRetries,
		MigrationLimit:  DefaultMigrationLimit,

		QueueMaxWait:     DefaultQueueMaxWait,
		QueueMaxRequests: DefaultQueueMaxRequests,
		QueueMaxBytes:    DefaultQueueMaxBytes,
		QueuePace:        DefaultQueuePace,
	}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...))
	}
	if c.BusyList == nil {
		bad("nil BusyList")
	}
	if c.Registry == nil {
		bad("nil Registry")
	}
	if !slices.Contains([]int{http.StatusServiceUnavailable, http.StatusTooManyRequests, 529}, c.RejectStatus) {
		bad("reject status %d is not 503, 429 or 529", c.RejectStatus)
	}
	if !slices.Contains([]int{http.StatusServiceUnavailable, http.StatusTooManyRequests, 529}, c.ShedStatus) {
		bad("shed status %d is not 429, 503 or 529", c.ShedStatus)
	}
	if c.RetryAfter <= 0 {
		bad("retry-after %v is not positive", c.RetryAfter)
	}
	if c.MaxBodyBytes <= 0 {
		bad("max body bytes %d is not positive", c.MaxBodyBytes)
	}
	if c.UpstreamTimeout <= 0 {
		bad("upstream timeout %v is not positive", c.UpstreamTimeout)
	}
	if c.ConnectTimeout <= 0 {
		bad("connect timeout %v is not positive", c.ConnectTimeout)
	}
	if c.MaxRetries < 0 {
		bad("max retries %d is negative", c.MaxRetries)
	}
	if c.MigrationLimit < 0 {
		bad("migration limit %d is negative", c.MigrationLimit)
	}
	if c.QueueMaxWait < 0 {
		bad("queue max wait %v is negative", c.QueueMaxWait)
	}
	if c.QueueMaxWait > 0 && c.QueueMaxRequests <= 0 {
		bad("queue max requests %d is not positive", c.QueueMaxRequests)
	}
	if c.QueueMaxWait > 0 && c.QueueMaxBytes < c.MaxBodyBytes {
		bad("queue max bytes %d is less than max body bytes %d: the largest request could never wait", c.QueueMaxBytes, c.MaxBodyBytes)
	}
	if c.QueueMaxWait > 0 && c.QueuePace <= 0 {
		bad("queue pace %v is not positive", c.QueuePace)
	}
	return errors.Join(errs...)
}

// Router is the gateway; it is an http.Handler. Build it with New.
type Router struct {
	cfg       Config
	log       *slog.Logger
	transport http.RoundTripper
	own       *http.Transport // the Router's own transport, closed by Close
	reject    *admission.Middleware
	admission *admission.Metrics
	metrics   *metrics
	loads     loads
	slots     *slotTracker // nil without Config.Slots
	queue     *queues      // nil with flow control off
	latency   latencyBook  // latency windows (contract §18), published by RunLatency
	mux       *http.ServeMux

	retry                  *admission.RetryEstimator // the retry headers of the rejections (retryafter.go)
	upstreamLog, streamLog rateLog
	registryLog            rateLog // a model without workers while the registry cannot be read
}

// New returns a Router, or the problems of cfg.
func New(cfg Config) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("router: new: %w", err)
	}
	rt := &Router{cfg: cfg, log: cfg.Logger, transport: cfg.Transport}
	if rt.log == nil {
		rt.log = slog.New(slog.DiscardHandler)
	}
	if cfg.RouterID != "" {
		rt.log = rt.log.With("router_id", cfg.RouterID)
	}
	var err error
	if rt.reject, err = admission.NewMiddleware(cfg.BusyList, admission.WithRejectStatus(cfg.RejectStatus),
		admission.WithShedStatus(cfg.ShedStatus), admission.WithRetryAfter(cfg.RetryAfter)); err != nil {
		return nil, fmt.Errorf("router: new: %w", err)
	}
	if rt.admission, err = admission.NewMetrics(cfg.Registerer, admission.DefaultMaxModelLabels); err != nil {
		return nil, fmt.Errorf("router: new: %w", err)
	}
	if rt.metrics, err = newMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("router: new: %w", err)
	}
	if rt.transport == nil {
		rt.own = newTransport(cfg.ConnectTimeout)
		rt.transport = rt.own
	}
	rt.retry = rt.reject.Estimator()
	rt.upstreamLog = rateLog{log: rt.log, every: rateLogEvery}
	rt.streamLog = rateLog{log: rt.log, every: rateLogEvery}
	rt.registryLog = rateLog{log: rt.log, every: rateLogEvery}
	rt.loads.init()
	qm, err := newQueueMetrics(cfg.Registerer, admission.DefaultMaxModelLabels)
	if err != nil {
		return nil, fmt.Errorf("router: new: %w", err)
	}
	if cfg.QueueMaxWait > 0 {
		deps := queueDeps{
			decide:     cfg.BusyList.DecideClass,
			registered: cfg.Registry.Endpoints,
			routers:    func(string) uint64 { return 0 },
			pick:       func(c []events.WorkerEntry) (events.WorkerEntry, bool) { return rt.loads.pick(c, nil) },
		}
		if rc, ok := cfg.BusyList.(interface{ Routers(model string) uint64 }); ok {
			deps.routers = rc.Routers
		}
		// Routers that queue as one (contract §22): the record's other
		// routers' queues, less this router's own entry.
		if qv, ok := cfg.BusyList.(queuedView); ok {
			own := rt.source()
			deps.others = func(model string, p int64) busylist.QueuedOthers { return qv.QueuedByOthers(model, own, p) }
		}
		rt.queue = newQueues(queueLimits{maxWait: cfg.QueueMaxWait, maxRequests: cfg.QueueMaxRequests,
			maxBytes: cfg.QueueMaxBytes, pace: cfg.QueuePace}, deps, qm)
	}

	mux := http.NewServeMux()
	mux.HandleFunc("POST "+PathCompletions, func(w http.ResponseWriter, r *http.Request) {
		rt.serveInference(w, r, routeCompletions)
	})
	mux.HandleFunc("POST "+PathChatCompletions, func(w http.ResponseWriter, r *http.Request) {
		rt.serveInference(w, r, routeChatCompletions)
	})
	mux.HandleFunc("GET "+PathModels, rt.serveModels)
	mux.HandleFunc("GET "+PathQueues, rt.serveQueues)
	if cfg.Slots != nil {
		rt.slots = &slotTracker{tr: cfg.Slots, prefix: cmp.Or(cfg.RouterID, "router")}
		api := slotsapi.Handler(cfg.Slots)
		// Every method: the API answers a wrong one 405 with Allow.
		mux.Handle("/loads", api)
		mux.Handle("/potential_loads", api)
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", rt.serveReady)
	mux.HandleFunc("/", rt.serveNotFound)
	rt.mux = mux
	return rt, nil
}

// Paths the Router serves.
const (
	PathCompletions     = "/v1/completions"
	PathChatCompletions = "/v1/chat/completions"
	PathModels          = "/v1/models"
	PathQueues          = "/queues"
)

// Route labels of the metrics.
const (
	routeCompletions     = "completions"
	routeChatCompletions = "chat_completions"
)

// ServeHTTP serves the proxied paths, /v1/models, /healthz and /readyz.
func (rt *Router) ServeHTTP(w http.ResponseWriter, r *http.Request) { rt.mux.ServeHTTP(w, r) }

// Close stops flow control and closes the idle connections of the Router's
// own transport. Requests in flight are not interrupted (shut the HTTP
// server down first): a request still queued is released and decided again
// as if it never queued, as is a request that arrives later, and Close
// returns once the queues' dispatchers have ended. It is idempotent and
// returns nil.
func (rt *Router) Close() error {
	if rt.queue != nil {
		rt.queue.close()
	}
	if rt.own != nil {
		rt.own.CloseIdleConnections()
	}
	return nil
}

// newTransport returns the transport to the engines: HTTP/1.1, bounded
// connects, many idle connections per engine, no transparent compression
// (the client's Accept-Encoding is passed on as is).
func newTransport(connectTimeout time.Duration) *http.Transport {
	d := &net.Dialer{Timeout: connectTimeout, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy:               nil,
		DialContext:         d.DialContext,
		MaxIdleConns:        4 * maxIdleConnsPerHost,
		MaxIdleConnsPerHost: maxIdleConnsPerHost,
		IdleConnTimeout:     idleConnTimeout,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
	}
}
