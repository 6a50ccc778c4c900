package loadgen

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// promptTransport answers every request with a short stream and records
// each request's prompt length in tokens and its max_tokens.
type promptTransport struct {
	mu      sync.Mutex
	prompts []int
	outputs []int
}

func (p *promptTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	var req struct {
		Prompt    string `json:"prompt"`
		MaxTokens int    `json:"max_tokens"`
	}
	data, _ := io.ReadAll(r.Body)
	_ = r.Body.Close()
	if err := json.Unmarshal(data, &req); err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.prompts = append(p.prompts, (len(req.Prompt)+1)/4)
	p.outputs = append(p.outputs, req.MaxTokens)
	p.mu.Unlock()
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{},
		Body: io.NopCloser(strings.NewReader(sseAnswer(3))), Request: r}, nil
}

// TestRateFuncWorkloadAtOnDone: a benchmark's scenario shapes the rate
// (RateFunc, here 20/s for a second then nothing) and the workload over
// time (chat, then documents), and sees every offered request once
// (OnDone) with the time it was due.
func TestRateFuncWorkloadAtOnDone(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		pt := &promptTransport{}
		cfg := DefaultConfig()
		cfg.Transport, cfg.CancelFraction = pt, 0
		cfg.RPS = 1 // replaced by RateFunc
		cfg.RateFunc = func(t time.Duration) float64 {
			if t < time.Second {
				return 20
			}
			return 0
		}
		cfg.WorkloadAt = func(t time.Duration) Workload {
			if t < 500*time.Millisecond {
				return WorkloadChat
			}
			return WorkloadDocuments
		}
		var mu sync.Mutex
		var samples []Sample
		cfg.OnDone = func(s Sample) {
			mu.Lock()
			samples = append(samples, s)
			mu.Unlock()
		}
		g, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		st := runFor(t, g, 2*time.Second)
		if st.Total.Sent < 18 || st.Total.Sent > 22 {
			t.Errorf("sent %d in 2 s, want about 20 (20/s for 1 s, then 0)", st.Total.Sent)
		}
		mu.Lock()
		defer mu.Unlock()
		if uint64(len(samples)) != st.Total.Sent {
			t.Fatalf("OnDone saw %d requests of %d sent", len(samples), st.Total.Sent)
		}
		chat, _ := WorkloadChat.Lengths()
		docs, _ := WorkloadDocuments.Lengths()
		pt.mu.Lock()
		defer pt.mu.Unlock()
		var sawChat, sawDocs bool
		for i, n := range pt.prompts {
			switch {
			case n >= chat.PromptMin && n <= chat.PromptMax:
				sawChat = true
			case n >= docs.PromptMin && n <= docs.PromptMax:
				sawDocs = true
			default:
				t.Errorf("prompt of %d tokens fits neither workload", n)
			}
			if o := pt.outputs[i]; o < chat.OutputMin || o > chat.OutputMax {
				t.Errorf("max_tokens %d out of the workloads' range", o)
			}
		}
		if !sawChat || !sawDocs {
			t.Errorf("chat prompts %v, documents prompts %v: want both", sawChat, sawDocs)
		}
		for _, s := range samples {
			if s.Offered < 0 || s.Offered >= time.Second {
				t.Errorf("a request offered at %v, outside the rate's second", s.Offered)
			}
			if !s.OK || !s.Good || s.Result.Tokens != 3 {
				t.Errorf("sample %+v: want an OK, good answer of 3 tokens", s)
			}
		}
	})
}
