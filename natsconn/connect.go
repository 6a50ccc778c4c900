package natsconn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/workermon/workermon/internal/redact"
)

// Connect connects to the servers of cfg and waits until the first
// connection is made. It returns an error when cfg is invalid, when the
// connection is given up (the server rejected the credentials twice: the
// error matches ErrUnauthorized), or when ctx ends first (the error matches
// ctx.Err() and names the last connection error); the connection is closed
// then. The returned connection reconnects forever; ctx bounds only the wait.
// A nil logger discards the connection's logs.
func Connect(ctx context.Context, cfg Config, logger *slog.Logger) (*nats.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("natsconn: connect %s: %w", redact.URLs(cfg.URL), err)
	}
	nc, h, err := dial(cfg, logger)
	if err != nil {
		return nil, err
	}
	if err := waitConnected(ctx, nc, h.lastError); err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsconn: connect %s: %w", redact.URLs(cfg.URL), err)
	}
	return nc, nil
}

// Dial creates a connection to the servers of cfg without waiting for one to
// answer: it tries each server once (each attempt bounded by
// cfg.ConnectTimeout) and, when none answers, returns a connection that keeps
// trying in the background and buffers publishes meanwhile. It fails only on
// an invalid cfg or unusable credential or TLS files. Use WaitConnected or
// nc.StatusChanged(nats.CONNECTED) to learn when it is connected. A nil
// logger discards the connection's logs.
func Dial(cfg Config, logger *slog.Logger) (*nats.Conn, error) {
	nc, _, err := dial(cfg, logger)
	return nc, err
}

func dial(cfg Config, logger *slog.Logger) (*nats.Conn, *handlers, error) {
	if err := cfg.Validate(); err != nil {
		return nil, nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	servers := redact.URLs(cfg.URL)
	h := newHandlers(logger)
	opts, err := cfg.options(h)
	if err != nil {
		return nil, nil, fmt.Errorf("natsconn: connect %s: %w", servers, err)
	}
	logger.Debug("nats: connecting", "servers", servers, "name", cfg.Name, "auth", cfg.authMethod())
	nc, err := nats.Connect(cfg.URL, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("natsconn: connect %s: %w", servers, translate(err))
	}
	if nc.IsConnected() {
		h.connected(nc)
	} else {
		attrs := []any{"servers", servers}
		if err := nc.LastError(); err != nil {
			attrs = append(attrs, "error", err)
		}
		logger.Warn("nats: not connected yet; retrying in the background", attrs...)
	}
	return nc, h, nil
}

// WaitConnected waits until nc is connected. It returns at once when it
// already is, an error matching ErrClosed (and ErrUnauthorized when the
// credentials were rejected) when nc is closed, and one matching ctx.Err()
// when ctx ends first. It does not close nc.
func WaitConnected(ctx context.Context, nc *nats.Conn) error {
	if err := waitConnected(ctx, nc, nc.LastError); err != nil {
		return fmt.Errorf("natsconn: wait for connection: %w", err)
	}
	return nil
}

// waitConnected waits as WaitConnected does; lastErr tells the error of the
// last failed attempt, for the error when ctx ends.
func waitConnected(ctx context.Context, nc *nats.Conn, lastErr func() error) error {
	// Register before looking at the status, so no change is missed.
	ch := nc.StatusChanged(nats.CONNECTED, nats.CLOSED)
	defer nc.RemoveStatusListener(ch)
	for {
		switch nc.Status() {
		case nats.CONNECTED:
			return nil
		case nats.CLOSED:
			if err := nc.LastError(); err != nil {
				return fmt.Errorf("%w: %w", ErrClosed, translate(err))
			}
			return ErrClosed
		}
		select {
		case <-ctx.Done():
			if err := lastErr(); err != nil {
				return fmt.Errorf("%w (last error: %w)", ctx.Err(), err)
			}
			return ctx.Err()
		case <-ch:
		}
	}
}

// translate adds this package's sentinel to the nats.go errors that callers
// act on.
func translate(err error) error {
	switch {
	case errors.Is(err, nats.ErrAuthorization),
		errors.Is(err, nats.ErrAuthExpired),
		errors.Is(err, nats.ErrAuthRevoked),
		errors.Is(err, nats.ErrAccountAuthExpired):
		return fmt.Errorf("%w: %w", ErrUnauthorized, err)
	}
	return err
}

// options returns the nats.go options of c, with h's handlers.
func (c Config) options(h *handlers) ([]nats.Option, error) {
	opts := []nats.Option{
		nats.Name(c.Name),
		nats.Timeout(c.ConnectTimeout),
		nats.PingInterval(c.PingInterval),
		nats.MaxPingsOutstanding(c.MaxPingsOutstanding),
		nats.ReconnectWait(c.ReconnectWait),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ConnectHandler(h.connected),
		nats.DisconnectErrHandler(h.disconnected),
		nats.ReconnectHandler(h.reconnected),
		nats.ReconnectErrHandler(h.reconnectFailed),
		nats.ClosedHandler(h.closed),
		nats.ErrorHandler(h.asyncError),
		nats.LameDuckModeHandler(h.lameDuck),
	}
	if c.InProcess != nil {
		opts = append(opts, nats.InProcessServer(c.InProcess))
	}
	if c.NoReconnectBuffer {
		opts = append(opts, nats.ReconnectBufSize(-1))
	}
	switch {
	case c.CredsFile != "":
		// nats.go reads the file at every connect; check it now so a bad
		// file fails here instead of in an endless reconnect loop.
		if err := checkCreds(c.CredsFile); err != nil {
			return nil, err
		}
		opts = append(opts, nats.UserCredentials(c.CredsFile))
	case c.NKeyFile != "":
		o, err := nats.NkeyOptionFromSeed(c.NKeyFile)
		if err != nil {
			return nil, fmt.Errorf("read nkey seed file %s: %w", c.NKeyFile, err)
		}
		opts = append(opts, o)
	case c.User != "":
		opts = append(opts, nats.UserInfo(c.User, c.Password))
	case c.Token != "":
		opts = append(opts, nats.Token(c.Token))
	}
	if c.TLSCA != "" {
		opts = append(opts, nats.RootCAs(c.TLSCA))
	}
	if c.TLSCert != "" {
		opts = append(opts, nats.ClientCert(c.TLSCert, c.TLSKey))
	}
	if c.IgnoreDiscoveredServers {
		opts = append(opts, nats.IgnoreDiscoveredServers())
	}
	return opts, nil
}

// checkCreds reports why path is not a usable credentials file, as far as
// its user nkey seed tells; a bad JWT is the server's to reject.
func checkCreds(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read creds file: %w", err)
	}
	kp, err := nkeys.ParseDecoratedUserNKey(b)
	if err != nil {
		return fmt.Errorf("creds file %s: no user nkey seed: %w", path, err)
	}
	kp.Wipe()
	return nil
}
