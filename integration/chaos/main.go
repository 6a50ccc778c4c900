// Command chaos runs workermon's chaos test (DESIGN §20, docs/ha.md "Faults
// under load"): it starts the chaos stack of deploy/chaos/compose.yml (a
// three-node NATS cluster, three monitors sharing 8 partitions, two
// routers, six `tiny` engines of three models), drives a load of about
// 120 % of the fleet's rated capacity with a priority mix through the
// routers, injects one fault at a time from a printed seed, and checks the
// whole time: epochs and seqs of the records, fail-open windows, the final
// state after each fault, the routers' answers, the processes' heap and
// goroutines. It prints the faults, the violations, the longest fail-open
// window and the recovery times, writes them as JSON, removes the stack
// (also when interrupted) and exits 1 on any violation.
//
//	go run ./integration/chaos -duration 10m [-seed N] [-json chaos.json]
//
// `make chaos` builds the images first and runs it (CHAOS_DURATION,
// CHAOS_SEED).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/sim/stepengine"
)

// Config is the chaos stack as deploy/chaos/compose.yml configures it.
type Config struct {
	NATSURLs       []string
	Monitors       map[string]string // service (= monitor id) → base URL on this host
	Routers        map[string]string // service → base URL on this host
	Engines        map[string]string // service → model
	EngineHTTP     map[string]string // service → base URL of its /metrics on this host
	Partitions     int
	LeaseTTL       time.Duration
	Heartbeat      time.Duration
	StaleAfter     time.Duration // the monitors'
	StaleListAfter time.Duration // the routers'
}

// chaosConfig is the stack of deploy/chaos/compose.yml with its ports'
// prefix; the compose file runs the monitors and routers with the default
// intervals.
func chaosConfig(prefix string) Config {
	c := Config{Monitors: map[string]string{}, Routers: map[string]string{}, Engines: map[string]string{}, EngineHTTP: map[string]string{},
		Partitions: 8, LeaseTTL: busylist.DefaultLeaseTTL, Heartbeat: busylist.DefaultHeartbeat,
		StaleAfter: monitor.DefaultStaleAfter, StaleListAfter: busylist.DefaultStaleListAfter}
	for n := 1; n <= 3; n++ {
		c.NATSURLs = append(c.NATSURLs, fmt.Sprintf("nats://127.0.0.1:%s2%d", prefix, n))
		c.Monitors[fmt.Sprintf("monitor-%d", n)] = fmt.Sprintf("http://127.0.0.1:%s9%d", prefix, n)
	}
	for n := 1; n <= 2; n++ {
		c.Routers[fmt.Sprintf("router-%d", n)] = fmt.Sprintf("http://127.0.0.1:%s8%d", prefix, n)
	}
	for n, m := range []string{"chaos/alpha", "chaos/alpha", "chaos/beta", "chaos/beta", "chaos/gamma", "chaos/gamma"} {
		c.Engines[fmt.Sprintf("sim-%d", n+1)] = m
		c.EngineHTTP[fmt.Sprintf("sim-%d", n+1)] = fmt.Sprintf("http://127.0.0.1:%s7%d", prefix, n+1)
	}
	return c
}

func (c Config) topology() Topology {
	return Topology{NATS: []string{"nats-1", "nats-2", "nats-3"}, Monitors: sortedKeys(c.Monitors),
		Routers: sortedKeys(c.Routers), Engines: sortedKeys(c.Engines)}
}

func (c Config) models() []string {
	return slices.Compact(slices.Sorted(maps.Values(c.Engines)))
}

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	duration := fs.Duration("duration", 10*time.Minute, "how long the load and the faults run (CHAOS_DURATION); below 5m each kind of fault once, 10-20 s apart")
	seed := fs.Uint64("seed", 0, "seed of the faults and the load (CHAOS_SEED); 0 draws one, printed")
	jsonOut := fs.String("json", "chaos.json", "where the results are written as JSON")
	composeCmd := fs.String("compose", os.Getenv("COMPOSE"), "the compose command (docker compose, or docker-compose); empty finds one")
	file := fs.String("file", "deploy/chaos/compose.yml", "the chaos stack's compose file")
	project := fs.String("project", "workermon-chaos", "the compose project name")
	ports := fs.String("ports", "242", "prefix of the stack's host ports (WORKERMON_CHAOS_PORTS of the compose file)")
	keep := fs.Bool("keep", false, "leave the stack running at the end (to look at it; `docker-compose -p workermon-chaos -f deploy/chaos/compose.yml down -v` removes it)")
	scheduleOnly := fs.Bool("schedule", false, "print the schedule of the seed and exit")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *seed == 0 {
		*seed = rand.Uint64()>>1 | 1
	}
	cfg := chaosConfig(*ports)
	faults := Schedule(*seed, *duration, cfg.topology())
	fmt.Fprintf(stdout, "chaos: seed %d, duration %v, %d faults planned (replay: CHAOS_SEED=%d CHAOS_DURATION=%v):\n%s",
		*seed, *duration, len(faults), *seed, *duration, scheduleString(faults))
	if *scheduleOnly {
		return 0
	}
	compose, err := findCompose(*composeCmd)
	if err != nil {
		fmt.Fprintln(stderr, "chaos:", err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Setenv("WORKERMON_CHAOS_PORTS", *ports)
	st := &Stack{Docker: "docker", Compose: compose, File: *file, Project: *project}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	d := &driver{cfg: cfg, st: st, out: stdout, log: log, seed: *seed, duration: *duration, faults: faults}
	res, err := func() (*Results, error) {
		// Removed however the run ends: a failure, Ctrl-C or SIGTERM (the
		// context), a panic.
		defer func() {
			if !*keep {
				fmt.Fprintln(stdout, "chaos: removing the stack")
				if derr := st.Down(); derr != nil {
					fmt.Fprintln(stderr, "chaos: remove the stack:", derr)
				}
			}
		}()
		return d.run(ctx)
	}()
	if err != nil {
		fmt.Fprintln(stderr, "chaos:", err)
		return 1
	}
	res.print(stdout)
	if data, err := json.MarshalIndent(res, "", "  "); err == nil {
		if err := os.WriteFile(*jsonOut, append(data, '\n'), 0o644); err != nil {
			fmt.Fprintln(stderr, "chaos:", err)
		} else {
			fmt.Fprintln(stdout, "chaos: results written to", *jsonOut)
		}
	}
	if !res.Pass {
		fmt.Fprintf(stdout, "chaos: FAIL: %d violation(s) (seed %d)\n", len(res.Violations), *seed)
		return 1
	}
	fmt.Fprintf(stdout, "chaos: PASS (seed %d)\n", *seed)
	return 0
}

// findCompose returns the compose command: the one given, else Compose v2
// (docker compose) when it answers, else docker-compose.
func findCompose(given string) ([]string, error) {
	if given != "" {
		return strings.Fields(given), nil
	}
	if exec.Command("docker", "compose", "version").Run() == nil {
		return []string{"docker", "compose"}, nil
	}
	if _, err := exec.LookPath("docker-compose"); err == nil {
		return []string{"docker-compose"}, nil
	}
	return nil, errors.New("neither `docker compose` nor docker-compose is there")
}

// interval is a stretch during which a service was down; to is zero while
// it still is.
type interval struct{ from, to time.Time }

// driver runs one chaos run.
type driver struct {
	cfg      Config
	st       *Stack
	out      io.Writer
	log      *slog.Logger
	seed     uint64
	duration time.Duration
	faults   []Fault

	ck     *Checker
	bg     sync.WaitGroup // the waits for a restarted router or engine to be healthy
	growth *Growth
	cpu    *CPU

	mu      sync.Mutex
	downs   map[string][]interval // service → when it was down
	downNow map[string]bool       // monitors down now (killed, paused, cut)
	gen     map[string]int        // service → starts so far
	started map[string]time.Time  // service → start of its current process
	viol    []Violation
}

func (d *driver) printf(format string, args ...any) {
	fmt.Fprintf(d.out, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

func (d *driver) run(ctx context.Context) (*Results, error) {
	d.downs, d.downNow, d.gen, d.started = map[string][]interval{}, map[string]bool{}, map[string]int{}, map[string]time.Time{}
	d.growth, d.cpu = newGrowth(), &CPU{}
	defer d.bg.Wait()
	// Whatever an earlier run interrupted hard left behind.
	_ = d.st.Down()

	d.printf("starting the NATS cluster")
	if err := d.st.Up(ctx, 3*time.Minute, "nats-1", "nats-2", "nats-3"); err != nil {
		return nil, fmt.Errorf("start NATS: %w", err)
	}
	ck, err := newChecker(ctx, d.cfg, d.log)
	if err != nil {
		return nil, err
	}
	d.ck = ck
	defer ck.Close()
	if err := ck.ProvisionWorkers(ctx); err != nil {
		return nil, fmt.Errorf("create the workers bucket at 3 replicas: %w", err)
	}
	all := slices.Concat([]string{"nats-1", "nats-2", "nats-3"}, sortedKeys(d.cfg.Monitors), sortedKeys(d.cfg.Engines), sortedKeys(d.cfg.Routers))
	d.printf("starting the monitors, engines and routers")
	if err := d.st.Up(ctx, 3*time.Minute, all...); err != nil {
		return nil, fmt.Errorf("start the stack: %w", err)
	}
	now := time.Now()
	for _, s := range all {
		d.started[s] = now
	}
	if err := ck.Start(ctx); err != nil {
		return nil, err
	}

	bg, stopBG := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stopBG(); wg.Wait() }()
	wg.Go(func() {
		if err := d.cpu.Run(bg); err != nil {
			d.printf("the host's CPU cannot be read (%v): no fault can be found inconclusive", err)
		}
	})
	wg.Go(func() { d.poll(bg) })
	wg.Go(func() { d.scrape(bg) })

	d.printf("waiting for the first final state")
	if _, why, err := d.untilFinal(ctx, 90*time.Second); err != nil {
		return nil, err
	} else if why != "" {
		return nil, fmt.Errorf("the stack never reached a final state: %s", why)
	}
	s, _ := ck.Snapshot(ctx, d.cfg.Monitors, nil, d.cfg.models())
	d.printf("stack ready: %s", holders(s))

	prof, err := stepengine.LookupProfile(stepengine.ProfileTiny)
	if err != nil {
		return nil, err
	}
	per := ratedRPS(prof.Config)
	rate := 1.2 * per * float64(len(d.cfg.Engines))
	load := &Load{Routers: d.cfg.Routers, Models: d.cfg.models(), RPS: rate, Seed: d.seed, Timeout: time.Minute,
		Down: d, OnViolation: func(at time.Time, what string) { d.violate(Violation{At: at, Rule: RuleAnswer, What: what}) }}
	d.printf("load: %.1f requests/s (120 %% of %d tiny engines rated %.2f requests/s each), streamed, priorities %v",
		rate, len(d.cfg.Engines), per, priorityMix)
	loadCtx, stopLoad := context.WithCancel(ctx)
	var lwg sync.WaitGroup
	lwg.Go(func() { load.Run(loadCtx) })
	start := time.Now()

	var done []FaultResult
	healed := start
	judged := start
	for _, f := range d.faults {
		at := healed.Add(f.Gap)
		if judged.After(at) {
			at = judged
		}
		if !d.quiet(ctx, at) {
			break
		}
		if d.duration >= shortRun && time.Since(start)+f.Down > d.duration {
			break
		}
		fr, err := d.inject(ctx, f)
		if err != nil {
			stopLoad()
			lwg.Wait()
			return nil, fmt.Errorf("fault %s: %w", f, err)
		}
		healed = fr.Healed
		rec, why, err := d.untilFinal(ctx, recoveryWithin)
		if err != nil {
			break
		}
		judged = time.Now()
		fr.Judged = judged
		if why == "" {
			fr.Recovery = rec
			d.printf("fault #%d recovered: final state %v after it healed", f.N, rec.Round(time.Millisecond))
		} else {
			fr.Failed = why
			v := Violation{At: judged, Rule: RuleRecovery, Fault: f.N,
				What: fmt.Sprintf("no final state within %v after fault %s healed: %s", recoveryWithin, f, why)}
			d.violate(v)
			d.printf("fault #%d: NO final state within %v: %s", f.N, recoveryWithin, why)
			for _, m := range d.cfg.topology().Monitors {
				lctx, cancel := healContext(ctx)
				d.printf("--- last log lines of %s ---\n%s", m, d.st.Logs(lctx, m, 15))
				cancel()
			}
		}
		done = append(done, fr)
	}
	d.quiet(ctx, start.Add(d.duration))
	d.printf("stopping the load")
	stopLoad()
	lwg.Wait()
	end := time.Now()
	stopBG()
	wg.Wait()
	d.bg.Wait()
	if ctx.Err() != nil {
		return nil, fmt.Errorf("interrupted: %w", ctx.Err())
	}
	return d.results(start, end, done, load), nil
}

// recoveryWithin is how long after a fault healed the final state must be
// back (contract §20).
const recoveryWithin = 20 * time.Second

// restartHealthy is how long a restarted router or engine has to pass its
// healthcheck again.
const restartHealthy = time.Minute

// healTimeout bounds a heal (and the failure logs) that runs on after the
// run's context ended.
const healTimeout = 30 * time.Second

// healContext is the context of a heal: not cancelled with ctx, so that a
// paused or cut monitor is healed after Ctrl-C too, but bounded, so that it
// cannot hang.
func healContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), healTimeout)
}

// FaultResult is one injected fault and how the stack came back.
type FaultResult struct {
	Fault
	Start        time.Time     `json:"start"`
	Healed       time.Time     `json:"healed"`
	Judged       time.Time     `json:"judged"`
	Recovery     time.Duration `json:"recovery_ns,omitempty"`
	Failed       string        `json:"failed,omitempty"`
	CPU          float64       `json:"cpu_pct"`
	Inconclusive bool          `json:"inconclusive,omitempty"`
}

// inject applies one fault and heals it.
func (d *driver) inject(ctx context.Context, f Fault) (FaultResult, error) {
	fr := FaultResult{Fault: f, Start: time.Now()}
	d.printf("fault #%d: %s %s", f.N, f.Kind, f.Target)
	var err error
	switch f.Kind {
	case KillMonitor, KillRouter, KillEngine:
		d.down(f.Target)
		if err = d.st.Signal(ctx, f.Target, "KILL"); err != nil {
			return fr, err
		}
		retry.Sleep(ctx, time.Until(fr.Start.Add(f.Down)))
		err = d.st.Start(ctx, f.Target)
		d.restarted(f.Target)
	case PauseMonitor:
		d.down(f.Target)
		if err = d.st.Signal(ctx, f.Target, "STOP"); err != nil {
			return fr, err
		}
		retry.Sleep(ctx, time.Until(fr.Start.Add(f.Down)))
		hctx, cancel := healContext(ctx)
		err = d.st.Signal(hctx, f.Target, "CONT")
		cancel()
	case RestartNATS:
		d.down(f.Target)
		if err = d.st.Stop(ctx, f.Target); err != nil {
			return fr, err
		}
		retry.Sleep(ctx, f.Down)
		err = d.st.Start(ctx, f.Target)
		d.restarted(f.Target)
	case CutMonitor:
		d.down(f.Target)
		if err = d.st.Disconnect(ctx, f.Target); err != nil {
			return fr, err
		}
		retry.Sleep(ctx, time.Until(fr.Start.Add(f.Down)))
		hctx, cancel := healContext(ctx)
		err = d.st.Connect(hctx, f.Target)
		cancel()
	}
	fr.Healed = time.Now()
	if err != nil {
		return fr, err
	}
	d.printf("fault #%d healed after %v", f.N, fr.Healed.Sub(fr.Start).Round(time.Millisecond))
	switch f.Kind {
	case KillRouter, KillEngine:
		// Down until its healthcheck passes again.
		d.bg.Go(func() {
			if err := d.st.WaitHealthy(ctx, restartHealthy, f.Target); err != nil && ctx.Err() == nil {
				d.violate(Violation{At: time.Now(), Rule: RuleRecovery, Fault: f.N,
					What: fmt.Sprintf("%s not healthy within %v of its restart after fault %s: %v", f.Target, restartHealthy, f, err)})
			}
			d.up(f.Target)
		})
	default:
		d.up(f.Target)
	}
	return fr, nil
}

func (d *driver) down(s string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.downs[s] = append(d.downs[s], interval{from: time.Now()})
	d.downNow[s] = true
}

func (d *driver) up(s string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if iv := d.downs[s]; len(iv) > 0 && iv[len(iv)-1].to.IsZero() {
		iv[len(iv)-1].to = time.Now()
	}
	delete(d.downNow, s)
}

func (d *driver) restarted(s string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gen[s]++
	d.started[s] = time.Now()
}

func (d *driver) wasDown(s string, start, end time.Time) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, iv := range d.downs[s] {
		if !iv.from.After(end) && (iv.to.IsZero() || !iv.to.Before(start)) {
			return true
		}
	}
	return false
}

// RouterDown implements Downtimes.
func (d *driver) RouterDown(router string, start, end time.Time) bool {
	return d.wasDown(router, start, end)
}

// EngineDown implements Downtimes.
func (d *driver) EngineDown(start, end time.Time) bool {
	for e := range d.cfg.Engines {
		if d.wasDown(e, start, end) {
			return true
		}
	}
	return false
}

func (d *driver) violate(v Violation) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.viol = append(d.viol, v)
	d.printf("VIOLATION %s: %s", v.Rule, v.What)
}

func (d *driver) monitorsDown() map[string]bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]bool{}
	for s := range d.downNow {
		if _, ok := d.cfg.Monitors[s]; ok {
			out[s] = true
		}
	}
	return out
}

// untilFinal judges the final state every pollEvery until it holds or
// within passes: it returns how long it took, or why it never held.
func (d *driver) untilFinal(ctx context.Context, within time.Duration) (time.Duration, string, error) {
	start := time.Now()
	why := "not judged"
	for {
		s, err := d.ck.Snapshot(ctx, d.cfg.Monitors, d.monitorsDown(), d.cfg.models())
		if err != nil {
			why = err.Error()
		} else {
			var ok bool
			if ok, why = s.Final(); ok {
				return time.Since(start), "", nil
			}
		}
		if time.Since(start) > within {
			return 0, why, nil
		}
		if !retry.Sleep(ctx, pollEvery) {
			return 0, "", ctx.Err()
		}
	}
}

// quiet watches the final state until the moment until, between faults
// (contract §20: the leases and the records the whole time, not only from
// a fault to its recovery): a stretch of more than recoveryWithin without
// it, with no fault in play, is a violation. It returns false when ctx
// ended.
func (d *driver) quiet(ctx context.Context, until time.Time) bool {
	var l lostFinal
	for time.Now().Before(until) {
		why := ""
		if s, err := d.ck.Snapshot(ctx, d.cfg.Monitors, d.monitorsDown(), d.cfg.models()); err != nil {
			why = err.Error()
		} else if ok, w := s.Final(); !ok {
			why = w
		}
		if now := time.Now(); l.see(now, why, recoveryWithin) {
			d.violate(Violation{At: now, Rule: RuleLost,
				What: fmt.Sprintf("no final state since %s with no fault in play: %s", l.since.Format("15:04:05.000"), why)})
		}
		if !retry.Sleep(ctx, min(quietEvery, time.Until(until))) {
			return false
		}
	}
	return ctx.Err() == nil
}

// lostFinal follows the final state from one judgement to the next.
type lostFinal struct {
	since    time.Time // since when it has not held; zero while it holds
	reported bool      // the present stretch is reported
}

// see takes a judgement made at now (why is empty when the state was
// final) and says whether it is the one that makes the present stretch
// without the final state longer than limit: true once per stretch.
func (l *lostFinal) see(now time.Time, why string, limit time.Duration) bool {
	switch {
	case why == "":
		*l = lostFinal{}
	case l.since.IsZero():
		l.since = now
	case !l.reported && now.Sub(l.since) > limit:
		l.reported = true
		return true
	}
	return false
}

// quietEvery is how often the final state is judged between faults: less
// often than around a fault (pollEvery), where the recovery time is
// measured, since each judgement reads every lease and asks each monitor.
const quietEvery = time.Second

// poll reads the records every pollEvery.
func (d *driver) poll(ctx context.Context) {
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			d.ck.Poll(ctx, d.cfg.models())
		}
	}
}

// scrape reads the heap and goroutines of the monitors, routers and
// engines every 5 s.
func (d *driver) scrape(ctx context.Context) {
	client := &http.Client{Timeout: 2 * time.Second}
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	targets := maps.Clone(d.cfg.Monitors)
	maps.Copy(targets, d.cfg.Routers)
	maps.Copy(targets, d.cfg.EngineHTTP)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, s := range sortedKeys(targets) {
			d.mu.Lock()
			isDown, gen, started := d.downNow[s], d.gen[s], d.started[s]
			d.mu.Unlock()
			if isDown {
				continue
			}
			name := fmt.Sprintf("%s#%d", s, gen)
			v, err := scrapeGrowth(ctx, client, targets[s]+"/metrics")
			if err != nil {
				if ctx.Err() == nil {
					d.growth.Missed(name, started)
				}
				continue
			}
			d.growth.Sample(name, started, time.Now(), v)
		}
	}
}

// holders says who holds which partitions.
func holders(s Snapshot) string {
	by := map[string][]int{}
	for p, l := range s.Leases {
		by[l.Monitor] = append(by[l.Monitor], p)
	}
	var parts []string
	for _, m := range sortedKeys(by) {
		slices.Sort(by[m])
		parts = append(parts, fmt.Sprintf("%s holds %v", m, by[m]))
	}
	var recs []string
	for _, m := range s.Models {
		if r, ok := s.Records[events.ModelKey(m)]; ok {
			recs = append(recs, fmt.Sprintf("%s (partition %d) busy %v free %v by %s epoch %d",
				m, events.Partition(m, s.Partitions), r.Busy, r.Free, r.MonitorID, r.Epoch))
		}
	}
	return strings.Join(parts, ", ") + "; " + strings.Join(recs, "; ")
}
