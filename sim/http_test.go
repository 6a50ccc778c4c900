package sim_test

import (
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/workermon/workermon/sim"
)

func TestCompletionShapes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := startWorker(t, workerConfig(e.srv))
	const maxTokens = 5

	for _, tc := range []struct {
		name   string
		path   string
		body   map[string]any
		chat   bool
		stream bool
	}{
		{"completion", "/v1/completions", map[string]any{"prompt": "say tok6"}, false, false},
		{"completion stream", "/v1/completions", map[string]any{"prompt": "say tok6", "stream": true}, false, true},
		{"chat", "/v1/chat/completions", map[string]any{"messages": []map[string]any{
			{"role": "system", "content": "be brief"}, {"role": "user", "content": "say tok6"}}}, true, false},
		{"chat stream", "/v1/chat/completions", map[string]any{"stream": true, "messages": []map[string]any{
			{"role": "user", "content": []map[string]any{{"type": "text", "text": "say tok6"}}}}}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.body["model"] = w.Model()
			tc.body["max_tokens"] = maxTokens
			resp := post(t, t.Context(), w.Endpoint()+tc.path, tc.body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			// The prompt ends with tok6: the answer continues at tok7.
			want := " tok7 tok8 tok9 tok10 tok11"
			if tc.chat {
				want = strings.TrimPrefix(want, " ")
			}
			if tc.stream {
				checkStream(t, resp, tc.chat, want, maxTokens)
			} else {
				checkWhole(t, resp, w.Model(), tc.chat, want, maxTokens)
			}
		})
	}
}

// checkWhole checks a non-streamed answer.
func checkWhole(t *testing.T, resp *http.Response, model string, chat bool, want string, maxTokens int) {
	t.Helper()
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	m := decodeJSON(t, resp)
	object, text := "text_completion", path(m, "choices", 0, "text")
	if chat {
		object, text = "chat.completion", path(m, "choices", 0, "message", "content")
		if role := path(m, "choices", 0, "message", "role"); role != "assistant" {
			t.Errorf("role %v", role)
		}
	}
	if m["object"] != object || m["model"] != model || m["id"] == "" || m["created"] == nil {
		t.Errorf("object %v, model %v, id %v, created %v", m["object"], m["model"], m["id"], m["created"])
	}
	if text != want {
		t.Errorf("text %q; want %q", text, want)
	}
	if f := path(m, "choices", 0, "finish_reason"); f != "length" {
		t.Errorf("finish_reason %v", f)
	}
	pt, _ := path(m, "usage", "prompt_tokens").(float64)
	ct, _ := path(m, "usage", "completion_tokens").(float64)
	tt, _ := path(m, "usage", "total_tokens").(float64)
	if pt < 1 || int(ct) != maxTokens || tt != pt+ct {
		t.Errorf("usage %v", m["usage"])
	}
}

// checkStream checks a streamed answer: one token per chunk, a last chunk
// with the finish reason, then [DONE].
func checkStream(t *testing.T, resp *http.Response, chat bool, want string, maxTokens int) {
	t.Helper()
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("Content-Type %q", ct)
	}
	evs := readEvents(t, resp.Body)
	if len(evs) == 0 || evs[len(evs)-1] != "[DONE]" {
		t.Fatalf("events %q do not end with [DONE]", evs)
	}
	evs = evs[:len(evs)-1]
	if chat {
		var first map[string]any
		if err := json.Unmarshal([]byte(evs[0]), &first); err != nil {
			t.Fatal(err)
		}
		if role := path(first, "choices", 0, "delta", "role"); role != "assistant" {
			t.Errorf("first chunk's role %v", role)
		}
		evs = evs[1:]
	}
	var text strings.Builder
	tokens := 0
	for i, ev := range evs {
		var c map[string]any
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("chunk %q: %v", ev, err)
		}
		object, piece := "text_completion", path(c, "choices", 0, "text")
		if chat {
			object, piece = "chat.completion.chunk", path(c, "choices", 0, "delta", "content")
		}
		if c["object"] != object {
			t.Errorf("chunk object %v", c["object"])
		}
		finish := path(c, "choices", 0, "finish_reason")
		if i == len(evs)-1 {
			if finish != "length" {
				t.Errorf("last chunk's finish_reason %v", finish)
			}
			continue
		}
		if finish != nil {
			t.Errorf("chunk %d has finish_reason %v", i, finish)
		}
		s, _ := piece.(string)
		text.WriteString(s)
		tokens++
	}
	if text.String() != want || tokens != maxTokens {
		t.Errorf("streamed %q in %d chunks; want %q in %d", text.String(), tokens, want, maxTokens)
	}
}

func TestStreamUsage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := startWorker(t, workerConfig(e.srv))
	resp := post(t, t.Context(), w.Endpoint()+"/v1/completions", map[string]any{
		"model": w.Model(), "prompt": "hi", "max_tokens": 3, "stream": true,
		"stream_options": map[string]any{"include_usage": true, "continuous_usage_stats": true},
	})
	defer resp.Body.Close()
	evs := readEvents(t, resp.Body)
	// 3 tokens, the finish chunk, the usage chunk, [DONE].
	if len(evs) != 6 {
		t.Fatalf("%d events: %q", len(evs), evs)
	}
	for i, want := range []float64{1, 2, 3, 3, 3} {
		var c map[string]any
		if err := json.Unmarshal([]byte(evs[i]), &c); err != nil {
			t.Fatal(err)
		}
		if got := path(c, "usage", "completion_tokens"); got != want {
			t.Errorf("chunk %d: completion_tokens %v; want %v", i, got, want)
		}
	}
	if !strings.Contains(evs[4], `"choices":[]`) {
		t.Errorf("usage chunk %s has choices", evs[4])
	}
}

func TestRequestErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := workerConfig(e.srv)
	cfg.Engine.MaxBodyBytes = 4096
	w := startWorker(t, cfg)
	model := w.Model()

	for _, tc := range []struct {
		name   string
		path   string
		body   any
		status int
		param  string
		code   string
	}{
		{"bad JSON", "/v1/completions", []byte(`{"model":`), 400, "", ""},
		{"wrong type", "/v1/completions", []byte(`{"model":"` + model + `","prompt":"x","max_tokens":"many"}`), 400, "", ""},
		{"missing model", "/v1/completions", map[string]any{"prompt": "x"}, 400, "model", ""},
		{"wrong model", "/v1/completions", map[string]any{"model": "other", "prompt": "x"}, 404, "model", "model_not_found"},
		{"wrong model chat", "/v1/chat/completions", map[string]any{"model": "other", "messages": []any{}}, 404, "model", "model_not_found"},
		{"missing prompt", "/v1/completions", map[string]any{"model": model}, 400, "prompt", ""},
		{"prompt list", "/v1/completions", map[string]any{"model": model, "prompt": []string{"a", "b"}}, 400, "prompt", ""},
		{"no messages", "/v1/chat/completions", map[string]any{"model": model, "messages": []any{}}, 400, "messages", ""},
		{"bad content", "/v1/chat/completions", map[string]any{"model": model, "messages": []any{map[string]any{"role": "user", "content": 7}}}, 400, "messages", ""},
		{"zero max_tokens", "/v1/completions", map[string]any{"model": model, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", ""},
		{"too long", "/v1/completions", map[string]any{"model": model, "prompt": "x", "max_tokens": 1 << 20}, 400, "max_tokens", ""},
		// prompt + max_tokens overflows an int: still too long, not a
		// request that never ends.
		{"huge max_tokens", "/v1/completions", map[string]any{"model": model, "prompt": "x", "max_tokens": math.MaxInt64, "stream": true}, 400, "max_tokens", ""},
		{"huge max_completion_tokens", "/v1/chat/completions", map[string]any{"model": model, "stream": true,
			"messages": []any{map[string]any{"role": "user", "content": "x"}}, "max_completion_tokens": math.MaxInt64}, 400, "max_completion_tokens", ""},
		{"n", "/v1/completions", map[string]any{"model": model, "prompt": "x", "n": 2}, 400, "n", ""},
		{"zero sim_output_tokens", "/v1/completions", map[string]any{"model": model, "prompt": "x", "max_tokens": 8, "sim_output_tokens": 0}, 400, "sim_output_tokens", ""},
		{"negative sim_output_tokens", "/v1/completions", map[string]any{"model": model, "prompt": "x", "max_tokens": 8, "sim_output_tokens": -1}, 400, "sim_output_tokens", ""},
		{"sim_output_tokens over max_tokens", "/v1/completions", map[string]any{"model": model, "prompt": "x", "max_tokens": 8, "sim_output_tokens": 9}, 400, "sim_output_tokens", ""},
		{"sim_output_tokens over the default max_tokens", "/v1/completions", map[string]any{"model": model, "prompt": "x", "sim_output_tokens": sim.DefaultMaxTokens + 1}, 400, "sim_output_tokens", ""},
		{"sim_output_tokens over max_completion_tokens", "/v1/chat/completions", map[string]any{"model": model,
			"messages": []any{map[string]any{"role": "user", "content": "x"}}, "max_completion_tokens": 4, "max_tokens": 100, "sim_output_tokens": 5}, 400, "sim_output_tokens", ""},
		{"sim_output_tokens not an integer", "/v1/completions", []byte(`{"model":"` + model + `","prompt":"x","max_tokens":8,"sim_output_tokens":2.5}`), 400, "", ""},
		{"too large", "/v1/completions", map[string]any{"model": model, "prompt": strings.Repeat("x", 5000)}, 413, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			resp := post(t, t.Context(), w.Endpoint()+tc.path, tc.body)
			if resp.StatusCode != tc.status {
				t.Errorf("status %d; want %d", resp.StatusCode, tc.status)
			}
			m := decodeJSON(t, resp)
			if msg, _ := path(m, "error", "message").(string); msg == "" {
				t.Errorf("no error message in %v", m)
			}
			if typ := path(m, "error", "type"); typ != "invalid_request_error" {
				t.Errorf("error type %v", typ)
			}
			if p := path(m, "error", "param"); tc.param != "" && p != tc.param {
				t.Errorf("param %v; want %s", p, tc.param)
			}
			if c := path(m, "error", "code"); tc.code != "" && c != tc.code {
				t.Errorf("code %v; want %s", c, tc.code)
			}
		})
	}
	t.Run("counted", func(t *testing.T) {
		t.Parallel()
		waitUntil(t, "rejections counted", func() bool { return w.Stats().Rejected >= 1 })
	})
}

func TestModelsAndHealth(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := startWorker(t, workerConfig(e.srv))

	resp, err := http.Get(w.Endpoint() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	m := decodeJSON(t, resp)
	if m["object"] != "list" || path(m, "data", 0, "id") != w.Model() || path(m, "data", 0, "object") != "model" {
		t.Errorf("models %v", m)
	}
	resp, err = http.Get(w.Endpoint() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("health status %d", resp.StatusCode)
	}
}

// TestTokenIDPrompt: a prompt of token ids counts one token per id.
func TestTokenIDPrompt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := startWorker(t, workerConfig(e.srv))
	resp := post(t, t.Context(), w.Endpoint()+"/v1/completions",
		map[string]any{"model": w.Model(), "prompt": []int{5, 6, 7, 8, 9, 10, 11}, "max_tokens": 2})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	m := decodeJSON(t, resp)
	usage, _ := m["usage"].(map[string]any)
	if usage["prompt_tokens"] != float64(7) {
		t.Fatalf("usage %v, want 7 prompt tokens", m["usage"])
	}
}

// A request with sim_output_tokens ends there with finish_reason "stop", as
// an end-of-sequence token would end it, and reports its usage, streamed or
// not, asked for or not.
func TestSimOutputTokens(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := startWorker(t, workerConfig(e.srv))
	user := []map[string]any{{"role": "user", "content": "say tok6"}}
	for _, tc := range []struct {
		name   string
		path   string
		body   map[string]any
		chat   bool
		stream bool
		want   string
		finish string
		tokens float64
	}{
		{"completion", "/v1/completions", map[string]any{"prompt": "say tok6", "max_tokens": 8, "sim_output_tokens": 3},
			false, false, " tok7 tok8 tok9", "stop", 3},
		{"completion stream", "/v1/completions", map[string]any{"prompt": "say tok6", "max_tokens": 8, "sim_output_tokens": 3, "stream": true},
			false, true, " tok7 tok8 tok9", "stop", 3},
		{"chat", "/v1/chat/completions", map[string]any{"messages": user, "max_tokens": 8, "sim_output_tokens": 2},
			true, false, "tok7 tok8", "stop", 2},
		{"chat stream", "/v1/chat/completions", map[string]any{"messages": user, "max_completion_tokens": 8, "sim_output_tokens": 2, "stream": true},
			true, true, "tok7 tok8", "stop", 2},
		{"at max_tokens: still stop", "/v1/completions", map[string]any{"prompt": "say tok6", "max_tokens": 2, "sim_output_tokens": 2, "stream": true},
			false, true, " tok7 tok8", "stop", 2},
		{"without: length", "/v1/completions", map[string]any{"prompt": "say tok6", "max_tokens": 2, "stream": true},
			false, true, " tok7 tok8", "length", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.body["model"] = w.Model()
			resp := post(t, t.Context(), w.Endpoint()+tc.path, tc.body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			var answers []map[string]any
			if tc.stream {
				evs := readEvents(t, resp.Body)
				resp.Body.Close()
				if len(evs) == 0 || evs[len(evs)-1] != "[DONE]" {
					t.Fatalf("events %q do not end with [DONE]", evs)
				}
				for _, ev := range evs[:len(evs)-1] {
					var c map[string]any
					if err := json.Unmarshal([]byte(ev), &c); err != nil {
						t.Fatalf("chunk %q: %v", ev, err)
					}
					answers = append(answers, c)
				}
			} else {
				answers = append(answers, decodeJSON(t, resp))
			}
			var text strings.Builder
			var finishes []any
			tokens := -1.0 // no usage
			for _, a := range answers {
				for _, piece := range []any{path(a, "choices", 0, "text"), path(a, "choices", 0, "delta", "content"),
					path(a, "choices", 0, "message", "content")} {
					s, _ := piece.(string)
					text.WriteString(s)
				}
				if f := path(a, "choices", 0, "finish_reason"); f != nil {
					finishes = append(finishes, f)
				}
				if u, ok := path(a, "usage", "completion_tokens").(float64); ok {
					tokens = u
				}
			}
			if text.String() != tc.want {
				t.Errorf("text %q, want %q", text.String(), tc.want)
			}
			if len(finishes) != 1 || finishes[0] != tc.finish {
				t.Errorf("finish reasons %v, want one %q", finishes, tc.finish)
			}
			if tokens != tc.tokens {
				t.Errorf("usage's completion_tokens %v, want %v (-1: no usage)", tokens, tc.tokens)
			}
		})
	}
}
