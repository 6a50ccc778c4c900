package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/workermon/workermon/internal/httplimit"
	"github.com/workermon/workermon/natsconn"
)

// What the long-running commands (serve, router, sim, demo) share: how they
// start, serve HTTP, name themselves and stop.

// Settings of every HTTP server of the process. A request's body and each
// write of its response are bounded too (httplimit.DefaultLimits), per
// request and per write, so that streams live as long as they write.
const (
	// httpReadHeaderTimeout bounds the reading of a client's request
	// headers.
	httpReadHeaderTimeout = 10 * time.Second
	// httpIdleTimeout is how long an idle client connection is kept.
	httpIdleTimeout = 2 * time.Minute
)

// natsURLEnv lets NATS_URL set --nats-url, as for the nats CLI.
var natsURLEnv = map[string]string{"NATS_URL": "nats-url"}

// parseCommand parses the flags of the long-running command name, which
// register defines, and --check, from args and the environment (see
// parseFlags), and returns the logger its logging flags lo ask for. The
// command ends with check.report before it starts anything when check.on.
func parseCommand(name string, args []string, stderr io.Writer, aliases map[string]string,
	register func(*flag.FlagSet), lo *logOptions) (*slog.Logger, *checkRequest, error) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	register(fs)
	check := newCheck(fs, name)
	if err := parseFlags(fs, args, stderr, aliases); err != nil {
		return nil, nil, err
	}
	log, err := lo.logger(stderr)
	return log, check, err
}

// serveUntil waits until ctx ends or the service fails (a value on failed),
// then closes it: on a failure it returns the failure with what closing
// returned.
func serveUntil(ctx context.Context, log *slog.Logger, failed <-chan error, close func(context.Context) error) error {
	select {
	case <-ctx.Done():
	case err := <-failed:
		log.Error("stopping", "err", err)
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), DefaultShutdownTimeout)
		defer cancel()
		return errors.Join(err, close(cctx))
	}
	return closeWhenDone(ctx, log, "shutting down", close)
}

// closeWhenDone waits until ctx ends (Ctrl-C, SIGTERM), logs msg, and then
// closes what the command runs, within DefaultShutdownTimeout.
func closeWhenDone(ctx context.Context, log *slog.Logger, msg string, close func(context.Context) error) error {
	<-ctx.Done()
	log.Info(msg)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), DefaultShutdownTimeout)
	defer cancel()
	return close(sctx)
}

// instanceID names this process in records, logs and NATS client names: the
// host name and six random hex digits, so that two processes on one host
// differ.
func instanceID() string {
	host, _ := os.Hostname()
	// Also a KV key token (--monitor-id): anything else becomes '-'.
	host = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' {
			return r
		}
		return '-'
	}, host)
	var b [3]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

// httpServer is an HTTP server serving on a goroutine of its own.
type httpServer struct {
	srv  *http.Server
	addr string        // the address it listens on, port resolved
	done chan struct{} // closed when the serving goroutine has returned

	// busy holds the connections serving a request now (StateActive), so
	// that shutdown can tell a cut request from a connection that never
	// carried one: net/http waits 5 s for those before it counts them idle.
	mu   sync.Mutex
	busy map[net.Conn]struct{}
}

// track follows each connection's state (http.Server.ConnState).
func (s *httpServer) track(c net.Conn, state http.ConnState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if state == http.StateActive {
		s.busy[c] = struct{}{}
	} else {
		delete(s.busy, c)
	}
}

// requestsInFlight is how many connections are serving a request.
func (s *httpServer) requestsInFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.busy)
}

// validListenAddr checks the listen address addr of the flag name as a
// start would need it: host:port with a port from 0 to 65535.
func validListenAddr(name, addr string) error {
	if _, _, err := natsconn.SplitListenAddr(addr); err != nil {
		return fmt.Errorf("--%s %q: want host:port with a port from 0 to 65535: %w", name, addr, err)
	}
	return nil
}

// startHTTP listens on addr and serves h until shutdown, with the default
// body read and write deadlines. name prefixes the error ("serve",
// "router").
func startHTTP(name, addr string, h http.Handler, log *slog.Logger) (*httpServer, error) {
	return startHTTPLimits(name, addr, h, log, httplimit.DefaultLimits())
}

// startHTTPLimits is startHTTP with the deadlines of l.
func startHTTPLimits(name, addr string, h http.Handler, log *slog.Logger, l httplimit.Limits) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s: listen on %s: %w", name, addr, err)
	}
	s := &httpServer{
		srv:  &http.Server{Handler: httplimit.Handler(h, l), ReadHeaderTimeout: httpReadHeaderTimeout, IdleTimeout: httpIdleTimeout},
		addr: ln.Addr().String(),
		done: make(chan struct{}),
		busy: make(map[net.Conn]struct{}),
	}
	s.srv.ConnState = s.track
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("HTTP server stopped", "err", err)
		}
	}()
	return s, nil
}

// shutdown stops accepting, lets the requests in flight finish until ctx
// ends and then cuts the connections still open. It returns once the
// serving goroutine has; the error says whether requests were cut.
func (s *httpServer) shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		n := s.requestsInFlight()
		_ = s.srv.Close()
		if n > 0 {
			err = fmt.Errorf("HTTP shutdown: %d requests still in flight were cut: %w", n, err)
		} else {
			err = nil // only connections that never sent a request were closed
		}
	}
	<-s.done
	return err
}

// partOf returns ctx bounded to frac of the time it has left, so that what
// follows keeps the rest; without a deadline, ctx as it is.
func partOf(ctx context.Context, frac float64) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, time.Duration(frac*float64(time.Until(deadline))))
}
