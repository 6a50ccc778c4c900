package natsconn

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := writeFile(t, dir, "file.pem", []byte("x"))
	missing := filepath.Join(dir, "missing.pem")

	tests := []struct {
		name   string
		modify func(*Config)
		fields []string // the fields reported, sorted; none = valid
	}{
		{name: "default", modify: func(*Config) {}},
		{name: "cluster list", modify: func(c *Config) { c.URL = "nats://10.0.0.1:4222, 10.0.0.2:4222,tls://n3:4222" }},
		{name: "websocket", modify: func(c *Config) { c.URL = "wss://nats.example.com:443" }},
		{name: "user and password", modify: func(c *Config) { c.User, c.Password = "a", "b" }},
		{name: "token", modify: func(c *Config) { c.Token = "t" }},
		{name: "user info in URL", modify: func(c *Config) { c.URL = "nats://a:b@127.0.0.1:4222" }},
		{name: "creds file", modify: func(c *Config) { c.CredsFile = file }},
		{name: "nkey file", modify: func(c *Config) { c.NKeyFile = file }},
		{name: "tls files", modify: func(c *Config) { c.TLSCA, c.TLSCert, c.TLSKey = file, file, file }},
		{name: "tls CA only", modify: func(c *Config) { c.TLSCA = file }},
		{name: "tls and token", modify: func(c *Config) { c.TLSCA, c.Token = file, "t" }},
		{name: "ignore discovered servers", modify: func(c *Config) { c.IgnoreDiscoveredServers = true }},

		{name: "empty URL", modify: func(c *Config) { c.URL = " " }, fields: []string{"URL"}},
		{name: "bad scheme", modify: func(c *Config) { c.URL = "http://127.0.0.1:4222" }, fields: []string{"URL"}},
		{name: "empty list entry", modify: func(c *Config) { c.URL = "nats://a:4222,,nats://b:4222" }, fields: []string{"URL"}},
		{name: "no host", modify: func(c *Config) { c.URL = "nats://:4222" }, fields: []string{"URL"}},
		{name: "bad port", modify: func(c *Config) { c.URL = "nats://a:port" }, fields: []string{"URL"}},
		{name: "two bad entries", modify: func(c *Config) { c.URL = "http://a,nats://:1" }, fields: []string{"URL", "URL"}},
		{name: "creds and user", modify: func(c *Config) { c.CredsFile, c.User, c.Password = file, "a", "b" }, fields: []string{"auth"}},
		{name: "nkey and token", modify: func(c *Config) { c.NKeyFile, c.Token = file, "t" }, fields: []string{"auth"}},
		{name: "creds and nkey", modify: func(c *Config) { c.CredsFile, c.NKeyFile = file, file }, fields: []string{"auth"}},
		{name: "URL user info and token", modify: func(c *Config) { c.URL, c.Token = "nats://u:p@h:4222", "t" }, fields: []string{"auth"}},
		{name: "user without password", modify: func(c *Config) { c.User = "a" }, fields: []string{"Password"}},
		{name: "password without user", modify: func(c *Config) { c.Password = "b" }, fields: []string{"User"}},
		{name: "token and password only", modify: func(c *Config) { c.Token, c.Password = "t", "b" }, fields: []string{"User", "auth"}},
		{name: "cert without key", modify: func(c *Config) { c.TLSCert = file }, fields: []string{"TLSKey"}},
		{name: "key without cert", modify: func(c *Config) { c.TLSKey = file }, fields: []string{"TLSCert"}},
		{name: "missing CA", modify: func(c *Config) { c.TLSCA = missing }, fields: []string{"TLSCA"}},
		{name: "missing cert and key", modify: func(c *Config) { c.TLSCert, c.TLSKey = missing, missing }, fields: []string{"TLSCert", "TLSKey"}},
		{name: "missing creds", modify: func(c *Config) { c.CredsFile = missing }, fields: []string{"CredsFile"}},
		{name: "creds is a directory", modify: func(c *Config) { c.CredsFile = dir }, fields: []string{"CredsFile"}},
		{name: "missing nkey", modify: func(c *Config) { c.NKeyFile = missing }, fields: []string{"NKeyFile"}},
		{name: "zero connect timeout", modify: func(c *Config) { c.ConnectTimeout = 0 }, fields: []string{"ConnectTimeout"}},
		{name: "negative ping interval", modify: func(c *Config) { c.PingInterval = -time.Second }, fields: []string{"PingInterval"}},
		{name: "zero max pings", modify: func(c *Config) { c.MaxPingsOutstanding = 0 }, fields: []string{"MaxPingsOutstanding"}},
		{name: "zero reconnect wait", modify: func(c *Config) { c.ReconnectWait = 0 }, fields: []string{"ReconnectWait"}},
		{name: "zero value", modify: func(c *Config) { *c = Config{} },
			fields: []string{"ConnectTimeout", "MaxPingsOutstanding", "PingInterval", "ReconnectWait", "URL"}},
		{name: "everything wrong", modify: func(c *Config) {
			*c = Config{URL: "ftp://x", CredsFile: missing, Token: "t", TLSCert: file,
				ConnectTimeout: -1, PingInterval: -1, ReconnectWait: -1, MaxPingsOutstanding: -1}
		}, fields: []string{"ConnectTimeout", "CredsFile", "MaxPingsOutstanding", "PingInterval", "ReconnectWait", "TLSKey", "URL", "auth"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := DefaultConfig()
			tt.modify(&cfg)
			err := cfg.Validate()
			if got := configFields(t, err); !slices.Equal(got, tt.fields) {
				t.Errorf("Validate() = %v\nfields %q, want %q", err, got, tt.fields)
			}
		})
	}
}

func TestDefaultConfig(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	want := Config{
		URL:                 "nats://127.0.0.1:4222",
		Name:                "workermon",
		ConnectTimeout:      2 * time.Second,
		PingInterval:        2 * time.Second,
		MaxPingsOutstanding: 2,
		ReconnectWait:       time.Second,
	}
	if cfg != want {
		t.Errorf("DefaultConfig() = %+v, want %+v", cfg, want)
	}
}

// TestValidateHidesSecrets: a server list Validate refuses is named in its
// errors without its password or token, even where url.Parse's own error
// quotes the raw URL.
func TestValidateHidesSecrets(t *testing.T) {
	t.Parallel()
	for _, u := range []string{
		"nats://user:s3cr3t@host:42x22",
		"nats://a:4222, nats://user:s3cr3t@host:42x22",
		"user:s3cr3t@host:42x22",
		"nats://s3cr3t@host:42x22",
		"nats://user:s3%zzcr3t@host:4222",
		"ftp://user:s3cr3t@host:4222",
		"nats://user:s3cr3t@:4222",
	} {
		cfg := DefaultConfig()
		cfg.URL = u
		err := cfg.Validate()
		if !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("Validate(URL %q) = %v, want ErrInvalidConfig", u, err)
			continue
		}
		if strings.Contains(err.Error(), "s3cr3t") || strings.Contains(err.Error(), "%zz") {
			t.Errorf("Validate(URL %q) = %q: shows the secret", u, err)
		}
	}
}

func TestEmbeddedConfigValidate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	tests := []struct {
		name   string
		modify func(*EmbeddedConfig)
		fields []string
	}{
		{name: "default", modify: func(*EmbeddedConfig) {}},
		{name: "random port", modify: func(c *EmbeddedConfig) { c.Addr = "127.0.0.1:0" }},
		{name: "all interfaces", modify: func(c *EmbeddedConfig) { c.Addr = ":4222" }},
		{name: "ipv6", modify: func(c *EmbeddedConfig) { c.Addr = "[::1]:4222" }},
		{name: "monitoring", modify: func(c *EmbeddedConfig) { c.MonitorAddr = "127.0.0.1:8222" }},
		{name: "both random", modify: func(c *EmbeddedConfig) { c.Addr, c.MonitorAddr = "127.0.0.1:0", "127.0.0.1:0" }},

		{name: "empty addr", modify: func(c *EmbeddedConfig) { c.Addr = "" }, fields: []string{"Addr"}},
		{name: "no port", modify: func(c *EmbeddedConfig) { c.Addr = "127.0.0.1" }, fields: []string{"Addr"}},
		{name: "port too large", modify: func(c *EmbeddedConfig) { c.Addr = "127.0.0.1:65536" }, fields: []string{"Addr"}},
		{name: "negative port", modify: func(c *EmbeddedConfig) { c.Addr = "127.0.0.1:-1" }, fields: []string{"Addr"}},
		{name: "named port", modify: func(c *EmbeddedConfig) { c.Addr = "127.0.0.1:nats" }, fields: []string{"Addr"}},
		{name: "bad monitor addr", modify: func(c *EmbeddedConfig) { c.MonitorAddr = "8222" }, fields: []string{"MonitorAddr"}},
		{name: "monitor on client addr", modify: func(c *EmbeddedConfig) { c.MonitorAddr = c.Addr }, fields: []string{"MonitorAddr"}},
		{name: "empty data dir", modify: func(c *EmbeddedConfig) { c.DataDir = "" }, fields: []string{"DataDir"}},
		{name: "empty server name", modify: func(c *EmbeddedConfig) { c.ServerName = "" }, fields: []string{"ServerName"}},
		{name: "server name with space", modify: func(c *EmbeddedConfig) { c.ServerName = "my server" }, fields: []string{"ServerName"}},
		{name: "zero ready timeout", modify: func(c *EmbeddedConfig) { c.ReadyTimeout = 0 }, fields: []string{"ReadyTimeout"}},
		{name: "zero value", modify: func(c *EmbeddedConfig) { *c = EmbeddedConfig{} },
			fields: []string{"Addr", "DataDir", "ReadyTimeout", "ServerName"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := DefaultEmbeddedConfig()
			cfg.DataDir = dir // the default depends on $HOME
			tt.modify(&cfg)
			err := cfg.Validate()
			if got := configFields(t, err); !slices.Equal(got, tt.fields) {
				t.Errorf("Validate() = %v\nfields %q, want %q", err, got, tt.fields)
			}
		})
	}
}

func TestDefaultEmbeddedConfig(t *testing.T) {
	t.Parallel()
	cfg := DefaultEmbeddedConfig()
	if cfg.Addr != "127.0.0.1:4222" || cfg.ServerName != "workermon" || cfg.MonitorAddr != "" ||
		cfg.ReadyTimeout != 10*time.Second || cfg.Logger != nil {
		t.Errorf("DefaultEmbeddedConfig() = %+v", cfg)
	}
	if cache, err := os.UserCacheDir(); err == nil {
		if want := filepath.Join(cache, "workermon"); cfg.DataDir != want {
			t.Errorf("DataDir = %q, want %q", cfg.DataDir, want)
		}
	}
}
