package natsconn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// DefaultEmbeddedAddr is where the embedded server listens for clients:
// loopback only, the standard NATS port.
const DefaultEmbeddedAddr = "127.0.0.1:4222"

// DefaultServerName is the embedded server's name.
const DefaultServerName = "workermon"

// DefaultReadyTimeout bounds the embedded server's start.
const DefaultReadyTimeout = 10 * time.Second

// lockFileName is the file in the data dir that an embedded server holds
// locked while it runs.
const lockFileName = "workermon.lock"

// readyPoll is how long one readiness check of the embedded server waits.
const readyPoll = 50 * time.Millisecond

// DefaultDataDir returns where the embedded server stores JetStream data by
// default: <user cache dir>/workermon (~/.cache/workermon on Linux,
// ~/Library/Caches/workermon on macOS, %LocalAppData%\workermon on Windows).
// It is per user, needs no privileges and survives reboots; what it holds is
// rebuilt by a running system except the per-model threshold overrides, so a
// deployment that must keep those should pass a durable directory (e.g.
// /var/lib/workermon). It returns "" when the system has no user cache
// directory (no $HOME): then the directory must be configured.
func DefaultDataDir() string {
	dir, err := os.UserCacheDir()
	if err != nil || dir == "" {
		return ""
	}
	return filepath.Join(dir, "workermon")
}

// EmbeddedConfig configures the embedded nats-server.
type EmbeddedConfig struct {
	// Addr is host:port to listen on for clients. Port 0 picks a free port
	// (see Embedded.ClientURL); an empty host means every interface.
	Addr string
	// DataDir holds the JetStream store (nats-server writes it under
	// DataDir/jetstream). It is created with mode 0700 when missing, and
	// locked while the server runs (on Unix), so that two servers never
	// share it.
	DataDir string
	// ServerName names the server in logs and monitoring.
	ServerName string
	// MonitorAddr, when not empty, is host:port of nats-server's HTTP
	// monitoring endpoints (/varz, /connz, /jsz, ...); port 0 picks one.
	MonitorAddr string
	// ReadyTimeout bounds the wait for the server to accept clients.
	ReadyTimeout time.Duration
	// Logger receives the server's logs; nil discards them.
	Logger *slog.Logger
}

// DefaultEmbeddedConfig returns the configuration of the embedded server:
// DefaultEmbeddedAddr, DefaultDataDir(), no monitoring port.
func DefaultEmbeddedConfig() EmbeddedConfig {
	return EmbeddedConfig{
		Addr:         DefaultEmbeddedAddr,
		DataDir:      DefaultDataDir(),
		ServerName:   DefaultServerName,
		ReadyTimeout: DefaultReadyTimeout,
	}
}

// Validate reports every problem of c, joined; each is a [*ConfigError].
func (c EmbeddedConfig) Validate() error {
	var p problems
	if _, _, err := SplitListenAddr(c.Addr); err != nil {
		p.add("Addr", "%v", err)
	}
	if c.MonitorAddr != "" {
		if _, _, err := SplitListenAddr(c.MonitorAddr); err != nil {
			p.add("MonitorAddr", "%v", err)
		} else if c.MonitorAddr == c.Addr && !strings.HasSuffix(c.Addr, ":0") {
			p.add("MonitorAddr", "same as Addr")
		}
	}
	if c.DataDir == "" {
		p.add("DataDir", "empty (this system has no user cache directory to default to)")
	}
	if c.ServerName == "" {
		p.add("ServerName", "empty")
	} else if strings.ContainsFunc(c.ServerName, unicode.IsSpace) {
		p.add("ServerName", "%q contains white space", c.ServerName)
	}
	if c.ReadyTimeout <= 0 {
		p.add("ReadyTimeout", "%v is not positive", c.ReadyTimeout)
	}
	return p.err()
}

// SplitListenAddr parses a listen address, host:port with a port from 0 to
// 65535 (0: any free port), and returns its host and port. Commands check
// their HTTP listen addresses with it too.
func SplitListenAddr(addr string) (string, int, error) {
	if addr == "" {
		return "", 0, errors.New("empty")
	}
	host, ps, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("%s: port %q is not a number from 0 to 65535", addr, ps)
	}
	return host, port, nil
}

// Embedded is a running embedded nats-server with JetStream.
type Embedded struct {
	s          *server.Server
	lock       *os.File // held locked until Close
	log        *slog.Logger
	clientURL  string
	monitorURL string
	closeOnce  sync.Once
}

// StartEmbedded starts nats-server with JetStream as cfg says and waits until
// it accepts clients. ctx bounds the start only; Close stops the server. An
// address already taken gives an error matching ErrAddrInUse; a server that
// is not ready within cfg.ReadyTimeout, one matching ErrNotReady; a data dir
// that another embedded server uses, one matching ErrDataDirInUse.
func StartEmbedded(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("natsconn: start embedded server: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Find a taken port here, with an error that says so: nats-server only
	// logs it and, for the monitoring port, loses the cause. Before the data
	// dir lock, so that a second workermon with the defaults hears of the port.
	for _, addr := range []string{cfg.Addr, cfg.MonitorAddr} {
		if err := checkListen(addr); err != nil {
			return nil, fmt.Errorf("natsconn: start embedded server: %w", err)
		}
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("natsconn: create data dir: %w", err)
	}
	lock, err := lockDataDir(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("natsconn: start embedded server: %w", err)
	}
	e, err := startServer(ctx, cfg, log)
	if err != nil {
		lock.Close()
		return nil, err
	}
	e.lock = lock
	return e, nil
}

// startServer does the work of StartEmbedded once the data dir is locked.
func startServer(ctx context.Context, cfg EmbeddedConfig, log *slog.Logger) (*Embedded, error) {
	host, port, _ := SplitListenAddr(cfg.Addr)
	opts := &server.Options{
		ServerName:             cfg.ServerName,
		Host:                   host,
		Port:                   serverPort(port),
		JetStream:              true,
		StoreDir:               cfg.DataDir,
		NoSigs:                 true,
		DisableJetStreamBanner: true,
	}
	if cfg.MonitorAddr != "" {
		mhost, mport, _ := SplitListenAddr(cfg.MonitorAddr)
		opts.HTTPHost, opts.HTTPPort = mhost, serverPort(mport)
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("natsconn: start embedded server: %w", err)
	}
	sl := newServerLogger(log.With("component", "nats-server"))
	sl.install(s)
	s.Start()
	if err := waitReady(ctx, s, sl, cfg.ReadyTimeout); err != nil {
		s.Shutdown()
		s.WaitForShutdown()
		if errors.Is(err, syscall.EADDRINUSE) {
			err = fmt.Errorf("%w: %w", ErrAddrInUse, err)
		}
		return nil, fmt.Errorf("natsconn: start embedded server on %s: %w", cfg.Addr, err)
	}

	e := &Embedded{s: s, log: log, clientURL: clientURL(s)}
	if a := s.MonitorAddr(); a != nil {
		e.monitorURL = "http://" + loopbackIfUnspecified(a).String()
	}
	log.Info("embedded NATS server ready",
		"url", e.clientURL, "data_dir", cfg.DataDir, "monitor_url", e.monitorURL)
	if beyondLoopback(host) {
		log.Warn("embedded NATS server listens beyond loopback without authentication: anyone who reaches it can publish load reports and change the buckets",
			"addr", cfg.Addr)
	}
	return e, nil
}

// beyondLoopback reports whether listening on host may accept clients from
// other machines.
func beyondLoopback(host string) bool {
	if host == "localhost" {
		return false
	}
	ip := net.ParseIP(host)
	return ip == nil || !ip.IsLoopback()
}

// waitReady waits until s accepts clients, reports a fatal error, or the
// timeout or ctx ends.
func waitReady(ctx context.Context, s *server.Server, sl *serverLogger, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ready := s.ReadyForConnections(readyPoll)
		select {
		case err := <-sl.fatal:
			return err
		default:
		}
		if ready {
			if !s.JetStreamEnabled() {
				return fmt.Errorf("%w: JetStream is not enabled", ErrNotReady)
			}
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w in %v", ErrNotReady, timeout)
		}
	}
}

// serverPort maps a listen port to nats-server's: there 0 means the default
// port and -1 a random one.
func serverPort(port int) int {
	if port == 0 {
		return server.RANDOM_PORT
	}
	return port
}

// checkListen reports whether addr, when not empty and not port 0, can be
// listened on; a taken address gives an error matching ErrAddrInUse.
func checkListen(addr string) error {
	if addr == "" {
		return nil
	}
	if _, port, _ := SplitListenAddr(addr); port == 0 {
		return nil
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			return fmt.Errorf("listen on %s: %w (is another workermon or nats-server running there?)", addr, ErrAddrInUse)
		}
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	return l.Close()
}

// clientURL returns the URL clients of s connect to: its actual port, and
// loopback when it listens on every interface.
func clientURL(s *server.Server) string {
	a, ok := s.Addr().(*net.TCPAddr)
	if !ok {
		return s.ClientURL()
	}
	return "nats://" + loopbackIfUnspecified(a).String()
}

func loopbackIfUnspecified(a *net.TCPAddr) *net.TCPAddr {
	if !a.IP.IsUnspecified() {
		return a
	}
	ip := net.IPv4(127, 0, 0, 1)
	if a.IP.To4() == nil {
		ip = net.IPv6loopback
	}
	return &net.TCPAddr{IP: ip, Port: a.Port}
}

// ClientURL returns the URL to connect to the server, e.g.
// nats://127.0.0.1:4222, with the actual port when Addr asked for port 0.
func (e *Embedded) ClientURL() string { return e.clientURL }

// MonitorURL returns the base URL of the monitoring endpoints, e.g.
// http://127.0.0.1:8222, or "" when monitoring is off.
func (e *Embedded) MonitorURL() string { return e.monitorURL }

// Server returns the running server, for in-process connections
// (nats.InProcessServer) and inspection.
func (e *Embedded) Server() *server.Server { return e.s }

// InProcessConn returns a new connection to the server inside this
// process; with it Embedded is the nats.InProcessConnProvider of
// Config.InProcess. The server keeps listening for everyone else.
func (e *Embedded) InProcessConn() (net.Conn, error) {
	c, err := e.s.InProcessConn()
	if err != nil {
		return nil, fmt.Errorf("natsconn: in-process connection: %w", err)
	}
	return c, nil
}

var _ nats.InProcessConnProvider = (*Embedded)(nil)

// Close shuts the server down and waits until it has stopped. It may be
// called more than once, also concurrently; every call returns after the
// server has stopped. Close clients first: the server drops them on close.
func (e *Embedded) Close() {
	e.closeOnce.Do(func() {
		e.s.Shutdown()
		e.s.WaitForShutdown()
		e.lock.Close() // releases the data dir
		e.log.Info("embedded NATS server stopped")
	})
}
