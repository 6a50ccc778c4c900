package watch

import (
	"context"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/workermon/workermon/monitor"
)

// Unknown stands for a leading value the monitor does not know (yet): never
// 0, which would read as "no queue" or "no preemption".
const Unknown = "–"

// Leading is one worker's leading values (contract §21) as the watch shows
// them, from the rows of the monitor's GET /loads; nil is unknown.
type Leading struct {
	// QueueDelayMs is the predicted queue delay of the worker's slowest
	// rank, in milliseconds: the largest over its fresh ranks.
	QueueDelayMs *float64
	// PrefillRate is the worker's prompt tokens computed per second: the
	// sum over its fresh ranks that have one.
	PrefillRate *float64
	// PreemptionRate is the worker's preemptions per second: the sum over
	// its fresh ranks that have one.
	PreemptionRate *float64
}

// LeadingOf folds the rank rows of GET /loads into each worker's values,
// by model and worker id. Stale ranks are left out: their values are no
// longer the worker's (a worker with no fresh rank has none).
func LeadingOf(rows []monitor.LoadRow) map[string]map[uint64]Leading {
	out := map[string]map[uint64]Leading{}
	for i := range rows {
		r := &rows[i]
		if r.Stale {
			continue
		}
		ws := out[r.Model]
		if ws == nil {
			ws = map[uint64]Leading{}
			out[r.Model] = ws
		}
		l := ws[r.WorkerID]
		l.QueueDelayMs = fold(l.QueueDelayMs, r.QueueDelayMs, math.Max)
		l.PrefillRate = fold(l.PrefillRate, r.PrefillRate, add)
		l.PreemptionRate = fold(l.PreemptionRate, r.PreemptionRate, add)
		ws[r.WorkerID] = l
	}
	return out
}

func add(a, b float64) float64 { return a + b }

// fold combines two optional values: unknown only when both are.
func fold(acc, v *float64, f func(a, b float64) float64) *float64 {
	switch {
	case v == nil:
		return acc
	case acc == nil:
		x := *v
		return &x
	}
	x := f(*acc, *v)
	return &x
}

// FormatDelay renders a predicted queue delay: 399ms, 12.3s, 95s; Unknown
// for nil.
func FormatDelay(ms *float64) string {
	switch {
	case ms == nil || math.IsNaN(*ms):
		return Unknown
	case math.Round(*ms) < 1000:
		return strconv.FormatFloat(math.Round(*ms), 'f', 0, 64) + "ms"
	case *ms < 59_950:
		return strconv.FormatFloat(*ms/1000, 'f', 1, 64) + "s"
	}
	return strconv.FormatFloat(*ms/1000, 'f', 0, 64) + "s"
}

// FormatPrefillRate renders a prefill rate in whole tokens per second:
// 6013tok/s; Unknown for nil.
func FormatPrefillRate(r *float64) string {
	if r == nil || math.IsNaN(*r) {
		return Unknown
	}
	return strconv.FormatFloat(*r, 'f', 0, 64) + "tok/s"
}

// FormatPreemptionRate renders a preemption rate in hundredths per second:
// 0.25/s; Unknown for nil.
func FormatPreemptionRate(r *float64) string {
	if r == nil || math.IsNaN(*r) {
		return Unknown
	}
	return strconv.FormatFloat(*r, 'f', 2, 64) + "/s"
}

// Loads is what the watch last read of the monitor's GET /loads, and how
// the reading goes. Immutable once published.
type Loads struct {
	// From names where the loads are read (credentials redacted).
	From string
	// Workers are the leading values by model and worker id, as of At;
	// nil before the first reading, and again once the last good reading
	// is older than the stale-after of the watch.
	Workers map[string]map[uint64]Leading
	// At is when Workers was read (the watch's clock); zero before the
	// first good reading.
	At time.Time
	// Err is the last reading's error, printable; empty when it succeeded.
	Err string
	// FailingSince is when the readings began to fail, while Err is set.
	FailingSince time.Time
}

// worker returns the values of a model's worker; all unknown when l is nil
// or does not know it.
func (l *Loads) worker(model string, id uint64) Leading {
	if l == nil {
		return Leading{}
	}
	return l.Workers[model][id]
}

// poller reads GET /loads every interval and publishes what it read.
type poller struct {
	read       func(ctx context.Context, model string) ([]monitor.LoadRow, error)
	model      string
	every      time.Duration
	timeout    time.Duration
	staleAfter time.Duration
	now        func() time.Time
	log        *slog.Logger
	cur        atomic.Pointer[Loads] // never nil once newPoller returned
	changed    chan<- struct{}       // capacity 1: a reading is worth a redraw
}

func newPoller(cfg Config, log *slog.Logger, changed chan<- struct{}) *poller {
	p := &poller{read: cfg.Loads, model: cfg.Model, every: cfg.LoadsEvery, timeout: cfg.LoadsTimeout,
		staleAfter: cfg.StaleAfter, now: cfg.Now, log: log, changed: changed}
	p.cur.Store(&Loads{From: cfg.LoadsFrom})
	return p
}

// run reads at once and then every interval until ctx ends.
func (p *poller) run(ctx context.Context) {
	tick := time.NewTicker(p.every)
	defer tick.Stop()
	for {
		p.poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// poll reads once, within the timeout, and publishes the outcome. A
// failure is logged when the readings begin to fail and the recovery when
// they succeed again, never once per reading: the screen's status line
// shows the failure meanwhile.
func (p *poller) poll(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, p.timeout)
	rows, err := p.read(rctx, p.model)
	cancel()
	if ctx.Err() != nil {
		return // stopping: not a failure of the monitor
	}
	now := p.now()
	prev := p.cur.Load()
	next := &Loads{From: prev.From, Workers: prev.Workers, At: prev.At}
	if err != nil {
		next.Err, next.FailingSince = printable(err.Error()), prev.FailingSince
		if prev.Err == "" {
			next.FailingSince = now
			p.log.Warn("watch: cannot read the monitor's loads; retrying every "+p.every.String(), "from", prev.From, "err", err)
		}
		if next.At.IsZero() || now.Sub(next.At) > p.staleAfter {
			next.Workers = nil // too old to show as the present
		}
	} else {
		if prev.Err != "" {
			p.log.Info("watch: reading the monitor's loads again", "from", prev.From, "failed_for", now.Sub(prev.FailingSince).Round(time.Millisecond))
		}
		next.Workers, next.At = LeadingOf(rows), now
	}
	p.cur.Store(next)
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// printable returns s with every rune that does not print (newlines,
// terminal escapes, invalid UTF-8) escaped as Go would: an error may quote
// what a monitor answered.
func printable(s string) string {
	if !strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) || r == unicode.ReplacementChar }) {
		return s
	}
	q := strconv.Quote(s)
	return q[1 : len(q)-1]
}
