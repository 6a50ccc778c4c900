package loadgen

import (
	"math"
	"net/http"
	"time"
)

// Latency targets of a request (contract §16), the defaults those of the
// simulated engine's demo profile.
const (
	// DefaultSLOTTFT is the time to first token a good request stays
	// within.
	DefaultSLOTTFT = 2 * time.Second
	// DefaultSLOITL is the time per output token a good request stays
	// within.
	DefaultSLOITL = 50 * time.Millisecond
)

// SLO is the latency targets that make a request good.
type SLO struct {
	// TTFT bounds the time to first token.
	TTFT time.Duration
	// ITL bounds the time per output token, (e2e − TTFT) / (tokens − 1).
	ITL time.Duration
}

// Result is what the client saw of one request.
type Result struct {
	// Status is the HTTP status received, 0 without an answer.
	Status int
	// Stream tells a streamed request from a non-streamed one.
	Stream bool
	// Complete reports that the answer was read to its end: a stream up to
	// [DONE] without an error event, a JSON body in full.
	Complete bool
	// Finished reports that a choice carried a finish reason.
	Finished bool
	// Tokens is the number of output tokens: the usage's
	// completion_tokens when the server gave it, else the chunks with
	// text.
	Tokens int
	// TTFT is the time from sending the request to the first chunk with
	// text (a stream only).
	TTFT time.Duration
	// E2E is the time from sending the request to the end of its answer.
	E2E time.Duration
}

// TPOT returns the time per output token after the first, (E2E − TTFT) /
// (Tokens − 1), of a streamed request; ok is false below 2 tokens or for a
// non-streamed request.
func (r Result) TPOT() (d time.Duration, ok bool) {
	if !r.Stream || r.Tokens < 2 {
		return 0, false
	}
	return (r.E2E - r.TTFT) / time.Duration(r.Tokens-1), true
}

// Good reports whether r meets slo, as vLLM's benchmark defines goodput
// (contract §16): status 200 and a complete answer; a stream must have
// ended with a finish reason, its TTFT ≤ slo.TTFT and its TPOT ≤ slo.ITL
// (no TPOT test at 1 token); a non-streamed request must have taken at most
// slo.TTFT + slo.ITL × (tokens − 1).
func (r Result) Good(slo SLO) bool {
	if r.Status != http.StatusOK || !r.Complete || r.Tokens < 1 {
		return false
	}
	if !r.Stream {
		return r.E2E <= slo.TTFT+slo.ITL*time.Duration(r.Tokens-1)
	}
	if !r.Finished || r.TTFT > slo.TTFT {
		return false
	}
	tpot, ok := r.TPOT()
	return !ok || tpot <= slo.ITL
}

// Report is the JSON document of `workermon load --json` (contract §16):
// times in milliseconds, a percentile of nothing null.
type Report struct {
	ReportCounts
	// Classes has the same figures per priority class (sheddable, standard,
	// critical), for the classes of the priority mix.
	Classes map[string]ReportCounts `json:"classes"`
}

// ReportCounts are the figures of a report, overall or of one class.
type ReportCounts struct {
	// OfferedRPS is the requests the schedule offered (sent or dropped at
	// the cap) per second.
	OfferedRPS float64 `json:"offered_rps"`
	// GoodputRPS is the good requests per second.
	GoodputRPS float64 `json:"goodput_rps"`
	// OK is the 200 answers received in full.
	OK uint64 `json:"ok"`
	// Good is the requests that met the SLO.
	Good uint64 `json:"good"`
	// Rejected is the 503 answers (every worker busy), counting every
	// attempt.
	Rejected uint64 `json:"rejected"`
	// Shed is the 429 answers (a sheddable request, or a queue that let it
	// go), counting every attempt.
	Shed uint64 `json:"shed"`
	// Attempts is the times requests were sent, retries included
	// (contract §23).
	Attempts uint64 `json:"attempts"`
	// Failed is the requests whose last attempt got no 200 answer.
	Failed uint64 `json:"failed"`
	// AttemptsPerRequest is Attempts over the requests sent; 0 when none
	// was.
	AttemptsPerRequest float64 `json:"attempts_per_request"`
	// Queued is the answers that waited in a router's queue
	// (X-Workermon-Queued).
	Queued    uint64      `json:"queued"`
	TTFT      Percentiles `json:"ttft_ms"`
	TPOT      Percentiles `json:"tpot_ms"`
	E2E       Percentiles `json:"e2e_ms"`
	QueueWait Percentiles `json:"queue_wait_ms"`
}

// Percentiles are the 50th, 90th and 99th percentiles of a latency, in
// milliseconds; nil (null) when nothing was measured.
type Percentiles struct {
	P50 *float64 `json:"p50"`
	P90 *float64 `json:"p90"`
	P99 *float64 `json:"p99"`
}

// percentiles returns l's percentiles in milliseconds, nil without samples.
func percentiles(l Latency) Percentiles {
	if l.Count == 0 {
		return Percentiles{}
	}
	ms := func(d time.Duration) *float64 {
		v := math.Round(float64(d)/float64(time.Millisecond)*1000) / 1000
		return &v
	}
	return Percentiles{P50: ms(l.P50), P90: ms(l.P90), P99: ms(l.P99)}
}

// reportCounts returns the figures of c.
func reportCounts(c Counts) ReportCounts {
	per := func(n uint64) float64 {
		if c.Duration <= 0 {
			return 0
		}
		return float64(n) / c.Duration.Seconds()
	}
	perRequest := 0.0
	if c.Sent > 0 {
		perRequest = math.Round(float64(c.Attempts)/float64(c.Sent)*1000) / 1000
	}
	return ReportCounts{
		AttemptsPerRequest: perRequest,
		OfferedRPS:         per(c.Sent + c.Dropped),
		GoodputRPS:         per(c.Good),
		OK:                 c.OK,
		Good:               c.Good,
		Rejected:           c.Unavailable,
		Shed:               c.TooMany,
		Attempts:           c.Attempts,
		Failed:             c.Failed,
		Queued:             c.Queued,
		TTFT:               percentiles(c.TTFT),
		TPOT:               percentiles(c.TPOT),
		E2E:                percentiles(c.Latency),
		QueueWait:          percentiles(c.QueueWait),
	}
}

// Report returns the document of s's totals.
func (s Stats) Report() Report {
	r := Report{ReportCounts: reportCounts(s.Total), Classes: map[string]ReportCounts{}}
	for _, c := range s.Classes {
		r.Classes[c.Class.String()] = reportCounts(c.Total)
	}
	return r
}
