package natsconn

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/workermon/workermon/internal/natstest"
)

func TestTooOld(t *testing.T) {
	for _, tc := range []struct {
		version string
		old     bool
	}{
		{"2.9.10", true},
		{"2.9.25", true},
		{"1.4.1", true},
		{"2.10.0", false},
		{"2.10.29", false},
		{"2.11.0-RC.1", false},
		{"2.15.2", false},
		{"3.0.0", false},
		{"", false},          // not told: let through
		{"dev-build", false}, // unreadable: let through
		{"2.x.1", false},     // unreadable: let through
		{"2.8.4-beta", true}, // a pre-release of an old line
		{"12.0.0", false},    // far future
		{"2.100.0", false},   // numbers, not strings, compare
		{"2.2.0", true},      // and not as a prefix of 2.20
		{"2.20.0", false},
	} {
		if got := tooOld(tc.version); got != tc.old {
			t.Errorf("tooOld(%q) = %v, want %v", tc.version, got, tc.old)
		}
	}
}

// TestCheckServer: a JetStream server passes; one with JetStream off is
// refused with one line naming what is missing and the version needed.
func TestCheckServer(t *testing.T) {
	s := natstest.Start(t, nil)
	nc := natstest.Connect(t, s)
	if err := CheckServer(t.Context(), nc); err != nil {
		t.Errorf("JetStream server %s refused: %v", nc.ConnectedServerVersion(), err)
	}

	opts := natstest.Options(t)
	opts.JetStream = false
	plain := natstest.Start(t, opts)
	nc2 := natstest.Connect(t, plain)
	err := CheckServer(t.Context(), nc2)
	if !errors.Is(err, ErrServerUnsupported) {
		t.Fatalf("server without JetStream: err = %v, want ErrServerUnsupported", err)
	}
	msg := err.Error()
	for _, want := range []string{"JetStream is disabled", nc2.ConnectedServerVersion(), MinServerVersion, "-js"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not name %q", msg, want)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error %q is more than one line", msg)
	}
}

// TestServerInfo: the collector exports the connected server's version.
func TestServerInfo(t *testing.T) {
	s := natstest.Start(t, nil)
	nc := natstest.Connect(t, s)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(ServerInfo(nc))
	want := `# HELP workermon_nats_server_info The NATS server this process is connected to: 1, with its version (empty while disconnected).
# TYPE workermon_nats_server_info gauge
workermon_nats_server_info{version="` + nc.ConnectedServerVersion() + `"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "workermon_nats_server_info"); err != nil {
		t.Error(err)
	}
	if nc.ConnectedServerVersion() == "" {
		t.Error("no server version while connected")
	}
}
