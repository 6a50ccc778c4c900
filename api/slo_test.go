package api

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

// fakeSLOs is an SLOStore in memory.
type fakeSLOs struct {
	mu       sync.Mutex
	slos     map[string]overrides.SLO
	statuses map[string]overrides.SLOStatus
	max      int // 0: no cap
}

func newFakeSLOs() *fakeSLOs {
	return &fakeSLOs{slos: map[string]overrides.SLO{}, statuses: map[string]overrides.SLOStatus{}}
}

func (f *fakeSLOs) Get(_ context.Context, model string) (overrides.SLO, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.slos[model]
	return v, ok, nil
}

func (f *fakeSLOs) Put(_ context.Context, v overrides.SLO) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.slos[v.Model]; !ok && f.max > 0 && len(f.slos) >= f.max {
		return fmt.Errorf("fake: %w", overrides.ErrTooManySLOs)
	}
	f.slos[v.Model] = v
	return nil
}

func (f *fakeSLOs) Delete(_ context.Context, model string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.slos, model)
	delete(f.statuses, model)
	return nil
}

func (f *fakeSLOs) List(context.Context) (map[string]overrides.SLO, map[string]overrides.SLOStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a, b := map[string]overrides.SLO{}, map[string]overrides.SLOStatus{}
	for k, v := range f.slos {
		a[k] = v
	}
	for k, v := range f.statuses {
		b[k] = v
	}
	return a, b, nil
}

func (f *fakeSLOs) Status(_ context.Context, model string) (overrides.SLOStatus, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.statuses[model]
	if !ok {
		return st, 0, nil
	}
	return st, 1, nil
}

type sloChange struct {
	model   string
	mode    string
	deleted bool
}

func newSLOFixture(t *testing.T, token string) (*fixture, *fakeSLOs, *[]sloChange) {
	t.Helper()
	slos := newFakeSLOs()
	var changes []sloChange
	f := newFixture(t, token, func(c *Config) {
		c.SLOs = slos
		c.OnSLOChange = func(_ context.Context, model string, v overrides.SLO, deleted bool) error {
			changes = append(changes, sloChange{model, v.Mode, deleted})
			return nil
		}
	})
	return f, slos, &changes
}

func TestSLOValidation(t *testing.T) {
	t.Parallel()
	f, _, _ := newSLOFixture(t, "")
	for _, tc := range []struct {
		body string
		want int
	}{
		{`{"model":"m","itl_ms":50}`, 200},
		{`{"model":"new/unseen","ttft_ms":500,"itl_ms":40,"percentile":0.99,"mode":"shadow"}`, 200},
		{`{"model":"m","ttft_ms":500,"itl_ms":null}`, 200},
		{`{"model":"m"}`, 400},
		{`{"itl_ms":50}`, 400},
		{`{"model":"m","itl_ms":0}`, 400},
		{`{"model":"m","itl_ms":-5}`, 400},
		{`{"model":"m","itl_ms":50,"percentile":1}`, 400},
		{`{"model":"m","itl_ms":50,"percentile":0}`, 400},
		{`{"model":"m","itl_ms":50,"mode":"loud"}`, 400},
		{`{"model":"m","itl_ms":50,"extra":1}`, 400},
		{`{"model":"m","itl_ms":50`, 400},
		{`{"model":"m","itl_ms":"50"}`, 422},
		{`{"model":"m","itl_ms":50,"percentile":"0.9"}`, 422},
		{`{"model":"m","itl_ms":50,"mode":1}`, 422},
		{`{"model":5,"itl_ms":50}`, 422},
		{`[1]`, 422},
	} {
		rec := f.do(t, request{method: "POST", target: "/slo", body: tc.body})
		if rec.Code != tc.want {
			t.Errorf("POST %s = %d %s, want %d", tc.body, rec.Code, rec.Body, tc.want)
		}
	}
	rec := f.do(t, request{method: "POST", target: "/slo", body: `{"model":"m","itl_ms":50}`, header: map[string]string{"Content-Type": "text/plain"}})
	if rec.Code != http.StatusUnsupportedMediaType {
		t.Errorf("text/plain: %d", rec.Code)
	}
}

// TestSLOLifecycle: set, get (one and all), defaults, delete, 404s, the
// controller told at once, the admin token.
func TestSLOLifecycle(t *testing.T) {
	t.Parallel()
	f, slos, changes := newSLOFixture(t, testToken)
	auth := map[string]string{"Authorization": "Bearer " + testToken}
	if rec := f.do(t, request{method: "POST", target: "/slo", body: `{"model":"m","itl_ms":50}`}); rec.Code != 401 {
		t.Fatalf("POST without token = %d", rec.Code)
	}
	rec := f.do(t, request{method: "POST", target: "/slo", body: `{"model":"m","itl_ms":50}`, header: auth})
	if rec.Code != 200 {
		t.Fatalf("POST = %d %s", rec.Code, rec.Body)
	}
	got := decodeAs[SLOReply](t, rec)
	if got.Percentile != 0.9 || got.Mode != slo.ModeEnforce || got.State != slo.StateNoData || got.TTFTms != nil || *got.ITLms != 50 {
		t.Fatalf("reply %+v", got)
	}
	if len(*changes) != 1 || (*changes)[0] != (sloChange{"m", "enforce", false}) {
		t.Fatalf("controller told %+v", *changes)
	}
	slos.statuses["m"] = overrides.SLOStatus{Model: "m", State: slo.StateLowering, Applied: &slo.Thresholds{Decode: 0.6, Prefill: 4096},
		Suggested: slo.Thresholds{Decode: 0.6, Prefill: 4096}, UpdatedAt: 42}
	rec = f.do(t, request{method: "GET", target: "/slo?model=m"})
	one := decodeAs[SLOReply](t, rec)
	if rec.Code != 200 || one.State != slo.StateLowering || one.Applied.Decode != 0.6 || one.UpdatedAt != 42 {
		t.Fatalf("GET one = %d %+v", rec.Code, one)
	}
	var raw map[string]json.RawMessage
	_ = json.Unmarshal(f.do(t, request{method: "GET", target: "/slo?model=m"}).Body.Bytes(), &raw)
	for _, k := range []string{"model", "ttft_ms", "itl_ms", "percentile", "mode", "state", "applied", "suggested", "measured", "updated_at"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("GET /slo?model= lacks %q", k)
		}
	}
	all := decodeAs[SLOsReply](t, f.do(t, request{method: "GET", target: "/slo"}))
	if len(all.SLOs) != 1 || all.SLOs[0].Model != "m" {
		t.Fatalf("GET all = %+v", all)
	}
	if rec := f.do(t, request{method: "GET", target: "/slo?model=none"}); rec.Code != 404 {
		t.Errorf("GET unknown = %d", rec.Code)
	}
	if rec := f.do(t, request{method: "DELETE", target: "/slo?model=m"}); rec.Code != 401 {
		t.Errorf("DELETE without token = %d", rec.Code)
	}
	if rec := f.do(t, request{method: "DELETE", target: "/slo?model=m", header: auth}); rec.Code != 200 {
		t.Fatalf("DELETE = %d %s", rec.Code, rec.Body)
	}
	if last := (*changes)[len(*changes)-1]; !last.deleted || last.model != "m" {
		t.Errorf("controller not told of the delete: %+v", last)
	}
	if rec := f.do(t, request{method: "DELETE", target: "/slo?model=m", header: auth}); rec.Code != 404 {
		t.Errorf("DELETE again = %d", rec.Code)
	}
	if rec := f.do(t, request{method: "PUT", target: "/slo"}); rec.Code != 405 {
		t.Errorf("PUT = %d", rec.Code)
	}
}

// TestThresholdsUnderEnforcedSLO: 409 on a setting POST and a DELETE of
// /busy_threshold; a get-only POST answers 200 with controlled_by and the
// controller's thresholds (_frac null); shadow leaves thresholds alone.
func TestThresholdsUnderEnforcedSLO(t *testing.T) {
	t.Parallel()
	f, slos, _ := newSLOFixture(t, "")
	itl := 50.0
	slos.slos[testModel] = overrides.SLO{Model: testModel, ITLms: &itl, Percentile: 0.9, Mode: slo.ModeEnforce}
	slos.statuses[testModel] = overrides.SLOStatus{Model: testModel, Applied: &slo.Thresholds{Decode: 0.55, Prefill: 2048}}
	set := `{"model":"` + testModel + `","active_decode_blocks_threshold":0.5}`
	if rec := f.do(t, request{method: "POST", target: "/busy_threshold", body: set}); rec.Code != http.StatusConflict ||
		!json.Valid(rec.Body.Bytes()) {
		t.Fatalf("setting POST = %d %s, want 409", rec.Code, rec.Body)
	}
	// The 409 covers the thresholds of contract §21 too.
	for _, body := range []string{`{"model":"` + testModel + `","kv_committed_threshold":1}`,
		`{"model":"` + testModel + `","queue_delay_threshold_ms":200}`} {
		if rec := f.do(t, request{method: "POST", target: "/busy_threshold", body: body}); rec.Code != http.StatusConflict {
			t.Fatalf("setting POST %s = %d %s, want 409", body, rec.Code, rec.Body)
		}
	}
	if rec := f.do(t, request{method: "DELETE", target: "/busy_threshold?model=" + testModel}); rec.Code != http.StatusConflict {
		t.Fatalf("DELETE = %d %s, want 409", rec.Code, rec.Body)
	}
	rec := f.do(t, request{method: "POST", target: "/busy_threshold", body: `{"model":"` + testModel + `"}`})
	var raw map[string]any
	_ = json.Unmarshal(rec.Body.Bytes(), &raw)
	if rec.Code != 200 || raw["controlled_by"] != "slo" || raw["active_decode_blocks_threshold"] != 0.55 ||
		raw["active_prefill_tokens_threshold"] != 2048.0 || raw["active_prefill_tokens_threshold_frac"] != nil {
		t.Fatalf("get-only POST = %d %s", rec.Code, rec.Body)
	}
	list := decodeAs[ThresholdsReply](t, f.do(t, request{method: "GET", target: "/busy_threshold"}))
	for _, mt := range list.Thresholds {
		if (mt.Model == testModel) != (mt.ControlledBy == "slo") {
			t.Errorf("list: %+v", mt)
		}
	}
	// Shadow: thresholds are the operator's again.
	v := slos.slos[testModel]
	v.Mode = slo.ModeShadow
	slos.slos[testModel] = v
	if rec := f.do(t, request{method: "POST", target: "/busy_threshold", body: set}); rec.Code != 200 {
		t.Fatalf("setting POST under shadow = %d %s", rec.Code, rec.Body)
	}
	rec = f.do(t, request{method: "POST", target: "/busy_threshold", body: `{"model":"` + testModel + `"}`})
	if raw = nil; json.Unmarshal(rec.Body.Bytes(), &raw) != nil || raw["controlled_by"] != nil {
		t.Fatalf("controlled_by present under shadow: %s", rec.Body)
	}
}

// TestSLOTooMany: a new SLO beyond the cap (--max-slos) answers 429 with an
// error that says what to do, from the bucket's check or the controller's;
// replacing an SLO at the cap is fine.
func TestSLOTooMany(t *testing.T) {
	t.Parallel()
	f, slos, _ := newSLOFixture(t, "")
	slos.max = 1
	if rec := f.do(t, request{method: "POST", target: "/slo", body: `{"model":"a","itl_ms":50}`}); rec.Code != http.StatusOK {
		t.Fatalf("first SLO: %d %s", rec.Code, rec.Body)
	}
	rec := f.do(t, request{method: "POST", target: "/slo", body: `{"model":"b","itl_ms":50}`})
	if rec.Code != http.StatusTooManyRequests || !strings.Contains(rec.Body.String(), "--max-slos") {
		t.Errorf("an SLO beyond the cap: %d %s, want 429 naming --max-slos", rec.Code, rec.Body)
	}
	if rec := f.do(t, request{method: "POST", target: "/slo", body: `{"model":"a","itl_ms":70}`}); rec.Code != http.StatusOK {
		t.Errorf("replacing an SLO at the cap: %d %s", rec.Code, rec.Body)
	}

	// The controller's own cap (the bucket holds SLOs it does not count).
	g := newFixture(t, "", func(c *Config) {
		c.SLOs = newFakeSLOs()
		c.OnSLOChange = func(context.Context, string, overrides.SLO, bool) error {
			return fmt.Errorf("controller: %w", overrides.ErrTooManySLOs)
		}
	})
	rec = g.do(t, request{method: "POST", target: "/slo", body: `{"model":"b","itl_ms":50}`})
	if rec.Code != http.StatusTooManyRequests || !strings.Contains(rec.Body.String(), "--max-slos") {
		t.Errorf("an SLO beyond the controller's cap: %d %s, want 429 naming --max-slos", rec.Code, rec.Body)
	}
}
