package board

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promtest"
)

// fakeSource serves a snapshot named "v<version>" (or an error) and counts
// its reads.
type fakeSource struct {
	mu      sync.Mutex
	version int
	err     error
	reads   int
	cost    time.Duration // how long a read takes
}

func (f *fakeSource) set(version int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.version = version
}

func (f *fakeSource) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

func (f *fakeSource) readCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reads
}

func (f *fakeSource) Snapshot(context.Context) (Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	time.Sleep(f.cost)
	f.reads++
	return Snapshot{Kind: KindMonitor, Name: fmt.Sprintf("v%d", f.version)}, f.err
}

// pipeWriter is a ResponseWriter whose every write waits until the test
// takes it from writes, or until the write deadline the handler set passes
// or the request's context ends (then it fails as a network write would).
type pipeWriter struct {
	ctx      context.Context
	header   http.Header
	status   int
	writes   chan string
	deadline time.Time // the handler's goroutine only
}

func newPipeWriter(ctx context.Context) *pipeWriter {
	return &pipeWriter{ctx: ctx, header: http.Header{}, writes: make(chan string)}
}

func (p *pipeWriter) Header() http.Header  { return p.header }
func (p *pipeWriter) WriteHeader(code int) { p.status = code }
func (p *pipeWriter) Flush()               {}

func (p *pipeWriter) SetWriteDeadline(t time.Time) error {
	p.deadline = t
	return nil
}

func (p *pipeWriter) Write(b []byte) (int, error) {
	var expired <-chan time.Time
	if !p.deadline.IsZero() {
		timer := time.NewTimer(time.Until(p.deadline))
		defer timer.Stop()
		expired = timer.C
	}
	select {
	case p.writes <- string(b):
		return len(b), nil
	case <-expired:
		return 0, os.ErrDeadlineExceeded
	case <-p.ctx.Done():
		return 0, net.ErrClosed
	}
}

// next takes the handler's next write.
func (p *pipeWriter) next(t *testing.T) string {
	t.Helper()
	select {
	case s := <-p.writes:
		return s
	case <-time.After(time.Minute): // fake time in a bubble
		t.Fatal("no write within a minute")
		return ""
	}
}

// none checks that the handler is not writing.
func (p *pipeWriter) none(t *testing.T) {
	t.Helper()
	synctest.Wait()
	select {
	case s := <-p.writes:
		t.Fatalf("unexpected write %q", s)
	default:
	}
}

// eventName returns the snapshot name an SSE snapshot event carries.
func eventName(t *testing.T, ev string) string {
	t.Helper()
	_, data, ok := strings.Cut(ev, "\ndata: ")
	if !strings.HasPrefix(ev, "id: ") || !strings.Contains(ev, "\nevent: snapshot\n") || !ok || !strings.HasSuffix(data, "\n\n") {
		t.Fatalf("not a snapshot event: %q", ev)
	}
	var s Snapshot
	if err := json.Unmarshal([]byte(strings.TrimSuffix(data, "\n\n")), &s); err != nil {
		t.Fatalf("event data: %v", err)
	}
	return s.Name
}

// stream is one client's request, served on a goroutine of its own.
type stream struct {
	w      *pipeWriter
	cancel context.CancelFunc
	done   chan struct{}
}

func openStream(t *testing.T, b *Board) *stream {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	s := &stream{w: newPipeWriter(ctx), cancel: cancel, done: make(chan struct{})}
	req := httptest.NewRequestWithContext(ctx, http.MethodGet, "/board/events", nil)
	go func() {
		defer close(s.done)
		b.ServeHTTP(s.w, req)
	}()
	if got := s.w.next(t); got != "retry: 2000\n\n" {
		t.Fatalf("first write %q, want the retry line", got)
	}
	if s.w.status != http.StatusOK || s.w.header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d, content type %q", s.w.status, s.w.header.Get("Content-Type"))
	}
	return s
}

// ended reports whether the stream's handler has returned.
func (s *stream) ended() bool {
	synctest.Wait()
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

func testBoard(t *testing.T, src Source, mutate func(*Config)) (*Board, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg := DefaultConfig()
	cfg.Source, cfg.Registerer = src, reg
	cfg.Interval = 100 * time.Millisecond
	cfg.Heartbeat = time.Hour
	cfg.WriteTimeout = time.Hour
	// No sampler: these tests count the publisher's reads of the source;
	// history_test.go turns it on.
	cfg.HistoryLen = 0
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b, reg
}

func counter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	v, ok := promtest.Value(t, reg, name, labels)
	if !ok {
		t.Fatalf("no series %s%v", name, labels)
	}
	return v
}

// TestEventsSlowClientGetsNewest: a client that stops reading while fifty
// versions go by holds at most the event it was being sent; when it reads
// again it gets the newest version next, not the fifty in between.
func TestEventsSlowClientGetsNewest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &fakeSource{}
		b, reg := testBoard(t, src, nil)
		s := openStream(t, b)
		if got := eventName(t, s.w.next(t)); got != "v0" {
			t.Fatalf("first snapshot %q, want v0", got)
		}
		// A new version between every two reads of the source; the client
		// reads nothing meanwhile.
		time.Sleep(b.cfg.Interval / 2)
		for v := 1; v <= 50; v++ {
			src.set(v)
			time.Sleep(b.cfg.Interval)
		}
		synctest.Wait()
		if n := counter(t, reg, "workermon_board_updates_total", nil); n != 51 {
			t.Fatalf("%v updates published, want 51", n)
		}
		if got := eventName(t, s.w.next(t)); got != "v1" {
			t.Fatalf("event in flight %q, want v1", got)
		}
		if got := eventName(t, s.w.next(t)); got != "v50" {
			t.Fatalf("next event %q, want the newest, v50", got)
		}
		s.w.none(t)
		s.cancel()
		if !s.ended() {
			t.Fatal("stream did not end with its request")
		}
	})
}

// TestEventsSlowClientDropped: a client that does not take an event within
// the write timeout is dropped and counted.
func TestEventsSlowClientDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &fakeSource{}
		b, reg := testBoard(t, src, func(c *Config) { c.WriteTimeout = time.Second })
		s := openStream(t, b)
		// The first snapshot is never taken.
		time.Sleep(b.cfg.WriteTimeout + b.cfg.Interval)
		if !s.ended() {
			t.Fatal("a client that takes nothing was not dropped after the write timeout")
		}
		if n := b.Clients(); n != 0 {
			t.Fatalf("%d clients after the drop", n)
		}
		if n := counter(t, reg, "workermon_board_streams_ended_total", map[string]string{"reason": "slow"}); n != 1 {
			t.Fatalf("slow drops %v, want 1", n)
		}
	})
}

// TestEventsClientLimit: beyond MaxClients a stream is refused with 503
// and counted; once one leaves, the next is served.
func TestEventsClientLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b, reg := testBoard(t, &fakeSource{}, func(c *Config) { c.MaxClients = 2 })
		first, _ := openStream(t, b), openStream(t, b)
		rec := httptest.NewRecorder()
		b.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, "/board/events", nil))
		if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") == "" ||
			!strings.Contains(rec.Body.String(), `"error"`) {
			t.Fatalf("third stream: %d %q %q, want 503 with Retry-After and a JSON error", rec.Code,
				rec.Header().Get("Retry-After"), rec.Body.String())
		}
		if n := counter(t, reg, "workermon_board_streams_ended_total", map[string]string{"reason": "limit"}); n != 1 {
			t.Fatalf("refusals %v, want 1", n)
		}
		if n := counter(t, reg, "workermon_board_clients", nil); n != 2 {
			t.Fatalf("clients gauge %v, want 2", n)
		}
		first.cancel()
		if !first.ended() {
			t.Fatal("first stream did not end")
		}
		openStream(t, b) // admitted again
	})
}

// TestEventsEnd: a stream ends when its request's context ends and when
// the board closes (a stream blocked writing to a slow client ends within
// the write timeout); a closed board refuses new streams and its publisher
// is gone (the bubble would report a leaked goroutine).
func TestEventsEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b, reg := testBoard(t, &fakeSource{}, nil)
		a, c := openStream(t, b), openStream(t, b)
		eventName(t, a.w.next(t))
		eventName(t, c.w.next(t))
		a.cancel()
		if !a.ended() {
			t.Fatal("stream did not end when its request's context ended")
		}
		if c.ended() {
			t.Fatal("the other stream ended too")
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		if !c.ended() {
			t.Fatal("stream did not end when the board closed")
		}
		for reason, want := range map[string]float64{"gone": 1, "closed": 1} {
			if n := counter(t, reg, "workermon_board_streams_ended_total", map[string]string{"reason": reason}); n != want {
				t.Errorf("ended %s: %v, want %v", reason, n, want)
			}
		}
		rec := httptest.NewRecorder()
		b.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, "/board/events", nil))
		if rec.Code != http.StatusServiceUnavailable {
			t.Fatalf("stream after Close: %d, want 503", rec.Code)
		}
		if err := b.Close(); err != nil { // idempotent
			t.Fatal(err)
		}
	})
}

// TestEventsHeartbeatAndNoChange: an unchanged source sends nothing (it is
// still read every interval); an idle stream gets a comment line every
// heartbeat.
func TestEventsHeartbeatAndNoChange(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &fakeSource{}
		b, _ := testBoard(t, src, func(c *Config) { c.Heartbeat = 5 * time.Second })
		s := openStream(t, b)
		eventName(t, s.w.next(t))
		time.Sleep(b.cfg.Heartbeat - time.Millisecond)
		s.w.none(t)
		if n := src.readCount(); n < 40 {
			t.Fatalf("source read %d times in %v, want one read per %v", n, b.cfg.Heartbeat, b.cfg.Interval)
		}
		time.Sleep(time.Millisecond)
		if got := s.w.next(t); got != ": ping\n\n" {
			t.Fatalf("heartbeat %q", got)
		}
		src.set(7)
		if got := eventName(t, s.w.next(t)); got != "v7" {
			t.Fatalf("after a change: %q, want v7", got)
		}
	})
}

// TestNoReadsWithoutClients: the source is read only while a client
// watches, and a client that comes later is not shown a snapshot from
// before.
func TestNoReadsWithoutClients(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &fakeSource{}
		b, _ := testBoard(t, src, nil)
		time.Sleep(10 * b.cfg.Interval)
		if n := src.readCount(); n != 0 {
			t.Fatalf("source read %d times with no client", n)
		}
		s := openStream(t, b)
		if got := eventName(t, s.w.next(t)); got != "v0" {
			t.Fatalf("first snapshot %q", got)
		}
		s.cancel()
		if !s.ended() {
			t.Fatal("stream did not end")
		}
		src.set(3)
		time.Sleep(10 * b.cfg.Interval)
		reads := src.readCount()
		time.Sleep(10 * b.cfg.Interval)
		if n := src.readCount(); n != reads {
			t.Fatalf("source read %d more times with no client", n-reads)
		}
		s = openStream(t, b)
		if got := eventName(t, s.w.next(t)); got != "v3" {
			t.Fatalf("snapshot for a new client %q, want the current v3", got)
		}
	})
}

// TestSlowSourceReadLessOften: a source whose reads take long is read
// less often, so that the board keeps it busy a tenth of the time at most.
func TestSlowSourceReadLessOften(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &fakeSource{cost: 50 * time.Millisecond}
		b, _ := testBoard(t, src, nil) // Interval 100ms
		openStream(t, b)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		// One read per 50ms × readShare (0.5s) plus the read's own time.
		if n := src.readCount(); n < 15 || n > 20 {
			t.Fatalf("%d reads of 50ms in 10s, want about 18 (every 550ms)", n)
		}
	})
}

// TestEventsSourceError: a failing source is shown as an error snapshot
// and counted; its recovery replaces it.
func TestEventsSourceError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &fakeSource{}
		src.fail(errors.New("monitor stopped"))
		b, reg := testBoard(t, src, nil)
		s := openStream(t, b)
		ev := s.w.next(t)
		if !strings.Contains(ev, `"error":"monitor stopped"`) {
			t.Fatalf("event %q does not carry the error", ev)
		}
		if n := counter(t, reg, "workermon_board_read_errors_total", nil); n < 1 {
			t.Fatalf("read errors %v", n)
		}
		src.fail(nil)
		if ev := s.w.next(t); strings.Contains(ev, `"error"`) || eventName(t, ev) != "v0" {
			t.Fatalf("after recovery: %q", ev)
		}
	})
}

// TestEventsOverHTTP reads the stream through a real HTTP server and
// client.
func TestEventsOverHTTP(t *testing.T) {
	t.Parallel()
	src := &fakeSource{}
	b, _ := testBoard(t, src, func(c *Config) { c.Interval = 20 * time.Millisecond })
	srv := httptest.NewServer(b)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/board/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	rd := bufio.NewReader(resp.Body)
	want := []string{"v0", "v1", "v2"}
	for i := 0; i < len(want); {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatalf("reading the stream: %v", err)
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var s Snapshot
		if err := json.Unmarshal([]byte(data), &s); err != nil {
			t.Fatal(err)
		}
		if s.Name != want[i] {
			t.Fatalf("snapshot %d: %q, want %q", i, s.Name, want[i])
		}
		i++
		src.set(i)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   []string
	}{
		{"default with a source", func(*Config) {}, nil},
		{"no source", func(c *Config) { c.Source = nil }, []string{"source is nil"}},
		{"zeroes", func(c *Config) { c.Interval, c.Heartbeat, c.WriteTimeout, c.ReadTimeout, c.MaxClients = 0, 0, -1, 0, 0 },
			[]string{"interval 0s", "heartbeat 0s", "write timeout -1ns", "read timeout 0s", "max clients 0"}},
		{"no history", func(c *Config) { c.HistoryLen, c.HistoryInterval, c.HistoryModels = 0, 0, 0 }, nil},
		{"history zeroes", func(c *Config) { c.HistoryInterval, c.HistoryModels = 0, 0 },
			[]string{"history interval 0s", "history models 0"}},
		{"history too long", func(c *Config) { c.HistoryLen = 86_401 }, []string{"history len 86401"}},
		{"history negative", func(c *Config) { c.HistoryLen = -1 }, []string{"history len -1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := DefaultConfig()
			c.Source = &fakeSource{}
			tc.mutate(&c)
			err := c.Validate()
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("error %v does not match ErrInvalidConfig", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if _, nerr := New(c); nerr == nil {
				t.Error("New accepted the config")
			}
		})
	}
}

// TestSnapshotEndpointReadsOncePerInterval: GET /board/snapshot reads the
// source (the monitor's loop) at most once an Interval, however many ask
// (it read it for every request: 200 requests, 200 reads), and reads it
// again once the Interval has passed.
func TestSnapshotEndpointReadsOncePerInterval(t *testing.T) {
	t.Parallel()
	get := func(b *Board) string {
		t.Helper()
		rec := httptest.NewRecorder()
		b.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/board/snapshot", nil))
		if rec.Code != http.StatusOK {
			t.Fatalf("status %d", rec.Code)
		}
		return rec.Body.String()
	}
	newBoard := func(src *fakeSource, interval time.Duration) *Board {
		cfg := DefaultConfig()
		cfg.Source, cfg.Interval = src, interval
		cfg.HistoryLen = 0 // no sampler: it would read the source too
		b, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close() })
		return b
	}
	src := &fakeSource{}
	b := newBoard(src, time.Hour) // however slow the machine, all within one interval
	for range 200 {
		get(b)
	}
	if n := src.readCount(); n != 1 {
		t.Errorf("200 requests within one interval read the source %d times, want once", n)
	}
	src2 := &fakeSource{}
	b2 := newBoard(src2, 20*time.Millisecond)
	get(b2)
	src2.set(1)
	time.Sleep(20 * time.Millisecond) // the interval has passed whatever the load
	if body := get(b2); !strings.Contains(body, `"name":"v1"`) {
		t.Errorf("after the interval: %s, want the source read again (v1)", body)
	}
}
