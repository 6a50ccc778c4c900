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
	outputTokens    int // sim_output_tokens, 0 when not given
	start           int // index of the first token to generate
	stream          bool
	includeUsage    bool // a last chunk with the usage
	continuousUsage bool // the usage in every chunk
}

// finish returns the finish_reason of j: "stop" at its sim_output_tokens,
// else "length" (all its max_tokens).
func (j job) finish() string {
	if j.outputTokens > 0 {
		return finishStop
	}
	return finishLength
}

// routes returns the worker's HTTP API.
func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", w.serveJob(w.completionJob))
	mux.HandleFunc("POST /v1/chat/completions", w.serveJob(w.chatJob))
	mux.HandleFunc("GET /v1/models", w.handleModels)
	mux.HandleFunc("GET /health", w.handleHealth)
	mux.HandleFunc("GET /metrics", w.handleMetrics) // vLLM-shaped, for workermon scrape
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

// serveJob returns the handler of an inference endpoint: parse reads and
// checks the request, which the engine then runs.
func (w *Worker) serveJob(parse func(http.ResponseWriter, *http.Request) (job, *apiError)) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		j, err := parse(rw, r)
		if err != nil {
			w.fail(rw, err)
			return
		}
		w.generate(rw, r, j)
	}
}

// completionJob reads a POST /v1/completions request.
func (w *Worker) completionJob(rw http.ResponseWriter, r *http.Request) (job, *apiError) {
	var req completionRequest
	if err := w.decode(rw, r, &req, &req.requestOptions); err != nil {
		return job{}, err
	}
	prompt, tokens, err := parsePrompt(req.Prompt)
	if err != nil {
		return job{}, err
	}
	j := job{promptTokens: tokens, start: continuation(prompt)}
	if err := w.checkCommon(&j, req.requestOptions, req.MaxTokens, "max_tokens"); err != nil {
		return job{}, err
	}
	return j, nil
}

// chatJob reads a POST /v1/chat/completions request.
func (w *Worker) chatJob(rw http.ResponseWriter, r *http.Request) (job, *apiError) {
	var req chatRequest
	if err := w.decode(rw, r, &req, &req.requestOptions); err != nil {
		return job{}, err
	}
	all, last, err := parseMessages(req.Messages)
	if err != nil {
		return job{}, err
	}
	j := job{chat: true, promptTokens: promptTokens(all), start: continuation(last)}
	maxTokens, param := req.MaxCompletionTokens, "max_completion_tokens"
	if maxTokens == nil {
		maxTokens, param = req.MaxTokens, "max_tokens"
	}
	if err := w.checkCommon(&j, req.requestOptions, maxTokens, param); err != nil {
		return job{}, err
	}
	return j, nil
}

// decode reads a JSON request body into req and checks the model of its
// options (a field of req).
func (w *Worker) decode(rw http.ResponseWriter, r *http.Request, req any, opts *requestOptions) *apiError {
	if err := decodeBody(rw, r, w.cfg.Engine.MaxBodyBytes, req); err != nil {
		return err
	}
	return w.checkModel(opts.Model)
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

// checkCommon fills in j from the options completions and chat share, with
// maxTokens the request's limit (named param), and checks them.
func (w *Worker) checkCommon(j *job, opts requestOptions, maxTokens *int, param string) *apiError {
	j.stream = opts.Stream
	j.maxTokens = w.cfg.Engine.DefaultMaxTokens
	if maxTokens != nil {
		if *maxTokens < 1 {
			return badRequest(param, param+" must be at least 1")
		}
		j.maxTokens = *maxTokens
	}
	// Compared without adding: prompt + max_tokens may overflow an int.
	if j.maxTokens > w.maxSeq-j.promptTokens {
		return badRequest(param, fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, you requested %d tokens in the prompt and %d in the completion.",
			w.maxSeq, j.promptTokens, j.maxTokens))
	}
	if n := opts.SimOutputTokens; n != nil {
		if *n < 1 || *n > j.maxTokens {
			return badRequest("sim_output_tokens", fmt.Sprintf("sim_output_tokens must be between 1 and %s (%d), got %d", param, j.maxTokens, *n))
		}
		j.outputTokens = *n
	}
	if opts.N != nil && *opts.N != 1 {
		return badRequest("n", "only n=1 is supported")
	}
	if so := opts.StreamOptions; so != nil {
		if !j.stream {
			return badRequest("stream_options", "stream_options is only allowed with stream")
		}
		j.includeUsage, j.continuousUsage = so.IncludeUsage, so.ContinuousUsageStats
	}
	return nil
}

// generate runs j on the engine and writes the answer. A client that goes
// away cancels the request in the engine at once.
func (w *Worker) generate(rw http.ResponseWriter, r *http.Request, j job) {
	ctx := r.Context()
	req := newRequest(j.promptTokens, j.maxTokens, j.outputTokens)
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
		var cut <-chan struct{}
		if markedMigratable(r) {
			var done func()
			cut, done = w.registerCuttable(req)
			defer done()
		}
		finished = w.stream(ctx, rw, j, req, id, cut)
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
	if n != req.tokens() {
		w.fail(rw, newAPIError(http.StatusInternalServerError, "internal_error", "", "", "no rank can hold the request"))
		return true
	}
	text, finish := generatedText(j.start, n, j.chat), finishReason(j.finish())
	u := newUsage(j.promptTokens, n)
	if j.chat {
		writeJSON(rw, http.StatusOK, newResponse(w, id, objectChat, u,
			chatChoice{Message: &chatDelta{Role: "assistant", Content: &text}, FinishReason: finish}))
	} else {
		writeJSON(rw, http.StatusOK, newResponse(w, id, objectCompletion, u, completionChoice{Text: text, FinishReason: finish}))
	}
	return true
}

// stream writes the answer as server-sent events, one token per chunk, as
// the engine generates them. It reports whether the request ran to its end.
//
// A cut (a migrate request; nil: never) ends the stream at once, without
// [DONE] or a finish reason: the request is not finished, and the caller
// cancels it in the engine.
func (w *Worker) stream(ctx context.Context, rw http.ResponseWriter, j job, req *request, id string, cut <-chan struct{}) bool {
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
		case <-cut:
			select {
			case <-req.done: // finished as it was cut: the stream ends as served
				done = true
			default:
				return false
			}
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
		if sent != req.tokens() {
			sw.event([]byte(`{"error":{"message":"no rank can hold the request","type":"internal_error","param":null,"code":null}}`))
			sw.flush()
			return true
		}
		var u *usage
		if j.continuousUsage {
			u = newUsage(j.promptTokens, sent)
		}
		if j.chat {
			sw.chunk(&chatDelta{}, j.finish(), u)
		} else {
			sw.text("", j.finish(), u)
		}
		// A request with sim_output_tokens ends before its max_tokens: the
		// usage tells the client how many tokens it got.
		if j.includeUsage || j.outputTokens > 0 {
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
	s.json(newResponse(s.w, s.id, objectCompletion, u, completionChoice{Text: text, FinishReason: finishReason(finish)}))
}

// chunk writes a chat chunk; an empty finish is null.
func (s *sseWriter) chunk(delta *chatDelta, finish string, u *usage) {
	s.json(newResponse(s.w, s.id, objectChatChunk, u, chatChoice{Delta: delta, FinishReason: finishReason(finish)}))
}

// usage writes the last chunk of include_usage: no choices, the usage.
func (s *sseWriter) usage(u *usage) {
	if s.j.chat {
		s.json(newResponse[chatChoice](s.w, s.id, objectChatChunk, u))
		return
	}
	s.json(newResponse[completionChoice](s.w, s.id, objectCompletion, u))
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
