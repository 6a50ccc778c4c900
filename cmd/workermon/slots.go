package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/watchmetrics"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/registry"
	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsapi"
	"github.com/workermon/workermon/slots/slotsnats"
)

// DefaultSlotsHTTPAddr is where `workermon slots` listens (Dynamo's port).
const DefaultSlotsHTTPAddr = "127.0.0.1:8091"

// slotsOptions is everything `workermon slots` can be told.
type slotsOptions struct {
	httpAddr     string
	tracker      slots.Config
	fromRegistry bool
	estimates    estimateOptions
	trackerID    string
	natsURL      string
	nats         natsconn.Config
	log          logOptions
}

func defaultSlotsOptions() slotsOptions {
	return slotsOptions{httpAddr: DefaultSlotsHTTPAddr, tracker: slots.DefaultConfig(), estimates: defaultEstimateOptions(false),
		trackerID: instanceID(), natsURL: natsconn.DefaultURL, nats: natsconn.DefaultConfig(), log: defaultLogOptions()}
}

func (o *slotsOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.httpAddr, "http-addr", o.httpAddr, "listen address of the slot tracker API and /metrics")
	fs.BoolVar(&o.fromRegistry, "from-registry", o.fromRegistry,
		"register and unregister workers (tenant default) from the "+events.WorkersBucket+" bucket")
	o.estimates.flags(fs, "publish", "publish each rank's load, summed over tenants, as source router/<tracker-id> for the monitors")
	fs.StringVar(&o.trackerID, "tracker-id", o.trackerID, "this tracker's name: its estimates' source is router/<tracker-id>")
	natsFlags(fs, &o.natsURL, &o.nats)
	trackerFlags(fs, &o.tracker)
	o.log.flags(fs)
}

// validate checks what can be checked before anything starts.
func (o slotsOptions) validate() error {
	errs := []error{o.tracker.Validate(), o.estimates.validate(), validListenAddr("http-addr", o.httpAddr)}
	if o.fromRegistry || o.estimates.publish {
		c := o.nats
		c.URL = o.natsURL
		errs = append(errs, c.Validate())
	}
	if o.estimates.publish {
		if err := validTrackerID(o.trackerID); err != nil {
			errs = append(errs, fmt.Errorf("--tracker-id: %w", err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// runSlots is `workermon slots`: Dynamo's standalone slot tracker API.
func runSlots(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := defaultSlotsOptions()
	log, check, err := parseCommand("slots", args, stderr, natsURLEnv, o.flags, &o.log)
	if err != nil {
		return err
	}
	if check.on {
		return check.report(stdout, o.validate(), map[string]any{"uses_nats": o.fromRegistry || o.estimates.publish})
	}
	svc, err := startSlots(ctx, o, log, newRegistry())
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "workermon slots: http://%s\n", svc.http.addr)
	return closeWhenDone(ctx, log, "shutting down", svc.close)
}

// slotsService is a running slot tracker: its HTTP server and, with
// --from-registry or --publish, its NATS side.
type slotsService struct {
	http     *httpServer
	nc       *nats.Conn
	registry *registry.Watcher
	link     *slotsLink
}

// close stops the HTTP server, then the NATS side (the estimates' goodbyes
// first), then the connection.
func (svc *slotsService) close(ctx context.Context) error {
	var err error
	if svc.http != nil {
		err = svc.http.shutdown(ctx)
	}
	svc.link.stop()
	if svc.registry != nil {
		_ = svc.registry.Close()
	}
	if svc.nc != nil {
		svc.nc.Close()
	}
	return err
}

// startSlots starts the slot tracker; ctx bounds the wait for NATS.
func startSlots(ctx context.Context, o slotsOptions, log *slog.Logger, reg *prometheus.Registry) (_ *slotsService, err error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	tr, err := slots.New(o.tracker)
	if err != nil {
		return nil, err
	}
	svc := &slotsService{}
	defer func() {
		if err != nil {
			_ = svc.close(context.Background())
		}
	}()
	if o.fromRegistry || o.estimates.publish {
		if err := svc.startNATS(ctx, o, tr, log, reg); err != nil {
			return nil, err
		}
	}
	if err := registerSlotsMetrics(reg, tr); err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.Handle("/metrics", slotsapi.NotAllowed("GET, HEAD"))
	// Dynamo's /health stays as its page says: 200 with an empty body
	// (slotsapi). workermon's /healthz carries the NATS server's version
	// ("none" without --from-registry and --publish), as on every command.
	mux.HandleFunc("GET /healthz", healthz(svc.nc))
	mux.Handle("/healthz", slotsapi.NotAllowed("GET, HEAD"))
	mux.Handle("/", slotsapi.Handler(tr))
	if svc.http, err = startHTTP("slots", o.httpAddr, mux, log); err != nil {
		return nil, err
	}
	log.Info("slot tracker started", "http", svc.http.addr, "request_ttl", o.tracker.RequestTTL,
		"from_registry", o.fromRegistry, "publish", o.estimates.publish, "tracker_id", o.trackerID)
	return svc, nil
}

// startNATS connects to NATS and starts the registry watcher (with
// --from-registry) and the link.
func (svc *slotsService) startNATS(ctx context.Context, o slotsOptions, tr *slots.Tracker, log *slog.Logger, reg *prometheus.Registry) error {
	c := o.nats
	c.URL = o.natsURL
	if c.Name == natsconn.DefaultName {
		c.Name = "workermon-slots/" + o.trackerID
	}
	var err error
	if svc.nc, err = natsconn.Connect(ctx, c, log.With("component", "nats")); err != nil {
		return err
	}
	if err := checkServer(ctx, svc.nc, reg); err != nil {
		return err
	}
	var source slotsnats.Registry = noRegistry{}
	if o.fromRegistry {
		js, err := jetstream.New(svc.nc)
		if err != nil {
			return fmt.Errorf("slots: jetstream: %w", err)
		}
		// The registry watch is counted as the router's is
		// (workermon_router_watch_*): an entry dropped as bad included.
		watchStats, err := watchmetrics.New(reg)
		if err != nil {
			return fmt.Errorf("slots: %w", err)
		}
		if svc.registry, err = registry.NewWatcher(js, registry.WithStats(watchStats.Bucket(events.WorkersBucket)),
			registry.WithLogger(log.With("component", "registry"))); err != nil {
			return err
		}
		source = svc.registry
	}
	svc.link = startSlotsLink(o.estimates, tr, source, svc.nc, o.trackerID, log)
	return nil
}

// slotsCollector exports what a tracker holds and what its caps refused.
// workermon slots and workermon router (for its embedded tracker) both
// register it, through registerSlotsMetrics.
type slotsCollector struct {
	tr                                         *slots.Tracker
	trackers, workers, ranks, requests, blocks *prometheus.Desc
	rejected, expired                          *prometheus.Desc
}

// registerSlotsMetrics registers the workermon_slots_* metrics of tr on reg.
func registerSlotsMetrics(reg prometheus.Registerer, tr *slots.Tracker) error {
	c := &slotsCollector{
		tr:       tr,
		trackers: prometheus.NewDesc("workermon_slots_trackers", "(model, tenant) trackers held.", nil, nil),
		workers:  prometheus.NewDesc("workermon_slots_workers", "Workers registered, over all trackers.", nil, nil),
		ranks:    prometheus.NewDesc("workermon_slots_ranks", "Data-parallel ranks of the registered workers, over all trackers.", nil, nil),
		requests: prometheus.NewDesc("workermon_slots_requests", "Active requests, over all trackers.", nil, nil),
		blocks: prometheus.NewDesc("workermon_slots_blocks",
			"Block hashes held by the active requests, over all trackers (what --max-blocks caps).", nil, nil),
		rejected: prometheus.NewDesc("workermon_slots_rejected_total",
			"Writes a cap refused, by cap: trackers, workers, ranks, requests, hashes (of one request), blocks.", []string{"reason"}, nil),
		expired: prometheus.NewDesc("workermon_slots_expired_total",
			"Requests dropped because they were older than --request-ttl.", nil, nil),
	}
	if err := reg.Register(c); err != nil {
		return fmt.Errorf("slots: register metrics: %w", err)
	}
	return nil
}

func (c *slotsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.trackers, c.workers, c.ranks, c.requests, c.blocks, c.rejected, c.expired} {
		ch <- d
	}
}

// Collect reads the tracker once per scrape; the read drops the expired
// requests first.
func (c *slotsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.tr.Stats()
	ch <- prometheus.MustNewConstMetric(c.trackers, prometheus.GaugeValue, float64(s.Trackers))
	ch <- prometheus.MustNewConstMetric(c.workers, prometheus.GaugeValue, float64(s.Workers))
	ch <- prometheus.MustNewConstMetric(c.ranks, prometheus.GaugeValue, float64(s.Ranks))
	ch <- prometheus.MustNewConstMetric(c.requests, prometheus.GaugeValue, float64(s.Requests))
	ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.GaugeValue, float64(s.Blocks))
	for r := range slots.NumReasons {
		ch <- prometheus.MustNewConstMetric(c.rejected, prometheus.CounterValue, float64(s.Rejected[r]), r.String())
	}
	ch <- prometheus.MustNewConstMetric(c.expired, prometheus.CounterValue, float64(s.Expired))
}

// noRegistry is the registry of a tracker whose workers register over HTTP.
type noRegistry struct{}

func (noRegistry) Models() []string                      { return nil }
func (noRegistry) Endpoints(string) []events.WorkerEntry { return nil }
