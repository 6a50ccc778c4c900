package loadgen

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/workermon/workermon/internal/redact"
)

// API is the OpenAI endpoint the generator calls.
type API string

// APIs.
const (
	// APICompletions posts to /v1/completions with a string prompt.
	APICompletions API = "completions"
	// APIChat posts to /v1/chat/completions with one user message.
	APIChat API = "chat"
)

// Profile is the shape of the request rate over time.
type Profile string

// Profiles.
const (
	// ProfileConstant sends Config.RPS requests per second.
	ProfileConstant Profile = "constant"
	// ProfileTriangle ramps from Config.MinRPS up to Config.MaxRPS in half a
	// Config.Period and back down in the other half, in cycles.
	ProfileTriangle Profile = "triangle"
)

// Workload draws the prompt and output lengths of the requests (contract
// §16): uniform in its ranges, in tokens.
type Workload string

// Workloads.
const (
	// WorkloadFixed gives every request Config.PromptTokens and
	// Config.MaxTokens.
	WorkloadFixed Workload = "fixed"
	// WorkloadChat: prompt 128–512, output 64–256.
	WorkloadChat Workload = "chat"
	// WorkloadDocuments: prompt 2048–6144, output 64–256.
	WorkloadDocuments Workload = "documents"
)

// Lengths are the ranges a workload draws from, in tokens, bounds included.
type Lengths struct {
	PromptMin, PromptMax, OutputMin, OutputMax int
}

// Lengths returns w's ranges; ok is false for WorkloadFixed and unknown
// workloads.
func (w Workload) Lengths() (l Lengths, ok bool) {
	switch w {
	case WorkloadChat:
		return Lengths{128, 512, 64, 256}, true
	case WorkloadDocuments:
		return Lengths{2048, 6144, 64, 256}, true
	}
	return Lengths{}, false
}

// Arrivals is how the requests of a rate are spaced.
type Arrivals string

// Arrival processes.
const (
	// ArrivalsUniform spaces the requests evenly.
	ArrivalsUniform Arrivals = "uniform"
	// ArrivalsPoisson draws the gaps from an exponential distribution
	// seeded by Config.Seed: a Poisson process of the rate.
	ArrivalsPoisson Arrivals = "poisson"
)

// DefaultTarget is the server the generator calls: the router's default
// address.
const DefaultTarget = "http://127.0.0.1:8080"

// DefaultModel is the model of the requests when none is given.
const DefaultModel = "Qwen/Qwen3-0.6B"

// DefaultRPS is the rate of the constant profile, requests per second.
const DefaultRPS = 10

// DefaultMinRPS and DefaultMaxRPS bound the triangle profile.
const (
	DefaultMinRPS = 1
	DefaultMaxRPS = 50
)

// DefaultPeriod is the length of one cycle of the triangle profile.
const DefaultPeriod = time.Minute

// DefaultConcurrency caps the requests in flight.
const DefaultConcurrency = 512

// DefaultPromptTokens is the prompt size, in tokens of four bytes.
const DefaultPromptTokens = 256

// DefaultMaxTokens is the max_tokens of every request.
const DefaultMaxTokens = 64

// DefaultTimeout bounds one request, answer included.
const DefaultTimeout = time.Minute

// DefaultCancelFraction is the fraction of requests the client cancels
// mid-way.
const DefaultCancelFraction = 0.02

// DefaultCancelAfter bounds the random delay after which a non-streamed
// request chosen for cancellation is cancelled.
const DefaultCancelAfter = 500 * time.Millisecond

// DefaultWindow is the span of the recent statistics.
const DefaultWindow = 10 * time.Second

// minWindow is the shortest Window accepted: one millisecond per slot.
const minWindow = windowSlots * time.Millisecond

// Config configures a Generator.
type Config struct {
	// Target is the base URL of the OpenAI-compatible server, without /v1.
	Target string
	// Models are the models of the requests, taken in turn.
	Models []string
	// API is the endpoint called.
	API API
	// Stream asks for streamed answers (server-sent events).
	Stream bool

	// Profile is the shape of the request rate.
	Profile Profile
	// RPS is the rate of ProfileConstant, requests per second.
	RPS float64
	// MinRPS and MaxRPS bound ProfileTriangle.
	MinRPS, MaxRPS float64
	// Period is one cycle of ProfileTriangle.
	Period time.Duration

	// Concurrency caps the requests in flight. The load is open-loop: a
	// request due while the cap is reached is not sent and counts as
	// dropped, so a slow server does not slow the rate down.
	Concurrency int
	// Arrivals is how the requests of the rate are spaced.
	Arrivals Arrivals
	// Workload draws each request's prompt and max_tokens;
	// WorkloadFixed uses PromptTokens and MaxTokens.
	Workload Workload
	// PromptTokens is the prompt size in tokens of four bytes (the
	// simulated engine's count) of WorkloadFixed.
	PromptTokens int
	// MaxTokens is the max_tokens of every request of WorkloadFixed.
	MaxTokens int
	// SLO is the latency targets of a good request (Result.Good).
	SLO SLO
	// Timeout bounds one request, answer included (with Retries, all its
	// attempts and the waits between them); a request that takes longer
	// counts as an error, or by its last answer when it was waiting to be
	// sent again.
	Timeout time.Duration
	// Duration, when positive, is how long Run offers load; then it waits
	// for the requests in flight that can still be good (Generator.Hopeful)
	// for at most MaxDrain (0: Timeout), cancels the rest, and returns. Rates are taken
	// over Duration: goodput is the good requests that arrived in it, over
	// it (contract §16), so a request cut at the end does not count against
	// a server that would have served it well. 0: offer until Run's
	// context ends, which cancels the requests in flight.
	Duration time.Duration
	// MaxDrain bounds that wait (0: Timeout).
	MaxDrain time.Duration

	// CancelFraction is the fraction of requests, in [0, 1], that the
	// client cancels mid-way: a streamed one after half its max_tokens
	// chunks, a non-streamed one after a random delay up to CancelAfter. A
	// request that ends before its cancellation counts by its outcome.
	CancelFraction float64
	// CancelAfter bounds the delay of a non-streamed cancellation.
	CancelAfter time.Duration

	// Retries is how many times a request is sent again after an answer
	// the official OpenAI SDKs retry (408, 409, 429, 5xx, or none: a
	// connection error), with their waits: the server's retry-after-ms or
	// Retry-After, else an exponential backoff (retry.go). Its TTFT, TPOT
	// and E2E count from the first attempt; Timeout bounds all the
	// attempts and the waits between them. 0: never.
	Retries int

	// Window is the span of Stats.Window.
	Window time.Duration

	// PriorityMix, when set, gives each request a priority, sent in the
	// PriorityHeader: priority p with probability its share over the sum
	// of the shares. Stats.Classes then counts the answers by class. Nil:
	// no header.
	PriorityMix []PriorityShare
	// Seed seeds the choice of priorities, the Poisson arrivals and the
	// workload's lengths: two runs with the same seed and mix give the
	// n-th request the same priority and lengths.
	Seed uint64
	// NoPriorityHeader chooses each request's priority from PriorityMix for
	// Stats.Classes but sends no header: every request is standard at the
	// router. With the same Seed, a baseline for a run with the header.
	NoPriorityHeader bool

	// Transport carries the requests; nil means a transport of the
	// generator's own, sized for Concurrency.
	Transport http.RoundTripper

	// RateFunc, when set, is the rate in requests per second at the time
	// elapsed since the start of the run, in place of Profile's (a
	// benchmark's scenario).
	RateFunc func(elapsed time.Duration) float64
	// WorkloadAt, when set, is the workload of a request offered at the
	// time elapsed since the start, in place of Workload (chat, then
	// documents); it returns WorkloadChat or WorkloadDocuments.
	WorkloadAt func(elapsed time.Duration) Workload
	// SimOutputTokens makes each request of a workload with ranges (not
	// WorkloadFixed) carry max_tokens = the top of its workload's output
	// range and its drawn output length in the body field
	// sim_output_tokens, which only workermon sim reads (contract §21):
	// the engine ends the request there, as an end-of-sequence token would,
	// without knowing it in advance. The length is drawn as without it.
	SimOutputTokens bool
	// OnDone, when set, is called with every offered request once it has
	// ended, or at once when it was dropped at the cap; from the
	// request's goroutine, so it must be safe for concurrent use.
	OnDone func(Sample)
}

// Sample is one offered request as Config.OnDone sees it.
type Sample struct {
	// Offered is when it was due, since the start of the run.
	Offered time.Duration
	// Dropped: not sent, Concurrency requests were in flight.
	Dropped bool
	// OK: a 200 answer read in full; Result holds the rest.
	OK     bool
	Result Result
	// Good: it met Config.SLO (Result.Good).
	Good bool
	// Queued: it waited QueueWait in a router's queue (X-Workermon-Queued),
	// over all its attempts.
	Queued    bool
	QueueWait time.Duration
	// Attempts is how many times it was sent (Config.Retries); 0 when
	// dropped. Result is its last attempt's, timed from the first.
	Attempts int
	// Failed: its last attempt got no 200 answer (a rejection, another
	// status, or no answer at all). A request cancelled by the client, or
	// cut off by the end of the run during an attempt, is not failed; one
	// cut off while it waited to be sent again counts by its last answer.
	Failed bool
	// Tries are its attempts, in order (len(Tries) == Attempts): when each
	// was sent and how it was answered, so that a benchmark can count the
	// attempts of each second (a retry wave) and the rejections among them.
	Tries []Try
}

// Try is one attempt of a request.
type Try struct {
	// At is when it was sent, since the request's first attempt (0 for
	// the first).
	At time.Duration
	// Status is its answer's HTTP status, 0 without an answer.
	Status int
}

// DefaultConfig returns streamed completions of DefaultModel to
// DefaultTarget at a constant DefaultRPS, with the other Default*
// constants; a triangle profile gets DefaultMinRPS, DefaultMaxRPS and
// DefaultPeriod.
func DefaultConfig() Config {
	return Config{
		Target:         DefaultTarget,
		Models:         []string{DefaultModel},
		API:            APICompletions,
		Stream:         true,
		Profile:        ProfileConstant,
		RPS:            DefaultRPS,
		MinRPS:         DefaultMinRPS,
		MaxRPS:         DefaultMaxRPS,
		Period:         DefaultPeriod,
		Concurrency:    DefaultConcurrency,
		Arrivals:       ArrivalsUniform,
		Workload:       WorkloadFixed,
		PromptTokens:   DefaultPromptTokens,
		MaxTokens:      DefaultMaxTokens,
		SLO:            SLO{TTFT: DefaultSLOTTFT, ITL: DefaultSLOITL},
		Timeout:        DefaultTimeout,
		CancelFraction: DefaultCancelFraction,
		CancelAfter:    DefaultCancelAfter,
		Window:         DefaultWindow,
	}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("loadgen: check %s: %s: %w", field, fmt.Sprintf(format, args...), ErrInvalidConfig))
	}
	if err := checkTarget(c.Target); err != nil {
		bad("Target", "%q: %v", redact.URL(c.Target), err)
	}
	if len(c.Models) == 0 {
		bad("Models", "none")
	}
	for i, m := range c.Models {
		if m == "" {
			bad("Models", "model %d is empty", i)
		}
	}
	if c.API != APICompletions && c.API != APIChat {
		bad("API", "%q is neither %q nor %q", c.API, APICompletions, APIChat)
	}
	switch {
	case c.RateFunc != nil:
	case c.Profile == ProfileConstant:
		if !positive(c.RPS) {
			bad("RPS", "%v is not a positive number", c.RPS)
		}
	case c.Profile == ProfileTriangle:
		if !(c.MinRPS >= 0) || math.IsInf(c.MinRPS, 0) {
			bad("MinRPS", "%v is not a number at least 0", c.MinRPS)
		}
		if !positive(c.MaxRPS) || c.MaxRPS < c.MinRPS {
			bad("MaxRPS", "%v is not a positive number at least MinRPS", c.MaxRPS)
		}
		if c.Period <= 0 {
			bad("Period", "%v is not positive", c.Period)
		}
	default:
		bad("Profile", "%q is neither %q nor %q", c.Profile, ProfileConstant, ProfileTriangle)
	}
	if c.Concurrency < 1 {
		bad("Concurrency", "%d is below 1", c.Concurrency)
	}
	if c.PromptTokens < 1 {
		bad("PromptTokens", "%d is below 1", c.PromptTokens)
	}
	if c.MaxTokens < 1 {
		bad("MaxTokens", "%d is below 1", c.MaxTokens)
	}
	if c.Arrivals != ArrivalsUniform && c.Arrivals != ArrivalsPoisson {
		bad("Arrivals", "%q is neither %q nor %q", c.Arrivals, ArrivalsUniform, ArrivalsPoisson)
	}
	if _, ok := c.Workload.Lengths(); !ok && c.Workload != WorkloadFixed {
		bad("Workload", "%q is not %q, %q or %q", c.Workload, WorkloadFixed, WorkloadChat, WorkloadDocuments)
	}
	if c.SimOutputTokens && c.Workload == WorkloadFixed && c.WorkloadAt == nil {
		bad("SimOutputTokens", "needs a workload with an output range (%q or %q), not %q", WorkloadChat, WorkloadDocuments, WorkloadFixed)
	}
	if c.SLO.TTFT <= 0 || c.SLO.ITL <= 0 {
		bad("SLO", "TTFT %v and ITL %v must be positive", c.SLO.TTFT, c.SLO.ITL)
	}
	if c.Duration < 0 {
		bad("Duration", "%v is negative", c.Duration)
	}
	if c.MaxDrain < 0 {
		bad("MaxDrain", "%v is negative", c.MaxDrain)
	}
	if c.Retries < 0 {
		bad("Retries", "%d is negative", c.Retries)
	}
	if c.Timeout <= 0 {
		bad("Timeout", "%v is not positive", c.Timeout)
	}
	if !(c.CancelFraction >= 0 && c.CancelFraction <= 1) {
		bad("CancelFraction", "%v is not in [0, 1]", c.CancelFraction)
	}
	if c.CancelAfter <= 0 {
		bad("CancelAfter", "%v is not positive", c.CancelAfter)
	}
	if c.Window < minWindow {
		bad("Window", "%v is shorter than %v", c.Window, minWindow)
	}
	if err := checkMix(c.PriorityMix); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// positive reports whether v is a positive finite number.
func positive(v float64) bool { return v > 0 && !math.IsInf(v, 0) }

// checkTarget accepts an http or https base URL without /v1, query or
// fragment.
func checkTarget(target string) error {
	u, err := redact.Parse(target) // url.Parse's error would quote the password
	switch {
	case err != nil:
		return err
	case u.Scheme != "http" && u.Scheme != "https":
		return errors.New("not an http or https URL")
	case u.Host == "":
		return errors.New("no host")
	case u.RawQuery != "" || u.Fragment != "":
		return errors.New("has a query or fragment")
	case strings.HasSuffix(strings.TrimRight(u.Path, "/"), "/v1"):
		return errors.New("give the base URL, without /v1")
	}
	return nil
}

// RateAt returns the target rate, in requests per second, at elapsed time
// since the start of the run.
func (c Config) RateAt(elapsed time.Duration) float64 {
	if c.RateFunc != nil {
		return c.RateFunc(elapsed)
	}
	if c.Profile != ProfileTriangle {
		return c.RPS
	}
	if c.Period <= 0 || elapsed < 0 {
		return c.MinRPS
	}
	phase := float64(elapsed%c.Period) / float64(c.Period) // [0, 1)
	x := 2 * phase                                         // up in the first half
	if phase >= 0.5 {
		x = 2 - 2*phase // down in the second
	}
	return c.MinRPS + (c.MaxRPS-c.MinRPS)*x
}
