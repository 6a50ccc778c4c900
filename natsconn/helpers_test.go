package natsconn

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/internal/natstest"
)

// configFields returns the fields of the ConfigErrors joined in err.
func configFields(t *testing.T, err error) []string {
	t.Helper()
	if err == nil {
		return nil
	}
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	} else {
		errs = []error{err}
	}
	var fields []string
	for _, e := range errs {
		var ce *ConfigError
		if !errors.As(e, &ce) {
			t.Fatalf("%v is not a *ConfigError", e)
		}
		if !errors.Is(e, ErrInvalidConfig) {
			t.Fatalf("%v does not match ErrInvalidConfig", e)
		}
		fields = append(fields, ce.Field)
	}
	slices.Sort(fields)
	return fields
}

// logRecord is one log record kept by capture.
type logRecord struct {
	Level slog.Level
	Msg   string
	Attrs map[string]string
}

// capture is a slog.Handler that keeps every record, for assertions.
type capture struct {
	store *captureStore
	attrs []slog.Attr
	level slog.Level
}

type captureStore struct {
	mu   sync.Mutex
	recs []logRecord
}

func newCapture(level slog.Level) *capture {
	return &capture{store: &captureStore{}, level: level}
}

func (c *capture) logger() *slog.Logger { return slog.New(c) }

func (c *capture) Enabled(_ context.Context, l slog.Level) bool { return l >= c.level }

func (c *capture) Handle(_ context.Context, r slog.Record) error {
	rec := logRecord{Level: r.Level, Msg: r.Message, Attrs: map[string]string{}}
	for _, a := range c.attrs {
		rec.Attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool {
		rec.Attrs[a.Key] = a.Value.String()
		return true
	})
	c.store.mu.Lock()
	defer c.store.mu.Unlock()
	c.store.recs = append(c.store.recs, rec)
	return nil
}

func (c *capture) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &capture{store: c.store, attrs: append(slices.Clip(c.attrs), attrs...), level: c.level}
}

func (c *capture) WithGroup(string) slog.Handler { return c }

// records returns the records with the level and message.
func (c *capture) records(level slog.Level, msg string) []logRecord {
	c.store.mu.Lock()
	defer c.store.mu.Unlock()
	var out []logRecord
	for _, r := range c.store.recs {
		if r.Level == level && r.Msg == msg {
			out = append(out, r)
		}
	}
	return out
}

// all returns every record kept.
func (c *capture) all() []logRecord {
	c.store.mu.Lock()
	defer c.store.mu.Unlock()
	return slices.Clone(c.store.recs)
}

// waitFor polls until a record with the level and message was logged.
func (c *capture) waitFor(t *testing.T, level slog.Level, msg string) logRecord {
	t.Helper()
	var rec logRecord
	natstest.WaitFor(t, 10*time.Second, fmt.Sprintf("log %v %q", level, msg), func() bool {
		recs := c.records(level, msg)
		if len(recs) == 0 {
			return false
		}
		rec = recs[0]
		return true
	})
	return rec
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// writeFile writes content to name in dir and returns the path.
func writeFile(t *testing.T, dir, name string, content []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns the PEM certificate and PKCS#8 key of a leaf signed by ca:
// a server certificate for 127.0.0.1, or a client certificate.
func (ca *testCA) issue(t *testing.T, name string, serial int64, server bool) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
		tmpl.DNSNames = []string{"localhost"}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	pk, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pk})
}
