package router

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestLatencyCountsLoseNothing: rejections and queued requests counted
// while windows are drained all land in some window. A count between a
// window's read and its reset was in none, and so was one on a model the
// drain was forgetting as idle (the counter taken from the old map); the
// drain now takes each count in one swap, and forgets an idle model only
// by marking its counters, which sends a late count to a fresh one.
func TestLatencyCountsLoseNothing(t *testing.T) {
	t.Parallel()
	var b latencyBook
	b.on.Store(true)
	models := []string{"a", "b", "c", "d"}
	const counters, perCounter = 4, 100000
	one := func(string) []uint64 { return []uint64{1} }
	var rejected, queued atomic.Uint64 // what the windows carried
	sum := func(now time.Time) {
		for _, r := range b.drain("router/r", time.Second, now, one) {
			rejected.Add(r.Rejected)
			queued.Add(r.Queued)
		}
	}
	var wg sync.WaitGroup
	for i := range counters {
		wg.Go(func() {
			for j := range perCounter {
				// Bursts with gaps, so that models go idle and are
				// forgotten while others still count on them.
				m := models[(i+j/64)%len(models)]
				b.reject(m)
				if j%3 == 0 {
					b.queue(m)
				}
			}
		})
	}
	done := make(chan struct{})
	var drains sync.WaitGroup
	drains.Go(func() {
		now := time.Unix(1, 0)
		for {
			select {
			case <-done:
				return
			default:
			}
			now = now.Add(time.Second)
			sum(now)
		}
	})
	wg.Wait()
	close(done)
	drains.Wait()
	sum(time.Unix(1e9, 0)) // what the last window holds
	wantQ := uint64(counters * ((perCounter + 2) / 3))
	if got := rejected.Load(); got != counters*perCounter {
		t.Errorf("windows carried %d rejections, want %d", got, counters*perCounter)
	}
	if got := queued.Load(); got != wantQ {
		t.Errorf("windows carried %d queued requests, want %d", got, wantQ)
	}
}
