package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/board"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/httplimit"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/internal/watchmetrics"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/registry"
	"github.com/workermon/workermon/router"
	"github.com/workermon/workermon/slots"
)

// Worker choices of --pick.
const (
	pickInFlight       = "in-flight"
	pickLeastPotential = "least-potential"
)

// DefaultRouterHTTPAddr is where `workermon router` listens (contract §9).
const DefaultRouterHTTPAddr = "127.0.0.1:8080"

// routerOptions is everything `workermon router` can be told.
type routerOptions struct {
	natsURL        string
	nats           natsconn.Config
	httpAddr       string
	httpLimits     httplimit.Limits
	router         router.Config
	staleListAfter time.Duration
	failOpen       bool
	replicas       int
	slots          slots.Config
	estimates      estimateOptions
	pick           string
	log            logOptions
}

func defaultRouterOptions() routerOptions {
	o := routerOptions{
		natsURL:        natsconn.DefaultURL,
		nats:           natsconn.DefaultConfig(),
		httpAddr:       DefaultRouterHTTPAddr,
		httpLimits:     httplimit.DefaultLimits(),
		router:         router.DefaultConfig(),
		staleListAfter: busylist.DefaultStaleListAfter,
		failOpen:       busylist.DefaultFailOpen,
		replicas:       1,
		slots:          slots.DefaultConfig(),
		estimates:      defaultEstimateOptions(true),
		pick:           pickInFlight,
		log:            defaultLogOptions(),
	}
	o.router.RouterID = instanceID()
	return o
}

func (o *routerOptions) flags(fs *flag.FlagSet) {
	natsFlags(fs, &o.natsURL, &o.nats)
	fs.StringVar(&o.httpAddr, "http-addr", o.httpAddr, "listen address of the proxy, the web board (/), /v1/models, /metrics, /healthz and /readyz")
	fs.IntVar(&o.router.RejectStatus, "reject-status", o.router.RejectStatus, "status of a rejection when every worker is busy: 503, 429 or 529")
	fs.IntVar(&o.router.ShedStatus, "shed-status", o.router.ShedStatus,
		"status of the rejection of a sheddable request (X-Workermon-Priority below 0) when every free worker is amber: 429, 503 or 529")
	fs.DurationVar(&o.router.RetryAfter, "retry-after", o.router.RetryAfter, "floor of the wait a rejection asks for (retry-after-ms, and Retry-After in whole seconds), estimated from when the model frees a slot")
	fs.DurationVar(&o.staleListAfter, "stale-list-after", o.staleListAfter, "a busy-list record not refreshed for this long is stale")
	fs.BoolVar(&o.failOpen, "fail-open", o.failOpen, "admit requests when the busy list is stale or not loaded yet")
	fs.IntVar(&o.router.MigrationLimit, "migration-limit", o.router.MigrationLimit,
		"how many times a cut streamed completion continues on another worker (0: off)")
	fs.DurationVar(&o.router.QueueMaxWait, "queue-max-wait", o.router.QueueMaxWait,
		"how long a request whose priority class has no free worker waits in its model's queue (0: off, rejected at once; header "+
			router.MaxWaitHeader+" shortens it per request)")
	fs.IntVar(&o.router.QueueMaxRequests, "queue-max-requests", o.router.QueueMaxRequests, "how many requests each model's queue holds")
	fs.Int64Var(&o.router.QueueMaxBytes, "queue-max-bytes", o.router.QueueMaxBytes,
		"how many bytes of request bodies the queues of all models hold together (at least --max-body-bytes)")
	fs.DurationVar(&o.router.QueuePace, "queue-pace", o.router.QueuePace,
		"this router hands a freed worker at most one queued request per pace × the routers sharing the model")
	fs.Int64Var(&o.router.MaxBodyBytes, "max-body-bytes", o.router.MaxBodyBytes, "largest request body accepted (413 beyond)")
	fs.DurationVar(&o.router.UpstreamTimeout, "upstream-timeout", o.router.UpstreamTimeout,
		"how long to wait for a worker's response headers (a non-streamed completion sends them at its end)")
	fs.DurationVar(&o.router.ConnectTimeout, "upstream-connect-timeout", o.router.ConnectTimeout,
		"how long to wait for a connection to a worker before trying another")
	fs.IntVar(&o.router.MaxRetries, "max-retries", o.router.MaxRetries, "how many other workers to try after one cannot be reached")
	fs.StringVar(&o.router.RouterID, "router-id", o.router.RouterID, "this router's name in logs and in its NATS client name")
	fs.IntVar(&o.replicas, "replicas", o.replicas, "replicas of the buckets this router creates when they are missing")
	o.estimates.flags(fs, "publish",
		"publish the slot tracker's loads as source router/<router-id> for the monitors to add to the engines' reports")
	// The flag's name before contract §9's: an error that names the new
	// one, rather than an alias whose environment variable could override
	// a --publish on the command line.
	fs.BoolFunc("publish-estimates", "renamed --publish", func(string) error {
		return errors.New("--publish-estimates is now --publish")
	})
	fs.StringVar(&o.pick, "pick", o.pick, "worker choice among the free workers: "+pickInFlight+
		" (power of two choices on this router's requests in flight) or "+pickLeastPotential+" (the slot tracker's projection)")
	trackerFlags(fs, &o.slots)
	o.log.flags(fs)
}

// resolvedNATS returns the NATS client configuration: the URL defaults to
// nats://127.0.0.1:4222 when empty (contract §7c).
func (o routerOptions) resolvedNATS() natsconn.Config {
	c := o.nats
	c.URL = o.natsURL
	if c.URL == "" {
		c.URL = natsconn.DefaultURL
	}
	if c.Name == natsconn.DefaultName {
		c.Name = "workermon-router"
		if o.router.RouterID != "" {
			c.Name += "/" + o.router.RouterID
		}
	}
	return c
}

// validate checks what can be checked before anything starts.
func (o routerOptions) validate() error {
	var errs []error
	if err := o.resolvedNATS().Validate(); err != nil {
		errs = append(errs, err)
	}
	// The collaborators are wired later; stand-ins let Validate check the
	// rest.
	c := o.router
	c.BusyList, c.Registry = validateStandIn{}, validateStandIn{}
	if err := c.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := validListenAddr("http-addr", o.httpAddr); err != nil {
		errs = append(errs, fmt.Errorf("router: %w", err))
	}
	if o.staleListAfter <= 0 {
		errs = append(errs, fmt.Errorf("router: --stale-list-after %v must be positive", o.staleListAfter))
	}
	if o.replicas < 1 || o.replicas > 5 {
		errs = append(errs, fmt.Errorf("router: --replicas %d must be 1 to 5", o.replicas))
	}
	if err := o.slots.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := o.estimates.validate(); err != nil {
		errs = append(errs, fmt.Errorf("router: %w", err))
	}
	if o.pick != pickInFlight && o.pick != pickLeastPotential {
		errs = append(errs, fmt.Errorf("router: --pick %q must be %s or %s", o.pick, pickInFlight, pickLeastPotential))
	}
	// The estimates (--publish) and the queue reports (--queue-max-wait,
	// contract §22) go out under the source router/<router-id>.
	if o.estimates.publish || o.router.QueueMaxWait > 0 {
		if err := validTrackerID(o.router.RouterID); err != nil {
			errs = append(errs, fmt.Errorf("router: --router-id: %w", err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// validateStandIn stands in for the busy list and the registry in validate.
type validateStandIn struct{}

func (validateStandIn) Decide(string) admission.Decision { return admission.Decision{} }
func (validateStandIn) DecideClass(string, admission.Class) admission.Decision {
	return admission.Decision{}
}
func (validateStandIn) Models() []string                      { return nil }
func (validateStandIn) Ready() bool                           { return false }
func (validateStandIn) Endpoints(string) []events.WorkerEntry { return nil }
func (validateStandIn) Live() bool                            { return false }

func runRouter(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := defaultRouterOptions()
	log, check, err := parseCommand("router", args, stderr, natsURLEnv, o.flags, &o.log)
	if err != nil {
		return err
	}
	if check.on {
		return check.report(stdout, o.validate(), map[string]any{"nats": redact.URLs(o.resolvedNATS().URL)})
	}
	svc, err := startRouter(o, log, newRegistry())
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "workermon router: NATS %s, proxy http://%s, board http://%s/\n", redact.URLs(svc.natsURL), svc.httpAddr, svc.httpAddr)
	return serveUntil(ctx, log, svc.failed, svc.Close)
}

// routerService is a running router: the NATS connection, the busy-list and
// registry watchers, the proxy and its HTTP server.
type routerService struct {
	natsURL  string
	httpAddr string

	nc       *nats.Conn
	watcher  *busylist.Watcher
	registry *registry.Watcher
	router   *router.Router
	http     *httpServer
	slots    *slotsLink
	board    *board.Board
	// stopLatency stops the latency windows (contract §18).
	stopLatency func()
	// stopQueueReports stops the queue reports (contract §22), once the
	// last of them went out.
	stopQueueReports func()
	// failed receives the server check's refusal (contract §14) of a
	// server first reached after the start: it ends the command. It is
	// nil when the server was checked at start.
	failed chan error
	// stopCheck stops that late check; checkDone is closed when it has
	// returned.
	stopCheck context.CancelFunc
	checkDone chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// startRouter starts the router. It does not wait for NATS: the watchers
// load their buckets when the server is there, and /readyz says when.
func startRouter(o routerOptions, log *slog.Logger, reg *prometheus.Registry) (_ *routerService, err error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	svc := &routerService{}
	defer func() {
		if err != nil {
			cctx, cancel := context.WithTimeout(context.Background(), DefaultShutdownTimeout)
			defer cancel()
			_ = svc.Close(cctx)
		}
	}()
	ncfg := o.resolvedNATS()
	svc.natsURL = ncfg.URL
	if svc.nc, err = natsconn.Dial(ncfg, log.With("component", "nats")); err != nil {
		return nil, err
	}
	// The router comes up before NATS does (it fails open); a server it
	// finds at start is checked now, one it reaches later on the first
	// connection.
	if svc.nc.IsConnected() {
		if err := checkServer(context.Background(), svc.nc, reg); err != nil {
			return nil, err
		}
	} else {
		reg.MustRegister(natsconn.ServerInfo(svc.nc))
		ctx, cancel := context.WithCancel(context.Background())
		svc.failed, svc.stopCheck, svc.checkDone = make(chan error, 1), cancel, make(chan struct{})
		go svc.checkLateServer(ctx)
	}
	js, err := jetstream.New(svc.nc)
	if err != nil {
		return nil, fmt.Errorf("router: jetstream: %w", err)
	}
	if svc.watcher, err = busylist.NewWatcher(js, busylist.WithRegisterer(reg),
		busylist.WithBucketReplicas(o.replicas),
		busylist.WithLogger(log.With("component", "busylist")),
		busylist.WithStaleListAfter(o.staleListAfter),
		busylist.WithFailOpen(o.failOpen)); err != nil {
		return nil, err
	}
	watchStats, err := watchmetrics.New(reg)
	if err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	if svc.registry, err = registry.NewWatcher(js, registry.WithStats(watchStats.Bucket(events.WorkersBucket)),
		registry.WithBucketReplicas(o.replicas),
		registry.WithLogger(log.With("component", "registry"))); err != nil {
		return nil, err
	}
	tracker, err := slots.New(o.slots)
	if err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	if err := registerSlotsMetrics(reg, tracker); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	svc.slots = startSlotsLink(o.estimates, tracker, svc.registry, svc.nc, o.router.RouterID, log)
	cfg := o.router
	cfg.BusyList, cfg.Registry, cfg.Slots = svc.watcher, svc.registry, tracker
	cfg.PickLeastPotential = o.pick == pickLeastPotential
	cfg.ReadyCheck = func() error {
		if st := svc.nc.Status(); st != nats.CONNECTED {
			return fmt.Errorf("NATS not connected: %s", st)
		}
		return nil
	}
	cfg.Logger = log.With("component", "router")
	cfg.Registerer = reg
	if svc.router, err = router.New(cfg); err != nil {
		return nil, err
	}
	svc.stopLatency = startRouterLatency(svc.router, svc.nc, o.estimates.subjectPrefix, log)
	svc.stopQueueReports = startQueueReports(svc.router, svc.nc, o.estimates.subjectPrefix, log)
	if svc.board, err = startBoard(&board.RouterSource{BusyList: svc.watcher, Registry: svc.registry, Tracker: tracker,
		Counts: board.GatheredCounts(reg), Queues: board.GatheredQueues(reg), ID: cfg.RouterID}, log, reg); err != nil {
		return nil, err
	}

	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", healthz(svc.nc))
	mountBoard(mux, svc.board)
	mux.Handle("/", svc.router)
	if svc.http, err = startHTTPLimits("router", o.httpAddr, mux, log, o.httpLimits); err != nil {
		return nil, err
	}
	svc.httpAddr = svc.http.addr
	log.Info("router started", "nats", redact.URLs(svc.natsURL), "http", svc.httpAddr, "router_id", cfg.RouterID,
		"reject_status", cfg.RejectStatus, "shed_status", cfg.ShedStatus, "stale_list_after", o.staleListAfter, "fail_open", o.failOpen,
		"migration_limit", cfg.MigrationLimit, "queue_max_wait", cfg.QueueMaxWait, "queue_max_requests", cfg.QueueMaxRequests,
		"queue_max_bytes", cfg.QueueMaxBytes, "queue_pace", cfg.QueuePace, "publish", o.estimates.publish, "pick", o.pick)
	return svc, nil
}

// startQueueReports publishes the router's queues (contract §22) on a
// loop of its own, with flow control on; the function it returns stops the
// loop once its last reports went out.
func startQueueReports(rt *router.Router, nc *nats.Conn, prefix string, log *slog.Logger) func() {
	stop, done := goLoop(func(ctx context.Context) error {
		return rt.RunQueueReports(ctx, prefix, nc.Publish)
	}, log, "queue reports")
	return func() {
		stop()
		<-done
	}
}

// checkLateServer waits for the first connection and checks its server
// (contract §14); a refusal goes to svc.failed. It returns when ctx ends or
// the connection closes first.
func (svc *routerService) checkLateServer(ctx context.Context) {
	defer close(svc.checkDone)
	if err := natsconn.WaitConnected(ctx, svc.nc); err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, serverCheckTimeout)
	defer cancel()
	if err := natsconn.CheckServer(ctx, svc.nc); err != nil {
		svc.failed <- err
	}
}

// Close stops in order: the late server check, the HTTP server (requests in flight may finish until
// ctx ends, then their connections are closed), the proxy's idle
// connections, the watchers, the NATS connection. It is idempotent and
// bounded by ctx.
func (svc *routerService) Close(ctx context.Context) error {
	svc.closeOnce.Do(func() {
		var errs []error
		if svc.stopCheck != nil {
			svc.stopCheck()
			<-svc.checkDone
		}
		// Before the HTTP server: its shutdown waits for the board's
		// streams, which end only when the board closes.
		if svc.board != nil {
			_ = svc.board.Close()
		}
		if svc.http != nil {
			if err := svc.http.shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("router: %w", err))
			}
		}
		if svc.router != nil {
			_ = svc.router.Close()
		}
		// After the router's close has emptied the queues: the last
		// reports say so.
		if svc.stopQueueReports != nil {
			svc.stopQueueReports()
		}
		// The estimates' goodbyes go out before the connection closes.
		svc.slots.stop()
		if svc.stopLatency != nil {
			svc.stopLatency()
		}
		if svc.watcher != nil {
			_ = svc.watcher.Close()
		}
		if svc.registry != nil {
			_ = svc.registry.Close()
		}
		if svc.nc != nil {
			svc.nc.Close()
		}
		svc.closeErr = errors.Join(errs...)
	})
	return svc.closeErr
}
