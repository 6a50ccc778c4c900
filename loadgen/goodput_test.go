package loadgen

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// The goodput arithmetic of contract §16, as vLLM's benchmark defines it.
func TestResultGood(t *testing.T) {
	t.Parallel()
	slo := SLO{TTFT: time.Second, ITL: 50 * time.Millisecond}
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	stream := func(ttft, e2e time.Duration, tokens int) Result {
		return Result{Status: 200, Stream: true, Complete: true, Finished: true, Tokens: tokens, TTFT: ttft, E2E: e2e}
	}
	for _, tc := range []struct {
		name string
		r    Result
		good bool
		tpot time.Duration // 0: none
	}{
		{"within both", stream(ms(500), ms(500+99*40), 100), true, ms(40)},
		{"TTFT at the target", stream(ms(1000), ms(1000+99*50), 100), true, ms(50)},
		{"TTFT over", stream(ms(1001), ms(1001+99*10), 100), false, ms(10)},
		{"TPOT over", stream(ms(100), ms(100+99*51), 100), false, ms(51)},
		{"TPOT at the target", stream(ms(100), ms(100+99*50), 100), true, ms(50)},
		{"one token: no TPOT test", stream(ms(900), ms(5000), 1), true, 0},
		{"two tokens", stream(ms(900), ms(951), 2), false, ms(51)},
		{"no finish reason", func() Result { r := stream(ms(10), ms(100), 10); r.Finished = false; return r }(), false, ms(10)},
		{"cut short", func() Result { r := stream(ms(10), ms(100), 10); r.Complete = false; return r }(), false, ms(10)},
		{"503", Result{Status: 503, Stream: true, E2E: ms(1)}, false, 0},
		{"429", Result{Status: 429, E2E: ms(1)}, false, 0},
		{"no tokens", stream(0, ms(10), 0), false, 0},
		{"non-streamed within t + i × (n−1)", Result{Status: 200, Complete: true, Tokens: 11, E2E: ms(1000 + 10*50)}, true, 0},
		{"non-streamed over", Result{Status: 200, Complete: true, Tokens: 11, E2E: ms(1000+10*50) + 1}, false, 0},
		{"non-streamed one token", Result{Status: 200, Complete: true, Tokens: 1, E2E: ms(1000)}, true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := tc.r.Good(slo); got != tc.good {
				t.Errorf("Good = %v; want %v", got, tc.good)
			}
			tpot, ok := tc.r.TPOT()
			if ok != (tc.tpot != 0) || tpot != tc.tpot {
				t.Errorf("TPOT = %v, %v; want %v", tpot, ok, tc.tpot)
			}
		})
	}
}

// The --json document has exactly §16's and §23's keys, times in ms, and null for a
// percentile of nothing.
func TestReportShape(t *testing.T) {
	t.Parallel()
	s := Stats{
		Total: Counts{Duration: 10 * time.Second, Sent: 90, Dropped: 10, OK: 50, Good: 40, Unavailable: 30, TooMany: 5,
			Attempts: 120, Failed: 25,
			Latency: Latency{Count: 50, P50: 1500 * time.Millisecond, P90: 2 * time.Second, P99: 3 * time.Second},
			TTFT:    Latency{Count: 50, P50: 100 * time.Millisecond, P90: 200 * time.Millisecond, P99: 300 * time.Millisecond},
			TPOT:    Latency{Count: 50, P50: 20 * time.Millisecond, P90: 30 * time.Millisecond, P99: 40 * time.Millisecond}},
		Classes: []ClassStats{{Class: 0, Total: Counts{Duration: 10 * time.Second, Sent: 20, TooMany: 5, Queued: 2,
			QueueWait: Latency{Count: 2, P50: 7 * time.Millisecond, P90: 8 * time.Millisecond, P99: 9 * time.Millisecond}}}},
	}
	data, err := json.Marshal(s.Report())
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	keys := []string{"offered_rps", "goodput_rps", "ok", "good", "rejected", "shed", "attempts", "failed", "attempts_per_request",
		"queued", "ttft_ms", "tpot_ms", "e2e_ms", "queue_wait_ms"}
	checkKeys := func(what string, m map[string]any, want []string) {
		t.Helper()
		var got []string
		for k := range m {
			got = append(got, k)
		}
		slices.Sort(got)
		want = slices.Sorted(slices.Values(want))
		if !slices.Equal(got, want) {
			t.Errorf("%s keys %v; want %v", what, got, want)
		}
	}
	checkKeys("document", doc, append(slices.Clone(keys), "classes"))
	for _, k := range []string{"ttft_ms", "tpot_ms", "e2e_ms", "queue_wait_ms"} {
		checkKeys(k, doc[k].(map[string]any), []string{"p50", "p90", "p99"})
	}
	want := map[string]any{"offered_rps": 10.0, "goodput_rps": 4.0, "ok": 50.0, "good": 40.0, "rejected": 30.0, "shed": 5.0, "queued": 0.0,
		"attempts": 120.0, "failed": 25.0, "attempts_per_request": 1.333}
	for k, v := range want {
		if doc[k] != v {
			t.Errorf("%s = %v; want %v", k, doc[k], v)
		}
	}
	if p := doc["e2e_ms"].(map[string]any); p["p50"] != 1500.0 || p["p99"] != 3000.0 {
		t.Errorf("e2e_ms %v; want milliseconds", p)
	}
	if p := doc["queue_wait_ms"].(map[string]any); p["p50"] != nil || p["p90"] != nil || p["p99"] != nil {
		t.Errorf("queue_wait_ms %v; want nulls without a queued request", p)
	}
	classes := doc["classes"].(map[string]any)
	checkKeys("classes", classes, []string{"standard"})
	std := classes["standard"].(map[string]any)
	checkKeys("class", std, keys)
	if std["shed"] != 5.0 || std["queued"] != 2.0 || std["offered_rps"] != 2.0 || std["ttft_ms"].(map[string]any)["p50"] != nil ||
		std["queue_wait_ms"].(map[string]any)["p99"] != 9.0 {
		t.Errorf("class standard %v", std)
	}
	if !bytes.Contains(data, []byte(`"p50":null`)) {
		t.Errorf("document %s has no null percentile", data)
	}
}

// streamTransport answers every request with a stream whose first token
// comes after ttft and each next one after itl, by the request's
// sim_output_tokens, else its max_tokens; requests whose prompt is longer
// than slowPrompt words take slowTTFT to start. It records the lengths
// asked for: the output, and the max_tokens.
type streamTransport struct {
	ttft, slowTTFT, itl time.Duration
	slowPrompt          int

	mu      sync.Mutex
	prompts []int
	outputs []int
	limits  []int
}

func (f *streamTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	var req request
	data, _ := io.ReadAll(r.Body)
	_ = r.Body.Close()
	if err := json.Unmarshal(data, &req); err != nil {
		return nil, err
	}
	words := len(strings.Fields(req.Prompt))
	f.mu.Lock()
	f.prompts = append(f.prompts, words)
	output := req.MaxTokens
	if req.SimOutputTokens > 0 {
		output = req.SimOutputTokens
	}
	f.outputs = append(f.outputs, output)
	f.limits = append(f.limits, req.MaxTokens)
	f.mu.Unlock()
	ttft := f.ttft
	if words > f.slowPrompt {
		ttft = f.slowTTFT
	}
	pr, pw := io.Pipe()
	go func() {
		sleep := func(d time.Duration) bool {
			select {
			case <-time.After(d):
				return true
			case <-r.Context().Done():
				return false
			}
		}
		if !sleep(ttft) {
			return
		}
		for i := range output {
			if i > 0 && !sleep(f.itl) {
				return
			}
			if _, err := fmt.Fprintf(pw, "data: {\"choices\":[{\"text\":\" tok%d\",\"finish_reason\":null}]}\n\n", i); err != nil {
				return
			}
		}
		_, _ = io.WriteString(pw, "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n")
		_ = pw.Close()
	}()
	go func() { <-r.Context().Done(); _ = pw.CloseWithError(r.Context().Err()) }()
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Body: pr, Request: r}, nil
}

// A run of the chat workload draws its lengths in §16's ranges from the
// seed, measures TTFT, TPOT and e2e from the stream, and counts as good the
// requests within the SLO: here those with a short prompt.
func TestWorkloadGoodput(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ft := &streamTransport{ttft: 200 * time.Millisecond, slowTTFT: 3 * time.Second, itl: 20 * time.Millisecond, slowPrompt: 320}
		cfg := DefaultConfig()
		cfg.Transport, cfg.CancelFraction = ft, 0
		cfg.Workload, cfg.Arrivals, cfg.Seed, cfg.RPS = WorkloadChat, ArrivalsPoisson, 7, 20
		cfg.SLO = SLO{TTFT: time.Second, ITL: 25 * time.Millisecond}
		cfg.Timeout = 20 * time.Second
		g, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := runFor(t, g, 10*time.Second)
		ft.mu.Lock()
		prompts, outputs := slices.Clone(ft.prompts), slices.Clone(ft.outputs)
		ft.mu.Unlock()
		if len(prompts) < 150 || len(prompts) > 250 {
			t.Errorf("%d requests in 10 s of Poisson arrivals at 20/s", len(prompts))
		}
		slow := 0
		for i := range prompts {
			if prompts[i] < 128 || prompts[i] > 512 || outputs[i] < 64 || outputs[i] > 256 {
				t.Errorf("request %d: prompt %d, output %d; want chat's ranges", i, prompts[i], outputs[i])
			}
			if prompts[i] > ft.slowPrompt {
				slow++
			}
		}
		// Runs that ended with the context count as aborted, not good.
		if want := uint64(len(prompts) - slow); s.Total.Good > want || s.Total.Good+s.Total.Aborted < want {
			t.Errorf("good %d, aborted %d; want the %d requests with a short prompt", s.Total.Good, s.Total.Aborted, want)
		}
		if s.Total.TTFT.Count == 0 || s.Total.TTFT.P50 > 210*time.Millisecond || s.Total.TPOT.P50 < 19*time.Millisecond ||
			s.Total.TPOT.P99 > 21*time.Millisecond {
			t.Errorf("TTFT %+v, TPOT %+v; want 200 ms and 20 ms", s.Total.TTFT, s.Total.TPOT)
		}
	})
}

// The same seed draws the same lengths.
func TestWorkloadSeeded(t *testing.T) {
	t.Parallel()
	draw := func(seed uint64) []int {
		var out []int
		synctest.Test(t, func(t *testing.T) {
			ft := &streamTransport{itl: time.Millisecond}
			cfg := DefaultConfig()
			cfg.Transport, cfg.CancelFraction = ft, 0
			cfg.Workload, cfg.Arrivals, cfg.Seed = WorkloadDocuments, ArrivalsPoisson, seed
			g, err := New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			runFor(t, g, 3*time.Second)
			ft.mu.Lock()
			defer ft.mu.Unlock()
			for i := range ft.prompts {
				if ft.prompts[i] < 2048 || ft.prompts[i] > 6144 {
					t.Errorf("documents prompt %d", ft.prompts[i])
				}
			}
			out = append(slices.Clone(ft.prompts), ft.outputs...)
		})
		return out
	}
	a, b, c := draw(1), draw(1), draw(2)
	slices.Sort(a)
	slices.Sort(b)
	slices.Sort(c)
	if !slices.Equal(a, b) || slices.Equal(a, c) {
		t.Errorf("seed 1 twice: equal %v; seeds 1 and 2: equal %v", slices.Equal(a, b), slices.Equal(a, c))
	}
}

// steadyConfig is a constant 10 requests/s of 50-token streams that take
// 100 ms + 49 × 20 ms ≈ 1.08 s each, every one well within the SLO (TTFT
// 1 s, ITL 50 ms), against ft.
func steadyConfig(ft http.RoundTripper) Config {
	cfg := DefaultConfig()
	cfg.Transport, cfg.CancelFraction = ft, 0
	cfg.RPS, cfg.MaxTokens, cfg.PromptTokens = 10, 50, 8
	cfg.SLO = SLO{TTFT: time.Second, ITL: 50 * time.Millisecond}
	cfg.Window = 5 * time.Second
	return cfg
}

// TestDurationDrains: with a Duration, the requests in flight when the
// load stops finish, and the rates are over the Duration: a server that
// serves every request within the SLO shows a goodput of the offered rate.
// Cut at the end (a context's deadline), the last second's requests were
// aborted and goodput read 7.8 of 9.8 requests/s.
func TestDurationDrains(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := steadyConfig(&streamTransport{ttft: 100 * time.Millisecond, itl: 20 * time.Millisecond, slowPrompt: 1 << 20})
		cfg.Duration = 5 * time.Second
		g, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := g.Run(t.Context()); err != nil {
			t.Fatal(err)
		}
		s := g.Stats()
		rep := s.Report()
		if s.Elapsed != cfg.Duration || s.Total.Aborted != 0 || s.Total.Good != s.Total.Sent || s.InFlight != 0 {
			t.Errorf("elapsed %v, %+v: want the Duration, every request sent good, none aborted", s.Elapsed, s.Total)
		}
		if rep.GoodputRPS != rep.OfferedRPS || rep.OfferedRPS < 9 {
			t.Errorf("goodput %.2f/s, offered %.2f/s: want both about 10", rep.GoodputRPS, rep.OfferedRPS)
		}
	})
}

// TestWindowGoodputSteady: in the live window, good requests count when
// they end, as the 200s do: at a steady state where every request is good
// the window's goodput is its rate of 200s. Counted by arrival, the
// arrivals of the window's last request duration were missing (7.8 of
// 10 requests/s here).
func TestWindowGoodputSteady(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g, err := New(steadyConfig(&streamTransport{ttft: 100 * time.Millisecond, itl: 20 * time.Millisecond, slowPrompt: 1 << 20}), nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- g.Run(ctx) }()
		time.Sleep(20 * time.Second)
		w := g.Stats().Window
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if w.OK < 45 || w.Good != w.OK {
			t.Errorf("window of %v: %d good, %d 200s; want about 50 of each, the same", w.Duration, w.Good, w.OK)
		}
	})
}

// With SimOutputTokens each request asks for the top of its workload's
// output range and carries the length drawn, the same lengths a run
// without it draws from the seed, in sim_output_tokens.
func TestSimOutputTokensBodies(t *testing.T) {
	t.Parallel()
	type drawn struct{ outputs, limits []int }
	draw := func(t *testing.T, sim bool, workload Workload, at func(time.Duration) Workload) drawn {
		var out drawn
		synctest.Test(t, func(t *testing.T) {
			ft := &streamTransport{itl: time.Millisecond}
			cfg := DefaultConfig()
			cfg.Transport, cfg.CancelFraction = ft, 0
			cfg.Workload, cfg.WorkloadAt, cfg.Arrivals, cfg.Seed, cfg.RPS = workload, at, ArrivalsPoisson, 3, 20
			cfg.SimOutputTokens = sim
			g, err := New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			runFor(t, g, 3*time.Second)
			ft.mu.Lock()
			defer ft.mu.Unlock()
			out = drawn{slices.Sorted(slices.Values(ft.outputs)), slices.Clone(ft.limits)}
		})
		return out
	}
	for _, tc := range []struct {
		name     string
		workload Workload
		at       func(time.Duration) Workload
	}{
		{"chat", WorkloadChat, nil},
		{"documents", WorkloadDocuments, nil},
		{"by time", WorkloadFixed, func(time.Duration) Workload { return WorkloadDocuments }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plain, sim := draw(t, false, tc.workload, tc.at), draw(t, true, tc.workload, tc.at)
			if len(sim.outputs) < 20 || !slices.Equal(plain.outputs, sim.outputs) {
				t.Errorf("sim_output_tokens %v, want the lengths drawn without it %v", sim.outputs, plain.outputs)
			}
			for i, l := range sim.limits {
				if l != 256 {
					t.Fatalf("request %d: max_tokens %d, want the top of the output range, 256", i, l)
				}
			}
			if slices.Equal(plain.limits, sim.limits) {
				t.Errorf("max_tokens without SimOutputTokens %v, want the drawn lengths", plain.limits)
			}
		})
	}
}
