// Package adapter attaches a stock inference engine to workermon without
// changing it (contract §13): it polls the engine's Prometheus /metrics
// page, turns it into each rank's load with a scrape.Mapping, and publishes
// that load with the publisher package, registering the engine's endpoint
// for the routers.
//
// Beside the KV blocks it publishes the engine's leading signals of contract
// §21 the page gives (scrape's leading.go): the requests waiting and
// running, and its preemption and computed prompt-token counters as the
// sums of the increases seen since the rank's first good scrape
// (scrape.CounterSum), so 0 at first and never going down, even when the
// engine restarts under the adapter; per boot of the adapter's publisher,
// which lives as long as the adapter.
//
// The ranks the worker declares (dp_start, dp_size) are those of the first
// good scrape: the lowest rank and the number of ranks. A good scrape is an
// HTTP 200 whose body parses whole and names at least one rank. When no
// scrape has been good for 2 × the interval + 1 s, every rank is paused
// (publisher.Pause): no report, no heartbeat and no registry refresh goes
// out, so the monitor sees the worker go stale, as a silent engine would,
// and never free. The next good scrape resumes them. A declared rank that a
// good scrape no longer names is paused alone. Only Close says goodbye.
//
//	a, err := adapter.Start(cfg) // cfg.Mapping = scrape.VLLM{}, cfg.MetricsURL = "http://10.0.0.7:8000/metrics", ...
//	...
//	err = a.Close(ctx) // goodbye, registry entry deleted
package adapter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/internal/retry"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/scrape"
)

// Defaults of Config.
const (
	// DefaultInterval is how often the engine's page is read (--interval).
	DefaultInterval = 100 * time.Millisecond
	// DefaultTimeout bounds one scrape, from the request to the last byte
	// (--timeout).
	DefaultTimeout = time.Second
	// DefaultMaxBodyBytes bounds the page read; a larger one is a failed
	// scrape. vLLM's page is about 50 KB per data-parallel rank.
	DefaultMaxBodyBytes = 16 << 20
	// SilenceGrace is added to twice the interval to give how long the
	// adapter goes without a good scrape before it pauses the engine's
	// ranks (contract §13).
	SilenceGrace = time.Second
)

// acceptHeader asks for the classic text format, the one Parse reads. It
// does not name application/openmetrics-text: prometheus_client, which
// serves both engines' pages, answers in OpenMetrics only when the client
// names it. (Go's transport adds Accept-Encoding: gzip and inflates the
// gzipped page prometheus_client then sends.)
const acceptHeader = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

// Sentinel errors.
var (
	// ErrInvalidConfig: a Config field is missing or out of range.
	ErrInvalidConfig = errors.New("invalid configuration")
	// ErrScrape: one scrape failed (the error says how).
	ErrScrape = errors.New("scrape failed")
)

// Reasons of a failed scrape, the `reason` label of
// workermon_scrape_failures_total.
const (
	ReasonRequest   = "request"   // no answer: connection refused, timeout, ...
	ReasonStatus    = "status"    // an answer other than 200
	ReasonBody      = "body"      // the body could not be read whole, or is too large
	ReasonParse     = "parse"     // the body is not a valid exposition
	ReasonNoRanks   = "no_ranks"  // the exposition names no rank of the engine's metrics
	ReasonPublisher = "publisher" // the ranks found cannot be declared (say, too many)
)

// Config configures an Adapter.
type Config struct {
	// Conn is the NATS connection the reports go out on. Required; the
	// Adapter does not close it.
	Conn *nats.Conn
	// Mapping reads the engine's page. Required.
	Mapping scrape.Mapping
	// MetricsURL is the engine's Prometheus page, http or https. Required.
	MetricsURL string
	// Model is the model the engine serves (contract §2). Required.
	Model string
	// WorkerID is the engine's worker id.
	WorkerID uint64
	// Endpoint, when set, is the engine's base URL registered for the
	// routers (publisher.WithEndpoint).
	Endpoint string
	// Interval between the starts of two scrapes; positive.
	Interval time.Duration
	// Timeout bounds one scrape; positive.
	Timeout time.Duration
	// MaxBodyBytes bounds the page; positive.
	MaxBodyBytes int64
	// SubjectPrefix is the first subject token(s) of the reports.
	SubjectPrefix string
	// Client makes the requests; nil: a client of the Adapter's own.
	Client *http.Client
	// LatencyWindow is how often the engine's latency windows (contract
	// §18: the difference of its TTFT and ITL histograms between two
	// scrapes) go out on <prefix>.lat.<model_key>.<worker_id>; 0: never.
	LatencyWindow time.Duration
	// PublisherOptions are added to the publisher's (ranks, endpoint,
	// block size, prefix and logger are set by the Adapter).
	PublisherOptions []publisher.Option
	// Logger and Registerer: nil for none.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// DefaultConfig returns the defaults; Conn, Mapping, MetricsURL and Model
// are still to be set.
func DefaultConfig() Config {
	return Config{
		Interval:      DefaultInterval,
		Timeout:       DefaultTimeout,
		MaxBodyBytes:  DefaultMaxBodyBytes,
		SubjectPrefix: events.DefaultSubjectPrefix,
		LatencyWindow: DefaultLatencyWindow,
	}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("adapter: check %s: %w", fmt.Sprintf(format, args...), ErrInvalidConfig))
	}
	if c.Conn == nil {
		bad("connection: nil")
	}
	if c.Mapping == nil {
		bad("mapping: nil (the engine: %v)", scrape.Engines())
	}
	if u, err := url.Parse(c.MetricsURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		bad("metrics URL %q: not an absolute http or https URL", redact.URL(c.MetricsURL))
	}
	if err := events.ValidateModel(c.Model); err != nil {
		bad("model: %v", err)
	}
	if c.Endpoint != "" {
		if _, err := publisher.CheckEndpoint(c.Endpoint); err != nil {
			errs = append(errs, fmt.Errorf("adapter: %w", err))
		}
	}
	if c.LatencyWindow < 0 {
		bad("latency window: %v is negative", c.LatencyWindow)
	}
	if c.Interval <= 0 {
		bad("interval: %v is not positive", c.Interval)
	}
	if c.Timeout <= 0 {
		bad("timeout: %v is not positive", c.Timeout)
	}
	if c.MaxBodyBytes <= 0 {
		bad("max body bytes: %d is not positive", c.MaxBodyBytes)
	}
	if err := events.ValidatePrefix(c.SubjectPrefix); err != nil {
		bad("subject prefix: %v", err)
	}
	return errors.Join(errs...)
}

// SilenceAfter is how long an adapter polling every interval goes without a
// good scrape before it pauses the engine's ranks: 2 × interval +
// SilenceGrace.
func SilenceAfter(interval time.Duration) time.Duration { return 2*interval + SilenceGrace }

// Status is what the Adapter has seen, for /healthz and tests.
type Status struct {
	// LastGood is the time of the last good scrape; zero before the first.
	LastGood time.Time
	// LastError is the error of the last failed scrape since the last good
	// one, nil after a good one.
	LastError error
	// DPStart and DPSize are the declared ranks; DPSize is 0 before the
	// first good scrape.
	DPStart, DPSize uint32
	// Ranks is the number of ranks the last good scrape found.
	Ranks int
	// Silent is true while every rank is paused because no scrape has been
	// good for SilenceAfter(Interval).
	Silent bool
	// BootID is the publisher's boot id; 0 before the first good scrape.
	BootID uint64
}

// Adapter polls one engine and publishes its ranks' load.
type Adapter struct {
	cfg     Config
	log     *slog.Logger
	metrics metrics
	client  *http.Client
	status  atomic.Pointer[Status]

	// Owned by the loop, then by Close once the loop has stopped.
	pub     *publisher.Publisher // nil before the first good scrape
	start   uint32
	size    uint32
	paused  []bool // by rank - start
	silent  bool
	buf     bytes.Buffer
	scrapes *retry.ErrLog
	ranks   *retry.ErrLog
	lat     latencyState
	// counters turn each rank's engine counters into the reports'
	// counters (scrape.CounterSum), from the rank's first good scrape.
	counters map[uint32]*rankCounters

	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// Start checks cfg, registers the metrics and starts polling at once. The
// first reports go out after the first good scrape.
func Start(cfg Config) (*Adapter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("engine", cfg.Mapping.Engine(), "model", cfg.Model, "worker_id", cfg.WorkerID)
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("adapter: %w", err)
	}
	client := cfg.Client
	if client == nil {
		client = &http.Client{}
	}
	a := &Adapter{
		cfg:     cfg,
		log:     log,
		metrics: m,
		client:  client,
		scrapes: retry.NewErrLog(log.With("url", redact.URL(cfg.MetricsURL)), slog.LevelWarn, "adapter: scrape engine metrics"),
		ranks:   retry.NewErrLog(log, slog.LevelWarn, "adapter: publish ranks"),
		done:    make(chan struct{}),
	}
	a.status.Store(&Status{})
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	go a.run(ctx)
	return a, nil
}

// Status returns what the Adapter has seen so far.
func (a *Adapter) Status() Status { return *a.status.Load() }

// Close stops polling, then closes the publisher: the reports still waiting
// go out, then the goodbye, and the registry entry is deleted. It returns
// within ctx (and publisher.DefaultCloseTimeout); further calls return the
// first call's result. The publisher is closed even when ctx ends before
// the polling stopped (its goroutines stop; an Update of the last poll then
// fails with publisher.ErrClosed). Close does not close the NATS
// connection.
func (a *Adapter) Close(ctx context.Context) error {
	a.closeOnce.Do(func() {
		a.cancel()
		var stopErr error
		select {
		case <-a.done:
		default:
			select {
			case <-a.done:
			case <-ctx.Done():
				stopErr = fmt.Errorf("adapter: stop polling: %w", ctx.Err())
			}
		}
		if a.pub != nil {
			a.closeErr = errors.Join(stopErr, a.pub.Close(ctx))
		} else {
			a.closeErr = stopErr
		}
	})
	return a.closeErr
}

// result is what one scrape brought.
type result struct {
	snap      scrape.Snapshot
	ttft, itl *scrape.Histogram // the latency histograms, nil when absent
	err       error
	reason    string
	duration  time.Duration
}

// run scrapes every interval (a scrape never overlaps the previous one)
// and pauses the ranks when the engine has been silent too long, until ctx
// ends.
func (a *Adapter) run(ctx context.Context) {
	defer close(a.done)
	silenceAfter := SilenceAfter(a.cfg.Interval)
	next := time.NewTimer(0)
	defer next.Stop()
	silence := time.NewTimer(silenceAfter)
	silence.Stop() // armed by the first good scrape
	defer silence.Stop()

	results := make(chan result, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	var started time.Time
	for {
		select {
		case <-ctx.Done():
			return // the scrape in flight sees ctx too; wg waits for it
		case <-next.C:
			started = time.Now()
			wg.Go(func() { results <- a.scrape(ctx) })
		case r := <-results:
			if ctx.Err() != nil {
				return
			}
			a.metrics.duration.Observe(r.duration.Seconds())
			if a.handle(r) {
				silence.Reset(silenceAfter)
			}
			next.Reset(max(0, time.Until(started.Add(a.cfg.Interval))))
		case <-silence.C:
			a.pauseAll()
		}
	}
}

// scrape reads and maps the engine's page once. The body is read into
// a.buf, which only the goroutine of the scrape in flight touches.
func (a *Adapter) scrape(ctx context.Context) (r result) {
	begin := time.Now()
	defer func() { r.duration = time.Since(begin) }()
	fail := func(reason string, err error) result {
		return result{reason: reason, err: redact.Error(fmt.Errorf("adapter: scrape %s: %w: %w", redact.URL(a.cfg.MetricsURL), ErrScrape, err), a.cfg.MetricsURL)}
	}
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.cfg.MetricsURL, nil)
	if err != nil {
		return fail(ReasonRequest, err)
	}
	req.Header.Set("Accept", acceptHeader)
	req.Header.Set("User-Agent", "workermon-scrape")
	resp, err := a.client.Do(req)
	if err != nil {
		return fail(ReasonRequest, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return fail(ReasonStatus, fmt.Errorf("status %s", resp.Status))
	}
	a.buf.Reset()
	n, err := a.buf.ReadFrom(io.LimitReader(resp.Body, a.cfg.MaxBodyBytes+1))
	switch {
	case err != nil:
		return fail(ReasonBody, fmt.Errorf("read body: %w", err))
	case n > a.cfg.MaxBodyBytes:
		return fail(ReasonBody, fmt.Errorf("body larger than %d bytes", a.cfg.MaxBodyBytes))
	}
	fams, err := scrape.Parse(bytes.NewReader(a.buf.Bytes()))
	if err != nil {
		return fail(ReasonParse, err)
	}
	snap := a.cfg.Mapping.Loads(fams)
	if len(snap.Ranks) == 0 {
		return fail(ReasonNoRanks, fmt.Errorf("no rank in %s's metrics", a.cfg.Mapping.Engine()))
	}
	ttft, itl := scrape.LatencyHistograms(a.cfg.Mapping.Engine(), fams)
	return result{snap: snap, ttft: ttft, itl: itl}
}

// handle applies one scrape's result and reports whether it was good.
func (a *Adapter) handle(r result) bool {
	if r.err == nil {
		if err := a.publish(r.snap); err != nil {
			r.err, r.reason = err, ReasonPublisher
		}
	}
	st := *a.status.Load()
	if r.err != nil {
		a.metrics.scrapes.WithLabelValues("failed").Inc()
		a.metrics.failures.WithLabelValues(r.reason).Inc()
		a.scrapes.Fail(r.err, "reason", r.reason)
		st.LastError = r.err
		a.status.Store(&st)
		return false
	}
	a.scrapes.OK()
	now := time.Now()
	a.latency(r, now)
	a.metrics.scrapes.WithLabelValues("ok").Inc()
	a.metrics.ranks.Set(float64(len(r.snap.Ranks)))
	a.metrics.lastGood.Set(float64(now.UnixNano()) / 1e9)
	st.LastGood, st.LastError, st.Ranks = now, nil, len(r.snap.Ranks)
	st.DPStart, st.DPSize, st.Silent, st.BootID = a.start, a.size, a.silent, a.pub.BootID()
	a.status.Store(&st)
	return true
}

// rankCounters are one rank's counters of contract §21.
type rankCounters struct{ preemptions, prefilled scrape.CounterSum }

// counted returns the reports' counters of r: the sums of the increases
// of its engine counters since the rank's first good scrape, unset where
// the page does not export the counter.
func (a *Adapter) counted(r scrape.RankLoad) (preemptions, prefilled events.Optional) {
	c := a.counters[r.Rank]
	if c == nil {
		if a.counters == nil {
			a.counters = make(map[uint32]*rankCounters)
		}
		c = &rankCounters{}
		a.counters[r.Rank] = c
	}
	if v, ok := c.preemptions.Add(r.Preemptions); ok {
		preemptions = events.Some(v)
	}
	if v, ok := c.prefilled.Add(r.PrefilledTokens); ok {
		prefilled = events.Some(v)
	}
	return preemptions, prefilled
}

// publish hands a good scrape's ranks to the publisher, creating it at the
// first one, resumes the ranks found and pauses the declared ranks not
// found.
func (a *Adapter) publish(snap scrape.Snapshot) error {
	if a.pub == nil {
		if err := a.open(snap); err != nil {
			return err
		}
	}
	found := make([]bool, a.size)
	var outside []uint32
	for _, r := range snap.Ranks {
		if r.Rank < a.start || uint64(r.Rank) >= uint64(a.start)+uint64(a.size) {
			outside = append(outside, r.Rank)
			continue
		}
		i := r.Rank - a.start
		found[i] = true
		preemptions, prefilled := a.counted(r)
		load := publisher.Load{
			ActiveDecodeBlocks:  r.ActiveDecodeBlocks,
			KVTotalBlocks:       r.KVTotalBlocks,
			ActivePrefillTokens: r.ActivePrefillTokens,
			MaxNumBatchedTokens: r.MaxNumBatchedTokens,
			WaitingRequests:     r.WaitingRequests,
			RunningRequests:     r.RunningRequests,
			Preemptions:         preemptions,
			PrefilledTokens:     prefilled,
		}
		if err := a.pub.Update(r.Rank, load); err != nil {
			return fmt.Errorf("adapter: update rank %d: %w", r.Rank, err)
		}
	}
	for i := range found {
		rank := a.start + uint32(i)
		switch {
		case found[i] && a.paused[i]:
			if err := a.pub.Resume(rank); err != nil {
				return fmt.Errorf("adapter: resume rank %d: %w", rank, err)
			}
			a.paused[i] = false
		case !found[i] && !a.paused[i]:
			if err := a.pub.Pause(rank); err != nil {
				return fmt.Errorf("adapter: pause rank %d: %w", rank, err)
			}
			a.paused[i] = true
		}
	}
	if a.silent {
		a.silent = false
		a.metrics.silent.Set(0)
		a.log.Info("adapter: engine answers again; its ranks are published again")
	}
	var err error
	if len(outside) > 0 || !allTrue(found) {
		err = fmt.Errorf("ranks %v are outside the declared [%d, %d), and %d declared ranks are missing (paused)",
			outside, a.start, uint64(a.start)+uint64(a.size), count(found, false))
	}
	a.ranks.Result(err)
	return nil
}

// open creates the publisher with the ranks of the first good scrape.
func (a *Adapter) open(snap scrape.Snapshot) error {
	start := snap.Ranks[0].Rank
	size := uint32(len(snap.Ranks))
	opts := []publisher.Option{
		publisher.WithRanks(start, size),
		publisher.WithSubjectPrefix(a.cfg.SubjectPrefix),
		publisher.WithLogger(a.log),
	}
	if a.cfg.Endpoint != "" {
		opts = append(opts, publisher.WithEndpoint(a.cfg.Endpoint))
		if snap.BlockSize > 0 {
			opts = append(opts, publisher.WithBlockSize(snap.BlockSize))
		}
	}
	opts = append(opts, a.cfg.PublisherOptions...)
	pub, err := publisher.New(a.cfg.Conn, a.cfg.Model, a.cfg.WorkerID, opts...)
	if err != nil {
		return fmt.Errorf("adapter: declare ranks [%d, %d): %w", start, uint64(start)+uint64(size), err)
	}
	a.pub, a.start, a.size, a.paused = pub, start, size, make([]bool, size)
	a.log.Info("adapter: first good scrape; publishing", "dp_start", start, "dp_size", size,
		"block_size", snap.BlockSize, "endpoint", a.cfg.Endpoint, "boot_id", pub.BootID())
	return nil
}

// pauseAll pauses every rank: the engine has been silent too long.
func (a *Adapter) pauseAll() {
	if a.pub == nil || a.silent {
		return
	}
	for i := range a.paused {
		if err := a.pub.Pause(a.start + uint32(i)); err != nil {
			a.log.Warn("adapter: pause rank", "rank", a.start+uint32(i), "err", err)
			continue
		}
		a.paused[i] = true
	}
	a.silent = true
	a.metrics.silent.Set(1)
	st := *a.status.Load()
	st.Silent = true
	a.status.Store(&st)
	a.log.Warn("adapter: no good scrape for too long; the engine's ranks are no longer published (the worker goes stale)",
		"silence", SilenceAfter(a.cfg.Interval), "last_error", st.LastError)
}

func allTrue(bs []bool) bool { return count(bs, false) == 0 }

func count(bs []bool, v bool) int {
	n := 0
	for _, b := range bs {
		if b == v {
			n++
		}
	}
	return n
}
