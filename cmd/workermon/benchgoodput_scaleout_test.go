package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	wmbench "github.com/workermon/workermon/bench"
	"github.com/workermon/workermon/internal/syncbuf"
)

// TestBenchGoodputScaleOut runs the scale-out scenario with tiny timings
// and the real monitor, fleet and routers: it runs none, thresholds and
// resched, the last worker joins during the load, and only the resched
// row's monitor runs the rescheduler (GET /rescheduler, read before it
// closes) and its router continues cut streams. No figure is asserted: the
// machine is shared.
func TestBenchGoodputScaleOut(t *testing.T) {
	t.Parallel()
	var progress syncbuf.Buffer
	scs, err := wmbench.SelectScenarios([]string{wmbench.ScenarioScaleOut})
	if err != nil {
		t.Fatal(err)
	}
	stack := &reschedStack{goodputStack: goodputStack{log: slog.New(slog.DiscardHandler)}}
	res, err := wmbench.Goodput(t.Context(), wmbench.GoodputConfig{
		Stack:     stack,
		Quick:     true,
		Timings:   wmbench.Timings{Warmup: time.Second, Measure: time.Second, Scenario: 3 * time.Second},
		Capacity:  10,
		MaxDrain:  500 * time.Millisecond,
		Scenarios: scs,
		Seed:      7,
		Progress:  func(s string) { _, _ = progress.Write([]byte(s + "\n")) },
	})
	if err != nil {
		t.Fatalf("goodput: %v\nprogress:\n%s", err, progress.String())
	}
	var got []string
	for _, r := range res.Results {
		got = append(got, r.Policy)
		if r.Scenario != wmbench.ScenarioScaleOut || r.Routers != 1 {
			t.Errorf("row %+v: want scaleout, 1 router", r)
		}
	}
	if want := []string{wmbench.PolicyNone, wmbench.PolicyThresholds, wmbench.PolicyResched}; !slices.Equal(got, want) {
		t.Errorf("rows %v, want %v", got, want)
	}
	if n := strings.Count(progress.String(), "worker 4 joined at 1s"); n != 3 {
		t.Errorf("the last worker joined %d times, want once a row:\n%s", n, progress.String())
	}
	stack.mu.Lock()
	defer stack.mu.Unlock()
	on := 0
	for _, m := range stack.monitors {
		if m.enabled != (m.spec.Rescheduling > 0) {
			t.Errorf("a monitor with --rescheduling-interval %v: rescheduler enabled %v", m.spec.Rescheduling, m.enabled)
		}
		if m.enabled {
			on++
			if m.interval != wmbench.ReschedInterval.String() {
				t.Errorf("the rescheduler runs every %s, want %v", m.interval, wmbench.ReschedInterval)
			}
		}
	}
	if on != 1 {
		t.Errorf("%d monitors ran the rescheduler, want 1 (resched)", on)
	}
	limits := 0
	for _, lim := range stack.limits {
		if lim > 0 {
			limits++
		}
	}
	if limits != 1 {
		t.Errorf("%d routers continue cut streams, want 1 (resched's): %v", limits, stack.limits)
	}
}

// reschedStack is goodputStack that reads each monitor's GET /rescheduler
// before it closes it, and keeps each router's --migration-limit.
type reschedStack struct {
	goodputStack
	mu       sync.Mutex
	monitors []*reschedMonitor
	limits   []int
}

type reschedMonitor struct {
	*goodputMonitor
	stack    *reschedStack
	spec     wmbench.MonitorSpec
	enabled  bool
	interval string
}

func (s *reschedStack) StartMonitor(ctx context.Context, spec wmbench.MonitorSpec) (wmbench.Monitor, error) {
	m, err := s.goodputStack.StartMonitor(ctx, spec)
	if err != nil {
		return nil, err
	}
	return &reschedMonitor{goodputMonitor: m.(*goodputMonitor), stack: s, spec: spec}, nil
}

func (s *reschedStack) StartRouter(ctx context.Context, spec wmbench.RouterSpec) (wmbench.Router, error) {
	r, err := s.goodputStack.StartRouter(ctx, spec)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.limits = append(s.limits, goodputRouterOptions(spec).router.MigrationLimit)
	s.mu.Unlock()
	return r, nil
}

func (m *reschedMonitor) Close(ctx context.Context) error {
	resp, err := http.Get("http://" + m.svc.httpAddr + "/rescheduler")
	if err == nil {
		var r reschedulerReply
		if json.NewDecoder(resp.Body).Decode(&r) == nil {
			m.enabled, m.interval = r.Enabled, r.Interval
		}
		resp.Body.Close()
	}
	m.stack.mu.Lock()
	m.stack.monitors = append(m.stack.monitors, m)
	m.stack.mu.Unlock()
	return m.goodputMonitor.Close(ctx)
}
