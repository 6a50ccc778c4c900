package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/scrape"
	"github.com/workermon/workermon/scrape/adapter"
)

// DefaultScrapeHTTPAddr is where `workermon scrape` serves /metrics and
// /healthz.
const DefaultScrapeHTTPAddr = "127.0.0.1:8093"

// scrapeOptions is everything `workermon scrape` can be told.
type scrapeOptions struct {
	engine     string
	metricsURL string
	model      string
	workerID   *uint64 // nil: not given
	endpoint   string
	interval   time.Duration
	timeout    time.Duration
	maxBody    int64
	prefix     string
	httpAddr   string
	natsURL    string
	nats       natsconn.Config
	log        logOptions
}

func defaultScrapeOptions() scrapeOptions {
	d := adapter.DefaultConfig()
	return scrapeOptions{interval: d.Interval, timeout: d.Timeout, maxBody: d.MaxBodyBytes, prefix: d.SubjectPrefix,
		httpAddr: DefaultScrapeHTTPAddr, natsURL: natsconn.DefaultURL, nats: natsconn.DefaultConfig(), log: defaultLogOptions()}
}

func (o *scrapeOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.engine, "engine", o.engine, "the engine behind --metrics-url: "+strings.Join(scrape.Engines(), " or "))
	fs.StringVar(&o.metricsURL, "metrics-url", o.metricsURL, "the engine's Prometheus page, e.g. http://127.0.0.1:8000/metrics")
	fs.StringVar(&o.model, "model", o.model, "the model the engine serves, as clients name it")
	fs.Var(optUint{&o.workerID}, "worker-id", "the engine's worker id (required)")
	fs.StringVar(&o.endpoint, "endpoint", o.endpoint,
		"the engine's base URL (without /v1) to register for routers, e.g. http://10.0.0.7:8000; empty: not registered")
	fs.DurationVar(&o.interval, "interval", o.interval,
		"how often the page is read; after 2 x this + 1s without a good read the worker's reports stop (it goes stale)")
	fs.DurationVar(&o.timeout, "timeout", o.timeout, "bound of one read of the page")
	fs.Int64Var(&o.maxBody, "max-body-bytes", o.maxBody, "largest page read; a larger one is a failed read")
	fs.StringVar(&o.prefix, "subject-prefix", o.prefix, "first subject token(s) of load and goodbye subjects")
	fs.StringVar(&o.httpAddr, "http-addr", o.httpAddr, "listen address of /metrics and /healthz; empty: none")
	natsFlags(fs, &o.natsURL, &o.nats)
	o.log.flags(fs)
}

// adapterConfig returns the adapter's configuration; Conn, Logger and
// Registerer are still to be set.
func (o scrapeOptions) adapterConfig() (adapter.Config, error) {
	c := adapter.DefaultConfig()
	var errs []error
	if o.engine == "" {
		errs = append(errs, fmt.Errorf("--engine is required (%s)", strings.Join(scrape.Engines(), ", ")))
	} else if m, err := scrape.ForEngine(o.engine); err != nil {
		errs = append(errs, fmt.Errorf("--engine: %w", err))
	} else {
		c.Mapping = m
	}
	if o.workerID == nil {
		errs = append(errs, errors.New("--worker-id is required"))
	} else {
		c.WorkerID = *o.workerID
	}
	c.MetricsURL, c.Model, c.Endpoint = o.metricsURL, o.model, o.endpoint
	c.Interval, c.Timeout, c.MaxBodyBytes, c.SubjectPrefix = o.interval, o.timeout, o.maxBody, o.prefix
	// Conn is set by the caller; a stand-in lets Validate check the rest.
	probe := c
	probe.Conn = new(nats.Conn)
	if probe.Mapping == nil {
		probe.Mapping = scrape.VLLM{}
	}
	if err := probe.Validate(); err != nil {
		errs = append(errs, err)
	}
	nc := o.nats
	nc.URL = o.natsURL
	errs = append(errs, nc.Validate())
	if o.httpAddr != "" {
		errs = append(errs, validListenAddr("http-addr", o.httpAddr))
	}
	if err := errors.Join(errs...); err != nil {
		return c, fmt.Errorf("%w: %w", errUsage, err)
	}
	return c, nil
}

// runScrape is `workermon scrape`: a sidecar that publishes a stock
// engine's load from its /metrics page (contract §13).
func runScrape(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := defaultScrapeOptions()
	log, check, err := parseCommand("scrape", args, stderr, natsURLEnv, o.flags, &o.log)
	if err != nil {
		return err
	}
	if check.on {
		_, err := o.adapterConfig()
		return check.report(stdout, err, map[string]any{"silence_after": adapter.SilenceAfter(o.interval).String()})
	}
	svc, err := startScrape(ctx, o, log, newRegistry())
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "workermon scrape: %s %s -> model %s, worker %d\n", o.engine, redact.URL(o.metricsURL), o.model, *o.workerID)
	if svc.http != nil {
		fmt.Fprintf(stdout, "workermon scrape: http://%s/metrics\n", svc.http.addr)
	}
	return closeWhenDone(ctx, log, "shutting down: goodbye, then the registry entry is deleted", svc.close)
}

// scrapeService is a running scrape sidecar.
type scrapeService struct {
	nc      *nats.Conn
	adapter *adapter.Adapter
	http    *httpServer
}

// startScrape connects to NATS (ctx bounds the wait) and starts the
// adapter and the HTTP server; on error what was started is stopped.
func startScrape(ctx context.Context, o scrapeOptions, log *slog.Logger, reg *prometheus.Registry) (_ *scrapeService, err error) {
	cfg, err := o.adapterConfig()
	if err != nil {
		return nil, err
	}
	svc := &scrapeService{}
	defer func() {
		if err != nil {
			cctx, cancel := context.WithTimeout(context.Background(), DefaultShutdownTimeout)
			defer cancel()
			_ = svc.close(cctx)
		}
	}()
	nc := o.nats
	nc.URL = o.natsURL
	if nc.Name == natsconn.DefaultName {
		nc.Name = "workermon-scrape-" + strconv.FormatUint(cfg.WorkerID, 10)
	}
	if svc.nc, err = natsconn.Connect(ctx, nc, log.With("component", "nats")); err != nil {
		return nil, err
	}
	if err := checkServer(ctx, svc.nc, reg); err != nil {
		return nil, err
	}
	cfg.Conn, cfg.Logger, cfg.Registerer = svc.nc, log, reg
	if svc.adapter, err = adapter.Start(cfg); err != nil {
		return nil, err
	}
	if o.httpAddr != "" {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		mux.HandleFunc("GET /healthz", svc.healthz)
		if svc.http, err = startHTTP("scrape", o.httpAddr, mux, log); err != nil {
			return nil, err
		}
	}
	httpAddr := ""
	if svc.http != nil {
		httpAddr = svc.http.addr
	}
	log.Info("scrape started", "engine", o.engine, "metrics_url", redact.URL(o.metricsURL), "model", o.model,
		"worker_id", cfg.WorkerID, "endpoint", o.endpoint, "interval", o.interval,
		"silence_after", adapter.SilenceAfter(o.interval), "http", httpAddr)
	return svc, nil
}

// healthz answers 200 while the process runs, with the NATS server's
// version and what the adapter has seen of the engine.
func (svc *scrapeService) healthz(w http.ResponseWriter, _ *http.Request) {
	version := "disconnected"
	if svc.nc.IsConnected() {
		version = svc.nc.ConnectedServerVersion()
	}
	st := svc.adapter.Status()
	last := "never"
	if !st.LastGood.IsZero() {
		last = st.LastGood.UTC().Format(time.RFC3339Nano)
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "ok\nnats_server_version %s\nlast_good_scrape %s\nranks %d\ndeclared_ranks %d+%d\nsilent %t\n",
		version, last, st.Ranks, st.DPStart, st.DPSize, st.Silent)
	if st.LastError != nil {
		fmt.Fprintf(w, "last_error %s\n", strings.ReplaceAll(st.LastError.Error(), "\n", " "))
	}
}

// close stops the HTTP server, then the adapter (its goodbye and the
// deletion of the registry entry), then the connection.
func (svc *scrapeService) close(ctx context.Context) error {
	var errs []error
	if svc.http != nil {
		hctx, cancel := partOf(ctx, 0.3)
		errs = append(errs, svc.http.shutdown(hctx))
		cancel()
	}
	if svc.adapter != nil {
		errs = append(errs, svc.adapter.Close(ctx))
	}
	if svc.nc != nil {
		svc.nc.Close()
	}
	return errors.Join(errs...)
}
