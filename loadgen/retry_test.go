package loadgen

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

func TestShouldRetry(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status int
		should string // x-should-retry
		want   bool
	}{
		{0, "", true}, // a connection error
		{408, "", true}, {409, "", true}, {429, "", true}, {500, "", true}, {502, "", true}, {503, "", true}, {529, "", true},
		{400, "", false}, {401, "", false}, {404, "", false}, {413, "", false}, {422, "", false},
		{400, "true", true}, {503, "false", false}, {503, "maybe", true},
	} {
		h := http.Header{}
		if tc.should != "" {
			h.Set("x-should-retry", tc.should)
		}
		if got := shouldRetry(tc.status, h); got != tc.want {
			t.Errorf("status %d, x-should-retry %q: retry %v; want %v", tc.status, tc.should, got, tc.want)
		}
	}
}

func TestRetryDelay(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	none := func(int64) int64 { return 0 }
	most := func(k int64) int64 { return k - 1 }
	for _, tc := range []struct {
		name   string
		header map[string]string
		n      int
		jitter func(int64) int64
		want   time.Duration
		ok     bool
	}{
		{"backoff 0", nil, 0, none, 500 * time.Millisecond, true},
		{"backoff 0, most jitter", nil, 0, most, 375*time.Millisecond + 1, true},
		{"backoff 1", nil, 1, none, time.Second, true},
		{"backoff 3", nil, 3, none, 4 * time.Second, true},
		{"backoff capped", nil, 4, none, 8 * time.Second, true},
		{"backoff capped, most jitter", nil, 40, most, 6*time.Second + 1, true},
		{"retry-after-ms", map[string]string{"retry-after-ms": "1234"}, 0, most, 1234 * time.Millisecond, true},
		{"retry-after-ms fraction", map[string]string{"retry-after-ms": "2.5"}, 0, none, 2500 * time.Microsecond, true},
		{"retry-after-ms first", map[string]string{"retry-after-ms": "300", "Retry-After": "7"}, 0, none, 300 * time.Millisecond, true},
		{"retry-after-ms 0", map[string]string{"retry-after-ms": "0"}, 2, none, 0, true},
		{"retry-after-ms 2 min", map[string]string{"retry-after-ms": "120000"}, 0, none, 2 * time.Minute, true},
		{"retry-after-ms past 2 min", map[string]string{"retry-after-ms": "120001"}, 0, none, 0, false},
		{"retry-after-ms overflows", map[string]string{"retry-after-ms": "1e400"}, 0, none, 0, false},
		{"retry-after-ms negative: Retry-After", map[string]string{"retry-after-ms": "-5", "Retry-After": "3"}, 0, none, 3 * time.Second, true},
		{"retry-after-ms junk: Retry-After", map[string]string{"retry-after-ms": "soon", "Retry-After": "3"}, 0, none, 3 * time.Second, true},
		{"retry-after-ms NaN: backoff", map[string]string{"retry-after-ms": "NaN"}, 1, none, time.Second, true},
		{"Retry-After seconds", map[string]string{"Retry-After": "2"}, 0, none, 2 * time.Second, true},
		{"Retry-After 120", map[string]string{"Retry-After": "120"}, 0, none, 2 * time.Minute, true},
		{"Retry-After 121", map[string]string{"Retry-After": "121"}, 0, none, 0, false},
		{"Retry-After date", map[string]string{"Retry-After": now.Add(7 * time.Second).Format(http.TimeFormat)}, 0, none, 7 * time.Second, true},
		{"Retry-After date past", map[string]string{"Retry-After": now.Add(-7 * time.Second).Format(http.TimeFormat)}, 0, none, 0, true},
		{"Retry-After date too far", map[string]string{"Retry-After": now.Add(3 * time.Minute).Format(http.TimeFormat)}, 0, none, 0, false},
		{"Retry-After junk: backoff", map[string]string{"Retry-After": "later"}, 0, none, 500 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var h http.Header
			if tc.header != nil {
				h = http.Header{}
				for k, v := range tc.header {
					h.Set(k, v)
				}
			}
			got, ok := retryDelay(h, tc.n, now, tc.jitter)
			if got != tc.want || ok != tc.ok {
				t.Errorf("retryDelay = %v, %v; want %v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

// scriptTransport answers attempt n of the one request of a run with
// answer(n, now) and records when each attempt came and its retry count;
// nil is a connection error. No network: usable in a synctest bubble.
type scriptTransport struct {
	answer func(n int, now time.Time) *http.Response

	mu       sync.Mutex
	times    []time.Time
	counts   []string
	statuses []int // 0: no answer
}

var errRefused = errors.New("connection refused")

func (s *scriptTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	s.mu.Lock()
	n := len(s.times)
	s.times = append(s.times, time.Now())
	s.counts = append(s.counts, r.Header.Get(RetryCountHeader))
	s.mu.Unlock()
	resp := s.answer(n, time.Now())
	status := 0
	if resp != nil {
		status = resp.StatusCode
	}
	s.mu.Lock()
	s.statuses = append(s.statuses, status)
	s.mu.Unlock()
	if resp == nil {
		return nil, errRefused
	}
	resp.Request = r
	return resp, nil
}

// reply returns a response of status with header pairs; a 200 is a stream
// of 3 tokens.
func reply(status int, kv ...string) *http.Response {
	body := `{"error":{"message":"busy","type":"service_unavailable","param":null,"code":503}}`
	if status == http.StatusOK {
		body = sseAnswer(3)
	}
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return &http.Response{StatusCode: status, Header: h, Body: io.NopCloser(strings.NewReader(body))}
}

// TestRetries runs one request against a scripted server, in a bubble of
// fake time, and checks its attempts, their spacing and headers, and how
// they are counted: the outcomes count attempts, the request counts once,
// failed when its last attempt got no 200, its TTFT from the first send.
func TestRetries(t *testing.T) {
	t.Parallel()
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	type gap struct{ lo, hi time.Duration } // bounds of the wait before an attempt, both included
	exact := func(d time.Duration) gap { return gap{d, d} }
	for _, tc := range []struct {
		name    string
		retries int
		timeout time.Duration
		answer  func(n int, now time.Time) *http.Response
		gaps    []gap // one per retry
		want    Counts
		ttft    time.Duration // of the last attempt's 200, from the first send
	}{{
		name: "retry-after-ms, then served", retries: 2,
		answer: func(n int, _ time.Time) *http.Response {
			switch n {
			case 0:
				return reply(503, "retry-after-ms", "700", "Retry-After", "1")
			case 1:
				return reply(429, "retry-after-ms", "1300", "Retry-After", "2")
			}
			return reply(200)
		},
		gaps: []gap{exact(ms(700)), exact(ms(1300))},
		want: Counts{Sent: 1, Attempts: 3, Unavailable: 1, TooMany: 1, OK: 1},
		ttft: ms(2000),
	}, {
		name: "backoff without a header, retries run out", retries: 3,
		answer: func(int, time.Time) *http.Response { return reply(500) },
		gaps:   []gap{{ms(375), ms(500)}, {ms(750), ms(1000)}, {ms(1500), ms(2000)}},
		want:   Counts{Sent: 1, Attempts: 4, OtherStatus: 4, Failed: 1},
	}, {
		name: "Retry-After in seconds and as a date", retries: 2,
		answer: func(n int, now time.Time) *http.Response {
			switch n {
			case 0:
				return reply(503, "Retry-After", "2")
			case 1:
				// A date has whole seconds: the wait is up to 3 s.
				return reply(503, "Retry-After", now.Add(3*time.Second).UTC().Format(http.TimeFormat))
			}
			return reply(503)
		},
		gaps: []gap{exact(2 * time.Second), {2*time.Second + 1, 3 * time.Second}},
		want: Counts{Sent: 1, Attempts: 3, Unavailable: 3, Failed: 1},
	}, {
		name: "a wait past 2 minutes is not retried", retries: 2,
		answer: func(int, time.Time) *http.Response { return reply(503, "retry-after-ms", "120001") },
		want:   Counts{Sent: 1, Attempts: 1, Unavailable: 1, Failed: 1},
	}, {
		name: "a wait of 2 minutes is", retries: 1, timeout: 5 * time.Minute,
		answer: func(n int, _ time.Time) *http.Response {
			if n == 0 {
				return reply(503, "retry-after-ms", "120000")
			}
			return reply(200)
		},
		gaps: []gap{exact(2 * time.Minute)},
		want: Counts{Sent: 1, Attempts: 2, Unavailable: 1, OK: 1},
		ttft: 2 * time.Minute,
	}, {
		name: "400 is not retried", retries: 2,
		answer: func(int, time.Time) *http.Response { return reply(400) },
		want:   Counts{Sent: 1, Attempts: 1, OtherStatus: 1, Failed: 1},
	}, {
		name: "x-should-retry overrides the status", retries: 2,
		answer: func(n int, _ time.Time) *http.Response {
			if n == 0 {
				return reply(400, "x-should-retry", "true", "retry-after-ms", "10")
			}
			return reply(503, "x-should-retry", "false")
		},
		gaps: []gap{exact(ms(10))},
		want: Counts{Sent: 1, Attempts: 2, OtherStatus: 1, Unavailable: 1, Failed: 1},
	}, {
		name: "a connection error is retried", retries: 1,
		answer: func(n int, _ time.Time) *http.Response {
			if n == 0 {
				return nil
			}
			return reply(200)
		},
		gaps: []gap{{ms(375), ms(500)}},
		want: Counts{Sent: 1, Attempts: 2, Errors: 1, OK: 1},
		ttft: -1, // checked against the gap
	}, {
		name: "no retries", retries: 0,
		answer: func(int, time.Time) *http.Response { return reply(503, "retry-after-ms", "10") },
		want:   Counts{Sent: 1, Attempts: 1, Unavailable: 1, Failed: 1},
	}, {
		name: "the timeout ends the wait: the last answer counts", retries: 2, timeout: 2 * time.Second,
		answer: func(int, time.Time) *http.Response { return reply(503, "retry-after-ms", "5000") },
		want:   Counts{Sent: 1, Attempts: 1, Unavailable: 1, Failed: 1},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				st := &scriptTransport{answer: tc.answer}
				cfg := DefaultConfig()
				cfg.Transport, cfg.CancelFraction, cfg.Retries = st, 0, tc.retries
				cfg.SLO.TTFT = time.Second
				if tc.timeout > 0 {
					cfg.Timeout = tc.timeout
				}
				cfg.RateFunc = func(t time.Duration) float64 { // one request, at the first tick
					if t < 15*time.Millisecond {
						return 100
					}
					return 0
				}
				var samples []Sample
				cfg.OnDone = func(s Sample) { samples = append(samples, s) } // one request: no race
				g, err := New(cfg, nil)
				if err != nil {
					t.Fatal(err)
				}
				s := runFor(t, g, max(30*time.Second, 2*cfg.Timeout))
				got := s.Total
				want := tc.want
				if got.Sent != want.Sent || got.Attempts != want.Attempts || got.OK != want.OK || got.Unavailable != want.Unavailable ||
					got.TooMany != want.TooMany || got.OtherStatus != want.OtherStatus || got.Errors != want.Errors ||
					got.Failed != want.Failed || got.Aborted != 0 {
					t.Errorf("counts %+v;\nwant sent %d attempts %d ok %d 503 %d 429 %d other %d errors %d failed %d", got,
						want.Sent, want.Attempts, want.OK, want.Unavailable, want.TooMany, want.OtherStatus, want.Errors, want.Failed)
				}
				if sum := got.OK + got.Unavailable + got.TooMany + got.OtherStatus + got.Errors + got.Cancelled + got.Aborted; sum != got.Attempts {
					t.Errorf("outcomes add up to %d of %d attempts", sum, got.Attempts)
				}
				rep := s.Report()
				if rep.Attempts != want.Attempts || rep.Failed != want.Failed || rep.AttemptsPerRequest != float64(want.Attempts) {
					t.Errorf("report attempts %d failed %d per request %v", rep.Attempts, rep.Failed, rep.AttemptsPerRequest)
				}

				st.mu.Lock()
				defer st.mu.Unlock()
				if len(st.times) != int(want.Attempts) {
					t.Fatalf("the server saw %d attempts; want %d", len(st.times), want.Attempts)
				}
				for i, c := range st.counts {
					if want := []string{"0", "1", "2", "3"}[i]; c != want {
						t.Errorf("attempt %d: %s %q; want %q", i, RetryCountHeader, c, want)
					}
				}
				for i, g := range tc.gaps {
					if d := st.times[i+1].Sub(st.times[i]); d < g.lo || d > g.hi {
						t.Errorf("wait before retry %d: %v; want in [%v, %v]", i+1, d, g.lo, g.hi)
					}
				}
				if len(samples) != 1 {
					t.Fatalf("%d samples; want 1", len(samples))
				}
				sm := samples[0]
				if sm.Attempts != int(want.Attempts) || sm.Failed != (want.Failed == 1) || sm.OK != (want.OK == 1) {
					t.Errorf("sample attempts %d failed %v ok %v", sm.Attempts, sm.Failed, sm.OK)
				}
				// Each attempt as the server saw it: sent at its time since
				// the first, answered with its status.
				if len(sm.Tries) != len(st.times) {
					t.Errorf("sample tries %+v; want %d", sm.Tries, len(st.times))
				}
				for i, try := range sm.Tries[:min(len(sm.Tries), len(st.times))] {
					if at := st.times[i].Sub(st.times[0]); try.At != at || try.Status != st.statuses[i] {
						t.Errorf("try %d: %+v; want sent at %v, status %d", i, try, at, st.statuses[i])
					}
				}
				ttft := tc.ttft
				if ttft < 0 {
					ttft = st.times[len(st.times)-1].Sub(st.times[0])
				}
				if want.OK == 1 {
					// The answer comes at once: the TTFT is the time from
					// the first send to the last, good within the 1 s target.
					good := ttft <= cfg.SLO.TTFT
					if sm.Result.TTFT != ttft || sm.Result.E2E != ttft || sm.Good != good || (got.Good == 1) != good {
						t.Errorf("TTFT %v E2E %v good %v; want %v from the first send, good %v", sm.Result.TTFT, sm.Result.E2E, sm.Good, ttft, good)
					}
				}
			})
		})
	}
}

// A retry the server asks for past the request's timeout is not waited
// for: the request ends at once with its last answer. One within the
// timeout but past the request's SLO deadline is waited for, but the run's
// drain does not wait for it (it cannot be good). Neither holds the run
// past its Duration.
func TestRetryPastTimeoutDoesNotHoldTheRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, after string
		attempts    uint64
	}{{"past the timeout", "100000", 1}, {"past the SLO", "30000", 1}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			testRetryHoldsRun(t, tc.after, tc.attempts)
		})
	}
}

func testRetryHoldsRun(t *testing.T, after string, attempts uint64) {
	synctest.Test(t, func(t *testing.T) {
		st := &scriptTransport{answer: func(int, time.Time) *http.Response { return reply(503, "retry-after-ms", after) }}
		cfg := DefaultConfig()
		cfg.Transport, cfg.CancelFraction, cfg.Retries = st, 0, 2
		cfg.Timeout, cfg.Duration = time.Minute, time.Second
		cfg.RateFunc = func(t time.Duration) float64 { // one request, at the first tick
			if t < 15*time.Millisecond {
				return 100
			}
			return 0
		}
		g, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		s := runFor(t, g, 10*time.Minute)
		if took := time.Since(start); took > cfg.Duration+100*time.Millisecond {
			t.Errorf("the run took %v (fake time) for a Duration of %v: held by a retry wait", took, cfg.Duration)
		}
		if c := s.Total; c.Sent != 1 || c.Attempts != attempts || c.Unavailable != attempts || c.Failed != 1 {
			t.Errorf("counts %+v; want %d attempts, 503, failed", c, attempts)
		}
	})
}
