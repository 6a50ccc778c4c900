package router

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/sim"
)

// The official OpenAI Go SDK against the router and a simulated engine:
// what every client built on the SDK sees of our answers (contract §7,
// §7c).

// sdkEnv is a router in front of one simulated worker of model, and an SDK
// client of the router that does not retry.
type sdkEnv struct {
	*testEnv
	worker *sim.Worker
	client openai.Client
}

const sdkModel = "Qwen/Qwen3-0.6B"

func newSDKEnv(t *testing.T, config func(*Config)) *sdkEnv {
	t.Helper()
	env := newTestEnv(t, envOptions{config: config})
	cfg := sim.DefaultWorkerConfig()
	cfg.Model, cfg.WorkerID, cfg.Ranks = sdkModel, 1, 1
	cfg.NATS.URL = env.natsURL
	cfg.Engine.PrefillSpeed, cfg.Engine.DecodeSpeed = 1_000_000, 2000
	w, err := sim.NewWorker(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close(context.Background()) })
	env.putRecord(t, sdkModel, []uint64{1}, nil, time.Now())
	// The worker registers itself; wait until the router knows it.
	natstest.WaitFor(t, 10*time.Second, "the simulated worker's registration", func() bool {
		return len(env.registry.Endpoints(sdkModel)) > 0
	})
	client := openai.NewClient(option.WithBaseURL(env.front.URL+"/v1/"), option.WithAPIKey("unused"),
		option.WithMaxRetries(0), option.WithHTTPClient(env.front.Client()))
	return &sdkEnv{testEnv: env, worker: w, client: client}
}

// apiError returns err as the SDK's error type.
func apiError(t *testing.T, err error) *openai.Error {
	t.Helper()
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("error %v (%T) is not an *openai.Error", err, err)
	}
	return apiErr
}

func TestSDKCompletionsAndModels(t *testing.T) {
	t.Parallel()
	e := newSDKEnv(t, nil)
	ctx := t.Context()

	c, err := e.client.Completions.New(ctx, openai.CompletionNewParams{
		Model: sdkModel, Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("say hi")},
		MaxTokens: openai.Int(5)})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Choices) != 1 || c.Choices[0].Text == "" || c.Choices[0].FinishReason != "length" || c.Usage.CompletionTokens != 5 {
		t.Errorf("completion %+v", c)
	}

	stream := e.client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:     sdkModel,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("say hi")},
		MaxTokens: openai.Int(6)})
	var acc openai.ChatCompletionAccumulator
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("chat stream: %v", err)
	}
	if len(acc.Choices) != 1 || acc.Choices[0].Message.Content == "" || acc.Choices[0].FinishReason != "length" || chunks < 6 {
		t.Errorf("chat stream: %d chunks, %+v", chunks, acc.Choices)
	}

	models, err := e.client.Models.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range models.Data {
		names = append(names, m.ID)
	}
	if fmt.Sprint(names) != "["+sdkModel+"]" {
		t.Errorf("models %v, want [%s]", names, sdkModel)
	}
}

// TestSDKErrors: the SDK reads our error bodies — the all-busy 503 with its
// type, message and Retry-After; a malformed request; a model nobody
// serves; and a stream cut that cannot continue.
func TestSDKErrors(t *testing.T) {
	t.Parallel()
	e := newSDKEnv(t, nil)
	ctx := t.Context()
	params := openai.CompletionNewParams{Model: sdkModel,
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hi")}, MaxTokens: openai.Int(3)}

	e.putRecord(t, sdkModel, nil, []uint64{1}, time.Now())
	natstest.WaitFor(t, 10*time.Second, "the all-busy record", func() bool { return !e.watcher.Decide(sdkModel).Admit })
	_, err := e.client.Completions.New(ctx, params)
	ae := apiError(t, err)
	if ae.StatusCode != http.StatusServiceUnavailable || ae.Type != "service_unavailable" ||
		!strings.Contains(ae.Message, "All workers are busy") || ae.Code != "503" {
		t.Errorf("all busy: status %d type %q code %q message %q", ae.StatusCode, ae.Type, ae.Code, ae.Message)
	}
	checkRetryHeaders(t, ae.Response.Header, DefaultRetryAfter)
	e.putRecord(t, sdkModel, []uint64{1}, nil, time.Now())

	// A request without a model.
	_, err = e.client.Completions.New(ctx, openai.CompletionNewParams{
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hi")}})
	ae = apiError(t, err)
	if ae.StatusCode != http.StatusBadRequest || ae.Type != "invalid_request_error" || !strings.Contains(ae.Message, "model") {
		t.Errorf("no model: status %d type %q message %q", ae.StatusCode, ae.Type, ae.Message)
	}

	// A model nobody serves: "no workers available", never the all-busy body.
	_, err = e.client.Completions.New(ctx, openai.CompletionNewParams{Model: "nobody/serves-this",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hi")}})
	ae = apiError(t, err)
	if ae.StatusCode != http.StatusServiceUnavailable || ae.Type != "service_unavailable" ||
		!strings.Contains(ae.Message, "no workers available") || strings.Contains(ae.Message, "All workers are busy") {
		t.Errorf("unknown model: status %d type %q message %q", ae.StatusCode, ae.Type, ae.Message)
	}
}

// TestSDKStreamCut: a stream the worker cuts and the router cannot
// continue (migration off) ends with our error event, which the SDK's
// stream returns as its error.
func TestSDKStreamCut(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, envOptions{})
	cutter := newEngine(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, sseEvent(completionChunk("cmpl-1", "Hel", "", nil)))
		fmt.Fprint(w, sseEvent(completionChunk("cmpl-1", "lo", "", nil)))
		// and the stream ends: no finish reason, no [DONE]
	})
	env.putWorker(t, sdkModel, 1, cutter.srv.URL)
	env.putRecord(t, sdkModel, []uint64{1}, nil, time.Now())
	client := openai.NewClient(option.WithBaseURL(env.front.URL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	stream := client.Completions.NewStreaming(t.Context(), openai.CompletionNewParams{Model: sdkModel,
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hi")}, MaxTokens: openai.Int(10)})
	var text strings.Builder
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			text.WriteString(c.Text)
		}
	}
	err := stream.Err()
	if err == nil || !strings.Contains(err.Error(), "the worker's stream was cut") {
		t.Fatalf("stream error %v, want ours", err)
	}
	if text.String() != "Hello" {
		t.Errorf("text before the error %q, want Hello", text.String())
	}
}

// countingTransport counts the requests a client sends.
type countingTransport struct {
	next http.RoundTripper
	n    atomic.Int64
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}

// TestSDKDefaultRetries: with its default settings the SDK retries the
// all-busy 503 twice, each time after the retry-after-ms we send (at least
// the 1 s floor), so a client of a fully busy model sends three requests
// and sees the error two seconds later or more (docs/router.md, "Clients";
// TestSDKRetriesHonourRetryAfterMs checks the waits exactly).
func TestSDKDefaultRetries(t *testing.T) {
	t.Parallel()
	e := newSDKEnv(t, nil)
	e.putRecord(t, sdkModel, nil, []uint64{1}, time.Now())
	natstest.WaitFor(t, 10*time.Second, "the all-busy record", func() bool { return !e.watcher.Decide(sdkModel).Admit })
	counter := &countingTransport{next: e.front.Client().Transport}
	client := openai.NewClient(option.WithBaseURL(e.front.URL+"/v1/"), option.WithAPIKey("unused"),
		option.WithHTTPClient(&http.Client{Transport: counter}))
	start := time.Now()
	_, err := client.Completions.New(t.Context(), openai.CompletionNewParams{Model: sdkModel,
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hi")}, MaxTokens: openai.Int(3)})
	elapsed := time.Since(start)
	ae := apiError(t, err)
	if ae.StatusCode != http.StatusServiceUnavailable || !strings.Contains(ae.Message, "All workers are busy") {
		t.Errorf("status %d message %q", ae.StatusCode, ae.Message)
	}
	if got := counter.n.Load(); got != 3 {
		t.Errorf("the SDK sent %d requests, want 3 (one and two retries)", got)
	}
	// Two waits of retry-after-ms: 1 s each, at least.
	if elapsed < 2*time.Second {
		t.Errorf("the error came after %v, want at least 2 s (two Retry-After waits)", elapsed)
	}
	t.Logf("default SDK: 3 requests, error after %v", elapsed.Round(time.Millisecond))
}

// inProcess is an http.RoundTripper that serves the requests with a
// handler in the process, recording when each came and the retry-after-ms
// of each answer: an SDK client of it runs in a synctest bubble.
type inProcess struct {
	h http.Handler

	mu    sync.Mutex
	times []time.Time
	waits []time.Duration // the answers' retry-after-ms
	count []string        // the requests' X-Stainless-Retry-Count
}

func (p *inProcess) RoundTrip(r *http.Request) (*http.Response, error) {
	req := r.Clone(r.Context())
	req.RequestURI = r.URL.RequestURI()
	rec := httptest.NewRecorder()
	p.h.ServeHTTP(rec, req)
	resp := rec.Result()
	resp.Request = r
	ms, _ := strconv.Atoi(resp.Header.Get(admission.RetryAfterMsHeader))
	p.mu.Lock()
	p.times = append(p.times, time.Now())
	p.waits = append(p.waits, time.Duration(ms)*time.Millisecond)
	p.count = append(p.count, r.Header.Get("X-Stainless-Retry-Count"))
	p.mu.Unlock()
	return resp, nil
}

// TestSDKRetriesHonourRetryAfterMs: the official Go SDK, with its default
// two retries, against a router whose model is all busy: it sends three
// requests, each retry after exactly the retry-after-ms of the answer
// before (not Retry-After's whole seconds, nor its own backoff), and
// numbers them in X-Stainless-Retry-Count. In a bubble of fake time.
func TestSDKRetriesHonourRetryAfterMs(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rt, list := newBubbleRouter(t, nil)
		serveAt(t, rt, 40, 4) // a slot frees every 250 ms
		list.busy.Store(true)
		p := &inProcess{h: rt}
		client := openai.NewClient(option.WithBaseURL("http://router.invalid/v1/"), option.WithAPIKey("unused"),
			option.WithHTTPClient(&http.Client{Transport: p}))
		start := time.Now()
		_, err := client.Completions.New(t.Context(), openai.CompletionNewParams{Model: model,
			Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hi")}, MaxTokens: openai.Int(3)})
		ae := apiError(t, err)
		if ae.StatusCode != http.StatusServiceUnavailable || !strings.Contains(ae.Message, "All workers are busy") {
			t.Errorf("status %d message %q", ae.StatusCode, ae.Message)
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if len(p.times) != 3 || fmt.Sprint(p.count) != "[0 1 2]" {
			t.Fatalf("the SDK sent %d requests numbered %v; want 3 (one and two retries) numbered [0 1 2]", len(p.times), p.count)
		}
		for i := 1; i < 3; i++ {
			gap, told := p.times[i].Sub(p.times[i-1]), p.waits[i-1]
			if gap != told || told < time.Second || told%time.Second == 0 {
				t.Errorf("retry %d came %v after the answer that said retry-after-ms %v; want exactly that, a fraction past the 1 s floor", i, gap, told)
			}
		}
		t.Logf("default SDK: 3 requests, retries after %v and %v, error after %v", p.waits[0], p.waits[1], time.Since(start))
	})
}
