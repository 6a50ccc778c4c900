package publisher

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"testing"
	"time"
)

func TestBackoffDoublesToCap(t *testing.T) {
	t.Parallel()
	tests := []struct {
		failures int
		want     time.Duration
	}{
		{1, registryBackoffMin},
		{2, 2 * registryBackoffMin},
		{3, 4 * registryBackoffMin},
		{6, 32 * registryBackoffMin},
		{7, registryBackoffMax},
		{1000, registryBackoffMax},
	}
	for _, tt := range tests {
		if got := backoff(tt.failures); got != tt.want {
			t.Errorf("backoff(%d) = %v, want %v", tt.failures, got, tt.want)
		}
	}
}

// errorLog logs the first failure, then at most one per logInterval with
// the count it left out, and the recovery once.
func TestErrorLogLimitsRate(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := errorLog{log: slog.New(slog.NewJSONHandler(&buf, nil)), what: "write thing"}
	t0 := time.Date(2026, 11, 5, 12, 0, 0, 0, time.UTC)
	fail := errors.New("boom")
	steps := []struct {
		at  time.Duration
		err error
	}{
		{0, nil},                          // fine: nothing to say
		{time.Second, fail},               // first failure: logged
		{2 * time.Second, fail},           // suppressed
		{3 * time.Second, fail},           // suppressed
		{time.Second + logInterval, fail}, // interval over: logged, 2 left out
		{20 * time.Second, nil},           // recovery: logged once
		{21 * time.Second, nil},           // still fine: nothing
		{22 * time.Second, fail},          // a new failure is logged at once
	}
	for _, s := range steps {
		l.result(t0.Add(s.at), s.err)
	}

	type line struct {
		Level      string `json:"level"`
		Msg        string `json:"msg"`
		Suppressed int    `json:"suppressed"`
	}
	want := []line{
		{"WARN", "workermon publisher: write thing failed", 0},
		{"WARN", "workermon publisher: write thing failed", 2},
		{"INFO", "workermon publisher: write thing recovered", 0},
		{"WARN", "workermon publisher: write thing failed", 0},
	}
	var got []line
	dec := json.NewDecoder(&buf)
	for dec.More() {
		var l line
		if err := dec.Decode(&l); err != nil {
			t.Fatalf("decode log: %v", err)
		}
		got = append(got, l)
	}
	if len(got) != len(want) {
		t.Fatalf("logged %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("log %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}
