package kvwatch

import (
	"maps"
	"sync/atomic"
)

// State is the copy-on-write state of a watched bucket: the published,
// immutable map behind an atomic pointer (nil until the initial values are
// in), and the pending copy the loop's goroutine applies changes to.
//
// Load may be called from any goroutine; every other method belongs to the
// loop's goroutine (the Sink's methods).
type State[V any] struct {
	cur     atomic.Pointer[map[string]V]
	pending map[string]V // owned by the loop's goroutine
}

// Load returns the published map, nil before the first Publish. It takes no
// lock and allocates nothing. The map is immutable: read only.
func (s *State[V]) Load() map[string]V {
	if p := s.cur.Load(); p != nil {
		return *p
	}
	return nil
}

// View returns the loop's current view: pending changes if any, else the
// published map.
func (s *State[V]) View() map[string]V {
	if s.pending != nil {
		return s.pending
	}
	return s.Load()
}

// Reset starts a full re-watch: changes now build a new map from nothing.
func (s *State[V]) Reset() {
	s.pending = make(map[string]V)
}

// Edit returns the pending map, copying the published one on the first
// change since the last Publish.
func (s *State[V]) Edit() map[string]V {
	if s.pending == nil {
		s.pending = maps.Clone(s.Load())
		if s.pending == nil {
			s.pending = make(map[string]V)
		}
	}
	return s.pending
}

// Remove deletes k, copying the published map only when k is in it.
func (s *State[V]) Remove(k string) {
	if _, ok := s.View()[k]; ok {
		delete(s.Edit(), k)
	}
}

// Publish makes the pending changes visible in one store and returns the
// number of keys published.
func (s *State[V]) Publish() int {
	if s.pending != nil {
		m := s.pending
		s.pending = nil
		s.cur.Store(&m)
	}
	return len(s.Load())
}
