package monitor

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promreg"
)

// metrics are the monitor's Prometheus collectors.
type metrics struct {
	accepted                  *prometheus.CounterVec
	acceptedLoad, acceptedBye prometheus.Counter
	rejected                  *prometheus.CounterVec
	workers                   *prometheus.GaugeVec
	busyFraction              *prometheus.GaugeVec
	allBusyChanges            *prometheus.CounterVec
	models                    prometheus.Gauge
	recompute                 prometheus.Histogram
	lag                       prometheus.Histogram
	saturation                *prometheus.GaugeVec
	// counterDecreases counts, by signal, the counters of contract §21
	// dropped from a report because they went down within a boot; nil for
	// the signals that are not counters.
	counterDecreases [numSignals]prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, queueLen func() float64) (*metrics, error) {
	m := &metrics{
		accepted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_reports_accepted_total",
			Help: "Messages applied to the load state, by kind (load, goodbye).",
		}, []string{"kind"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_reports_rejected_total",
			Help: "Messages rejected, by reason (malformed, wrong_type, mismatch, duplicate, too_many_workers, wrong_partition, ...).",
		}, []string{"reason"}),
		allBusyChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_all_busy_changes_total",
			Help: "Times a model's record turned all_busy on or off: its flap rate (see --release-margin).",
		}, []string{"model"}),
		workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_workers",
			Help: "Workers of each model by state (busy, free, stale; amber counts free workers at amber level, hard busy workers at hard level).",
		}, []string{"model", "state"}),
		saturation: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_model_saturation",
			Help: "Mean saturation of each model's fresh, uncordoned workers (a worker's is its least saturated rank's largest value ÷ limit over the thresholds in force, 0 to 4; above 1 is busy), exact: the record carries it rounded to 0.01. A scaling signal.",
		}, []string{"model"}),
		busyFraction: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_model_busy_fraction",
			Help: "Busy workers of each model over its listed workers (busy + free; stale ones are not listed as either), 0 with none: a scaling signal.",
		}, []string{"model"}),
		models: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_models",
			Help: "Models with at least one worker in the load state.",
		}),
		recompute: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "workermon_recompute_seconds",
			Help:    "Time to decode, apply and recompute one message (the mean over the batch it was applied in).",
			Buckets: prometheus.ExponentialBuckets(250e-9, 4, 10),
		}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "workermon_report_lag_seconds",
			Help:    "Monitor clock at processing minus the report's sent_at (includes clock skew between hosts).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 4, 10),
		}),
	}
	m.acceptedLoad, m.acceptedBye = m.accepted.WithLabelValues("load"), m.accepted.WithLabelValues("goodbye")
	decreases := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "workermon_report_fields_dropped_total",
		Help: "Counters of a report (preemptions, prefilled_tokens) that went down within a boot: that field of the report was dropped, the rest applied.",
	}, []string{"field"})
	for i, name := range counterNames {
		if name != "" {
			m.counterDecreases[i] = decreases.WithLabelValues(name)
		}
	}
	queue := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "workermon_queue_length",
		Help: "Messages waiting for the monitor loop.",
	}, queueLen)
	if err := promreg.All(reg, m.accepted, m.rejected, m.workers, m.busyFraction, m.saturation, m.allBusyChanges, m.models,
		m.recompute, m.lag, queue, decreases); err != nil {
		return nil, fmt.Errorf("monitor: %w", err)
	}
	return m, nil
}

// modelMetrics are one model's series, looked up once, at its first record,
// rather than by label on every record. A model that never has a record
// (seeded from a record with no workers left) has no series.
type modelMetrics struct {
	resolved                       bool
	busy, free, stale, amber, hard prometheus.Gauge
	busyFraction                   prometheus.Gauge
	saturation                     prometheus.Gauge
	allBusyChanges                 prometheus.Counter
}

func (m *metrics) forModel(name string) modelMetrics {
	return modelMetrics{
		resolved:       true,
		busy:           m.workers.WithLabelValues(name, "busy"),
		free:           m.workers.WithLabelValues(name, "free"),
		stale:          m.workers.WithLabelValues(name, "stale"),
		amber:          m.workers.WithLabelValues(name, "amber"),
		hard:           m.workers.WithLabelValues(name, "hard"),
		busyFraction:   m.busyFraction.WithLabelValues(name),
		saturation:     m.saturation.WithLabelValues(name),
		allBusyChanges: m.allBusyChanges.WithLabelValues(name),
	}
}

func (mm *modelMetrics) setWorkers(md *model) {
	mm.busy.Set(float64(len(md.busy)))
	mm.free.Set(float64(len(md.free)))
	mm.stale.Set(float64(len(md.stale)))
	mm.amber.Set(float64(len(md.amber)))
	mm.hard.Set(float64(len(md.hard)))
	mm.busyFraction.Set(BusyFraction(len(md.busy), len(md.free)))
}

// BusyFraction is busy ÷ (busy + free): the share of a model's listed
// workers that are busy (contract §19), 0 when none is listed.
func BusyFraction(busy, free int) float64 {
	if busy+free == 0 {
		return 0
	}
	return float64(busy) / float64(busy+free)
}

func (m *metrics) forgetModel(name string) {
	m.workers.DeletePartialMatch(prometheus.Labels{"model": name})
	m.busyFraction.DeletePartialMatch(prometheus.Labels{"model": name})
	m.saturation.DeletePartialMatch(prometheus.Labels{"model": name})
	m.allBusyChanges.DeletePartialMatch(prometheus.Labels{"model": name})
}
