package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"slices"
	"strconv"
	"sync"

	"github.com/workermon/workermon/natsconn"
)

// FleetConfig configures a fleet of identical workers of one model.
type FleetConfig struct {
	// Model is the model every worker serves.
	Model string
	// Workers is the number of workers, 1 to MaxWorkers.
	Workers int
	// Ranks is the number of data-parallel ranks of each worker (ranks 0 to
	// Ranks-1).
	Ranks uint32
	// BaseWorkerID is the id of the first worker; worker i has
	// BaseWorkerID+i.
	BaseWorkerID uint64
	// Host is the host the workers listen on.
	Host string
	// BasePort is the port of the first worker; worker i listens on
	// BasePort+i. 0 picks a free port for each.
	BasePort int
	// AdvertiseHost, when set, is the host in the endpoints the workers
	// register (http://AdvertiseHost:BasePort+i), for workers that listen
	// on an address routers cannot use, like 0.0.0.0 in a container. It
	// needs a BasePort.
	AdvertiseHost string
	// Engine is the capacity and speed of every worker's ranks.
	Engine EngineConfig
	// Publish is how every worker reports its load.
	Publish PublishConfig
	// NATS configures each worker's own connection; its Name, when left at
	// natsconn.DefaultName, becomes workermon-sim-<worker id>.
	NATS natsconn.Config
}

// DefaultFleetConfig returns DefaultWorkers workers of DefaultRanks ranks of
// DefaultModel from id DefaultBaseWorkerID, on random loopback ports,
// talking to the default NATS server.
func DefaultFleetConfig() FleetConfig {
	return FleetConfig{
		Model:        DefaultModel,
		Workers:      DefaultWorkers,
		Ranks:        DefaultRanks,
		BaseWorkerID: DefaultBaseWorkerID,
		Host:         DefaultHost,
		Engine:       DefaultEngineConfig(),
		Publish:      DefaultPublishConfig(),
		NATS:         defaultNATSConfig(),
	}
}

// Validate reports every problem of c, joined; each wraps ErrInvalidConfig.
func (c FleetConfig) Validate() error {
	var errs configErrors
	bad := errs.add
	errs.addShared(c.Model, c.Ranks, c.Engine, c.Publish, c.NATS)
	if c.Workers < 1 || c.Workers > MaxWorkers {
		bad("Workers", "%d is not in [1, %d]", c.Workers, MaxWorkers)
	} else if c.BaseWorkerID > math.MaxUint64-uint64(c.Workers-1) {
		bad("BaseWorkerID", "%d + %d workers overflows uint64", c.BaseWorkerID, c.Workers)
	}
	if c.Host == "" {
		bad("Host", "empty")
	}
	if c.AdvertiseHost != "" && c.BasePort == 0 {
		bad("AdvertiseHost", "needs a fixed BasePort")
	}
	if c.BasePort < 0 || c.BasePort > 0 && c.BasePort+c.Workers-1 > math.MaxUint16 {
		bad("BasePort", "%d is not 0 or a port leaving room for %d workers", c.BasePort, c.Workers)
	}
	return errors.Join(errs...)
}

// WorkerConfig returns the configuration of worker i of the fleet.
func (c FleetConfig) WorkerConfig(i int) WorkerConfig {
	port := 0
	if c.BasePort > 0 {
		port = c.BasePort + i
	}
	endpoint := ""
	if c.AdvertiseHost != "" {
		endpoint = "http://" + net.JoinHostPort(c.AdvertiseHost, strconv.Itoa(port))
	}
	return WorkerConfig{
		Model:    c.Model,
		WorkerID: c.BaseWorkerID + uint64(i),
		Ranks:    c.Ranks,
		Addr:     net.JoinHostPort(c.Host, strconv.Itoa(port)),
		Endpoint: endpoint,
		Engine:   c.Engine,
		Publish:  c.Publish,
		NATS:     c.NATS,
	}
}

// Fleet is a set of workers started and closed together.
type Fleet struct {
	model   string
	workers []*Worker
}

// NewFleet starts the workers of cfg one after the other; ctx bounds each
// one's wait for its NATS connection. If one fails to start, those already
// started are closed and the error is returned. logger may be nil.
func NewFleet(ctx context.Context, cfg FleetConfig, logger *slog.Logger) (*Fleet, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	f := &Fleet{model: cfg.Model, workers: make([]*Worker, 0, cfg.Workers)}
	for i := range cfg.Workers {
		w, err := NewWorker(ctx, cfg.WorkerConfig(i), logger)
		if err != nil {
			closeErr := f.Close(context.WithoutCancel(ctx))
			return nil, errors.Join(fmt.Errorf("sim: start fleet: %w", err), closeErr)
		}
		f.workers = append(f.workers, w)
	}
	return f, nil
}

// Model returns the model the fleet serves.
func (f *Fleet) Model() string { return f.model }

// Workers returns the workers, in id order.
func (f *Fleet) Workers() []*Worker { return slices.Clone(f.workers) }

// Worker returns the worker with id, or nil.
func (f *Fleet) Worker(id uint64) *Worker {
	for _, w := range f.workers {
		if w.ID() == id {
			return w
		}
	}
	return nil
}

// Stats returns a snapshot of every worker, in id order.
func (f *Fleet) Stats() []WorkerStats {
	out := make([]WorkerStats, len(f.workers))
	for i, w := range f.workers {
		out[i] = w.Stats()
	}
	return out
}

// Close closes every worker at the same time (see Worker.Close) and returns
// their errors joined.
func (f *Fleet) Close(ctx context.Context) error {
	errs := make([]error, len(f.workers))
	var wg sync.WaitGroup
	for i, w := range f.workers {
		wg.Go(func() { errs[i] = w.Close(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}
