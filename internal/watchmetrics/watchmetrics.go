// Package watchmetrics counts the router side's KV watches in Prometheus:
// the workermon_router_watch_* families, labelled by bucket, shared by the
// busy-set Watcher (busylist) and the registry Watcher (registry). It is
// kept apart from both so that the registry, which engines link through the
// publisher, does not pull in the Prometheus client.
package watchmetrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/internal/kvwatch"
	"github.com/workermon/workermon/internal/promreg"
)

// Metrics are the watch metrics of a registry, for every bucket.
type Metrics struct {
	rewatches  *prometheus.CounterVec
	badRecords *prometheus.CounterVec
	ready      *prometheus.GaugeVec
	keys       *prometheus.GaugeVec
}

// New returns the metrics registered on reg (not registered when reg is
// nil; families already registered there are shared).
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		rewatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_watch_rewatches_total",
			Help: "Re-watches of a KV bucket by the router, by reason: reconnect, closed, error, gone, recreated, stalled, recovered.",
		}, []string{"bucket", "reason"}),
		badRecords: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "workermon_router_watch_bad_records_total",
			Help: "KV entries the router ignored because they could not be decoded or did not match their key, by reason.",
		}, []string{"bucket", "reason"}),
		ready: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_router_watch_ready",
			Help: "1 once the router has loaded the bucket's initial values.",
		}, []string{"bucket"}),
		keys: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "workermon_router_watch_keys",
			Help: "Keys in the router's snapshot of the bucket: models of the busy bucket, models with registered workers of the workers bucket.",
		}, []string{"bucket"}),
	}
	if err := errors.Join(promreg.Shared(reg, &m.rewatches), promreg.Shared(reg, &m.badRecords),
		promreg.Shared(reg, &m.ready), promreg.Shared(reg, &m.keys)); err != nil {
		return nil, err
	}
	return m, nil
}

// Bucket returns the counters of one bucket's watch.
func (m *Metrics) Bucket(bucket string) *Stats {
	return &Stats{
		rewatches:  m.rewatches.MustCurryWith(prometheus.Labels{"bucket": bucket}),
		badRecords: m.badRecords.MustCurryWith(prometheus.Labels{"bucket": bucket}),
		ready:      m.ready.WithLabelValues(bucket),
		keys:       m.keys.WithLabelValues(bucket),
	}
}

// Stats counts one bucket's watch; it is a kvwatch.Stats.
type Stats struct {
	rewatches  *prometheus.CounterVec // curried with the bucket
	badRecords *prometheus.CounterVec // curried with the bucket
	ready      prometheus.Gauge
	keys       prometheus.Gauge
}

var _ kvwatch.Stats = (*Stats)(nil)

// Rewatched counts a watch that ended, by reason.
func (s *Stats) Rewatched(reason string) { s.rewatches.WithLabelValues(reason).Inc() }

// BadRecord counts an entry the watcher rejected, by reason.
func (s *Stats) BadRecord(reason string) { s.badRecords.WithLabelValues(reason).Inc() }

// Published sets the ready gauge and the number of keys.
func (s *Stats) Published(keys int) {
	s.ready.Set(1)
	s.keys.Set(float64(keys))
}
