package router

import (
	"bytes"
	"encoding/json"
	"maps"
	"strconv"
)

// migration is what a cut streamed completion needs to continue elsewhere:
// the request's fields, its prompt and its token limits (see stream.go).
type migration struct {
	fields    map[string]json.RawMessage
	prompt    string
	maxTokens int // -1: not given
	minTokens int // -1: not given
	// simOutput is the sim-only sim_output_tokens (contract §21): the output
	// at which workermon sim ends the request, lowered with max_tokens.
	// -1: not given.
	simOutput int
}

// newMigration returns the migration of a completion request, or nil when it
// cannot migrate: not streamed, a prompt that is not one string, several
// choices (n, best_of), echo, or token limits that are not integers.
func newMigration(body []byte) *migration {
	var f map[string]json.RawMessage
	if err := json.Unmarshal(body, &f); err != nil {
		return nil
	}
	if string(bytes.TrimSpace(f["stream"])) != "true" {
		return nil
	}
	m := &migration{fields: f, maxTokens: -1, minTokens: -1, simOutput: -1}
	p := bytes.TrimSpace(f["prompt"])
	if len(p) == 0 || p[0] != '"' || json.Unmarshal(p, &m.prompt) != nil {
		return nil
	}
	for _, k := range []string{"n", "best_of"} {
		if v, ok := jsonInt(f[k]); !ok || v > 1 {
			return nil
		}
	}
	if e := bytes.TrimSpace(f["echo"]); len(e) > 0 && string(e) != "null" && string(e) != "false" {
		return nil
	}
	var ok bool
	if m.maxTokens, ok = jsonInt(f["max_tokens"]); !ok {
		return nil
	}
	if m.minTokens, ok = jsonInt(f["min_tokens"]); !ok {
		return nil
	}
	if m.simOutput, ok = jsonInt(f["sim_output_tokens"]); !ok {
		return nil
	}
	return m
}

// jsonInt reads an optional non-negative integer: -1 when absent or null;
// ok is false when it is something else.
func jsonInt(raw json.RawMessage) (v int, ok bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return -1, true
	}
	n, err := strconv.ParseInt(string(raw), 10, 32)
	if err != nil || n < 0 {
		return 0, false
	}
	return int(n), true
}

// simOutputReached reports whether the request's sim_output_tokens, if
// any, is used up after produced tokens: workermon sim would have ended it
// with finish_reason "stop".
func (m *migration) simOutputReached(produced int) bool {
	return m.simOutput >= 0 && produced >= m.simOutput
}

// body returns the continuation's request: the prompt followed by the text
// so far, max_tokens = remaining (when the request had one), min_tokens
// reduced by the tokens produced, sim_output_tokens too (at least 1: migrate
// ends the stream instead when none are left).
func (m *migration) body(text []byte, produced, remaining int) ([]byte, error) {
	f := maps.Clone(m.fields)
	prompt, err := marshalJSON(m.prompt + string(text))
	if err != nil {
		return nil, err
	}
	f["prompt"] = prompt
	if m.maxTokens >= 0 {
		f["max_tokens"] = strconv.AppendInt(nil, int64(remaining), 10)
	}
	if m.minTokens >= 0 {
		f["min_tokens"] = strconv.AppendInt(nil, int64(max(m.minTokens-produced, 0)), 10)
	}
	if m.simOutput >= 0 {
		f["sim_output_tokens"] = strconv.AppendInt(nil, int64(max(m.simOutput-produced, 1)), 10)
	}
	return marshalJSON(f)
}

// marshalJSON is json.Marshal without the escaping of <, > and & (the text
// of a completion goes back to the engine and the client as it was).
func marshalJSON(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte{'\n'}), nil
}
