package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
)

const (
	testModel = "Qwen/Qwen3-0.6B"
	testToken = "s3cret-token"
)

var testDefaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8)}

// fixture is an API handler over fakes.
type fixture struct {
	mon   *fakeMonitor
	store *fakeStore
	h     http.Handler
	log   *bytes.Buffer
}

func newFixture(t *testing.T, token string, mutate func(*Config)) *fixture {
	t.Helper()
	f := &fixture{mon: newFakeMonitor(testDefaults, testModel), store: newFakeStore(), log: &bytes.Buffer{}}
	cfg := DefaultConfig()
	cfg.Monitor, cfg.Store, cfg.Defaults, cfg.AdminToken = f.mon, f.store, testDefaults, token
	cfg.RecordModels = func() []string { return []string{"old/record-only"} }
	cfg.Logger = slog.New(slog.NewTextHandler(f.log, nil))
	if mutate != nil {
		mutate(&cfg)
	}
	h, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.h = h
	return f
}

// request is one call to the handler.
type request struct {
	method, target, body string
	header               map[string]string // Content-Type defaults to application/json when a body is given
}

func (f *fixture) do(t *testing.T, r request) *httptest.ResponseRecorder {
	t.Helper()
	var body io.Reader
	if r.body != "" {
		body = strings.NewReader(r.body)
	}
	req := httptest.NewRequest(r.method, r.target, body)
	if r.body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range r.header {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	rec := httptest.NewRecorder()
	f.h.ServeHTTP(rec, req)
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", r.method, r.target, ct)
	}
	return rec
}

// errorBody checks that a reply is exactly {"error": "<non-empty>"} and
// returns the message.
func errorBody(t *testing.T, rec *httptest.ResponseRecorder) string {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &m); err != nil {
		t.Fatalf("error body %q is not JSON: %v", rec.Body, err)
	}
	msg, ok := m["error"].(string)
	if len(m) != 1 || !ok || msg == "" {
		t.Fatalf("error body %q is not {\"error\": \"...\"}", rec.Body)
	}
	return msg
}

func decodeAs[T any](t *testing.T, rec *httptest.ResponseRecorder) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(rec.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("reply %q: %v", rec.Body, err)
	}
	return v
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	good := DefaultConfig()
	good.Monitor, good.Store = newFakeMonitor(events.Thresholds{}), newFakeStore()
	if err := good.Validate(); err != nil {
		t.Fatalf("good config: %v", err)
	}
	tests := []struct {
		name   string
		mutate func(*Config)
		want   []string
	}{
		{"everything wrong", func(c *Config) {
			*c = Config{AdminToken: "a b", Defaults: events.Thresholds{ActiveDecodeBlocks: events.Ptr(2.0)}}
		},
			[]string{"monitor is nil", "store is nil", "not in [0, 1]", "max body 0", "timeout 0s", "admin token"}},
		{"control character in token", func(c *Config) { c.AdminToken = "abc\n" }, []string{"admin token"}},
		{"negative timeout", func(c *Config) { c.Timeout = -1 }, []string{"timeout -1ns"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := good
			tt.mutate(&c)
			err := c.Validate()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("Validate() = %v, want ErrInvalidConfig", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate() = %q, lacks %q", err, w)
				}
			}
			if _, err := New(c); err == nil {
				t.Error("New accepted an invalid config")
			}
		})
	}
}

func TestNewWarnsWithoutToken(t *testing.T) {
	t.Parallel()
	open := newFixture(t, "", nil)
	if !strings.Contains(open.log.String(), "level=WARN") ||
		!strings.Contains(open.log.String(), "anyone who can reach the API can change thresholds") {
		t.Errorf("no warning without a token; log: %s", open.log)
	}
	closed := newFixture(t, testToken, nil)
	if strings.Contains(closed.log.String(), "level=WARN") {
		t.Errorf("warning with a token; log: %s", closed.log)
	}
}

// TestPostErrors checks every way a POST body can be refused.
func TestPostErrors(t *testing.T) {
	t.Parallel()
	auth := map[string]string{"Authorization": "Bearer " + testToken}
	tests := []struct {
		name   string
		req    request
		status int
		want   string // in the message
	}{
		{"no content type", request{body: `{"model":"m"}`, header: map[string]string{"Content-Type": ""}}, 415, "Content-Type: application/json"},
		{"text content type", request{body: `{"model":"m"}`, header: map[string]string{"Content-Type": "text/plain"}}, 415, `"text/plain" is not supported`},
		{"form content type", request{body: `model=m`, header: map[string]string{"Content-Type": "application/x-www-form-urlencoded"}}, 415, "not supported"},
		{"latin-1 charset", request{body: `{"model":"m"}`, header: map[string]string{"Content-Type": "application/json; charset=latin1"}}, 415, "charset"},
		{"too large", request{body: `{"model":"` + strings.Repeat("a", DefaultMaxBody) + `"}`}, 413, "limit"},
		{"empty", request{body: " ", header: nil}, 400, "empty"},
		{"broken JSON", request{body: `{"model":`}, 400, "not valid JSON"},
		{"trailing data", request{body: `{"model":"m"} {}`}, 400, "after top-level value"},
		{"NaN literal", request{body: `{"model":"m","active_decode_blocks_threshold":NaN}`, header: auth}, 400, "NaN and Infinity are not JSON numbers"},
		{"Infinity literal", request{body: `{"model":"m","active_prefill_tokens_threshold_frac":Infinity}`, header: auth}, 400, "NaN and Infinity"},
		{"invalid UTF-8", request{body: "{\"model\":\"\xff\"}"}, 400, "UTF-8"},
		{"array", request{body: `[{"model":"m"}]`}, 422, "must be a JSON object"},
		{"string body", request{body: `"m"`}, 422, "not a string"},
		{"duplicate field", request{body: `{"model":"m","model":"n"}`}, 400, `"model" appears more than once`},
		{"unknown field", request{body: `{"model":"m","active_decode_blocks":0.5}`}, 400, `unknown field "active_decode_blocks"`},
		{"model missing", request{body: `{}`}, 400, `"model" is required`},
		{"model null", request{body: `{"model":null}`}, 400, `"model" is required`},
		{"model empty", request{body: `{"model":""}`}, 400, "not a valid model name"},
		{"model too long", request{body: `{"model":"` + strings.Repeat("m", events.MaxModelLen+1) + `"}`}, 400, "not a valid model name"},
		{"model number", request{body: `{"model":7}`}, 422, `"model" must be a string, not a number`},
		{"decode above 1", request{body: `{"model":"m","active_decode_blocks_threshold":1.5}`, header: auth}, 400, "out of range"},
		{"decode negative", request{body: `{"model":"m","active_decode_blocks_threshold":-0.1}`, header: auth}, 400, "between 0 and 1"},
		{"decode overflow", request{body: `{"model":"m","active_decode_blocks_threshold":1e999}`, header: auth}, 400, "1e999, out of range"},
		{"decode string NaN", request{body: `{"model":"m","active_decode_blocks_threshold":"NaN"}`, header: auth}, 422, "not a string"},
		{"decode string number", request{body: `{"model":"m","active_decode_blocks_threshold":"0.5"}`, header: auth}, 422, "not a string"},
		{"decode boolean", request{body: `{"model":"m","active_decode_blocks_threshold":true}`, header: auth}, 422, "not a boolean"},
		{"frac negative", request{body: `{"model":"m","active_prefill_tokens_threshold_frac":-1}`, header: auth}, 400, "≥ 0"},
		{"frac overflow", request{body: `{"model":"m","active_prefill_tokens_threshold_frac":-1e400}`, header: auth}, 400, "out of range"},
		{"frac object", request{body: `{"model":"m","active_prefill_tokens_threshold_frac":{}}`, header: auth}, 422, "not an object"},
		{"tokens negative", request{body: `{"model":"m","active_prefill_tokens_threshold":-1}`, header: auth}, 400, "out of range"},
		{"tokens fraction", request{body: `{"model":"m","active_prefill_tokens_threshold":1.5}`, header: auth}, 422, "not a whole number"},
		{"tokens over uint64", request{body: `{"model":"m","active_prefill_tokens_threshold":18446744073709551616}`, header: auth}, 400, "at most 18446744073709551615"},
		{"tokens huge exponent", request{body: `{"model":"m","active_prefill_tokens_threshold":1e999999999}`, header: auth}, 400, "out of range"},
		{"tokens string", request{body: `{"model":"m","active_prefill_tokens_threshold":"100"}`, header: auth}, 422, "not a string"},
		{"tokens array", request{body: `{"model":"m","active_prefill_tokens_threshold":[1]}`, header: auth}, 422, "not an array"},
		{"committed above 4", request{body: `{"model":"m","kv_committed_threshold":4.01}`, header: auth}, 400, "between 0 and 4"},
		{"committed negative", request{body: `{"model":"m","kv_committed_threshold":-0.5}`, header: auth}, 400, "out of range"},
		{"committed NaN literal", request{body: `{"model":"m","kv_committed_threshold":NaN}`, header: auth}, 400, "NaN and Infinity"},
		{"committed string", request{body: `{"model":"m","kv_committed_threshold":"1"}`, header: auth}, 422, "not a string"},
		{"delay negative", request{body: `{"model":"m","queue_delay_threshold_ms":-1}`, header: auth}, 400, "out of range"},
		{"delay fraction", request{body: `{"model":"m","queue_delay_threshold_ms":2.5}`, header: auth}, 422, "not a whole number: it must be a whole number of milliseconds"},
		{"delay over uint64", request{body: `{"model":"m","queue_delay_threshold_ms":18446744073709551616}`, header: auth}, 400, "at most 18446744073709551615"},
		{"delay boolean", request{body: `{"model":"m","queue_delay_threshold_ms":false}`, header: auth}, 422, "not a boolean"},
		{"delay set without token", request{body: `{"model":"m","queue_delay_threshold_ms":100}`}, 401, "Authorization: Bearer"},
		{"unknown model set", request{body: `{"model":"nobody","active_decode_blocks_threshold":0.5}`, header: auth}, 404, `"nobody" is not known`},
		{"unknown model get", request{body: `{"model":"nobody"}`}, 404, `"nobody" is not known`},
		{"set without token", request{body: `{"model":"m","active_decode_blocks_threshold":0.5}`}, 401, "Authorization: Bearer"},
		{"invalid set without token", request{body: `{"model":"m","active_decode_blocks_threshold":"x"}`}, 401, "Authorization: Bearer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, testToken, nil)
			tt.req.method, tt.req.target = http.MethodPost, "/busy_threshold"
			rec := f.do(t, tt.req)
			msg := errorBody(t, rec)
			if rec.Code != tt.status || !strings.Contains(msg, tt.want) {
				t.Errorf("got %d %q, want %d and a message with %q", rec.Code, msg, tt.status, tt.want)
			}
			if f.store.merges != 0 || len(f.mon.sets) != 0 {
				t.Errorf("a refused request changed something: %d merges, %d overrides", f.store.merges, len(f.mon.sets))
			}
		})
	}
}

// TestSet checks a set: merged into the store, applied to the monitor at
// once, and answered with the effective thresholds.
func TestSet(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "", nil)
	post := func(body string) ModelThresholds {
		t.Helper()
		rec := f.do(t, request{method: "POST", target: "/busy_threshold", body: body})
		if rec.Code != http.StatusOK {
			t.Fatalf("POST %s = %d %s", body, rec.Code, rec.Body)
		}
		return decodeAs[ModelThresholds](t, rec)
	}
	got := post(`{"model":"Qwen/Qwen3-0.6B","active_prefill_tokens_threshold":1000.0}`)
	want := ModelThresholds{Model: testModel, Thresholds: events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](1000)}}
	if got.Model != want.Model || !got.Equal(want.Thresholds) {
		t.Fatalf("reply %+v, want %+v", got, want)
	}
	// Merge: the second set keeps the first's field; null sets nothing.
	got = post(`{"model":"Qwen/Qwen3-0.6B","active_decode_blocks_threshold":0.5,"active_prefill_tokens_threshold":null}`)
	want.Thresholds = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5), ActivePrefillTokens: events.Ptr[uint64](1000)}
	if !got.Equal(want.Thresholds) {
		t.Fatalf("reply %+v, want %+v", got, want)
	}
	stored, _ := f.store.override(testModel)
	if !stored.Equal(want.Thresholds) {
		t.Errorf("stored %+v, want %+v", stored, want.Thresholds)
	}
	if len(f.mon.sets) != 2 || f.mon.sets[1].t == nil || !f.mon.sets[1].t.Equal(stored) {
		t.Errorf("monitor overrides %+v, want the stored override applied twice", f.mon.sets)
	}
	// A body with only the model (or null thresholds) is a get: nothing written.
	for _, body := range []string{`{"model":"Qwen/Qwen3-0.6B"}`, `{"model":"Qwen/Qwen3-0.6B","active_decode_blocks_threshold":null}`} {
		if got := post(body); !got.Equal(want.Thresholds) {
			t.Errorf("get %s = %+v, want %+v", body, got, want)
		}
	}
	if f.store.merges != 2 || len(f.mon.sets) != 2 {
		t.Errorf("a get wrote: %d merges, %d overrides", f.store.merges, len(f.mon.sets))
	}
	if !strings.Contains(f.log.String(), "threshold override set") {
		t.Errorf("no audit log of the set: %s", f.log)
	}
	// A model known only by its record in the busy bucket can be set, and a
	// stored override that is not valid is replaced.
	got = post(`{"model":"old/record-only","active_prefill_tokens_threshold_frac":0}`)
	if got.ActivePrefillTokensFrac == nil || *got.ActivePrefillTokensFrac != 0 {
		t.Errorf("record-only model: %+v", got)
	}
	// The thresholds of contract §21 merge like the others.
	got = post(`{"model":"Qwen/Qwen3-0.6B","kv_committed_threshold":1.25,"queue_delay_threshold_ms":300}`)
	want.Thresholds.KVCommitted, want.Thresholds.QueueDelayMs = events.Ptr(1.25), events.Ptr[uint64](300)
	if !got.Equal(want.Thresholds) {
		t.Fatalf("reply %+v, want %+v", got, want)
	}
	if stored, _ := f.store.override(testModel); !stored.Equal(want.Thresholds) {
		t.Errorf("stored %+v, want %+v", stored, want.Thresholds)
	}
	got = post(`{"model":"Qwen/Qwen3-0.6B","kv_committed_threshold":4,"queue_delay_threshold_ms":0}`)
	if *got.KVCommitted != 4 || *got.QueueDelayMs != 0 {
		t.Fatalf("bounds: %+v", got)
	}
	f.store.bad["bad/override"] = true
	got = post(`{"model":"bad/override","active_decode_blocks_threshold":1}`)
	if got.ActiveDecodeBlocks == nil || *got.ActiveDecodeBlocks != 1 {
		t.Errorf("bad stored override: %+v", got)
	}
}

func TestAuth(t *testing.T) {
	t.Parallel()
	const set = `{"model":"Qwen/Qwen3-0.6B","active_decode_blocks_threshold":0.5}`
	tests := []struct {
		name      string
		req       request
		status    int
		challenge string
	}{
		{"set without header", request{method: "POST", body: set}, 401, `Bearer realm="workermon"`},
		{"set with wrong token", request{method: "POST", body: set, header: map[string]string{"Authorization": "Bearer nope"}}, 401, `Bearer realm="workermon", error="invalid_token"`},
		{"set with token prefix", request{method: "POST", body: set, header: map[string]string{"Authorization": "Bearer " + testToken[:4]}}, 401, `Bearer realm="workermon", error="invalid_token"`},
		{"set with basic auth", request{method: "POST", body: set, header: map[string]string{"Authorization": "Basic " + testToken}}, 401, `Bearer realm="workermon"`},
		{"set with the bare token", request{method: "POST", body: set, header: map[string]string{"Authorization": testToken}}, 401, `Bearer realm="workermon"`},
		{"set with token", request{method: "POST", body: set, header: map[string]string{"Authorization": "Bearer " + testToken}}, 200, ""},
		{"scheme in lower case", request{method: "POST", body: set, header: map[string]string{"Authorization": "bearer " + testToken}}, 200, ""},
		{"get-only POST stays open", request{method: "POST", body: `{"model":"Qwen/Qwen3-0.6B"}`}, 200, ""},
		{"get-only POST with a wrong token", request{method: "POST", body: `{"model":"Qwen/Qwen3-0.6B"}`, header: map[string]string{"Authorization": "Bearer nope"}}, 200, ""},
		{"GET stays open", request{method: "GET"}, 200, ""},
		{"DELETE without header", request{method: "DELETE", target: "/busy_threshold?model=Qwen/Qwen3-0.6B"}, 401, `Bearer realm="workermon"`},
		{"DELETE of an unknown model without header", request{method: "DELETE", target: "/busy_threshold?model=nobody"}, 401, `Bearer realm="workermon"`},
		{"DELETE with token", request{method: "DELETE", target: "/busy_threshold?model=Qwen/Qwen3-0.6B", header: map[string]string{"Authorization": "Bearer " + testToken}}, 200, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, testToken, nil)
			if tt.req.target == "" {
				tt.req.target = "/busy_threshold"
			}
			rec := f.do(t, tt.req)
			if rec.Code != tt.status {
				t.Fatalf("status %d %s, want %d", rec.Code, rec.Body, tt.status)
			}
			if got := rec.Header().Get("WWW-Authenticate"); got != tt.challenge {
				t.Errorf("WWW-Authenticate %q, want %q", got, tt.challenge)
			}
			if tt.status == 401 {
				errorBody(t, rec)
				if strings.Contains(rec.Body.String(), testToken) {
					t.Errorf("the answer shows the token: %s", rec.Body)
				}
				if f.store.merges+f.store.deletes != 0 || len(f.mon.sets) != 0 {
					t.Error("an unauthorized request changed something")
				}
			}
		})
	}
}

func TestDelete(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "", nil)
	f.store.m[testModel] = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.3)}
	f.store.m["override/only"] = events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](5)}
	del := func(query string) *httptest.ResponseRecorder {
		return f.do(t, request{method: "DELETE", target: "/busy_threshold" + query})
	}
	rec := del("?model=Qwen%2FQwen3-0.6B")
	if rec.Code != http.StatusOK {
		t.Fatalf("DELETE = %d %s", rec.Code, rec.Body)
	}
	if got := decodeAs[ModelThresholds](t, rec); got.Model != testModel || !got.Equal(testDefaults) {
		t.Errorf("reply %+v, want the defaults", got)
	}
	if _, ok := f.store.override(testModel); ok || f.store.deletes != 1 {
		t.Error("override still stored")
	}
	if len(f.mon.sets) != 1 || f.mon.sets[0].t != nil {
		t.Errorf("monitor calls %+v, want one clear", f.mon.sets)
	}
	// Known without an override: 200, nothing to delete in the bucket.
	if rec := del("?model=" + testModel); rec.Code != http.StatusOK || f.store.deletes != 1 {
		t.Errorf("second DELETE = %d, %d deletes", rec.Code, f.store.deletes)
	}
	// Known only by its override: deleted, then unknown.
	if rec := del("?model=override/only"); rec.Code != http.StatusOK {
		t.Errorf("DELETE override/only = %d", rec.Code)
	}
	for _, tt := range []struct {
		query  string
		status int
		want   string
	}{
		{"?model=override/only", 404, "is not known"},
		{"", 400, "model query parameter is required"},
		{"?model=", 400, "model query parameter is required"},
		{"?model=a&model=b", 400, "once"},
		{"?model=" + strings.Repeat("x", 300), 400, "not a valid model name"},
	} {
		rec := del(tt.query)
		if msg := errorBody(t, rec); rec.Code != tt.status || !strings.Contains(msg, tt.want) {
			t.Errorf("DELETE %s = %d %q, want %d with %q", tt.query, rec.Code, msg, tt.status, tt.want)
		}
	}
}

func TestList(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "", nil)
	f.store.m["b/override"] = events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.5)}
	f.store.m[testModel] = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.9)}
	rec := f.do(t, request{method: "GET", target: "/busy_threshold"})
	if rec.Code != http.StatusOK {
		t.Fatalf("GET = %d %s", rec.Code, rec.Body)
	}
	const want = `{"thresholds":[` +
		`{"model":"Qwen/Qwen3-0.6B","active_decode_blocks_threshold":0.9,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"kv_committed_threshold":null,"queue_delay_threshold_ms":null},` +
		`{"model":"b/override","active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":0.5,"kv_committed_threshold":null,"queue_delay_threshold_ms":null},` +
		`{"model":"old/record-only","active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"kv_committed_threshold":null,"queue_delay_threshold_ms":null}]}` + "\n"
	if rec.Body.String() != want {
		t.Errorf("GET =\n%s\nwant\n%s", rec.Body, want)
	}
	empty := newFixture(t, "", func(c *Config) { c.RecordModels = nil; c.Monitor = newFakeMonitor(testDefaults) })
	if rec := empty.do(t, request{method: "GET", target: "/busy_threshold"}); rec.Body.String() != `{"thresholds":[]}`+"\n" {
		t.Errorf("GET with no model = %s", rec.Body)
	}
}

// TestUnavailable checks the answers when NATS or the monitor fail.
func TestUnavailable(t *testing.T) {
	t.Parallel()
	const set = `{"model":"Qwen/Qwen3-0.6B","active_decode_blocks_threshold":0.5}`
	tests := []struct {
		name     string
		storeErr error
		monErr   error
		req      request
		status   int
		want     string
	}{
		{"list, NATS down", errors.New("nats: timeout"), nil, request{method: "GET", target: "/busy_threshold"}, 503, "thresholds bucket cannot be reached"},
		{"set, NATS down", errors.New("nats: timeout"), nil, request{method: "POST", target: "/busy_threshold", body: set}, 503, "nats: timeout"},
		{"set, conflict", overrides.ErrThresholdConflict, nil, request{method: "POST", target: "/busy_threshold", body: set}, 409, "retry"},
		{"set, monitor stopped", nil, monitor.ErrStopped, request{method: "POST", target: "/busy_threshold", body: set}, 503, "monitor is not answering"},
		{"loads, monitor stopped", nil, monitor.ErrStopped, request{method: "GET", target: "/loads"}, 503, "monitor stopped"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, "", nil)
			f.store.err, f.mon.err = tt.storeErr, tt.monErr
			if tt.name == "set, monitor stopped" {
				f.store.m[testModel] = events.Thresholds{} // known through the store
			}
			rec := f.do(t, tt.req)
			if msg := errorBody(t, rec); rec.Code != tt.status || !strings.Contains(msg, tt.want) {
				t.Errorf("got %d %q, want %d with %q", rec.Code, msg, tt.status, tt.want)
			}
		})
	}
}

func TestInspect(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "", nil)
	f.mon.records = []events.BusySet{
		{Model: "a", Busy: []uint64{1}, Hard: []uint64{1}, Reasons: map[string]string{"1": "kv"}, AllBusy: true, Thresholds: testDefaults},
		{Model: testModel, Free: []uint64{2, 3}, Amber: []uint64{3}, Routers: 2,
			QueuedBy: map[string]map[int64]uint64{"router/a": {0: 3, -1: 1}}, Queued: map[int64]uint64{0: 3, -1: 1}},
	}
	f.mon.workers = []monitor.WorkerRow{{Model: "a", WorkerID: 1, State: "busy", Reason: "kv", Sources: []string{"engine"}, Ranks: []uint32{0}}}
	f.mon.loads = []monitor.LoadRow{{Model: "a", WorkerID: 1, DPRank: 0, ActiveDecodeBlocks: 90, KVTotalBlocks: 100, Busy: true, Reason: "kv", Sources: map[string]monitor.SourceLoad{}}}
	tests := []struct {
		target string
		status int
		want   string
	}{
		{"/busy", 200, `{"records":[{"model":"a","busy":[1],"free":[],"stale":[],"all_busy":true,"amber":[],"hard":[1],"reasons":{"1":"kv"},"thresholds":{"active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"kv_committed_threshold":null,"queue_delay_threshold_ms":null},"routers":0,"saturation":0,"queued_by":{},"queued":{}},` +
			`{"model":"Qwen/Qwen3-0.6B","busy":[],"free":[2,3],"stale":[],"all_busy":false,"amber":[3],"hard":[],"reasons":{},"thresholds":{"active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"kv_committed_threshold":null,"queue_delay_threshold_ms":null},"routers":2,"saturation":0,"queued_by":{"router/a":{"-1":1,"0":3}},"queued":{"-1":1,"0":3}}]}`},
		{"/busy?model=nobody", 200, `{"records":[]}`},
		{"/workers?model=a", 200, `{"workers":[{"model":"a","worker_id":1,"state":"busy","reason":"kv","sources":["engine"],"ranks":[0],"age_seconds":0}]}`},
		{"/workers?model=nobody", 200, `{"workers":[]}`},
		{"/loads?model=a", 200, `{"loads":[{"model":"a","worker_id":1,"dp_rank":0,"active_decode_blocks":90,"kv_total_blocks":100,"active_prefill_tokens":0,"max_num_batched_tokens":0,"kv_committed_blocks":null,"waiting_requests":null,"running_requests":null,"preemptions":null,"prefilled_tokens":null,"prefill_rate":null,"queue_delay_ms":null,"preemption_rate":null,"saturation":0,"sources":{},"busy":true,"reason":"kv","stale":false,"age_seconds":0}]}`},
		{"/loads?model=nobody", 200, `{"loads":[]}`},
		{"/loads?model=" + strings.Repeat("x", 300), 400, `{"error":"model \"` + strings.Repeat("x", 64) + `\"… (300 bytes) is not a valid model name: it must be 1 to 256 bytes of UTF-8"}`},
	}
	for _, tt := range tests {
		rec := f.do(t, request{method: "GET", target: tt.target})
		if rec.Code != tt.status || rec.Body.String() != tt.want+"\n" {
			t.Errorf("GET %s = %d\n%s\nwant %d\n%s", tt.target, rec.Code, rec.Body, tt.status, tt.want)
		}
	}
}

func TestMethodNotAllowed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "", nil)
	for _, tt := range []struct{ method, target, allow string }{
		{"PUT", "/busy_threshold", "GET, HEAD, POST, DELETE"},
		{"PATCH", "/busy_threshold", "GET, HEAD, POST, DELETE"},
		{"POST", "/loads", "GET, HEAD"},
		{"DELETE", "/workers", "GET, HEAD"},
		{"POST", "/busy", "GET, HEAD"},
	} {
		rec := f.do(t, request{method: tt.method, target: tt.target})
		msg := errorBody(t, rec)
		if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != tt.allow || !strings.Contains(msg, tt.method) {
			t.Errorf("%s %s = %d Allow %q %q", tt.method, tt.target, rec.Code, rec.Header().Get("Allow"), msg)
		}
	}
	rec := f.do(t, request{method: "GET", target: "/nope"})
	if msg := errorBody(t, rec); rec.Code != http.StatusNotFound || !strings.Contains(msg, "/busy_threshold") {
		t.Errorf("GET /nope = %d %q", rec.Code, msg)
	}
}
