package bench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/hostcpu"
	"github.com/workermon/workermon/loadgen"
	"github.com/workermon/workermon/sim"
)

// readyTimeout bounds the wait for the parts of a row to see each other.
const readyTimeout = time.Minute

// closeTimeout bounds the shutdown of a row's parts.
const closeTimeout = 10 * time.Second

// loadShape is what the load generator offers over length.
type loadShape struct {
	rate     func(time.Duration) float64
	workload func(time.Duration) loadgen.Workload
	length   time.Duration
	// join, when positive, is when the fleet's last worker joins; the run
	// starts without it.
	join time.Duration
	// retries is the clients' loadgen.Config.Retries.
	retries int
}

// runStats is what a row measures beside the requests.
type runStats struct {
	preemptions uint64
	cpuPct      float64
	// setup is the time from the start to the load, drain from the end of
	// the arrivals to the last request that could still be good.
	setup, drain time.Duration
	// byRouter is each router's figures, in the order of the routers.
	byRouter []RouterRow
}

// run starts a fresh monitor configured by spec, the fleet and routers
// routers configured by rspec, offers shape to them (spread over the
// routers in turn), waits for the requests in flight and stops
// everything. It returns every offered request.
func (g *goodput) run(ctx context.Context, rspec RouterSpec, spec MonitorSpec, routers int, seed uint64, shape loadShape) (_ []loadgen.Sample, st runStats, err error) {
	var closers []func(context.Context) error
	t0 := time.Now()
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
		defer cancel()
		for i := len(closers) - 1; i >= 0; i-- {
			err = errors.Join(err, closers[i](cctx))
		}
	}()
	mon, err := g.cfg.Stack.StartMonitor(ctx, spec)
	if err != nil {
		return nil, st, fmt.Errorf("bench: goodput: monitor: %w", err)
	}
	closers = append(closers, mon.Close)
	fcfg := fleetConfig(mon.NATSURL())
	fcfg.Workers = startWorkers(shape.join)
	fleet, err := sim.NewFleet(ctx, fcfg, g.cfg.Log.With("part", "sim"))
	if err != nil {
		return nil, st, fmt.Errorf("bench: goodput: %w", err)
	}
	closers = append(closers, fleet.Close)
	var all fleets
	all.add(fleet)
	var urls []string
	for i := range routers {
		rs := rspec
		rs.NATSURL, rs.ID = mon.NATSURL(), "bench-"+strconv.Itoa(i)
		r, err := g.cfg.Stack.StartRouter(ctx, rs)
		if err != nil {
			return nil, st, fmt.Errorf("bench: goodput: router: %w", err)
		}
		closers = append(closers, r.Close)
		urls = append(urls, r.URL())
	}
	if err := waitFleet(ctx, mon.NATSURL(), urls, fcfg.Workers); err != nil {
		return nil, st, err
	}
	st.setup = time.Since(t0)

	lc := g.loadConfig(urls[0], seed, shape)
	var mu sync.Mutex
	var samples []loadgen.Sample
	lc.OnDone = func(s loadgen.Sample) {
		mu.Lock()
		samples = append(samples, s)
		mu.Unlock()
	}
	transport := newSpread(urls, g.cfg.RouterShares)
	defer transport.CloseIdleConnections()
	lc.Transport = transport
	gen, err := loadgen.New(lc, nil)
	if err != nil {
		return nil, st, err
	}
	preempted := all.preemptions
	p0 := preempted()
	cpu0, _ := hostcpu.Read() // zero where unknown: the row's CPU figure is then 0
	// The row's CPU figure is over the load, not its drain.
	cpuEnd := make(chan hostcpu.Sample, 1)
	atEnd := time.AfterFunc(shape.length, func() { c, _ := hostcpu.Read(); cpuEnd <- c })
	defer atEnd.Stop()
	tStart := time.Now()
	// The joining worker, when the shape has one: started by its own
	// goroutine into the load, waited for (and stopped, when the load ends
	// first) before the figures are read or the parts closed.
	joined := func() error { return nil }
	if shape.join > 0 {
		jctx, stopJoin := context.WithCancel(ctx)
		j := startJoiner(jctx, mon.NATSURL(), shape.join, g.cfg.Log.With("part", "sim"), g.cfg.Progress)
		once := sync.OnceValue(func() error {
			stopJoin()
			f, err := j.wait()
			if f != nil {
				closers = append(closers, f.Close)
				all.add(f)
			}
			return err
		})
		joined = once
		defer func() { err = errors.Join(err, once()) }()
	}
	if err := gen.Run(ctx); err != nil {
		return nil, st, err
	}
	if err := ctx.Err(); err != nil {
		return nil, st, err
	}
	st.drain = max(0, time.Since(tStart)-shape.length)
	if err := joined(); err != nil {
		return nil, st, err
	}
	var cpu1 hostcpu.Sample
	select {
	case cpu1 = <-cpuEnd:
	default: // the load ended early
		cpu1, _ = hostcpu.Read()
	}
	st.preemptions = preempted() - p0
	st.cpuPct = cpu0.BusyPct(cpu1)
	st.byRouter = transport.byRouter()
	mu.Lock()
	defer mu.Unlock()
	return samples, st, nil
}

// loadConfig is the load generator's configuration of a row: shape offered
// to target (the transport spreads it over the routers) from seed.
func (g *goodput) loadConfig(target string, seed uint64, shape loadShape) loadgen.Config {
	// The client gives up on a request that can no longer be good: the
	// longest a good one takes is TTFT + ITL × (the longest output − 1),
	// from its first attempt (retries and the waits between them
	// included).
	chat, _ := loadgen.WorkloadChat.Lengths()
	timeout := g.slo.TTFT + g.slo.ITL*time.Duration(chat.OutputMax-1) + time.Second
	lc := loadgen.DefaultConfig()
	lc.Target, lc.Models = target, []string{GoodputModel}
	lc.Stream, lc.Arrivals, lc.Seed, lc.SLO, lc.Timeout = true, loadgen.ArrivalsPoisson, seed, g.slo, timeout
	lc.CancelFraction, lc.Concurrency, lc.Retries = 0, 4096, shape.retries
	lc.WorkloadAt = shape.workload
	lc.RateFunc = shape.rate
	// Contract §21: each request asks for the top of its workload's output
	// range (max_tokens) and carries its drawn length in sim_output_tokens,
	// where the sim ends it as an end-of-sequence token would: the engine,
	// the routers and the monitor see what a real one would, not the
	// length in advance.
	lc.SimOutputTokens = true
	// The arrivals end after the scenario; the requests in flight that can
	// still be good finish (loadgen's drain), within the client's timeout
	// and a second, or MaxDrain: those cut count as not good.
	lc.Duration, lc.MaxDrain = shape.length, timeout+time.Second
	if g.cfg.MaxDrain > 0 {
		lc.MaxDrain = g.cfg.MaxDrain
	}
	return lc
}

// waitFleet waits until the busy list shows the workers free, the
// registry lists them all and every router answers a request.
func waitFleet(ctx context.Context, natsURL string, routers []string, workers int) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	nc, err := nats.Connect(natsURL, nats.Name("workermon-bench-goodput"))
	if err != nil {
		return fmt.Errorf("bench: goodput: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ready := func() bool {
		busy, err := js.KeyValue(ctx, events.BusyBucket)
		if err != nil {
			return false
		}
		e, err := busy.Get(ctx, events.ModelKey(GoodputModel))
		if err != nil {
			return false
		}
		rec, err := events.DecodeBusySet(e.Value())
		if err != nil || len(rec.Free) != workers {
			return false
		}
		reg, err := js.KeyValue(ctx, events.WorkersBucket)
		if err != nil {
			return false
		}
		keys, err := reg.ListKeys(ctx)
		if err != nil {
			return false
		}
		n := 0
		for range keys.Keys() {
			n++
		}
		if n < workers {
			return false
		}
		for _, u := range routers {
			if !probe(ctx, u) {
				return false
			}
		}
		return true
	}
	for !ready() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("bench: goodput: the monitor, the workers and the routers did not see each other within %v", readyTimeout)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// probe sends one short completion through a router.
func probe(ctx context.Context, base string) bool {
	body := `{"model":"` + GoodputModel + `","prompt":"ready?","max_tokens":1}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return false
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// spread is a transport that sends each attempt to one of the routers,
// in proportion to their shares (smooth weighted round-robin: an even
// share is plain turns), and counts, per router, the attempts it answered,
// those it rejected (503, 429) and the queue waits it reported
// (X-Workermon-Queued): the load of several routers over the same bucket,
// split as a front-end load balancer would.
type spread struct {
	hosts   []string
	weights []float64
	t       *http.Transport

	mu      sync.Mutex
	current []float64 // the round-robin's running weights
	stats   []routerStats
}

// routerStats is what one router answered through a spread.
type routerStats struct {
	attempts, rejected int
	waits              []time.Duration
}

// newSpread spreads over urls by shares (nil or of another length: even).
func newSpread(urls []string, shares []float64) *spread {
	s := &spread{t: http.DefaultTransport.(*http.Transport).Clone()}
	s.t.MaxIdleConns, s.t.MaxIdleConnsPerHost = 4096, 4096
	for i, u := range urls {
		pu, _ := url.Parse(u)
		s.hosts = append(s.hosts, pu.Host)
		w := 1.0
		if len(shares) == len(urls) {
			w = shares[i]
		}
		s.weights = append(s.weights, w)
	}
	s.current = make([]float64, len(urls))
	s.stats = make([]routerStats, len(urls))
	return s
}

// pick returns the router of the next attempt: each router's running
// weight grows by its share, the largest is chosen and loses the total
// (nginx's smooth weighted round-robin), so that over any n attempts each
// router has its share of them within one.
func (s *spread) pick() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	best, total := 0, 0.0
	for i, w := range s.weights {
		s.current[i] += w
		total += w
		if s.current[i] > s.current[best] {
			best = i
		}
	}
	s.current[best] -= total
	return best
}

func (s *spread) RoundTrip(r *http.Request) (*http.Response, error) {
	i := s.pick()
	if len(s.hosts) > 1 {
		r = r.Clone(r.Context())
		r.URL.Host = s.hosts[i]
		r.Host = r.URL.Host
	}
	resp, err := s.t.RoundTrip(r)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.stats[i]
	st.attempts++
	if err == nil {
		if rejection(resp.StatusCode) {
			st.rejected++
		}
		if v := resp.Header.Get(queuedHeader); v != "" {
			if ms, perr := strconv.ParseUint(v, 10, 63); perr == nil {
				st.waits = append(st.waits, time.Duration(ms)*time.Millisecond)
			}
		}
	}
	return resp, err
}

func (s *spread) CloseIdleConnections() { s.t.CloseIdleConnections() }

// byRouter returns each router's figures: its share (of the shares'
// sum), the p90 of the queue waits it reported (nil without one), the
// share of its attempts it rejected or let expire.
func (s *spread) byRouter() []RouterRow {
	s.mu.Lock()
	defer s.mu.Unlock()
	total := 0.0
	for _, w := range s.weights {
		total += w
	}
	out := make([]RouterRow, len(s.hosts))
	for i, st := range s.stats {
		out[i] = RouterRow{Share: s.weights[i] / total, QueueWaitP90: pct(st.waits, 90)}
		if st.attempts > 0 {
			out[i].RejectedPct = 100 * float64(st.rejected) / float64(st.attempts)
		}
	}
	return out
}

// queuedHeader is the router's header on an answer that waited in its
// queue: the milliseconds waited (contract §17).
const queuedHeader = "X-Workermon-Queued"
