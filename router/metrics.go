package router

import (
	"errors"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promreg"
)

// Upstream error kinds of workermon_router_upstream_errors_total.
const (
	upstreamConnect  = "connect"  // transport error before the response headers
	upstreamTimeout  = "timeout"  // no response headers within the upstream timeout
	upstreamStream   = "stream"   // the response body was cut (read error, or a stream ended early)
	upstreamEndpoint = "endpoint" // the registered endpoint is not a usable URL
)

// Outcomes of workermon_router_migrations_total.
const (
	migrationContinued = "continued" // the stream went on on another worker
	migrationFinished  = "finished"  // the cut came after the last token allowed: finished by the router
	migrationFailed    = "failed"    // no other worker could continue it
	migrationLimit     = "limit"     // the migration limit was reached
)

// statusClientClosed is the code label of a request whose client went away
// before the response started (nginx's convention).
const statusClientClosed = 499

// rateLogEvery is how often a repeated upstream failure is logged at Warn;
// the others go to Debug.
const rateLogEvery = 10 * time.Second

// metrics are the Router's own metrics; the admission counters are
// admission.Metrics.
type metrics struct {
	duration      *prometheus.HistogramVec
	inFlight      prometheus.Gauge
	cancellations *prometheus.CounterVec
	upstream      *prometheus.CounterVec
	retries       prometheus.Counter
	migrations    *prometheus.CounterVec
	noWorkers     prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "workermon_router_request_duration_seconds",
			Help:    "Time from a proxied request's arrival to the end of its response, by route and status code (499: the client went away first).",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600},
		}, []string{"route", "code"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_router_requests_in_flight",
			Help: "Proxied requests being served.",
		}),
		cancellations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_cancellations_total",
			Help: "Proxied requests whose client went away before the response ended; the upstream request is cancelled.",
		}, []string{"route"}),
		upstream: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_upstream_errors_total",
			Help: "Failures talking to workers, by kind: connect, timeout, stream, endpoint.",
		}, []string{"kind"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_router_upstream_retries_total",
			Help: "Requests sent again, to another worker or on a fresh connection, after a worker could not be reached.",
		}),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_migrations_total",
			Help: "Cut streamed completions, by outcome: continued (on another worker), finished (by the router: no token left), failed, limit.",
		}, []string{"outcome"}),
		noWorkers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_router_no_workers_total",
			Help: "Admitted requests answered 503 because no registered worker could take them.",
		}),
	}
	if err := errors.Join(promreg.Shared(reg, &m.duration), promreg.Shared(reg, &m.inFlight),
		promreg.Shared(reg, &m.cancellations), promreg.Shared(reg, &m.upstream),
		promreg.Shared(reg, &m.retries), promreg.Shared(reg, &m.migrations),
		promreg.Shared(reg, &m.noWorkers)); err != nil {
		return nil, err
	}
	// Initialise the label values known in advance, so that they show as 0.
	for _, k := range []string{upstreamConnect, upstreamTimeout, upstreamStream, upstreamEndpoint} {
		m.upstream.WithLabelValues(k)
	}
	for _, o := range []string{migrationContinued, migrationFinished, migrationFailed, migrationLimit} {
		m.migrations.WithLabelValues(o)
	}
	for _, r := range []string{routeCompletions, routeChatCompletions} {
		m.cancellations.WithLabelValues(r)
	}
	return m, nil
}

// observe records a finished request.
func (m *metrics) observe(route string, code int, since time.Time) {
	m.duration.WithLabelValues(route, strconv.Itoa(code)).Observe(time.Since(since).Seconds())
}

// rateLog logs a repeated failure at Warn at most once per interval, and at
// Debug otherwise.
type rateLog struct {
	log   *slog.Logger
	every time.Duration
	last  atomic.Int64 // Unix nanoseconds of the last Warn
}

func (l *rateLog) warn(msg string, args ...any) {
	now := time.Now().UnixNano()
	last := l.last.Load()
	if now-last >= int64(l.every) && l.last.CompareAndSwap(last, now) {
		l.log.Warn(msg, args...)
		return
	}
	l.log.Debug(msg, args...)
}
