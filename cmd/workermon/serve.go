package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/internal/httplimit"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/natsconn"
)

// Defaults of `workermon serve` that are not defaults of a package.
const (
	// DefaultMonitorHTTPAddr is where the monitor serves its API and metrics.
	DefaultMonitorHTTPAddr = "127.0.0.1:8090"
	// DefaultShutdownTimeout bounds the whole clean shutdown.
	DefaultShutdownTimeout = 10 * time.Second
)

// serveOptions is everything `workermon serve` can be told.
type serveOptions struct {
	natsURL    string
	nats       natsconn.Config
	embedded   natsconn.EmbeddedConfig
	httpAddr   string
	httpLimits httplimit.Limits
	monitor    monitor.Config
	writer     busylist.WriterConfig
	replicas   int
	partitions int
	leaseTTL   time.Duration
	// staleListAfter is the routers' --stale-list-after, for the warning
	// about a takeover's length.
	staleListAfter time.Duration
	adminToken     string
	resched        reschedOptions
	slo            sloOptions
	log            logOptions
	// hooks are for tests; nil otherwise.
	hooks *serveHooks
}

func defaultServeOptions() serveOptions {
	o := serveOptions{
		nats:           natsconn.DefaultConfig(),
		embedded:       natsconn.DefaultEmbeddedConfig(),
		httpAddr:       DefaultMonitorHTTPAddr,
		httpLimits:     httplimit.DefaultLimits(),
		monitor:        monitor.DefaultConfig(),
		writer:         busylist.DefaultWriterConfig(),
		replicas:       1,
		partitions:     busylist.DefaultPartitions,
		leaseTTL:       busylist.DefaultLeaseTTL,
		staleListAfter: busylist.DefaultStaleListAfter,
		resched:        defaultReschedOptions(),
		slo:            defaultSLOOptions(),
		log:            defaultLogOptions(),
	}
	o.nats.URL = ""
	o.nats.Name = "workermon-monitor"
	o.writer.MonitorID = instanceID()
	return o
}

// natsFlags registers the flags of a NATS client shared by every command.
func natsFlags(fs *flag.FlagSet, url *string, c *natsconn.Config) {
	fs.StringVar(url, "nats-url", *url, "NATS server URL(s), comma-separated (env NATS_URL too)")
	fs.StringVar(&c.CredsFile, "nats-creds", c.CredsFile, "NATS credentials file (JWT + nkey seed)")
	fs.StringVar(&c.NKeyFile, "nats-nkey", c.NKeyFile, "file with a NATS user nkey seed")
	fs.StringVar(&c.User, "nats-user", c.User, "NATS user name")
	fs.StringVar(&c.Password, "nats-password", c.Password, "NATS password")
	fs.StringVar(&c.Token, "nats-token", c.Token, "NATS authentication token")
	fs.StringVar(&c.TLSCA, "nats-tls-ca", c.TLSCA, "PEM file of the CAs that verify the NATS server")
	fs.StringVar(&c.TLSCert, "nats-tls-cert", c.TLSCert, "PEM client certificate for NATS (with --nats-tls-key)")
	fs.StringVar(&c.TLSKey, "nats-tls-key", c.TLSKey, "PEM key of the client certificate")
	fs.BoolVar(&c.IgnoreDiscoveredServers, "nats-ignore-discovered", c.IgnoreDiscoveredServers,
		"use only the given NATS URLs, not the servers a cluster advertises")
}

func (o *serveOptions) flags(fs *flag.FlagSet) {
	natsFlags(fs, &o.natsURL, &o.nats)
	fs.StringVar(&o.embedded.Addr, "embedded-nats-addr", o.embedded.Addr, "listen address of the embedded NATS server (used when --nats-url is empty)")
	fs.StringVar(&o.embedded.DataDir, "data-dir", o.embedded.DataDir, "JetStream store of the embedded NATS server")
	fs.StringVar(&o.httpAddr, "http-addr", o.httpAddr, "listen address of the web board (/), the API, /metrics, /healthz and /readyz")
	fs.StringVar(&o.monitor.SubjectPrefix, "subject-prefix", o.monitor.SubjectPrefix, "first subject token(s) of load and goodbye subjects")
	fs.Var(optFloat{&o.monitor.Defaults.ActiveDecodeBlocks}, "active-decode-blocks-threshold",
		"default KV-cache threshold in [0, 1]: busy when active_decode_blocks > threshold × kv_total_blocks (unset: off)")
	fs.Var(optUint{&o.monitor.Defaults.ActivePrefillTokens}, "active-prefill-tokens-threshold",
		"default prefill threshold in tokens: busy when active_prefill_tokens > threshold (unset: off)")
	fs.Var(optFloat{&o.monitor.Defaults.ActivePrefillTokensFrac}, "active-prefill-tokens-threshold-frac",
		"default prefill threshold as a fraction of max_num_batched_tokens (unset: off)")
	fs.Var(optFloat{&o.monitor.Defaults.KVCommitted}, "kv-committed-threshold",
		"default committed-KV threshold in [0, 4]: busy when kv_committed_blocks > threshold × kv_total_blocks; above 1 allows overcommit (unset: off)")
	fs.Var(optUint{&o.monitor.Defaults.QueueDelayMs}, "queue-delay-threshold-ms",
		"default queue-delay threshold in ms: busy when active_prefill_tokens ÷ the measured prefill rate > threshold; no check while the rate is unknown (unset: off)")
	fs.DurationVar(&o.monitor.RateWindow, "rate-window", o.monitor.RateWindow,
		"the prefill and preemption rates are measured over this much time (for the prefill rate: time in which prefill tokens were active)")
	fs.DurationVar(&o.monitor.StaleAfter, "stale-after", o.monitor.StaleAfter, "a state not heard for this long no longer counts")
	fs.DurationVar(&o.monitor.GoneAfter, "gone-after", o.monitor.GoneAfter, "a silent worker is removed after this long; also a goodbye's tombstone")
	fs.DurationVar(&o.writer.Heartbeat, "heartbeat", o.writer.Heartbeat, "re-put every record at least this often")
	fs.DurationVar(&o.writer.Warmup, "warmup", o.writer.Warmup, "wait this long after start before the first write")
	fs.StringVar(&o.writer.MonitorID, "monitor-id", o.writer.MonitorID, "this monitor's name in the records and leases ([A-Za-z0-9_-])")
	fs.IntVar(&o.partitions, "partitions", o.partitions, "partitions the models are split into, the same on every monitor of a deployment")
	fs.DurationVar(&o.leaseTTL, "lease-ttl", o.leaseTTL, "a partition's lease lasts this long without a renewal")
	fs.DurationVar(&o.staleListAfter, "stale-list-after", o.staleListAfter, "the routers' stale-list-after, to warn when a takeover could outlast it")
	fs.IntVar(&o.replicas, "replicas", o.replicas, "replicas of the buckets this monitor creates")
	fs.IntVar(&o.monitor.MaxModels, "max-models", o.monitor.MaxModels, "most models tracked; reports of more are rejected")
	fs.IntVar(&o.monitor.MaxWorkersPerModel, "max-workers-per-model", o.monitor.MaxWorkersPerModel, "most workers tracked per model")
	fs.IntVar(&o.monitor.MaxSourcesPerWorker, "max-sources-per-worker", o.monitor.MaxSourcesPerWorker, "most sources tracked per worker")
	fs.IntVar(&o.monitor.MaxRoutersPerModel, "max-routers-per-model", o.monitor.MaxRoutersPerModel,
		"most routers whose queues (rq subjects) are kept per model")
	fs.IntVar(&o.monitor.MaxRanksPerWorker, "max-ranks-per-worker", o.monitor.MaxRanksPerWorker, "largest dp_size a report may declare")
	fs.StringVar(&o.adminToken, "admin-token", o.adminToken, "bearer token required to change thresholds and cordons (unset: anyone can)")
	o.reschedFlags(fs)
	o.slo.flags(fs)
	classFlags(fs, &o.monitor)
	o.log.flags(fs)
}

// validate checks what can be checked before anything starts.
func (o serveOptions) validate() error {
	var errs []error
	if err := o.monitor.Validate(); err != nil {
		errs = append(errs, err)
	}
	if o.natsURL == "" {
		if err := o.embedded.Validate(); err != nil {
			errs = append(errs, err)
		}
	} else {
		c := o.nats
		c.URL = o.natsURL
		if err := c.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := validListenAddr("http-addr", o.httpAddr); err != nil {
		errs = append(errs, fmt.Errorf("serve: %w", err))
	}
	if o.replicas < 1 || o.replicas > 5 {
		errs = append(errs, fmt.Errorf("serve: --replicas %d must be 1 to 5", o.replicas))
	}
	if o.writer.Heartbeat <= 0 {
		errs = append(errs, fmt.Errorf("serve: --heartbeat %v must be positive", o.writer.Heartbeat))
	}
	if o.writer.Warmup < 0 {
		errs = append(errs, fmt.Errorf("serve: --warmup %v must not be negative", o.writer.Warmup))
	}
	if err := busylist.ValidateMonitorID(o.writer.MonitorID); err != nil {
		errs = append(errs, fmt.Errorf("serve: --monitor-id: %w", err))
	}
	if o.partitions < 1 || o.partitions > 1024 {
		errs = append(errs, fmt.Errorf("serve: --partitions %d must be 1 to 1024", o.partitions))
	}
	errs = append(errs, o.resched.validate()...)
	if _, err := o.slo.controllerConfig(); err != nil {
		errs = append(errs, err)
	}
	if o.leaseTTL <= 0 {
		errs = append(errs, fmt.Errorf("serve: --lease-ttl %v must be positive", o.leaseTTL))
	}
	if o.staleListAfter <= 0 {
		errs = append(errs, fmt.Errorf("serve: --stale-list-after %v must be positive", o.staleListAfter))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// resolved is what --check adds to the flags: where NATS is and the
// rescheduler's effective timeout.
func (o serveOptions) resolved() map[string]any {
	r := map[string]any{"rescheduling_timeout": o.resched.effectiveTimeout().String()}
	if o.natsURL == "" {
		r["nats"] = "embedded server on " + o.embedded.Addr + ", JetStream store " + o.embedded.DataDir
	} else {
		r["nats"] = redact.URLs(o.natsURL)
	}
	return r
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := defaultServeOptions()
	log, check, err := parseCommand("serve", args, stderr, natsURLEnv, o.flags, &o.log)
	if err != nil {
		return err
	}
	if check.on {
		return check.report(stdout, o.validate(), o.resolved())
	}
	svc, err := startService(ctx, o, log, newRegistry())
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "workermon monitor: NATS %s, API http://%s, board http://%s/\n", redact.URLs(svc.natsURL), svc.httpAddr, svc.httpAddr)
	return serveUntil(ctx, log, svc.failed, svc.Close)
}
