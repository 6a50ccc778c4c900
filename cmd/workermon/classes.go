package main

import (
	"flag"

	"github.com/workermon/workermon/monitor"
)

// classFlags registers the flags of the priority classes' levels (contract
// §15) on the monitor's config: serve's and demo's.
func classFlags(fs *flag.FlagSet, c *monitor.Config) {
	fs.Float64Var(&c.ShedFraction, "shed-fraction", c.ShedFraction,
		"priority classes: a worker is amber (sheddable requests avoid it) above this fraction of a threshold, in (0, 1] (1: no amber level)")
	fs.Float64Var(&c.CriticalFraction, "critical-fraction", c.CriticalFraction,
		"priority classes: a busy worker is hard (critical requests avoid it too) above this fraction of a threshold, ≥ 1, the KV check capped at the whole cache")
}
