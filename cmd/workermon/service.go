package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/board"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/overrides"
)

// service is a running monitor: NATS (embedded or not), the monitor loop,
// the busy-set writer, the threshold watcher and the HTTP server.
type service struct {
	log      *slog.Logger
	reg      *prometheus.Registry
	natsURL  string
	httpAddr string

	embedded *natsconn.Embedded
	nc       *nats.Conn
	// intakeNC carries the reports: nc, or with an embedded server a
	// connection of its own over TCP while nc is in process.
	intakeNC *nats.Conn
	mon      *monitor.Monitor
	writer   *busylist.Writer
	leaser   *busylist.Leaser
	intake   *intake

	parts     int
	monitorID string
	leaseTTL  time.Duration
	// failed receives a loop's error that must end the command (another
	// live monitor with the same id).
	failed chan error

	thresholdsSynced <-chan struct{}
	cordonsSynced    <-chan struct{}
	http             *httpServer
	// board is the web board at /; boardCounts the router counts it shows
	// (set by the demo, which runs a router beside the monitor).
	board       *board.Board
	boardCounts lateCounter

	// Each loop has its own context so that Close can stop them in order.
	stopMonitor, stopWriter, stopWatcher, stopLeaser context.CancelFunc
	monitorDone, writerDone, watcherDone, leaserDone chan struct{}
	stopCordons, stopSync, stopResched               context.CancelFunc
	cordonsDone, syncDone, reschedDone               chan struct{}
	stopSLO                                          context.CancelFunc
	sloDone                                          chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// startService starts everything; on error what was started is stopped.
func startService(ctx context.Context, o serveOptions, log *slog.Logger, reg *prometheus.Registry) (_ *service, err error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	svc := &service{log: log, reg: reg, parts: o.partitions, monitorID: o.writer.MonitorID, leaseTTL: o.leaseTTL,
		failed: make(chan error, 1)}
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
		if err := addPartitionMappings(svc.embedded.Server(), o.monitor.SubjectPrefix, o.partitions); err != nil {
			return nil, err
		}
		log.Info("embedded NATS server started", "url", url, "data_dir", o.embedded.DataDir)
	}
	svc.natsURL = url
	o.nats.URL = url
	o.nats.NoReconnectBuffer = true
	// The reports: over the network, even from the embedded server (see
	// natsconn.Config.InProcess).
	intakeConn := o.nats
	intakeConn.Name += "-intake"
	if svc.embedded != nil {
		// Everything else (records, leases, watches, the API) stays in
		// the process; the server still listens at url for the others.
		o.nats.InProcess = svc.embedded
	}
	if svc.nc, err = natsconn.Connect(ctx, o.nats, log.With("component", "nats")); err != nil {
		return nil, err
	}
	svc.intakeNC = svc.nc
	if svc.embedded != nil {
		if svc.intakeNC, err = natsconn.Connect(ctx, intakeConn, log.With("component", "nats-intake")); err != nil {
			return nil, err
		}
	}
	if err := checkServer(ctx, svc.nc, reg); err != nil {
		return nil, err
	}
	js, err := jetstream.New(svc.nc)
	if err != nil {
		return nil, fmt.Errorf("serve: jetstream: %w", err)
	}

	// The registry bucket is created by its first user; creating it here too
	// gives it this monitor's --replicas rather than an engine's default.
	octx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if _, err := kvbucket.Open(octx, js, events.WorkersBucket, o.replicas); err != nil {
		log.Warn("worker registry bucket not opened; engines will create it", "err", err)
	}
	cancel()
	tcfg := overrides.DefaultThresholdWatcherConfig()
	tcfg.JetStream, tcfg.Replicas, tcfg.Registerer = js, o.replicas, reg
	tcfg.Logger = log.With("component", "thresholds")
	tcfg.OnChange = svc.applyOverride
	watcher, err := overrides.NewThresholdWatcher(tcfg)
	if err != nil {
		return nil, err
	}
	svc.thresholdsSynced = watcher.Synced()
	cordons, cordonWatcher, err := svc.newCordons(js, o.replicas)
	if err != nil {
		return nil, err
	}
	svc.cordonsSynced = cordonWatcher.Synced()
	o.writer.JetStream = js
	o.writer.Replicas = o.replicas
	o.writer.Logger = log.With("component", "writer")
	o.writer.Registerer = reg
	o.writer.OrphanAfter = o.monitor.GoneAfter
	o.writer.Partitions, o.writer.Leased = o.partitions, true
	// No record before the overrides and cordons are loaded: it would use
	// the defaults and list cordoned workers free.
	o.writer.HoldUntil = svc.bothClosed(svc.thresholdsSynced, svc.cordonsSynced)
	// Workers listed by a previous monitor start as stale in this one.
	o.writer.OnExisting = func(records []events.BusySet) {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := svc.mon.Seed(sctx, records); err != nil && !errors.Is(err, monitor.ErrStopped) {
			log.Warn("records of the previous monitor not taken over", "err", err)
		}
	}
	lcfg := busylist.DefaultLeaserConfig()
	lcfg.JetStream, lcfg.Replicas, lcfg.Registerer = js, o.replicas, reg
	lcfg.MonitorID, lcfg.Partitions, lcfg.TTL = o.writer.MonitorID, o.partitions, o.leaseTTL
	lcfg.Logger = log.With("component", "leases")
	// Nor any lease while the writer is held back: a monitor that cannot
	// write leaves its partitions to the others.
	lcfg.HoldUntil = o.writer.HoldUntil
	svc.leaseCallbacks(&lcfg, o.hooks)
	if svc.leaser, err = busylist.NewLeaser(lcfg); err != nil {
		return nil, err
	}
	o.writer.Fence = svc.leaser.Valid
	// The leaser calls OnLose, which stops the intake, on the partition's
	// goroutine: after its OnAcquire, never racing it.
	o.writer.OnLost = svc.leaser.Abandon
	// The warm-up counts from when the partition is subscribed (OnAcquire).
	o.writer.WarmOnListen = true
	// The monitor builds a model's next record once the writer has taken the
	// previous one (monitor.PendingSink); svc.mon is set before Run starts.
	o.writer.OnTaken = func() { svc.mon.Kick() }
	if svc.writer, err = busylist.NewWriter(o.writer); err != nil {
		return nil, err
	}
	o.monitor.Logger = log.With("component", "monitor")
	o.monitor.Registerer = reg
	o.monitor.Partitions = o.partitions // mapped subjects are checked against it
	if svc.mon, err = monitor.New(o.monitor, svc.writer); err != nil {
		return nil, err
	}

	// Reports and goodbyes of a partition arrive on one subscription, taken
	// when its lease is: NATS keeps one publisher's order within a
	// subscription, so a goodbye never overtakes the reports sent before it.
	svc.intake = newIntake(svc.intakeNC, svc.mon, o.monitor.SubjectPrefix, o.partitions, log.With("component", "intake"))
	if err := svc.intake.watchPlain(); err != nil {
		return nil, err
	}

	svc.stopWriter, svc.writerDone = goLoop(svc.writer.Run, log, "writer")
	svc.stopMonitor, svc.monitorDone = goLoop(func(ctx context.Context) error {
		return monitor.RunFrom(ctx, svc.mon, svc.intake.source())
	}, log, "monitor")
	svc.stopWatcher, svc.watcherDone = goLoop(watcher.Run, log, "threshold watcher")
	// After the monitor: every cordon goes to it.
	svc.stopCordons, svc.cordonsDone = goLoop(cordonWatcher.Run, log, "cordon watcher")
	svc.stopLeaser, svc.leaserDone = goLoop(func(ctx context.Context) error {
		err := svc.leaser.Run(ctx)
		if err != nil {
			svc.failed <- err
		}
		return err
	}, log, "leases")

	scfg := overrides.DefaultThresholdStoreConfig()
	scfg.JetStream, scfg.Replicas = js, o.replicas
	store, err := overrides.NewThresholdStore(scfg)
	if err != nil {
		return nil, err
	}
	rescheduler, err := svc.startRescheduler(o)
	if err != nil {
		return nil, err
	}
	acfg := api.DefaultConfig()
	acfg.Monitor, acfg.Store = svc.mon, store
	acfg.Cordons, acfg.CordonMonitor, acfg.Rescheduler = cordons, svc.mon, rescheduler
	acfg.RecordModels = func() []string { return recordModels(js, svc.writer) }
	acfg.Defaults, acfg.AdminToken = o.monitor.Defaults, o.adminToken
	slos, err := startSLO(o.slo, js, o.replicas, o.partitions, o.writer.MonitorID, svc.mon, svc.leaser.Epoch,
		log.With("component", "slo"), reg)
	if err != nil {
		return nil, err
	}
	slos.apiConfig(&acfg)
	svc.stopSLO, svc.sloDone = goLoop(slos.run, log, "slo controller")
	acfg.Logger = log.With("component", "api")
	apiHandler, err := api.New(acfg)
	if err != nil {
		return nil, err
	}

	if svc.board, err = startBoard(&board.MonitorSource{Monitor: svc.mon, ID: o.writer.MonitorID,
		Counts: svc.boardCounts.count, Queues: svc.boardCounts.queues, SLOs: slos.boardLines}, log, reg); err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	for _, path := range api.Paths {
		mux.Handle(path, apiHandler)
	}
	// The web board at /; every path nobody serves gets the API's JSON 404.
	mountBoard(mux, svc.board)
	mux.Handle("/", apiHandler)
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", healthz(svc.nc, svc.intake.healthLines))
	mux.HandleFunc("GET /readyz", svc.ready)
	mux.HandleFunc("GET /partitions", svc.servePartitions)
	// A wrong method on these is 405 with Allow, not the catch-all's 404.
	for _, p := range []string{"/metrics", "/healthz", "/readyz", "/partitions"} {
		mux.HandleFunc(p, api.MethodNotAllowed("GET, HEAD"))
	}
	if svc.http, err = startHTTPLimits("serve", o.httpAddr, mux, log, o.httpLimits); err != nil {
		return nil, err
	}
	svc.httpAddr = svc.http.addr
	log.Info("monitor started", "nats", redact.URLs(url), "http", svc.httpAddr, "monitor_id", o.writer.MonitorID,
		"warmup", o.writer.Warmup, "heartbeat", o.writer.Heartbeat, "stale_after", o.monitor.StaleAfter,
		"gone_after", o.monitor.GoneAfter, "thresholds", thresholdsAttr(o.monitor.Defaults),
		"partitions", o.partitions, "lease_ttl", o.leaseTTL, "release_margin", o.monitor.ReleaseMargin,
		"rescheduling_interval", o.resched.interval)
	warnReplicas(ctx, js, svc.nc, o.replicas, log)
	if budget := o.writer.Heartbeat + o.leaseTTL + o.writer.Warmup; budget > o.staleListAfter*8/10 {
		log.Warn("a takeover may let routers see a stale list: heartbeat + lease-ttl + warmup exceeds 80% of the routers' stale-list-after",
			"heartbeat", o.writer.Heartbeat, "lease_ttl", o.leaseTTL, "warmup", o.writer.Warmup, "stale_list_after", o.staleListAfter)
	}
	return svc, nil
}

// recordModels lists the models with a record in the busy bucket, as the
// bucket holds them now (a standby writes none of them), and those the
// writer will write.
func recordModels(js jetstream.JetStream, w *busylist.Writer) []string {
	models := w.Models()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, events.BusyBucket)
	if err != nil {
		return models
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		return models
	}
	for key := range keys.Keys() {
		if m, err := events.ParseModelKey(key); err == nil {
			models = append(models, m)
		}
	}
	slices.Sort(models)
	return slices.Compact(models)
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

// ready answers 200 once NATS is connected, the writer has opened the
// bucket, the overrides are loaded and the leases have settled (a standby is
// ready too), 503 otherwise.
func (svc *service) ready(w http.ResponseWriter, _ *http.Request) {
	var problems []string
	if !svc.nc.IsConnected() {
		problems = append(problems, "NATS not connected: "+svc.nc.Status().String())
	}
	if svc.intakeNC != svc.nc && !svc.intakeNC.IsConnected() {
		problems = append(problems, "NATS connection of the reports not connected: "+svc.intakeNC.Status().String())
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
	select {
	case <-svc.cordonsSynced:
	default:
		problems = append(problems, "cordons not loaded yet")
	}
	if key := svc.leaser.Foreign(); key != "" {
		problems = append(problems, "the leases bucket holds a lease of another --partitions ("+key+"): holding and taking no partition until it is gone")
	} else {
		select {
		case <-svc.leaser.Settled():
		default:
			problems = append(problems, "partition leases not settled yet (the first --lease-ttl)")
		}
	}
	problems = append(problems, svc.unheard()...)
	if len(problems) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		for _, p := range problems {
			fmt.Fprintln(w, p)
		}
		return
	}
	_, _ = w.Write([]byte("ready\n"))
}

// unheard lists the partitions this monitor took but could not subscribe
// to, and that no other monitor holds now: nobody hears them.
func (svc *service) unheard() []string {
	failed := svc.intake.unheard()
	if len(failed) == 0 {
		return nil
	}
	var out []string
	for _, info := range svc.leaser.Partitions() {
		err, ok := failed[info.Partition]
		if !ok || info.Instance != "" && info.Instance != svc.leaser.Instance() && !info.Expired {
			continue
		}
		out = append(out, fmt.Sprintf("partition %d taken but not subscribed to (given back, retried): %v", info.Partition, err))
	}
	return out
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
// records reach the writer), leases (each partition's final write, then its
// lease handed back), writer, watcher, connection, embedded server. It is idempotent and bounded by ctx; the requests in
// flight get half of it, the loops keep the rest.
func (svc *service) Close(ctx context.Context) error {
	svc.closeOnce.Do(func() {
		var errs []error
		if svc.intake != nil {
			svc.intake.close()
		}
		// Before the HTTP server: its shutdown waits for the board's
		// streams, which end only when the board closes.
		if svc.board != nil {
			_ = svc.board.Close()
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
		stop(svc.stopResched, svc.reschedDone, "rescheduler")
		stop(svc.stopSLO, svc.sloDone, "slo controller")
		stop(svc.stopMonitor, svc.monitorDone, "monitor")
		stop(svc.stopLeaser, svc.leaserDone, "leases")
		stop(svc.stopWriter, svc.writerDone, "writer")
		stop(svc.stopWatcher, svc.watcherDone, "threshold watcher")
		stop(svc.stopCordons, svc.cordonsDone, "cordon watcher")
		stop(svc.stopSync, svc.syncDone, "sync")
		if svc.nc != nil {
			svc.nc.Close()
		}
		if svc.intakeNC != nil {
			svc.intakeNC.Close()
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
		f("prefill_frac", t.ActivePrefillTokensFrac != nil, fmtPtr(t.ActivePrefillTokensFrac)) + " " +
		f("kv_committed", t.KVCommitted != nil, fmtPtr(t.KVCommitted)) + " " +
		f("queue_delay_ms", t.QueueDelayMs != nil, fmtPtr(t.QueueDelayMs))
	return s
}

func fmtPtr[T any](p *T) string {
	if p == nil {
		return ""
	}
	return fmt.Sprint(*p)
}
