package stepengine

import (
	"testing"
	"time"
)

// loopResult is what a closed-loop benchmark measured.
type loopResult struct {
	ttft, itl  time.Duration // means over the measured requests
	throughput float64       // output tokens per second
	preempted  uint64
}

// closedLoop runs conc clients that each send a request of in prompt tokens
// and out output tokens and send the next as soon as it finishes (as AIPerf
// and vLLM's benchmark do with a concurrency), for rounds requests per
// client; the first round of each client is warm-up. ITL is AIPerf's: per
// request (e2e - TTFT) / (out - 1), averaged.
func closedLoop(t testing.TB, cfg Config, conc, in, out, rounds int) loopResult {
	t.Helper()
	e := newEngine(t, cfg)
	sent := map[*Request]int{} // round of each request
	ttft := map[*Request]time.Duration{}
	for range conc {
		sent[add(t, e, t0, in, out)] = 0
	}
	var res loopResult
	var n int
	var sumTTFT, sumITL time.Duration
	var sumE2E time.Duration
	now := t0
	for e.Busy() {
		end, evs, _ := e.Step(now)
		now = end
		for _, ev := range evs {
			r := ev.Request
			round := sent[r]
			if ev.First() {
				ttft[r] = ev.Latency
			}
			if ev.Kind == EventFinished {
				if round > 0 {
					n++
					sumTTFT += ttft[r]
					sumITL += (ev.Latency - ttft[r]) / time.Duration(out-1)
					sumE2E += ev.Latency
				}
				delete(sent, r)
				delete(ttft, r)
				if round+1 < rounds {
					sent[add(t, e, ev.At, in, out)] = round + 1
				}
			}
		}
	}
	res.ttft = sumTTFT / time.Duration(n)
	res.itl = sumITL / time.Duration(n)
	// Each client has one request in flight at all times (Little's law).
	res.throughput = float64(conc*out) / (sumE2E / time.Duration(n)).Seconds()
	res.preempted = e.Load().Preemptions
	return res
}

// published is one row of NVIDIA's NIM benchmark of Llama-3.3-70B-Instruct,
// NIM 1.8.0, FP8, TP2 on 2 x H100 80GB, 5000 input / 500 output tokens
// (docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance).
type published struct {
	conc            int
	ttftMS, itlMS   float64
	throughputTokPS float64
}

var nim70B = []published{
	{1, 406.77, 18.58, 51.67},
	{5, 546.7, 21.83, 218.48},
	{25, 688.69, 38.75, 623.4},
	{50, 834.51, 59.73, 814.37},
	{100, 7996.25, 92.91, 917.26},
	{250, 88605.32, 93.2, 920.12},
}

// TestCalibrationLlama70B runs the published benchmark against the
// llama70b-2xh100 profile and checks that ITL and throughput stay within 15 %
// of the published figures and TTFT within 35 %. Its log is the fit table of
// docs/sim.md.
func TestCalibrationLlama70B(t *testing.T) {
	t.Parallel()
	p, err := LookupProfile(ProfileLlama70BH100)
	if err != nil {
		t.Fatal(err)
	}
	t.Log("| concurrency | TTFT ms published / model | ITL ms published / model | tokens/s published / model |")
	for _, row := range nim70B {
		rounds := 4
		if row.conc >= 100 {
			rounds = 3
		}
		got := closedLoop(t, p.Config, row.conc, 5000, 500, rounds)
		ttft := float64(got.ttft) / float64(time.Millisecond)
		itl := float64(got.itl) / float64(time.Millisecond)
		t.Logf("| %d | %.0f / %.0f | %.1f / %.1f | %.0f / %.0f | %d |", row.conc, row.ttftMS, ttft, row.itlMS, itl, row.throughputTokPS, got.throughput, got.preempted)
		within := func(what string, pub, model, tol float64) {
			if model < pub*(1-tol) || model > pub*(1+tol) {
				t.Errorf("concurrency %d: %s %.1f, published %.1f (more than %.0f %% off)", row.conc, what, model, pub, tol*100)
			}
		}
		within("ITL", row.itlMS, itl, 0.15)
		within("throughput", row.throughputTokPS, got.throughput, 0.15)
		within("TTFT", row.ttftMS, ttft, 0.35)
	}
}

// TestProfileScales checks the tiny profile's scale: one rank serves a few
// chat requests per second (prompt 128–512, output 64–256 tokens: 320 and
// 160 on average). It logs the demo profile's figures too (prompt 128,
// output the sim's default max_tokens, 64).
func TestProfileScales(t *testing.T) {
	t.Parallel()
	tiny, err := LookupProfile(ProfileTiny)
	if err != nil {
		t.Fatal(err)
	}
	for _, conc := range []int{1, 8, 16, 32} {
		got := closedLoop(t, tiny.Config, conc, 320, 160, 6)
		rps := got.throughput / 160
		t.Logf("| tiny | %d | %.1f | %.0f | %.1f | %d |", conc, rps, ms(got.ttft), ms(got.itl), got.preempted)
		if conc == 32 && (rps < 2 || rps > 10) {
			t.Errorf("tiny saturates at %.1f requests/s, want a few", rps)
		}
	}
	for _, conc := range []int{1, 8, 32} {
		got := closedLoop(t, DefaultConfig(), conc, 128, 64, 6)
		t.Logf("| demo | %d | %.1f | %.0f | %.1f | %d |", conc, got.throughput/64, ms(got.ttft), ms(got.itl), got.preempted)
	}
}

// ms returns d in milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
