package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
)

const (
	e2eModel = "e2e/model-0.5B"
	e2eToken = "e2e-admin-token"
)

// longLived keeps a single report fresh for the whole test, so that what
// changes a record can only be a threshold, never a new report.
func longLived(o *serveOptions) {
	o.monitor.StaleAfter = 2 * time.Minute
	o.monitor.GoneAfter = 4 * time.Minute
}

// publishReport publishes one engine report of one rank.
func publishReport(t *testing.T, nc *nats.Conn, model string, worker, decode, total uint64) {
	t.Helper()
	data, err := events.MarshalLoadReport(&events.LoadReport{
		Model: model, WorkerID: worker, DPSize: 1, Source: events.SourceEngine,
		ActiveDecodeBlocks: events.Some(decode), KVTotalBlocks: events.Some(total),
		BootID: 1, Seq: uint64(time.Now().UnixNano()), SentAt: time.Now().UnixNano(),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(events.LoadSubject(events.DefaultSubjectPrefix, model, worker, 0), data); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// call sends one request to a monitor's API.
func call(t *testing.T, svc *service, method, target, token, body string) (int, http.Header, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, "http://"+svc.httpAddr+target, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, data
}

// effectiveOf returns a model's entry of GET /busy_threshold, if listed.
func effectiveOf(t *testing.T, svc *service, model string) (api.ModelThresholds, bool) {
	t.Helper()
	code, _, body := call(t, svc, "GET", "/busy_threshold", "", "")
	if code != http.StatusOK {
		t.Fatalf("GET /busy_threshold = %d %s", code, body)
	}
	var reply api.ThresholdsReply
	if err := json.Unmarshal(body, &reply); err != nil {
		t.Fatal(err)
	}
	for _, m := range reply.Thresholds {
		if m.Model == model {
			return m, true
		}
	}
	return api.ModelThresholds{}, false
}

// knownBy waits until the monitor knows model (a get-only POST answers 200).
func knownBy(t *testing.T, svc *service, model string) {
	t.Helper()
	natstest.WaitFor(t, 5*time.Second, model+" known", func() bool {
		code, _, _ := call(t, svc, "POST", "/busy_threshold", "", `{"model":"`+model+`"}`)
		return code == http.StatusOK
	})
}

// TestThresholdsAPI sets, reads and deletes an override on a running
// monitor and checks that the busy record follows at once, with no new
// report.
func TestThresholdsAPI(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { longLived(o); o.adminToken = e2eToken })
	nc, busy := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 50, 100) // 50% < 80% default: free
	natstest.WaitFor(t, 5*time.Second, "worker 7 free", func() bool {
		b, ok := record(t, busy, e2eModel)
		return ok && slices.Equal(b.Free, []uint64{7}) && len(b.Busy) == 0
	})

	// Set: the reply is the effective thresholds.
	code, _, body := call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`","active_decode_blocks_threshold":0.4}`)
	const wantSet = `{"model":"e2e/model-0.5B","active_decode_blocks_threshold":0.4,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"kv_committed_threshold":null,"queue_delay_threshold_ms":null}` + "\n"
	if code != http.StatusOK || string(body) != wantSet {
		t.Fatalf("set = %d %s, want 200 %s", code, body, wantSet)
	}
	// The record follows without a report: 50% > 40%.
	natstest.WaitFor(t, 5*time.Second, "worker 7 busy by the override", func() bool {
		b, _ := record(t, busy, e2eModel)
		return slices.Equal(b.Busy, []uint64{7}) && len(b.Free) == 0 && b.AllBusy && b.Reasons["7"] == events.ReasonKV &&
			b.Thresholds.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.4)})
	})
	// The override is in the thresholds bucket, as JSON.
	js, _ := jetstream.New(nc)
	tkv, err := js.KeyValue(t.Context(), events.ThresholdsBucket)
	if err != nil {
		t.Fatal(err)
	}
	e, err := tkv.Get(t.Context(), events.ModelKey(e2eModel))
	if err != nil {
		t.Fatal(err)
	}
	var stored events.Thresholds
	if err := json.Unmarshal(e.Value(), &stored); err != nil || !stored.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.4)}) {
		t.Fatalf("stored override %s: %v", e.Value(), err)
	}
	// A second set merges.
	code, _, body = call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`","active_prefill_tokens_threshold":4096}`)
	if code != http.StatusOK || !strings.Contains(string(body), `"active_decode_blocks_threshold":0.4,"active_prefill_tokens_threshold":4096`) {
		t.Fatalf("second set = %d %s", code, body)
	}
	if m, ok := effectiveOf(t, svc, e2eModel); !ok || !m.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.4), ActivePrefillTokens: events.Ptr[uint64](4096)}) {
		t.Fatalf("GET lists %+v, %v", m, ok)
	}

	// Inspection.
	code, _, body = call(t, svc, "GET", "/busy?model="+e2eModel, "", "")
	if code != http.StatusOK || !strings.Contains(string(body), `"busy":[7]`) || !strings.Contains(string(body), `"reasons":{"7":"kv"}`) {
		t.Errorf("GET /busy = %d %s", code, body)
	}
	code, _, body = call(t, svc, "GET", "/loads?model="+e2eModel, "", "")
	if code != http.StatusOK || !strings.Contains(string(body), `"worker_id":7,"dp_rank":0,"active_decode_blocks":50,"kv_total_blocks":100`) {
		t.Errorf("GET /loads = %d %s", code, body)
	}
	code, _, body = call(t, svc, "GET", "/workers", "", "")
	if code != http.StatusOK || !strings.Contains(string(body), `"worker_id":7,"state":"busy","reason":"kv"`) {
		t.Errorf("GET /workers = %d %s", code, body)
	}
	if code, _, body = call(t, svc, "GET", "/loads?model=nobody", "", ""); code != http.StatusOK || string(body) != `{"loads":[]}`+"\n" {
		t.Errorf("GET /loads of an unknown model = %d %s", code, body)
	}

	// Delete: back to the defaults, at once.
	code, _, body = call(t, svc, "DELETE", "/busy_threshold?model="+e2eModel, e2eToken, "")
	const wantDefaults = `{"model":"e2e/model-0.5B","active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"kv_committed_threshold":null,"queue_delay_threshold_ms":null}` + "\n"
	if code != http.StatusOK || string(body) != wantDefaults {
		t.Fatalf("delete = %d %s, want 200 %s", code, body, wantDefaults)
	}
	natstest.WaitFor(t, 5*time.Second, "worker 7 free again", func() bool {
		b, _ := record(t, busy, e2eModel)
		return slices.Equal(b.Free, []uint64{7}) && len(b.Busy) == 0 && b.Thresholds.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)})
	})
	if _, err := tkv.Get(t.Context(), events.ModelKey(e2eModel)); err == nil {
		t.Error("override still in the thresholds bucket")
	}
	if m, _ := effectiveOf(t, svc, e2eModel); !m.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}) {
		t.Errorf("GET after delete lists %+v", m)
	}
}

// TestThresholdsAPIErrors checks each error status of a running monitor:
// the status, a JSON {"error"} body and nothing changed.
func TestThresholdsAPIErrors(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { longLived(o); o.adminToken = e2eToken })
	nc, _ := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 50, 100)
	knownBy(t, svc, e2eModel)
	set := func(field, value string) string {
		return `{"model":"` + e2eModel + `","` + field + `":` + value + `}`
	}
	tests := []struct {
		name, method, target, ctype, token, body string
		status                                   int
		want                                     string
	}{
		{"bad JSON", "POST", "/busy_threshold", "application/json", e2eToken, `{"model":`, 400, "not valid JSON"},
		{"NaN", "POST", "/busy_threshold", "application/json", e2eToken, set("active_decode_blocks_threshold", "NaN"), 400, "NaN"},
		{"out of range", "POST", "/busy_threshold", "application/json", e2eToken, set("active_decode_blocks_threshold", "1.01"), 400, "out of range"},
		{"overflow", "POST", "/busy_threshold", "application/json", e2eToken, set("active_prefill_tokens_threshold_frac", "1e999"), 400, "out of range"},
		{"unknown field", "POST", "/busy_threshold", "application/json", e2eToken, set("threshold", "0.5"), 400, `unknown field "threshold"`},
		{"no model", "POST", "/busy_threshold", "application/json", e2eToken, `{"active_decode_blocks_threshold":0.5}`, 400, `"model" is required`},
		{"no token", "POST", "/busy_threshold", "application/json", "", set("active_decode_blocks_threshold", "0.5"), 401, "Bearer"},
		{"wrong token", "POST", "/busy_threshold", "application/json", "nope", set("active_decode_blocks_threshold", "0.5"), 401, "not valid"},
		{"delete without token", "DELETE", "/busy_threshold?model=" + e2eModel, "", "", "", 401, "Bearer"},
		{"unknown model", "POST", "/busy_threshold", "application/json", e2eToken, `{"model":"no/such-model","active_decode_blocks_threshold":0.5}`, 404, `"no/such-model" is not known`},
		{"delete unknown model", "DELETE", "/busy_threshold?model=no/such-model", "", e2eToken, "", 404, "not known"},
		{"wrong method", "PUT", "/busy_threshold", "application/json", e2eToken, set("active_decode_blocks_threshold", "0.5"), 405, "PUT"},
		{"too large", "POST", "/busy_threshold", "application/json", e2eToken, `{"model":"` + strings.Repeat("m", api.DefaultMaxBody) + `"}`, 413, "limit"},
		{"wrong content type", "POST", "/busy_threshold", "text/plain", e2eToken, set("active_decode_blocks_threshold", "0.5"), 415, "application/json"},
		{"string NaN", "POST", "/busy_threshold", "application/json", e2eToken, set("active_decode_blocks_threshold", `"NaN"`), 422, "not a string"},
		{"fractional tokens", "POST", "/busy_threshold", "application/json", e2eToken, set("active_prefill_tokens_threshold", "10.5"), 422, "whole number"},
	}
	t.Run("refused", func(t *testing.T) {
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				req, err := http.NewRequestWithContext(t.Context(), tt.method, "http://"+svc.httpAddr+tt.target, strings.NewReader(tt.body))
				if err != nil {
					t.Fatal(err)
				}
				if tt.ctype != "" {
					req.Header.Set("Content-Type", tt.ctype)
				}
				if tt.token != "" {
					req.Header.Set("Authorization", "Bearer "+tt.token)
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				data, _ := io.ReadAll(resp.Body)
				var m map[string]any
				if err := json.Unmarshal(data, &m); err != nil || len(m) != 1 {
					t.Fatalf("body %q is not a JSON object with one member: %v", data, err)
				}
				msg, _ := m["error"].(string)
				if resp.StatusCode != tt.status || !strings.Contains(msg, tt.want) {
					t.Errorf("%d %q, want %d with %q", resp.StatusCode, msg, tt.status, tt.want)
				}
				if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q", ct)
				}
				if tt.status == 401 && !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
					t.Errorf("WWW-Authenticate %q", resp.Header.Get("WWW-Authenticate"))
				}
			})
		}
	})
	// Nothing refused may have changed the model's thresholds.
	if m, _ := effectiveOf(t, svc, e2eModel); !m.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}) {
		t.Errorf("thresholds after refused requests: %+v", m)
	}
}

// TestThresholdsShared runs two monitors on one NATS server, one holding
// the partition and the other a standby: an override set through one is
// listed by the other and applied to the record, and a delete through the
// other reaches the first.
func TestThresholdsShared(t *testing.T) {
	t.Parallel()
	first := testService(t, longLived)
	second := testService(t, func(o *serveOptions) {
		longLived(o)
		o.natsURL = first.natsURL
		o.writer.MonitorID = "second"
	})
	nc, _ := connect(t, first.natsURL)
	publishReport(t, nc, e2eModel, 3, 50, 100)
	knownBy(t, first, e2eModel)
	knownBy(t, second, e2eModel)

	code, _, body := call(t, first, "POST", "/busy_threshold", "", `{"model":"`+e2eModel+`","active_decode_blocks_threshold":0.25}`)
	if code != http.StatusOK {
		t.Fatalf("set on the first = %d %s", code, body)
	}
	want := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.25)}
	if m, ok := effectiveOf(t, second, e2eModel); !ok || !m.Equal(want) {
		t.Fatalf("second lists %+v, %v; want %+v", m, ok, want)
	}
	// The monitor that holds the model's partition (either) applies it.
	_, busy := connect(t, first.natsURL)
	natstest.WaitFor(t, 5*time.Second, "the override applied to the record", func() bool {
		rec, ok := record(t, busy, e2eModel)
		return ok && slices.Equal(rec.Busy, []uint64{3}) && rec.Thresholds.Equal(want)
	})

	if code, _, body := call(t, second, "DELETE", "/busy_threshold?model="+e2eModel, "", ""); code != http.StatusOK {
		t.Fatalf("delete on the second = %d %s", code, body)
	}
	if m, _ := effectiveOf(t, first, e2eModel); !m.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}) {
		t.Fatalf("first lists %+v after the delete", m)
	}
	natstest.WaitFor(t, 5*time.Second, "the record back to the defaults", func() bool {
		rec, ok := record(t, busy, e2eModel)
		return ok && slices.Equal(rec.Free, []uint64{3}) && rec.Thresholds.Equal(events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)})
	})
}

// TestThresholdsSurviveRestart sets an override, restarts the monitor on
// the same data directory, and finds the override listed and applied.
func TestThresholdsSurviveRestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	sameDir := func(o *serveOptions) { longLived(o); o.embedded.DataDir = dir }
	before := testService(t, sameDir)
	nc, _ := connect(t, before.natsURL)
	publishReport(t, nc, e2eModel, 5, 50, 100)
	knownBy(t, before, e2eModel)
	code, _, body := call(t, before, "POST", "/busy_threshold", "", `{"model":"`+e2eModel+`","active_prefill_tokens_threshold_frac":0.125}`)
	if code != http.StatusOK {
		t.Fatalf("set = %d %s", code, body)
	}
	nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := before.Close(ctx); err != nil {
		t.Fatal(err)
	}

	after := testService(t, sameDir)
	want := events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokensFrac: events.Ptr(0.125)}
	if m, ok := effectiveOf(t, after, e2eModel); !ok || !m.Equal(want) {
		t.Fatalf("after the restart GET lists %+v, %v; want %+v", m, ok, want)
	}
	nc2, busy := connect(t, after.natsURL)
	publishReport(t, nc2, e2eModel, 5, 50, 100)
	natstest.WaitFor(t, 5*time.Second, "the restarted monitor applies the override", func() bool {
		b, _ := record(t, busy, e2eModel)
		return b.MonitorID != "" && b.Thresholds.Equal(want) && slices.Equal(b.Free, []uint64{5})
	})
}

// TestThresholdsAPIWarnsWithoutToken checks the startup warning.
func TestThresholdsAPIWarnsWithoutToken(t *testing.T) {
	t.Parallel()
	var logs syncbuf.Buffer
	o := defaultServeOptions()
	o.embedded.Addr, o.embedded.DataDir, o.httpAddr = "127.0.0.1:0", t.TempDir(), "127.0.0.1:0"
	log, err := logOptions{level: "info", format: "text"}.logger(&logs)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := startService(t.Context(), o, log, newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := svc.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if s := logs.String(); !strings.Contains(s, "level=WARN") || !strings.Contains(s, "anyone who can reach the API can change thresholds") {
		t.Errorf("no warning in the log:\n%s", s)
	}
}
