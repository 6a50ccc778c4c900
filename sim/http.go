package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// job is a parsed completion or chat request.
type job struct {
	chat            bool
	promptTokens    int
	maxTokens       int
	start           int // index of the first token to generate
	stream          bool
	includeUsage    bool // a last chunk with the usage
	continuousUsage bool // the usage in every chunk
}

// routes returns the worker's HTTP API.
func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", w.handleCompletions)
	mux.HandleFunc("POST /v1/chat/completions", w.handleChat)
	mux.HandleFunc("GET /v1/models", w.handleModels)
	mux.HandleFunc("GET /health", w.handleHealth)
	return w.track(mux)
}

// track counts the handlers in progress so that Kill and Close can wait for
// them, and turns requests away once the worker is stopping.
func (w *Worker) track(next http.Handler) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w.hmu.Lock()
		if w.down {
			w.hmu.Unlock()
			w.fail(rw, newAPIError(http.StatusServiceUnavailable, "service_unavailable", "", "", "engine stopping"))
			return
		}
		w.handlers.Add(1)
		w.hmu.Unlock()
		defer w.handlers.Done()
		next.ServeHTTP(rw, r)
	})
}

// fail answers with err and counts the rejection.
func (w *Worker) fail(rw http.ResponseWriter, err *apiError) {
	w.rejected.Add(1)
	writeError(rw, err)
}

func (w *Worker) handleCompletions(rw http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if err := decodeBody(rw, r, w.cfg.Engine.MaxBodyBytes, &req); err != nil {
		w.fail(rw, err)
		return
	}
	if err := w.checkModel(req.Model); err != nil {
		w.fail(rw, err)
		return
	}
	prompt, err := parsePrompt(req.Prompt)
	if err != nil {
		w.fail(rw, err)
		return
	}
	j := job{promptTokens: promptTokens(prompt), start: continuation(prompt), stream: req.Stream}
	if err := w.checkCommon(&j, req.MaxTokens, "max_tokens", req.N, req.StreamOptions); err != nil {
		w.fail(rw, err)
		return
	}
	w.generate(rw, r, j)
}

func (w *Worker) handleChat(rw http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if err := decodeBody(rw, r, w.cfg.Engine.MaxBodyBytes, &req); err != nil {
		w.fail(rw, err)
		return
	}
	if err := w.checkModel(req.Model); err != nil {
		w.fail(rw, err)
		return
	}
	all, last, err := parseMessages(req.Messages)
	if err != nil {
		w.fail(rw, err)
		return
	}
	j := job{chat: true, promptTokens: promptTokens(all), start: continuation(last), stream: req.Stream}
	maxTokens, param := req.MaxCompletionTokens, "max_completion_tokens"
	if maxTokens == nil {
		maxTokens, param = req.MaxTokens, "max_tokens"
	}
	if err := w.checkCommon(&j, maxTokens, param, req.N, req.StreamOptions); err != nil {
		w.fail(rw, err)
		return
	}
	w.generate(rw, r, j)
}

func (w *Worker) handleModels(rw http.ResponseWriter, _ *http.Request) {
	writeJSON(rw, http.StatusOK, modelList{Object: "list", Data: []modelCard{{
		ID: w.cfg.Model, Object: "model", Created: w.created, OwnedBy: ownedBy,
	}}})
}

func (w *Worker) handleHealth(rw http.ResponseWriter, _ *http.Request) {
	rw.WriteHeader(http.StatusOK)
}

// checkModel requires the model this worker serves.
func (w *Worker) checkModel(model string) *apiError {
	switch model {
	case "":
		return badRequest("model", "model is required")
	case w.cfg.Model:
		return nil
	}
	return newAPIError(http.StatusNotFound, "invalid_request_error", "model", "model_not_found",
		fmt.Sprintf("The model `%s` does not exist.", model))
}

// checkCommon fills in and checks the fields completions and chat share.
func (w *Worker) checkCommon(j *job, maxTokens *int, param string, n *int, opts *streamOptions) *apiError {
	j.maxTokens = w.cfg.Engine.DefaultMaxTokens
	if maxTokens != nil {
		if *maxTokens < 1 {
			return badRequest(param, param+" must be at least 1")
		}
		j.maxTokens = *maxTokens
	}
	if j.promptTokens+j.maxTokens > w.maxSeq {
		return badRequest(param, fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the prompt, %d in the completion).",
			w.maxSeq, j.promptTokens+j.maxTokens, j.promptTokens, j.maxTokens))
	}
	if n != nil && *n != 1 {
		return badRequest("n", "only n=1 is supported")
	}
	if opts != nil {
		if !j.stream {
			return badRequest("stream_options", "stream_options is only allowed with stream")
		}
		j.includeUsage, j.continuousUsage = opts.IncludeUsage, opts.ContinuousUsageStats
	}
	return nil
}

// generate runs j on the engine and writes the answer. A client that goes
// away cancels the request in the engine at once.
func (w *Worker) generate(rw http.ResponseWriter, r *http.Request, j job) {
	ctx := r.Context()
	req := newRequest(j.promptTokens, j.maxTokens)
	select {
	case w.submit <- req:
	case <-w.stopped:
		w.fail(rw, newAPIError(http.StatusServiceUnavailable, "service_unavailable", "", "", "engine stopping"))
		return
	case <-ctx.Done():
		return
	}
	finished := false
	defer func() {
		if !finished {
			select {
			case w.cancels <- req:
			case <-w.stopped:
			}
		}
	}()
	prefix := "cmpl-"
	if j.chat {
		prefix = "chatcmpl-"
	}
	id := prefix + strconv.FormatUint(w.cfg.WorkerID, 10) + "-" + strconv.FormatUint(w.ids.Add(1), 10)
	if j.stream {
		finished = w.stream(ctx, rw, j, req, id)
	} else {
		finished = w.complete(ctx, rw, j, req, id)
	}
}

// complete waits for the whole answer and writes it as one JSON body. It
// reports whether the request ran to its end.
func (w *Worker) complete(ctx context.Context, rw http.ResponseWriter, j job, req *request, id string) bool {
	select {
	case <-req.done:
	case <-ctx.Done():
		return false
	case <-w.stopped:
		return false
	}
	n := int(req.produced.Load())
	if n != j.maxTokens {
		w.fail(rw, newAPIError(http.StatusInternalServerError, "internal_error", "", "", "no rank can hold the request"))
		return true
	}
	text := generatedText(j.start, n, j.chat)
	finish, created := finishLength, w.created
	u := newUsage(j.promptTokens, n)
	if j.chat {
		writeJSON(rw, http.StatusOK, chatResponse{
			ID: id, Object: "chat.completion", Created: created, Model: w.cfg.Model, Usage: u,
			Choices: []chatChoice{{Message: &chatDelta{Role: "assistant", Content: &text}, FinishReason: &finish}},
		})
	} else {
		writeJSON(rw, http.StatusOK, completionResponse{
			ID: id, Object: "text_completion", Created: created, Model: w.cfg.Model, Usage: u,
			Choices: []completionChoice{{Text: text, FinishReason: &finish}},
		})
	}
	return true
}

// stream writes the answer as server-sent events, one token per chunk, as
// the engine generates them. It reports whether the request ran to its end.
func (w *Worker) stream(ctx context.Context, rw http.ResponseWriter, j job, req *request, id string) bool {
	h := rw.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	rw.WriteHeader(http.StatusOK)
	sw := &sseWriter{rw: rw, rc: http.NewResponseController(rw), w: w, j: j, id: id}
	if j.chat {
		empty := ""
		sw.chunk(&chatDelta{Role: "assistant", Content: &empty}, "", nil)
	}
	sent := 0
	for {
		if !sw.flush() {
			return false
		}
		done := false
		select {
		case <-req.notify:
		case <-req.done:
			done = true
		case <-ctx.Done():
			return false
		case <-w.stopped:
			return false
		}
		if !done {
			select {
			case <-req.done:
				done = true
			default:
			}
		}
		// After done, produced holds the final count.
		for n := int(req.produced.Load()); sent < n; sent++ {
			var u *usage
			if j.continuousUsage {
				u = newUsage(j.promptTokens, sent+1)
			}
			text := string(appendToken(nil, j.start+sent, j.chat && sent == 0))
			if j.chat {
				sw.chunk(&chatDelta{Content: &text}, "", u)
			} else {
				sw.text(text, "", u)
			}
		}
		if !done {
			continue
		}
		if sent != j.maxTokens {
			sw.event([]byte(`{"error":{"message":"no rank can hold the request","type":"internal_error","param":null,"code":null}}`))
			sw.flush()
			return true
		}
		var u *usage
		if j.continuousUsage {
			u = newUsage(j.promptTokens, sent)
		}
		if j.chat {
			sw.chunk(&chatDelta{}, finishLength, u)
		} else {
			sw.text("", finishLength, u)
		}
		if j.includeUsage {
			sw.usage(newUsage(j.promptTokens, sent))
		}
		sw.event([]byte("[DONE]"))
		sw.flush()
		return true
	}
}

// sseWriter writes the chunks of one streamed answer; the first write error
// stops it.
type sseWriter struct {
	rw  http.ResponseWriter
	rc  *http.ResponseController
	w   *Worker
	j   job
	id  string
	err error
}

// text writes a completion chunk; an empty finish is null.
func (s *sseWriter) text(text, finish string, u *usage) {
	c := completionChoice{Text: text}
	if finish != "" {
		c.FinishReason = &finish
	}
	s.json(completionResponse{ID: s.id, Object: "text_completion", Created: s.w.created, Model: s.w.cfg.Model,
		Choices: []completionChoice{c}, Usage: u})
}

// chunk writes a chat chunk; an empty finish is null.
func (s *sseWriter) chunk(delta *chatDelta, finish string, u *usage) {
	c := chatChoice{Delta: delta}
	if finish != "" {
		c.FinishReason = &finish
	}
	s.json(chatResponse{ID: s.id, Object: "chat.completion.chunk", Created: s.w.created, Model: s.w.cfg.Model,
		Choices: []chatChoice{c}, Usage: u})
}

// usage writes the last chunk of include_usage: no choices, the usage.
func (s *sseWriter) usage(u *usage) {
	if s.j.chat {
		s.json(chatResponse{ID: s.id, Object: "chat.completion.chunk", Created: s.w.created, Model: s.w.cfg.Model,
			Choices: []chatChoice{}, Usage: u})
		return
	}
	s.json(completionResponse{ID: s.id, Object: "text_completion", Created: s.w.created, Model: s.w.cfg.Model,
		Choices: []completionChoice{}, Usage: u})
}

func (s *sseWriter) json(v any) {
	data, err := json.Marshal(v)
	if err != nil {
		s.err = err
		return
	}
	s.event(data)
}

// event writes one "data: ...\n\n" event.
func (s *sseWriter) event(data []byte) {
	if s.err != nil {
		return
	}
	buf := make([]byte, 0, len(data)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	_, s.err = s.rw.Write(buf)
}

// flush sends what was written and reports whether all went well.
func (s *sseWriter) flush() bool {
	if s.err == nil {
		s.err = s.rc.Flush()
	}
	return s.err == nil
}
