package admission

import (
	"bytes"
	"encoding/json"
)

// The error bodies of routers (contract §7, §7c): Dynamo's documented
// fields at the top level, {"message","type","code"}, and the same again as
// OpenAI's "error" object, {"message","type","param","code"}, which is all
// that the official OpenAI SDKs read. code is the HTTP status.

// openAIError is OpenAI's error object.
type openAIError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"` // always null: no request parameter is blamed
	Code    int     `json:"code"`
}

// errorBody is a router's error body.
type errorBody struct {
	Message string      `json:"message"`
	Type    string      `json:"type"`
	Code    int         `json:"code"`
	Error   openAIError `json:"error"`
}

// errorEvent is the data of an error event inside an SSE stream.
type errorEvent struct {
	Error openAIError `json:"error"`
}

// ErrorBody returns the body of a router error with the given status, type
// and message:
// {"message":M,"type":T,"code":S,"error":{"message":M,"type":T,"param":null,"code":S}}.
func ErrorBody(status int, typ, message string) []byte {
	return marshal(errorBody{Message: message, Type: typ, Code: status,
		Error: openAIError{Message: message, Type: typ, Code: status}})
}

// ErrorEvent returns the data of the SSE event that reports an error inside
// a stream: {"error":{"message":M,"type":T,"param":null,"code":S}}; an
// OpenAI SDK's stream returns it as an error.
func ErrorEvent(status int, typ, message string) []byte {
	return marshal(errorEvent{Error: openAIError{Message: message, Type: typ, Code: status}})
}

// marshal encodes v without escaping <, > and & (messages stay readable)
// and without the encoder's trailing newline.
func marshal(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic(err) // strings, ints and a nil pointer always encode
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}
