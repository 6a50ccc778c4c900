package slo_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/sim/stepengine"
	"github.com/workermon/workermon/slo"
)

// The step response against the faithful simulated engine (contract §16):
// two `tiny` ranks stepped as vLLM V1 schedules, Poisson arrivals of the
// `chat` workload admitted by the busy rules (a rank is busy when its blocks
// exceed decode × total or its prompt tokens to prefill exceed the prefill
// threshold; a request goes to the least-used free rank, else it is
// rejected), TTFT from arrival, ITL between tokens, all in simulated time.
// The controller moves the thresholds every 2 s against the profile's
// targets.

// simPhase is a stretch of constant offered load.
type simPhase struct {
	name    string
	seconds int
	rps     float64
}

// simPhases: about 50 % of the two ranks' capacity (about 3 chat requests
// per second each), then 250 %, then 50 % again.
var simPhases = []simPhase{
	{"50 %", 30, 3},
	{"250 %", 90, 15},
	{"50 % again", 40, 3},
}

const simInterval = 2 * time.Second

type simRow struct {
	at        time.Duration
	phase     string
	decode    float64
	prefill   uint64
	ttftAtt   float64
	itlAtt    float64
	rejected  uint64
	state     slo.State
	move      slo.Move
	goodShare float64 // share of the interval's finished requests within both targets
	finished  int
}

type simReq struct {
	arrival time.Time
	ttft    time.Duration
	maxITL  time.Duration
	sumITL  time.Duration
	tokens  int
}

func runSim(t *testing.T, seed uint64) []simRow {
	t.Helper()
	prof, err := stepengine.LookupProfile(stepengine.ProfileTiny)
	if err != nil {
		t.Fatal(err)
	}
	const ranks = 2
	engines := make([]*stepengine.Engine, ranks)
	stepEnd := make([]time.Time, ranks)
	inStep := make([]bool, ranks)
	for i := range engines {
		if engines[i], err = stepengine.New(prof.Config); err != nil {
			t.Fatal(err)
		}
	}
	c := slo.DefaultConfig()
	target := slo.Target{TTFTms: float64(prof.SLO.TTFT.Milliseconds()), ITLms: float64(prof.SLO.ITL.Milliseconds()), Percentile: 0.9}
	st := slo.Start(c, slo.Base{})
	rng := rand.New(rand.NewPCG(seed, 7))
	start := time.Unix(0, 0)
	now := start
	var w slo.Window
	var pool slo.Pool
	reqs := map[*stepengine.Request]*simReq{}
	var rows []simRow
	good, finished := 0, 0

	busy := func(e *stepengine.Engine) bool {
		l := e.Load()
		return float64(l.BlocksUsed) > st.Suggested.Decode*float64(l.KVBlocks) || uint64(l.PrefillTokens) > st.Suggested.Prefill
	}
	admit := func(at time.Time) {
		best := -1
		for i, e := range engines {
			if busy(e) {
				continue
			}
			if best < 0 || e.Load().BlocksUsed < engines[best].Load().BlocksUsed {
				best = i
			}
		}
		if best < 0 {
			w.Rejected++
			return
		}
		r, err := engines[best].Add(at, 128+rng.IntN(385), 64+rng.IntN(193))
		if err != nil {
			t.Fatal(err)
		}
		reqs[r] = &simReq{arrival: at}
		if !inStep[best] {
			if end, ok := engines[best].Begin(at); ok {
				stepEnd[best], inStep[best] = end, true
			}
		}
	}
	nextTick := start.Add(simInterval)
	phaseEnd := start
	for _, ph := range simPhases {
		phaseEnd = phaseEnd.Add(time.Duration(ph.seconds) * time.Second)
		nextArrival := now.Add(time.Duration(rng.ExpFloat64() / ph.rps * float64(time.Second)))
		for now.Before(phaseEnd) {
			// The earliest of: an arrival, a step's end, the controller.
			next, which := nextArrival, -1
			for i := range engines {
				if inStep[i] && stepEnd[i].Before(next) {
					next, which = stepEnd[i], i
				}
			}
			if nextTick.Before(next) {
				next, which = nextTick, -2
			}
			if !next.Before(phaseEnd) && which != -2 {
				now = phaseEnd
				break
			}
			now = next
			switch which {
			case -1:
				admit(now)
				nextArrival = now.Add(time.Duration(rng.ExpFloat64() / ph.rps * float64(time.Second)))
			case -2:
				applied := st.Suggested
				var m slo.Move
				win := pool.Window(target, &w)
				st, m = slo.Next(c, target, st, win)
				pool.After(target, st, win)
				row := simRow{at: now.Sub(start), phase: ph.name, decode: applied.Decode, prefill: applied.Prefill,
					ttftAtt: w.TTFT.Attainment(target.TTFTms), itlAtt: w.ITL.Attainment(target.ITLms), rejected: w.Rejected,
					state: st.State, move: m, finished: finished}
				if finished > 0 {
					row.goodShare = float64(good) / float64(finished)
				}
				rows = append(rows, row)
				w, good, finished = slo.Window{}, 0, 0
				nextTick = nextTick.Add(simInterval)
			default:
				e := engines[which]
				inStep[which] = false
				for _, ev := range e.End() {
					r := reqs[ev.Request]
					switch {
					case ev.First():
						r.ttft = ev.At.Sub(r.arrival)
						w.TTFT.Observe(float64(r.ttft) / float64(time.Millisecond))
						r.tokens = 1
					case ev.Kind == stepengine.EventToken:
						w.ITL.Observe(float64(ev.Latency) / float64(time.Millisecond))
						r.sumITL += ev.Latency
						r.tokens++
					case ev.Kind == stepengine.EventFinished:
						finished++
						tpot := time.Duration(0)
						if r.tokens > 1 {
							tpot = r.sumITL / time.Duration(r.tokens-1)
						}
						if r.ttft <= prof.SLO.TTFT && tpot <= prof.SLO.ITL {
							good++
						}
						delete(reqs, ev.Request)
					}
				}
				if end, ok := e.Begin(now); ok {
					stepEnd[which], inStep[which] = end, true
				}
			}
		}
	}
	return rows
}

func simTable(rows []simRow) string {
	var b strings.Builder
	b.WriteString("| t s | load | decode | prefill | TTFT att | ITL att | rejected | good | state | move |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %.0f | %s | %.3f | %d | %.2f | %.2f | %d | %.2f | %s | %+d |\n", r.at.Seconds(), r.phase, r.decode, r.prefill,
			nanZero(r.ttftAtt), nanZero(r.itlAtt), r.rejected, r.goodShare, r.state, r.move)
	}
	return b.String()
}

func nanZero(v float64) float64 {
	if math.IsNaN(v) {
		return -1
	}
	return v
}

// simSettle is the stated settling time against the simulated engines, in
// intervals (40 s at 2 s): the latency of a request of this workload takes
// its whole length to show, and the first tokens of two ranks are too few
// for one interval (the controller pools them, see slo.Pool).
const simSettle = 20

// TestSimStepResponse: against the simulated engines, once simSettle
// intervals of the overload have passed the decode threshold stays within
// a range of 0.06 (what moves remain are minimum steps, no swing) with at
// most three reversals; over the last 10 intervals of the overload the
// mean attainment meets the TTFT target and comes within 0.02 of the ITL
// one, and at least 90 % of the requests that finish are good (TTFT and
// mean TPOT within the targets); back at 50 % it never moves down.
func TestSimStepResponse(t *testing.T) {
	t.Parallel()
	for _, seed := range []uint64{1, 2, 3, 4, 5} {
		rows := runSim(t, seed)
		if testing.Verbose() && seed == 1 {
			t.Log("\n" + simTable(rows))
		}
		var over, after []simRow
		for _, r := range rows {
			switch r.phase {
			case "250 %":
				over = append(over, r)
			case "50 % again":
				after = append(after, r)
			}
		}
		lo, hi := math.Inf(1), math.Inf(-1)
		reversals, dir := 0, slo.Move(0)
		for _, r := range over[simSettle:] {
			lo, hi = min(lo, r.decode), max(hi, r.decode)
			if r.move != 0 {
				if dir != 0 && r.move != dir {
					reversals++
				}
				dir = r.move
			}
		}
		t.Logf("seed %d: after %d intervals the decode threshold stays in [%.3f, %.3f], %d reversals", seed, simSettle, lo, hi, reversals)
		if hi-lo > 0.06+1e-9 || reversals > 3 {
			t.Errorf("seed %d: not settled\n%s", seed, simTable(over))
		}
		var ttft, itl, good float64
		tail := over[len(over)-10:]
		for _, r := range tail {
			ttft += r.ttftAtt / float64(len(tail))
			itl += r.itlAtt / float64(len(tail))
			good += r.goodShare / float64(len(tail))
		}
		t.Logf("seed %d: last 10 intervals of the overload: attainment ttft %.3f itl %.3f, good %.3f", seed, ttft, itl, good)
		if ttft < 0.9 || itl < 0.88 || good < 0.9 {
			t.Errorf("seed %d: the targets not met at the end of the overload\n%s", seed, simTable(over))
		}
		for _, r := range after {
			if r.move < 0 {
				t.Errorf("seed %d: a move down at %v under light load\n%s", seed, r.at, simTable(after))
				break
			}
		}
	}
}
