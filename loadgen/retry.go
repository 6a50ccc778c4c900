package loadgen

import (
	"errors"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"
)

// Retries as the official OpenAI SDKs make them (contract §23), in the
// rules of openai-go (v3, internal/requestconfig): a request whose answer is
// 408, 409, 429 or 5xx, or that got no answer (a connection error, not a
// timeout), is sent again up to Config.Retries times; the header
// x-should-retry, when "true" or "false", overrides the status. The wait
// before retry n (0 for the first) is the answer's retry-after-ms, else its
// Retry-After (seconds, or an HTTP date), when 0 ≤ value ≤ 2 minutes; an
// answer asking for longer is not retried. Without either header the wait is
// min(0.5 s × 2^n, 8 s) less up to a quarter of it, at random. Every attempt
// carries RetryCountHeader: 0 on the first. A retry whose wait would end
// past Config.Timeout is not made (the request ends with its last answer),
// and a request waiting past its SLO deadline no longer holds the drain.

// RetryCountHeader is the header that numbers a request's attempts, 0 on the
// first, as the official OpenAI SDKs send it.
const RetryCountHeader = "X-Stainless-Retry-Count"

// Retry timing of openai-go.
const (
	// retryBackoff is the first wait without a header from the server; it
	// doubles with every retry.
	retryBackoff = 500 * time.Millisecond
	// retryMaxBackoff caps the wait without a header.
	retryMaxBackoff = 8 * time.Second
	// retryMaxServerDelay is the longest wait a server may ask for; one
	// that asks for longer is not retried.
	retryMaxServerDelay = 2 * time.Minute
)

// Headers a server answers with to steer retries.
const (
	retryAfterMsHeader = "Retry-After-Ms"
	retryAfterHeader   = "Retry-After"
	shouldRetryHeader  = "X-Should-Retry"
)

// shouldRetry reports whether an attempt that ended with status (0: no
// answer, a connection error) and header is retried, the attempts left
// aside.
func shouldRetry(status int, header http.Header) bool {
	if status == 0 {
		return true
	}
	switch header.Get(shouldRetryHeader) {
	case "true":
		return true
	case "false":
		return false
	}
	return status == http.StatusRequestTimeout || status == http.StatusConflict ||
		status == http.StatusTooManyRequests || status >= http.StatusInternalServerError
}

// retryDelay returns the wait before retry n (0-based) after an answer with
// header (nil: no answer), at now; ok is false when the server asks for a
// wait longer than retryMaxServerDelay: no retry. jitter(k) returns a
// random integer in [0, k).
func retryDelay(header http.Header, n int, now time.Time, jitter func(int64) int64) (d time.Duration, ok bool) {
	if d, found, tooLong := serverDelay(header, now); found {
		return d, !tooLong
	}
	d = retryMaxBackoff
	if b := float64(retryBackoff) * math.Pow(2, float64(n)); b < float64(retryMaxBackoff) {
		d = time.Duration(b)
	}
	if k := int64(d / 4); k > 0 {
		d -= time.Duration(jitter(k))
	}
	return d, true
}

// serverDelay reads the wait a server asks for: retry-after-ms first, then
// Retry-After in seconds or as an HTTP date. found is false without a
// usable header; tooLong when it asks for more than retryMaxServerDelay.
// A negative or non-finite number is skipped, as openai-go does; a date in
// the past is a wait of 0.
func serverDelay(header http.Header, now time.Time) (d time.Duration, found, tooLong bool) {
	for _, h := range [...]struct {
		name string
		unit time.Duration
	}{{retryAfterMsHeader, time.Millisecond}, {retryAfterHeader, time.Second}} {
		v := header.Get(h.name)
		if v == "" {
			continue
		}
		f, err := strconv.ParseFloat(v, 64)
		if errors.Is(err, strconv.ErrRange) && math.IsInf(f, 1) {
			return 0, true, true
		}
		if err == nil {
			if math.IsNaN(f) || math.IsInf(f, 0) || f < 0 {
				continue
			}
			limit := float64(retryMaxServerDelay) / float64(h.unit)
			if f > limit {
				return 0, true, true
			}
			return time.Duration(f * float64(h.unit)), true, false
		}
		if h.name != retryAfterHeader {
			continue
		}
		t, err := time.Parse(time.RFC1123, v)
		if err != nil {
			continue
		}
		switch d := t.Sub(now); {
		case d <= 0:
			return 0, true, false
		case d > retryMaxServerDelay:
			return 0, true, true
		default:
			return d, true, false
		}
	}
	return 0, false, false
}

// jitter returns a random integer in [0, k), k > 0.
func jitter(k int64) int64 { return rand.Int64N(k) }
