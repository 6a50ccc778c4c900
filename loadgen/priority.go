package loadgen

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// PriorityShare is one part of a priority mix: the share of the requests
// sent with Priority.
type PriorityShare struct {
	Priority int64
	Share    float64
}

// ParsePriorityMix parses a mix written priority=share, comma-separated,
// e.g. "-1=0.5,0=0.4,1=0.1". Shares are weights: they need not sum to 1.
// The empty string is no mix.
func ParsePriorityMix(s string) ([]PriorityShare, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var mix []PriorityShare
	for part := range strings.SplitSeq(s, ",") {
		p, sh, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return nil, fmt.Errorf("loadgen: priority mix %q: %q is not priority=share: %w", s, part, ErrInvalidConfig)
		}
		prio, err := strconv.ParseInt(strings.TrimSpace(p), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("loadgen: priority mix %q: priority %q is not an integer: %w", s, p, ErrInvalidConfig)
		}
		share, err := strconv.ParseFloat(strings.TrimSpace(sh), 64)
		if err != nil {
			return nil, fmt.Errorf("loadgen: priority mix %q: share %q is not a number: %w", s, sh, ErrInvalidConfig)
		}
		mix = append(mix, PriorityShare{Priority: prio, Share: share})
	}
	return mix, checkMix(mix)
}

// checkMix reports what is wrong with a mix: a share that is negative or
// not finite, a priority given twice, or shares that sum to 0.
func checkMix(mix []PriorityShare) error {
	var errs []error
	var sum float64
	for i, p := range mix {
		if !(p.Share >= 0) || math.IsInf(p.Share, 0) {
			errs = append(errs, fmt.Errorf("loadgen: check PriorityMix: share %v of priority %d is not a finite number ≥ 0: %w",
				p.Share, p.Priority, ErrInvalidConfig))
		} else {
			sum += p.Share
		}
		if slices.ContainsFunc(mix[:i], func(q PriorityShare) bool { return q.Priority == p.Priority }) {
			errs = append(errs, fmt.Errorf("loadgen: check PriorityMix: priority %d given twice: %w", p.Priority, ErrInvalidConfig))
		}
	}
	if len(mix) > 0 && len(errs) == 0 && !(sum > 0) {
		errs = append(errs, fmt.Errorf("loadgen: check PriorityMix: the shares sum to 0: %w", ErrInvalidConfig))
	}
	return errors.Join(errs...)
}

// chooser picks each request's priority from the mix, in a sequence that
// depends only on the seed: the n-th request of two runs with the same
// seed has the same priority. One goroutine uses it (Run's).
type chooser struct {
	mix    []PriorityShare
	cum    []float64 // cumulative shares, normalised: the last is 1
	header []string  // the header value of each priority
	rng    *rand.Rand
}

func newChooser(mix []PriorityShare, seed uint64) *chooser {
	if len(mix) == 0 {
		return nil
	}
	c := &chooser{mix: mix, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
	var sum float64
	for _, p := range mix {
		sum += p.Share
	}
	var acc float64
	for _, p := range mix {
		acc += p.Share / sum
		c.cum = append(c.cum, acc)
		c.header = append(c.header, strconv.FormatInt(p.Priority, 10))
	}
	c.cum[len(c.cum)-1] = 1
	return c
}

// next returns the index in the mix of the next request's priority.
func (c *chooser) next() int {
	u := c.rng.Float64()
	for i, v := range c.cum {
		if u < v {
			return i
		}
	}
	return len(c.cum) - 1
}
