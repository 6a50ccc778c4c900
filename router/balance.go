package router

import (
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/workermon/workermon/events"
)

// Worker choice.
//
// The busy list says only which workers are free, not how loaded they are,
// so the Router adds what it knows itself: how many of its own requests each
// endpoint has in flight. Among the candidates not tried yet for the request
// it draws two at random and takes the one with fewer requests in flight (the
// first drawn on a tie): the power of two choices, which spreads load almost
// as well as always taking the least loaded, without the herd that follows
// one stale minimum when many routers share the same workers. With a single
// candidate, that one.

// maxTrackedEndpoints is how many endpoints have a counter before the idle
// ones (none in flight) are dropped.
const maxTrackedEndpoints = 4096

// loads counts the requests in flight per endpoint. Reads take no lock; a new
// endpoint copies the map under mu.
type loads struct {
	m  atomic.Pointer[map[string]*atomic.Int64]
	mu sync.Mutex
}

func (l *loads) init() { l.m.Store(&map[string]*atomic.Int64{}) }

// counter returns the endpoint's counter, creating it when needed.
func (l *loads) counter(endpoint string) *atomic.Int64 {
	if c := (*l.m.Load())[endpoint]; c != nil {
		return c
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	cur := *l.m.Load()
	if c := cur[endpoint]; c != nil {
		return c
	}
	next := make(map[string]*atomic.Int64, len(cur)+1)
	maps.Copy(next, cur)
	if len(next) >= maxTrackedEndpoints {
		maps.DeleteFunc(next, func(_ string, c *atomic.Int64) bool { return c.Load() == 0 })
	}
	c := new(atomic.Int64)
	next[endpoint] = c
	l.m.Store(&next)
	return c
}

// inFlight returns the endpoint's requests in flight.
func (l *loads) inFlight(endpoint string) int64 {
	if c := (*l.m.Load())[endpoint]; c != nil {
		return c.Load()
	}
	return 0
}

// pick chooses among the candidates whose worker is not in tried (see the
// top of this file); ok is false when every candidate was tried.
func (l *loads) pick(cands []events.WorkerEntry, tried []uint64) (events.WorkerEntry, bool) {
	n := 0
	for _, c := range cands {
		if !slices.Contains(tried, c.WorkerID) {
			n++
		}
	}
	switch n {
	case 0:
		return events.WorkerEntry{}, false
	case 1:
		return nth(cands, tried, 0), true
	}
	i := rand.IntN(n)
	j := rand.IntN(n - 1)
	if j >= i {
		j++
	}
	a, b := nth(cands, tried, i), nth(cands, tried, j)
	if l.inFlight(b.Endpoint) < l.inFlight(a.Endpoint) {
		return b, true
	}
	return a, true
}

// nth returns the i-th candidate not in tried.
func nth(cands []events.WorkerEntry, tried []uint64, i int) events.WorkerEntry {
	for _, c := range cands {
		if slices.Contains(tried, c.WorkerID) {
			continue
		}
		if i == 0 {
			return c
		}
		i--
	}
	return events.WorkerEntry{}
}
