package main

import (
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/workermon/workermon/slo"
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

// TestSLOLeadingRanges: --slo-committed-range and --slo-delay-range (contract
// §21) default to 0.5-2 and 100-60000, reach the controller's config, and a
// bad value is refused at start with an error that names its flag and only
// it.
func TestSLOLeadingRanges(t *testing.T) {
	t.Parallel()
	c, err := defaultSLOOptions().controllerConfig()
	if err != nil || c.CommittedMin != 0.5 || c.CommittedMax != 2 || c.DelayMin != 100 || c.DelayMax != 60000 {
		t.Fatalf("defaults: committed %v-%v, delay %d-%d, %v", c.CommittedMin, c.CommittedMax, c.DelayMin, c.DelayMax, err)
	}
	for _, tc := range []struct {
		flag, value string
		ok          bool
	}{
		{"--slo-committed-range", "0.8-1", true},
		{"--slo-committed-range", "0-1", false},   // a floor of 0 turns the model away at any commitment
		{"--slo-committed-range", "1.5-1", false}, // min above max
		{"--slo-committed-range", "1-4.5", false}, // past kv_committed_threshold's 4
		{"--slo-committed-range", "1", false},     // not MIN-MAX: refused by the parser
		{"--slo-delay-range", "200-2000", true},
		{"--slo-delay-range", "0-2000", false},
		{"--slo-delay-range", "3000-2000", false},
		{"--slo-delay-range", "100-9007199254740993", false},
		{"--slo-delay-range", "-1-2000", false},
	} {
		o := defaultSLOOptions()
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.flags(fs)
		err := fs.Parse([]string{tc.flag, tc.value})
		if err == nil {
			var c slo.Config
			c, err = o.controllerConfig()
			if err == nil && tc.flag == "--slo-committed-range" && c.CommittedMax != o.committed.max {
				t.Errorf("%s %s: the controller got %v-%v", tc.flag, tc.value, c.CommittedMin, c.CommittedMax)
			}
			if err == nil && tc.flag == "--slo-delay-range" && c.DelayMax != o.delay.max {
				t.Errorf("%s %s: the controller got %d-%d", tc.flag, tc.value, c.DelayMin, c.DelayMax)
			}
			if err != nil && (!strings.Contains(err.Error(), tc.flag) || strings.Count(err.Error(), "--slo-") != 1) {
				t.Errorf("%s %s: error %q does not name the flag alone", tc.flag, tc.value, err)
			}
		}
		if tc.ok != (err == nil) {
			t.Errorf("%s %s: %v", tc.flag, tc.value, err)
		}
	}
}
