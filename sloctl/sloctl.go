// Package sloctl runs the SLO controller of contract §18 around the pure
// package slo: every --slo-interval it takes the latency windows the
// monitor gathered, and for each model with an SLO whose partition this
// monitor holds it loads the controller's status (from <model_key>.status
// in the workermon-slo bucket on the first round of a lease, so that a
// takeover continues from it) and claims it (a compare-and-set re-put under
// its epoch, so that a late write of the previous holder fails, contract
// §10), moves the thresholds (slo.Next), writes the status by
// compare-and-set under the partition's epoch, and under `enforce` hands
// the thresholds to the monitor. Under `shadow`, and when an SLO is
// deleted, the monitor gets the model back (its override and the defaults
// apply again).
//
// No lock is held across a bucket call: a round reads and writes the
// bucket on its own, and takes the controller's lock only to check that a
// model's SLO did not change meanwhile and to hand thresholds to the
// monitor, so that SetSLO (the API, the bucket's watcher) never waits for
// a round's writes, and waits for the rest no longer than its ctx allows.
package sloctl

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/promreg"
	"github.com/workermon/workermon/internal/retry"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/slo"
)

// DefaultInterval is --slo-interval: at most one move per interval.
const DefaultInterval = 2 * time.Second

// DefaultMaxSLOs is --max-slos: the most models with an SLO, each a status
// write every interval and a few metric series (the monitor's
// --max-models by default).
const DefaultMaxSLOs = overrides.DefaultMaxSLOs

// maxBackoff caps the wait between rounds while the SLO bucket cannot be
// reached.
const maxBackoff = 30 * time.Second

// claimAttempts bounds the compare-and-set attempts of claiming a status
// that keeps changing.
const claimAttempts = 8

// bucketError marks a failure to reach the SLO bucket (not a conflict, not
// a bad value): every other model's call would wait for the same timeout,
// so the round stops there and Run backs off.
type bucketError struct{ err error }

func (e bucketError) Error() string { return e.err.Error() }
func (e bucketError) Unwrap() error { return e.err }

func isBucketError(err error) bool {
	var b bucketError
	return errors.As(err, &b)
}

// Errors.
var (
	ErrInvalidConfig = errors.New("invalid slo controller config")
)

// Monitor is what the controller needs of the monitor; *monitor.Monitor
// implements it. Loads gives the leading inputs (contract §21): each rank's
// preemption counter and predicted queue delay, read once per round for
// each model the controller holds.
type Monitor interface {
	DrainLatency(ctx context.Context) (map[string]*slo.Window, error)
	SetControlled(ctx context.Context, model string, t *slo.Thresholds) error
	BaseThresholds(ctx context.Context, model string) (events.Thresholds, error)
	Loads(ctx context.Context, model string) ([]monitor.LoadRow, error)
}

// Store is the status part of the SLO bucket; *overrides.SLOStore
// implements it.
type Store interface {
	Status(ctx context.Context, model string) (overrides.SLOStatus, uint64, error)
	PutStatus(ctx context.Context, st overrides.SLOStatus, rev uint64) (uint64, error)
}

// Config configures a Controller.
type Config struct {
	Monitor Monitor
	Store   Store
	// Controller bounds and shapes the moves (--slo-decode-range,
	// --slo-prefill-range).
	Controller slo.Config
	// Interval is --slo-interval. > 0.
	Interval time.Duration
	// MaxSLOs is --max-slos: SetSLO refuses a model beyond it with
	// overrides.ErrTooManySLOs. > 0.
	MaxSLOs int
	// Partitions is --partitions.
	Partitions int
	// Epoch returns the epoch of partition p while this monitor may write
	// it, 0 otherwise (busylist.Leaser.Epoch). Required.
	Epoch     func(p int) uint64
	MonitorID string
	// Now is the clock of updated_at; nil means time.Now.
	Now        func() time.Time
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// DefaultConfig returns a Config with the defaults of §18.
func DefaultConfig() Config {
	return Config{Controller: slo.DefaultConfig(), Interval: DefaultInterval, MaxSLOs: DefaultMaxSLOs, Partitions: 1}
}

// Validate reports every problem of c.
func (c Config) Validate() error {
	var errs []error
	if c.Monitor == nil {
		errs = append(errs, errors.New("monitor is nil"))
	}
	if c.Store == nil {
		errs = append(errs, errors.New("store is nil"))
	}
	if c.Epoch == nil {
		errs = append(errs, errors.New("epoch is nil"))
	}
	if c.Interval <= 0 {
		errs = append(errs, fmt.Errorf("interval %v must be positive", c.Interval))
	}
	if c.MaxSLOs < 1 {
		errs = append(errs, fmt.Errorf("max slos %d must be at least 1", c.MaxSLOs))
	}
	if c.Partitions < 1 {
		errs = append(errs, fmt.Errorf("partitions %d must be at least 1", c.Partitions))
	}
	if err := c.Controller.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sloctl: %w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// held is the controller's state of a model it controls here.
type held struct {
	status overrides.SLOStatus
	rev    uint64
	epoch  uint64
	// gen is the generation of the SLO it was taken up under: a change of
	// the SLO since makes the next round take the model up again.
	gen uint64
	// pool adds up the windows of intervals with too few samples (kept in
	// memory only: a new holder starts pooling again).
	pool slo.Pool
	// preempts are the preemption counters of the model's ranks at the
	// last round whose status landed (kept in memory only: a new holder
	// counts from its first round).
	preempts map[rankKey]counter
	// reread is set when a status write failed (another writer, or the
	// bucket away): the next round reads and claims the status again,
	// counting the preemptions from preempts still.
	reread bool
}

// rankKey names a rank of a model.
type rankKey struct {
	worker uint64
	rank   uint32
}

// counter is a rank's preemption counter as last read, with the boot of
// the engine that counts it.
type counter struct {
	boot, value uint64
}

// slot is a model's SLO as the controller has it, with the generation of
// its last change.
type slot struct {
	v   overrides.SLO
	gen uint64
}

// Controller runs the SLO controllers of the models this monitor holds.
type Controller struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	// errs logs the failures of rounds at a limited rate (under rounds).
	errs *retry.ErrLog

	// rounds orders the rounds and take-ups (Run's loop, Round, Adopt);
	// held is theirs.
	rounds sync.Mutex
	held   map[string]*held

	// lock (a channel of one, so that it is taken with a ctx) guards what
	// follows. It is held for in-memory work and the monitor's calls only,
	// never across a call of the bucket.
	lock chan struct{}
	slos map[string]slot
	gen  uint64 // the last generation given
	// applied are the models whose thresholds this controller handed to
	// the monitor.
	applied map[string]bool
	// unreleased are the models whose SLO was deleted or put in shadow
	// mode but whose thresholds the monitor could not be given back then
	// (SetSLO's ctx ended, the monitor busy): Adopt and Round retry.
	unreleased map[string]bool

	// observed is the best latency each model's fleet has shown, from
	// every model's windows, with or without an SLO (under obsMu, apart
	// from mu: a round holds mu through its bucket writes, and the API
	// reads observed).
	obsMu    sync.Mutex
	observed map[string]*observedModel
}

// observedModel is a model's slo.Observed and when its last window came.
type observedModel struct {
	slo.Observed
	heard time.Time
}

const (
	// maxObserved bounds the models whose observed latency is kept; a
	// model beyond waits until one is forgotten.
	maxObserved = 4096
	// observedForget is how long the observed latency of a model whose
	// windows stopped is kept.
	observedForget = 24 * time.Hour
)

// New checks cfg and returns a Controller with its metrics registered.
func New(cfg Config) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Controller{cfg: cfg, log: cfg.Logger, lock: make(chan struct{}, 1), slos: map[string]slot{},
		held: map[string]*held{}, applied: map[string]bool{}, unreleased: map[string]bool{},
		observed: map[string]*observedModel{}}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	c.metrics = m
	c.errs = retry.NewErrLog(c.log, slog.LevelWarn, "slo: controller round")
	return c, nil
}

// acquire takes the controller's lock, or gives up when ctx ends first.
func (c *Controller) acquire(ctx context.Context) error {
	select {
	case c.lock <- struct{}{}:
		return nil
	default:
	}
	select {
	case c.lock <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("sloctl: wait for the controller: %w", ctx.Err())
	}
}

func (c *Controller) unlock() { <-c.lock }

// SetSLO records a change of a model's SLO (the bucket's watcher and the
// API call it). A deleted SLO, or one in shadow mode, gives the model's
// thresholds back to the monitor at once; when that fails, the controller
// gives them back later (Adopt, Round), until it succeeds. A new model
// beyond Config.MaxSLOs is refused with overrides.ErrTooManySLOs. It waits
// for no call of the bucket, and for the rest (a round handing thresholds
// to the monitor) no longer than ctx allows.
func (c *Controller) SetSLO(ctx context.Context, model string, v overrides.SLO, deleted bool) error {
	if err := c.acquire(ctx); err != nil {
		return err
	}
	defer c.unlock()
	if deleted {
		delete(c.slos, model)
		delete(c.applied, model)
		c.metrics.forget(model)
	} else {
		if _, ok := c.slos[model]; !ok && len(c.slos) >= c.cfg.MaxSLOs {
			return fmt.Errorf("sloctl: slo of %q: the controller has %d SLOs, the most allowed (--max-slos): %w",
				model, len(c.slos), overrides.ErrTooManySLOs)
		}
		c.gen++
		c.slos[model] = slot{v: v, gen: c.gen}
	}
	delete(c.unreleased, model)
	if deleted || !v.Enforced() {
		if err := c.cfg.Monitor.SetControlled(ctx, model, nil); err != nil {
			c.unreleased[model] = true
			return err
		}
	}
	return nil
}

// current reports whether model's SLO is still the one of generation gen.
// Under lock.
func (c *Controller) current(model string, gen uint64) bool {
	s, ok := c.slos[model]
	return ok && s.gen == gen
}

// snapshot returns the SLOs to work on, after the give-backs SetSLO could
// not make (whose first failure it reports), and forgets the held state of
// the models whose SLO is gone.
func (c *Controller) snapshot(ctx context.Context) (map[string]slot, error) {
	if err := c.acquire(ctx); err != nil {
		return nil, err
	}
	defer c.unlock()
	err := c.giveBack(ctx)
	for model := range c.held {
		if _, ok := c.slos[model]; !ok {
			delete(c.held, model)
		}
	}
	return maps.Clone(c.slos), err
}

// giveBack retries the give-backs SetSLO could not make. It reports the
// first failure. Under lock.
func (c *Controller) giveBack(ctx context.Context) error {
	for model := range c.unreleased {
		if s, ok := c.slos[model]; ok && s.v.Enforced() {
			delete(c.unreleased, model) // enforced again since
			continue
		}
		if err := c.cfg.Monitor.SetControlled(ctx, model, nil); err != nil {
			return fmt.Errorf("give model %q's thresholds back: %w", model, err)
		}
		delete(c.unreleased, model)
	}
	return nil
}

// Run runs a round every Interval until ctx ends, and between rounds
// takes up the models of newly held partitions (Adopt) every tenth of it.
// While the SLO bucket cannot be reached it waits a capped backoff (from
// Interval up to 30 s) before the next round or take-up.
func (c *Controller) Run(ctx context.Context) error {
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	adopt := time.NewTicker(max(c.cfg.Interval/10, 50*time.Millisecond))
	defer adopt.Stop()
	bo := retry.NewBackoff(c.cfg.Interval, max(c.cfg.Interval, maxBackoff))
	var resume time.Time
	after := func(ok bool) {
		if ok {
			bo.Reset()
			resume = time.Time{}
			return
		}
		resume = time.Now().Add(bo.Next())
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case now := <-t.C:
			if now.Before(resume) {
				continue
			}
			after(c.round(ctx))
		case now := <-adopt.C:
			if now.Before(resume) {
				continue
			}
			if !c.adoptAll(ctx) {
				after(false)
			}
		}
	}
}

// Round drains the latency windows and moves every held model's
// thresholds once. When the SLO bucket cannot be reached the round stops
// at the first model that finds it so (the others keep their thresholds
// and move next round), so as not to spend a timeout per model.
func (c *Controller) Round(ctx context.Context) { c.round(ctx) }

// round is Round; it reports false when the SLO bucket could not be
// reached.
func (c *Controller) round(ctx context.Context) bool {
	c.rounds.Lock()
	defer c.rounds.Unlock()
	windows, err := c.cfg.Monitor.DrainLatency(ctx)
	if err == nil {
		c.observe(windows)
	}
	if err != nil {
		c.errs.Fail(fmt.Errorf("read the latency windows: %w", err))
		return true
	}
	slos, first := c.snapshot(ctx)
	failed, skipped := 0, 0
	if first != nil {
		failed++
	}
	for model, s := range slos {
		if first != nil && isBucketError(first) {
			skipped++
			continue
		}
		if err := c.step(ctx, model, s, windows[model]); err != nil {
			failed++
			if first == nil || isBucketError(err) {
				first = fmt.Errorf("model %q: %w", model, err)
			}
		}
	}
	if failed > 0 {
		c.errs.Fail(first, "models_failed", failed, "models_skipped", skipped)
		return !isBucketError(first)
	}
	c.errs.OK()
	return true
}

// observe adds a round's windows to the models' observed latency, and
// forgets the models not heard for observedForget.
func (c *Controller) observe(windows map[string]*slo.Window) {
	now := c.cfg.Now()
	c.obsMu.Lock()
	defer c.obsMu.Unlock()
	for model, w := range windows {
		o := c.observed[model]
		if o == nil {
			if len(c.observed) >= maxObserved {
				continue
			}
			o = &observedModel{}
			c.observed[model] = o
		}
		o.Add(w)
		o.heard = now
	}
	for model, o := range c.observed {
		if now.Sub(o.heard) > observedForget {
			delete(c.observed, model)
		}
	}
}

// Observed returns the best latency model's fleet has shown in the
// windows of the rounds so far, with an SLO or without (slo.Observed), and
// whether a window of it came. The windows are those of the models whose
// partition this monitor holds (their latency subjects are mapped like
// their load); a model not heard for a day is forgotten.
func (c *Controller) Observed(model string) (slo.Observed, bool) {
	c.obsMu.Lock()
	defer c.obsMu.Unlock()
	if o := c.observed[model]; o != nil {
		return o.Observed, true
	}
	return slo.Observed{}, false
}

// step moves one model's thresholds: the bucket calls without the lock,
// then, under it, the thresholds to the monitor unless the SLO changed
// meanwhile (the next round takes it up again).
func (c *Controller) step(ctx context.Context, model string, s slot, w *slo.Window) error {
	epoch := c.cfg.Epoch(events.Partition(model, c.cfg.Partitions))
	h := c.held[model]
	if epoch == 0 {
		// Not held (or the partition went to another monitor, which
		// continues from the status).
		return c.release(ctx, model)
	}
	if h == nil || h.reread || h.epoch != epoch || h.gen != s.gen {
		var err error
		if h, err = c.adopt(ctx, model, s, epoch); h == nil || err != nil {
			return err
		}
	}
	v := s.v
	if w == nil {
		w = &slo.Window{}
	}
	lw := *w
	preempts, err := c.leading(ctx, model, h.preempts, &lw)
	if err != nil {
		return err
	}
	w = h.pool.Window(v.Target(), &lw) // pools the latency, never the leading inputs
	next, move := slo.Next(c.cfg.Controller, v.Target(), h.status.Controller, w)
	h.pool.After(v.Target(), next, w)
	st := overrides.SLOStatus{
		Model: model, State: next.State, Suggested: next.Suggested, Measured: next.Measured,
		UpdatedAt: c.cfg.Now().UnixNano(), MonitorID: c.cfg.MonitorID, Epoch: epoch, Controller: next,
	}
	if v.Enforced() {
		applied := next.Suggested
		st.Applied = &applied
	}
	rev, err := c.cfg.Store.PutStatus(ctx, st, h.rev)
	if err != nil {
		// Another writer, or the bucket away: read it again next round,
		// the preemptions since the baseline counted then.
		h.reread = true
		if !errors.Is(err, overrides.ErrStatusConflict) && !errors.Is(err, overrides.ErrBadSLO) {
			return bucketError{err}
		}
		return err
	}
	h.status, h.rev, h.preempts = st, rev, preempts
	if err := c.acquire(ctx); err != nil {
		return err
	}
	defer c.unlock()
	if !c.current(model, s.gen) {
		delete(c.held, model) // changed or deleted meanwhile: taken up again next round
		return nil
	}
	var th *slo.Thresholds
	if v.Enforced() {
		th = st.Applied
	}
	if err := c.cfg.Monitor.SetControlled(ctx, model, th); err != nil {
		return err
	}
	c.applied[model] = th != nil
	c.metrics.observe(model, st, move)
	if c.log.Enabled(ctx, slog.LevelDebug) {
		c.log.Debug("slo: round", "model", model, "state", st.State, "move", int(move),
			"decode", st.Suggested.Decode, "prefill", st.Suggested.Prefill,
			"kv_committed", st.Suggested.KVCommitted, "queue_delay_ms", st.Suggested.QueueDelayMs,
			"ttft_samples", st.Measured.TTFTSamples, "itl_samples", st.Measured.ITLSamples,
			"rejected", st.Measured.Rejected, "preemptions", st.Measured.Preemptions, "queue_delay_measured_ms", fmtDelay(st.Measured.QueueDelayMs))
	}
	return nil
}

// leading fills w's leading inputs (contract §21) from the monitor's view
// of model's ranks: the preemptions counted since last (a rank's first
// reading, or its engine's new boot, sets the baseline and counts nothing;
// a counter that went down counts from 0) and the largest predicted queue
// delay of the fresh ranks now. It returns the counters read, the baseline
// once the round's status lands.
func (c *Controller) leading(ctx context.Context, model string, last map[rankKey]counter, w *slo.Window) (map[rankKey]counter, error) {
	rows, err := c.cfg.Monitor.Loads(ctx, model)
	if err != nil {
		return nil, fmt.Errorf("read the leading values: %w", err)
	}
	next := make(map[rankKey]counter, len(rows))
	for _, r := range rows {
		if r.Stale {
			continue
		}
		if r.QueueDelayMs != nil && *r.QueueDelayMs > w.QueueDelayMs {
			w.QueueDelayMs = *r.QueueDelayMs
		}
		if r.Preemptions == nil {
			continue
		}
		k := rankKey{r.WorkerID, r.DPRank}
		now := counter{boot: r.Sources[events.SourceEngine].BootID, value: *r.Preemptions}
		next[k] = now
		if before, ok := last[k]; ok && before.boot == now.boot && now.value >= before.value {
			w.Preemptions = slo.AddCount(w.Preemptions, now.value-before.value)
		}
	}
	return next, nil
}

// adopt starts controlling a model whose partition this monitor holds
// under epoch: from its status in the bucket (a takeover continues from
// there), else from the monitor's thresholds clamped into the ranges. It
// claims the status first (contract §10, as the busy records are claimed):
// a compare-and-set re-put as found with this monitor's id and epoch,
// updated_at kept, or a create of the first status, retried with the
// status as found again when the compare-and-set fails; from then on a
// late write of the previous holder fails. Under enforce a found status's
// thresholds apply at once, before the first move. It returns nil when a
// newer holder writes the status, and gives the model up (release) when
// the status changed through claimAttempts compare-and-sets.
func (c *Controller) adopt(ctx context.Context, model string, s slot, epoch uint64) (*held, error) {
	old := c.held[model]
	st, rev, err := c.cfg.Store.Status(ctx, model)
	found := false
	for attempt := 0; ; attempt++ {
		if err != nil && !errors.Is(err, overrides.ErrBadSLO) {
			return nil, bucketError{err}
		}
		good := rev != 0 && err == nil // a status that decodes
		if good && (st.Epoch > epoch || st.Epoch == epoch && st.MonitorID != c.cfg.MonitorID) {
			return nil, c.release(ctx, model) // a newer holder writes it
		}
		found = good && st.Controller.Step != 0
		if good && st.Epoch == epoch {
			break // claimed by this monitor already (the SLO changed since)
		}
		claim := st
		if !found {
			base, err := c.cfg.Monitor.BaseThresholds(ctx, model)
			if err != nil {
				return nil, err
			}
			start := slo.Start(c.cfg.Controller, slo.Base{Decode: base.ActiveDecodeBlocks, Prefill: base.ActivePrefillTokens,
				KVCommitted: base.KVCommitted, QueueDelayMs: base.QueueDelayMs})
			claim = overrides.SLOStatus{Model: model, State: start.State, Suggested: start.Suggested,
				UpdatedAt: c.cfg.Now().UnixNano(), Controller: start}
		}
		claim.MonitorID, claim.Epoch = c.cfg.MonitorID, epoch
		nrev, perr := c.cfg.Store.PutStatus(ctx, claim, rev)
		if perr == nil {
			st, rev = claim, nrev
			break
		}
		if !errors.Is(perr, overrides.ErrStatusConflict) {
			return nil, bucketError{perr}
		}
		if attempt+1 >= claimAttempts {
			// Give the model up rather than leave the thresholds of a
			// previous hold in force uncontrolled; the next round or
			// take-up tries again.
			err := fmt.Errorf("claim the status: it kept changing through %d attempts: %w", claimAttempts, perr)
			return nil, errors.Join(err, c.release(ctx, model))
		}
		st, rev, err = c.cfg.Store.Status(ctx, model) // claim it as it is now
	}
	h := &held{status: st, rev: rev, epoch: epoch, gen: s.gen}
	if old != nil && old.epoch == epoch {
		h.preempts = old.preempts // held all along: its count goes on
	}
	c.held[model] = h
	if !s.v.Enforced() || !found {
		return h, nil
	}
	if err := c.acquire(ctx); err != nil {
		return h, err
	}
	defer c.unlock()
	if !c.current(model, s.gen) {
		delete(c.held, model)
		return nil, nil
	}
	applied := st.Controller.Suggested
	if err := c.cfg.Monitor.SetControlled(ctx, model, &applied); err != nil {
		return h, err
	}
	c.applied[model] = true
	return h, nil
}

// Adopt takes up, without moving them, the models whose partition this
// monitor has come to hold since the last round, so that their thresholds
// apply as soon as the partition is held rather than at the next round;
// Run calls it between rounds. Taking a model up claims its status.
// It stops at the first model that finds the SLO bucket unreachable.
func (c *Controller) Adopt(ctx context.Context) { c.adoptAll(ctx) }

// adoptAll is Adopt; it reports false when the SLO bucket could not be
// reached.
func (c *Controller) adoptAll(ctx context.Context) bool {
	c.rounds.Lock()
	defer c.rounds.Unlock()
	slos, err := c.snapshot(ctx)
	if err != nil {
		c.errs.Fail(err)
	}
	for model, s := range slos {
		epoch := c.cfg.Epoch(events.Partition(model, c.cfg.Partitions))
		if h := c.held[model]; epoch == 0 || h != nil && h.epoch == epoch && h.gen == s.gen {
			continue
		}
		if _, err := c.adopt(ctx, model, s, epoch); err != nil {
			c.errs.Fail(fmt.Errorf("take up model %q: %w", model, err))
			if isBucketError(err) {
				return false
			}
		}
	}
	return true
}

// release forgets a model this monitor no longer controls and gives its
// thresholds back to the monitor.
func (c *Controller) release(ctx context.Context, model string) error {
	delete(c.held, model)
	if err := c.acquire(ctx); err != nil {
		return err
	}
	defer c.unlock()
	if _, ok := c.applied[model]; !ok {
		return nil
	}
	delete(c.applied, model)
	c.metrics.forget(model)
	return c.cfg.Monitor.SetControlled(ctx, model, nil)
}

// metrics are the controller's Prometheus collectors (contract §18).
type metrics struct {
	threshold  *prometheus.GaugeVec
	attainment *prometheus.GaugeVec
	moves      *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		threshold: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_slo_threshold",
			Help: "Thresholds the SLO controller holds for a model, on the monitor that holds it: applied under enforce, suggested under shadow (threshold decode, prefill, kv_committed or queue_delay).",
		}, []string{"model", "threshold"}),
		attainment: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_slo_attainment",
			Help: "Share of the last interval's samples at or under the target, by signal (ttft, itl).",
		}, []string{"model", "signal"}),
		moves: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_slo_moves_total",
			Help: "Moves of the SLO controller by direction (up, down).",
		}, []string{"model", "direction"}),
	}
	if reg != nil {
		if err := promreg.All(reg, m.threshold, m.attainment, m.moves); err != nil {
			return nil, fmt.Errorf("sloctl: metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) observe(model string, st overrides.SLOStatus, move slo.Move) {
	m.threshold.WithLabelValues(model, "decode").Set(st.Suggested.Decode)
	m.threshold.WithLabelValues(model, "prefill").Set(float64(st.Suggested.Prefill))
	m.threshold.WithLabelValues(model, "kv_committed").Set(st.Suggested.KVCommitted)
	m.threshold.WithLabelValues(model, "queue_delay").Set(float64(st.Suggested.QueueDelayMs))
	set := func(signal string, a *float64) {
		if a == nil {
			m.attainment.DeleteLabelValues(model, signal)
			return
		}
		m.attainment.WithLabelValues(model, signal).Set(*a)
	}
	set("ttft", st.Measured.TTFTAttainment)
	set("itl", st.Measured.ITLAttainment)
	switch move {
	case +1:
		m.moves.WithLabelValues(model, "up").Inc()
	case -1:
		m.moves.WithLabelValues(model, "down").Inc()
	}
}

// forget drops a model's series when this monitor no longer controls it:
// the moves too, or the series of every model ever controlled would stay
// for the life of the process.
func (m *metrics) forget(model string) {
	m.threshold.DeletePartialMatch(prometheus.Labels{"model": model})
	m.attainment.DeletePartialMatch(prometheus.Labels{"model": model})
	m.moves.DeletePartialMatch(prometheus.Labels{"model": model})
}

// fmtDelay is a measured queue delay for the log: "-" when unknown.
func fmtDelay(d *float64) string {
	if d == nil {
		return "-"
	}
	return fmt.Sprintf("%.0f", *d)
}
