package retry

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
	b := NewBackoff(100*time.Millisecond, time.Second)
	// Without jitter: 100, 200, 400, 800, 1000, 1000 ms; jitter is ±20%.
	for i, want := range []time.Duration{100, 200, 400, 800, 1000, 1000} {
		want *= time.Millisecond
		if got := b.Next(); got < want*8/10 || got > want*12/10 {
			t.Errorf("attempt %d: %v, want %v ±20%%", i+1, got, want)
		}
	}
	b.Reset()
	if got := b.Next(); got > 120*time.Millisecond {
		t.Errorf("after Reset: %v, want about the minimum", got)
	}
}

// ErrLog logs the first failure, then at most one per LogEvery with the
// count it left out, and the recovery once.
func TestErrLogLimitsRate(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := NewErrLog(slog.New(slog.NewJSONHandler(&buf, nil)), slog.LevelWarn, "x: write thing")
	t0 := time.Date(2026, 11, 5, 12, 0, 0, 0, time.UTC)
	var at time.Duration
	l.now = func() time.Time { return t0.Add(at) }
	fail := errors.New("boom")
	steps := []struct {
		at  time.Duration
		err error
	}{
		{0, nil},                       // fine: nothing to say
		{time.Second, fail},            // first failure: logged
		{2 * time.Second, fail},        // suppressed
		{3 * time.Second, fail},        // suppressed
		{time.Second + LogEvery, fail}, // interval over: logged, 2 left out
		{20 * time.Second, nil},        // recovery: logged once
		{21 * time.Second, nil},        // still fine: nothing
		{22 * time.Second, fail},       // LogEvery since the last: logged
		{23 * time.Second, nil},        // recovery
		{24 * time.Second, fail},       // flapping: quiet until LogEvery passed
	}
	for _, s := range steps {
		at = s.at
		l.Result(s.err)
	}
	type line struct {
		Level      string `json:"level"`
		Msg        string `json:"msg"`
		Suppressed int    `json:"suppressed"`
	}
	want := []line{
		{"WARN", "x: write thing failed", 0},
		{"WARN", "x: write thing failed", 2},
		{"INFO", "x: write thing recovered", 0},
		{"WARN", "x: write thing failed", 0},
		{"INFO", "x: write thing recovered", 0},
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
			t.Errorf("line %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}
