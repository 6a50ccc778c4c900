// Package promreg registers the Prometheus collectors of workermon's
// components on the registry they are given: All registers one owner's
// collectors, every one or none; Shared registers a family that several
// owners of one registry declare alike (the router's watchers, its
// admission metrics and its gateway count into the same families), so that
// the second one shares the first one's collector instead of failing. Sum
// reads a family back.
package promreg

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Shared registers the collector *c on reg. When an equal collector is
// already registered there, *c becomes that one, so that they share it. A
// nil reg registers nothing.
func Shared[C prometheus.Collector](reg prometheus.Registerer, c *C) error {
	if reg == nil {
		return nil
	}
	if err := reg.Register(*c); err != nil {
		if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
			if existing, ok := are.ExistingCollector.(C); ok {
				*c = existing
				return nil
			}
		}
		return fmt.Errorf("register metrics: %w", err)
	}
	return nil
}

// All registers every collector on reg, or none: on a failure it
// unregisters those it registered and returns the error. A nil reg
// registers nothing.
func All(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			return fmt.Errorf("register metrics: %w", err)
		}
	}
	return nil
}

// Sum is the sum of a counter's or a gauge's series in reg (0 when
// absent).
func Sum(reg prometheus.Gatherer, name string) float64 {
	families, err := reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}
