// Package syncbuf gives tests an output buffer that one goroutine (a
// logger, a command, a child process) writes while the test reads it.
package syncbuf

import (
	"bytes"
	"strings"
	"sync"
)

// Buffer is a bytes.Buffer safe for concurrent writers and readers. The
// zero value is ready to use.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Lines returns the complete lines written so far, without their newlines.
func (s *Buffer) Lines() []string {
	str := s.String()
	if i := strings.LastIndexByte(str, '\n'); i >= 0 {
		return strings.Split(str[:i], "\n")
	}
	return nil
}

// Tail returns the last n bytes written, marked with a leading "…" when
// cut.
func (s *Buffer) Tail(n int) string {
	str := s.String()
	if len(str) > n {
		str = "…" + str[len(str)-n:]
	}
	return str
}
