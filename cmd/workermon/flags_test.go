package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

func TestParseFlagsFromEnv(t *testing.T) {
	o := defaultServeOptions()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	o.flags(fs)
	t.Setenv("WORKERMON_STALE_AFTER", "3s")
	t.Setenv("WORKERMON_ACTIVE_DECODE_BLOCKS_THRESHOLD", "0.75")
	t.Setenv("WORKERMON_GONE_AFTER", "30s")
	t.Setenv("NATS_URL", "nats://example:4222")
	if err := parseFlags(fs, []string{"--gone-after", "45s"}, io.Discard, map[string]string{"NATS_URL": "nats-url"}); err != nil {
		t.Fatal(err)
	}
	if o.monitor.StaleAfter != 3*time.Second {
		t.Errorf("stale-after = %v, want 3s from the environment", o.monitor.StaleAfter)
	}
	if o.monitor.GoneAfter != 45*time.Second {
		t.Errorf("gone-after = %v, want 45s: the command line wins", o.monitor.GoneAfter)
	}
	if v := o.monitor.Defaults.ActiveDecodeBlocks; v == nil || *v != 0.75 {
		t.Errorf("decode threshold = %v", v)
	}
	if o.monitor.Defaults.ActivePrefillTokens != nil {
		t.Error("unset threshold is set")
	}
	if o.natsURL != "nats://example:4222" {
		t.Errorf("nats-url = %q", o.natsURL)
	}
}

func TestParseFlagsErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
	}{
		{"bad duration", []string{"--stale-after", "soon"}, nil},
		{"NaN threshold", []string{"--active-decode-blocks-threshold", "NaN"}, nil},
		{"negative tokens", []string{"--active-prefill-tokens-threshold", "-1"}, nil},
		{"bad env", nil, map[string]string{"WORKERMON_MAX_MODELS": "many"}},
		{"stray argument", []string{"extra"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			o := defaultServeOptions()
			fs := flag.NewFlagSet("serve", flag.ContinueOnError)
			o.flags(fs)
			if err := parseFlags(fs, tt.args, io.Discard, nil); !errors.Is(err, errUsage) {
				t.Fatalf("err = %v, want a usage error", err)
			}
		})
	}
}

func TestRunExitCodes(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := run(nil, &out, &errOut); code != 2 {
		t.Errorf("no command: exit %d", code)
	}
	if code := run([]string{"nope"}, &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "unknown command") {
		t.Errorf("unknown command: exit %d, %q", code, errOut.String())
	}
	if code := run([]string{"serve", "--stale-after", "x"}, &out, &errOut); code != 2 {
		t.Errorf("bad flag: exit %d", code)
	}
	if code := run([]string{"serve", "-h"}, &out, &errOut); code != 0 {
		t.Errorf("-h: exit %d", code)
	}
	// Configuration problems are reported before anything starts.
	errOut.Reset()
	if code := run([]string{"serve", "--stale-after", "0s", "--max-models", "0"}, &out, &errOut); code != 2 ||
		!strings.Contains(errOut.String(), "stale-after") || !strings.Contains(errOut.String(), "max-models") {
		t.Errorf("invalid config: exit %d, %q", code, errOut.String())
	}
}

// TestPeriodFlags checks that a zero or negative --interval (it used to
// panic in time.NewTicker) and a negative --duration are usage errors, found
// before anything starts.
func TestPeriodFlags(t *testing.T) {
	for _, tt := range []struct {
		args []string
		flag string
	}{
		{[]string{"load", "--interval", "0s"}, "--interval"},
		{[]string{"load", "--interval", "-1s"}, "--interval"},
		{[]string{"load", "--duration", "-1s"}, "--duration"},
		{[]string{"demo", "--interval", "0s"}, "--interval"},
		{[]string{"demo", "--duration", "-1m"}, "--duration"},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			if code := run(tt.args, &out, &errOut); code != 2 || !strings.Contains(errOut.String(), tt.flag) {
				t.Errorf("exit %d, %q; want 2 and a message about %s", code, errOut.String(), tt.flag)
			}
		})
	}
}

// TestReschedulingTimeoutDefault checks contract §12: an unset
// --rescheduling-timeout is the default cut to half the interval when that
// is shorter, so no legal interval is refused because of a default; a value
// the operator set (flag or environment) must still be below the interval.
func TestReschedulingTimeoutDefault(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     string // WORKERMON_RESCHEDULING_TIMEOUT
		want    time.Duration
		refused bool
	}{
		{name: "off", args: nil, want: DefaultReschedulingTimeout},
		{name: "long interval keeps the default", args: []string{"--rescheduling-interval", "3s"}, want: time.Second},
		{name: "short interval halves it", args: []string{"--rescheduling-interval", "500ms"}, want: 250 * time.Millisecond},
		{name: "interval of twice the default", args: []string{"--rescheduling-interval", "2s"}, want: time.Second},
		{name: "set below the interval", args: []string{"--rescheduling-interval", "3s", "--rescheduling-timeout", "2s"}, want: 2 * time.Second},
		{name: "set not below the interval", args: []string{"--rescheduling-interval", "500ms", "--rescheduling-timeout", "1s"}, refused: true},
		{name: "set to the default, not below", args: []string{"--rescheduling-interval", "800ms", "--rescheduling-timeout", "1s"}, refused: true},
		{name: "set from the environment", args: []string{"--rescheduling-interval", "500ms"}, env: "1s", refused: true},
		{name: "set to zero", args: []string{"--rescheduling-timeout", "0s"}, refused: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.env != "" {
				t.Setenv("WORKERMON_RESCHEDULING_TIMEOUT", tt.env)
			}
			o := defaultServeOptions()
			fs := flag.NewFlagSet("serve", flag.ContinueOnError)
			o.flags(fs)
			if err := parseFlags(fs, tt.args, io.Discard, nil); err != nil {
				t.Fatal(err)
			}
			err := o.validate()
			if tt.refused {
				if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "rescheduling-timeout") {
					t.Fatalf("validate = %v, want the timeout refused", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("validate = %v, want accepted", err)
			}
			if got := o.resched.effectiveTimeout(); got != tt.want {
				t.Errorf("timeout = %v, want %v", got, tt.want)
			}
		})
	}
}
