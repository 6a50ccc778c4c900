// Package natsconn is the one place where workermon connects to NATS and runs
// its embedded nats-server.
//
// # Clients
//
// Every long-lived client is made from a [Config] (see [DefaultConfig]):
// reconnects never give up, the server is pinged every couple of seconds so a
// dead or paused server is noticed within a few pings, and the connection
// events are logged with slog (disconnect at Warn, reconnect at Info, failed
// reconnect attempts at Warn but at most once per [ReconnectErrorLogInterval]).
//
// Two ways to connect:
//
//   - [Connect] blocks until the first connection is made, the connection is
//     given up (e.g. a rejected password), or ctx ends. Use it where nothing
//     works without NATS (the monitor) and starting must wait for the server;
//     pass a ctx that Ctrl-C cancels, or one with a deadline.
//   - [Dial] returns at once, even when no server is reachable yet: the
//     connection keeps trying in the background (RetryOnFailedConnect) and
//     publishes are buffered meanwhile. Use it where the service should come up
//     before NATS does (a router that fails open); [WaitConnected] waits for it
//     later.
//
// # Reconnect notifications
//
// nats.go reports connection state changes to any number of listeners; there
// is no wrapper here. A component that must act after every reconnect (a KV
// watcher re-watching from its last revision: a watcher can stall for 10–20 s
// after a server restart otherwise) registers a listener before it starts its
// first watch and removes it when done:
//
//	ch := nc.StatusChanged(nats.CONNECTED)
//	defer nc.RemoveStatusListener(ch)
//	for {
//		select {
//		case <-ctx.Done():
//			return
//		case <-ch:
//			// (re)connected: re-create the watcher with ResumeFromRevision(last+1)
//		case e := <-w.Updates():
//			...
//		}
//	}
//
// CONNECTED arrives on every reconnect and on a first connection that Dial
// left for the background; re-watching on it must be idempotent. The channel
// buffers 10 events and drops further ones while full, which loses nothing for
// a "something reconnected" signal. It is not closed when the connection
// closes: always also select on ctx. Listen for nats.CLOSED to learn that the
// connection was given up: reconnects never stop on their own, but nats.go
// closes a connection whose credentials the server rejects twice in a row, at
// the first connection or any later one. Do not install handlers with nc.SetReconnectHandler
// and friends: they replace the logging handlers set here.
//
// # Embedded server
//
// [StartEmbedded] runs nats-server with JetStream inside the process (the
// default when no NATS URL is given): listening on 127.0.0.1:4222 unless told
// otherwise, storing under [EmbeddedConfig.DataDir], logging through slog.
package natsconn

import (
	"errors"
	"fmt"
)

// Sentinel errors. Errors of this package wrap one of them (configuration
// problems are [*ConfigError] values, which match ErrInvalidConfig).
var (
	// ErrInvalidConfig: Validate found a problem in a Config or EmbeddedConfig.
	ErrInvalidConfig = errors.New("invalid config")
	// ErrUnauthorized: the server rejected the client's credentials.
	ErrUnauthorized = errors.New("authorization failed")
	// ErrClosed: the connection was closed before it connected.
	ErrClosed = errors.New("connection closed")
	// ErrAddrInUse: the embedded server's listen address is taken, usually
	// by another workermon or nats-server.
	ErrAddrInUse = errors.New("address already in use")
	// ErrDataDirInUse: another embedded server, usually another
	// workermon, uses the data directory.
	ErrDataDirInUse = errors.New("data dir in use")
	// ErrNotReady: the embedded server did not become ready.
	ErrNotReady = errors.New("embedded server not ready")
)

// ConfigError is one problem that Validate found: the field concerned and
// what is wrong with it. Validate joins them with errors.Join; each matches
// ErrInvalidConfig with errors.Is.
type ConfigError struct {
	Field   string
	Problem string
}

func (e *ConfigError) Error() string {
	return "natsconn: invalid " + e.Field + ": " + e.Problem
}

// Is reports whether target is ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// problems collects ConfigErrors for Validate.
type problems []error

func (p *problems) add(field, format string, args ...any) {
	*p = append(*p, &ConfigError{Field: field, Problem: fmt.Sprintf(format, args...)})
}

func (p problems) err() error { return errors.Join(p...) }
