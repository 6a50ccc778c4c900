package publisher

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/registry"
)

// DefaultDebounce is how long a change waits for further changes before it is
// published. The first change after a publish starts the wait and later
// changes join it, so a change is never held longer than this, however busy
// the engine.
const DefaultDebounce = 5 * time.Millisecond

// DefaultHeartbeat is how often a rank whose load has not changed is
// published again. The contract asks for a report at least every second.
const DefaultHeartbeat = time.Second

// MaxHeartbeat is the longest heartbeat interval accepted (contract §5:
// "at least every second").
const MaxHeartbeat = time.Second

// MaxRanks is the most ranks one Publisher declares; it keeps the state of
// each, so the bound keeps a typo from allocating gigabytes.
const MaxRanks = 1 << 16

// DefaultRegistryReplicas is the number of replicas the registry bucket is
// created with when it does not exist yet.
const DefaultRegistryReplicas = 1

// DefaultCloseTimeout bounds Close when its context has no earlier deadline.
const DefaultCloseTimeout = 5 * time.Second

// An Option configures a Publisher. Options check their own argument and
// New checks how they combine; every problem is reported.
type Option func(*options) error

// options is the configuration New builds from its Options.
type options struct {
	dpStart   uint32
	dpSize    uint32
	source    string
	prefix    string
	logger    *slog.Logger
	debounce  time.Duration
	heartbeat time.Duration
	now       func() time.Time

	endpoint     string
	blockSize    uint32
	refresh      time.Duration
	replicas     int
	registryOpts []string // names of registry options given, to reject them without an endpoint

	migrate MigrateHandler // nil: migrate requests are not listened to
}

func defaultOptions() options {
	return options{
		dpStart:   0,
		dpSize:    1,
		source:    events.SourceEngine,
		prefix:    events.DefaultSubjectPrefix,
		logger:    slog.Default(),
		debounce:  DefaultDebounce,
		heartbeat: DefaultHeartbeat,
		now:       time.Now,
		refresh:   registry.Refresh,
		replicas:  DefaultRegistryReplicas,
	}
}

// newOptions applies opts to the defaults and checks how they combine. The
// error joins every problem found.
func newOptions(opts []Option) (options, error) {
	o := defaultOptions()
	var errs []error
	for _, opt := range opts {
		if opt == nil {
			errs = append(errs, fmt.Errorf("publisher: apply option: nil Option: %w", ErrInvalidConfig))
			continue
		}
		if err := opt(&o); err != nil {
			errs = append(errs, err)
		}
	}
	if o.debounce >= o.heartbeat {
		errs = append(errs, fmt.Errorf("publisher: check debounce: %v is not shorter than the heartbeat %v: %w",
			o.debounce, o.heartbeat, ErrInvalidConfig))
	}
	if o.endpoint == "" && len(o.registryOpts) > 0 {
		errs = append(errs, fmt.Errorf("publisher: check registry options: %s given without WithEndpoint: %w",
			strings.Join(o.registryOpts, ", "), ErrInvalidConfig))
	}
	if o.endpoint != "" && o.source != events.SourceEngine {
		// Only the engine owns its registry entry; another source deleting
		// it on Close would hide a live worker from the routers.
		errs = append(errs, fmt.Errorf("publisher: check endpoint: source %q may not register a worker, only %q: %w",
			o.source, events.SourceEngine, ErrInvalidConfig))
	}
	if o.migrate != nil && o.source != events.SourceEngine {
		errs = append(errs, fmt.Errorf("publisher: check migrate handler: source %q may not take migrate requests, only %q: %w",
			o.source, events.SourceEngine, ErrInvalidConfig))
	}
	return o, errors.Join(errs...)
}

// WithRanks declares the data-parallel ranks this publisher reports for:
// size ranks from start, size at most MaxRanks. Update rejects any other
// rank. The default is one rank, 0.
func WithRanks(start, size uint32) Option {
	return func(o *options) error {
		if size == 0 || size > MaxRanks {
			return fmt.Errorf("publisher: check ranks: size %d is not in [1, %d]: %w", size, MaxRanks, ErrInvalidConfig)
		}
		if uint64(start)+uint64(size) > math.MaxUint32+1 {
			return fmt.Errorf("publisher: check ranks: start %d + size %d overflows uint32: %w", start, size, ErrInvalidConfig)
		}
		o.dpStart, o.dpSize = start, size
		return nil
	}
}

// WithSource sets who measured the load: events.SourceEngine ("engine", the
// default) for the engine's own truth, or "router/<id>" for a router's
// estimate.
func WithSource(source string) Option {
	return func(o *options) error {
		if err := events.ValidateSource(source); err != nil {
			return fmt.Errorf("publisher: check source: %w: %w", ErrInvalidConfig, err)
		}
		o.source = source
		return nil
	}
}

// WithSubjectPrefix sets the first subject token(s); the default is
// events.DefaultSubjectPrefix.
func WithSubjectPrefix(prefix string) Option {
	return func(o *options) error {
		if err := events.ValidatePrefix(prefix); err != nil {
			return fmt.Errorf("publisher: check subject prefix: %w: %w", ErrInvalidConfig, err)
		}
		o.prefix = prefix
		return nil
	}
}

// WithLogger sets the logger of publish and registry errors; the default is
// slog.Default(). Repeated errors are logged at a limited rate.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("publisher: check logger: nil: %w", ErrInvalidConfig)
		}
		o.logger = l
		return nil
	}
}

// WithDebounce sets how long a change waits for further changes before it is
// published (DefaultDebounce). It must be positive and shorter than the
// heartbeat.
func WithDebounce(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("publisher: check debounce: %v is not positive: %w", d, ErrInvalidConfig)
		}
		o.debounce = d
		return nil
	}
}

// WithHeartbeat sets how often an unchanged rank is published again
// (DefaultHeartbeat). It must be positive and at most MaxHeartbeat.
func WithHeartbeat(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 || d > MaxHeartbeat {
			return fmt.Errorf("publisher: check heartbeat: %v is not in (0, %v]: %w", d, MaxHeartbeat, ErrInvalidConfig)
		}
		o.heartbeat = d
		return nil
	}
}

// WithClock sets the clock of the timestamps on the wire (sent_at,
// registered_at); the default is time.Now. Timers always use the real clock.
func WithClock(now func() time.Time) Option {
	return func(o *options) error {
		if now == nil {
			return fmt.Errorf("publisher: check clock: nil: %w", ErrInvalidConfig)
		}
		o.now = now
		return nil
	}
}

// WithEndpoint registers the worker in the registry bucket
// (events.WorkersBucket) so that routers can send it requests. endpoint is
// the engine's base URL without /v1, such as "http://10.0.0.7:8000"; a
// trailing slash is dropped. Only the engine source may register.
//
// The entry (events.WorkerEntry, JSON) is written in the background at
// once, again every registry refresh and after every reconnect, with
// registered_at the time of that write; Close deletes it. Failed writes are
// retried with capped backoff and never delay load reports.
func WithEndpoint(endpoint string) Option {
	return func(o *options) error {
		ep, err := CheckEndpoint(endpoint)
		if err != nil {
			return err
		}
		o.endpoint = ep
		return nil
	}
}

// WithBlockSize puts the engine's KV block size (tokens per block) in the
// registry entry, where slot trackers read it to hash prompts in the
// engine's blocks (contract §7b, §11). It must be positive. Needs
// WithEndpoint.
func WithBlockSize(tokens uint32) Option {
	return func(o *options) error {
		o.registryOpts = append(o.registryOpts, "WithBlockSize")
		if tokens == 0 {
			return fmt.Errorf("publisher: check block size: 0 tokens: %w", ErrInvalidConfig)
		}
		o.blockSize = tokens
		return nil
	}
}

// WithRegistryRefresh sets how often the registry entry is written again
// (registry.Refresh). It must be positive and shorter than the
// bucket's registry.TTL. Needs WithEndpoint.
func WithRegistryRefresh(d time.Duration) Option {
	return func(o *options) error {
		o.registryOpts = append(o.registryOpts, "WithRegistryRefresh")
		if d <= 0 || d >= registry.TTL {
			return fmt.Errorf("publisher: check registry refresh: %v is not in (0, %v): %w", d, registry.TTL, ErrInvalidConfig)
		}
		o.refresh = d
		return nil
	}
}

// WithRegistryReplicas sets the replicas the registry bucket is created with
// if it does not exist yet (DefaultRegistryReplicas); an existing bucket is
// left alone. Needs WithEndpoint.
func WithRegistryReplicas(n int) Option {
	return func(o *options) error {
		o.registryOpts = append(o.registryOpts, "WithRegistryReplicas")
		if n < 1 {
			return fmt.Errorf("publisher: check registry replicas: %d is less than 1: %w", n, ErrInvalidConfig)
		}
		o.replicas = n
		return nil
	}
}

// CheckEndpoint checks an endpoint as WithEndpoint does: an absolute http or
// https base URL without credentials, query, fragment or a trailing /v1. It
// returns the endpoint as it would be registered, without trailing slashes;
// the error wraps ErrInvalidConfig.
func CheckEndpoint(endpoint string) (string, error) {
	fail := func(why string) (string, error) {
		return "", fmt.Errorf("publisher: check endpoint %q: %s: %w", redact.URL(endpoint), why, ErrInvalidConfig)
	}
	u, err := redact.Parse(endpoint) // url.Parse's error would quote the password
	switch {
	case err != nil:
		return fail(err.Error())
	case u.Scheme != "http" && u.Scheme != "https":
		return fail("not an http or https URL")
	case u.Host == "":
		return fail("no host")
	case u.User != nil:
		return fail("credentials would be published in the registry")
	case u.RawQuery != "" || u.Fragment != "" || u.ForceQuery:
		return fail("has a query or fragment")
	}
	if p := strings.TrimRight(u.Path, "/"); p == "/v1" || strings.HasSuffix(p, "/v1") {
		return fail("give the base URL, without /v1")
	}
	return strings.TrimRight(endpoint, "/"), nil
}
