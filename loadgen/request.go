package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/internal/redact"
)

// drainLimit bounds how much of an error answer is read before the
// connection is given back.
const drainLimit = 64 << 10

// maxEventSize bounds one server-sent event line.
const maxEventSize = 1 << 20

// promptWords are the words of the prompt, each three letters and a space:
// four bytes, one token to the simulated engine.
var promptWords = strings.Fields("the fox ran far and saw two red owl sit top one big oak all day")

// makePrompt returns a text of n words of four bytes with their space.
func makePrompt(n int) string {
	var b strings.Builder
	b.Grow(4 * n)
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(promptWords[i%len(promptWords)])
	}
	return b.String()
}

// chatMessage is a message of a chat request.
type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// request is the body of a completion or chat request.
type request struct {
	Model     string        `json:"model"`
	Prompt    string        `json:"prompt,omitempty"`
	Messages  []chatMessage `json:"messages,omitempty"`
	MaxTokens int           `json:"max_tokens"`
	Stream    bool          `json:"stream"`
	// SimOutputTokens is the sim-only output length (Config.SimOutputTokens).
	SimOutputTokens int `json:"sim_output_tokens,omitempty"`
}

// requestBody returns the JSON body of a request of cfg for model with
// prompt and maxTokens, and simOutput in sim_output_tokens when positive.
func requestBody(cfg Config, model, prompt string, maxTokens, simOutput int) ([]byte, error) {
	r := request{Model: model, MaxTokens: maxTokens, Stream: cfg.Stream, SimOutputTokens: simOutput}
	if cfg.API == APIChat {
		r.Messages = []chatMessage{{Role: "user", Content: prompt}}
	} else {
		r.Prompt = prompt
	}
	return json.Marshal(&r)
}

// queuedHeader is the router's header on an answer that waited in its
// queue: the milliseconds waited (contract §17).
const queuedHeader = "X-Workermon-Queued"

// do sends one request, with the priority header when priority is not
// empty, and reads its answer to the end, retrying it up to Config.Retries
// times as the OpenAI SDKs do (retry.go). Config.Timeout bounds it all,
// waits between attempts included. It returns how its last attempt ended and
// what the client saw, E2E and TTFT from start, the first attempt's send;
// each attempt before the last is counted in the recorder (class) when it
// is retried.
func (g *Generator) do(ctx context.Context, start time.Time, body []byte, priority string, maxTokens int, fl *flight, class int) done {
	reqCtx, cancelTimeout := context.WithTimeout(ctx, g.cfg.Timeout)
	defer cancelTimeout()
	reqCtx, cancel := context.WithCancelCause(reqCtx)
	defer cancel(nil)

	cancelIt := g.cfg.CancelFraction > 0 && rand.Float64() < g.cfg.CancelFraction
	if cancelIt && !g.cfg.Stream {
		delay := time.Duration(rand.Int64N(int64(g.cfg.CancelAfter))) + 1
		t := time.AfterFunc(delay, func() { cancel(errClientCancel) })
		defer t.Stop()
	}
	var waited time.Duration // in a router's queue, over the attempts
	queued := false
	tries := make([]Try, 0, 1+g.cfg.Retries)
	for n := 0; ; n++ {
		at := time.Since(start)
		d, header, noAnswer := g.attempt(ctx, reqCtx, cancel, start, body, priority, n, maxTokens, fl, cancelIt)
		d.attempts = n + 1
		tries = append(tries, Try{At: at, Status: d.res.Status})
		d.tries = tries
		if d.queued {
			queued, waited = true, waited+d.queueWait
		}
		d.anyQueued, d.waited = queued, waited
		retry := n < g.cfg.Retries && (noAnswer || d.res.Status != 0 && d.o != outOK && shouldRetry(d.res.Status, header))
		if !retry {
			return d
		}
		now := time.Now()
		wait, ok := retryDelay(header, n, now, jitter)
		if deadline, set := reqCtx.Deadline(); !ok || set && now.Add(wait).After(deadline) {
			// Not retried, or not before the timeout would end the wait:
			// the request ends now with this answer, holding nothing.
			return d
		}
		if fl != nil {
			fl.retryAt(now.Add(wait))
		}
		t := time.NewTimer(wait)
		select {
		case <-reqCtx.Done():
			// The request ends with this attempt's answer, or as the
			// context says when it had none.
			t.Stop()
			if noAnswer {
				d.o = g.failed(ctx, reqCtx, reqCtx.Err())
			}
			return d
		case <-t.C:
		}
		g.rec.retried(time.Now(), class, d)
	}
}

// attempt sends the request once, attempt n of it, and reads its answer.
// noAnswer reports a connection error before any answer, which is retried.
func (g *Generator) attempt(ctx, reqCtx context.Context, cancel context.CancelCauseFunc, start time.Time, body []byte,
	priority string, n, maxTokens int, fl *flight, cancelIt bool) (_ done, _ http.Header, noAnswer bool) {
	d := done{o: outError, res: Result{Stream: g.cfg.Stream}}
	finish := func(o outcome) done { return g.ended(d, o, start) }
	req, err := http.NewRequestWithContext(reqCtx, http.MethodPost, g.url, bytes.NewReader(body))
	if err != nil {
		return finish(g.failed(ctx, reqCtx, err)), nil, false
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(RetryCountHeader, strconv.Itoa(n))
	if g.cfg.Stream {
		req.Header.Set("Accept", "text/event-stream")
	}
	if priority != "" {
		req.Header.Set(admission.PriorityHeader, priority)
	}
	resp, err := g.client.Do(req)
	if err != nil {
		// A connection error; one of the context (a timeout, a
		// cancellation, the end of the run) is not retried.
		return finish(g.failed(ctx, reqCtx, err)), nil, reqCtx.Err() == nil
	}
	defer resp.Body.Close()
	d.res.Status = resp.StatusCode
	if v := resp.Header.Get(queuedHeader); v != "" {
		if ms, err := strconv.ParseUint(v, 10, 63); err == nil {
			d.queued, d.queueWait = true, time.Duration(ms)*time.Millisecond
		}
	}

	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusServiceUnavailable:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return finish(outUnavailable), resp.Header, false
	case http.StatusTooManyRequests:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return finish(outTooMany), resp.Header, false
	default:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return finish(outOther), resp.Header, false
	}
	return g.readOK(ctx, reqCtx, cancel, start, resp, d, maxTokens, fl, cancelIt), resp.Header, false
}

// readOK reads a 200 answer to its end into d.
func (g *Generator) readOK(ctx, reqCtx context.Context, cancel context.CancelCauseFunc, start time.Time, resp *http.Response,
	d done, maxTokens int, fl *flight, cancelIt bool) done {
	finish := func(o outcome) done { return g.ended(d, o, start) }
	if !g.cfg.Stream {
		data, err := io.ReadAll(resp.Body)
		if err != nil {
			return finish(g.failed(ctx, reqCtx, err))
		}
		var a answer
		if err := json.Unmarshal(data, &a); err != nil {
			g.log.Debug("loadgen: request failed", "err", err)
			return finish(outError)
		}
		d.res.Complete = true
		d.res.Finished = a.finished()
		d.res.Tokens = a.usageTokens()
		if d.res.Tokens == 0 && d.res.Finished {
			d.res.Tokens = maxTokens // no usage: the simulated engine always generates max_tokens
		}
		return finish(outOK)
	}
	cancelAt := 0
	if cancelIt {
		cancelAt = max(1, maxTokens/2)
	}
	info, err := readStream(resp.Body, cancelAt, func() { cancel(errClientCancel) }, func(first time.Time) {
		if fl != nil {
			fl.firstToken(g.cfg.SLO, start, first, maxTokens)
		}
	})
	d.res.Tokens, d.res.Finished = info.tokens, info.finished
	if !info.first.IsZero() {
		d.res.TTFT = info.first.Sub(start)
	}
	switch {
	case err == nil:
		d.res.Complete = true
		return finish(outOK)
	case errors.Is(err, errClientCancel):
		return finish(outCancelled)
	case errors.Is(err, errStreamError), errors.Is(err, errIncomplete):
		g.log.Debug("loadgen: request failed", "err", err)
		return finish(outError)
	}
	return finish(g.failed(ctx, reqCtx, err))
}

// ended returns d ended with o: its E2E from start and whether it is good.
func (g *Generator) ended(d done, o outcome, start time.Time) done {
	d.o = o
	d.res.E2E = time.Since(start)
	d.good = d.o == outOK && d.res.Good(g.cfg.SLO)
	return d
}

// answer is the part of a completion, chat answer or chunk that the
// generator reads.
type answer struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta *struct {
			Content string `json:"content"`
		} `json:"delta"`
		Message *struct {
			Content string `json:"content"`
		} `json:"message"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// hasText reports whether a chunk carries generated text.
func (a *answer) hasText() bool {
	for _, c := range a.Choices {
		if c.Text != "" || c.Delta != nil && c.Delta.Content != "" || c.Message != nil && c.Message.Content != "" {
			return true
		}
	}
	return false
}

// finished reports whether a choice has a finish reason.
func (a *answer) finished() bool {
	for _, c := range a.Choices {
		if c.FinishReason != nil && *c.FinishReason != "" {
			return true
		}
	}
	return false
}

// usageTokens returns the usage's completion tokens, 0 without a usage.
func (a *answer) usageTokens() int {
	if a.Usage == nil {
		return 0
	}
	return a.Usage.CompletionTokens
}

// failed classifies the error of a request: cancelled by the client on
// purpose, aborted because the run ended, or an error.
func (g *Generator) failed(runCtx, reqCtx context.Context, err error) outcome {
	switch {
	case errors.Is(context.Cause(reqCtx), errClientCancel):
		return outCancelled
	case runCtx.Err() != nil:
		return outAborted
	}
	g.log.Debug("loadgen: request failed", "err", redact.Error(err, g.url))
	return outError
}

// streamInfo is what a stream told: when its first chunk with text came,
// its output tokens (the usage's when given, else the chunks with text) and
// whether a choice finished.
type streamInfo struct {
	first    time.Time
	tokens   int
	finished bool
}

// readStream reads server-sent events until [DONE]. With cancelAt > 0 it
// calls cancel after that many chunks and returns errClientCancel. An error
// event, or the end of the stream before [DONE], is an error.
func readStream(body io.Reader, cancelAt int, cancel func(), onFirst func(time.Time)) (streamInfo, error) {
	var info streamInfo
	usage := 0
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 4096), maxEventSize)
	chunks := 0
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasPrefix(line, []byte("event:")) &&
			string(bytes.TrimSpace(line[len("event:"):])) == "error" {
			return info, errStreamError
		}
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			if usage > 0 {
				info.tokens = usage
			}
			return info, nil
		}
		if isErrorEvent(data) {
			return info, errStreamError
		}
		var a answer
		if json.Unmarshal(data, &a) == nil {
			if a.hasText() {
				if info.tokens == 0 {
					info.first = time.Now()
					if onFirst != nil {
						onFirst(info.first)
					}
				}
				info.tokens++
			}
			info.finished = info.finished || a.finished()
			usage = max(usage, a.usageTokens())
		}
		chunks++
		if cancelAt > 0 && chunks >= cancelAt {
			cancel()
			return info, errClientCancel
		}
	}
	if err := sc.Err(); err != nil {
		return info, err
	}
	return info, errIncomplete
}

// isErrorEvent reports whether data is a JSON object with an "error" key.
func isErrorEvent(data []byte) bool {
	if !bytes.Contains(data, []byte(`"error"`)) {
		return false
	}
	var e struct {
		Error json.RawMessage `json:"error"`
	}
	return json.Unmarshal(data, &e) == nil && len(e.Error) > 0 && string(e.Error) != "null"
}
