// Package sim simulates a fleet of LLM inference engines for demos, tests
// and benchmarks: each Worker serves an OpenAI-compatible HTTP API for one
// model, runs each of its R data-parallel ranks as a stepengine.Engine (a
// rank scheduled step by step as vLLM V1 schedules, with a finite KV cache
// taken on demand, preemption and chunked prefill), and publishes every
// rank's load through the publisher package, registering its endpoint for
// the routers, as a real engine would.
//
// # The engine
//
// EngineConfig names a stepengine profile (demo by default, tiny, or the
// calibrated llama70b-2xh100) and the values that replace the profile's.
// A request is assigned, when it arrives, to the least loaded rank that can
// hold it (the smallest fraction of its KV cache held, or wanted by the
// prompts still to prefill). Its prompt counts len(prompt)/4+1 tokens (for
// chat: the messages as "role: content\n" lines; an array of token ids, one
// per id), and it generates exactly max_tokens tokens. Admitting more slows
// every request of the rank down: a step lasts longer with every request
// it runs and every token of context it reads, and a full cache preempts
// the newest request, which prefills again (docs/sim.md).
//
// One goroutine per Worker owns the ranks' engines. It begins a step, waits
// on a timer for the step's scheduled end, ends it and hands each request's
// tokens to its HTTP handler, which streams them as they come. While a rank
// has work its next step starts at the previous end, so a stall of the host
// delays tokens but does not lengthen the simulated steps. A client that
// goes away cancels its request, which frees its blocks at once.
//
// The reported load of a rank is:
//
//   - active_decode_blocks: the KV blocks held;
//   - active_prefill_tokens: the prompt tokens not yet computed of its
//     waiting and running requests, recomputation after a preemption
//     included;
//   - kv_total_blocks and max_num_batched_tokens: its capacities.
//
// # Generated text
//
// Token i of a sequence is the word "tok<i>" (" tok<i>" with a leading
// space, except at the start of a chat answer). A prompt whose last word is
// "tok<n>" continues the sequence at tok<n+1>, so a completion cut short and
// continued elsewhere with the text so far (as the router's migration does)
// produces exactly the text one worker would have.
//
// # Metrics
//
// Every Worker also serves GET /metrics: the part of vLLM's Prometheus page
// that `workermon scrape --engine vllm` reads, from the engine loop's last
// snapshot (per rank, labels model_name and engine = the rank:
// vllm:kv_cache_usage_perc = blocks held / blocks in total,
// vllm:cache_config_info with num_gpu_blocks and block_size, requests
// running and waiting, vllm:num_preemptions_total), and vLLM's histograms
// of the time to first token, the inter-token latency and the end-to-end
// latency, with vLLM's bucket bounds. With
// PublishConfig.Disabled a Worker stays off NATS, as a stock engine does,
// and a scrape sidecar publishes for it.
//
// # Faults
//
// Worker.Kill simulates a crash: the HTTP server and the NATS connection are
// closed without a goodbye, and the registry entry is left to expire.
// Worker.Mute simulates an engine cut off from NATS that still serves: its
// connection is closed (again without a goodbye) while HTTP keeps working,
// and Worker.Unmute comes back as a restarted publisher (a new boot id).
// Worker.Close is the graceful way out: goodbye, drain, stop. Uneven ranks
// come from EngineConfig.CapacitySkew and EngineConfig.SpeedSkew.
package sim

import (
	"errors"
	"log/slog"
	"time"

	"github.com/workermon/workermon/sim/stepengine"
)

// Sentinel errors. Configuration problems wrap ErrInvalidConfig; errors of
// NATS and the publisher are wrapped as they come.
var (
	// ErrInvalidConfig: a Config field is missing, out of range, or conflicts
	// with another.
	ErrInvalidConfig = errors.New("invalid configuration")
	// ErrClosed: the Worker was killed or closed.
	ErrClosed = errors.New("worker closed")
)

// DefaultModel is the model a simulated worker serves when none is given.
const DefaultModel = "Qwen/Qwen3-0.6B"

// DefaultAddr is the listen address of a Worker: a random loopback port.
const DefaultAddr = "127.0.0.1:0"

// DefaultHost is the host the workers of a Fleet listen on.
const DefaultHost = "127.0.0.1"

// DefaultWorkers is the number of workers of a Fleet.
const DefaultWorkers = 2

// DefaultRanks is the number of data-parallel ranks of each worker.
const DefaultRanks = 2

// DefaultBaseWorkerID is the id of a Fleet's first worker; the others follow.
const DefaultBaseWorkerID = 1

// DefaultKVBlocks is the number of KV-cache blocks of each rank of the
// default profile.
const DefaultKVBlocks = stepengine.DefaultKVBlocks

// DefaultBlockSize is the number of tokens per KV-cache block of the default
// profile.
const DefaultBlockSize = stepengine.DefaultBlockSize

// DefaultMaxNumBatchedTokens is a step's token budget in the default
// profile.
const DefaultMaxNumBatchedTokens = stepengine.DefaultMaxBatchedTokens

// DefaultMaxTokens is the max_tokens of a request that gives none.
const DefaultMaxTokens = 64

// DefaultMaxBodyBytes bounds the body of a request.
const DefaultMaxBodyBytes = 1 << 20

// DefaultReconnectWait is the pause between reconnect rounds of a worker's
// NATS connection: short, so that a restarted server is found again at once.
const DefaultReconnectWait = 250 * time.Millisecond

// DefaultCloseTimeout bounds Close (drain included) when its context has no
// earlier deadline.
const DefaultCloseTimeout = 10 * time.Second

// MaxWorkers is the largest Fleet accepted.
const MaxWorkers = 1024

// MaxRanks is the most ranks one Worker declares; each rank is simulated, so
// the bound is far below the publisher's.
const MaxRanks = 1024

// State is where a Worker is in its life.
type State int32

// States of a Worker.
const (
	// StateRunning: serving HTTP and reporting its load.
	StateRunning State = iota + 1
	// StateMuted: serving HTTP, but its NATS connection is closed.
	StateMuted
	// StateKilled: crashed on purpose by Kill.
	StateKilled
	// StateClosed: shut down by Close.
	StateClosed
)

// String returns "running", "muted", "killed" or "closed".
func (s State) String() string {
	switch s {
	case StateRunning:
		return "running"
	case StateMuted:
		return "muted"
	case StateKilled:
		return "killed"
	case StateClosed:
		return "closed"
	}
	return "unknown"
}

// discardLogger returns l, or a logger that discards everything when l is
// nil.
func discardLogger(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}
