package stepengine

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Capacity and scheduling defaults (those of the demo profile).
const (
	// DefaultKVBlocks is the number of KV-cache blocks of a rank.
	DefaultKVBlocks = 256
	// DefaultBlockSize is the number of tokens per KV-cache block.
	DefaultBlockSize = 16
	// DefaultMaxBatchedTokens is a step's token budget (vLLM's
	// --max-num-batched-tokens).
	DefaultMaxBatchedTokens = 2048
	// DefaultMaxNumSeqs is the most requests running at once (vLLM's
	// --max-num-seqs default).
	DefaultMaxNumSeqs = 256
	// MaxBlockSize bounds Config.BlockSize.
	MaxBlockSize = 1 << 16
	// MaxKVBlocks bounds Config.KVBlocks (far above any GPU's cache), so
	// that KVBlocks × BlockSize, the longest request, cannot overflow.
	MaxKVBlocks = 1 << 32
)

// Step cost defaults (those of the demo profile): a batch-1 decode step at
// an empty context lasts 1/DefaultDecodeSpeed s, and a step prefills
// DefaultPrefillSpeed tokens per second.
const (
	// DefaultDecodeSpeed is the tokens per second of a request decoding
	// alone at an empty context.
	DefaultDecodeSpeed = 50
	// DefaultPrefillSpeed is the prompt tokens per second a step computes.
	DefaultPrefillSpeed = 16000
	// DefaultStepBase is t_base: the fixed cost of a step.
	DefaultStepBase = 19750 * time.Microsecond
	// DefaultDecodePerRequest is c_decode: the cost of each decoding
	// request in a step.
	DefaultDecodePerRequest = 250 * time.Microsecond
	// DefaultContextPerToken is c_ctx: the cost of each context token read
	// in a step.
	DefaultContextPerToken = 250 * time.Nanosecond
)

// Config is one rank's capacity, scheduling limits and step cost model. A
// step lasts StepBase + PrefillPerToken × prefill tokens + DecodePerRequest
// × decoding requests + ContextPerToken × context tokens read.
type Config struct {
	// KVBlocks is the number of KV-cache blocks of the rank.
	KVBlocks int
	// BlockSize is the number of tokens per block.
	BlockSize int
	// MaxBatchedTokens is a step's token budget: decodes (1 token each)
	// and prefill chunks together.
	MaxBatchedTokens int
	// MaxNumSeqs is the most requests running (admitted) at once.
	MaxNumSeqs int
	// StepBase is t_base, the fixed cost of a step; it must be positive.
	StepBase time.Duration
	// PrefillPerToken is c_prefill, the cost of each prompt token (or
	// token recomputed after a preemption) in a step: 1/prefill speed.
	PrefillPerToken time.Duration
	// DecodePerRequest is c_decode, the cost of each decoding request in a
	// step.
	DecodePerRequest time.Duration
	// ContextPerToken is c_ctx, the cost of each context token a step reads
	// (the tokens already in the cache of every request it runs).
	ContextPerToken time.Duration
}

// DefaultConfig returns the demo profile's configuration.
func DefaultConfig() Config {
	return Config{
		KVBlocks:         DefaultKVBlocks,
		BlockSize:        DefaultBlockSize,
		MaxBatchedTokens: DefaultMaxBatchedTokens,
		MaxNumSeqs:       DefaultMaxNumSeqs,
		StepBase:         DefaultStepBase,
		PrefillPerToken:  time.Second / DefaultPrefillSpeed,
		DecodePerRequest: DefaultDecodePerRequest,
		ContextPerToken:  DefaultContextPerToken,
	}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("stepengine: check %s: %s: %w", field, fmt.Sprintf(format, args...), ErrInvalidConfig))
	}
	if c.KVBlocks < 1 || c.KVBlocks > MaxKVBlocks {
		bad("KVBlocks", "%d is not in [1, %d]", c.KVBlocks, MaxKVBlocks)
	}
	if c.BlockSize < 1 || c.BlockSize > MaxBlockSize {
		bad("BlockSize", "%d is not in [1, %d]", c.BlockSize, MaxBlockSize)
	}
	if c.MaxBatchedTokens < 1 {
		bad("MaxBatchedTokens", "%d is below 1", c.MaxBatchedTokens)
	}
	if c.MaxNumSeqs < 1 {
		bad("MaxNumSeqs", "%d is below 1", c.MaxNumSeqs)
	}
	if c.StepBase <= 0 {
		bad("StepBase", "%v is not positive", c.StepBase)
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{{"PrefillPerToken", c.PrefillPerToken}, {"DecodePerRequest", c.DecodePerRequest}, {"ContextPerToken", c.ContextPerToken}} {
		if d.v < 0 {
			bad(d.field, "%v is negative", d.v)
		}
	}
	return errors.Join(errs...)
}

// StepTime returns how long a step lasts that computes prefillTokens prompt
// tokens, decodes for decoding requests and reads contextTokens tokens from
// the cache.
func (c Config) StepTime(prefillTokens, decoding, contextTokens int) time.Duration {
	return c.StepBase +
		time.Duration(prefillTokens)*c.PrefillPerToken +
		time.Duration(decoding)*c.DecodePerRequest +
		time.Duration(contextTokens)*c.ContextPerToken
}

// DecodeSpeed returns the tokens per second of a request decoding alone at
// an empty context: 1 / (StepBase + DecodePerRequest).
func (c Config) DecodeSpeed() float64 {
	return float64(time.Second) / float64(c.StepBase+c.DecodePerRequest)
}

// PrefillSpeed returns the prompt tokens per second a step computes,
// 1/PrefillPerToken; +Inf when prefill costs nothing.
func (c Config) PrefillSpeed() float64 {
	if c.PrefillPerToken <= 0 {
		return math.Inf(1)
	}
	return float64(time.Second) / float64(c.PrefillPerToken)
}

// WithDecodeSpeed returns c with a batch-1 decode step at an empty context
// lasting 1/s seconds: StepBase, DecodePerRequest and ContextPerToken are
// scaled by the same factor, so the shape of the decode cost (how ITL grows
// with the batch and its context) is kept. s must be positive and finite.
func (c Config) WithDecodeSpeed(s float64) (Config, error) {
	if !(s > 0) || math.IsInf(s, 0) {
		return c, fmt.Errorf("stepengine: set decode speed: %v is not a positive number: %w", s, ErrInvalidConfig)
	}
	f := (float64(time.Second) / s) / float64(c.StepBase+c.DecodePerRequest)
	scale := func(d time.Duration) time.Duration { return time.Duration(math.Round(float64(d) * f)) }
	c.StepBase = max(1, scale(c.StepBase))
	c.DecodePerRequest = scale(c.DecodePerRequest)
	c.ContextPerToken = scale(c.ContextPerToken)
	return c, nil
}

// WithPrefillSpeed returns c with PrefillPerToken = 1/p seconds. p must be
// positive and finite.
func (c Config) WithPrefillSpeed(p float64) (Config, error) {
	if !(p > 0) || math.IsInf(p, 0) {
		return c, fmt.Errorf("stepengine: set prefill speed: %v is not a positive number: %w", p, ErrInvalidConfig)
	}
	c.PrefillPerToken = time.Duration(math.Round(float64(time.Second) / p))
	return c, nil
}

// MaxRequestTokens returns the longest prompt + max_tokens a request may
// have: the one whose context fills the whole cache.
func (c Config) MaxRequestTokens() int {
	// The last token is sampled, never fed back, so its KV is never stored.
	return c.KVBlocks*c.BlockSize + 1
}

// blocksFor returns the KV blocks that hold tokens tokens.
func (c Config) blocksFor(tokens int) int {
	return (tokens + c.BlockSize - 1) / c.BlockSize
}
