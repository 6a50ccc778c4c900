package httplimit

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// short are limits a test can wait out.
var short = Limits{BodyRead: 200 * time.Millisecond, Write: 200 * time.Millisecond}

// bound is how long a test waits for what the limits must end; far above
// them, it only turns a hang into a failure.
const bound = 20 * time.Second

// serve runs h behind Handler(h, short) on a real connection.
func serve(t *testing.T, h http.HandlerFunc) string {
	t.Helper()
	srv := httptest.NewUnstartedServer(Handler(h, short))
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// dial opens a raw connection to addr, closed when the test ends.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// wait fails the test when done is not closed within bound.
func wait(t *testing.T, done <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(bound):
		t.Fatalf("%s: still running after %v", what, bound)
		return nil
	}
}

// TestBodyThatNeverEnds: a chunked body that keeps trickling is cut at
// BodyRead; the handler's read fails and it returns.
func TestBodyThatNeverEnds(t *testing.T) {
	t.Parallel()
	done := make(chan error, 1)
	addr := serve(t, func(w http.ResponseWriter, r *http.Request) {
		_, err := io.Copy(io.Discard, r.Body)
		done <- err
		if err != nil {
			http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
		}
	})
	c := dial(t, addr)
	fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				if _, err := io.WriteString(c, "1\r\nx\r\n"); err != nil {
					return
				}
			}
		}
	}()
	err := wait(t, done, "reading a body that never ends")
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("body read ended with %v, want a timeout", err)
	}
}

// TestClientThatDoesNotRead: a client that stops reading is cut at Write:
// the handler's write fails and it returns.
func TestClientThatDoesNotRead(t *testing.T) {
	t.Parallel()
	done := make(chan error, 1)
	addr := serve(t, func(w http.ResponseWriter, r *http.Request) {
		chunk := []byte(strings.Repeat("x", 64<<10))
		for {
			if _, err := w.Write(chunk); err != nil {
				done <- err
				return
			}
		}
	})
	c := dial(t, addr)
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetReadBuffer(4 << 10)
	}
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if err := wait(t, done, "writing to a client that does not read"); err == nil {
		t.Error("the write did not fail")
	}
}

// TestLongStreamsLive: a response that keeps writing lives far beyond both
// limits, after a body read to its end (POST) or without one (GET), and its
// request's context is not cancelled by a read deadline.
func TestLongStreamsLive(t *testing.T) {
	t.Parallel()
	const events = 12 // 12 × 100 ms: six times each limit
	for _, method := range []string{"POST", "GET"} {
		t.Run(method, func(t *testing.T) {
			t.Parallel()
			addr := serve(t, func(w http.ResponseWriter, r *http.Request) {
				if _, err := io.Copy(io.Discard, r.Body); err != nil {
					http.Error(w, err.Error(), http.StatusBadRequest)
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				rc := http.NewResponseController(w)
				for i := range events {
					select {
					case <-r.Context().Done():
						fmt.Fprintf(w, "data: cancelled\n\n")
						return
					case <-time.After(100 * time.Millisecond):
					}
					fmt.Fprintf(w, "data: %d\n\n", i)
					if err := rc.Flush(); err != nil {
						return
					}
				}
				fmt.Fprintf(w, "data: [DONE]\n\n")
			})
			body := io.Reader(nil)
			if method == "POST" {
				body = strings.NewReader(`{"model":"m","stream":true}`)
			}
			req, err := http.NewRequestWithContext(t.Context(), method, "http://"+addr+"/", body)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var lines []string
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if l := sc.Text(); l != "" {
					lines = append(lines, l)
				}
			}
			if len(lines) != events+1 || lines[len(lines)-1] != "data: [DONE]" {
				t.Errorf("stream: %q (%v), want %d events and [DONE]", lines, sc.Err(), events)
			}
		})
	}
}

// TestHandlerOwnWriteDeadline: a handler that sets its own write deadline
// keeps it, and the flushers are reached through the wrapper.
func TestHandlerOwnWriteDeadline(t *testing.T) {
	t.Parallel()
	done := make(chan error, 1)
	addr := serve(t, func(w http.ResponseWriter, r *http.Request) {
		if _, ok := w.(http.Flusher); !ok {
			done <- errors.New("the writer is not an http.Flusher")
			return
		}
		rc := http.NewResponseController(w)
		// In the past: the next write that reaches the connection fails,
		// unless the wrapper moved the deadline.
		if err := rc.SetWriteDeadline(time.Now().Add(-time.Second)); err != nil {
			done <- err
			return
		}
		_, _ = w.Write([]byte("x"))
		done <- rc.Flush()
	})
	c := dial(t, addr)
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if err := wait(t, done, "a handler with its own deadline"); err == nil {
		t.Error("the flush succeeded: the wrapper replaced the handler's own deadline")
	}
}
