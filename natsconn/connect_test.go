package natsconn

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/workermon/workermon/internal/natstest"
)

// testConfig returns DefaultConfig for url with quick reconnects.
func testConfig(url string) Config {
	cfg := DefaultConfig()
	cfg.URL = url
	cfg.ReconnectWait = 50 * time.Millisecond
	return cfg
}

// connectT connects and closes the connection at the end of the test.
func connectT(t *testing.T, cfg Config, log *slog.Logger) *nats.Conn {
	t.Helper()
	nc, err := Connect(t.Context(), cfg, log)
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// roundTrip checks that nc can publish and receive.
func roundTrip(t *testing.T, nc *nats.Conn) {
	t.Helper()
	sub, err := nc.SubscribeSync("natsconn.test")
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.Publish("natsconn.test", []byte("hi")); err != nil {
		t.Fatal(err)
	}
	msg, err := sub.NextMsg(5 * time.Second)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	if string(msg.Data) != "hi" {
		t.Fatalf("received %q", msg.Data)
	}
}

func TestConnect(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, nil)
	logs := newCapture(slog.LevelDebug)
	cfg := DefaultConfig()
	cfg.URL = s.ClientURL()
	cfg.Name = "natsconn-test"
	nc := connectT(t, cfg, logs.logger())
	roundTrip(t, nc)

	o := nc.Opts
	if o.Name != "natsconn-test" || o.MaxReconnect != -1 || !o.RetryOnFailedConnect ||
		o.PingInterval != DefaultPingInterval || o.MaxPingsOut != DefaultMaxPingsOutstanding ||
		o.ReconnectWait != DefaultReconnectWait || o.Timeout != DefaultConnectTimeout || o.IgnoreDiscoveredServers {
		t.Errorf("connection options = %+v", o)
	}
	rec := logs.waitFor(t, slog.LevelInfo, "nats: connected")
	if rec.Attrs["url"] != s.ClientURL() {
		t.Errorf("connected log url = %q, want %q", rec.Attrs["url"], s.ClientURL())
	}
	if n := len(logs.records(slog.LevelInfo, "nats: connected")); n != 1 {
		t.Errorf("logged connected %d times", n)
	}
}

func TestConnectServerList(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, nil)
	dead := fmt.Sprintf("nats://127.0.0.1:%d", freePort(t))
	cfg := testConfig(dead + ", " + s.ClientURL())
	cfg.IgnoreDiscoveredServers = true
	nc := connectT(t, cfg, nil)
	roundTrip(t, nc)
	if !nc.Opts.IgnoreDiscoveredServers {
		t.Error("IgnoreDiscoveredServers not passed on")
	}
	if len(nc.Servers()) != 2 {
		t.Errorf("servers = %v, want both", nc.Servers())
	}
}

func TestConnectInvalidConfig(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	cfg.PingInterval = 0
	if _, err := Connect(t.Context(), cfg, nil); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Connect = %v, want ErrInvalidConfig", err)
	}
	if _, err := Dial(cfg, nil); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Dial = %v, want ErrInvalidConfig", err)
	}
}

func TestConnectUserPassword(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	opts.Users = []*server.User{{Username: "alice", Password: "s3cret"}}
	s := natstest.Start(t, opts)

	t.Run("accepted", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(s.ClientURL())
		cfg.User, cfg.Password = "alice", "s3cret"
		roundTrip(t, connectT(t, cfg, nil))
	})
	t.Run("URL user info", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(strings.Replace(s.ClientURL(), "nats://", "nats://alice:s3cret@", 1))
		roundTrip(t, connectT(t, cfg, nil))
	})
	t.Run("rejected", func(t *testing.T) {
		t.Parallel()
		logs := newCapture(slog.LevelInfo)
		cfg := testConfig(s.ClientURL())
		cfg.User, cfg.Password = "alice", "wrong"
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		nc, err := Connect(ctx, cfg, logs.logger())
		if err == nil {
			nc.Close()
			t.Fatal("Connect succeeded with a wrong password")
		}
		if !errors.Is(err, ErrUnauthorized) || !errors.Is(err, ErrClosed) {
			t.Errorf("Connect = %v, want ErrUnauthorized and ErrClosed", err)
		}
		if ctx.Err() != nil {
			t.Error("the rejection was not noticed before the deadline")
		}
		if strings.Contains(err.Error(), "wrong") {
			t.Errorf("error %q shows the password", err)
		}
		logs.waitFor(t, slog.LevelError, "nats: connection closed: credentials rejected")
	})
	t.Run("missing", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		_, err := Connect(ctx, testConfig(s.ClientURL()), nil)
		if !errors.Is(err, ErrUnauthorized) {
			t.Errorf("Connect = %v, want ErrUnauthorized", err)
		}
	})
}

func TestConnectToken(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	opts.Authorization = "tok-123"
	s := natstest.Start(t, opts)

	cfg := testConfig(s.ClientURL())
	cfg.Token = "tok-123"
	roundTrip(t, connectT(t, cfg, nil))

	cfg.Token = "tok-456"
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := Connect(ctx, cfg, nil); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("Connect with a wrong token = %v, want ErrUnauthorized", err)
	}
}

// TestConnectTokenInURL: a token given as the URL's user connects, and
// neither the logs nor ConnectedURL show it (nats.go's ConnectedUrlRedacted
// would: it hides passwords only).
func TestConnectTokenInURL(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	opts.Authorization = "tok-s3cr3t"
	s := natstest.Start(t, opts)

	logs := newCapture(slog.LevelDebug)
	cfg := testConfig(strings.Replace(s.ClientURL(), "nats://", "nats://tok-s3cr3t@", 1))
	nc := connectT(t, cfg, logs.logger())
	roundTrip(t, nc)
	if got := ConnectedURL(nc); strings.Contains(got, "s3cr3t") || !strings.Contains(got, "@127.0.0.1") {
		t.Errorf("ConnectedURL = %q", got)
	}
	logs.waitFor(t, slog.LevelInfo, "nats: connected")
	for _, r := range logs.all() {
		if strings.Contains(fmt.Sprint(r), "s3cr3t") {
			t.Errorf("log record shows the token: %+v", r)
		}
	}
}

func TestConnectNKey(t *testing.T) {
	t.Parallel()
	ukp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := ukp.PublicKey()
	seed, _ := ukp.Seed()
	opts := natstest.Options(t)
	opts.Nkeys = []*server.NkeyUser{{Nkey: pub}}
	s := natstest.Start(t, opts)
	dir := t.TempDir()

	cfg := testConfig(s.ClientURL())
	cfg.NKeyFile = writeFile(t, dir, "user.nk", seed)
	roundTrip(t, connectT(t, cfg, nil))

	cfg.NKeyFile = writeFile(t, dir, "garbage.nk", []byte("not a seed\n"))
	if _, err := Dial(cfg, nil); err == nil || !strings.Contains(err.Error(), "garbage.nk") {
		t.Errorf("Dial with a bad seed file = %v, want an error naming the file", err)
	}
}

func TestConnectCreds(t *testing.T) {
	t.Parallel()
	okp, _ := nkeys.CreateOperator()
	opub, _ := okp.PublicKey()
	akp, _ := nkeys.CreateAccount()
	apub, _ := akp.PublicKey()
	ajwt, err := jwt.NewAccountClaims(apub).Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	if err := resolver.Store(apub, ajwt); err != nil {
		t.Fatal(err)
	}
	ukp, _ := nkeys.CreateUser()
	upub, _ := ukp.PublicKey()
	useed, _ := ukp.Seed()
	ujwt, err := jwt.NewUserClaims(upub).Encode(akp)
	if err != nil {
		t.Fatal(err)
	}
	creds, err := jwt.FormatUserConfig(ujwt, useed)
	if err != nil {
		t.Fatal(err)
	}

	opts := natstest.Options(t)
	opts.JetStream = false // operator mode would need account JetStream limits
	opts.TrustedKeys = []string{opub}
	opts.AccountResolver = resolver
	s := natstest.Start(t, opts)
	dir := t.TempDir()

	cfg := testConfig(s.ClientURL())
	cfg.CredsFile = writeFile(t, dir, "user.creds", creds)
	roundTrip(t, connectT(t, cfg, nil))

	cfg.CredsFile = writeFile(t, dir, "bad.creds", []byte("-----BEGIN NATS USER JWT-----\nxx\n------END NATS USER JWT------\n"))
	if _, err := Dial(cfg, nil); err == nil || !strings.Contains(err.Error(), "bad.creds") {
		t.Errorf("Dial with a bad creds file = %v, want an error naming the file", err)
	}

	// A user the account did not sign.
	other, _ := nkeys.CreateAccount()
	ojwt, _ := jwt.NewUserClaims(upub).Encode(other)
	forged, _ := jwt.FormatUserConfig(ojwt, useed)
	cfg.CredsFile = writeFile(t, dir, "forged.creds", forged)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := Connect(ctx, cfg, nil); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("Connect with forged creds = %v, want ErrUnauthorized", err)
	}
}

func TestConnectTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newTestCA(t, "natsconn test CA")
	srvCert, srvKey := ca.issue(t, "server", 2, true)
	cliCert, cliKey := ca.issue(t, "client", 3, false)
	caFile := writeFile(t, dir, "ca.pem", ca.pem)
	otherCAFile := writeFile(t, dir, "other-ca.pem", newTestCA(t, "other CA").pem)
	cliCertFile := writeFile(t, dir, "client.pem", cliCert)
	cliKeyFile := writeFile(t, dir, "client-key.pem", cliKey)

	tlsConfig, err := server.GenTLSConfig(&server.TLSConfigOpts{
		CertFile: writeFile(t, dir, "server.pem", srvCert),
		KeyFile:  writeFile(t, dir, "server-key.pem", srvKey),
		CaFile:   caFile,
		Verify:   true,
	})
	if err != nil {
		t.Fatal(err)
	}
	opts := natstest.Options(t)
	opts.TLSConfig = tlsConfig
	opts.TLSVerify = true
	opts.TLSTimeout = 2
	s := natstest.Start(t, opts)
	if !strings.HasPrefix(s.ClientURL(), "tls://") {
		t.Fatalf("server URL %s is not tls://", s.ClientURL())
	}
	plainURL := strings.Replace(s.ClientURL(), "tls://", "nats://", 1)

	t.Run("verified both ways", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(plainURL) // the TLS files alone ask for TLS
		cfg.TLSCA, cfg.TLSCert, cfg.TLSKey = caFile, cliCertFile, cliKeyFile
		nc := connectT(t, cfg, nil)
		roundTrip(t, nc)
		state, err := nc.TLSConnectionState()
		if err != nil || !state.HandshakeComplete {
			t.Errorf("TLS state = %+v, %v", state, err)
		}
	})
	for _, tc := range []struct {
		name          string
		ca, cert, key string
	}{
		{name: "no client certificate", ca: caFile},
		{name: "unknown server CA", ca: otherCAFile, cert: cliCertFile, key: cliKeyFile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			logs := newCapture(slog.LevelInfo)
			cfg := testConfig(s.ClientURL())
			cfg.TLSCA, cfg.TLSCert, cfg.TLSKey = tc.ca, tc.cert, tc.key
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			defer cancel()
			nc, err := Connect(ctx, cfg, logs.logger())
			if err == nil {
				nc.Close()
				t.Fatal("Connect succeeded")
			}
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Connect = %v, want context.DeadlineExceeded", err)
			}
			// The cause is in the logs, and in the error when nats.go kept it.
			logs.waitFor(t, slog.LevelWarn, "nats: connection attempt failed; retrying")
		})
	}
	t.Run("unknown server CA names the cause", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(s.ClientURL())
		cfg.TLSCA = otherCAFile
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		_, err := Connect(ctx, cfg, nil)
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Errorf("Connect = %v, want x509.UnknownAuthorityError as the last error", err)
		}
	})
	t.Run("CA file not PEM", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(s.ClientURL())
		cfg.TLSCA = cliKeyFile
		if _, err := Dial(cfg, nil); err == nil {
			t.Error("Dial with a key as CA file succeeded")
		}
	})
}

func TestDialBeforeServer(t *testing.T) {
	t.Parallel()
	port := freePort(t)
	logs := newCapture(slog.LevelInfo)
	cfg := testConfig(fmt.Sprintf("nats://127.0.0.1:%d", port))
	nc, err := Dial(cfg, logs.logger())
	if err != nil {
		t.Fatalf("Dial without a server: %v", err)
	}
	t.Cleanup(nc.Close)
	if st := nc.Status(); st != nats.RECONNECTING {
		t.Fatalf("status = %v, want RECONNECTING", st)
	}
	logs.waitFor(t, slog.LevelWarn, "nats: not connected yet; retrying in the background")
	// Publishes are buffered until the server comes.
	sub, err := nc.SubscribeSync("natsconn.early")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("natsconn.early", []byte("early")); err != nil {
		t.Fatal(err)
	}

	opts := natstest.Options(t)
	opts.Port = port
	natstest.Start(t, opts)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := WaitConnected(ctx, nc); err != nil {
		t.Fatalf("WaitConnected: %v", err)
	}
	if msg, err := sub.NextMsg(5 * time.Second); err != nil || string(msg.Data) != "early" {
		t.Errorf("buffered message: %v, %v", msg, err)
	}
	rec := logs.waitFor(t, slog.LevelInfo, "nats: connected")
	if rec.Attrs["failed_attempts"] == "" || rec.Attrs["failed_attempts"] == "0" {
		t.Errorf("connected log %v does not count the failed attempts", rec.Attrs)
	}
	if n := len(logs.records(slog.LevelInfo, "nats: connected")); n != 1 {
		t.Errorf("logged connected %d times", n)
	}
	// Already connected: at once.
	if err := WaitConnected(ctx, nc); err != nil {
		t.Errorf("WaitConnected when connected: %v", err)
	}
}

func TestConnectWithoutServer(t *testing.T) {
	t.Parallel()
	cfg := testConfig(fmt.Sprintf("nats://127.0.0.1:%d", freePort(t)))

	t.Run("deadline", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err := Connect(ctx, cfg, nil)
		if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("Connect = %v, want context.DeadlineExceeded and the last error, ECONNREFUSED", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("Connect returned after %v", d)
		}
	})
	t.Run("canceled before", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if _, err := Connect(ctx, cfg, nil); !errors.Is(err, context.Canceled) {
			t.Errorf("Connect = %v, want context.Canceled", err)
		}
	})
	t.Run("closed while waiting", func(t *testing.T) {
		t.Parallel()
		nc, err := Dial(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(50*time.Millisecond, nc.Close)
		if err := WaitConnected(t.Context(), nc); !errors.Is(err, ErrClosed) {
			t.Errorf("WaitConnected = %v, want ErrClosed", err)
		}
	})
}

// TestReconnectNotification shows the recommended way for a component to
// act after every reconnect: a status listener for nats.CONNECTED.
func TestReconnectNotification(t *testing.T) {
	t.Parallel()
	opts := natstest.Options(t)
	s := natstest.Start(t, opts)
	logs := newCapture(slog.LevelInfo)
	nc := connectT(t, testConfig(s.ClientURL()), logs.logger())

	ch := nc.StatusChanged(nats.CONNECTED)
	defer nc.RemoveStatusListener(ch)

	for i := range 2 {
		s = natstest.Restart(t, s, opts)
		select {
		case st := <-ch:
			if st != nats.CONNECTED {
				t.Fatalf("restart %d: status %v", i, st)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("restart %d: no CONNECTED notification", i)
		}
		roundTrip(t, nc)
	}
	natstest.WaitFor(t, 10*time.Second, "two reconnect logs", func() bool {
		return len(logs.records(slog.LevelInfo, "nats: reconnected")) == 2
	})
	if n := len(logs.records(slog.LevelWarn, "nats: disconnected; reconnecting")); n != 2 {
		t.Errorf("logged %d disconnects, want 2", n)
	}
	rec := logs.records(slog.LevelInfo, "nats: reconnected")[0]
	if rec.Attrs["url"] != s.ClientURL() || rec.Attrs["down_for"] == "" {
		t.Errorf("reconnected log attrs = %v", rec.Attrs)
	}
}

func TestCloseLogsNoDisconnect(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, nil)
	logs := newCapture(slog.LevelDebug)
	nc, err := Connect(t.Context(), testConfig(s.ClientURL()), logs.logger())
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	logs.waitFor(t, slog.LevelInfo, "nats: connection closed")
	for _, r := range logs.all() {
		if r.Level >= slog.LevelWarn {
			t.Errorf("closing on purpose logged %v %q %v", r.Level, r.Msg, r.Attrs)
		}
	}
}
