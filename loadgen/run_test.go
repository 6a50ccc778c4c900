package loadgen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// sseAnswer is a streamed answer of n tokens.
func sseAnswer(n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "data: {\"choices\":[{\"index\":0,\"text\":\" tok%d\",\"finish_reason\":null}]}\n\n", i)
	}
	b.WriteString("data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n")
	return b.String()
}

// fakeTransport answers every other request with 503, the others with 200
// after delay, without a network: usable inside a synctest bubble.
type fakeTransport struct {
	delay time.Duration
	calls atomic.Int64
}

func (f *fakeTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	status, body := http.StatusOK, sseAnswer(3)
	if f.calls.Add(1)%2 == 0 {
		status, body = http.StatusServiceUnavailable, `{"message":"busy","type":"service_unavailable","code":503}`
	} else {
		select {
		case <-time.After(f.delay):
		case <-r.Context().Done():
			return nil, r.Context().Err()
		}
	}
	return &http.Response{
		StatusCode: status,
		Header:     http.Header{},
		Body:       io.NopCloser(strings.NewReader(body)),
		Request:    r,
	}, nil
}

// runFor runs g until d has passed and returns its stats.
func runFor(t *testing.T, g *Generator, d time.Duration) Stats {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	if err := g.Run(ctx); err != nil {
		t.Fatalf("Run: %v", err)
	}
	return g.Stats()
}

// checkSum fails unless every request sent is counted by one outcome.
func checkSum(t *testing.T, c Counts) {
	t.Helper()
	if sum := c.OK + c.Unavailable + c.TooMany + c.OtherStatus + c.Errors + c.Cancelled + c.Aborted; sum != c.Sent {
		t.Errorf("outcomes add up to %d of %d sent: %+v", sum, c.Sent, c)
	}
}

func TestRateProfiles(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		change func(*Config)
		run    time.Duration
		want   float64 // requests sent: the integral of the rate
	}{
		{"constant", func(c *Config) { c.RPS = 20 }, 10 * time.Second, 200},
		{"triangle", func(c *Config) {
			c.Profile, c.MinRPS, c.MaxRPS, c.Period = ProfileTriangle, 0, 40, 10*time.Second
		}, 10 * time.Second, 200},
		{"half a triangle", func(c *Config) {
			c.Profile, c.MinRPS, c.MaxRPS, c.Period = ProfileTriangle, 10, 30, 20*time.Second
		}, 5 * time.Second, 75}, // 10 to 20 rps over 5 s
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				ft := &fakeTransport{delay: 40 * time.Millisecond}
				cfg := DefaultConfig()
				cfg.Transport = ft
				cfg.CancelFraction = 0
				tc.change(&cfg)
				g, err := New(cfg, nil)
				if err != nil {
					t.Fatal(err)
				}
				s := runFor(t, g, tc.run)
				if math.Abs(float64(s.Total.Sent)-tc.want) > 2 {
					t.Errorf("sent %d; want %v", s.Total.Sent, tc.want)
				}
				checkSum(t, s.Total)
				if d := int64(s.Total.OK) - int64(s.Total.Unavailable); d < -1 || d > 1 {
					t.Errorf("%d OK and %d unavailable; want every other", s.Total.OK, s.Total.Unavailable)
				}
				if l := s.Total.Latency; l.Count != s.Total.OK || l.P50 != 40*time.Millisecond || l.P99 != 40*time.Millisecond {
					t.Errorf("latency %+v; want 40ms", l)
				}
				if s.Statuses[200] != s.Total.OK || s.Statuses[503] != s.Total.Unavailable || s.Elapsed != tc.run {
					t.Errorf("statuses %v, elapsed %v", s.Statuses, s.Elapsed)
				}
			})
		})
	}
}

func TestAgainstServer(t *testing.T) {
	t.Parallel()
	var calls, bad atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Model     string `json:"model"`
			Prompt    string `json:"prompt"`
			MaxTokens int    `json:"max_tokens"`
			Stream    bool   `json:"stream"`
		}
		if r.URL.Path != "/v1/completions" || json.NewDecoder(r.Body).Decode(&body) != nil ||
			body.Model != "m" || body.MaxTokens != 4 || !body.Stream || len(body.Prompt)/4+1 != 10 {
			bad.Add(1)
		}
		if calls.Add(1)%2 == 0 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"message":"busy","type":"service_unavailable","code":503}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, sseAnswer(4))
	}))
	defer srv.Close()

	cfg := DefaultConfig()
	cfg.Target, cfg.Models = srv.URL, []string{"m"}
	cfg.RPS, cfg.PromptTokens, cfg.MaxTokens, cfg.CancelFraction = 50, 10, 4, 0
	g, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Stats is safe while Run runs.
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			_ = g.Stats()
			time.Sleep(time.Millisecond)
		}
	})
	if err := g.Run(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	s := g.Stats()

	// 50 rps for a second, within wide bounds.
	if s.Total.Sent < 20 || s.Total.Sent > 80 {
		t.Errorf("sent %d in a second at 50 rps", s.Total.Sent)
	}
	checkSum(t, s.Total)
	if n := uint64(calls.Load()); s.Total.OK == 0 || s.Total.Unavailable == 0 || s.Total.Errors != 0 ||
		s.Total.OtherStatus != 0 || n < s.Total.Sent-s.Total.Aborted || n > s.Total.Sent {
		t.Errorf("counts %+v after %d calls", s.Total, calls.Load())
	}
	if bad.Load() != 0 {
		t.Errorf("%d malformed requests", bad.Load())
	}
	if l := s.Total.Latency; l.Count != s.Total.OK || l.P50 <= 0 || l.P50 > l.P90 || l.P90 > l.P99 || l.P99 > l.Max {
		t.Errorf("latency %+v", l)
	}
	if s.Window.Sent != s.Total.Sent || s.InFlight != 0 || s.TargetRPS != 50 {
		t.Errorf("window %+v, in flight %d, target %v", s.Window, s.InFlight, s.TargetRPS)
	}
	if err := g.Run(t.Context()); !errors.Is(err, ErrAlreadyRun) {
		t.Errorf("second Run: %v; want ErrAlreadyRun", err)
	}
}

// counter counts the requests a server received and those whose client
// went away before the end.
type counter struct {
	calls, gone atomic.Int64
}

// slowServer streams n tokens, one every interval, or holds a non-streamed
// answer for n intervals.
func slowServer(t *testing.T, n int, interval time.Duration, c *counter) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.calls.Add(1)
		var body struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		rc := http.NewResponseController(w)
		w.WriteHeader(http.StatusOK)
		_ = rc.Flush()
		for i := range n {
			select {
			case <-r.Context().Done():
				c.gone.Add(1)
				return
			case <-time.After(interval):
			}
			if body.Stream {
				fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\" tok%d\"}]}\n\n", i)
				_ = rc.Flush()
			}
		}
		if body.Stream {
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
		} else {
			_, _ = io.WriteString(w, `{"choices":[{"text":"done"}]}`)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestCancellation(t *testing.T) {
	t.Parallel()
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			t.Parallel()
			var c counter
			// 100 tokens of 20 ms: two seconds unless cancelled.
			srv := slowServer(t, 100, 20*time.Millisecond, &c)
			cfg := DefaultConfig()
			cfg.Target, cfg.Stream = srv.URL, stream
			cfg.RPS, cfg.MaxTokens, cfg.CancelFraction, cfg.CancelAfter = 20, 10, 1, 50*time.Millisecond
			g, err := New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			s := runFor(t, g, 1500*time.Millisecond)
			checkSum(t, s.Total)
			if s.Total.Cancelled < 10 || s.Total.OK != 0 || s.Total.Errors != 0 {
				t.Errorf("counts %+v; want every request cancelled", s.Total)
			}
			// Every request that reached the server was cut off by its
			// client (a non-streamed one may be cancelled before it gets
			// there).
			deadline := time.Now().Add(10 * time.Second)
			for c.gone.Load() < c.calls.Load() && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if c.gone.Load() != c.calls.Load() || c.calls.Load() == 0 {
				t.Errorf("server saw %d clients go away of %d requests", c.gone.Load(), c.calls.Load())
			}
		})
	}
}

func TestConcurrencyCap(t *testing.T) {
	t.Parallel()
	var c counter
	srv := slowServer(t, 1000, 10*time.Millisecond, &c) // ten seconds
	cfg := DefaultConfig()
	cfg.Target, cfg.Stream = srv.URL, false
	cfg.RPS, cfg.Concurrency, cfg.CancelFraction = 100, 2, 0
	g, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := runFor(t, g, 500*time.Millisecond)
	if s.Total.Sent != 2 || s.Total.Aborted != 2 || s.Total.Dropped < 10 {
		t.Errorf("counts %+v; want 2 sent and aborted, the rest dropped", s.Total)
	}
	checkSum(t, s.Total)
}

func TestStreamFailures(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		status int
		body   string
		want   func(Counts) uint64 // the count that takes every answer
	}{
		{"cut", 200, "data: {\"choices\":[]}\n\n", func(c Counts) uint64 { return c.Errors }},
		{"error event", 200, "data: {\"choices\":[]}\n\nevent: error\ndata: {\"message\":\"x\"}\n\n",
			func(c Counts) uint64 { return c.Errors }},
		{"error data", 200, "data: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n",
			func(c Counts) uint64 { return c.Errors }},
		{"other status", 500, "{}", func(c Counts) uint64 { return c.OtherStatus }},
		{"429", 429, "{}", func(c Counts) uint64 { return c.TooMany }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.WriteHeader(tc.status)
				_, _ = io.WriteString(w, tc.body)
			}))
			defer srv.Close()
			cfg := DefaultConfig()
			cfg.Target, cfg.RPS, cfg.CancelFraction = srv.URL, 50, 0
			g, err := New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			s := runFor(t, g, 300*time.Millisecond)
			// A request in flight when the run ends is aborted.
			answered := s.Total.Sent - s.Total.Aborted
			if answered == 0 || tc.want(s.Total) != answered || s.Statuses[tc.status] != answered {
				t.Errorf("counts %+v, statuses %v", s.Total, s.Statuses)
			}
		})
	}
}

// holdTransport holds every request for an hour, so that a concurrency cap
// of 1 drops nearly every offered request.
type holdTransport struct{}

func (holdTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	select {
	case <-time.After(time.Hour):
	case <-r.Context().Done():
		return nil, r.Context().Err()
	}
	return &http.Response{StatusCode: 200, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(sseAnswer(1))), Request: r}, nil
}

// TestClassOfferedIncludesDropped: a request dropped at the concurrency cap
// counts in its class's offered load, so the classes add up to the total
// (its class was drawn only once it passed the cap: they added up to 1 of
// 100), and the n-th request's class does not depend on what was dropped.
func TestClassOfferedIncludesDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := DefaultConfig()
		cfg.Transport, cfg.CancelFraction, cfg.RPS, cfg.Concurrency, cfg.Seed = holdTransport{}, 0, 20, 1, 5
		cfg.PriorityMix = []PriorityShare{{-1, 0.5}, {0, 0.5}}
		g, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := runFor(t, g, 5*time.Second)
		rep := s.Report()
		var sum float64
		var dropped uint64
		for _, c := range rep.Classes {
			sum += c.OfferedRPS
		}
		for _, c := range s.Classes {
			dropped += c.Total.Dropped
		}
		if math.Abs(sum-rep.OfferedRPS) > 1e-9 || dropped != s.Total.Dropped || dropped < 90 {
			t.Errorf("classes' offered_rps add up to %.2f of %.2f, their drops %d of %d", sum, rep.OfferedRPS, dropped, s.Total.Dropped)
		}
	})
}
