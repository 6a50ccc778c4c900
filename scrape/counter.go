package scrape

// CounterSum turns one rank's engine counter, read page after page, into
// the counter a report carries (contract §21): the sum of the non-negative
// increases seen since the first page, so 0 at the first page, never going
// down. Each series counts apart:
//
//   - a value at or above the series' last one adds the difference;
//   - a value below it means the series restarted from zero (the engine
//     restarted under the adapter): all of it is an increase, as Prometheus
//     counts a counter reset;
//   - a series first seen after the first page (a new engine process, a
//     counter SGLang creates at its first increment) started from zero
//     since then: all of it is an increase;
//   - a series a page lacks keeps its last value, to compare the next one
//     with, for counterSeriesPages pages that carry the counter; then it
//     is forgotten (a label set that went away), so that the memory is
//     bounded by the series alive, and if it comes back it counts as new.
//
// The sum stops at the largest uint64 rather than wrap. The zero value is
// ready to use; a CounterSum is not safe for concurrent use.
type CounterSum struct {
	last    map[string]seriesSeen
	sum     uint64
	page    uint64 // pages that carried the counter
	started bool
}

// counterSeriesPages is how many pages carrying a counter a CounterSum
// keeps the last value of a series those pages lack (10 s at the default
// poll interval).
const counterSeriesPages = 100

// seriesSeen is a series' last value and the page that gave it.
type seriesSeen struct{ value, page uint64 }

// Add reads one page's series of the counter and returns the sum so far.
// ok is false when the page does not export the counter (c is nil): the
// report leaves it out. The first call, with or without c, is the start:
// what it gives is the baseline, not an increase.
func (s *CounterSum) Add(c Counter) (sum uint64, ok bool) {
	if s.last == nil {
		s.last = make(map[string]seriesSeen, len(c))
	}
	first := !s.started
	s.started = true
	if c != nil {
		s.page++
	}
	for _, series := range c {
		last, seen := s.last[series.Key]
		prev := last.value
		s.last[series.Key] = seriesSeen{series.Value, s.page}
		switch {
		case first:
		case !seen, series.Value < prev:
			s.sum = addSaturating(s.sum, series.Value)
		default:
			s.sum = addSaturating(s.sum, series.Value-prev)
		}
	}
	if c != nil && len(s.last) > len(c) {
		for k, v := range s.last {
			if s.page-v.page >= counterSeriesPages {
				delete(s.last, k)
			}
		}
	}
	return s.sum, c != nil
}
