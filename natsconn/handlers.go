package natsconn

import (
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// ReconnectErrorLogInterval is the least time between two logs of failed
// reconnect attempts (the first failure of an outage is always logged), and
// between two logs of the same asynchronous error.
const ReconnectErrorLogInterval = 30 * time.Second

// handlers log a connection's events. nats.go calls them one at a time from
// the connection's callback goroutine; the mutex makes them safe anyway.
type handlers struct {
	log *slog.Logger

	mu        sync.Mutex
	announced bool      // the first connection was logged
	downSince time.Time // start of the current outage; zero while connected
	failures  int       // failed attempts in the current outage
	lastFail  time.Time // when a failed attempt was last logged
	lastErr   error     // the error of the last failed attempt
	lastAsync string    // the asynchronous error last logged
	asyncAt   time.Time // when it was logged
	asyncSkip int       // repeats of it not logged since
}

func newHandlers(log *slog.Logger) *handlers {
	return &handlers{log: log}
}

// endOutage returns the attributes describing the outage that just ended, and
// starts afresh. h.mu is held.
func (h *handlers) endOutage(nc *nats.Conn) []any {
	attrs := []any{"url", ConnectedURL(nc), "server", nc.ConnectedServerName(),
		"server_version", nc.ConnectedServerVersion()}
	if !h.downSince.IsZero() {
		attrs = append(attrs,
			"failed_attempts", h.failures,
			"down_for", time.Since(h.downSince).Round(time.Millisecond))
	}
	h.downSince, h.failures, h.lastFail, h.lastErr = time.Time{}, 0, time.Time{}, nil
	return attrs
}

// connected logs the first connection, made at once or after retries.
func (h *handlers) connected(nc *nats.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.announced {
		return
	}
	h.announced = true
	h.log.Info("nats: connected", h.endOutage(nc)...)
}

func (h *handlers) disconnected(nc *nats.Conn, err error) {
	if nc != nil && nc.IsClosed() {
		return // closed on purpose; closed logs it
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.downSince.IsZero() {
		h.downSince = time.Now()
	}
	attrs := []any{}
	if err != nil {
		attrs = append(attrs, "error", err)
	}
	h.log.Warn("nats: disconnected; reconnecting", attrs...)
}

func (h *handlers) reconnected(nc *nats.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.log.Info("nats: reconnected", h.endOutage(nc)...)
}

// reconnectFailed logs the first failed attempt of an outage, then at most
// one per ReconnectErrorLogInterval.
func (h *handlers) reconnectFailed(_ *nats.Conn, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	if h.downSince.IsZero() {
		h.downSince = now
	}
	h.failures++
	h.lastErr = err
	if h.failures > 1 && now.Sub(h.lastFail) < ReconnectErrorLogInterval {
		return
	}
	h.lastFail = now
	h.log.Warn("nats: connection attempt failed; retrying",
		"error", err,
		"failed_attempts", h.failures,
		"down_for", now.Sub(h.downSince).Round(time.Millisecond))
}

// lastError returns the error of the last failed connection attempt, which
// nc.LastError does not keep.
func (h *handlers) lastError() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lastErr
}

// closed logs the end of the connection: at Error when nats.go gave up
// because the server rejected the credentials (with reconnects that never
// give up, the only way it closes on its own), at Info otherwise.
func (h *handlers) closed(nc *nats.Conn) {
	err := nc.LastError()
	if errors.Is(translate(err), ErrUnauthorized) {
		h.log.Error("nats: connection closed: credentials rejected", "error", err)
		return
	}
	h.log.Info("nats: connection closed")
}

// asyncError logs errors that reach no caller (slow consumers, permission
// violations); a repeat of the last one is logged at most once per
// ReconnectErrorLogInterval, with the number of repeats skipped.
func (h *handlers) asyncError(_ *nats.Conn, sub *nats.Subscription, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	msg := err.Error()
	if sub != nil {
		msg = sub.Subject + "\x00" + msg
	}
	if msg == h.lastAsync && now.Sub(h.asyncAt) < ReconnectErrorLogInterval {
		h.asyncSkip++
		return
	}
	attrs := []any{"error", err}
	if sub != nil {
		attrs = append(attrs, "subject", sub.Subject)
	}
	if msg == h.lastAsync && h.asyncSkip > 0 {
		attrs = append(attrs, "repeats", h.asyncSkip)
	}
	h.lastAsync, h.asyncAt, h.asyncSkip = msg, now, 0
	h.log.Error("nats: asynchronous error", attrs...)
}

func (h *handlers) lameDuck(nc *nats.Conn) {
	h.log.Warn("nats: server entering lame duck mode; will move to another server",
		"url", ConnectedURL(nc), "server", nc.ConnectedServerName())
}
