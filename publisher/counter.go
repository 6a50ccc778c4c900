package publisher

import "math"

// counter turns an engine's running total into the counter a report
// carries (contract §21: a counter per boot_id that never goes down): the
// first value as given, then the sum of the increases. A value below the
// previous one is a restart of the engine's count from zero, so all of it is
// an increase. The sum stops at the largest uint64 rather than wrap.
type counter struct {
	last  uint64 // the engine's last value
	total uint64 // the value published
	seen  bool
}

// add takes the engine's value v and returns the value to publish.
func (c *counter) add(v uint64) uint64 {
	switch {
	case !c.seen:
		c.total = v
	case v >= c.last:
		c.total = addSaturating(c.total, v-c.last)
	default: // the engine's count restarted from zero
		c.total = addSaturating(c.total, v)
	}
	c.last, c.seen = v, true
	return c.total
}

// addSaturating returns a+b, or the largest uint64 when that overflows.
func addSaturating(a, b uint64) uint64 {
	if b > math.MaxUint64-a {
		return math.MaxUint64
	}
	return a + b
}
