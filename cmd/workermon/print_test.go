package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/overrides"
)

// hostileModels are model names a publisher may send (valid UTF-8 or not:
// the monitor refuses invalid ones, but these printers do not rely on it)
// that a terminal would act on if printed raw.
var hostileModels = []string{
	"\x1b[2J\x1b[Hclear/screen", // clear the screen, cursor home
	"fake\nok-model  no  0 []",  // a faked row
	"tab\tcolumn",
	"bell\a",
	"csi\u009b31m",   // C1 control introducer
	"rtl\u202eledom", // right-to-left override
	"bad\xff\xfeutf8",
}

// checkEscaped fails when out holds a control byte other than the row
// ends, more lines than rows, or a hostile name raw.
func checkEscaped(t *testing.T, what, out string, rows int) {
	t.Helper()
	if n := strings.Count(out, "\n"); n != rows {
		t.Errorf("%s: %d lines, want %d:\n%s", what, n, rows, out)
	}
	for _, r := range strings.ReplaceAll(out, "\n", "") {
		if r < ' ' || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == '\u202e' || r == '\ufffd' {
			t.Errorf("%s: raw %U in the output:\n%q", what, r, out)
			break
		}
	}
	for _, m := range hostileModels {
		if strings.Contains(out, m) {
			t.Errorf("%s: model %q printed raw", what, m)
		}
	}
}

// TestPrintersEscapeModelNames: `workermon status`, `thresholds get` and
// `cordon list` print model names escaped as `watch` does (issue 23, item
// 25), so that a name cannot clear the screen or fake rows.
func TestPrintersEscapeModelNames(t *testing.T) {
	t.Parallel()
	var records []api.Record
	var thresholds []api.ModelThresholds
	var cordons []overrides.Cordon
	for i, m := range append([]string{"Qwen/Qwen3-0.6B"}, hostileModels...) {
		records = append(records, api.Record{Model: m, Free: []uint64{uint64(i)}})
		thresholds = append(thresholds, api.ModelThresholds{Model: m})
		cordons = append(cordons, overrides.Cordon{Model: m, WorkerID: uint64(i)})
	}
	rows := len(hostileModels) + 2 // a header, the plain model, the hostile ones
	var b bytes.Buffer
	if err := printStatus(&b, records); err != nil {
		t.Fatal(err)
	}
	checkEscaped(t, "status", b.String(), rows)
	if !strings.Contains(b.String(), "\nQwen/Qwen3-0.6B ") {
		t.Errorf("status: a plain name is not printed as it is:\n%s", b.String())
	}
	b.Reset()
	if err := printThresholds(&b, thresholds); err != nil {
		t.Fatal(err)
	}
	checkEscaped(t, "thresholds get", b.String(), rows)
	b.Reset()
	if err := printCordons(&b, cordons); err != nil {
		t.Fatal(err)
	}
	checkEscaped(t, "cordon list", b.String(), rows)
}
