// Package httplimit bounds how long a client may hold an HTTP server's
// request goroutine: the reading of a request's body, and each write of its
// response. It is what every workermon HTTP server (serve, router, slots,
// scrape, sim, demo) wraps its handler in.
//
// A server-wide http.Server.ReadTimeout or WriteTimeout would do neither
// well: a WriteTimeout counts from the request's start, so it cuts every
// stream that lives longer (the router's SSE relay, the board's event
// stream), and a ReadTimeout still running when the handler streams makes
// net/http cancel the request's context. Here the body's read deadline is
// lifted once the body has been read, and the write deadline is moved
// forward before every write and flush: a stream lives as long as it keeps
// writing, and a client that stops reading is cut after one Write timeout.
package httplimit

import (
	"errors"
	"io"
	"net/http"
	"time"
)

// Defaults of Limits.
const (
	// DefaultBodyRead bounds the reading of a request's body, from the
	// handler's start to the body's end: a 4 MiB body at 150 KB/s.
	DefaultBodyRead = 30 * time.Second
	// DefaultWrite bounds each write or flush of a response: how long a
	// client may leave the data unread before it is cut.
	DefaultWrite = 30 * time.Second
)

// Limits are the deadlines Handler sets.
type Limits struct {
	// BodyRead bounds the reading of a request's body; > 0.
	BodyRead time.Duration
	// Write bounds each write and flush of a response; > 0. A handler that
	// sets its own write deadline (http.ResponseController.SetWriteDeadline)
	// keeps it: Handler stops moving it for that request.
	Write time.Duration
}

// DefaultLimits returns the Limits of every workermon server.
func DefaultLimits() Limits {
	return Limits{BodyRead: DefaultBodyRead, Write: DefaultWrite}
}

// Handler returns h with l's deadlines on each request. A request without a
// body gets no read deadline (after its headers, which
// http.Server.ReadHeaderTimeout bounds, nothing is read).
func Handler(h http.Handler, l Limits) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		if r.Body != nil && r.Body != http.NoBody {
			// ErrNotSupported (a writer that is not a connection's): no
			// deadline, as before.
			_ = rc.SetReadDeadline(time.Now().Add(l.BodyRead))
			r.Body = &body{ReadCloser: r.Body, rc: rc}
		}
		dw := &writer{ResponseWriter: w, rc: rc, timeout: l.Write}
		h.ServeHTTP(dw, r)
		// net/http writes what is still buffered once the handler returns.
		dw.extend()
	})
}

// body lifts the read deadline once the body has been read to its end:
// net/http then reads the connection to notice a client that goes away,
// and a deadline there would cancel the request's context mid-stream.
type body struct {
	io.ReadCloser
	rc   *http.ResponseController
	done bool
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) && !b.done {
		b.done = true
		_ = b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

// writer moves the connection's write deadline forward before each write
// and flush.
type writer struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	// own: the handler set a write deadline of its own.
	own bool
}

func (w *writer) extend() {
	if !w.own {
		_ = w.rc.SetWriteDeadline(time.Now().Add(w.timeout))
	}
}

func (w *writer) Write(p []byte) (int, error) {
	w.extend()
	return w.ResponseWriter.Write(p)
}

// Flush implements http.Flusher, for handlers that assert it.
func (w *writer) Flush() { _ = w.FlushError() }

// FlushError is what http.ResponseController.Flush calls.
func (w *writer) FlushError() error {
	w.extend()
	return w.rc.Flush()
}

// SetWriteDeadline is what http.ResponseController.SetWriteDeadline calls:
// the handler takes the deadline over.
func (w *writer) SetWriteDeadline(t time.Time) error {
	w.own = true
	return w.rc.SetWriteDeadline(t)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *writer) Unwrap() http.ResponseWriter { return w.ResponseWriter }
