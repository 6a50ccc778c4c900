package loadgen

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestRateAt(t *testing.T) {
	t.Parallel()
	tri := DefaultConfig()
	tri.Profile, tri.MinRPS, tri.MaxRPS, tri.Period = ProfileTriangle, 2, 12, 10*time.Second
	for _, tc := range []struct {
		elapsed time.Duration
		want    float64
	}{
		{0, 2},
		{2500 * time.Millisecond, 7},
		{5 * time.Second, 12},
		{7500 * time.Millisecond, 7},
		{10 * time.Second, 2},
		{15 * time.Second, 12}, // the next cycle
	} {
		if got := tri.RateAt(tc.elapsed); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("triangle RateAt(%v) = %v; want %v", tc.elapsed, got, tc.want)
		}
	}
	c := DefaultConfig()
	c.RPS = 7
	if got := c.RateAt(time.Hour); got != 7 {
		t.Errorf("constant RateAt = %v; want 7", got)
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("DefaultConfig: %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(*Config)
		fields []string
	}{
		{"target", func(c *Config) { c.Target = "ftp://x" }, []string{"Target"}},
		{"target v1", func(c *Config) { c.Target = "http://x/v1" }, []string{"Target"}},
		{"target with a password, bad port", func(c *Config) { c.Target = "http://u:s3cr3t@x:80x0" }, []string{"Target"}},
		{"target with a token, no host", func(c *Config) { c.Target = "http://s3cr3t@" }, []string{"Target"}},
		{"models", func(c *Config) { c.Models = []string{"a", ""} }, []string{"Models"}},
		{"api and profile", func(c *Config) { c.API, c.Profile = "x", "y" }, []string{"API", "Profile"}},
		{"constant", func(c *Config) { c.RPS = 0 }, []string{"RPS"}},
		{"triangle", func(c *Config) {
			c.Profile, c.MinRPS, c.MaxRPS, c.Period = ProfileTriangle, 5, 4, 0
		}, []string{"MaxRPS", "Period"}},
		{"negative min", func(c *Config) { c.Profile, c.MinRPS = ProfileTriangle, -1 }, []string{"MinRPS"}},
		{"sizes", func(c *Config) {
			c.Concurrency, c.PromptTokens, c.MaxTokens, c.Timeout = 0, 0, 0, 0
		}, []string{"Concurrency", "PromptTokens", "MaxTokens", "Timeout"}},
		{"cancel", func(c *Config) { c.CancelFraction, c.CancelAfter = math.NaN(), 0 }, []string{"CancelFraction", "CancelAfter"}},
		{"window", func(c *Config) { c.Window = time.Millisecond }, []string{"Window"}},
		{"sim output tokens of a fixed workload", func(c *Config) { c.SimOutputTokens = true }, []string{"SimOutputTokens"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := DefaultConfig()
			tc.change(&cfg)
			err := cfg.Validate()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("Validate: %v; want ErrInvalidConfig", err)
			}
			for _, f := range tc.fields {
				if !strings.Contains(err.Error(), "check "+f+":") {
					t.Errorf("error %q does not name %s", err, f)
				}
			}
			if strings.Contains(err.Error(), "s3cr3t") {
				t.Errorf("error %q shows the secret", err)
			}
			if _, err := New(cfg, nil); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("New: %v; want ErrInvalidConfig", err)
			}
		})
	}
}

func TestPrompt(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 7, 256} {
		p := makePrompt(n)
		// The simulated engine counts len/4+1 tokens.
		if got := len(p)/4 + 1; got != n {
			t.Errorf("makePrompt(%d) counts %d tokens", n, got)
		}
		if len(strings.Fields(p)) != n {
			t.Errorf("makePrompt(%d) has %d words", n, len(strings.Fields(p)))
		}
	}
}

func TestHistogram(t *testing.T) {
	t.Parallel()
	var h histogram
	if h.summary() != (Latency{}) {
		t.Fatalf("empty summary %+v", h.summary())
	}
	for i := 1; i <= 100; i++ {
		h.add(time.Duration(i) * time.Millisecond)
	}
	s := h.summary()
	within := func(got, want time.Duration) bool {
		return got >= want && float64(got) <= float64(want)*histGrowth
	}
	if s.Count != 100 || !within(s.P50, 50*time.Millisecond) || !within(s.P90, 90*time.Millisecond) ||
		!within(s.P99, 99*time.Millisecond) || s.Max != 100*time.Millisecond {
		t.Errorf("summary %+v", s)
	}
	// Extremes land in the first and last buckets.
	h.add(0)
	h.add(24 * time.Hour)
	if h.quantile(1) != 24*time.Hour || h.quantile(0) > histMin {
		t.Errorf("extremes: %v, %v", h.quantile(0), h.quantile(1))
	}
}

func TestRecorderWindow(t *testing.T) {
	t.Parallel()
	r := newRecorder(10 * time.Second)
	if s := r.stats(time.Now()); s.Total.Sent != 0 || s.Statuses == nil {
		t.Fatalf("stats before the start %+v", s)
	}
	t0 := time.Unix(1000, 0)
	r.begin(t0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	for i := range 20 { // one request a second, each taking 10 ms
		r.sent(at(time.Duration(i)*time.Second), noClass)
		r.done(at(time.Duration(i)*time.Second+10*time.Millisecond), done{class: noClass, o: outOK,
			start: at(time.Duration(i) * time.Second),
			res:   Result{Status: 200, E2E: time.Duration(i+1) * time.Millisecond}})
	}
	r.dropped(at(19*time.Second), noClass)
	r.sent(at(19*time.Second), noClass)
	r.done(at(19*time.Second), done{class: noClass, o: outUnavailable, start: at(19 * time.Second), res: Result{Status: 503}})

	s := r.stats(at(19*time.Second + 500*time.Millisecond))
	if s.Total.Sent != 21 || s.Total.OK != 20 || s.Total.Unavailable != 1 || s.Total.Dropped != 1 ||
		s.Statuses[200] != 20 || s.Statuses[503] != 1 || s.InFlight != 0 {
		t.Errorf("total %+v, statuses %v", s.Total, s.Statuses)
	}
	// The window holds seconds 10 to 19.
	if s.Window.Sent != 11 || s.Window.OK != 10 || s.Window.Latency.Count != 10 ||
		s.Window.Latency.Max != 20*time.Millisecond || s.Window.Duration != 9500*time.Millisecond {
		t.Errorf("window %+v", s.Window)
	}
	if s.Total.Latency.Max != 20*time.Millisecond || s.Total.Latency.P50 < 10*time.Millisecond {
		t.Errorf("total latency %+v", s.Total.Latency)
	}
	// Long after, the window is empty but the total stays.
	s = r.stats(at(time.Hour))
	if s.Window.Sent != 0 || s.Window.Latency.Count != 0 || s.Total.Sent != 21 {
		t.Errorf("after an hour: window %+v, total sent %d", s.Window, s.Total.Sent)
	}
}

func TestRequestBodies(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	cfg.Target = "http://h:1/"
	cfg.API, cfg.Models, cfg.MaxTokens, cfg.PromptTokens, cfg.Stream = APIChat, []string{"a", "b"}, 7, 3, false
	g, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if g.url != "http://h:1/v1/chat/completions" {
		t.Errorf("url %s", g.url)
	}
	want := []string{
		`{"model":"a","messages":[{"role":"user","content":"the fox ran"}],"max_tokens":7,"stream":false}`,
		`{"model":"b","messages":[{"role":"user","content":"the fox ran"}],"max_tokens":7,"stream":false}`,
	}
	for i, b := range g.bodies {
		if string(b) != want[i] {
			t.Errorf("body %d: %s; want %s", i, b, want[i])
		}
	}
}
