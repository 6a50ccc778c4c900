package busylist

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/promreg"
)

// writerMetrics are the Writer's Prometheus metrics.
type writerMetrics struct {
	writes     *prometheus.CounterVec
	errors     *prometheus.CounterVec
	duration   prometheus.Histogram
	pending    prometheus.Gauge
	epoch      prometheus.Gauge
	badRecords prometheus.Counter
	fenced     prometheus.Counter
}

func newWriterMetrics(reg prometheus.Registerer) (writerMetrics, error) {
	m := writerMetrics{
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_busy_writer_writes_total",
			Help: "Successful writes to the busy bucket by kind: put_change (content changed), put_heartbeat (unchanged re-put), delete (model gone), claim (a record re-put under a new epoch at a takeover).",
		}, []string{"kind"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_busy_writer_errors_total",
			Help: "Failed busy-bucket operations by kind: put_change, put_heartbeat, delete, open (opening or reading the bucket), claim. Failed writes are retried.",
		}, []string{"kind"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "workermon_busy_writer_write_duration_seconds",
			Help:    "Duration of each put or delete in the busy bucket, failed ones included.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}),
		pending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_busy_writer_pending_records",
			Help: "Models whose latest busy set or deletion is not written yet (during the warm-up, or while NATS is unreachable).",
		}),
		epoch: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "workermon_busy_writer_epoch",
			Help: "The busy writer's epoch: 1 + the highest epoch found in the bucket at start; 0 before the bucket is open.",
		}),
		badRecords: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "workermon_busy_writer_unreadable_records_total",
			Help: "Records found in the busy bucket at start whose epoch could not be read.",
		}),
	}
	m.fenced = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "workermon_busy_writer_fenced_total",
		Help: "Times the writer stopped writing a partition because it found a record with a higher epoch (another monitor took the partition over).",
	})
	for _, k := range []string{writerKindChange, writerKindHeartbeat, writerKindDelete, writerKindClaim} {
		m.writes.WithLabelValues(k)
		m.errors.WithLabelValues(k)
	}
	m.errors.WithLabelValues(writerKindOpen)
	if err := promreg.All(reg, m.writes, m.errors, m.duration, m.pending, m.epoch, m.badRecords, m.fenced); err != nil {
		return m, fmt.Errorf("busylist: writer: %w", err)
	}
	return m, nil
}
