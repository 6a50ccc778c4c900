package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestSum(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total"}, []string{"k"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g"})
	if err := All(reg, c, g); err != nil {
		t.Fatal(err)
	}
	c.WithLabelValues("a").Add(2)
	c.WithLabelValues("b").Add(3)
	g.Set(-1.5)
	for name, want := range map[string]float64{"c_total": 5, "g": -1.5, "absent": 0} {
		if got := Sum(reg, name); got != want {
			t.Errorf("Sum(%q) = %g, want %g", name, got, want)
		}
	}
}
