// Package loadgen sends load to an OpenAI-compatible server — the workermon
// router, or an engine — and counts what comes back.
//
// The load is open-loop: requests start on the schedule of the rate profile
// (constant, a triangle wave between two rates, or any function of time: a
// benchmark's scenario), evenly spaced or as a
// seeded Poisson process, whatever the server does, up to a cap on the
// requests in flight. Their prompt and output lengths are fixed or drawn
// from a workload (chat, documents) with the same seed. A fraction of them
// is cancelled by the client mid-way, to exercise cancellation along the
// path. Answers are counted by outcome (200, 503, 429, other statuses,
// errors, cancellations) in total and over a sliding window, with latency,
// time-to-first-token and time-per-output-token percentiles of the
// successful ones. Those latencies decide whether a request met the SLO
// (Result.Good); the good ones make the goodput (Stats.Report). With a
// priority mix each request carries a priority header (X-Workermon-Priority)
// drawn from the mix with a seeded generator, and the answers are counted by
// priority class too. With Config.Retries a request that is rejected (or
// gets a 408, 409, 5xx or no answer) is sent again as the official OpenAI
// SDKs do, honouring the server's retry-after-ms and Retry-After (retry.go);
// the outcomes then count attempts, and a request whose last attempt got no
// 200 is failed. A benchmark can see every request as it ends
// (Config.OnDone) and change the workload over time (Config.WorkloadAt).
//
//	g, err := loadgen.New(cfg, logger)
//	...
//	go func() { _ = g.Run(ctx) }() // until ctx ends
//	...
//	s := g.Stats()
package loadgen

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/internal/redact"
)

// Sentinel errors.
var (
	// ErrInvalidConfig: a Config field is missing, out of range, or
	// conflicts with another.
	ErrInvalidConfig = errors.New("invalid configuration")
	// ErrAlreadyRun: Run was called a second time.
	ErrAlreadyRun = errors.New("generator already run")

	// Internal: how a request ended early, for the counts.
	errClientCancel = errors.New("loadgen: cancelled by the client")
	errStreamError  = errors.New("loadgen: error event in the stream")
	errIncomplete   = errors.New("loadgen: stream ended without [DONE]")
)

// schedulerTick is how often the scheduler starts the requests that have
// fallen due.
const schedulerTick = 10 * time.Millisecond

// maxBurstSeconds caps the requests the scheduler catches up on after a
// stall, in seconds of the current rate.
const maxBurstSeconds = 1.0

// Generator sends requests to one server on a rate profile. Stats is safe
// for concurrent use with Run.
type Generator struct {
	cfg       Config
	log       *slog.Logger
	client    *http.Client
	transport *http.Transport // nil when the Config gives the transport
	url       string
	bodies    [][]byte // one request body per model (WorkloadFixed)
	prompt    string   // the longest prompt of the workload; shorter ones are its prefixes
	lengths   Lengths  // of the workload; zero for WorkloadFixed

	sem     chan struct{} // one token per request in flight
	next    atomic.Uint64 // the next model, in turn
	chooser *chooser      // the priority of each request; nil without a mix
	started atomic.Bool
	rec     *recorder
	flights flights
}

// New returns a Generator of cfg. logger may be nil.
func New(cfg Config, logger *slog.Logger) (*Generator, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	g := &Generator{
		cfg: cfg,
		log: logger,
		sem: make(chan struct{}, cfg.Concurrency),
		rec: newRecorder(cfg.Window),
	}
	g.chooser = newChooser(cfg.PriorityMix, cfg.Seed)
	for _, p := range cfg.PriorityMix {
		g.rec.useClass(admission.ClassOf(p.Priority))
	}
	rt := cfg.Transport
	if rt == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConns = cfg.Concurrency
		t.MaxIdleConnsPerHost = cfg.Concurrency
		g.transport, rt = t, t
	}
	g.client = &http.Client{Transport: rt}
	path := "/v1/completions"
	if cfg.API == APIChat {
		path = "/v1/chat/completions"
	}
	g.url = strings.TrimRight(cfg.Target, "/") + path
	if cfg.WorkloadAt != nil {
		chat, _ := WorkloadChat.Lengths()
		docs, _ := WorkloadDocuments.Lengths()
		g.lengths, g.prompt = chat, makePrompt(max(chat.PromptMax, docs.PromptMax))
		return g, nil
	}
	if l, ok := cfg.Workload.Lengths(); ok {
		g.lengths, g.prompt = l, makePrompt(l.PromptMax)
		return g, nil
	}
	prompt := makePrompt(cfg.PromptTokens)
	for _, m := range cfg.Models {
		body, err := requestBody(cfg, m, prompt, cfg.MaxTokens, 0)
		if err != nil {
			return nil, fmt.Errorf("loadgen: encode request of model %q: %w", m, err)
		}
		g.bodies = append(g.bodies, body)
	}
	return g, nil
}

// Run sends requests until ctx ends, or for Config.Duration, then cancels
// those in flight (counted as aborted) — after Duration, once none of them
// can still be good — waits for them and returns nil. It may be called
// once; a second call fails with ErrAlreadyRun.
func (g *Generator) Run(ctx context.Context) error {
	if !g.started.CompareAndSwap(false, true) {
		return fmt.Errorf("loadgen: run: %w", ErrAlreadyRun)
	}
	start := time.Now()
	g.rec.begin(start)
	g.rec.setTarget(g.cfg.RateAt(0))
	g.log.Info("loadgen: started", "target", redact.URL(g.url), "profile", g.cfg.Profile)

	// The requests' context: ctx, or the end of the drain after Duration.
	rctx, cancelRequests := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancelRequests()
		wg.Wait()
		if g.transport != nil {
			g.transport.CloseIdleConnections()
		}
		g.rec.finish(time.Now())
		g.log.Info("loadgen: stopped")
	}()

	tick := time.NewTicker(schedulerTick)
	defer tick.Stop()
	var stop <-chan time.Time
	if g.cfg.Duration > 0 {
		t := time.NewTimer(g.cfg.Duration)
		defer t.Stop()
		stop = t.C
	}
	rng := rand.New(rand.NewPCG(g.cfg.Seed, arrivalStream))
	last, credit := start, 0.0
	next := start // the next Poisson arrival
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-stop:
			g.rec.finish(start.Add(g.cfg.Duration))
			g.drain(ctx)
			return nil
		case now := <-tick.C:
			if ctx.Err() != nil {
				// select picks at random among ready cases: never start a
				// request once the run is over.
				return nil
			}
			rate := g.cfg.RateAt(now.Sub(start))
			g.rec.setTarget(rate)
			if g.cfg.Arrivals == ArrivalsPoisson {
				// After a stall, catch up on at most maxBurstSeconds.
				if lag := now.Add(-maxBurstSeconds * time.Second); next.Before(lag) {
					next = lag
				}
				for !next.After(now) {
					r := g.cfg.RateAt(next.Sub(start))
					if r <= 0 {
						next = now.Add(schedulerTick)
						break
					}
					g.launch(rctx, now, next.Sub(start), &wg, rng)
					next = next.Add(time.Duration(rng.ExpFloat64() / r * float64(time.Second)))
				}
				continue
			}
			credit = min(credit+rate*now.Sub(last).Seconds(), max(1, rate*maxBurstSeconds))
			last = now
			for ; credit >= 1; credit-- {
				g.launch(rctx, now, now.Sub(start), &wg, rng)
			}
		}
	}
}

// drain waits, once the load has stopped, until no request in flight can
// still be good, for at most Config.MaxDrain (0: Timeout), or until ctx
// ends.
func (g *Generator) drain(ctx context.Context) {
	limit := time.NewTimer(cmp.Or(g.cfg.MaxDrain, g.cfg.Timeout))
	defer limit.Stop()
	poll := time.NewTicker(drainPoll)
	defer poll.Stop()
	for g.flights.hopeful(time.Now()) > 0 {
		select {
		case <-ctx.Done():
			return
		case <-limit.C:
			return
		case <-poll.C:
		}
	}
}

// drainPoll is how often drain looks at the requests in flight.
const drainPoll = 50 * time.Millisecond

// arrivalStream is the second word of the seed of the arrivals' and
// lengths' generator (the priorities' has its own).
const arrivalStream = 0x6c656e67746873 // "lengths"

// Hopeful returns how many requests in flight can still be good at now
// (Config.SLO): a streamed one until the TTFT target passes without a
// first token, then until TTFT + ITL × (its max_tokens − 1) after its
// send; one not streamed until TTFT + ITL × (max_tokens − 1). With
// Config.SimOutputTokens its drawn length stands for its max_tokens. Without a
// target every request in flight counts. A benchmark that has stopped
// offering load need not wait for the others: they cannot be good.
func (g *Generator) Hopeful(now time.Time) int { return g.flights.hopeful(now) }

// Stats returns a snapshot of the counters.
func (g *Generator) Stats() Stats { return g.rec.stats(time.Now()) }

// launch starts one request due at offered since the start, or counts it
// dropped when the cap is reached. rng draws its lengths; only Run's
// goroutine uses it.
func (g *Generator) launch(ctx context.Context, now time.Time, offered time.Duration, wg *sync.WaitGroup, rng *rand.Rand) {
	var body []byte
	maxTokens := g.cfg.MaxTokens
	model := int((g.next.Add(1) - 1) % uint64(len(g.cfg.Models)))
	l := g.lengths
	if g.cfg.WorkloadAt != nil {
		l, _ = g.cfg.WorkloadAt(offered).Lengths()
	}
	if l.PromptMax > 0 {
		// Drawn before the cap is checked, so that a seed gives the n-th
		// offered request the same lengths whatever the server does.
		prompt := l.PromptMin + rng.IntN(l.PromptMax-l.PromptMin+1)
		maxTokens = l.OutputMin + rng.IntN(l.OutputMax-l.OutputMin+1)
		limit, simOutput := maxTokens, 0
		if g.cfg.SimOutputTokens {
			// The engine sees the range's top; the length drawn is the
			// hidden truth, and what the SLO and cancellation go by.
			limit, simOutput = l.OutputMax, maxTokens
		}
		var err error
		if body, err = requestBody(g.cfg, g.cfg.Models[model], g.prompt[:4*prompt-1], limit, simOutput); err != nil {
			g.log.Error("loadgen: encode request", "err", err)
			return
		}
	} else {
		body = g.bodies[model]
	}
	// The priority too is drawn before the cap is checked: the n-th offered
	// request has the same class whatever was dropped, and a dropped one
	// counts in its class's offered load.
	class, header := noClass, ""
	if g.chooser != nil {
		i := g.chooser.next()
		class = int(admission.ClassOf(g.cfg.PriorityMix[i].Priority))
		if !g.cfg.NoPriorityHeader {
			header = g.chooser.header[i]
		}
	}
	select {
	case g.sem <- struct{}{}:
	default:
		g.rec.dropped(now, class)
		if g.cfg.OnDone != nil {
			g.cfg.OnDone(Sample{Offered: offered, Dropped: true})
		}
		return
	}
	g.rec.sent(now, class)
	wg.Go(func() {
		defer func() { <-g.sem }()
		start := time.Now()
		fl := g.flights.add(g.cfg, start, maxTokens)
		defer g.flights.remove(fl)
		d := g.do(ctx, start, body, header, maxTokens, fl, class)
		d.class, d.start = class, now
		g.rec.done(time.Now(), d)
		if g.cfg.OnDone != nil {
			g.cfg.OnDone(Sample{Offered: offered, OK: d.o == outOK, Result: d.res, Good: d.good,
				Queued: d.anyQueued, QueueWait: d.waited, Attempts: d.attempts, Failed: d.failed(), Tries: d.tries})
		}
	})
}
