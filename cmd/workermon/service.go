package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/natsconn"
)

// subscriptionPendingLimit is how many messages a subscription may buffer
// while the monitor's queue is full before NATS drops them as a slow
// consumer.
const subscriptionPendingLimit = 1 << 20

// service is a running monitor: NATS (embedded or not), the monitor loop,
// the busy-set writer, the threshold watcher and the HTTP server.
type service struct {
	log      *slog.Logger
	reg      *prometheus.Registry
	natsURL  string
	httpAddr string

	embedded *natsconn.Embedded
	nc       *nats.Conn
	mon      *monitor.Monitor
	writer   *busylist.Writer

	thresholdsSynced <-chan struct{}
	sub              *nats.Subscription
	http             *httpServer

	// Each loop has its own context so that Close can stop them in order.
	stopMonitor, stopWriter, stopWatcher context.CancelFunc
	monitorDone, writerDone, watcherDone chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// startService starts everything; on error what was started is stopped.
func startService(ctx context.Context, o serveOptions, log *slog.Logger, reg *prometheus.Registry) (_ *service, err error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	svc := &service{log: log, reg: reg}
	defer func() {
		if err != nil {
			cctx, cancel := context.WithTimeout(context.Background(), DefaultShutdownTimeout)
			defer cancel()
			_ = svc.Close(cctx)
		}
	}()
	url := o.natsURL
	if url == "" {
		o.embedded.Logger = log
		if svc.embedded, err = natsconn.StartEmbedded(ctx, o.embedded); err != nil {
			return nil, err
		}
		url = svc.embedded.ClientURL()
		log.Info("embedded NATS server started", "url", url, "data_dir", o.embedded.DataDir)
	}
	svc.natsURL = url
	o.nats.URL = url
	if svc.nc, err = natsconn.Connect(ctx, o.nats, log.With("component", "nats")); err != nil {
		return nil, err
	}
	js, err := jetstream.New(svc.nc)
	if err != nil {
		return nil, fmt.Errorf("serve: jetstream: %w", err)
	}

	// The registry bucket is created by its first user; creating it here too
	// gives it this monitor's --replicas rather than an engine's default.
	octx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if _, err := busylist.OpenBucket(octx, js, events.WorkersBucket, o.replicas); err != nil {
		log.Warn("worker registry bucket not opened; engines will create it", "err", err)
	}
	cancel()
	tcfg := busylist.DefaultThresholdWatcherConfig()
	tcfg.JetStream, tcfg.Replicas, tcfg.Registerer = js, o.replicas, reg
	tcfg.Logger = log.With("component", "thresholds")
	tcfg.OnChange = svc.applyOverride
	watcher, err := busylist.NewThresholdWatcher(tcfg)
	if err != nil {
		return nil, err
	}
	svc.thresholdsSynced = watcher.Synced()
	o.writer.JetStream = js
	o.writer.Replicas = o.replicas
	o.writer.Logger = log.With("component", "writer")
	o.writer.Registerer = reg
	o.writer.OrphanAfter = o.monitor.GoneAfter
	// No record before the overrides are loaded: it would use the defaults.
	o.writer.HoldUntil = svc.thresholdsSynced
	// Workers listed by a previous monitor start as stale in this one.
	o.writer.OnExisting = func(records []events.BusySet) {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := svc.mon.Seed(sctx, records); err != nil && !errors.Is(err, monitor.ErrStopped) {
			log.Warn("records of the previous monitor not taken over", "err", err)
		}
	}
	if svc.writer, err = busylist.NewWriter(o.writer); err != nil {
		return nil, err
	}
	o.monitor.Logger = log.With("component", "monitor")
	o.monitor.Registerer = reg
	if svc.mon, err = monitor.New(o.monitor, svc.writer); err != nil {
		return nil, err
	}

	svc.stopWriter, svc.writerDone = goLoop(svc.writer.Run, log, "writer")
	svc.stopMonitor, svc.monitorDone = goLoop(svc.mon.Run, log, "monitor")
	svc.stopWatcher, svc.watcherDone = goLoop(watcher.Run, log, "threshold watcher")

	// One subscription for reports and goodbyes: NATS keeps one publisher's
	// order within a subscription, so a goodbye never overtakes the reports
	// sent before it.
	subject := events.Wildcard(o.monitor.SubjectPrefix)
	if svc.sub, err = svc.nc.Subscribe(subject, func(m *nats.Msg) { svc.mon.Submit(m.Subject, m.Data) }); err != nil {
		return nil, fmt.Errorf("serve: subscribe %s: %w", subject, err)
	}
	if err := svc.sub.SetPendingLimits(subscriptionPendingLimit, 64<<20); err != nil {
		return nil, fmt.Errorf("serve: subscribe %s: %w", subject, err)
	}

	scfg := busylist.DefaultThresholdStoreConfig()
	scfg.JetStream, scfg.Replicas = js, o.replicas
	store, err := busylist.NewThresholdStore(scfg)
	if err != nil {
		return nil, err
	}
	acfg := api.DefaultConfig()
	acfg.Monitor, acfg.Store, acfg.RecordModels = svc.mon, store, svc.writer.Models
	acfg.Defaults, acfg.AdminToken = o.monitor.Defaults, o.adminToken
	acfg.Logger = log.With("component", "api")
	apiHandler, err := api.New(acfg)
	if err != nil {
		return nil, err
	}

	mux := http.NewServeMux()
	for _, path := range api.Paths {
		mux.Handle(path, apiHandler)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", svc.ready)
	if svc.http, err = startHTTP("serve", o.httpAddr, mux, log); err != nil {
		return nil, err
	}
	svc.httpAddr = svc.http.addr
	log.Info("monitor started", "nats", url, "http", svc.httpAddr, "monitor_id", o.writer.MonitorID,
		"warmup", o.writer.Warmup, "heartbeat", o.writer.Heartbeat, "stale_after", o.monitor.StaleAfter,
		"gone_after", o.monitor.GoneAfter, "thresholds", thresholdsAttr(o.monitor.Defaults))
	return svc, nil
}

// applyOverride hands a change of the thresholds bucket to the monitor.
func (svc *service) applyOverride(model string, t events.Thresholds, deleted bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	if deleted {
		err = svc.mon.SetOverride(ctx, model, nil)
	} else {
		err = svc.mon.SetOverride(ctx, model, &t)
	}
	if err != nil && !errors.Is(err, monitor.ErrStopped) {
		svc.log.Warn("threshold override not applied", "model", model, "err", err)
	}
}

// ready answers 200 once NATS is connected and the writer has read the
// bucket, 503 otherwise.
func (svc *service) ready(w http.ResponseWriter, _ *http.Request) {
	var problems []string
	if !svc.nc.IsConnected() {
		problems = append(problems, "NATS not connected: "+svc.nc.Status().String())
	}
	select {
	case <-svc.writer.Ready():
	default:
		problems = append(problems, "busy bucket not open yet")
	}
	select {
	case <-svc.thresholdsSynced:
	default:
		problems = append(problems, "threshold overrides not loaded yet")
	}
	if len(problems) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		for _, p := range problems {
			fmt.Fprintln(w, p)
		}
		return
	}
	_, _ = w.Write([]byte("ready\n"))
}

// goLoop runs loop on a goroutine of its own with a context of its own.
func goLoop(loop func(context.Context) error, log *slog.Logger, name string) (context.CancelFunc, chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := loop(ctx); err != nil && !errors.Is(err, context.Canceled) {
			log.Error("loop stopped", "loop", name, "err", err)
		}
	}()
	return cancel, done
}

// Close stops everything in order: intake and HTTP, monitor loop (its final
// records reach the writer), writer (final flush), watcher, connection,
// embedded server. It is idempotent and bounded by ctx; the requests in
// flight get half of it, the loops keep the rest.
func (svc *service) Close(ctx context.Context) error {
	svc.closeOnce.Do(func() {
		var errs []error
		if svc.sub != nil {
			_ = svc.sub.Unsubscribe()
		}
		if svc.http != nil {
			hctx, cancel := partOf(ctx, 0.5)
			if err := svc.http.shutdown(hctx); err != nil {
				errs = append(errs, fmt.Errorf("serve: %w", err))
			}
			cancel()
		}
		stop := func(cancel context.CancelFunc, done chan struct{}, name string) {
			if cancel == nil {
				return
			}
			cancel()
			select {
			case <-done:
			case <-ctx.Done():
				errs = append(errs, fmt.Errorf("serve: %s did not stop: %w", name, ctx.Err()))
			}
		}
		stop(svc.stopMonitor, svc.monitorDone, "monitor")
		stop(svc.stopWriter, svc.writerDone, "writer")
		stop(svc.stopWatcher, svc.watcherDone, "threshold watcher")
		if svc.nc != nil {
			svc.nc.Close()
		}
		if svc.embedded != nil {
			svc.embedded.Close()
		}
		svc.closeErr = errors.Join(errs...)
	})
	return svc.closeErr
}

// thresholdsAttr renders thresholds for a log line.
func thresholdsAttr(t events.Thresholds) string {
	f := func(name string, set bool, v string) string {
		if !set {
			return name + "=off"
		}
		return name + "=" + v
	}
	s := f("decode", t.ActiveDecodeBlocks != nil, fmtPtr(t.ActiveDecodeBlocks)) + " " +
		f("prefill", t.ActivePrefillTokens != nil, fmtPtr(t.ActivePrefillTokens)) + " " +
		f("prefill_frac", t.ActivePrefillTokensFrac != nil, fmtPtr(t.ActivePrefillTokensFrac))
	return s
}

func fmtPtr[T any](p *T) string {
	if p == nil {
		return ""
	}
	return fmt.Sprint(*p)
}
