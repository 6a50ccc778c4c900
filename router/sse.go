package router

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// Server-sent events (the WHATWG event-stream format) as OpenAI-compatible
// engines stream them: lines ending in LF or CRLF, events ending with a blank
// line, the payload in "data:" fields (one optional space after the colon;
// several data lines join with LF), comments starting with ':'. A bare CR as
// line end is not supported.

// errEventTooLarge: an event grew beyond maxEventBytes.
var errEventTooLarge = fmt.Errorf("router: server-sent event larger than %d bytes", maxEventBytes)

// sseReader splits an event stream into raw events.
type sseReader struct {
	br *bufio.Reader
	ev []byte
}

func newSSEReader(r io.Reader) *sseReader {
	return &sseReader{br: bufio.NewReaderSize(r, 16<<10)}
}

// next returns the raw bytes of the next event, up to and including the
// blank line that ends it; they are valid until the next call. It returns as
// soon as the event's last line has arrived. At the end of the stream it
// returns io.EOF with what arrived of an unfinished event (maybe nothing); on
// a read error, that error.
func (s *sseReader) next() ([]byte, error) {
	s.ev = s.ev[:0]
	lineStart := 0
	for {
		part, err := s.br.ReadSlice('\n')
		s.ev = append(s.ev, part...)
		if len(s.ev) > maxEventBytes {
			return nil, errEventTooLarge
		}
		switch {
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF):
			return s.ev, io.EOF
		case err != nil:
			return nil, err
		}
		if line := s.ev[lineStart:]; len(line) == 1 || len(line) == 2 && line[0] == '\r' {
			return s.ev, nil
		}
		lineStart = len(s.ev)
	}
}

var (
	sseDataField = []byte("data")
	sseDone      = []byte("[DONE]")
)

// sseData appends the event's data to dst; ok is false when the event has no
// data field (a comment, or only other fields).
func sseData(ev, dst []byte) (data []byte, ok bool) {
	for len(ev) > 0 {
		var line []byte
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			line, ev = ev, nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		v, isData := sseField(line)
		if !isData {
			continue
		}
		if ok {
			dst = append(dst, '\n')
		}
		dst = append(dst, v...)
		ok = true
	}
	return dst, ok
}

// sseField returns the value of a data line; isData is false for any other
// line.
func sseField(line []byte) (v []byte, isData bool) {
	rest, found := bytes.CutPrefix(line, sseDataField)
	if !found {
		return nil, false
	}
	if len(rest) == 0 {
		return nil, true
	}
	if rest[0] != ':' {
		return nil, false
	}
	rest = rest[1:]
	if len(rest) > 0 && rest[0] == ' ' {
		rest = rest[1:]
	}
	return rest, true
}

// sseReplaceData returns ev with its data replaced by data: the other lines
// are kept, the first data line becomes "data: <data>", the other data lines
// go.
func sseReplaceData(ev, data []byte) []byte {
	out := make([]byte, 0, len(ev)+len(data))
	replaced := false
	for len(ev) > 0 {
		var line []byte
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i+1], ev[i+1:]
		} else {
			line, ev = ev, nil
		}
		if _, isData := sseField(bytes.TrimRight(line, "\r\n")); !isData {
			out = append(out, line...)
			continue
		}
		if !replaced {
			replaced = true
			out = append(out, "data: "...)
			out = append(out, data...)
			out = append(out, '\n')
		}
	}
	return out
}

// sseIsDone reports whether data is the end marker [DONE].
func sseIsDone(data []byte) bool { return bytes.Equal(bytes.TrimSpace(data), sseDone) }

// sseTerminate completes an event cut before its blank line.
func sseTerminate(ev []byte) []byte {
	switch {
	case bytes.HasSuffix(ev, []byte("\n\n")), bytes.HasSuffix(ev, []byte("\r\n\r\n")):
		return ev
	case bytes.HasSuffix(ev, []byte("\n")):
		return append(ev, '\n')
	}
	return append(ev, "\n\n"...)
}
