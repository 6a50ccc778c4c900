// Package registry is the worker registry (bucket workermon-workers,
// contract §7b), where routers find the endpoints of the workers that
// publish load: the engine side's Registration, which writes a worker's
// entry and refreshes it well inside the bucket's max age, and the router
// side's Watcher, which keeps every model's registered workers in a
// lock-free immutable snapshot and drops an entry that was not refreshed in
// time.
//
// Users: the publisher (Registration, for an engine given an endpoint);
// workermon router and other gateways (Watcher). It imports the wire
// contract and NATS only, never the monitor or the Prometheus client, so
// that an engine linking the publisher stays light; the Watcher's metrics
// come in through WithStats.
package registry

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/kvwatch"
)

// TTL is the max age of a registry entry, the bucket's TTL when workermon
// creates it; Registrations write theirs again every Refresh.
const (
	TTL     = kvbucket.RegistryTTL
	Refresh = kvbucket.RegistryRefresh
)

// DefaultProbeInterval is how often a Watcher asks the server about its
// bucket, to notice a deleted or recreated bucket and a stalled watcher.
const DefaultProbeInterval = 5 * time.Second

const (
	// watchBackoffMin is the first delay before re-watching after a failure.
	watchBackoffMin = 50 * time.Millisecond
	// watchBackoffMax caps the delay between re-watch attempts.
	watchBackoffMax = 5 * time.Second
	// watchOpTimeout bounds every single request to the server.
	watchOpTimeout = 5 * time.Second
)

// Sentinel errors of the package.
var (
	// ErrWatcherClosed is returned by WaitReady when the Watcher was closed
	// before its initial values arrived.
	ErrWatcherClosed = errors.New("registry: watcher closed")
	// ErrInvalidOption is wrapped by the constructors when an option or a
	// configuration field is out of range.
	ErrInvalidOption = errors.New("registry: invalid option")
)

// Stats is where a Watcher counts what happens to its watch: why a watch
// ended and was replaced (reconnect, manual, closed, error, gone, recreated,
// stalled), an entry it rejected and why (bad_key, malformed, mismatch,
// no_endpoint, bad_range), and the number of models after each change.
// workermon's router and slot tracker count them in Prometheus
// (workermon_router_watch_*).
type Stats = kvwatch.Stats

// Option configures a Watcher.
type Option func(*options) error

type options struct {
	log        *slog.Logger
	stats      Stats
	now        func() time.Time
	probeEvery time.Duration
	replicas   int
}

func applyOptions(opts []Option) (options, error) {
	o := options{
		log:        slog.New(slog.DiscardHandler),
		stats:      noStats{},
		now:        time.Now,
		probeEvery: DefaultProbeInterval,
		replicas:   1,
	}
	var errs []error
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&o); err != nil {
			errs = append(errs, err)
		}
	}
	return o, errors.Join(errs...)
}

func (o *options) loopConfig(js jetstream.JetStream) kvwatch.Config {
	return kvwatch.Config{
		JS:         js,
		Bucket:     events.WorkersBucket,
		Replicas:   o.replicas,
		Log:        o.log,
		ErrLevel:   slog.LevelWarn,
		Now:        o.now,
		OpTimeout:  watchOpTimeout,
		ProbeEvery: o.probeEvery,
		RetryMin:   watchBackoffMin,
		RetryMax:   watchBackoffMax,
	}
}

// WithLogger sets the logger (default: discard).
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = l
		return nil
	}
}

// WithStats sets where the watch is counted (default: nowhere).
func WithStats(s Stats) Option {
	return func(o *options) error {
		if s == nil {
			return fmt.Errorf("%w: nil stats", ErrInvalidOption)
		}
		o.stats = s
		return nil
	}
}

// WithClock sets the clock (default time.Now) entries are received and
// expired by.
func WithClock(now func() time.Time) Option {
	return func(o *options) error {
		if now == nil {
			return fmt.Errorf("%w: nil clock", ErrInvalidOption)
		}
		o.now = now
		return nil
	}
}

// WithProbeInterval sets how often the bucket is probed for deletion,
// recreation and a stalled watcher (default DefaultProbeInterval).
func WithProbeInterval(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("%w: probe interval %v is not positive", ErrInvalidOption, d)
		}
		o.probeEvery = d
		return nil
	}
}

// WithBucketReplicas sets the replica count the bucket is created with when
// the Watcher finds it missing (default 1). An existing bucket is left alone.
func WithBucketReplicas(n int) Option {
	return func(o *options) error {
		if n < 1 || n > kvbucket.MaxReplicas {
			return fmt.Errorf("%w: replicas %d not in [1, %d]", ErrInvalidOption, n, kvbucket.MaxReplicas)
		}
		o.replicas = n
		return nil
	}
}

// noStats counts nothing.
type noStats struct{}

func (noStats) Rewatched(string) {}
func (noStats) BadRecord(string) {}
func (noStats) Published(int)    {}
