package bench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

func TestValidate(t *testing.T) {
	t.Parallel()
	good := DefaultConfig()
	good.Executable, good.Serve = "/bin/workermon", func(string) []string { return nil }
	if err := good.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
	}{
		{"no executable", func(c *Config) { c.Executable = "" }},
		{"no serve", func(c *Config) { c.Serve = nil }},
		{"no reports", func(c *Config) { c.Reports = 0 }},
		{"one flip", func(c *Config) { c.Flips = 1 }},
		{"more rounds than reports", func(c *Config) { c.Reports, c.Rounds = 3, 4 }},
		{"too many workers a model", func(c *Config) { c.Workers, c.Models = 4097, 1 }},
		{"no timeout", func(c *Config) { c.WaitTimeout = 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := good
			tc.mutate(&c)
			if err := c.Validate(); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("Validate = %v, want ErrInvalidConfig", err)
			}
		})
	}
}

func TestParseServeLine(t *testing.T) {
	t.Parallel()
	nats, api, err := parseServeLine("workermon monitor: NATS nats://127.0.0.1:4222, API http://127.0.0.1:8090, board http://127.0.0.1:8090/")
	if err != nil || nats != "nats://127.0.0.1:4222" || api != "http://127.0.0.1:8090" {
		t.Errorf("got %q %q %v", nats, api, err)
	}
	if _, _, err := parseServeLine("level=ERROR msg=boom"); !errors.Is(err, ErrChild) {
		t.Errorf("a line without addresses: %v", err)
	}
}

func TestScrape(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `# HELP workermon_reports_accepted_total Reports applied.
# TYPE workermon_reports_accepted_total counter
workermon_reports_accepted_total{source="engine"} 1500
workermon_reports_accepted_total{source="router"} 25
workermon_reports_accepted_total_other 7
workermon_reports_accepted 9
`)
	}))
	defer srv.Close()
	got, err := scrape(t.Context(), srv.URL, "workermon_reports_accepted_total")
	if err != nil || got != 1525 {
		t.Errorf("scrape = %v, %v; want 1525", got, err)
	}
}

// TestWaitReady polls until the page answers 200, and gives up at the
// deadline.
func TestWaitReady(t *testing.T) {
	t.Parallel()
	calls := make(chan struct{}, 100)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		calls <- struct{}{}
		if len(calls) < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	if err := waitReady(t.Context(), srv.URL, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	never := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer never.Close()
	if err := waitReady(t.Context(), never.URL, 100*time.Millisecond); !errors.Is(err, ErrChild) {
		t.Errorf("never ready: %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := waitReady(ctx, never.URL, 10*time.Second); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
}
