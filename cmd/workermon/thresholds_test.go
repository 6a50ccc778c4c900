package main

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// runCLI runs the workermon command line and returns its exit code and
// outputs.
func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// spaces collapses runs of blanks, so that tables compare regardless of
// column widths.
var spaces = regexp.MustCompile(`[ \t]+`)

func collapse(s string) string { return spaces.ReplaceAllString(s, " ") }

func TestThresholdsCommand(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { longLived(o); o.adminToken = e2eToken })
	nc, busy := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 50, 100)
	publishReport(t, nc, e2eModel, 8, 90, 100)
	knownBy(t, svc, e2eModel)
	url := "--monitor-url=http://" + svc.httpAddr

	code, out, errOut := runCLI(t, "thresholds", "set", url, "--admin-token", e2eToken, "--model", e2eModel,
		"--active-prefill-tokens-threshold", "2048", "--active-prefill-tokens-threshold-frac", "0.5",
		"--kv-committed-threshold", "1.5", "--queue-delay-threshold-ms", "250")
	if code != 0 {
		t.Fatalf("set: exit %d, %s", code, errOut)
	}
	want := "MODEL DECODE_BLOCKS PREFILL_TOKENS PREFILL_FRAC KV_COMMITTED QUEUE_DELAY_MS\ne2e/model-0.5B 0.8 2048 0.5 1.5 250\n"
	if collapse(out) != want {
		t.Errorf("set printed\n%s\nwant\n%s", out, want)
	}
	natstest.WaitFor(t, 5*time.Second, "record with the override", func() bool {
		b, _ := record(t, busy, e2eModel)
		return b.Thresholds.ActivePrefillTokens != nil && *b.Thresholds.ActivePrefillTokens == 2048 &&
			b.Thresholds.KVCommitted != nil && *b.Thresholds.KVCommitted == 1.5 &&
			b.Thresholds.QueueDelayMs != nil && *b.Thresholds.QueueDelayMs == 250
	})

	if code, out, errOut = runCLI(t, "thresholds", "get", url); code != 0 || !strings.Contains(collapse(out), "e2e/model-0.5B 0.8 2048 0.5 1.5 250") {
		t.Errorf("get: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "thresholds", "get", url, "--model", e2eModel, "--json")
	var one api.ModelThresholds
	if code != 0 || json.Unmarshal([]byte(out), &one) != nil || one.Model != e2eModel || one.ActivePrefillTokens == nil {
		t.Errorf("get --json: exit %d\n%s%s", code, out, errOut)
	}

	code, out, _ = runCLI(t, "status", url)
	// Worker 8 (90 of 100 blocks) is beyond 1.1 × 0.8 of the cache: hard.
	wantStatus := "MODEL ALL_BUSY BUSY HARD FREE AMBER STALE THRESHOLDS\n" +
		"e2e/model-0.5B no 1 [8:kv] 1 [8] 1 [7] 0 0 decode=0.8 prefill=2048 prefill_frac=0.5 kv_committed=1.5 queue_delay_ms=250\n"
	if code != 0 || !strings.HasPrefix(collapse(out), wantStatus) || !strings.Contains(out, "holds 1 of 1 partitions") {
		t.Errorf("status: exit %d\n%s\nwant\n%s", code, out, wantStatus)
	}
	code, out, _ = runCLI(t, "status", url, "--json", "--model", e2eModel)
	var records api.RecordsReply
	if code != 0 || json.Unmarshal([]byte(out), &records) != nil || len(records.Records) != 1 || records.Records[0].Reasons["8"] != "kv" {
		t.Errorf("status --json: exit %d\n%s", code, out)
	}
	if code, out, _ = runCLI(t, "status", url, "--model", "no/such-model"); code != 0 || !strings.Contains(out, "no worker") {
		t.Errorf("status of an unknown model: exit %d %s", code, out)
	}

	if code, out, errOut = runCLI(t, "thresholds", "unset", url, "--admin-token", e2eToken, "--model", e2eModel); code != 0 ||
		!strings.Contains(collapse(out), "e2e/model-0.5B 0.8 off off") {
		t.Errorf("unset: exit %d\n%s%s", code, out, errOut)
	}

	// Errors: the API's message, exit 1; the command line's, exit 2.
	tests := []struct {
		name string
		args []string
		code int
		want string // in stderr
	}{
		{"no token", []string{"thresholds", "set", url, "--model", e2eModel, "--active-decode-blocks-threshold", "0.5"}, 1, "401 Unauthorized: this monitor requires the admin token"},
		{"unknown model", []string{"thresholds", "set", url, "--admin-token", e2eToken, "--model", "no/such-model", "--active-decode-blocks-threshold", "0.5"}, 1, `404 Not Found: model "no/such-model" is not known`},
		{"out of range", []string{"thresholds", "set", url, "--admin-token", e2eToken, "--model", e2eModel, "--active-decode-blocks-threshold", "1.5"}, 1, "out of range"},
		{"unreachable", []string{"thresholds", "get", "--monitor-url", "http://127.0.0.1:1"}, 1, "monitor unreachable"},
		{"no subcommand", []string{"thresholds"}, 2, "missing subcommand"},
		{"unknown subcommand", []string{"thresholds", "show"}, 2, `unknown subcommand "show"`},
		{"set without model", []string{"thresholds", "set", url, "--active-decode-blocks-threshold", "0.5"}, 2, "--model is required"},
		{"set without thresholds", []string{"thresholds", "set", url, "--model", e2eModel}, 2, "give at least one"},
		{"NaN flag", []string{"thresholds", "set", url, "--model", e2eModel, "--active-decode-blocks-threshold", "NaN"}, 2, "not a finite number"},
		{"negative tokens", []string{"thresholds", "set", url, "--model", e2eModel, "--active-prefill-tokens-threshold", "-1"}, 2, "not a non-negative integer"},
		{"unset without model", []string{"thresholds", "unset", url}, 2, "--model is required"},
		{"bad URL", []string{"status", "--monitor-url", "ftp://x"}, 2, "monitor URL"},
		{"extra argument", []string{"status", url, "extra"}, 2, "unexpected arguments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			code, _, errOut := runCLI(t, tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d, stderr %q; want %d with %q", code, errOut, tt.code, tt.want)
			}
		})
	}
}

// TestThresholdsCommandEnv checks that the URL and the token come from the
// environment, and that a serve default in the environment does not leak
// into `thresholds set`.
func TestThresholdsCommandEnv(t *testing.T) {
	svc := testService(t, func(o *serveOptions) { longLived(o); o.adminToken = e2eToken })
	nc, _ := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 50, 100)
	knownBy(t, svc, e2eModel)
	t.Setenv("WORKERMON_MONITOR_URL", "http://"+svc.httpAddr)
	t.Setenv("WORKERMON_ADMIN_TOKEN", e2eToken)
	t.Setenv("WORKERMON_ACTIVE_DECODE_BLOCKS_THRESHOLD", "0.1")
	code, out, errOut := runCLI(t, "thresholds", "set", "--model", e2eModel, "--active-prefill-tokens-threshold", "99")
	if code != 0 {
		t.Fatalf("set: exit %d %s", code, errOut)
	}
	if !strings.Contains(collapse(out), "e2e/model-0.5B 0.8 99 off") {
		t.Errorf("set printed\n%s", out)
	}
	if m, _ := effectiveOf(t, svc, e2eModel); !m.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](99)}) {
		t.Errorf("thresholds %+v", m)
	}
}
