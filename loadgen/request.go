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
	"strings"
	"time"

	"github.com/workermon/workermon/admission"
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
}

// requestBody returns the JSON body of cfg's requests for model.
func requestBody(cfg Config, model, prompt string) ([]byte, error) {
	r := request{Model: model, MaxTokens: cfg.MaxTokens, Stream: cfg.Stream}
	if cfg.API == APIChat {
		r.Messages = []chatMessage{{Role: "user", Content: prompt}}
	} else {
		r.Prompt = prompt
	}
	return json.Marshal(&r)
}

// do sends one request, with the priority header when priority is not
// empty, and reads its answer to the end. It returns how it ended, the HTTP
// status received (0 without one) and, for a stream, when its first data
// event arrived (zero otherwise).
func (g *Generator) do(ctx context.Context, body []byte, priority string) (outcome, int, time.Time) {
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

	req, err := http.NewRequestWithContext(reqCtx, http.MethodPost, g.url, bytes.NewReader(body))
	if err != nil {
		return g.failed(ctx, reqCtx, err), 0, time.Time{}
	}
	req.Header.Set("Content-Type", "application/json")
	if g.cfg.Stream {
		req.Header.Set("Accept", "text/event-stream")
	}
	if priority != "" {
		req.Header.Set(admission.PriorityHeader, priority)
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return g.failed(ctx, reqCtx, err), 0, time.Time{}
	}
	defer resp.Body.Close()

	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusServiceUnavailable:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return outUnavailable, resp.StatusCode, time.Time{}
	case http.StatusTooManyRequests:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return outTooMany, resp.StatusCode, time.Time{}
	default:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return outOther, resp.StatusCode, time.Time{}
	}

	if !g.cfg.Stream {
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return g.failed(ctx, reqCtx, err), resp.StatusCode, time.Time{}
		}
		return outOK, resp.StatusCode, time.Time{}
	}
	cancelAt := 0
	if cancelIt {
		cancelAt = max(1, g.cfg.MaxTokens/2)
	}
	var first time.Time
	err = readStream(resp.Body, cancelAt, func() { cancel(errClientCancel) }, func() { first = time.Now() })
	switch {
	case err == nil:
		return outOK, resp.StatusCode, first
	case errors.Is(err, errClientCancel):
		return outCancelled, resp.StatusCode, first
	case errors.Is(err, errStreamError), errors.Is(err, errIncomplete):
		g.log.Debug("loadgen: request failed", "err", err)
		return outError, resp.StatusCode, first
	}
	return g.failed(ctx, reqCtx, err), resp.StatusCode, first
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
	g.log.Debug("loadgen: request failed", "err", err)
	return outError
}

// readStream reads server-sent events until [DONE]. It calls first when the
// first data event that is not an error arrives. With cancelAt > 0 it
// calls cancel after that many chunks and returns errClientCancel. An error
// event, or the end of the stream before [DONE], is an error.
func readStream(body io.Reader, cancelAt int, cancel, first func()) error {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 4096), maxEventSize)
	chunks := 0
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasPrefix(line, []byte("event:")) &&
			string(bytes.TrimSpace(line[len("event:"):])) == "error" {
			return errStreamError
		}
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			return nil
		}
		if isErrorEvent(data) {
			return errStreamError
		}
		chunks++
		if chunks == 1 {
			first()
		}
		if cancelAt > 0 && chunks >= cancelAt {
			cancel()
			return errClientCancel
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return errIncomplete
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
