package board

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/internal/retry"
)

// Reasons a stream ends, the label of workermon_board_streams_ended_total.
const (
	endGone   = "gone"   // the client went away (its request's context ended)
	endSlow   = "slow"   // the client did not take an event within the write timeout, or the write failed
	endLimit  = "limit"  // refused: MaxClients streams were open
	endClosed = "closed" // the board was closed
)

// frame is one snapshot as sent: its version and its SSE event.
type frame struct {
	version uint64
	event   []byte // "id: …\nevent: snapshot\ndata: {…}\n\n"
	data    []byte // the JSON alone, for GET /board/snapshot
}

// client is one open stream. notify has room for one wake-up: a client
// behind by several versions is woken once and sends only the newest.
type client struct {
	notify chan struct{}
}

// Board serves the page and its event stream; see the package comment.
// Build it with New, stop it with Close.
type Board struct {
	cfg     Config
	log     *slog.Logger
	mux     *http.ServeMux
	metrics *metrics
	errLog  *retry.ErrLog

	latest atomic.Pointer[frame]
	wake   chan struct{} // capacity 1: a client joined, read the source now

	// The snapshot GET /board/snapshot answers: read from the source at
	// most once an Interval, the requests meanwhile sharing it.
	snapMu   sync.Mutex
	snapData []byte
	snapAt   time.Time

	mu      sync.Mutex
	clients map[*client]struct{}
	closed  bool

	// The history the sampler keeps; nil when Config.HistoryLen is 0.
	histMu sync.Mutex
	hist   *historyRing

	cancel    context.CancelFunc
	wg        sync.WaitGroup // the publisher and the sampler
	stopping  chan struct{}  // closed by Close: streams end
	closeOnce sync.Once
}

// New checks cfg and starts the board's publishing goroutine and, unless
// cfg.HistoryLen is 0, its sampler.
func New(cfg Config) (*Board, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	b := &Board{
		cfg: cfg, log: log, mux: http.NewServeMux(), metrics: m,
		errLog:   retry.NewErrLog(log, slog.LevelWarn, "board: read the source"),
		wake:     make(chan struct{}, 1),
		clients:  map[*client]struct{}{},
		stopping: make(chan struct{}),
	}
	b.routes()
	ctx, cancel := context.WithCancel(context.Background())
	b.cancel = cancel
	b.wg.Go(func() { b.publish(ctx) })
	if cfg.HistoryLen > 0 {
		b.hist = newHistoryRing(cfg.HistoryLen)
		b.wg.Go(func() { b.sample(ctx) })
	}
	return b, nil
}

// Close ends every open stream, stops the publishing goroutine and the
// sampler and waits for them (at most one source read each, bounded by
// Config.ReadTimeout). Streams asked for later get 503. Close is idempotent
// and returns nil.
func (b *Board) Close() error {
	b.closeOnce.Do(func() {
		b.mu.Lock()
		b.closed = true
		b.mu.Unlock()
		close(b.stopping)
		b.cancel()
	})
	b.wg.Wait()
	return nil
}

// Clients returns the number of open streams.
func (b *Board) Clients() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.clients)
}

// join registers a new stream, unless MaxClients are open or the board is
// closed.
func (b *Board) join() (*client, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, ErrClosed
	}
	if len(b.clients) >= b.cfg.MaxClients {
		return nil, fmt.Errorf("board: %d streams are open, the most this board serves", len(b.clients))
	}
	c := &client{notify: make(chan struct{}, 1)}
	b.clients[c] = struct{}{}
	b.metrics.clients.Set(float64(len(b.clients)))
	return c, nil
}

func (b *Board) leave(c *client, why string) {
	b.mu.Lock()
	delete(b.clients, c)
	b.metrics.clients.Set(float64(len(b.clients)))
	b.mu.Unlock()
	b.metrics.ended.WithLabelValues(why).Inc()
}

// readShare bounds the share of time the board keeps its source busy: after
// a read that took d, the next comes no sooner than readShare × d (the
// monitor's loop answers the reads between reports).
const readShare = 10

// publish is the board's goroutine: while a client watches, it reads the
// source every Interval (at once when a client joins, unless it read less
// than an Interval ago; less often when reads are slow, see readShare)
// and, when the snapshot changed, makes it the latest frame and wakes
// every client. With no client it reads nothing and waits for one.
func (b *Board) publish(ctx context.Context) {
	timer := time.NewTimer(b.cfg.Interval)
	defer timer.Stop()
	armed := true
	var (
		last    []byte    // the JSON of the latest frame
		lastAt  time.Time // when the source was last read
		gap     = b.cfg.Interval
		version uint64
	)
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
			armed = false
		case <-b.wake:
			if wait := gap - time.Since(lastAt); wait > 0 {
				// Read a moment ago: the timer brings the next read.
				if !armed {
					timer.Reset(wait)
					armed = true
				}
				continue
			}
		}
		if b.Clients() == 0 {
			// Nobody watches: read nothing until a client joins (its wake).
			// It must not be shown what was true when the last one left.
			if last != nil {
				last = nil
				b.latest.Store(nil)
			}
			continue
		}
		lastAt = time.Now()
		data, err := b.read(ctx)
		gap = max(b.cfg.Interval, readShare*time.Since(lastAt))
		timer.Reset(gap)
		armed = true
		if data != nil && err != nil {
			b.metrics.readErrors.Inc()
			b.errLog.Fail(err)
		} else if data != nil {
			b.errLog.OK()
		}
		if data == nil || bytes.Equal(data, last) {
			continue
		}
		last = data
		version++
		b.latest.Store(&frame{version: version, event: sseEvent(version, data), data: data})
		b.metrics.updates.Inc()
		b.notifyAll()
	}
}

// read reads the source once and returns the snapshot's JSON, or the JSON
// of an error snapshot and the error when the source failed; nil data when
// ctx ended (the board is closing, or the request went away).
func (b *Board) read(ctx context.Context) ([]byte, error) {
	rctx, cancel := context.WithTimeout(ctx, b.cfg.ReadTimeout)
	snap, err := b.cfg.Source.Snapshot(rctx)
	cancel()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if err != nil {
		snap = Snapshot{Kind: snap.Kind, Name: snap.Name, Error: err.Error()}
	}
	if snap.Models == nil {
		snap.Models = []Model{}
	}
	data, merr := json.Marshal(snap)
	if merr != nil {
		// Only a NaN or an infinity in the thresholds can do this; they are
		// refused where thresholds are set.
		err = fmt.Errorf("board: encode snapshot: %w", merr)
		data, _ = json.Marshal(Snapshot{Kind: snap.Kind, Name: snap.Name, Error: err.Error(), Models: []Model{}})
	}
	return data, err
}

// notifyAll wakes every client that is not already due to wake.
func (b *Board) notifyAll() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for c := range b.clients {
		select {
		case c.notify <- struct{}{}:
		default:
		}
	}
}

// sseEvent encodes a snapshot event. JSON holds no raw newline, so the data
// is one line.
func sseEvent(version uint64, data []byte) []byte {
	var buf bytes.Buffer
	buf.Grow(len(data) + 48)
	buf.WriteString("id: ")
	buf.WriteString(strconv.FormatUint(version, 10))
	buf.WriteString("\nevent: snapshot\ndata: ")
	buf.Write(data)
	buf.WriteString("\n\n")
	return buf.Bytes()
}

// heartbeat is the comment line an idle stream gets.
var heartbeat = []byte(": ping\n\n")

// serveEvents serves one client's stream until its request ends, it is too
// slow, or the board closes.
func (b *Board) serveEvents(w http.ResponseWriter, r *http.Request) {
	c, err := b.join()
	if err != nil {
		b.metrics.ended.WithLabelValues(endLimit).Inc()
		w.Header().Set("Retry-After", "5")
		writeError(w, http.StatusServiceUnavailable, err.Error())
		return
	}
	why := endGone
	defer func() { b.leave(c, why) }()
	// Read the source now, unless it was read a moment ago.
	select {
	case b.wake <- struct{}{}:
	default:
	}

	rc := http.NewResponseController(w)
	h := w.Header()
	securityHeaders(h)
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
	w.WriteHeader(http.StatusOK)
	// send writes p and flushes it, within the write timeout.
	send := func(p []byte) bool {
		// A writer that cannot take a deadline (ErrNotSupported) gets none.
		_ = rc.SetWriteDeadline(time.Now().Add(b.cfg.WriteTimeout))
		if _, err := w.Write(p); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	if !send([]byte("retry: " + strconv.FormatInt(retryDelay.Milliseconds(), 10) + "\n\n")) {
		why = endSlow
		return
	}
	hb := time.NewTicker(b.cfg.Heartbeat)
	defer hb.Stop()
	var sent uint64
	for {
		if f := b.latest.Load(); f != nil && f.version != sent {
			if !send(f.event) {
				why = endSlow
				return
			}
			sent = f.version
			hb.Reset(b.cfg.Heartbeat)
		}
		select {
		case <-r.Context().Done():
			return
		case <-b.stopping:
			why = endClosed
			return
		case <-c.notify:
		case <-hb.C:
			if !send(heartbeat) {
				why = endSlow
				return
			}
		}
	}
}

// serveSnapshot answers the current snapshot as JSON: read from the source
// now, or less than an Interval ago (the source is the monitor's loop: a
// script polling this endpoint must not read it for every request).
func (b *Board) serveSnapshot(w http.ResponseWriter, r *http.Request) {
	select {
	case <-b.stopping:
		writeError(w, http.StatusServiceUnavailable, ErrClosed.Error())
		return
	default:
	}
	data, err := b.snapshot(r.Context())
	if data == nil {
		writeError(w, http.StatusServiceUnavailable, "board: "+err.Error())
		return
	}
	writeJSON(w, data)
}

// snapshot returns the snapshot's JSON for GET /board/snapshot: the one
// read less than an Interval ago, else one read now (read's results).
func (b *Board) snapshot(ctx context.Context) ([]byte, error) {
	b.snapMu.Lock()
	defer b.snapMu.Unlock()
	if b.snapData != nil && time.Since(b.snapAt) < b.cfg.Interval {
		return b.snapData, nil
	}
	data, err := b.read(ctx)
	if data != nil && err == nil {
		b.snapData, b.snapAt = data, time.Now()
	}
	return data, err
}

// errorJSON is {"error": msg}.
func errorJSON(msg string) []byte {
	data, err := json.Marshal(map[string]string{"error": msg})
	if err != nil {
		return []byte(`{"error":"internal error"}`)
	}
	return data
}

// metrics are the board's.
type metrics struct {
	clients    prometheus.Gauge
	ended      *prometheus.CounterVec
	updates    prometheus.Counter
	readErrors prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		clients: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_board_clients",
			Help: "Open event streams of the web board.",
		}),
		ended: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_board_streams_ended_total",
			Help: "Event streams of the web board that ended or were refused, by reason: gone (the client left), slow (dropped: it did not take an event within the write timeout), limit (refused: too many streams), closed (shutdown).",
		}, []string{"reason"}),
		updates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_board_updates_total",
			Help: "Snapshots of the web board that changed and were pushed to its streams.",
		}),
		readErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_board_read_errors_total",
			Help: "Reads of the board's source (the monitor's state or the router's lists) that failed.",
		}),
	}
	for _, r := range []string{endGone, endSlow, endLimit, endClosed} {
		m.ended.WithLabelValues(r)
	}
	if err := promreg.All(reg, m.clients, m.ended, m.updates, m.readErrors); err != nil {
		return nil, fmt.Errorf("board: %w", err)
	}
	return m, nil
}
