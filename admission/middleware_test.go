package admission

import (
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/internal/retrytest"
)

// admitTestDecider is a fixed table of decisions; models not in it are
// unknown.
type admitTestDecider map[string]Decision

func (d admitTestDecider) Decide(model string) Decision {
	if dec, ok := d[model]; ok {
		return dec
	}
	return Decision{Admit: true, Reason: ReasonUnknownModel}
}

// admitTestNext answers 200 "next:" + the body it read.
var admitTestNext = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, "next:"+string(body))
})

var admitTestDecisions = admitTestDecider{
	"busy":  {Reason: ReasonAllBusy, Busy: []uint64{1}},
	"free":  {Admit: true, Reason: ReasonFree, Free: []uint64{1}},
	"stale": {Admit: true, Reason: ReasonStale},
}

func admitTestServe(t *testing.T, h http.Handler, req *http.Request) *http.Response {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Result()
}

// checkRetryHeaders checks the retry headers of a rejection of a model
// whose rate is not known yet: retry-after-ms within a quarter above the
// floor (at least the table's 10 ms), Retry-After that value in whole
// seconds, rounded, at least the floor rounded up and at least 1.
func checkRetryHeaders(t *testing.T, h http.Header, floor time.Duration) {
	t.Helper()
	retrytest.Headers(t, h, floor, max(floor+floor/4, 10*time.Millisecond)*101/100)
}

func TestMiddlewareRejects(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		opts   []MiddlewareOption
		status int
		floor  time.Duration // of retry-after-ms; Retry-After is that rounded, at least the floor rounded up
		body   string
	}{
		{"default", nil, 503, time.Second,
			`{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503,"error":{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","param":null,"code":503}}`},
		{"429", []MiddlewareOption{WithRejectStatus(429), WithRetryAfter(1500 * time.Millisecond)}, 429, 1500 * time.Millisecond,
			`{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":429,"error":{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","param":null,"code":429}}`},
		{"529", []MiddlewareOption{WithRejectStatus(529), WithRetryAfter(time.Millisecond)}, 529, time.Millisecond,
			`{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":529,"error":{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","param":null,"code":529}}`},
		{"503 retry 30s", []MiddlewareOption{WithRetryAfter(30 * time.Second)}, 503, 30 * time.Second,
			`{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503,"error":{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","param":null,"code":503}}`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			m, err := NewMiddleware(admitTestDecisions, c.opts...)
			if err != nil {
				t.Fatal(err)
			}
			h := m.Wrap(admitTestNext)
			req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(`{"prompt":"x"}`))
			req.Header.Set(DefaultModelHeader, "busy")
			for range 2 { // the precomputed response serves every rejection
				resp := admitTestServe(t, h, req)
				body, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != c.status {
					t.Errorf("status %d, want %d", resp.StatusCode, c.status)
				}
				if string(body) != c.body {
					t.Errorf("body %s\nwant %s", body, c.body)
				}
				if got := resp.Header.Values("Content-Type"); len(got) != 1 || got[0] != "application/json" {
					t.Errorf("Content-Type %q", got)
				}
				checkRetryHeaders(t, resp.Header, c.floor)
				if got := resp.Header.Get("Content-Length"); got != strconv.Itoa(len(c.body)) {
					t.Errorf("Content-Length %q", got)
				}
			}
			if string(RejectBody(c.status)) != c.body {
				t.Errorf("RejectBody(%d) = %s", c.status, RejectBody(c.status))
			}
		})
	}
}

func TestMiddlewareAdmits(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	metrics, err := NewMetrics(reg, DefaultMaxModelLabels)
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewMiddleware(admitTestDecisions, WithMetrics(metrics))
	if err != nil {
		t.Fatal(err)
	}
	h := m.Wrap(admitTestNext)
	long := `{"messages":[{"role":"user","content":"` + strings.Repeat("é", 5000) + `"}],"model":"busy","stream":true}`
	for _, c := range []struct {
		name, header, ctype, body string
		status                    int
	}{
		{"header free", "free", "", `{"model":"busy"}`, 200}, // the header wins over the body
		{"header unknown", "nope", "", "", 200},
		{"header stale", "stale", "", "", 200},
		{"body free", "", "application/json", `{"model":"free","prompt":"hi"}`, 200},
		{"body busy after a long field", "", "application/json; charset=utf-8", long, 503},
		{"body busy, no content type", "", "", `{"stream":false,"n":{"a":[1,2]},"model":"busy"}`, 503},
		{"no model", "", "application/json", `{"prompt":"x"}`, 200},
		{"not json", "", "text/plain", `{"model":"busy"}`, 200},
		{"bad json", "", "application/json", `{"model":`, 200},
		{"model not a string", "", "application/json", `{"model":7}`, 200},
		{"no body", "", "", "", 200},
	} {
		t.Run(c.name, func(t *testing.T) {
			var body io.Reader = http.NoBody
			if c.body != "" {
				body = strings.NewReader(c.body)
			}
			req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", body)
			if c.header != "" {
				req.Header.Set(DefaultModelHeader, c.header)
			}
			if c.ctype != "" {
				req.Header.Set("Content-Type", c.ctype)
			}
			resp := admitTestServe(t, h, req)
			got, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d (%s)", resp.StatusCode, c.status, got)
			}
			// The next handler reads the whole body, unchanged.
			if c.status == 200 && string(got) != "next:"+c.body {
				t.Errorf("next handler got %q, want %q", got, "next:"+c.body)
			}
		})
	}
	wantSeries(t, reg, "workermon_router_admissions_total", nil, "outcome", map[string]float64{OutcomeAdmitted: 2, OutcomeUnknownModel: 1,
		OutcomeStaleOpen: 1, OutcomeRejected: 2, OutcomeNoModel: 5})
	if v := metricValue(t, reg, "workermon_router_requests_rejected_total", map[string]string{"model": "busy"}); v != 2 {
		t.Errorf("rejected{model=busy} = %v, want 2", v)
	}
}

// TestMiddlewareDuplicateModelKey: a body naming "model" twice is served by
// OpenAI-compatible engines (Python's json, Go's encoding/json) as the last
// one; the Middleware decides on that model, so that naming a free model
// first does not get a request for a busy one through.
func TestMiddlewareDuplicateModelKey(t *testing.T) {
	t.Parallel()
	m, err := NewMiddleware(admitTestDecisions)
	if err != nil {
		t.Fatal(err)
	}
	h := m.Wrap(admitTestNext)
	for body, status := range map[string]int{
		`{"model":"free","prompt":"p","model":"busy"}`: http.StatusServiceUnavailable,
		`{"model":"busy","prompt":"p","model":"free"}`: http.StatusOK,
	} {
		req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if resp := admitTestServe(t, h, req); resp.StatusCode != status {
			t.Errorf("%s: status %d, want %d (decided on the last model)", body, resp.StatusCode, status)
		}
	}
}

// TestAdmitJSONModel: the top-level "model" string, the last of several,
// of a body or a prefix of one.
func TestAdmitJSONModel(t *testing.T) {
	t.Parallel()
	for body, want := range map[string]string{
		`{"model":"m"}`:                                        "m",
		` { "model" : "m" , "n" : 1 } `:                        "m",
		`{"model":"a","model":"b"}`:                            "b",
		`{"model":"a","model":7}`:                              "",
		`{"model":7,"model":"b"}`:                              "b",
		`{"x":{"model":"in"},"model":"m"}`:                     "m",
		`{"x":{"model":"in"}}`:                                 "",
		`{"x":["a\"]",{"y":"}"}],"model":"m"}`:                 "m",
		`{"x":"\\","model":"m"}`:                               "m",
		`{"mod\u0065l":"m"}`:                                   "m",
		`{"model":"caf\u00e9"}`:                                "café",
		`{"Model":"m"}`:                                        "",
		`{"n":-1.5e3,"t":true,"f":false,"z":null,"model":"m"}`: "m",
		`{"model":"a","x":"unterminated`:                       "a",
		`{"model":"a","model":"trunc`:                          "a",
		`{"model":"a","n":12`:                                  "a",
		`{"model":"a" "model":"b"}`:                            "a",
		`{"model":`:                                            "",
		`["model","m"]`:                                        "",
		``:                                                     "",
	} {
		if got := admitJSONModel([]byte(body)); got != want {
			t.Errorf("admitJSONModel(%s) = %q, want %q", body, got, want)
		}
	}
}

// FuzzAdmitJSONModel: on a JSON object, admitJSONModel finds what
// encoding/json decodes as the last top-level "model" string.
func FuzzAdmitJSONModel(f *testing.F) {
	for _, s := range []string{`{"model":"m"}`, `{"model":"a","x":[{"model":"b"}],"model":"c"}`, `{"a\"":"\\","model":"\u00e9"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got := admitJSONModel(body)
		var m map[string]json.RawMessage
		if json.Unmarshal(body, &m) != nil {
			return
		}
		var want string
		if raw, ok := m["model"]; ok {
			_ = json.Unmarshal(raw, &want)
		}
		if got != want {
			t.Errorf("admitJSONModel(%q) = %q, encoding/json: %q", body, got, want)
		}
	})
}

func TestModelFromJSONBodyLimit(t *testing.T) {
	t.Parallel()
	f := ModelFromJSONBody(16)
	body := `{"prompt":"0123456789","model":"m"}`
	req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body))
	if got := f(req); got != "" {
		t.Errorf("model beyond the limit found: %q", got)
	}
	if rest, _ := io.ReadAll(req.Body); string(rest) != body {
		t.Errorf("body after peek %q", rest)
	}
	req = httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{"model":"m","prompt":"0123456789"}`))
	if got := f(req); got != "m" {
		t.Errorf("model within the limit: %q", got)
	}
	h := ModelFromHeader("x-model")
	req = httptest.NewRequest(http.MethodGet, "/", nil)
	req.Header.Set("X-Model", "hm")
	if got := h(req); got != "hm" {
		t.Errorf("ModelFromHeader = %q", got)
	}
}

func TestMiddlewareOptionsInvalid(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]MiddlewareOption{
		"status 500":  {WithRejectStatus(500)},
		"status 200":  {WithRejectStatus(200)},
		"retry 0":     {WithRetryAfter(0)},
		"retry < 0":   {WithRetryAfter(-time.Second)},
		"nil model":   {WithModelFunc(nil)},
		"two at once": {WithRejectStatus(404), WithRetryAfter(0)},
	} {
		if _, err := NewMiddleware(admitTestDecisions, opts...); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
	if _, err := NewMiddleware(nil); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("nil Decider: %v", err)
	}
}

// metricValue returns a counter's or gauge's value from g, or -1 when there
// is no such series.
func metricValue(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	if v, ok := promtest.Value(t, g, name, labels); ok {
		return v
	}
	return -1
}

// wantSeries checks one series of the metric name per entry of want: the
// series labelled as base plus key = the entry's key.
func wantSeries(t *testing.T, g prometheus.Gatherer, name string, base map[string]string, key string, want map[string]float64) {
	t.Helper()
	for val, w := range want {
		lbl := map[string]string{key: val}
		maps.Copy(lbl, base)
		if v := metricValue(t, g, name, lbl); v != w {
			t.Errorf("%s%v = %v, want %v", name, lbl, v, w)
		}
	}
}

// BenchmarkAdmitJSONModel measures finding the model in a peeked body: first
// in a short body, and after a long chat message.
func BenchmarkAdmitJSONModel(b *testing.B) {
	for _, c := range []struct{ name, body string }{
		{"short", `{"model":"Qwen/Qwen3-0.6B","prompt":"hello","max_tokens":16,"stream":true}`},
		{"long", `{"messages":[{"role":"user","content":"` + strings.Repeat("hello world ", 1000) + `"}],"model":"Qwen/Qwen3-0.6B","stream":true}`},
	} {
		b.Run(c.name, func(b *testing.B) {
			buf := []byte(c.body)
			b.ReportAllocs()
			for b.Loop() {
				if admitJSONModel(buf) != "Qwen/Qwen3-0.6B" {
					b.Fatal("model not found")
				}
			}
		})
	}
}
