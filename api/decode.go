package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/workermon/workermon/events"
)

// JSON field names of a threshold request.
const (
	fieldModel   = "model"
	fieldDecode  = "active_decode_blocks_threshold"
	fieldPrefill = "active_prefill_tokens_threshold"
	fieldFrac    = "active_prefill_tokens_threshold_frac"
	// The thresholds of the leading signals (contract §21).
	fieldCommitted = "kv_committed_threshold"
	fieldDelay     = "queue_delay_threshold_ms"
)

// thresholdFields are the threshold members of a request, in the order
// messages list them.
var thresholdFields = [...]string{fieldDecode, fieldPrefill, fieldFrac, fieldCommitted, fieldDelay}

var fieldList = fieldModel + ", " + fieldDecode + ", " + fieldPrefill + ", " + fieldFrac + ", " + fieldCommitted +
	" and " + fieldDelay

// exampleBody is quoted in messages that say what a body should look like.
const exampleBody = `{"model":"Qwen/Qwen3-0.6B","active_decode_blocks_threshold":0.9}`

// checkContentType answers 415 unless the request says its body is JSON
// (application/json, charset utf-8 if any).
func checkContentType(r *http.Request) *httpError {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return errorf(http.StatusUnsupportedMediaType, "missing Content-Type: send the body as JSON with Content-Type: application/json")
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != "application/json" {
		return errorf(http.StatusUnsupportedMediaType, fmt.Sprintf("Content-Type %q is not supported: send the body as JSON with Content-Type: application/json", ct))
	}
	if cs, ok := params["charset"]; ok && !strings.EqualFold(cs, "utf-8") {
		return errorf(http.StatusUnsupportedMediaType, fmt.Sprintf("charset %q is not supported: send the body as UTF-8", cs))
	}
	return nil
}

// readBody reads at most max bytes of the body; more is 413.
func readBody(w http.ResponseWriter, r *http.Request, max int64) ([]byte, *httpError) {
	if r.ContentLength > max {
		return nil, errorf(http.StatusRequestEntityTooLarge, fmt.Sprintf("the body is %d bytes, more than the limit of %d", r.ContentLength, max))
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, max))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, errorf(http.StatusRequestEntityTooLarge, fmt.Sprintf("the body is more than the limit of %d bytes", max))
		}
		if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
			return nil, errorf(http.StatusRequestTimeout, "the body did not arrive in time")
		}
		return nil, errorf(http.StatusBadRequest, "cannot read the body: "+err.Error())
	}
	return body, nil
}

// readObject checks the Content-Type, reads the body (at most MaxBody) and
// parses it as one JSON object: checkContentType, readBody, parseObject.
func (h *handler) readObject(w http.ResponseWriter, r *http.Request) (map[string]json.RawMessage, *httpError) {
	if herr := checkContentType(r); herr != nil {
		return nil, herr
	}
	body, herr := readBody(w, r, h.cfg.MaxBody)
	if herr != nil {
		return nil, herr
	}
	return parseObject(body)
}

// parseObject parses body as one JSON object and returns its members,
// undecoded. Broken JSON (trailing data included) and a member given twice
// are 400; valid JSON that is not an object is 422.
func parseObject(body []byte) (map[string]json.RawMessage, *httpError) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, errorf(http.StatusBadRequest, "the body is empty: send a JSON object such as "+exampleBody)
	}
	if !utf8.Valid(body) {
		return nil, errorf(http.StatusBadRequest, "the body is not valid UTF-8")
	}
	// A check of the whole body first: it finds every syntax error
	// (trailing data included) with its offset in the body.
	var top json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return nil, syntaxError(body, err)
	}
	if t := jsonType(bytes.TrimSpace(body)); t != "an object" {
		return nil, errorf(http.StatusUnprocessableEntity, fmt.Sprintf("the body must be a JSON object such as %s, not %s", exampleBody, t))
	}
	// Then the members, undecoded, in order, to catch duplicates.
	dec := json.NewDecoder(bytes.NewReader(body))
	if _, err := dec.Token(); err != nil { // the opening '{'
		return nil, syntaxError(body, err)
	}
	members := make(map[string]json.RawMessage)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, syntaxError(body, err)
		}
		key := tok.(string) // inside an object, Token returns keys as strings
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, syntaxError(body, err)
		}
		if _, dup := members[key]; dup {
			return nil, errorf(http.StatusBadRequest, fmt.Sprintf("field %q appears more than once", key))
		}
		members[key] = raw
	}
	return members, nil
}

// syntaxError turns a JSON decoding error into a 400 that says where.
func syntaxError(body []byte, err error) *httpError {
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return errorf(http.StatusBadRequest, "the body is not valid JSON: it ends before the object does")
	}
	msg := "the body is not valid JSON: " + err.Error()
	if se, ok := errors.AsType[*json.SyntaxError](err); ok {
		msg = fmt.Sprintf("the body is not valid JSON: %v (at byte %d)", se, se.Offset)
		if rest := body[max(0, min(int(se.Offset)-1, len(body))):]; bytes.HasPrefix(rest, []byte("NaN")) ||
			bytes.HasPrefix(rest, []byte("Infinity")) || bytes.HasPrefix(rest, []byte("-Infinity")) ||
			bytes.HasPrefix(rest, []byte("Inf")) {
			msg += "; NaN and Infinity are not JSON numbers, and every threshold must be a finite number"
		}
	}
	return errorf(http.StatusBadRequest, msg)
}

// jsonType names the type of a JSON value for messages.
func jsonType(raw json.RawMessage) string {
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case 'n':
		return "null"
	case 't', 'f':
		return "a boolean"
	case '"':
		return "a string"
	case '[':
		return "an array"
	case '{':
		return "an object"
	}
	return "a number"
}

func isNull(raw json.RawMessage) bool { return len(raw) == 0 || raw[0] == 'n' }

// isSet reports whether members set a threshold: a set needs the admin
// token, a body with only a model (or null thresholds) is a get.
func isSet(members map[string]json.RawMessage) bool {
	for _, f := range thresholdFields {
		if raw, ok := members[f]; ok && !isNull(raw) {
			return true
		}
	}
	return false
}

// thresholdRequest is a checked POST /busy_threshold body.
type thresholdRequest struct {
	model string
	patch events.Thresholds // fields to set; all nil for a get
}

// decodeRequest checks the members of a POST body: unknown field, missing
// or invalid model, out of range or non-finite number → 400; a field of
// the wrong type → 422.
func decodeRequest(members map[string]json.RawMessage) (thresholdRequest, *httpError) {
	var req thresholdRequest
	for key := range members {
		switch key {
		case fieldModel, fieldDecode, fieldPrefill, fieldFrac, fieldCommitted, fieldDelay:
		default:
			return req, errorf(http.StatusBadRequest, fmt.Sprintf("unknown field %q: the fields are %s", key, fieldList))
		}
	}
	model, herr := decodeModel(members[fieldModel])
	if herr != nil {
		return req, herr
	}
	req.model = model
	if req.patch.ActiveDecodeBlocks, herr = decodeFloat(members[fieldDecode], fieldDecode,
		"a number between 0 and 1 (a fraction of kv_total_blocks)", func(v float64) bool { return v >= 0 && v <= 1 }); herr != nil {
		return req, herr
	}
	if req.patch.ActivePrefillTokens, herr = decodeUint(members[fieldPrefill], fieldPrefill, "a whole number of tokens ≥ 0"); herr != nil {
		return req, herr
	}
	if req.patch.ActivePrefillTokensFrac, herr = decodeFloat(members[fieldFrac], fieldFrac,
		"a finite number ≥ 0 (a fraction of max_num_batched_tokens)", func(v float64) bool { return v >= 0 }); herr != nil {
		return req, herr
	}
	if req.patch.KVCommitted, herr = decodeFloat(members[fieldCommitted], fieldCommitted,
		fmt.Sprintf("a number between 0 and %d (a multiple of kv_total_blocks)", events.MaxKVCommittedThreshold),
		func(v float64) bool { return v >= 0 && v <= events.MaxKVCommittedThreshold }); herr != nil {
		return req, herr
	}
	if req.patch.QueueDelayMs, herr = decodeUint(members[fieldDelay], fieldDelay, "a whole number of milliseconds ≥ 0"); herr != nil {
		return req, herr
	}
	if err := req.patch.Validate(); err != nil { // the contract's own check, as a last guard
		return req, errorf(http.StatusBadRequest, err.Error())
	}
	return req, nil
}

// decodeModel checks the model member.
func decodeModel(raw json.RawMessage) (string, *httpError) {
	if isNull(raw) {
		return "", errorf(http.StatusBadRequest, `field "model" is required: the model name the engines report, e.g. `+exampleBody)
	}
	if raw[0] != '"' {
		return "", errorf(http.StatusUnprocessableEntity, fmt.Sprintf(`field "model" must be a string, not %s`, jsonType(raw)))
	}
	var model string
	if err := json.Unmarshal(raw, &model); err != nil {
		return "", errorf(http.StatusBadRequest, fmt.Sprintf(`field "model": %v`, err))
	}
	if herr := checkModel(model); herr != nil {
		return "", herr
	}
	return model, nil
}

// checkModel answers 400 for a name that cannot be a model name. A name
// over the limit is cut in the message: it may be a megabyte long.
func checkModel(model string) *httpError {
	if err := events.ValidateModel(model); err != nil {
		if len(model) > events.MaxModelLen {
			return errorf(http.StatusBadRequest, fmt.Sprintf("model %.64q… (%d bytes) is not a valid model name: it must be 1 to %d bytes of UTF-8",
				model, len(model), events.MaxModelLen))
		}
		return errorf(http.StatusBadRequest, fmt.Sprintf("model %q is not a valid model name: it must be 1 to %d bytes of UTF-8", model, events.MaxModelLen))
	}
	return nil
}

// decodeFloat decodes an optional float member: null or absent is nil.
func decodeFloat(raw json.RawMessage, field, want string, inRange func(float64) bool) (*float64, *httpError) {
	if isNull(raw) {
		return nil, nil
	}
	if jsonType(raw) != "a number" {
		return nil, errorf(http.StatusUnprocessableEntity, fmt.Sprintf("field %q must be %s or null, not %s", field, want, jsonType(raw)))
	}
	v, err := strconv.ParseFloat(string(raw), 64)
	if err != nil || math.IsInf(v, 0) || math.IsNaN(v) || !inRange(v) {
		return nil, errorf(http.StatusBadRequest, fmt.Sprintf("field %q is %s, out of range: it must be %s", field, raw, want))
	}
	return &v, nil
}

// decodeUint decodes an optional count (tokens, milliseconds; want says
// which): a non-negative integer (an integral number written with a fraction
// or exponent, like 1000.0 or 1e3, counts), null or absent is nil. A
// fraction is the wrong type (422); a negative number or one over 2^64-1 is
// out of range (400).
func decodeUint(raw json.RawMessage, field, want string) (*uint64, *httpError) {
	if isNull(raw) {
		return nil, nil
	}
	if jsonType(raw) != "a number" {
		return nil, errorf(http.StatusUnprocessableEntity, fmt.Sprintf("field %q must be %s or null, not %s", field, want, jsonType(raw)))
	}
	s := string(raw)
	if v, err := strconv.ParseUint(s, 10, 64); err == nil {
		return &v, nil
	}
	outOfRange := errorf(http.StatusBadRequest, fmt.Sprintf("field %q is %s, out of range: it must be %s, at most %d", field, s, want, uint64(math.MaxUint64)))
	f, err := strconv.ParseFloat(s, 64)
	switch {
	case err != nil: // too large for a float64, or digits too many for a uint64
		return nil, outOfRange
	case f != math.Trunc(f):
		return nil, errorf(http.StatusUnprocessableEntity, fmt.Sprintf("field %q is %s, not a whole number: it must be %s", field, s, want))
	case f < 0 || f >= math.MaxUint64: // float64(MaxUint64) is 2^64
		return nil, outOfRange
	}
	v := uint64(f)
	return &v, nil
}
