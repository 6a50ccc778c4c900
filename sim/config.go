package sim

import (
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/registry"
	"github.com/workermon/workermon/sim/stepengine"
)

// EngineConfig is the engine profile of a simulated engine's ranks and the
// values that replace the profile's. A zero override keeps the profile's
// value.
type EngineConfig struct {
	// Profile is the name of a stepengine profile (stepengine.ProfileNames);
	// empty means stepengine.DefaultProfile.
	Profile string
	// KVBlocks, when set, is the number of KV-cache blocks of each rank.
	KVBlocks int
	// BlockSize, when set, is the number of tokens per block.
	BlockSize int
	// MaxNumBatchedTokens, when set, is a step's token budget: decodes (1
	// token each) and prefill chunks together.
	MaxNumBatchedTokens int
	// MaxNumSeqs, when set, is the most requests running at once on a rank.
	MaxNumSeqs int
	// PrefillSpeed, when set, is the prompt tokens per second a step
	// computes (c_prefill = 1/PrefillSpeed).
	PrefillSpeed float64
	// DecodeSpeed, when set, makes a batch-1 decode step at an empty
	// context last 1/DecodeSpeed seconds; the other decode costs are scaled
	// with it (stepengine.Config.WithDecodeSpeed).
	DecodeSpeed float64
	// DefaultMaxTokens is the max_tokens of a request that gives none.
	DefaultMaxTokens int
	// MaxBodyBytes bounds a request body; a larger one gets 413.
	MaxBodyBytes int64
	// CapacitySkew, when set, has one factor per rank that multiplies that
	// rank's KVBlocks and MaxNumBatchedTokens (rounded, at least 1): a rank
	// with a smaller KV cache, as on a smaller GPU.
	CapacitySkew []float64
	// SpeedSkew, when set, has one factor per rank that divides every cost
	// of that rank's steps: a rank at 0.5 takes twice as long per step.
	SpeedSkew []float64
}

// EngineProfiles returns the names of the engine profiles, the default
// first.
func EngineProfiles() []string { return stepengine.ProfileNames() }

// DefaultEngineConfig returns the default profile with no override and no
// skew.
func DefaultEngineConfig() EngineConfig {
	return EngineConfig{
		Profile:          stepengine.DefaultProfile,
		DefaultMaxTokens: DefaultMaxTokens,
		MaxBodyBytes:     DefaultMaxBodyBytes,
	}
}

// Step returns the step engine configuration of c's profile with c's
// overrides, before any skew.
func (c EngineConfig) Step() (stepengine.Config, error) {
	name := c.Profile
	if name == "" {
		name = stepengine.DefaultProfile
	}
	p, err := stepengine.LookupProfile(name)
	if err != nil {
		return stepengine.Config{}, err
	}
	s := p.Config
	for _, o := range []struct {
		dst *int
		v   int
	}{{&s.KVBlocks, c.KVBlocks}, {&s.BlockSize, c.BlockSize}, {&s.MaxBatchedTokens, c.MaxNumBatchedTokens}, {&s.MaxNumSeqs, c.MaxNumSeqs}} {
		if o.v != 0 {
			*o.dst = o.v
		}
	}
	if c.DecodeSpeed != 0 {
		if s, err = s.WithDecodeSpeed(c.DecodeSpeed); err != nil {
			return stepengine.Config{}, err
		}
	}
	if c.PrefillSpeed != 0 {
		if s, err = s.WithPrefillSpeed(c.PrefillSpeed); err != nil {
			return stepengine.Config{}, err
		}
	}
	return s, s.Validate()
}

// check adds every problem of c for an engine of ranks ranks to errs.
func (c EngineConfig) check(errs *configErrors, ranks uint32) {
	bad := errs.add
	before := len(*errs)
	defer func() {
		// The fields are each in range: check what they make together.
		if len(*errs) == before {
			if _, err := c.Step(); err != nil {
				*errs = append(*errs, fmt.Errorf("sim: check Engine: %w: %w", ErrInvalidConfig, err))
			}
		}
	}()
	if c.Profile != "" {
		if _, err := stepengine.LookupProfile(c.Profile); err != nil {
			bad("Profile", "%q is not one of %s", c.Profile, strings.Join(stepengine.ProfileNames(), ", "))
		}
	}
	for _, o := range []struct {
		field string
		v     int
	}{{"KVBlocks", c.KVBlocks}, {"MaxNumBatchedTokens", c.MaxNumBatchedTokens}, {"MaxNumSeqs", c.MaxNumSeqs}} {
		if o.v < 0 {
			bad(o.field, "%d is negative (0: the profile's)", o.v)
		}
	}
	if c.BlockSize < 0 || c.BlockSize > stepengine.MaxBlockSize {
		bad("BlockSize", "%d is not in [0, %d] (0: the profile's)", c.BlockSize, stepengine.MaxBlockSize)
	}
	for _, s := range []struct {
		field string
		v     float64
	}{{"PrefillSpeed", c.PrefillSpeed}, {"DecodeSpeed", c.DecodeSpeed}} {
		if !(s.v >= 0) || math.IsInf(s.v, 0) {
			bad(s.field, "%v is not a positive number or 0 (the profile's)", s.v)
		}
	}
	if c.DefaultMaxTokens < 1 {
		bad("DefaultMaxTokens", "%d is below 1", c.DefaultMaxTokens)
	}
	if c.MaxBodyBytes < 1 {
		bad("MaxBodyBytes", "%d is below 1", c.MaxBodyBytes)
	}
	for _, s := range []struct {
		field   string
		factors []float64
	}{{"CapacitySkew", c.CapacitySkew}, {"SpeedSkew", c.SpeedSkew}} {
		if len(s.factors) != 0 && len(s.factors) != int(ranks) {
			bad(s.field, "%d factors for %d ranks", len(s.factors), ranks)
		}
		for i, f := range s.factors {
			if !(f > 0) || math.IsInf(f, 0) {
				bad(s.field, "factor %d: %v is not a positive number", i, f)
			}
		}
	}
}

// rankConfigs returns the step engine configuration of each of ranks ranks,
// skew applied. c must be valid.
func (c EngineConfig) rankConfigs(ranks uint32) ([]stepengine.Config, error) {
	base, err := c.Step()
	if err != nil {
		return nil, fmt.Errorf("sim: configure engine: %w: %w", ErrInvalidConfig, err)
	}
	out := make([]stepengine.Config, ranks)
	for i := range out {
		s := base
		if len(c.CapacitySkew) > 0 {
			f := c.CapacitySkew[i]
			s.KVBlocks = max(1, int(math.Round(float64(s.KVBlocks)*f)))
			s.MaxBatchedTokens = max(1, int(math.Round(float64(s.MaxBatchedTokens)*f)))
		}
		if len(c.SpeedSkew) > 0 {
			slow := func(d time.Duration) time.Duration { return time.Duration(math.Round(float64(d) / c.SpeedSkew[i])) }
			s.StepBase = max(1, slow(s.StepBase))
			s.PrefillPerToken = slow(s.PrefillPerToken)
			s.DecodePerRequest = slow(s.DecodePerRequest)
			s.ContextPerToken = slow(s.ContextPerToken)
		}
		if err := s.Validate(); err != nil { // a skew may carry a value out of range
			return nil, fmt.Errorf("sim: configure rank %d: %w: %w", i, ErrInvalidConfig, err)
		}
		out[i] = s
	}
	return out, nil
}

// PublishConfig is how a worker reports its load.
type PublishConfig struct {
	// SubjectPrefix is the first subject token(s) of the reports.
	SubjectPrefix string
	// Heartbeat is how often an unchanged rank is reported again.
	Heartbeat time.Duration
	// Debounce is how long a change waits for further changes.
	Debounce time.Duration
	// RegistryRefresh is how often the registry entry is written again.
	RegistryRefresh time.Duration
	// Disabled keeps the worker off NATS: it reports no load and registers
	// nothing, as a stock engine does; `workermon scrape` then reads its
	// vLLM-shaped /metrics page and publishes for it.
	Disabled bool
}

// DefaultPublishConfig returns the publisher's defaults.
func DefaultPublishConfig() PublishConfig {
	return PublishConfig{
		SubjectPrefix:   events.DefaultSubjectPrefix,
		Heartbeat:       publisher.DefaultHeartbeat,
		Debounce:        publisher.DefaultDebounce,
		RegistryRefresh: registry.Refresh,
	}
}

// check adds every problem of c to errs.
func (c PublishConfig) check(errs *configErrors) {
	bad := errs.add
	if err := events.ValidatePrefix(c.SubjectPrefix); err != nil {
		bad("SubjectPrefix", "%v", err)
	}
	if c.Heartbeat <= 0 || c.Heartbeat > publisher.MaxHeartbeat {
		bad("Heartbeat", "%v is not in (0, %v]", c.Heartbeat, publisher.MaxHeartbeat)
	}
	if c.Debounce <= 0 || c.Debounce >= c.Heartbeat {
		bad("Debounce", "%v is not positive and shorter than the heartbeat", c.Debounce)
	}
	if c.RegistryRefresh <= 0 || c.RegistryRefresh >= registry.TTL {
		bad("RegistryRefresh", "%v is not in (0, %v)", c.RegistryRefresh, registry.TTL)
	}
}

// options returns the publisher options of c.
func (c PublishConfig) options() []publisher.Option {
	return []publisher.Option{
		publisher.WithSubjectPrefix(c.SubjectPrefix),
		publisher.WithHeartbeat(c.Heartbeat),
		publisher.WithDebounce(c.Debounce),
		publisher.WithRegistryRefresh(c.RegistryRefresh),
	}
}

// defaultNATSConfig is natsconn's default client with a short reconnect
// wait.
func defaultNATSConfig() natsconn.Config {
	c := natsconn.DefaultConfig()
	c.ReconnectWait = DefaultReconnectWait
	return c
}

// WorkerConfig configures one simulated engine instance.
type WorkerConfig struct {
	// Model is the one model the worker serves.
	Model string
	// WorkerID is the engine instance id of its reports.
	WorkerID uint64
	// DPStart is its first data-parallel rank.
	DPStart uint32
	// Ranks is its number of data-parallel ranks, 1 to MaxRanks.
	Ranks uint32
	// Addr is the HTTP listen address, host:port; port 0 picks one.
	Addr string
	// Endpoint is the base URL (without /v1) registered for the routers;
	// empty means http://<listen address>, with 127.0.0.1 for an
	// unspecified host.
	Endpoint string
	// Engine is the capacity and speed of its ranks.
	Engine EngineConfig
	// Publish is how it reports its load.
	Publish PublishConfig
	// NATS is its own connection's configuration; the worker opens it (and
	// opens it again on Unmute) and closes it. A Name left at
	// natsconn.DefaultName becomes workermon-sim-<worker id>.
	NATS natsconn.Config
}

// DefaultWorkerConfig returns a worker of DefaultModel with id 1,
// DefaultRanks ranks on DefaultAddr, talking to the default NATS server.
func DefaultWorkerConfig() WorkerConfig {
	return WorkerConfig{
		Model:    DefaultModel,
		WorkerID: DefaultBaseWorkerID,
		Ranks:    DefaultRanks,
		Addr:     DefaultAddr,
		Engine:   DefaultEngineConfig(),
		Publish:  DefaultPublishConfig(),
		NATS:     defaultNATSConfig(),
	}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c WorkerConfig) Validate() error {
	var errs configErrors
	bad := errs.add
	errs.addShared(c.Model, c.Ranks, c.Engine, c.Publish, c.NATS)
	if uint64(c.DPStart)+uint64(c.Ranks) > math.MaxUint32+1 {
		bad("DPStart", "%d + %d ranks overflows uint32", c.DPStart, c.Ranks)
	}
	if _, port, err := net.SplitHostPort(c.Addr); err != nil {
		bad("Addr", "%v", err)
	} else if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		bad("Addr", "port %q is not a number in [0, 65535]", port)
	}
	if c.Endpoint != "" {
		if _, err := publisher.CheckEndpoint(c.Endpoint); err != nil {
			bad("Endpoint", "%v", err)
		}
	}
	return errors.Join(errs...)
}

// configErrors collects the problems of a configuration.
type configErrors []error

// add records a problem of field; it wraps ErrInvalidConfig.
func (e *configErrors) add(field, format string, args ...any) {
	*e = append(*e, fmt.Errorf("sim: check %s: %s: %w", field, fmt.Sprintf(format, args...), ErrInvalidConfig))
}

// addShared records the problems of what a WorkerConfig and a FleetConfig
// share: the model, the number of ranks, the engine, the publishing and the
// NATS connection.
func (e *configErrors) addShared(model string, ranks uint32, engine EngineConfig, publish PublishConfig, nc natsconn.Config) {
	if err := events.ValidateModel(model); err != nil {
		e.add("Model", "%v", err)
	}
	if ranks < 1 || ranks > MaxRanks {
		e.add("Ranks", "%d is not in [1, %d]", ranks, MaxRanks)
	}
	engine.check(e, ranks)
	publish.check(e)
	if err := nc.Validate(); err != nil {
		*e = append(*e, fmt.Errorf("sim: check NATS: %w: %w", ErrInvalidConfig, err))
	}
}
