package router

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/workermon/workermon/admission"
)

// Streams.
//
// A successful, uncompressed text/event-stream response is relayed event by
// event: each event is written and flushed as soon as its blank line has
// arrived, unchanged unless the stream migrated (below). The Router watches
// the events go by: [DONE], a finish_reason, an error event, the text of a
// completion and its usage.
//
// A stream that ends with a read error, or with an end of stream before
// [DONE] and before any finish_reason or error event, was cut. A read error
// after [DONE] or an error event was relayed is no cut: the client's stream
// had ended, and nothing is added to it. Without
// migration, the client's stream then ends with an error event and [DONE]:
//
//	data: {"error":{"message":"...","type":"upstream_error","code":502}}
//
//	data: [DONE]
//
// (cut after a finish_reason, only [DONE] is added).
//
// Migration (MigrationLimit > 0; POST /v1/completions with "stream": true,
// one string "prompt", no "echo", "n" and "best_of" absent or 1): the
// stream continues on another worker with the same request except "prompt" =
// the original prompt + the text relayed so far and "max_tokens" (and
// "min_tokens") reduced by the tokens produced so far — the engine's last
// usage.completion_tokens of each worker when it sent usage, else one per
// event that carried text. Only whole events are relayed, so the client sees
// each piece of text once. The continuation's events are relayed with the
// first worker's "id", and a usage object in them counts the tokens of the
// whole stream (completion_tokens + the tokens before, prompt_tokens = the
// original prompt's when the first worker told it). When max_tokens is used
// up, the Router ends the stream itself with a finish_reason "length" event
// and [DONE]. When no worker can continue, after MigrationLimit
// migrations, or when the text so far is more than MaxBodyBytes (the
// continuation would be a request larger than the router accepts), the
// stream ends with the error event.

// streamEnd is how one worker's part of a stream ended.
type streamEnd uint8

const (
	streamComplete streamEnd = iota // [DONE], a finish reason or an error event, then the end (or a read error after [DONE] or an error event)
	streamCut                       // any other read error, or the end before any of those
	streamClient                    // the client went away
)

// streamState is what the Router knows of a relayed stream.
type streamState struct {
	mig        *migration // nil: no migration for this request (or no more)
	migrations int
	segment    int    // number of workers before the current one
	text       []byte // completion text relayed so far (with mig)
	maxText    int    // the most text kept for a continuation
	firstID    string // the first worker's chunk id
	before     int    // tokens produced by the earlier workers
	segChunks  int    // events with text from the current worker
	segUsage   int    // the current worker's last usage.completion_tokens; -1: none
	prompt     int    // the first worker's usage.prompt_tokens; -1: none
	done       bool   // [DONE] relayed
	finished   bool   // a finish_reason relayed
	errored    bool   // an error event relayed
	untracked  bool   // an event could not be read: migration would lose text
	chatText   bool   // the last event observed carried chat text
	data       []byte // scratch
}

// streamChunk is what the Router reads of a streamed chunk (completions and
// chat completions alike).
type streamChunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Choices []struct {
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		// Delta is a chat completion's; only its text is read.
		Delta *struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     *int `json:"prompt_tokens"`
		CompletionTokens *int `json:"completion_tokens"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

// segTokens returns the tokens the current worker produced.
func (st *streamState) segTokens() int {
	if st.segUsage >= 0 {
		return st.segUsage
	}
	return st.segChunks
}

// nextSegment moves on to the next worker.
func (st *streamState) nextSegment() {
	st.before += st.segTokens()
	st.segment++
	st.segChunks, st.segUsage = 0, -1
	st.done, st.finished, st.errored = false, false, false
}

// observe takes note of one chunk.
func (st *streamState) observe(c *streamChunk) {
	if (len(c.Error) > 0 && string(c.Error) != "null") || c.Object == "error" {
		st.errored = true
	}
	if st.firstID == "" {
		st.firstID = c.ID
	}
	text := false
	for _, ch := range c.Choices {
		if ch.FinishReason != nil && *ch.FinishReason != "" {
			st.finished = true
		}
		if ch.Text != "" {
			text = true
			st.keep(ch.Text)
		}
		if ch.Delta != nil && ch.Delta.Content != "" {
			st.chatText = true
		}
	}
	if text {
		st.segChunks++
	}
	if c.Usage != nil {
		if c.Usage.CompletionTokens != nil {
			st.segUsage = *c.Usage.CompletionTokens
		}
		if c.Usage.PromptTokens != nil && st.segment == 0 {
			st.prompt = *c.Usage.PromptTokens
		}
	}
}

// keep adds text to what a continuation would start from. Beyond maxText
// the continuation would be a request larger than the router accepts: the
// text is dropped and the stream can no longer migrate.
func (st *streamState) keep(text string) {
	if st.mig == nil {
		return
	}
	if len(st.text)+len(text) > st.maxText {
		st.mig, st.text = nil, nil
		return
	}
	st.text = append(st.text, text...)
}

// stream relays an event stream, migrating it when it is cut and mig allows.
func (ex *exchange) stream(up *upstream, mig *migration) {
	rt := ex.rt
	h := ex.w.Header()
	copyResponseHeader(h, up.resp.Header)
	h.Del("Content-Length")
	ex.code = http.StatusOK
	ex.w.WriteHeader(http.StatusOK)
	if !ex.write(nil) {
		up.close()
		return
	}
	st := &streamState{mig: mig, segUsage: -1, prompt: -1, maxText: int(rt.cfg.MaxBodyBytes)}
	for {
		end, err := ex.pump(up, st)
		up.close()
		switch end {
		case streamComplete:
			return
		case streamClient:
			ex.clientGone()
			return
		}
		rt.metrics.upstream.WithLabelValues(upstreamStream).Inc()
		rt.streamLog.warn("router: worker's stream cut", "model", ex.model, "worker", up.worker.WorkerID,
			"endpoint", up.worker.Endpoint, "err", err)
		if st.finished {
			// Cut after the last text: only the end marker is missing,
			// unless it was relayed.
			if !st.done {
				ex.write([]byte("data: [DONE]\n\n"))
			}
			return
		}
		if st.mig == nil || st.untracked {
			ex.endWithError(fmt.Sprintf("the worker's stream was cut: %v", err))
			return
		}
		if st.migrations >= rt.cfg.MigrationLimit {
			rt.metrics.migrations.WithLabelValues(migrationLimit).Inc()
			ex.endWithError(fmt.Sprintf("the worker's stream was cut (%v) and the migration limit (%d) is reached",
				err, rt.cfg.MigrationLimit))
			return
		}
		// Only the worker that cut the stream is left out: the earlier ones
		// served their segments (a cut at the rescheduler's request is no
		// fault), and one that cannot be reached now is dropped by dispatch.
		ex.tried = append(ex.tried[:0], up.worker.WorkerID)
		next := ex.migrate(st, up, err)
		if next == nil {
			return
		}
		up = next
	}
}

// pump relays one worker's events until its stream ends.
func (ex *exchange) pump(up *upstream, st *streamState) (streamEnd, error) {
	sr := newSSEReader(up.resp.Body)
	for {
		ev, err := sr.next()
		if err == nil {
			if !ex.relay(ev, st) {
				return streamClient, nil
			}
			continue
		}
		if !errors.Is(err, io.EOF) {
			if st.done || st.errored {
				// The client's stream had ended ([DONE] or an error event
				// relayed): only the engine's connection closing is lost.
				return streamComplete, nil
			}
			if ex.r.Context().Err() != nil {
				return streamClient, nil
			}
			return streamCut, err
		}
		// The end of the stream; an unfinished last event counts only when
		// it is the end marker.
		if data, ok := sseData(ev, st.data[:0]); ok && sseIsDone(data) {
			if !ex.relay(sseTerminate(ev), st) {
				return streamClient, nil
			}
		}
		if st.done || st.finished || st.errored {
			return streamComplete, nil
		}
		return streamCut, errors.New("the stream ended before [DONE] or a finish reason")
	}
}

// relay takes note of one event and writes it to the client; false means
// the client is gone.
func (ex *exchange) relay(ev []byte, st *streamState) bool {
	data, ok := sseData(ev, st.data[:0])
	st.data = data
	switch {
	case !ok:
	case sseIsDone(data):
		st.done = true
	default:
		var c streamChunk
		if err := json.Unmarshal(data, &c); err != nil {
			st.untracked = true
			break
		}
		before := st.segChunks
		st.chatText = false
		st.observe(&c)
		if st.segment == 0 && (st.segChunks > before || st.chatText) {
			ex.lat.text(time.Now()) // latency windows (contract §18)
		}
		if st.segment > 0 {
			if out, err := st.rewrite(data); err == nil {
				ev = sseReplaceData(ev, out)
			}
		}
	}
	return ex.write(ev)
}

// rewrite gives a continuation's chunk the first worker's id and the whole
// stream's usage.
func (st *streamState) rewrite(data []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, err
	}
	if _, ok := m["id"]; ok && st.firstID != "" {
		id, _ := json.Marshal(st.firstID)
		m["id"] = id
	}
	if raw, ok := m["usage"]; ok && string(raw) != "null" {
		var u map[string]json.RawMessage
		if err := json.Unmarshal(raw, &u); err == nil {
			var pt, ct int
			_ = json.Unmarshal(u["prompt_tokens"], &pt)
			_ = json.Unmarshal(u["completion_tokens"], &ct)
			ct += st.before
			if st.prompt >= 0 {
				pt = st.prompt
			} else {
				pt = max(pt-st.before, 0)
			}
			u["prompt_tokens"] = strconv.AppendInt(nil, int64(pt), 10)
			u["completion_tokens"] = strconv.AppendInt(nil, int64(ct), 10)
			u["total_tokens"] = strconv.AppendInt(nil, int64(pt+ct), 10)
			if raw, err = marshalJSON(u); err == nil {
				m["usage"] = raw
			}
		}
	}
	return marshalJSON(m)
}

// migrate continues a cut stream on another worker. It returns the new
// worker's stream, or nil when the client's stream has ended (finished, or
// ended with an error event) or the client is gone.
func (ex *exchange) migrate(st *streamState, cut *upstream, cause error) *upstream {
	rt := ex.rt
	st.nextSegment()
	if st.mig.simOutputReached(st.before) {
		rt.metrics.migrations.WithLabelValues(migrationFinished).Inc()
		ex.endFinished(st, finishStop)
		return nil
	}
	remaining := -1
	if st.mig.maxTokens >= 0 {
		remaining = st.mig.maxTokens - st.before
		if remaining <= 0 {
			rt.metrics.migrations.WithLabelValues(migrationFinished).Inc()
			ex.endFinished(st, finishLength)
			return nil
		}
	}
	st.migrations++
	body, err := st.mig.body(st.text, st.before, remaining)
	if err != nil {
		rt.metrics.migrations.WithLabelValues(migrationFailed).Inc()
		ex.endWithError(fmt.Sprintf("the worker's stream was cut and could not be continued: %v", err))
		return nil
	}
	var lastErr error
	for range maxMigrationAttempts {
		d := rt.cfg.BusyList.DecideClass(ex.model, ex.class)
		if !d.Admit {
			lastErr = errors.New("every worker of the model is busy")
			break
		}
		cands := d.Candidates(nil, rt.cfg.Registry.Endpoints(ex.model))
		up, err := ex.dispatch(body, cands, true, st.migrations < rt.cfg.MigrationLimit, false)
		if err != nil {
			if ex.r.Context().Err() != nil {
				ex.clientGone()
				return nil
			}
			if lastErr == nil || !errors.Is(err, ErrNoCandidates) {
				lastErr = err
			}
			break
		}
		if up.isEventStream() {
			rt.metrics.migrations.WithLabelValues(migrationContinued).Inc()
			rt.log.Info("router: stream migrated", "model", ex.model, "from", cut.worker.WorkerID,
				"to", up.worker.WorkerID, "tokens_before", st.before, "max_tokens_left", remaining,
				"migration", st.migrations, "cause", cause)
			return up
		}
		lastErr = fmt.Errorf("worker %d answered %s", up.worker.WorkerID, up.resp.Status)
		ex.tried = append(ex.tried, up.worker.WorkerID)
		up.close()
	}
	rt.metrics.migrations.WithLabelValues(migrationFailed).Inc()
	ex.endWithError(fmt.Sprintf("the worker's stream was cut (%v) and no other worker could continue it: %v", cause, lastErr))
	return nil
}

// endWithError ends the client's stream with an error event and [DONE].
func (ex *exchange) endWithError(msg string) {
	var b bytes.Buffer
	b.WriteString("data: ")
	b.Write(admission.ErrorEvent(http.StatusBadGateway, typeUpstream, msg))
	b.WriteString("\n\ndata: [DONE]\n\n")
	ex.write(b.Bytes())
}

// Finish reasons of a migrated completion that ends in the router.
const (
	finishLength = "length" // its max_tokens used up
	finishStop   = "stop"   // its sim_output_tokens used up (workermon sim)
)

// endFinished ends a migrated completion whose max_tokens (or
// sim_output_tokens) is used up: a last chunk with finish_reason finish,
// then [DONE].
func (ex *exchange) endFinished(st *streamState, finish string) {
	chunk := map[string]any{
		"id":      st.firstID,
		"object":  "text_completion",
		"created": time.Now().Unix(),
		"model":   ex.model,
		"choices": []map[string]any{{"index": 0, "text": "", "logprobs": nil, "finish_reason": finish}},
	}
	data, err := json.Marshal(chunk)
	if err != nil {
		panic(err) // plain values always marshal
	}
	var b bytes.Buffer
	b.WriteString("data: ")
	b.Write(data)
	b.WriteString("\n\ndata: [DONE]\n\n")
	ex.write(b.Bytes())
}
