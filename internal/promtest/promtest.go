// Package promtest reads metrics back from a Prometheus registry in tests.
package promtest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Value returns the first series of the metric name whose labels include
// every pair in labels: a counter's or gauge's value, or a histogram's sample
// count. ok is false when there is no such series.
func Value(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) (v float64, ok bool) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("promtest: gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue series
				}
			}
			switch {
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue(), true
			case m.GetHistogram() != nil:
				return float64(m.GetHistogram().GetSampleCount()), true
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}
