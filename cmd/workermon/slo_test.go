package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/overrides"
)

// publishLatency publishes one router window of worker with n ITL samples
// of itlMs each.
func publishLatency(t *testing.T, nc *nats.Conn, model string, worker uint64, n uint64, itlMs float64, rejected uint64) {
	t.Helper()
	r := events.LatencyReport{Model: model, WorkerID: worker, Source: "router/e2e", WindowMs: 1000,
		ITL:      []events.LatencyBucket{{K: events.LatencyBucketOf(itlMs), N: n}},
		Rejected: rejected, SentAt: time.Now().UnixNano()}
	data, err := events.MarshalLatencyReport(&r)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(events.LatrSubject(events.DefaultSubjectPrefix, model, worker), data); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestSLOEnforce runs `workermon serve` with an enforced SLO: the
// controller starts at the top of the decode range (no override), lowers
// the threshold while the routers' windows miss the ITL target, answers 409
// to a threshold change and controlled_by to a get, writes its status to
// the workermon-slo bucket; deleting the SLO brings the override back at
// once.
func TestSLOEnforce(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.adminToken = e2eToken
		o.slo.interval = 100 * time.Millisecond
	})
	nc, busy := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 50, 100)
	knownBy(t, svc, e2eModel)
	code, _, body := call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`","active_decode_blocks_threshold":0.7}`)
	if code != http.StatusOK {
		t.Fatalf("override = %d %s", code, body)
	}

	code, _, body = call(t, svc, "POST", "/slo", e2eToken, `{"model":"`+e2eModel+`","itl_ms":50}`)
	if code != http.StatusOK {
		t.Fatalf("POST /slo = %d %s", code, body)
	}
	// The controller starts from the override (0.7) and lowers while every
	// sample misses 50 ms.
	natstest.WaitFor(t, 10*time.Second, "decode threshold lowered by the controller", func() bool {
		publishLatency(t, nc, e2eModel, 7, 100, 200, 0)
		b, ok := record(t, busy, e2eModel)
		return ok && b.Thresholds.ActiveDecodeBlocks != nil && *b.Thresholds.ActiveDecodeBlocks < 0.7 &&
			b.Thresholds.ActivePrefillTokensFrac == nil
	})
	// The leading thresholds (§21) are the controller's too: unset, they
	// start at the tops of their ranges, and the record carries them.
	if b, _ := record(t, busy, e2eModel); b.Thresholds.KVCommitted == nil || *b.Thresholds.KVCommitted != 2 ||
		b.Thresholds.QueueDelayMs == nil || *b.Thresholds.QueueDelayMs != 60000 {
		t.Fatalf("record's thresholds %+v: want kv_committed 2 and queue_delay 60000 from the controller", b.Thresholds)
	}
	for _, field := range []string{`"kv_committed_threshold":1`, `"queue_delay_threshold_ms":500`} {
		code, _, body = call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`",`+field+`}`)
		if code != http.StatusConflict {
			t.Fatalf("setting %s under the SLO = %d %s, want 409", field, code, body)
		}
	}
	code, _, body = call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`","active_decode_blocks_threshold":0.9}`)
	if code != http.StatusConflict || !strings.Contains(string(body), "SLO") {
		t.Fatalf("setting POST under the SLO = %d %s, want 409", code, body)
	}
	if code, _, _ = call(t, svc, "DELETE", "/busy_threshold?model="+e2eModel, e2eToken, ""); code != http.StatusConflict {
		t.Fatalf("DELETE under the SLO = %d, want 409", code)
	}
	code, _, body = call(t, svc, "POST", "/busy_threshold", "", `{"model":"`+e2eModel+`"}`)
	if code != http.StatusOK || !strings.Contains(string(body), `"controlled_by":"slo"`) ||
		!strings.Contains(string(body), `"kv_committed_threshold":2`) || !strings.Contains(string(body), `"queue_delay_threshold_ms":60000`) {
		t.Fatalf("get-only POST = %d %s, want the controller's four thresholds", code, body)
	}
	// The status is in the bucket, written by this monitor.
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(t.Context(), overrides.SLOBucket)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(t.Context(), events.ModelKey(e2eModel)+".status")
	if err != nil {
		t.Fatal(err)
	}
	var st overrides.SLOStatus
	if err := json.Unmarshal(e.Value(), &st); err != nil || st.Applied == nil || st.Epoch == 0 || st.MonitorID == "" {
		t.Fatalf("status %s: %v", e.Value(), err)
	}
	code, _, body = call(t, svc, "GET", "/slo?model="+e2eModel, "", "")
	if code != http.StatusOK || !strings.Contains(string(body), `"mode":"enforce"`) {
		t.Fatalf("GET /slo = %d %s", code, body)
	}

	// Delete: the override applies again at once.
	if code, _, body = call(t, svc, "DELETE", "/slo?model="+e2eModel, e2eToken, ""); code != http.StatusOK {
		t.Fatalf("DELETE /slo = %d %s", code, body)
	}
	natstest.WaitFor(t, 5*time.Second, "override back", func() bool {
		b, _ := record(t, busy, e2eModel)
		return b.Thresholds.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.7)})
	})
}

// runSLOCmd runs the command in process and returns its exit code and
// outputs.
func runSLOCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut strings.Builder
	code := run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// TestSLOCommand: `workermon slo set|get|delete` against a running monitor.
func TestSLOCommand(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { o.adminToken = e2eToken })
	base := []string{"--monitor-url", "http://" + svc.httpAddr}
	code, out, errOut := runSLOCmd(t, append([]string{"slo", "set", "--model", "m/x", "--itl-ms", "40", "--mode", "shadow", "--admin-token", e2eToken}, base...)...)
	if code != 0 || !strings.Contains(out, "shadow") {
		t.Fatalf("slo set: %d %s %s", code, out, errOut)
	}
	code, out, _ = runSLOCmd(t, append([]string{"slo", "get", "--json"}, base...)...)
	if code != 0 || !strings.Contains(out, `"itl_ms": 40`) {
		t.Fatalf("slo get: %d %s", code, out)
	}
	code, out, _ = runSLOCmd(t, append([]string{"status"}, base...)...)
	if code != 0 || !strings.Contains(out, "m/x") || !strings.Contains(out, "shadow") {
		t.Fatalf("status does not show the SLO: %d %s", code, out)
	}
	if code, _, _ = runSLOCmd(t, append([]string{"slo", "set", "--model", "m/x"}, base...)...); code != 2 {
		t.Errorf("slo set without a target: exit %d, want 2", code)
	}
	if code, _, errOut = runSLOCmd(t, append([]string{"slo", "delete", "--model", "m/x"}, base...)...); code == 0 {
		t.Errorf("slo delete without the token: exit 0 (%s)", errOut)
	}
	if code, out, errOut = runSLOCmd(t, append([]string{"slo", "delete", "--model", "m/x", "--admin-token", e2eToken}, base...)...); code != 0 {
		t.Fatalf("slo delete: %d %s %s", code, out, errOut)
	}
}

// TestSLOSetWarnsBelowObserved: `workermon slo set` with a target below
// the best the model's fleet has shown (here every ITL sample is 60 ms)
// sets the SLO, exits 0 and warns on stderr; a target the fleet has met
// does not warn, and GET /slo shows the observed latency.
func TestSLOSetWarnsBelowObserved(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.adminToken = e2eToken
		o.slo.interval = 100 * time.Millisecond
	})
	nc, _ := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 50, 100)
	knownBy(t, svc, e2eModel)
	base := []string{"--monitor-url", "http://" + svc.httpAddr, "--admin-token", e2eToken, "--model", e2eModel}
	set := func(args ...string) (int, string, string) {
		return runSLOCmd(t, append(append([]string{"slo", "set"}, base...), args...)...)
	}
	// A loose target, in shadow, until the monitor has a window of the
	// fleet's ITL.
	if code, out, errOut := set("--itl-ms", "1000", "--mode", "shadow"); code != 0 || errOut != "" {
		t.Fatalf("slo set: %d %s %s", code, out, errOut)
	}
	var reply struct {
		Observed *struct {
			Windows uint64             `json:"windows"`
			ITLms   map[string]float64 `json:"itl_ms"`
		} `json:"observed"`
	}
	natstest.WaitFor(t, 10*time.Second, "the fleet's ITL observed", func() bool {
		publishLatency(t, nc, e2eModel, 7, 100, 60, 0)
		code, _, body := call(t, svc, "GET", "/slo?model="+e2eModel, "", "")
		return code == http.StatusOK && json.Unmarshal(body, &reply) == nil && reply.Observed != nil && reply.Observed.ITLms["p90"] > 0
	})
	if p90 := reply.Observed.ITLms["p90"]; p90 < 55 || p90 > 66 {
		t.Errorf("observed ITL p90 %v ms, want about 60", p90)
	}

	code, out, errOut := set("--itl-ms", "50", "--mode", "shadow")
	if code != 0 || !strings.Contains(out, "shadow") {
		t.Fatalf("slo set below the observed: exit %d, want 0 and the SLO set: %s %s", code, out, errOut)
	}
	if !strings.Contains(errOut, "warning: --itl-ms 50 is below the best ITL") || !strings.Contains(errOut, "p90") {
		t.Errorf("no warning on stderr for a target below the fleet's best: %q", errOut)
	}
	code, out, _ = runSLOCmd(t, "slo", "get", "--json", "--monitor-url", "http://"+svc.httpAddr, "--model", e2eModel)
	if code != 0 || !strings.Contains(out, `"itl_ms": 50`) {
		t.Errorf("the SLO is not set after the warning: %d %s", code, out)
	}
	if code, _, errOut = set("--itl-ms", "80", "--mode", "shadow"); code != 0 || errOut != "" {
		t.Errorf("a target the fleet meets: exit %d, stderr %q; want 0 and nothing", code, errOut)
	}
}
