// Package retrytest checks the retry headers of a rejection (contract §23)
// in tests.
package retrytest

import (
	"net/http"
	"strconv"
	"testing"
	"time"
)

// Headers checks that h holds one retry-after-ms and one Retry-After, both
// integers: retry-after-ms within [floor, hi], and Retry-After that value in
// whole seconds, rounded, at least floor rounded up and at least 1. It
// returns the retry-after-ms value.
func Headers(t testing.TB, h http.Header, floor, hi time.Duration) time.Duration {
	t.Helper()
	msv, secv := h.Values("Retry-After-Ms"), h.Values("Retry-After")
	if len(msv) != 1 || len(secv) != 1 {
		t.Fatalf("retry-after-ms %q, Retry-After %q: want one of each", msv, secv)
	}
	ms, err1 := strconv.ParseInt(msv[0], 10, 64)
	secs, err2 := strconv.ParseInt(secv[0], 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("retry-after-ms %q, Retry-After %q: want integers", msv, secv)
	}
	d := time.Duration(ms) * time.Millisecond
	if d < floor || d > hi {
		t.Errorf("retry-after-ms %d: want in [%v, %v]", ms, floor, hi)
	}
	if want := max(1, int64((floor+time.Second-1)/time.Second), (ms+500)/1000); secs != want {
		t.Errorf("Retry-After %d with retry-after-ms %d, floor %v; want %d", secs, ms, floor, want)
	}
	return d
}
