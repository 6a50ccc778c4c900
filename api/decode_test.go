package api

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestDecodeUint(t *testing.T) {
	t.Parallel()
	tests := []struct {
		raw    string
		want   uint64
		status int // 0: accepted
	}{
		{"0", 0, 0},
		{"4096", 4096, 0},
		{"18446744073709551615", 1<<64 - 1, 0},
		{"1000.0", 1000, 0},
		{"1e3", 1000, 0},
		{"-0", 0, 0},
		{"null", 0, 0},
		{"-1", 0, 400},
		{"-1e3", 0, 400},
		{"18446744073709551616", 0, 400},
		{"1.8446744073709552e19", 0, 400},
		{"1e999", 0, 400},
		{"0.5", 0, 422},
		{"-1.5", 0, 422},
		{`"12"`, 0, 422},
		{"false", 0, 422},
	}
	for _, tt := range tests {
		got, herr := decodeUint(json.RawMessage(tt.raw), fieldPrefill, "a whole number of tokens ≥ 0")
		switch {
		case tt.status != 0:
			if herr == nil || herr.status != tt.status {
				t.Errorf("decodeUint(%s) = %v, %v; want status %d", tt.raw, got, herr, tt.status)
			}
		case herr != nil:
			t.Errorf("decodeUint(%s): %v", tt.raw, herr)
		case tt.raw == "null" && got != nil, tt.raw != "null" && (got == nil || *got != tt.want):
			t.Errorf("decodeUint(%s) = %v, want %d", tt.raw, got, tt.want)
		}
	}
}

func TestDecodeFloat(t *testing.T) {
	t.Parallel()
	unit := func(v float64) bool { return v >= 0 && v <= 1 }
	tests := []struct {
		raw    string
		want   float64
		status int
	}{
		{"0", 0, 0},
		{"1", 1, 0},
		{"0.85", 0.85, 0},
		{"85e-2", 0.85, 0},
		{"1e-400", 0, 0}, // underflows to 0: in range
		{"1.0000001", 0, 400},
		{"-0.0001", 0, 400},
		{"1e999", 0, 400},
		{"-1e999", 0, 400},
		{`"NaN"`, 0, 422},
		{`"Infinity"`, 0, 422},
		{"[]", 0, 422},
	}
	for _, tt := range tests {
		got, herr := decodeFloat(json.RawMessage(tt.raw), fieldDecode, "in [0, 1]", unit)
		switch {
		case tt.status != 0:
			if herr == nil || herr.status != tt.status {
				t.Errorf("decodeFloat(%s) = %v, %v; want status %d", tt.raw, got, herr, tt.status)
			}
		case herr != nil:
			t.Errorf("decodeFloat(%s): %v", tt.raw, herr)
		case got == nil || *got != tt.want:
			t.Errorf("decodeFloat(%s) = %v, want %v", tt.raw, got, tt.want)
		}
	}
}

// TestBodyLimitChunked checks the limit on a body of unknown length.
func TestBodyLimitChunked(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "", nil)
	body := `{"model":"` + strings.Repeat("a", DefaultMaxBody) + `"}`
	req := httptest.NewRequest(http.MethodPost, "/busy_threshold", io.NopCloser(strings.NewReader(body)))
	req.ContentLength = -1
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	f.h.ServeHTTP(rec, req)
	if msg := errorBody(t, rec); rec.Code != http.StatusRequestEntityTooLarge || !strings.Contains(msg, "limit") {
		t.Errorf("chunked large body = %d %q", rec.Code, msg)
	}
}

// FuzzRequest checks that no body crashes the decoder, that every refusal
// is a 400 or a 422, and that what is accepted is within the contract.
func FuzzRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m"}`, `{"model":"m","active_decode_blocks_threshold":0.5}`,
		`{"model":"m","active_prefill_tokens_threshold":1e3,"active_prefill_tokens_threshold_frac":0.25}`,
		`{"model":"m","active_decode_blocks_threshold":NaN}`, `[]`, `{"model":1}`, `{"a":{"b":[1,2,{}]}}`, `{"model":"m"}x`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		members, herr := parseObject(body)
		if herr != nil {
			if herr.status != 400 && herr.status != 422 {
				t.Fatalf("parseObject: status %d", herr.status)
			}
			return
		}
		req, herr := decodeRequest(members)
		if herr != nil {
			if herr.status != 400 && herr.status != 422 {
				t.Fatalf("decodeRequest: status %d", herr.status)
			}
			return
		}
		if err := req.patch.Validate(); err != nil {
			t.Fatalf("accepted %q: %v", body, err)
		}
		if checkModel(req.model) != nil {
			t.Fatalf("accepted model %q", req.model)
		}
	})
}
