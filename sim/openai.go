package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"unicode"
)

// Finish reasons: a simulated completion generates max_tokens tokens
// ("length"), or the sim_output_tokens of its body ("stop", as an
// end-of-sequence token ends it).
const (
	finishLength = "length"
	finishStop   = "stop"
)

// ownedBy is the owned_by of the model in GET /v1/models.
const ownedBy = "workermon-sim"

// streamOptions are the streaming options of OpenAI (include_usage) and
// vLLM (continuous_usage_stats: usage in every chunk).
type streamOptions struct {
	IncludeUsage         bool `json:"include_usage"`
	ContinuousUsageStats bool `json:"continuous_usage_stats"`
}

// requestOptions are the fields of a request body that completions and chat
// share.
type requestOptions struct {
	Model         string         `json:"model"`
	MaxTokens     *int           `json:"max_tokens"`
	N             *int           `json:"n"`
	Stream        bool           `json:"stream"`
	StreamOptions *streamOptions `json:"stream_options"`
	// SimOutputTokens is the sim-only body field sim_output_tokens
	// (contract §21): the request ends after that many tokens, as an
	// end-of-sequence token would end it.
	SimOutputTokens *int `json:"sim_output_tokens"`
}

// completionRequest is the part of a POST /v1/completions body the
// simulation reads; other fields are ignored.
type completionRequest struct {
	requestOptions
	Prompt json.RawMessage `json:"prompt"`
}

// chatMessage is one message of a chat request; content is a string or an
// array of parts of which the text ones count.
type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// chatRequest is the part of a POST /v1/chat/completions body the
// simulation reads.
type chatRequest struct {
	requestOptions
	Messages            []chatMessage `json:"messages"`
	MaxCompletionTokens *int          `json:"max_completion_tokens"`
}

// usage is the token accounting of a response.
type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

func newUsage(prompt, completion int) *usage {
	return &usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion}
}

// Objects of the answers.
const (
	objectCompletion = "text_completion"
	objectChat       = "chat.completion"
	objectChatChunk  = "chat.completion.chunk"
)

// completionChoice is a choice of a completion or of one of its chunks.
type completionChoice struct {
	Index        int       `json:"index"`
	Text         string    `json:"text"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

// chatDelta is the message of a chat answer, or the delta of a chunk.
type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

// chatChoice is a choice of a chat answer or of one of its chunks.
type chatChoice struct {
	Index        int        `json:"index"`
	Message      *chatDelta `json:"message,omitempty"`
	Delta        *chatDelta `json:"delta,omitempty"`
	Logprobs     *struct{}  `json:"logprobs"`
	FinishReason *string    `json:"finish_reason"`
}

// response is a completion or a chat answer, or one chunk of a streamed one,
// by its choice type.
type response[C completionChoice | chatChoice] struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []C    `json:"choices"`
	Usage   *usage `json:"usage,omitempty"`
}

// newResponse returns an answer of w's model; without choices, its choices
// are an empty list (the usage chunk of a stream).
func newResponse[C completionChoice | chatChoice](w *Worker, id, object string, u *usage, choices ...C) response[C] {
	if choices == nil {
		choices = []C{}
	}
	return response[C]{ID: id, Object: object, Created: w.created, Model: w.cfg.Model, Choices: choices, Usage: u}
}

// finishReason returns the finish_reason of a choice: null when empty.
func finishReason(finish string) *string {
	if finish == "" {
		return nil
	}
	return &finish
}

// modelList is the body of GET /v1/models.
type modelList struct {
	Object string      `json:"object"`
	Data   []modelCard `json:"data"`
}

// modelCard is one model of GET /v1/models.
type modelCard struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// apiError is an OpenAI-style error.
type apiError struct {
	status int
	body   errorBody
}

// errorBody is the JSON of an OpenAI-style error.
type errorBody struct {
	Error errorDetail `json:"error"`
}

// errorDetail is the inside of an OpenAI-style error.
type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) Error() string { return e.body.Error.Message }

// badRequest returns a 400 invalid_request_error about param (none when
// empty).
func badRequest(param, msg string) *apiError {
	return newAPIError(http.StatusBadRequest, "invalid_request_error", param, "", msg)
}

// newAPIError returns an error answered with status; empty param or code are
// null.
func newAPIError(status int, typ, param, code, msg string) *apiError {
	e := &apiError{status: status, body: errorBody{Error: errorDetail{Message: msg, Type: typ}}}
	if param != "" {
		e.body.Error.Param = &param
	}
	if code != "" {
		e.body.Error.Code = &code
	}
	return e
}

// writeJSON writes v as the JSON body of a status response.
func writeJSON(w http.ResponseWriter, status int, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		http.Error(w, "encode response", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(data, '\n'))
}

// writeError writes err as an OpenAI-style error.
func writeError(w http.ResponseWriter, err *apiError) { writeJSON(w, err.status, err.body) }

// promptTokens estimates the tokens of a text the way the simulation counts
// them: one per four bytes, plus one.
func promptTokens(text string) int { return len(text)/4 + 1 }

// tokenWord is the word of token i of a sequence.
const tokenWord = "tok"

// appendToken appends the text of token i: " tok<i>", without the space when
// first is set.
func appendToken(b []byte, i int, first bool) []byte {
	if !first {
		b = append(b, ' ')
	}
	b = append(b, tokenWord...)
	return strconv.AppendInt(b, int64(i), 10)
}

// generatedText returns the text of n tokens from token start.
func generatedText(start, n int, chat bool) string {
	var b []byte
	for i := range n {
		b = appendToken(b, start+i, chat && i == 0)
	}
	return string(b)
}

// continuation returns the index of the token that follows text: n+1 when
// its last word is "tok<n>", else 0.
func continuation(text string) int {
	text = strings.TrimRightFunc(text, unicode.IsSpace)
	word := text[strings.LastIndexFunc(text, unicode.IsSpace)+1:]
	digits, ok := strings.CutPrefix(word, tokenWord)
	if !ok || digits == "" || len(digits) > 9 {
		return 0
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n < 0 || digits[0] == '+' {
		return 0
	}
	return n + 1
}

// parsePrompt returns a completion prompt's text and its tokens: a string,
// or an array of one string, counts promptTokens(text); an array of token
// ids (what a tokenizing client or router sends) counts one token per id,
// with no text to continue from.
func parsePrompt(raw json.RawMessage) (text string, tokens int, _ *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", 0, badRequest("prompt", "prompt is required")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, promptTokens(s), nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err == nil && len(list) == 1 {
		return list[0], promptTokens(list[0]), nil
	}
	var ids []uint32
	if err := json.Unmarshal(raw, &ids); err == nil && len(ids) > 0 {
		return "", len(ids), nil
	}
	return "", 0, badRequest("prompt", "prompt must be a string, an array of one string, or an array of token ids")
}

// parseMessages returns the text a chat request's messages count for, as
// "role: content" lines, and the content of the last message.
func parseMessages(msgs []chatMessage) (all, last string, err *apiError) {
	if len(msgs) == 0 {
		return "", "", badRequest("messages", "messages must be a non-empty array")
	}
	var b strings.Builder
	for i, m := range msgs {
		content, ok := messageText(m.Content)
		if !ok {
			return "", "", badRequest("messages", "messages["+strconv.Itoa(i)+"].content must be a string or an array of parts")
		}
		b.WriteString(m.Role)
		b.WriteString(": ")
		b.WriteString(content)
		b.WriteByte('\n')
		last = content
	}
	return b.String(), last, nil
}

// messageText returns the text of a message's content: a string, null, or
// the text parts of an array.
func messageText(raw json.RawMessage) (string, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", true
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, true
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", false
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Type == "text" {
			b.WriteString(p.Text)
		}
	}
	return b.String(), true
}

// decodeBody reads a JSON body of at most limit bytes into v.
func decodeBody(w http.ResponseWriter, r *http.Request, limit int64, v any) *apiError {
	body := http.MaxBytesReader(w, r.Body, limit)
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return newAPIError(http.StatusRequestEntityTooLarge, "invalid_request_error", "", "",
				"request body larger than "+strconv.FormatInt(limit, 10)+" bytes")
		}
		return badRequest("", "invalid JSON body: "+err.Error())
	}
	if dec.More() {
		return badRequest("", "invalid JSON body: more than one value")
	}
	return nil
}
