package sim

import (
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/registry"
)

// EngineConfig is the capacity and speed of a simulated engine's ranks.
type EngineConfig struct {
	// KVBlocks is the number of KV-cache blocks of each rank.
	KVBlocks int
	// BlockSize is the number of tokens per block.
	BlockSize int
	// MaxNumBatchedTokens is each rank's budget of prompt tokens in prefill
	// at once.
	MaxNumBatchedTokens int
	// PrefillSpeed is the prompt tokens per second one request prefills.
	PrefillSpeed float64
	// DecodeSpeed is the tokens per second one request generates.
	DecodeSpeed float64
	// Tick is how often the engine advances its requests while it has work.
	Tick time.Duration
	// DefaultMaxTokens is the max_tokens of a request that gives none.
	DefaultMaxTokens int
	// MaxBodyBytes bounds a request body; a larger one gets 413.
	MaxBodyBytes int64
	// CapacitySkew, when set, has one factor per rank that multiplies that
	// rank's KVBlocks and MaxNumBatchedTokens (rounded, at least 1): a rank
	// with a smaller KV cache, as on a smaller GPU.
	CapacitySkew []float64
	// SpeedSkew, when set, has one factor per rank that multiplies that
	// rank's PrefillSpeed and DecodeSpeed: a slower rank.
	SpeedSkew []float64
}

// DefaultEngineConfig returns the defaults of the Default* constants, with
// no skew.
func DefaultEngineConfig() EngineConfig {
	return EngineConfig{
		KVBlocks:            DefaultKVBlocks,
		BlockSize:           DefaultBlockSize,
		MaxNumBatchedTokens: DefaultMaxNumBatchedTokens,
		PrefillSpeed:        DefaultPrefillSpeed,
		DecodeSpeed:         DefaultDecodeSpeed,
		Tick:                DefaultTick,
		DefaultMaxTokens:    DefaultMaxTokens,
		MaxBodyBytes:        DefaultMaxBodyBytes,
	}
}

// check adds every problem of c for an engine of ranks ranks to errs.
func (c EngineConfig) check(errs *configErrors, ranks uint32) {
	bad := errs.add
	if c.KVBlocks < 1 {
		bad("KVBlocks", "%d is below 1", c.KVBlocks)
	}
	if c.BlockSize < 1 || c.BlockSize > 1<<16 {
		bad("BlockSize", "%d is not in [1, 65536]", c.BlockSize)
	}
	if c.MaxNumBatchedTokens < 1 {
		bad("MaxNumBatchedTokens", "%d is below 1", c.MaxNumBatchedTokens)
	}
	if !(c.PrefillSpeed > 0) || math.IsInf(c.PrefillSpeed, 0) {
		bad("PrefillSpeed", "%v is not a positive number", c.PrefillSpeed)
	}
	if !(c.DecodeSpeed > 0) || math.IsInf(c.DecodeSpeed, 0) {
		bad("DecodeSpeed", "%v is not a positive number", c.DecodeSpeed)
	}
	if c.Tick <= 0 {
		bad("Tick", "%v is not positive", c.Tick)
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

// rankSpecs returns the capacity and speed of each of ranks ranks.
func (c EngineConfig) rankSpecs(ranks uint32) []rankSpec {
	specs := make([]rankSpec, ranks)
	for i := range specs {
		capf, speedf := 1.0, 1.0
		if len(c.CapacitySkew) > 0 {
			capf = c.CapacitySkew[i]
		}
		if len(c.SpeedSkew) > 0 {
			speedf = c.SpeedSkew[i]
		}
		specs[i] = rankSpec{
			kvBlocks:     max(1, int(math.Round(float64(c.KVBlocks)*capf))),
			maxBatched:   max(1, int(math.Round(float64(c.MaxNumBatchedTokens)*capf))),
			prefillSpeed: c.PrefillSpeed * speedf,
			decodeSpeed:  c.DecodeSpeed * speedf,
		}
	}
	return specs
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
