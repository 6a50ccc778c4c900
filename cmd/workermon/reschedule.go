package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
	"github.com/workermon/workermon/resched"
	"github.com/workermon/workermon/resched/dispatch"
)

// Rescheduler defaults (contract §12; the planner's are resched's).
const (
	// RecommendedReschedulingInterval is the round interval the docs
	// recommend when turning the rescheduler on, and what the planner's
	// defaults were measured with (docs/rescheduler.md); the flag's
	// default stays 0, off.
	RecommendedReschedulingInterval = 200 * time.Millisecond
	// DefaultReschedulingTimeout is how long a migrate request waits for an
	// engine's answer when --rescheduling-timeout is unset, cut to half of
	// --rescheduling-interval when that is shorter.
	DefaultReschedulingTimeout = time.Second
	reschedulingHistory        = 50
)

// reschedOptions are the flags of cordons' and the rescheduler's part of
// `workermon serve`.
type reschedOptions struct {
	interval time.Duration // 0: off
	timeout  time.Duration
	// timeoutSet says the operator set --rescheduling-timeout: only then is
	// a timeout not below the interval refused.
	timeoutSet bool
	planner    resched.Config
}

func defaultReschedOptions() reschedOptions {
	return reschedOptions{timeout: DefaultReschedulingTimeout, planner: resched.DefaultConfig()}
}

func (o *serveOptions) reschedFlags(fs *flag.FlagSet) {
	fs.Float64Var(&o.monitor.ReleaseMargin, "release-margin", o.monitor.ReleaseMargin,
		"hysteresis in [0, 1): a busy rank turns free only at or below (1 − margin) × each threshold that made it busy (0: off)")
	r := &o.resched
	fs.DurationVar(&r.interval, "rescheduling-interval", r.interval,
		"run a rescheduling round this often (0: off; "+RecommendedReschedulingInterval.String()+" recommended, with --balance-gap 0.05 --rescheduling-cooldown 500ms --rescheduling-max-requests 4)")
	fs.Float64Var(&r.planner.BalanceGap, "balance-gap", r.planner.BalanceGap,
		"decode_load moves work from workers above the model's mean (projected) KV usage + gap to workers below mean − gap")
	fs.DurationVar(&r.planner.Cooldown, "rescheduling-cooldown", r.planner.Cooldown, "a worker rests this long after a migration")
	fs.Uint64Var(&r.planner.MaxRequests, "rescheduling-max-requests", r.planner.MaxRequests,
		"at most this many running requests one migrate request asks an engine to cut (a decode_load pair asks for as many as close the gap; a failover pair this many)")
	fs.Var(setDuration{&r.timeout, &r.timeoutSet}, "rescheduling-timeout",
		"wait this long for an engine's answer to a migrate request (unset: 1s, or half of --rescheduling-interval when that is shorter)")
}

// effectiveTimeout is the migrate requests' timeout: the flag's value when
// the operator set it, else the default cut to half the interval when that
// is shorter (contract §12).
func (r reschedOptions) effectiveTimeout() time.Duration {
	if r.timeoutSet || r.interval <= 0 {
		return r.timeout
	}
	return min(r.timeout, r.interval/2)
}

func (r reschedOptions) validate() []error {
	var errs []error
	if err := r.planner.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("serve: --balance-gap/--rescheduling-cooldown/--rescheduling-max-requests: %w", err))
	}
	if r.interval < 0 {
		errs = append(errs, fmt.Errorf("serve: --rescheduling-interval %v must not be negative", r.interval))
	}
	timeout := r.effectiveTimeout()
	if timeout <= 0 {
		errs = append(errs, fmt.Errorf("serve: --rescheduling-timeout %v must be positive", timeout))
	}
	if r.interval > 0 && timeout >= r.interval {
		errs = append(errs, fmt.Errorf("serve: --rescheduling-timeout %v must be below --rescheduling-interval %v", timeout, r.interval))
	}
	return errs
}

// newCordons opens the cordons bucket for the API and makes the watcher
// that hands every cordon to the monitor; its loop is started with the
// monitor's (runCordons).
func (svc *service) newCordons(js jetstream.JetStream, replicas int) (*overrides.CordonStore, *overrides.CordonWatcher, error) {
	scfg := overrides.DefaultCordonStoreConfig()
	scfg.JetStream, scfg.Replicas = js, replicas
	store, err := overrides.NewCordonStore(scfg)
	if err != nil {
		return nil, nil, err
	}
	wcfg := overrides.DefaultCordonWatcherConfig()
	wcfg.JetStream, wcfg.Replicas, wcfg.Registerer = js, replicas, svc.reg
	wcfg.Logger = svc.log.With("component", "cordons")
	wcfg.OnChange = svc.applyCordon
	watcher, err := overrides.NewCordonWatcher(wcfg)
	if err != nil {
		return nil, nil, err
	}
	return store, watcher, nil
}

// applyCordon hands a change of the cordons bucket to the monitor.
func (svc *service) applyCordon(model string, worker uint64, on bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := svc.mon.SetCordon(ctx, model, worker, on); err != nil && !errors.Is(err, monitor.ErrStopped) {
		svc.log.Warn("cordon not applied", "model", model, "worker_id", worker, "cordoned", on, "err", err)
	}
}

// bothClosed returns a channel closed once a and b are, and starts the
// owned loop that closes it.
func (svc *service) bothClosed(a, b <-chan struct{}) <-chan struct{} {
	out := make(chan struct{})
	svc.stopSync, svc.syncDone = goLoop(func(ctx context.Context) error {
		for _, ch := range []<-chan struct{}{a, b} {
			select {
			case <-ch:
			case <-ctx.Done():
				return nil
			}
		}
		close(out)
		return nil
	}, svc.log, "sync")
	return out
}

// reschedSource is the dispatcher's view of the monitor.
type reschedSource struct{ svc *service }

func (s reschedSource) Snapshot(ctx context.Context) (resched.Snapshot, error) {
	return s.svc.mon.RescheduleSnapshot(ctx)
}

// Epoch is the epoch of the model's partition while this monitor holds it
// with a valid lease, 0 otherwise: a standby proposes nothing.
func (s reschedSource) Epoch(model string) uint64 {
	return s.svc.leaser.Epoch(events.PartitionOfKey(events.ModelKey(model), s.svc.parts))
}

// reschedulerReply is what GET /rescheduler shows.
type reschedulerReply struct {
	Enabled     bool             `json:"enabled"`
	Interval    string           `json:"interval,omitempty"`
	BalanceGap  float64          `json:"balance_gap"`
	Cooldown    string           `json:"cooldown"`
	MaxRequests uint64           `json:"max_requests"`
	Rounds      []dispatch.Round `json:"rounds"`
}

// startRescheduler starts the dispatcher when --rescheduling-interval is
// set; it returns what GET /rescheduler shows.
func (svc *service) startRescheduler(o serveOptions) (func() any, error) {
	r := o.resched
	reply := reschedulerReply{Enabled: r.interval > 0, BalanceGap: r.planner.BalanceGap,
		Cooldown: r.planner.Cooldown.String(), MaxRequests: r.planner.MaxRequests, Rounds: []dispatch.Round{}}
	if r.interval <= 0 {
		return func() any { return reply }, nil
	}
	reply.Interval = r.interval.String()
	planner, err := resched.New(r.planner)
	if err != nil {
		return nil, err
	}
	d, err := dispatch.New(dispatch.Config{Conn: svc.nc, Prefix: o.monitor.SubjectPrefix, Interval: r.interval,
		MaxRequests: r.planner.MaxRequests, Timeout: r.effectiveTimeout(), Planner: planner, Source: reschedSource{svc},
		History: reschedulingHistory, Logger: svc.log.With("component", "rescheduler"), Registerer: svc.reg})
	if err != nil {
		return nil, err
	}
	svc.stopResched, svc.reschedDone = goLoop(d.Run, svc.log, "rescheduler")
	return func() any {
		out := reply
		out.Rounds = d.Rounds()
		if out.Rounds == nil {
			out.Rounds = []dispatch.Round{}
		}
		return out
	}, nil
}
