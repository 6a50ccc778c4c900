package natsconn

import (
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/internal/redact"
)

// DefaultURL is the server a client connects to when told nothing else: the
// embedded server's default address.
const DefaultURL = "nats://127.0.0.1:4222"

// DefaultName is the client name shown by the server (connz, logs).
const DefaultName = "workermon"

// DefaultConnectTimeout bounds one dial and handshake with one server.
const DefaultConnectTimeout = 2 * time.Second

// DefaultPingInterval is how often the client pings the server. With
// DefaultMaxPingsOutstanding a dead or paused server is noticed after about
// three intervals; nats.go's own default of 2 minutes left clients hanging.
const DefaultPingInterval = 2 * time.Second

// DefaultMaxPingsOutstanding is how many unanswered pings make the client
// drop the connection and reconnect.
const DefaultMaxPingsOutstanding = 2

// DefaultReconnectWait is the pause after every server of the list has been
// tried without success, before the next round (nats.go adds a little jitter).
const DefaultReconnectWait = time.Second

// Config configures a workermon NATS client. At most one authentication
// method may be set: CredsFile, NKeyFile, User and Password, Token, or user
// info in the URL. TLS is used when the URL says tls:// or wss://, or when any
// TLS file is given; the files are read again on every reconnect, so
// rotated certificates are picked up.
type Config struct {
	// URL lists the servers, comma-separated (a cluster): nats://, tls://,
	// ws:// or wss://; host:port alone means nats://.
	URL string
	// Name is the client name the server shows.
	Name string

	// CredsFile is a NATS credentials file (user JWT and nkey seed).
	CredsFile string
	// NKeyFile is a file holding a user nkey seed.
	NKeyFile string
	// User and Password authenticate with a user name and password.
	User, Password string
	// Token authenticates with a token.
	Token string

	// TLSCA is a PEM file of the CAs that verify the server, in place of the
	// system roots.
	TLSCA string
	// TLSCert and TLSKey are the PEM client certificate and its key, for
	// servers that verify clients; they go together.
	TLSCert, TLSKey string

	// ConnectTimeout bounds one dial and handshake with one server.
	ConnectTimeout time.Duration
	// PingInterval is how often the server is pinged.
	PingInterval time.Duration
	// MaxPingsOutstanding unanswered pings make the client reconnect.
	MaxPingsOutstanding int
	// ReconnectWait is the pause between rounds of reconnect attempts.
	ReconnectWait time.Duration

	// IgnoreDiscoveredServers keeps the servers a cluster advertises out of
	// the client's server list. Set it for clients outside a containerised
	// cluster, whose servers advertise addresses only reachable inside.
	IgnoreDiscoveredServers bool

	// NoReconnectBuffer makes a publish while disconnected fail at once
	// instead of being buffered and sent after the reconnect: the monitor's
	// connection, so that no stale write or lease renewal is sent late
	// (contract §10).
	NoReconnectBuffer bool

	// InProcess, when not nil, is the server to connect to inside this
	// process (an [Embedded]) instead of over the network: no loopback
	// TCP, no system call and no poller wake-up between a process and its
	// own embedded server. Every (re)connection is made in process; URL
	// only names the server in logs.
	//
	// An in-process connection is a net.Pipe: the server hands over each
	// of its write buffers (a few hundred bytes) synchronously, where a
	// socket takes them all in one system call. It suits a connection
	// that sends and receives a little at a time (the monitor's records,
	// leases and watches), not one that receives a flood (the reports).
	InProcess nats.InProcessConnProvider
}

// DefaultConfig returns the configuration of a client of the embedded
// server's default address.
func DefaultConfig() Config {
	return Config{
		URL:                 DefaultURL,
		Name:                DefaultName,
		ConnectTimeout:      DefaultConnectTimeout,
		PingInterval:        DefaultPingInterval,
		MaxPingsOutstanding: DefaultMaxPingsOutstanding,
		ReconnectWait:       DefaultReconnectWait,
	}
}

// Validate reports every problem of c, joined; each is a [*ConfigError]. It
// also checks that the files named exist and can be read.
func (c Config) Validate() error {
	var p problems
	urlAuth := false
	if strings.TrimSpace(c.URL) == "" {
		p.add("URL", "empty")
	} else {
		for _, raw := range strings.Split(c.URL, ",") {
			u, err := parseServerURL(raw)
			if err != nil {
				p.add("URL", "%v", err)
				continue
			}
			if u.User != nil {
				urlAuth = true
			}
		}
	}

	var methods []string
	if c.CredsFile != "" {
		methods = append(methods, "CredsFile")
	}
	if c.NKeyFile != "" {
		methods = append(methods, "NKeyFile")
	}
	if c.User != "" || c.Password != "" {
		methods = append(methods, "User/Password")
	}
	if c.Token != "" {
		methods = append(methods, "Token")
	}
	if urlAuth {
		methods = append(methods, "user info in URL")
	}
	if len(methods) > 1 {
		p.add("auth", "more than one authentication method: %s", strings.Join(methods, ", "))
	}
	if c.User != "" && c.Password == "" {
		p.add("Password", "empty while User is set")
	}
	if c.User == "" && c.Password != "" {
		p.add("User", "empty while Password is set")
	}
	if c.TLSCert != "" && c.TLSKey == "" {
		p.add("TLSKey", "empty while TLSCert is set")
	}
	if c.TLSCert == "" && c.TLSKey != "" {
		p.add("TLSCert", "empty while TLSKey is set")
	}
	for _, f := range []struct{ field, path string }{
		{"CredsFile", c.CredsFile},
		{"NKeyFile", c.NKeyFile},
		{"TLSCA", c.TLSCA},
		{"TLSCert", c.TLSCert},
		{"TLSKey", c.TLSKey},
	} {
		if f.path == "" {
			continue
		}
		if err := checkReadable(f.path); err != nil {
			p.add(f.field, "%v", err)
		}
	}

	if c.ConnectTimeout <= 0 {
		p.add("ConnectTimeout", "%v is not positive", c.ConnectTimeout)
	}
	if c.PingInterval <= 0 {
		p.add("PingInterval", "%v is not positive", c.PingInterval)
	}
	if c.MaxPingsOutstanding < 1 {
		p.add("MaxPingsOutstanding", "%d is below 1", c.MaxPingsOutstanding)
	}
	if c.ReconnectWait <= 0 {
		p.add("ReconnectWait", "%v is not positive", c.ReconnectWait)
	}
	return p.err()
}

// parseServerURL parses one entry of Config.URL the way nats.go reads it.
func parseServerURL(raw string) (*url.URL, error) {
	s := strings.TrimSpace(raw)
	if s == "" {
		return nil, fmt.Errorf("empty entry in server list")
	}
	if !strings.Contains(s, "://") {
		s = "nats://" + s
	}
	u, err := redact.Parse(s) // url.Parse's error would quote the password
	if err != nil {
		return nil, err
	}
	switch u.Scheme {
	case "nats", "tls", "ws", "wss":
	default:
		return nil, fmt.Errorf("%s: scheme %q is not nats, tls, ws or wss", redact.URL(s), u.Scheme)
	}
	if u.Hostname() == "" {
		return nil, fmt.Errorf("%s: no host", redact.URL(s))
	}
	return u, nil
}

// checkReadable reports why path cannot be read as a regular file.
func checkReadable(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return err
	}
	if info.IsDir() {
		return fmt.Errorf("%s is a directory", path)
	}
	return nil
}

// ConnectedURL returns the URL of the server nc is connected to, its user
// info hidden (nats.go's ConnectedUrlRedacted shows a token given as the
// user in clear); empty when nc is not connected.
func ConnectedURL(nc *nats.Conn) string {
	return redact.URL(nc.ConnectedUrl())
}

// authMethod names the authentication method of a valid c, for logs.
func (c Config) authMethod() string {
	switch {
	case c.CredsFile != "":
		return "creds"
	case c.NKeyFile != "":
		return "nkey"
	case c.User != "":
		return "user/password"
	case c.Token != "":
		return "token"
	case strings.Contains(c.URL, "@"):
		return "url user info"
	}
	return "none"
}
