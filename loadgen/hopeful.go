package loadgen

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// flight is a request in flight and the time after which it can no longer
// be good (Unix nanoseconds; math.MaxInt64 without a target).
type flight struct {
	deadline atomic.Int64
}

// firstToken moves the deadline of a streamed request whose first token
// came at first: good only if it came within the TTFT target, then as long
// as its TPOT can stay within the ITL target.
func (f *flight) firstToken(slo SLO, start, first time.Time, maxTokens int) {
	if slo.TTFT <= 0 && slo.ITL <= 0 {
		return
	}
	if slo.TTFT > 0 && first.Sub(start) > slo.TTFT {
		f.deadline.Store(math.MinInt64) // it cannot be good any more
		return
	}
	if slo.ITL <= 0 {
		f.deadline.Store(math.MaxInt64)
		return
	}
	f.deadline.Store(first.Add(slo.ITL * time.Duration(max(0, maxTokens-1))).UnixNano())
}

// retryAt marks a request that waits to be sent again at at: if that is
// past its deadline it cannot be good any more (its answer comes later), so
// a drain need not wait for it.
func (f *flight) retryAt(at time.Time) {
	if at.UnixNano() > f.deadline.Load() {
		f.deadline.Store(math.MinInt64)
	}
}

// flights are the requests in flight.
type flights struct {
	mu  sync.Mutex
	set map[*flight]struct{}
}

// add registers a request of cfg sent at start.
func (fs *flights) add(cfg Config, start time.Time, maxTokens int) *flight {
	f := &flight{}
	d := int64(math.MaxInt64)
	switch {
	case cfg.SLO.TTFT <= 0 && cfg.SLO.ITL <= 0, maxTokens <= 0:
	case cfg.Stream && cfg.SLO.TTFT > 0:
		d = start.Add(cfg.SLO.TTFT).UnixNano()
	case !cfg.Stream && cfg.SLO.TTFT > 0:
		d = start.Add(cfg.SLO.TTFT + cfg.SLO.ITL*time.Duration(maxTokens-1)).UnixNano()
	}
	f.deadline.Store(d)
	fs.mu.Lock()
	if fs.set == nil {
		fs.set = map[*flight]struct{}{}
	}
	fs.set[f] = struct{}{}
	fs.mu.Unlock()
	return f
}

func (fs *flights) remove(f *flight) {
	fs.mu.Lock()
	delete(fs.set, f)
	fs.mu.Unlock()
}

func (fs *flights) hopeful(now time.Time) int {
	n := now.UnixNano()
	fs.mu.Lock()
	defer fs.mu.Unlock()
	c := 0
	for f := range fs.set {
		if f.deadline.Load() >= n {
			c++
		}
	}
	return c
}
