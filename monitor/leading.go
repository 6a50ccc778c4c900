package monitor

import (
	"time"

	"github.com/workermon/workermon/events"
)

// DefaultRateWindow is how much monitor-clock time the prefill and
// preemption rates are measured over (contract §21, --rate-window).
const DefaultRateWindow = 5 * time.Second

// rateSpans is how many spans a window is cut into at most (more exactly,
// a span shorter than window ÷ rateSpans takes the next one in), so that a
// rank's window costs a few hundred bytes however often it reports.
const rateSpans = 16

// rateSpan is a stretch of monitor-clock time and a counter's increase over
// it.
type rateSpan struct {
	dt time.Duration
	dv uint64
}

// rateWindow is a counter's increases over the latest spans of time that
// cover a window: the spans it was given, newest last, the oldest dropped
// once the others cover the window without it.
type rateWindow struct {
	spans []rateSpan
	total time.Duration
}

// add appends a span of dt in which the counter rose by dv.
func (rw *rateWindow) add(dt time.Duration, dv uint64, window time.Duration) {
	if n := len(rw.spans); n > 0 && rw.spans[n-1].dt < window/rateSpans {
		last := &rw.spans[n-1]
		last.dt += dt
		last.dv = addCapped(last.dv, dv)
	} else {
		rw.spans = append(rw.spans, rateSpan{dt: dt, dv: dv})
	}
	rw.total += dt
	drop := 0
	for drop < len(rw.spans)-1 && rw.total-rw.spans[drop].dt >= window {
		rw.total -= rw.spans[drop].dt
		drop++
	}
	if drop > 0 {
		rw.spans = append(rw.spans[:0], rw.spans[drop:]...)
	}
}

// rate is the counter's increase per second over the last window of the
// spans' time, the oldest span counted in proportion to its part inside
// the window; ok is false with no time measured. It reads nothing but rw.
func (rw *rateWindow) rate(window time.Duration) (perSecond float64, ok bool) {
	if rw.total <= 0 {
		return 0, false
	}
	var sum float64
	for i, sp := range rw.spans {
		v := float64(sp.dv)
		if i == 0 && rw.total > window && sp.dt > 0 {
			v *= float64(sp.dt-(rw.total-window)) / float64(sp.dt)
		}
		sum += v
	}
	return sum / min(rw.total, window).Seconds(), true
}

// reset forgets every span, keeping the array.
func (rw *rateWindow) reset() {
	rw.spans, rw.total = rw.spans[:0], 0
}

func addCapped(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}

// leadingSample is what one evaluation of a fresh rank sees of the values
// the leading signals derive from (contract §21): the engine's counters and
// the merged active prefill tokens.
type leadingSample struct {
	prefilled, preemptions events.Optional
	activePrefill          uint64
}

// rankLeading derives a rank's leading values (contract §21) from the
// samples of its evaluations, each taken at a monitor-clock instant and
// held until the next:
//   - the prefill rate: prefilled_tokens' increases over the last window of
//     time in which the held active_prefill_tokens was above 0, however
//     long ago (idle time adds nothing and takes nothing away);
//   - the preemption rate: preemptions' increases over the last window of
//     time.
//
// A stretch between two samples longer than maxGap (the rank was stale)
// counts for neither. It is pure: time comes in with each sample.
type rankLeading struct {
	rank     uint32
	at       time.Time // the last sample's, zero before the first
	last     leadingSample
	prefill  rateWindow // spans in which active_prefill_tokens > 0
	preempts rateWindow // every span
}

// observe takes the sample s at now.
func (d *rankLeading) observe(now time.Time, s leadingSample, window, maxGap time.Duration) {
	if !d.at.IsZero() {
		if dt := now.Sub(d.at); dt >= 0 && dt <= maxGap {
			p, q := d.last.prefilled, s.prefilled
			if d.last.activePrefill > 0 && p.Set && q.Set && q.Value >= p.Value {
				d.prefill.add(dt, q.Value-p.Value, window)
			}
			p, q = d.last.preemptions, s.preemptions
			if p.Set && q.Set && q.Value >= p.Value {
				d.preempts.add(dt, q.Value-p.Value, window)
			}
		}
	}
	d.at, d.last = now, s
}

// prefillRate is the prefill rate in tokens per second; ok is false until
// a prefilled token has been measured in the window's time (then the rate
// is unknown, and so is the queue delay).
func (d *rankLeading) prefillRate(window time.Duration) (float64, bool) {
	r, ok := d.prefill.rate(window)
	return r, ok && r > 0
}

// queueDelay is the predicted queue delay in milliseconds, active prefill
// tokens ÷ the prefill rate; ok is false while the rate is unknown.
func (d *rankLeading) queueDelay(activePrefill uint64, window time.Duration) (float64, bool) {
	r, ok := d.prefillRate(window)
	if !ok {
		return 0, false
	}
	return float64(activePrefill) / r * 1000, true
}

// preemptionRate is the preemptions per second over the last window; ok is
// false before two samples with the counter.
func (d *rankLeading) preemptionRate(window time.Duration) (float64, bool) {
	return d.preempts.rate(window)
}

// leadingRank returns w's derived state of rank r, adding it when absent
// (the first one for the boot of w's engine source). The pointer is valid
// until the next rank is added.
func (w *worker) leadingRank(r uint32) *rankLeading {
	if len(w.leading) == 0 {
		if src := w.source(events.SourceEngine); src != nil {
			w.leadingBoot = src.bootID
		}
	}
	lo, hi := 0, len(w.leading)
	for lo < hi {
		h := int(uint(lo+hi) >> 1)
		if w.leading[h].rank < r {
			lo = h + 1
		} else {
			hi = h
		}
	}
	if lo == len(w.leading) || w.leading[lo].rank != r {
		w.leading = append(w.leading, rankLeading{})
		copy(w.leading[lo+1:], w.leading[lo:])
		w.leading[lo] = rankLeading{rank: r}
	}
	return &w.leading[lo]
}

// findLeading returns w's derived state of rank r, or nil.
func (w *worker) findLeading(r uint32) *rankLeading {
	for i := range w.leading {
		if w.leading[i].rank == r {
			return &w.leading[i]
		}
	}
	return nil
}

// checkLeadingBoot forgets w's derived values when its engine source
// restarted (a new boot_id): the counters start again, and the rates are
// unknown until measured anew (contract §21). It also drops the ranks the
// engine no longer declares.
func (w *worker) checkLeadingBoot() {
	src := w.source(events.SourceEngine)
	if src == nil {
		return
	}
	if src.bootID != w.leadingBoot {
		w.leading, w.leadingBoot = w.leading[:0], src.bootID
		return
	}
	if n := len(w.leading); n > 0 && (w.leading[0].rank < src.start ||
		uint64(w.leading[n-1].rank) >= uint64(src.start)+uint64(src.size)) {
		lo, hi := uint64(src.start), uint64(src.start)+uint64(src.size)
		kept := w.leading[:0]
		for _, d := range w.leading {
			if uint64(d.rank) >= lo && uint64(d.rank) < hi {
				kept = append(kept, d)
			}
		}
		w.leading = kept
	}
}
