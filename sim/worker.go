package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/httplimit"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/publisher"
)

// readHeaderTimeout bounds the reading of a request's headers.
const readHeaderTimeout = 10 * time.Second

// idleTimeout is how long an idle client connection is kept (a router's
// pool keeps its own for 90 s): without it one was kept for ever.
const idleTimeout = 2 * time.Minute

// detachTimeout bounds closing a publisher whose connection is already
// closed; nothing goes out, so it returns at once in practice.
const detachTimeout = 2 * time.Second

// cancelBuffer is the room of the cancellation channel, so that handlers
// rarely wait for the engine loop.
const cancelBuffer = 64

// Worker is one simulated engine instance. Its methods are safe for
// concurrent use.
type Worker struct {
	cfg      WorkerConfig
	log      *slog.Logger
	ln       net.Listener
	srv      *http.Server
	endpoint string
	maxSeq   int // longest prompt+max_tokens accepted, in tokens
	created  int64

	blockSize int             // tokens per KV block, the same on every rank
	metrics   *latencyMetrics // vLLM's latency histograms, observed by the engine loop

	// Requests travel to the engine loop, which owns eng.
	eng     *engine
	submit  chan *request
	cancels chan *request
	stopped chan struct{} // closed to stop the engine loop
	wg      sync.WaitGroup

	stats    atomic.Pointer[engineStats]
	rejected atomic.Uint64
	migrated atomic.Uint64 // streams cut for the rescheduler
	ids      atomic.Uint64
	state    atomic.Int32
	bootID   atomic.Uint64

	// Handlers in progress, waited for on the way out.
	hmu      sync.Mutex
	down     bool
	handlers sync.WaitGroup

	// The streams a migrate request may cut, oldest first; closing one's
	// channel cuts it.
	cutMu     sync.Mutex
	cuttables []cuttable

	// life serializes Mute, Unmute, Kill and Close.
	life     sync.Mutex
	closeErr error

	// mu guards the publisher and its connection, swapped by Mute and
	// Unmute while the engine loop reports through them.
	mu    sync.Mutex
	nc    *nats.Conn
	pub   *publisher.Publisher
	quiet *atomic.Bool     // silences pub's logger once it is being torn down
	loads []publisher.Load // last load of each rank, for a new publisher
}

// NewWorker starts a Worker: it listens on cfg.Addr, connects to NATS (ctx
// bounds the wait for the first connection), starts the publisher (which
// registers the endpoint) and reports every rank idle at once. logger may be
// nil.
func NewWorker(ctx context.Context, cfg WorkerConfig, logger *slog.Logger) (*Worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	logger = discardLogger(logger).With("model", cfg.Model, "worker_id", cfg.WorkerID)
	cfgs, err := cfg.Engine.rankConfigs(cfg.Ranks)
	if err != nil {
		return nil, err
	}
	w := &Worker{
		cfg:       cfg,
		log:       logger,
		created:   time.Now().Unix(),
		blockSize: cfgs[0].BlockSize,
		metrics:   newLatencyMetrics(cfg.Model, cfg.DPStart, len(cfgs)),
		submit:    make(chan *request),
		cancels:   make(chan *request, cancelBuffer),
		stopped:   make(chan struct{}),
		loads:     make([]publisher.Load, cfg.Ranks),
	}
	if w.eng, err = newEngine(cfgs, w.metrics); err != nil {
		return nil, fmt.Errorf("sim: start engine: %w: %w", ErrInvalidConfig, err)
	}
	w.maxSeq = w.eng.maxSequence()
	for i, c := range cfgs {
		w.loads[i] = publisher.Load{
			ActiveDecodeBlocks:  events.Some(0),
			KVTotalBlocks:       events.Some(uint64(c.KVBlocks)),
			ActivePrefillTokens: events.Some(0),
			MaxNumBatchedTokens: events.Some(uint64(c.MaxBatchedTokens)),
			WaitingRequests:     events.Some(0),
			RunningRequests:     events.Some(0),
			Preemptions:         events.Some(0),
			PrefilledTokens:     events.Some(0),
			KVCommittedBlocks:   events.Some(0),
		}
	}

	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("sim: listen on %s: %w", cfg.Addr, err)
	}
	w.ln = ln
	w.endpoint = cfg.Endpoint
	if w.endpoint == "" {
		w.endpoint = endpointOf(ln.Addr())
	}
	if err := w.attach(ctx); err != nil {
		_ = ln.Close()
		return nil, err
	}
	w.state.Store(int32(StateRunning))
	w.stats.Store(w.snapshot())

	w.srv = &http.Server{
		// A body that never ends and a client that stops reading are cut;
		// a stream lives as long as it writes (httplimit).
		Handler:           httplimit.Handler(w.routes(), httplimit.DefaultLimits()),
		ReadHeaderTimeout: readHeaderTimeout,
		IdleTimeout:       idleTimeout,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelDebug),
	}
	w.wg.Add(2)
	go w.run()
	go func() {
		defer w.wg.Done()
		if err := w.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("sim: serve HTTP", "err", err)
		}
	}()
	logger.Info("sim: worker started", "endpoint", w.endpoint, "ranks", cfg.Ranks)
	return w, nil
}

// endpointOf returns the base URL of a listener, with 127.0.0.1 for an
// unspecified host.
func endpointOf(a net.Addr) string {
	host, port := "127.0.0.1", "0"
	if tcp, ok := a.(*net.TCPAddr); ok {
		port = strconv.Itoa(tcp.Port)
		if !tcp.IP.IsUnspecified() {
			host = tcp.IP.String()
		}
	}
	return "http://" + net.JoinHostPort(host, port)
}

// ID returns the worker id.
func (w *Worker) ID() uint64 { return w.cfg.WorkerID }

// Model returns the model served.
func (w *Worker) Model() string { return w.cfg.Model }

// Endpoint returns the base URL registered for the routers, without /v1.
func (w *Worker) Endpoint() string { return w.endpoint }

// Addr returns the address the HTTP server listens on.
func (w *Worker) Addr() net.Addr { return w.ln.Addr() }

// State returns where the worker is in its life.
func (w *Worker) State() State { return State(w.state.Load()) }

// BootID returns the boot id of the current publisher, 0 while muted and
// after Kill or Close.
func (w *Worker) BootID() uint64 { return w.bootID.Load() }

// Mute closes the worker's NATS connection without a goodbye: its reports
// stop (the monitor sees it go stale, then gone) while HTTP keeps serving.
// The registry entry is not deleted and expires with the bucket's TTL. A
// worker not running is left as it is.
func (w *Worker) Mute() {
	w.life.Lock()
	defer w.life.Unlock()
	if w.State() != StateRunning {
		return
	}
	w.detach()
	w.state.Store(int32(StateMuted))
	w.log.Info("sim: worker muted")
}

// Unmute connects a muted worker to NATS again with a new publisher: a new
// boot id, every rank reported at once, the registry entry written again.
// It does nothing to a running worker and fails with ErrClosed after Kill or
// Close. ctx bounds the wait for the connection.
func (w *Worker) Unmute(ctx context.Context) error {
	w.life.Lock()
	defer w.life.Unlock()
	switch w.State() {
	case StateRunning:
		return nil
	case StateKilled, StateClosed:
		return fmt.Errorf("sim: unmute worker %d: %w", w.cfg.WorkerID, ErrClosed)
	}
	if err := w.attach(ctx); err != nil {
		return err
	}
	w.state.Store(int32(StateRunning))
	w.log.Info("sim: worker unmuted", "boot_id", w.bootID.Load())
	return nil
}

// Kill crashes the worker: the HTTP server and its connections close at
// once, the NATS connection closes without a goodbye (the registry entry is
// left to expire) and the engine stops, dropping its requests. Every
// goroutine of the worker has stopped when Kill returns. Kill after Kill or
// Close does nothing.
func (w *Worker) Kill() {
	w.life.Lock()
	defer w.life.Unlock()
	if s := w.State(); s == StateKilled || s == StateClosed {
		return
	}
	_ = w.srv.Close()
	w.detach()
	w.stop()
	w.state.Store(int32(StateKilled))
	w.log.Info("sim: worker killed")
}

// Close shuts the worker down gracefully: the publisher says goodbye and
// deletes the registry entry (so routers stop choosing it), the HTTP server
// stops accepting and lets the requests in progress finish, the engine
// stops and the NATS connection closes. When ctx ends first (and within
// DefaultCloseTimeout in any case) the remaining requests are cut off.
// Every goroutine of the worker has stopped when Close returns. Pass a
// context that is not already cancelled (say, context.WithoutCancel of the
// one Ctrl-C ended, with a timeout): a cancelled one skips the drain and
// the registry deletion. A muted worker has no connection, so it leaves
// without a goodbye. Close after Kill returns nil; further calls return the
// first call's result.
func (w *Worker) Close(ctx context.Context) error {
	w.life.Lock()
	defer w.life.Unlock()
	switch w.State() {
	case StateKilled:
		return nil
	case StateClosed:
		return w.closeErr
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultCloseTimeout)
	defer cancel()

	var errs []error
	w.mu.Lock()
	pub, nc := w.pub, w.nc
	w.pub, w.nc = nil, nil
	w.mu.Unlock()
	w.bootID.Store(0)
	if pub != nil {
		if err := pub.Close(ctx); err != nil {
			errs = append(errs, fmt.Errorf("sim: close publisher of worker %d: %w", w.cfg.WorkerID, err))
		}
	}
	if err := w.srv.Shutdown(ctx); err != nil {
		_ = w.srv.Close()
		errs = append(errs, fmt.Errorf("sim: drain worker %d: %w", w.cfg.WorkerID, err))
	}
	w.stop()
	if nc != nil {
		nc.Close()
	}
	w.state.Store(int32(StateClosed))
	w.closeErr = errors.Join(errs...)
	w.log.Info("sim: worker closed")
	return w.closeErr
}

// attach connects to NATS and starts a publisher that reports every rank's
// last load at once; with Publish.Disabled it does nothing.
func (w *Worker) attach(ctx context.Context) error {
	if w.cfg.Publish.Disabled {
		return nil
	}
	natsCfg := w.cfg.NATS
	if natsCfg.Name == natsconn.DefaultName || natsCfg.Name == "" {
		natsCfg.Name = "workermon-sim-" + strconv.FormatUint(w.cfg.WorkerID, 10)
	}
	nc, err := natsconn.Connect(ctx, natsCfg, w.log)
	if err != nil {
		return fmt.Errorf("sim: connect worker %d: %w", w.cfg.WorkerID, err)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err = natsconn.CheckServer(cctx, nc)
	cancel()
	if err != nil {
		nc.Close()
		return err
	}
	quiet := new(atomic.Bool)
	opts := append(w.cfg.Publish.options(),
		publisher.WithRanks(w.cfg.DPStart, w.cfg.Ranks),
		publisher.WithEndpoint(w.endpoint),
		publisher.WithBlockSize(uint32(w.blockSize)),
		publisher.WithMigrateHandler(w.migrate),
		publisher.WithLogger(slog.New(quietHandler{h: w.log.Handler(), quiet: quiet})))
	pub, err := publisher.New(nc, w.cfg.Model, w.cfg.WorkerID, opts...)
	if err != nil {
		nc.Close()
		return fmt.Errorf("sim: start publisher of worker %d: %w", w.cfg.WorkerID, err)
	}
	w.mu.Lock()
	w.nc, w.pub, w.quiet = nc, pub, quiet
	for i, l := range w.loads {
		_ = pub.Update(w.cfg.DPStart+uint32(i), l)
	}
	w.mu.Unlock()
	w.bootID.Store(pub.BootID())
	return nil
}

// detach closes the NATS connection, then the publisher, so that no goodbye
// and no report gets out: the way a crashed or cut-off engine disappears.
func (w *Worker) detach() {
	w.mu.Lock()
	pub, nc, quiet := w.pub, w.nc, w.quiet
	w.pub, w.nc, w.quiet = nil, nil, nil
	w.mu.Unlock()
	w.bootID.Store(0)
	if pub == nil {
		return
	}
	quiet.Store(true) // its failed publishes are the point, not news
	nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), detachTimeout)
	defer cancel()
	_ = pub.Close(ctx) // fails: the connection is closed
}

// stop stops the engine loop and waits for it, the HTTP server goroutine and
// every handler. The HTTP server must already be closed or shut down.
func (w *Worker) stop() {
	w.hmu.Lock()
	w.down = true
	w.hmu.Unlock()
	close(w.stopped)
	w.handlers.Wait()
	w.wg.Wait()
}

// run is the engine loop: it owns eng, ends each step at its scheduled time
// on the wall clock (a timer) and begins the next, takes arrivals and
// cancellations as they come, and reports each change.
func (w *Worker) run() {
	defer w.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	prev := make([]rankLoad, len(w.eng.ranks))

	for {
		if next, ok := w.eng.advance(time.Now()); ok {
			timer.Reset(time.Until(next))
		} else {
			timer.Stop()
		}
		w.report(prev)
		select {
		case <-w.stopped:
			return
		case r := <-w.submit:
			if !w.eng.add(time.Now(), r) {
				// The handler checked that the largest rank holds it, so
				// this does not happen; if it did, the handler sees done
				// with tokens missing and answers with an error.
				close(r.done)
			}
		case r := <-w.cancels:
			w.eng.cancel(r)
		case <-timer.C:
		}
	}
}

// report hands every rank whose load changed since prev to the publisher
// and stores a new stats snapshot.
func (w *Worker) report(prev []rankLoad) {
	for i := range prev {
		l := w.eng.load(i)
		if l == prev[i] {
			continue
		}
		prev[i] = l
		load := publisher.Load{
			ActiveDecodeBlocks:  events.Some(l.decodeBlocks),
			ActivePrefillTokens: events.Some(l.prefillTokens),
			WaitingRequests:     events.Some(l.waiting),
			RunningRequests:     events.Some(l.running),
			Preemptions:         events.Some(l.preemptions),
			PrefilledTokens:     events.Some(l.prefilledTokens),
			KVCommittedBlocks:   events.Some(l.kvCommittedBlocks),
		}
		w.mu.Lock()
		// The capacities stay; every other field is the engine's now. A
		// new publisher (Unmute) starts from these: its counters go on from
		// the engine's totals.
		kvTotal, maxBatched := w.loads[i].KVTotalBlocks, w.loads[i].MaxNumBatchedTokens
		w.loads[i] = load
		w.loads[i].KVTotalBlocks, w.loads[i].MaxNumBatchedTokens = kvTotal, maxBatched
		if w.pub != nil {
			_ = w.pub.Update(w.cfg.DPStart+uint32(i), load)
		}
		w.mu.Unlock()
	}
	w.stats.Store(w.snapshot())
}
