package monitor

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the monitor's Prometheus collectors.
type metrics struct {
	accepted                  *prometheus.CounterVec
	acceptedLoad, acceptedBye prometheus.Counter
	rejected                  *prometheus.CounterVec
	workers                   *prometheus.GaugeVec
	models                    prometheus.Gauge
	recompute                 prometheus.Histogram
	lag                       prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer, queueLen func() float64) (*metrics, error) {
	m := &metrics{
		accepted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_reports_accepted_total",
			Help: "Messages applied to the load state, by kind (load, goodbye).",
		}, []string{"kind"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_reports_rejected_total",
			Help: "Messages rejected, by reason (malformed, wrong_type, mismatch, duplicate, too_many_workers, ...).",
		}, []string{"reason"}),
		workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_workers",
			Help: "Workers of each model by state (busy, free, stale).",
		}, []string{"model", "state"}),
		models: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_models",
			Help: "Models with at least one worker in the load state.",
		}),
		recompute: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "workermon_recompute_seconds",
			Help:    "Time to decode, apply and recompute one message.",
			Buckets: prometheus.ExponentialBuckets(250e-9, 4, 10),
		}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "workermon_report_lag_seconds",
			Help:    "Monitor clock at processing minus the report's sent_at (includes clock skew between hosts).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 4, 10),
		}),
	}
	m.acceptedLoad, m.acceptedBye = m.accepted.WithLabelValues("load"), m.accepted.WithLabelValues("goodbye")
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{
		m.accepted, m.rejected, m.workers, m.models, m.recompute, m.lag,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "workermon_queue_length",
			Help: "Messages waiting for the monitor loop.",
		}, queueLen),
	} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("monitor: register metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) setWorkers(md *model) {
	m.workers.WithLabelValues(md.name, "busy").Set(float64(len(md.busy)))
	m.workers.WithLabelValues(md.name, "free").Set(float64(len(md.free)))
	m.workers.WithLabelValues(md.name, "stale").Set(float64(len(md.stale)))
}

func (m *metrics) forgetModel(name string) {
	m.workers.DeletePartialMatch(prometheus.Labels{"model": name})
}
