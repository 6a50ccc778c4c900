package main

import (
	"flag"
	"io"
	"strings"
	"testing"
)

// TestSLOPrefillRangeBounded: --slo-prefill-range past 2^53 tokens is
// refused at start with an error naming the flag and the bound.
func TestSLOPrefillRangeBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		value string
		ok    bool
	}{
		{"1024-1048576", true},
		{"1024-9007199254740992", true},
		{"1024-9007199254740993", false},
		{"1024-18446744073709551615", false},
	} {
		o := defaultSLOOptions()
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.flags(fs)
		if err := fs.Parse([]string{"--slo-prefill-range", tc.value}); err != nil {
			t.Fatalf("%s: parse: %v", tc.value, err)
		}
		_, err := o.controllerConfig()
		if tc.ok != (err == nil) {
			t.Errorf("--slo-prefill-range %s: %v", tc.value, err)
			continue
		}
		if err != nil && !(strings.Contains(err.Error(), "--slo-prefill-range") && strings.Contains(err.Error(), "9007199254740992")) {
			t.Errorf("--slo-prefill-range %s: error %q names neither the flag nor the bound", tc.value, err)
		}
	}
}

// TestMaxSLOsFlag: --max-slos below 1 is refused at start.
func TestMaxSLOsFlag(t *testing.T) {
	t.Parallel()
	o := defaultSLOOptions()
	if _, err := o.controllerConfig(); err != nil || o.maxSLOs != 1024 {
		t.Fatalf("defaults: --max-slos %d, %v", o.maxSLOs, err)
	}
	o.maxSLOs = 0
	if _, err := o.controllerConfig(); err == nil || !strings.Contains(err.Error(), "--max-slos") {
		t.Errorf("--max-slos 0: %v", err)
	}
}
