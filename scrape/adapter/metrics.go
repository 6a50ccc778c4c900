package adapter

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promreg"
)

// metrics are the Adapter's Prometheus collectors.
type metrics struct {
	scrapes  *prometheus.CounterVec
	failures *prometheus.CounterVec
	duration prometheus.Histogram
	ranks    prometheus.Gauge
	silent   prometheus.Gauge
	lastGood prometheus.Gauge
}

// newMetrics returns the collectors, registered on reg (nil: none).
func newMetrics(reg prometheus.Registerer) (metrics, error) {
	m := metrics{
		scrapes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_scrapes_total",
			Help: "Scrapes of the engine's /metrics page, by result: ok (an HTTP 200 that parsed and named at least one rank) or failed.",
		}, []string{"result"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_scrape_failures_total",
			Help: "Failed scrapes by reason: request, status, body, parse, no_ranks, publisher.",
		}, []string{"reason"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "workermon_scrape_duration_seconds",
			Help:    "Time of one scrape, from the request to the mapped ranks, failed ones included.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}),
		ranks: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_scrape_ranks",
			Help: "Ranks the last good scrape found.",
		}),
		silent: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_scrape_silent",
			Help: "1 while no scrape has been good for 2 x the interval + 1s: the engine's ranks and registry entry are not published, and the worker goes stale at the monitor.",
		}),
		lastGood: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_scrape_last_success_timestamp_seconds",
			Help: "Unix time of the last good scrape; 0 before the first.",
		}),
	}
	m.scrapes.WithLabelValues("ok")
	m.scrapes.WithLabelValues("failed")
	for _, r := range []string{ReasonRequest, ReasonStatus, ReasonBody, ReasonParse, ReasonNoRanks, ReasonPublisher} {
		m.failures.WithLabelValues(r)
	}
	return m, promreg.All(reg, m.scrapes, m.failures, m.duration, m.ranks, m.silent, m.lastGood)
}
