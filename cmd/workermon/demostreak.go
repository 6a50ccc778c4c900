package main

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// demoStreakPoll is how often the demo looks at the router's view of the
// model to time its all-busy periods.
const demoStreakPoll = 25 * time.Millisecond

// allBusyStreaks times the periods in which a model is all busy, as the
// router sees it: how many there were, the longest, and the one under way.
// It is safe for concurrent use.
type allBusyStreaks struct {
	mu      sync.Mutex
	since   time.Time // start of the period under way; zero when not all busy
	count   int
	longest time.Duration
}

// observe records whether the model is all busy at now.
func (s *allBusyStreaks) observe(now time.Time, allBusy bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case allBusy && s.since.IsZero():
		s.since = now
		s.count++
	case allBusy:
		s.longest = max(s.longest, now.Sub(s.since))
	case !s.since.IsZero():
		s.longest = max(s.longest, now.Sub(s.since))
		s.since = time.Time{}
	}
}

// current returns how long the period under way has lasted at now (0 when
// the model is not all busy).
func (s *allBusyStreaks) current(now time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.since.IsZero() {
		return 0
	}
	return now.Sub(s.since)
}

// cell renders the periods so far: "all busy 3× longest 4.2s".
func (s *allBusyStreaks) cell(now time.Time) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	longest := s.longest
	if !s.since.IsZero() {
		longest = max(longest, now.Sub(s.since))
	}
	return fmt.Sprintf("all busy %d× longest %.1fs", s.count, longest.Seconds())
}

// watch observes allBusy every poll until ctx ends.
func (s *allBusyStreaks) watch(ctx context.Context, poll time.Duration, allBusy func() bool) {
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.observe(now, allBusy())
		}
	}
}
