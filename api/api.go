// Package api serves the monitor's HTTP API (contract §8 and the inspection
// endpoints) and holds a Client for it.
//
// Thresholds:
//
//	GET    /busy_threshold              every known model's configured thresholds
//	POST   /busy_threshold              set (merge) a model's override, or get one model
//	DELETE /busy_threshold?model=NAME   drop a model's override (back to the defaults)
//
// SLOs (contract §18):
//
//	GET    /slo[?model=NAME]   every SLO with its controller's state, or one
//	POST   /slo                set (replace) a model's SLO
//	DELETE /slo?model=NAME     drop a model's SLO
//
// Inspection, read from the monitor's own state:
//
//	GET /loads?model=NAME     one row per worker and rank
//	GET /workers?model=NAME   one row per worker
//	GET /busy?model=NAME      the busy-set records, with each busy worker's reason
//
// Every reply is a JSON object; every error is {"error": "..."}. The
// handler writes overrides to the thresholds bucket (a Store) and applies them
// to the monitor at once (Monitor.SetOverride), without waiting for the
// bucket's watcher. docs/api.md documents the shapes and status codes.
package api

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

// Defaults of Config.
const (
	// DefaultMaxBody bounds a request body, in bytes. A threshold request is
	// well under 1 KiB (a model name is at most 256 bytes).
	DefaultMaxBody = 16 << 10
	// DefaultTimeout bounds the work of one request: the calls to the monitor
	// loop and to the thresholds bucket.
	DefaultTimeout = 5 * time.Second
)

// Paths are the paths the handler serves; a caller mounting it on a mux of
// its own registers each of them (methods included: the handler answers a
// wrong method with 405 itself).
var Paths = []string{"/busy_threshold", "/loads", "/workers", "/busy", "/cordon", "/uncordon", "/cordons", "/rescheduler", "/slo"}

// Sentinel errors.
var (
	// ErrInvalidConfig wraps every problem Config.Validate finds.
	ErrInvalidConfig = errors.New("invalid api config")
	// ErrUnreachable wraps a Client's failure to reach the monitor at all.
	ErrUnreachable = errors.New("monitor unreachable")
)

// Monitor is what the API needs of the monitor; *monitor.Monitor
// implements it.
type Monitor interface {
	// Known reports whether the monitor has seen model since start, tracks
	// it, or holds an override for it.
	Known(ctx context.Context, model string) (bool, error)
	// Thresholds returns the thresholds in force by model, for every model
	// seen since start or with an override.
	Thresholds(ctx context.Context) (map[string]events.Thresholds, error)
	// SetOverride sets (nil clears) a model's override and recomputes its
	// busy set at once.
	SetOverride(ctx context.Context, model string, t *events.Thresholds) error
	// Records, Workers and Loads return the monitor's view of model, or of
	// every model when it is empty, sorted.
	Records(ctx context.Context, model string) ([]events.BusySet, error)
	Workers(ctx context.Context, model string) ([]monitor.WorkerRow, error)
	Loads(ctx context.Context, model string) ([]monitor.LoadRow, error)
}

// Store holds the per-model overrides (the thresholds bucket);
// *overrides.ThresholdStore implements it.
type Store interface {
	// Get returns a model's override and whether it has one.
	Get(ctx context.Context, model string) (events.Thresholds, bool, error)
	// Merge sets the fields patch sets, keeping the others, and returns the
	// override now stored.
	Merge(ctx context.Context, model string, patch events.Thresholds) (events.Thresholds, error)
	// Delete drops a model's override.
	Delete(ctx context.Context, model string) error
	// List returns every override by model.
	List(ctx context.Context) (map[string]events.Thresholds, error)
}

// Config configures the API handler.
type Config struct {
	// Monitor is the running monitor. Required.
	Monitor Monitor
	// Store is the thresholds bucket. Required.
	Store Store
	// RecordModels returns the models that have a record in the busy bucket
	// (busylist.Writer.Models); they count as known. Nil means none.
	RecordModels func() []string
	// Defaults are the thresholds of `workermon serve`'s flags, the same the
	// monitor was configured with; an override is merged over them.
	Defaults events.Thresholds
	// AdminToken, when set, is the bearer token a set or a delete must carry.
	// Empty means anyone who can reach the API can change thresholds.
	AdminToken string
	// MaxBody bounds a request body in bytes; larger bodies get 413. > 0.
	MaxBody int64
	// Timeout bounds the work of one request. > 0.
	Timeout time.Duration
	// Cordons is the cordons bucket and CordonMonitor the monitor that
	// applies them at once. Nil Cordons: the cordon endpoints answer 404.
	Cordons       Cordons
	CordonMonitor CordonMonitor
	// SLOs is the SLO bucket (contract §18) and OnSLOChange tells the SLO
	// controller of a change at once, without waiting for the bucket's
	// watcher. Nil SLOs: /slo answers 404 and no model is controlled.
	SLOs        SLOStore
	OnSLOChange func(ctx context.Context, model string, v overrides.SLO, deleted bool) error
	// Observed returns the best latency a model's fleet has shown
	// (sloctl.Controller.Observed), for the replies of /slo. Nil: none.
	Observed func(model string) (slo.Observed, bool)
	// Rescheduler returns what GET /rescheduler shows: the recent rounds.
	// Nil: the endpoint says the rescheduler is off.
	Rescheduler func() any
	// Logger receives the audit log of changes and the startup warning; nil
	// discards.
	Logger *slog.Logger
}

// DefaultConfig returns a Config with every default set; the caller must
// still set Monitor and Store.
func DefaultConfig() Config {
	return Config{MaxBody: DefaultMaxBody, Timeout: DefaultTimeout}
}

// Validate reports every problem of the configuration at once.
func (c Config) Validate() error {
	var errs []error
	if c.Monitor == nil {
		errs = append(errs, errors.New("monitor is nil"))
	}
	if c.Store == nil {
		errs = append(errs, errors.New("threshold store is nil"))
	}
	if err := c.Defaults.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.MaxBody <= 0 {
		errs = append(errs, fmt.Errorf("max body %d must be positive", c.MaxBody))
	}
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("timeout %v must be positive", c.Timeout))
	}
	if c.Cordons != nil && c.CordonMonitor == nil {
		errs = append(errs, errors.New("cordons without a monitor to apply them"))
	}
	if strings.IndexFunc(c.AdminToken, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0 {
		errs = append(errs, errors.New("admin token contains a space or a control character: it cannot travel in an Authorization header"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("api: %w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// handler serves the API.
type handler struct {
	cfg       Config
	log       *slog.Logger
	tokenHash [sha256.Size]byte // of cfg.AdminToken, compared in constant time
	mux       *http.ServeMux
}

// New checks cfg and returns the API handler. It logs a warning when no
// admin token is configured.
func New(cfg Config) (http.Handler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	h := &handler{cfg: cfg, log: cfg.Logger, mux: http.NewServeMux()}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	if cfg.AdminToken == "" {
		h.log.Warn("api: no admin token configured: anyone who can reach the API can change thresholds; " +
			"set --admin-token or WORKERMON_ADMIN_TOKEN")
	} else {
		h.tokenHash = sha256.Sum256([]byte(cfg.AdminToken))
	}

	h.mux.HandleFunc("GET /busy_threshold", h.listThresholds)
	h.mux.HandleFunc("POST /busy_threshold", h.postThresholds)
	h.mux.HandleFunc("DELETE /busy_threshold", h.deleteThresholds)
	h.mux.HandleFunc("/busy_threshold", methodNotAllowed("GET, HEAD, POST, DELETE"))
	h.mux.HandleFunc("GET /loads", h.loads())
	h.mux.HandleFunc("/loads", methodNotAllowed("GET, HEAD"))
	h.mux.HandleFunc("GET /workers", h.workers())
	h.mux.HandleFunc("/workers", methodNotAllowed("GET, HEAD"))
	h.mux.HandleFunc("GET /busy", h.records())
	h.mux.HandleFunc("/busy", methodNotAllowed("GET, HEAD"))
	if cfg.Cordons != nil {
		h.mux.HandleFunc("POST /cordon", h.setCordon(true))
		h.mux.HandleFunc("/cordon", methodNotAllowed("POST"))
		h.mux.HandleFunc("POST /uncordon", h.setCordon(false))
		h.mux.HandleFunc("/uncordon", methodNotAllowed("POST"))
		h.mux.HandleFunc("GET /cordons", h.listCordons)
		h.mux.HandleFunc("/cordons", methodNotAllowed("GET, HEAD"))
	}
	if cfg.SLOs != nil {
		h.mux.HandleFunc("GET /slo", h.getSLO)
		h.mux.HandleFunc("POST /slo", h.postSLO)
		h.mux.HandleFunc("DELETE /slo", h.deleteSLO)
		h.mux.HandleFunc("/slo", methodNotAllowed("GET, HEAD, POST, DELETE"))
	}
	rescheduler := cfg.Rescheduler
	if rescheduler == nil {
		rescheduler = func() any { return map[string]any{"enabled": false, "rounds": []any{}} }
	}
	h.cfg.Rescheduler = rescheduler
	h.mux.HandleFunc("GET /rescheduler", h.rescheduler)
	h.mux.HandleFunc("/rescheduler", methodNotAllowed("GET, HEAD"))
	h.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no such endpoint %s; the API serves %s",
			r.URL.Path, strings.Join(Paths, ", ")))
	})
	return h, nil
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

// context returns the request's context bounded by the configured timeout.
func (h *handler) context(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), h.cfg.Timeout)
}

// MethodNotAllowed answers 405 with Allow and the JSON error, for a caller
// that serves more paths beside the API's on one mux.
func MethodNotAllowed(allow string) http.HandlerFunc { return methodNotAllowed(allow) }

func methodNotAllowed(allow string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		writeError(w, http.StatusMethodNotAllowed,
			fmt.Sprintf("method %s is not allowed on %s; use %s", r.Method, r.URL.Path, allow))
	}
}
