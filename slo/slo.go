// Package slo is the SLO controller of contract §18: a pure function from a
// model's latency targets, the latency windows measured since the last move
// and the controller's previous status to the next thresholds and status. It
// holds no clock and talks to nothing; the monitor calls Next once per
// --slo-interval on the monitor that holds the model's partition.
//
// How it moves (docs/slo.md has the step-response table):
//
//   - attainment is the share of samples at or under the target, per signal
//     (TTFT, ITL), the worst signal with enough samples deciding;
//   - below the percentile: step down; at or above it with rejections or
//     queueing: step up, but only while the percentile latency of every
//     judged signal is at most (1 − Headroom) of its target (a dead band:
//     at the edge the controller holds instead of probing up and down);
//   - the decode step starts at DecodeStep, grows by half in a run of moves
//     the same way (up to DecodeStepMax) and halves on every reversal (down to
//     DecodeStepMin); after HoldsToReset intervals without a move it starts
//     again from DecodeStep. The prefill threshold moves with it, by the
//     factor 1 + PrefillGain × step.
//
// The leading inputs of contract §21 (leading.go) move the two thresholds
// of the leading signals, kv_committed and queue_delay, on their own rules:
// preemptions on the model's ranks are a miss of the KV side at once, and a
// predicted queue delay above the TTFT target a TTFT miss before any sample
// of the requests that wait exists. Either holds off every step up; the
// queue's also counts as a TTFT miss of the decode and prefill controller
// above (a step down, never sped up, one interval's wait after a step
// down).
package slo

import (
	"errors"
	"fmt"
	"math"
)

// Defaults of Config.
const (
	// DefaultDecodeMin and DefaultDecodeMax are --slo-decode-range.
	DefaultDecodeMin = 0.3
	DefaultDecodeMax = 0.98
	// DefaultPrefillMin and DefaultPrefillMax are --slo-prefill-range.
	DefaultPrefillMin = 1024
	DefaultPrefillMax = 1048576
	// MaxPrefill bounds the top of --slo-prefill-range: 2^53, the largest
	// range of whole numbers float64 holds exactly (the busy rules and the
	// steps compute in float64), far above any engine's batch.
	MaxPrefill = 1 << 53
	// DefaultInfeasibleAfter is k: this many steps down in a row without
	// attainment improving make the target infeasible.
	DefaultInfeasibleAfter = 5
	// DefaultDecodeStep is the first step of the decode threshold.
	DefaultDecodeStep = 0.04
	// DefaultDecodeStepMin and DefaultDecodeStepMax bound the adaptive step.
	DefaultDecodeStepMin = 0.01
	DefaultDecodeStepMax = 0.12
	// DefaultPrefillGain turns the decode step into the prefill factor
	// 1 + gain × step (0.04 → ×1.24).
	DefaultPrefillGain = 6
	// DefaultHeadroom is the dead band of a step up: the percentile latency
	// must be at most (1 − headroom) × target.
	DefaultHeadroom = 0.1
	// DefaultHoldsToReset is how many intervals without a move reset the
	// step to DefaultDecodeStep.
	DefaultHoldsToReset = 5
	// improveEpsilon is how much attainment must rise to count as an
	// improvement in a run of steps down.
	improveEpsilon = 0.01
	// improveRatio is how much the percentile latency must fall, as a
	// share, to count as an improvement.
	improveRatio = 0.02
	// DefaultInfeasibleMove is how far attainment must move from its value
	// when the target was found infeasible before the controller moves again.
	DefaultInfeasibleMove = 0.05
	// DefaultSmoothing is the weight α of a new window in the smoothed
	// attainment and latency while the thresholds hold still; the first
	// window after a move counts alone.
	DefaultSmoothing = 0.3
	// DefaultPercentile is the percentile of a target that names none.
	DefaultPercentile = 0.9
	// DefaultCommittedMin and DefaultCommittedMax are
	// --slo-committed-range (contract §21).
	DefaultCommittedMin = 0.5
	DefaultCommittedMax = 2
	// DefaultDelayMin and DefaultDelayMax are --slo-delay-range, in
	// milliseconds (contract §21).
	DefaultDelayMin = 100
	DefaultDelayMax = 60000
	// MaxCommitted is the largest kv_committed_threshold (contract §21).
	MaxCommitted = 4
	// MaxDelay bounds the top of --slo-delay-range: 2^53 ms, as
	// MaxPrefill (the steps compute in float64).
	MaxDelay = 1 << 53
)

// Errors.
var (
	ErrInvalidConfig = errors.New("invalid slo config")
	ErrInvalidTarget = errors.New("invalid slo target")
)

// State is what the controller is doing (contract §18).
type State string

// States.
const (
	StateNoData     State = "no_data"
	StateLowering   State = "lowering"
	StateRaising    State = "raising"
	StateSteady     State = "steady"
	StateInfeasible State = "infeasible"
)

// Modes of an SLO.
const (
	ModeEnforce = "enforce"
	ModeShadow  = "shadow"
)

// Config bounds and shapes the controller's moves.
type Config struct {
	DecodeMin, DecodeMax   float64
	PrefillMin, PrefillMax uint64
	InfeasibleAfter        int
	DecodeStep             float64
	DecodeStepMin          float64
	DecodeStepMax          float64
	PrefillGain            float64
	Headroom               float64
	HoldsToReset           int
	InfeasibleMove         float64
	Smoothing              float64
	// CommittedMin and CommittedMax bound kv_committed_threshold
	// (--slo-committed-range), DelayMin and DelayMax
	// queue_delay_threshold_ms (--slo-delay-range); both minimums > 0.
	CommittedMin, CommittedMax float64
	DelayMin, DelayMax         uint64
	// Lead shapes the moves of the leading thresholds (leading.go).
	Lead Lead
}

// DefaultConfig is the configuration of contract §18's defaults.
func DefaultConfig() Config {
	return Config{
		DecodeMin: DefaultDecodeMin, DecodeMax: DefaultDecodeMax,
		PrefillMin: DefaultPrefillMin, PrefillMax: DefaultPrefillMax,
		InfeasibleAfter: DefaultInfeasibleAfter,
		DecodeStep:      DefaultDecodeStep, DecodeStepMin: DefaultDecodeStepMin, DecodeStepMax: DefaultDecodeStepMax,
		PrefillGain: DefaultPrefillGain, Headroom: DefaultHeadroom,
		HoldsToReset: DefaultHoldsToReset, InfeasibleMove: DefaultInfeasibleMove,
		Smoothing:    DefaultSmoothing,
		CommittedMin: DefaultCommittedMin, CommittedMax: DefaultCommittedMax,
		DelayMin: DefaultDelayMin, DelayMax: DefaultDelayMax,
		Lead: DefaultLead(),
	}
}

// Validate reports every problem of c.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, a...)...))
	}
	if !(c.DecodeMin >= 0 && c.DecodeMin <= c.DecodeMax && c.DecodeMax <= 1) {
		bad("decode range %v-%v must satisfy 0 <= min <= max <= 1", c.DecodeMin, c.DecodeMax)
	}
	if c.PrefillMin == 0 || c.PrefillMin > c.PrefillMax {
		bad("prefill range %d-%d must satisfy 0 < min <= max", c.PrefillMin, c.PrefillMax)
	}
	if c.PrefillMax > MaxPrefill {
		bad("prefill range %d-%d must end at or below %d tokens (2^53)", c.PrefillMin, c.PrefillMax, uint64(MaxPrefill))
	}
	if c.InfeasibleAfter < 1 {
		bad("infeasible after %d steps must be at least 1", c.InfeasibleAfter)
	}
	if !(c.DecodeStepMin > 0 && c.DecodeStepMin <= c.DecodeStep && c.DecodeStep <= c.DecodeStepMax) {
		bad("decode steps %v <= %v <= %v must be positive and ordered", c.DecodeStepMin, c.DecodeStep, c.DecodeStepMax)
	}
	if !(c.PrefillGain > 0) {
		bad("prefill gain %v must be positive", c.PrefillGain)
	}
	if !(c.Headroom >= 0 && c.Headroom < 1) {
		bad("headroom %v must be in [0, 1)", c.Headroom)
	}
	if c.HoldsToReset < 1 {
		bad("holds to reset %d must be at least 1", c.HoldsToReset)
	}
	if !(c.InfeasibleMove > 0 && c.InfeasibleMove < 1) {
		bad("infeasible move %v must be in (0, 1)", c.InfeasibleMove)
	}
	if !(c.Smoothing > 0 && c.Smoothing <= 1) {
		bad("smoothing %v must be in (0, 1]", c.Smoothing)
	}
	if !(c.CommittedMin > 0 && c.CommittedMin <= c.CommittedMax && c.CommittedMax <= MaxCommitted) {
		bad("committed range %v-%v must satisfy 0 < min <= max <= %d", c.CommittedMin, c.CommittedMax, MaxCommitted)
	}
	if c.DelayMin == 0 || c.DelayMin > c.DelayMax {
		bad("delay range %d-%d must satisfy 0 < min <= max", c.DelayMin, c.DelayMax)
	}
	if c.DelayMax > MaxDelay {
		bad("delay range %d-%d must end at or below %d ms (2^53)", c.DelayMin, c.DelayMax, uint64(MaxDelay))
	}
	errs = append(errs, c.Lead.validate()...)
	return errors.Join(errs...)
}

// Target is a model's SLO: latency targets in milliseconds (0 = none) met
// by a share Percentile of the samples.
type Target struct {
	TTFTms     float64
	ITLms      float64
	Percentile float64
}

// Validate checks t as §18 asks: at least one positive target, finite
// positive numbers, a percentile in (0, 1).
func (t Target) Validate() error {
	var errs []error
	for _, f := range []struct {
		name string
		v    float64
	}{{"ttft_ms", t.TTFTms}, {"itl_ms", t.ITLms}} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			errs = append(errs, fmt.Errorf("%w: %s must be a positive number", ErrInvalidTarget, f.name))
		}
	}
	if !(t.TTFTms > 0) && !(t.ITLms > 0) {
		errs = append(errs, fmt.Errorf("%w: one of ttft_ms and itl_ms is required", ErrInvalidTarget))
	}
	if !(t.Percentile > 0 && t.Percentile < 1) {
		errs = append(errs, fmt.Errorf("%w: percentile must be in (0, 1)", ErrInvalidTarget))
	}
	return errors.Join(errs...)
}

// MinSamples is the fewest samples of a signal that the controller judges:
// max(20, 5 / (1 − percentile)).
func (t Target) MinSamples() uint64 {
	return uint64(max(20, math.Ceil(5/(1-t.Percentile)-1e-9)))
}

// Thresholds are the thresholds the controller moves: the decode and
// prefill thresholds of contract §18 and the two of the leading signals of
// §21. KVCommitted and QueueDelayMs are 0 in a status stored before §21
// (both ranges start above 0): Next takes that as unset, the top of the
// range.
type Thresholds struct {
	Decode       float64 `json:"active_decode_blocks_threshold"`
	Prefill      uint64  `json:"active_prefill_tokens_threshold"`
	KVCommitted  float64 `json:"kv_committed_threshold"`
	QueueDelayMs uint64  `json:"queue_delay_threshold_ms"`
}

// Window is what the model's workers measured since the last move, merged.
type Window struct {
	TTFT, ITL Hist
	Rejected  uint64
	Queued    uint64
	// The leading inputs (contract §21): Preemptions is how many
	// preemptions the model's ranks counted in the window; QueueDelayMs
	// is the largest predicted queue delay of the model's fresh ranks at
	// its end, in milliseconds (0 when none is known).
	Preemptions  uint64
	QueueDelayMs float64
}

// Measured is what the controller saw in its last window.
type Measured struct {
	// TTFTAttainment and ITLAttainment are nil for a signal with no target
	// or no sample.
	TTFTAttainment *float64 `json:"ttft_attainment"`
	ITLAttainment  *float64 `json:"itl_attainment"`
	TTFTSamples    uint64   `json:"ttft_samples"`
	ITLSamples     uint64   `json:"itl_samples"`
	Rejected       uint64   `json:"rejected"`
	Queued         uint64   `json:"queued"`
	// Preemptions and QueueDelayMs are the window's leading inputs
	// (contract §21); QueueDelayMs is nil when no rank's is known.
	Preemptions  uint64   `json:"preemptions"`
	QueueDelayMs *float64 `json:"queue_delay_ms"`
}

// Status is the controller's state between moves, stored in
// <model_key>.status so that a new holder continues from it.
type Status struct {
	State     State      `json:"state"`
	Suggested Thresholds `json:"suggested"`
	Measured  Measured   `json:"measured"`
	// Step is the decode step of the next move.
	Step float64 `json:"step"`
	// Dir is the direction of the last move: -1, 0 (none yet, or reset), +1.
	Dir int `json:"dir"`
	// Holds counts intervals without a move since the last one.
	Holds int `json:"holds"`
	// Streak counts steps down in a row without attainment improving past
	// StreakBest.
	Streak     int     `json:"streak"`
	StreakBest float64 `json:"streak_best"`
	// StreakRatio is the percentile latency ÷ target when the run's
	// baseline was taken.
	StreakRatio float64 `json:"streak_ratio"`
	// InfeasibleAt is the attainment when the target was found infeasible.
	InfeasibleAt float64 `json:"infeasible_at"`
	// Attainment is the smoothed worst attainment of the judged signals,
	// and Ratio the smoothed worst percentile latency ÷ target; both 0
	// before a first judgment.
	Attainment float64 `json:"attainment"`
	Ratio      float64 `json:"ratio"`
	// Smoothed: Attainment and Ratio were judged at the thresholds in
	// force, so the next judgment is smoothed with them; a move clears it.
	Smoothed bool `json:"smoothed"`
	// The leading thresholds' state (leading.go): intervals to wait before
	// the next step down of each, and intervals since its last miss.
	CommittedWait  int `json:"committed_wait"`
	DelayWait      int `json:"delay_wait"`
	CommittedQuiet int `json:"committed_quiet"`
	DelayQuiet     int `json:"delay_quiet"`
}

// Base is a model's effective thresholds as the monitor has them, nil
// where unset.
type Base struct {
	Decode       *float64
	Prefill      *uint64
	KVCommitted  *float64
	QueueDelayMs *uint64
}

// Start is the first status of a model: its effective thresholds clamped
// into the ranges, the top of a range where a threshold is unset (nil).
func Start(c Config, b Base) Status {
	t := Thresholds{Decode: c.DecodeMax, Prefill: c.PrefillMax, KVCommitted: c.CommittedMax, QueueDelayMs: c.DelayMax}
	if b.Decode != nil {
		t.Decode = *b.Decode
	}
	if b.Prefill != nil {
		t.Prefill = *b.Prefill
	}
	if b.KVCommitted != nil {
		// 0 is below every range: clamped to its floor, not taken as unset.
		t.KVCommitted = max(*b.KVCommitted, c.CommittedMin)
	}
	if b.QueueDelayMs != nil {
		t.QueueDelayMs = max(*b.QueueDelayMs, c.DelayMin)
	}
	return Status{State: StateNoData, Suggested: clamp(c, t), Step: c.DecodeStep}
}

// Move is the direction of one step: -1 down, 0 none, +1 up.
type Move int

// Next judges window w against target t and returns the next status; its
// Suggested thresholds are the ones to apply, and the Move says whether they
// moved (-1 when any threshold went down).
func Next(c Config, t Target, prev Status, w *Window) (Status, Move) {
	s := prev
	s.Suggested = clamp(c, prev.Suggested)
	if !(s.Step >= c.DecodeStepMin && s.Step <= c.DecodeStepMax) {
		s.Step = c.DecodeStep
	}
	s.Measured = Measured{Rejected: w.Rejected, Queued: w.Queued, Preemptions: w.Preemptions}
	if w.QueueDelayMs > 0 {
		d := w.QueueDelayMs
		s.Measured.QueueDelayMs = &d
	}
	lm := leadingMisses(t, w)
	s, move, raise := s.lagging(c, t, prev, w, lm)
	ttftMiss := s.Measured.TTFTAttainment != nil && s.Measured.TTFTSamples >= t.MinSamples() &&
		*s.Measured.TTFTAttainment < t.Percentile
	lm.delay = lm.delay || ttftMiss
	return s.leading(c, t, move, raise, lm)
}

// lagging is contract §18's controller of the decode and prefill
// thresholds on the measured latency. A leading miss (lm) holds off its
// steps up. raise reports that the window would let thresholds go up:
// rejections or queueing, and every signal met with headroom or no sample
// at all.
func (s Status) lagging(c Config, t Target, prev Status, w *Window, lm misses) (_ Status, _ Move, raise bool) {
	minN := t.MinSamples()
	pressure := (w.Rejected > 0 || w.Queued > 0) && !lm.any()

	att := math.Inf(1) // the worst judged attainment
	ratio := 0.0       // the worst judged percentile latency ÷ target
	judged := false    // a signal has enough samples
	short := false     // a targeted signal has too few samples
	samples := false   // a targeted signal has any sample
	for _, sig := range []struct {
		target float64
		h      *Hist
		attP   **float64
		n      *uint64
	}{
		{t.TTFTms, &w.TTFT, &s.Measured.TTFTAttainment, &s.Measured.TTFTSamples},
		{t.ITLms, &w.ITL, &s.Measured.ITLAttainment, &s.Measured.ITLSamples},
	} {
		if !(sig.target > 0) {
			continue
		}
		n := sig.h.Total()
		*sig.n = n
		if n == 0 {
			short = true
			continue
		}
		samples = true
		a := sig.h.Attainment(sig.target)
		*sig.attP = &a
		if n < minN {
			short = true
			continue
		}
		judged = true
		att = min(att, a)
		ratio = max(ratio, sig.h.Quantile(t.Percentile)/sig.target)
	}

	switch {
	case !samples && pressure:
		// Rejections or queueing and no sample at all: the fleet sheds
		// without evidence of latency trouble.
		s, m := s.move(c, +1, true)
		return s, m, true
	case lm.delay && (!judged || att >= t.Percentile):
		// A predicted queue delay over the TTFT target (contract §21)
		// counts as a TTFT miss before the samples show one: a step
		// down, the step never sped up, and right after a step down it
		// waits one interval for it to show. (Preemptions do not: they
		// go on while the requests admitted before hold their blocks,
		// and stepping on them cost the goodput benchmark's burst.)
		if prev.Dir == -1 && prev.Holds == 0 {
			return s.hold(c, StateLowering), 0, false
		}
		s.Streak, s.StreakBest, s.StreakRatio = 0, 0, 0
		s, m := s.move(c, -1, false)
		return s, m, false
	case !judged, short && att >= t.Percentile:
		// Too few samples to judge every signal, and none of those judged
		// misses: hold (the caller pools the windows, see Pool).
		return s.hold(c, StateNoData), 0, false
	}

	// Smoothing: while the thresholds hold still, each judgment is
	// smoothed with the previous one made at the same thresholds. A
	// collapse (more than twice the allowed share of misses) counts at once:
	// smoothed, a sudden change of load would wait two intervals more
	// before the first step down.
	collapse := att < t.Percentile-(1-t.Percentile)
	if prev.Smoothed && !collapse {
		att = c.Smoothing*att + (1-c.Smoothing)*prev.Attainment
		ratio = c.Smoothing*ratio + (1-c.Smoothing)*prev.Ratio
	}
	s.Attainment, s.Ratio, s.Smoothed = att, ratio, true
	headroom := ratio <= 1-c.Headroom

	if prev.State == StateInfeasible {
		if att < t.Percentile && math.Abs(att-prev.InfeasibleAt) <= c.InfeasibleMove {
			return s.hold(c, StateInfeasible), 0, false
		}
		s.Streak, s.StreakBest, s.StreakRatio = 0, 0, 0
	}

	switch {
	case att < t.Percentile:
		// Improving: more samples meet the target, or the percentile
		// latency fell (attainment alone stays at 0 while every sample is
		// far over the target).
		improved := att > prev.StreakBest+improveEpsilon || ratio < prev.StreakRatio*(1-improveRatio)
		switch {
		case prev.Dir != -1 || prev.State != StateLowering || improved:
			s.Streak, s.StreakBest, s.StreakRatio = 0, att, ratio
		case prev.Holds == 0:
			s.Streak++
		}
		if s.Streak >= c.InfeasibleAfter {
			s.InfeasibleAt = att
			return s.hold(c, StateInfeasible), 0, false
		}
		// A small miss (less than half the allowed share of misses) right
		// after a step down waits one interval for that step to show, and
		// never speeds the step up.
		small := t.Percentile-att < (1-t.Percentile)/2
		if small && prev.Dir == -1 && prev.Holds == 0 {
			return s.hold(c, StateLowering), 0, false
		}
		s, m := s.move(c, -1, !small)
		return s, m, false
	case pressure && headroom && !(prev.Dir == +1 && prev.Holds == 0):
		// A step up waits one interval after the last one: half of the
		// window after a move was measured under the old thresholds.
		s.Streak, s.StreakBest, s.StreakRatio = 0, 0, 0
		s, m := s.move(c, +1, true)
		return s, m, true
	case pressure && headroom:
		s.Streak, s.StreakBest, s.StreakRatio = 0, 0, 0
		return s.hold(c, StateRaising), 0, true
	default:
		s.Streak, s.StreakBest, s.StreakRatio = 0, 0, 0
		return s.hold(c, StateSteady), 0, false
	}
}

// Add adds o's samples and counts to w.
func (w *Window) Add(o *Window) {
	w.TTFT.Add(&o.TTFT)
	w.ITL.Add(&o.ITL)
	w.Rejected = AddCount(w.Rejected, o.Rejected)
	w.Queued = AddCount(w.Queued, o.Queued)
}

// DefaultPoolMax is how many intervals of too few samples Pool adds up
// before it starts again.
const DefaultPoolMax = 10

// Pool adds up the windows of consecutive intervals that had too few
// samples to judge (state no_data), so that a model with little traffic is
// judged over several intervals instead of never. It pools each signal on
// its own: a signal with enough samples in an interval (t.MinSamples) is
// judged on that interval alone, whatever the other signal lacks, so that a
// well-measured ITL is not diluted by the intervals a scarce TTFT needs.
// Its zero value is ready.
type Pool struct {
	carry Window
	n     int
}

// Window returns w with, for each signal short of t.MinSamples in w, the
// samples pooled so far added (and the pooled rejections and queueing).
func (p *Pool) Window(t Target, w *Window) *Window {
	if p.n == 0 {
		return w
	}
	out := *w
	minN := t.MinSamples()
	if w.TTFT.Total() < minN {
		out.TTFT.Add(&p.carry.TTFT)
	}
	if w.ITL.Total() < minN {
		out.ITL.Add(&p.carry.ITL)
	}
	out.Rejected = AddCount(out.Rejected, p.carry.Rejected)
	out.Queued = AddCount(out.Queued, p.carry.Queued)
	return &out
}

// After keeps the window just judged (as Window returned it) when the
// status says it had too few samples, at most DefaultPoolMax intervals in
// a row — without limit while the pooled windows hold rejections or
// queueing, so that a model that sheds with little traffic is judged in
// the end instead of shedding for good — less the signals it had enough
// samples of; it forgets it otherwise.
func (p *Pool) After(t Target, st Status, judged *Window) {
	pressure := judged.Rejected > 0 || judged.Queued > 0
	if st.State == StateNoData && (p.n < DefaultPoolMax || pressure) {
		p.carry = *judged
		minN := t.MinSamples()
		if p.carry.TTFT.Total() >= minN {
			p.carry.TTFT = Hist{}
		}
		if p.carry.ITL.Total() >= minN {
			p.carry.ITL = Hist{}
		}
		p.n++
		return
	}
	p.carry, p.n = Window{}, 0
}

// hold keeps the thresholds and counts the interval.
func (s Status) hold(c Config, st State) Status {
	s.State = st
	s.Holds++
	if s.Holds >= c.HoldsToReset {
		s.Step, s.Dir = c.DecodeStep, 0
	}
	return s
}

// move steps the thresholds in direction d, adapting the step; at the end
// of a range it moves what it can.
func (s Status) move(c Config, d int, speedUp bool) (Status, Move) {
	switch {
	case s.Dir == d && s.Holds <= 1 && speedUp:
		s.Step = min(s.Step*1.5, c.DecodeStepMax)
	case s.Dir == -d:
		s.Step = max(s.Step/2, c.DecodeStepMin)
	}
	old := s.Suggested
	s.Smoothed = false
	step := s.Step
	if d > 0 {
		step /= 2 // fall fast, rise slowly
	}
	f := 1 + c.PrefillGain*step
	if d > 0 {
		s.Suggested.Decode += step
		s.Suggested.Prefill = clampPrefill(c, math.Round(float64(s.Suggested.Prefill)*f))
		s.State = StateRaising
	} else {
		s.Suggested.Decode -= s.Step
		s.Suggested.Prefill = clampPrefill(c, math.Round(float64(s.Suggested.Prefill)/f))
		s.State = StateLowering
	}
	s.Suggested = clamp(c, s.Suggested)
	s.Suggested.Decode = math.Round(s.Suggested.Decode*1e4) / 1e4
	if s.Suggested == old {
		if d > 0 {
			// At the top of both ranges: nothing to gain.
			s.State = StateSteady
			s.Holds++
			return s, 0
		}
		// At the floor: lowering that moves nothing still counts towards
		// infeasible.
		s.Dir, s.Holds = d, 0
		return s, 0
	}
	s.Dir, s.Holds = d, 0
	return s, Move(d)
}

// clampPrefill turns a prefill threshold computed in float64 back into a
// whole number, clamped into the prefill range first: a product past 2^64
// has no uint64 (amd64 converts it to 2^63), which would drop a threshold
// near the top of a wide range and make the controller step up for ever.
func clampPrefill(c Config, v float64) uint64 {
	switch {
	case !(v < float64(c.PrefillMax)): // NaN too; float64(MaxUint64) is 2^64
		return c.PrefillMax
	case v <= float64(c.PrefillMin):
		return c.PrefillMin
	}
	return uint64(v)
}

func clamp(c Config, t Thresholds) Thresholds {
	t.Decode = min(max(t.Decode, c.DecodeMin), c.DecodeMax)
	if math.IsNaN(t.Decode) {
		t.Decode = c.DecodeMax
	}
	t.Prefill = min(max(t.Prefill, c.PrefillMin), c.PrefillMax)
	if !(t.KVCommitted > 0) { // unset (a status from before §21), or NaN
		t.KVCommitted = c.CommittedMax
	}
	t.KVCommitted = min(max(t.KVCommitted, c.CommittedMin), c.CommittedMax)
	if t.QueueDelayMs == 0 {
		t.QueueDelayMs = c.DelayMax
	}
	t.QueueDelayMs = min(max(t.QueueDelayMs, c.DelayMin), c.DelayMax)
	return t
}
