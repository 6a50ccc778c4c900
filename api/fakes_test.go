package api

import (
	"context"
	"maps"
	"slices"
	"sync"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
)

// The real types implement the interfaces the API declares.
var (
	_ Monitor = (*monitor.Monitor)(nil)
	_ Store   = (*overrides.ThresholdStore)(nil)
)

// fakeMonitor is a Monitor that keeps what it is told.
type fakeMonitor struct {
	mu        sync.Mutex
	defaults  events.Thresholds
	seen      map[string]bool
	overrides map[string]events.Thresholds
	records   []events.BusySet
	workers   []monitor.WorkerRow
	loads     []monitor.LoadRow
	err       error
	sets      []setCall
}

type setCall struct {
	model string
	t     *events.Thresholds
}

func newFakeMonitor(defaults events.Thresholds, seen ...string) *fakeMonitor {
	m := &fakeMonitor{defaults: defaults, seen: map[string]bool{}, overrides: map[string]events.Thresholds{}}
	for _, s := range seen {
		m.seen[s] = true
	}
	return m
}

func (m *fakeMonitor) Known(_ context.Context, model string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, over := m.overrides[model]
	return m.seen[model] || over, m.err
}

func (m *fakeMonitor) Thresholds(context.Context) (map[string]events.Thresholds, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]events.Thresholds{}
	for _, name := range append(slices.Collect(maps.Keys(m.seen)), slices.Collect(maps.Keys(m.overrides))...) {
		out[name] = m.defaults.Merge(m.overrides[name])
	}
	return out, m.err
}

func (m *fakeMonitor) SetOverride(_ context.Context, model string, t *events.Thresholds) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return m.err
	}
	m.sets = append(m.sets, setCall{model, t})
	if t == nil {
		delete(m.overrides, model)
	} else {
		m.overrides[model] = *t
	}
	return nil
}

func (m *fakeMonitor) Records(_ context.Context, model string) ([]events.BusySet, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return ofModel(m.records, model, func(r events.BusySet) string { return r.Model }), m.err
}

func (m *fakeMonitor) Workers(_ context.Context, model string) ([]monitor.WorkerRow, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return ofModel(m.workers, model, func(r monitor.WorkerRow) string { return r.Model }), m.err
}

func (m *fakeMonitor) Loads(_ context.Context, model string) ([]monitor.LoadRow, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return ofModel(m.loads, model, func(r monitor.LoadRow) string { return r.Model }), m.err
}

// ofModel returns the rows of model, every row when model is "" (nil when
// none matches).
func ofModel[T any](rows []T, model string, modelOf func(T) string) []T {
	var out []T
	for _, r := range rows {
		if model == "" || modelOf(r) == model {
			out = append(out, r)
		}
	}
	return out
}

// fakeStore is a Store in memory.
type fakeStore struct {
	mu      sync.Mutex
	m       map[string]events.Thresholds
	bad     map[string]bool // models whose stored value is not a valid override
	err     error           // returned by every call
	merges  int
	deletes int
}

func newFakeStore() *fakeStore {
	return &fakeStore{m: map[string]events.Thresholds{}, bad: map[string]bool{}}
}

func (s *fakeStore) Get(_ context.Context, model string) (events.Thresholds, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return events.Thresholds{}, false, s.err
	}
	if s.bad[model] {
		return events.Thresholds{}, true, overrides.ErrBadOverride
	}
	t, ok := s.m[model]
	return t, ok, nil
}

func (s *fakeStore) Merge(_ context.Context, model string, patch events.Thresholds) (events.Thresholds, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return events.Thresholds{}, s.err
	}
	s.merges++
	next := s.m[model].Merge(patch)
	s.m[model] = next
	delete(s.bad, model)
	return next, nil
}

func (s *fakeStore) Delete(_ context.Context, model string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	s.deletes++
	delete(s.m, model)
	delete(s.bad, model)
	return nil
}

func (s *fakeStore) List(context.Context) (map[string]events.Thresholds, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	return maps.Clone(s.m), nil
}

func (s *fakeStore) override(model string) (events.Thresholds, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.m[model]
	return t, ok
}
