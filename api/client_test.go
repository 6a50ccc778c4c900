package api

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
)

func TestClient(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testToken, nil)
	f.mon.records = []events.BusySet{{Model: testModel, Free: []uint64{1}}}
	f.mon.workers = []monitor.WorkerRow{{Model: testModel, WorkerID: 1, State: "free"}}
	f.mon.loads = []monitor.LoadRow{{Model: testModel, WorkerID: 1}}
	srv := httptest.NewServer(f.h)
	t.Cleanup(srv.Close)
	ctx := t.Context()

	c, err := NewClient(srv.URL+"/", testToken, srv.Client())
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.SetThresholds(ctx, testModel, events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](64)})
	if err != nil || !got.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](64)}) {
		t.Fatalf("SetThresholds = %+v, %v", got, err)
	}
	if one, err := c.ThresholdsOf(ctx, testModel); err != nil || !one.Equal(got.Thresholds) {
		t.Errorf("ThresholdsOf = %+v, %v", one, err)
	}
	if all, err := c.Thresholds(ctx); err != nil || len(all) != 2 || all[0].Model != testModel {
		t.Errorf("Thresholds = %+v, %v", all, err)
	}
	if del, err := c.DeleteThresholds(ctx, testModel); err != nil || !del.Equal(testDefaults) {
		t.Errorf("DeleteThresholds = %+v, %v", del, err)
	}
	if r, err := c.Records(ctx, testModel); err != nil || len(r) != 1 || r[0].Free[0] != 1 {
		t.Errorf("Records = %+v, %v", r, err)
	}
	if w, err := c.Workers(ctx, ""); err != nil || len(w) != 1 {
		t.Errorf("Workers = %+v, %v", w, err)
	}
	if l, err := c.Loads(ctx, "other"); err != nil || len(l) != 0 {
		t.Errorf("Loads = %+v, %v", l, err)
	}

	// The API's errors come back as a *StatusError with the message.
	anon, _ := NewClient(srv.URL, "", nil)
	_, err = anon.SetThresholds(ctx, testModel, events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)})
	var se *StatusError
	if !errors.As(err, &se) || se.StatusCode != http.StatusUnauthorized || se.Message == "" {
		t.Errorf("SetThresholds without token: %v", err)
	}
	// A reply that is not JSON keeps its text.
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "upstream gateway broke", http.StatusBadGateway)
	}))
	t.Cleanup(plain.Close)
	pc, _ := NewClient(plain.URL, "", nil)
	if _, err := pc.Thresholds(ctx); !errors.As(err, &se) || se.StatusCode != 502 || se.Message != "upstream gateway broke" {
		t.Errorf("plain-text error: %v", err)
	}
	// Nobody listening.
	dead, _ := NewClient("http://127.0.0.1:1", "", nil)
	if _, err := dead.Thresholds(ctx); !errors.Is(err, ErrUnreachable) {
		t.Errorf("unreachable: %v", err)
	}
	for _, bad := range []string{"", "127.0.0.1:8090", "ftp://host", "http://", "::"} {
		if _, err := NewClient(bad, "", nil); err == nil {
			t.Errorf("NewClient(%q) accepted", bad)
		}
	}
}

// TestClientHidesCredentials: the monitor URL's password, or a token given
// as its user, shows in no error of the client (net/http's own error hides
// a password but not a lone user).
func TestClientHidesCredentials(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"http://u:s3cr3t@host:42x22", "ftp://u:s3cr3t@host", "http://s3cr3t@"} {
		_, err := NewClient(bad, "", nil)
		if err == nil || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("NewClient(%q) = %v", bad, err)
		}
	}
	for _, dead := range []string{"http://s3cr3t@127.0.0.1:1", "http://u:s3cr3t@127.0.0.1:1"} {
		c, err := NewClient(dead, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Thresholds(t.Context())
		if !errors.Is(err, ErrUnreachable) || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("unreachable %s: %v", dead, err)
		}
	}
}
