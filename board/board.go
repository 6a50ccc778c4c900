// Package board serves workermon's live web board: one page that shows
// every model with its workers as tiles — each data-parallel rank's KV-cache
// usage and prefill load against the thresholds in force (on the monitor's,
// its predicted queue delay and prefill rate too), busy, free, stale and
// cordoned colours, amber and hard levels, the reasons, all_busy, the
// model's saturation, and the router's rejection counts — updated live over
// server-sent events.
//
// The page's HTML, CSS and JavaScript are embedded (no build step, no CDN:
// it works offline). A Board reads a Source: MonitorSource (a monitor's own
// state, with the ranks' loads) or RouterSource (a router's busy list,
// registry and admission counts). One goroutine, owned by the Board and
// stopped by Close, reads the source at most once per Config.Interval (less
// often when reads are slow) while at least one client watches, and pushes a
// snapshot only when it changed.
// Each client gets the newest snapshot, never a queue of old ones: a slot
// of one per client, and a client that does not take an event within
// Config.WriteTimeout is dropped.
//
// A second goroutine, the sampler, also owned by the Board and stopped by
// Close, reads the source every Config.HistoryInterval whether or not
// anyone watches, and keeps the last Config.HistoryLen points of each
// model's counts in a ring (history.go): the page draws its strip of the
// last minutes from them, so a page opened during a peak shows it.
//
// Paths (register each of Patterns on the server's mux):
//
//	GET /                the page
//	GET /board/<asset>   its stylesheet and script
//	GET /board/events    the server-sent events: "snapshot" events whose data is a Snapshot in JSON
//	GET /board/snapshot  the current Snapshot as JSON, once
//	GET /board/history   the last minutes as a History in JSON
package board

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"path"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Defaults of Config.
const (
	// DefaultInterval is how often the source is read while a client
	// watches: changes reach the page at most this often.
	DefaultInterval = 250 * time.Millisecond
	// DefaultHeartbeat is how often an idle stream gets a comment line, so
	// that proxies keep it open and a dead client is noticed.
	DefaultHeartbeat = 15 * time.Second
	// DefaultMaxClients bounds the streams served at once; more get 503.
	DefaultMaxClients = 32
	// DefaultWriteTimeout is how long a client may take to accept one
	// event before it is dropped.
	DefaultWriteTimeout = 10 * time.Second
	// DefaultReadTimeout bounds one read of the source.
	DefaultReadTimeout = 2 * time.Second
)

// retryDelay is the reconnect delay the page's EventSource is told.
const retryDelay = 2 * time.Second

// Patterns are the net/http.ServeMux patterns a Board serves; a caller
// mounting it on a mux of its own registers each of them.
var Patterns = []string{"GET /{$}", "/board/"}

// Sentinel errors.
var (
	// ErrInvalidConfig wraps every problem Config.Validate finds.
	ErrInvalidConfig = errors.New("invalid board config")
	// ErrClosed: the board was closed.
	ErrClosed = errors.New("board closed")
)

// Config configures a Board.
type Config struct {
	// Source is what the board shows. Required.
	Source Source
	// Interval is how often the source is read while a client watches. > 0.
	Interval time.Duration
	// Heartbeat is how often an idle stream gets a comment line. > 0.
	Heartbeat time.Duration
	// MaxClients bounds the streams served at once. > 0.
	MaxClients int
	// WriteTimeout is how long a client may take to accept one event. > 0.
	WriteTimeout time.Duration
	// ReadTimeout bounds one read of the source. > 0.
	ReadTimeout time.Duration
	// Logger receives the source's errors (rate-limited); nil discards.
	Logger *slog.Logger
	// Registerer receives the board's metrics; nil registers nothing.
	Registerer prometheus.Registerer
	// HistoryInterval is how often the sampler reads the source for the
	// history; > 0 when HistoryLen is.
	HistoryInterval time.Duration
	// HistoryLen is how many points the history keeps, at most 86,400; 0
	// keeps none and starts no sampler (GET /board/history answers no
	// points).
	HistoryLen int
	// HistoryModels bounds the models of one point (the first ones, by
	// name); > 0 when HistoryLen is.
	HistoryModels int
}

// DefaultConfig returns a Config with every default set; the caller sets
// Source.
func DefaultConfig() Config {
	return Config{Interval: DefaultInterval, Heartbeat: DefaultHeartbeat, MaxClients: DefaultMaxClients,
		WriteTimeout: DefaultWriteTimeout, ReadTimeout: DefaultReadTimeout,
		HistoryInterval: DefaultHistoryInterval, HistoryLen: DefaultHistoryLen, HistoryModels: DefaultHistoryModels}
}

// Validate reports every problem of the configuration at once.
func (c Config) Validate() error {
	var errs []error
	if c.Source == nil {
		errs = append(errs, errors.New("source is nil"))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"interval", c.Interval}, {"heartbeat", c.Heartbeat}, {"write timeout", c.WriteTimeout}, {"read timeout", c.ReadTimeout}} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s %v must be positive", d.name, d.v))
		}
	}
	if c.MaxClients <= 0 {
		errs = append(errs, fmt.Errorf("max clients %d must be positive", c.MaxClients))
	}
	if c.HistoryLen < 0 || c.HistoryLen > maxHistoryLen {
		errs = append(errs, fmt.Errorf("history len %d must be in [0, %d]", c.HistoryLen, maxHistoryLen))
	}
	if c.HistoryLen > 0 {
		if c.HistoryInterval <= 0 {
			errs = append(errs, fmt.Errorf("history interval %v must be positive", c.HistoryInterval))
		}
		if c.HistoryModels <= 0 {
			errs = append(errs, fmt.Errorf("history models %d must be positive", c.HistoryModels))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("board: %w: %w", ErrInvalidConfig, err)
	}
	return nil
}

//go:embed assets
var assetFS embed.FS

// assets holds the files served under /board/ and the page.
var assets = func() fs.FS {
	sub, err := fs.Sub(assetFS, "assets")
	if err != nil {
		panic(err) // the embed directive guarantees the directory
	}
	return sub
}()

// contentTypes of the embedded assets, by extension.
var contentTypes = map[string]string{
	".html": "text/html; charset=utf-8",
	".css":  "text/css; charset=utf-8",
	".js":   "text/javascript; charset=utf-8",
	".svg":  "image/svg+xml",
}

// securityHeaders are set on every answer: the page loads nothing but its
// own files and talks to nothing but its own origin.
func securityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
}

// ServeHTTP serves the page, its assets, the event stream, the JSON
// snapshot and the history.
func (b *Board) ServeHTTP(w http.ResponseWriter, r *http.Request) { b.mux.ServeHTTP(w, r) }

func (b *Board) routes() {
	b.mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) { serveAsset(w, r, "index.html") })
	b.mux.HandleFunc("GET /board/events", b.serveEvents)
	b.mux.HandleFunc("GET /board/snapshot", b.serveSnapshot)
	b.mux.HandleFunc("GET /board/history", b.serveHistory)
	b.mux.HandleFunc("GET /board/{name}", func(w http.ResponseWriter, r *http.Request) {
		serveAsset(w, r, r.PathValue("name"))
	})
	b.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			writeError(w, http.StatusMethodNotAllowed, fmt.Sprintf("method %s is not allowed on %s", r.Method, r.URL.Path))
			return
		}
		writeError(w, http.StatusNotFound, "no such page "+r.URL.Path)
	})
}

// serveAsset answers with an embedded file.
func serveAsset(w http.ResponseWriter, r *http.Request, name string) {
	ctype, ok := contentTypes[path.Ext(name)]
	data, err := fs.ReadFile(assets, name)
	if !ok || err != nil || name == "index.html" && r.URL.Path != "/" {
		writeError(w, http.StatusNotFound, "no such page "+r.URL.Path)
		return
	}
	securityHeaders(w.Header())
	w.Header().Set("Content-Type", ctype)
	// Revalidated on every load, so an upgrade shows at once.
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		_, _ = w.Write(data)
	}
}

// writeJSON answers 200 with data, a JSON document, never cached.
func writeJSON(w http.ResponseWriter, data []byte) {
	securityHeaders(w.Header())
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(append(data, '\n'))
}

// writeError answers {"error": msg}, as the monitor's API does.
func writeError(w http.ResponseWriter, status int, msg string) {
	securityHeaders(w.Header())
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(errorJSON(msg), '\n'))
}
