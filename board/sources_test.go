package board

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/slots"
)

type fakeMonitor struct {
	records []events.BusySet
	loads   []monitor.LoadRow
	err     error
}

func (f *fakeMonitor) Records(context.Context, string) ([]events.BusySet, error) {
	return f.records, f.err
}

func (f *fakeMonitor) Loads(context.Context, string) ([]monitor.LoadRow, error) {
	return f.loads, f.err
}

var testThresholds = events.Thresholds{
	ActiveDecodeBlocks:      events.Ptr(0.8),
	ActivePrefillTokens:     events.Ptr[uint64](1000),
	ActivePrefillTokensFrac: events.Ptr(0.5),
}

// recordA lists 1 busy (kv, hard), 2 cordoned, 3 free (amber), 5 free and
// 4 stale.
func recordA() events.BusySet {
	return events.BusySet{Model: "a", Busy: []uint64{1, 2}, Free: []uint64{3, 5}, Stale: []uint64{4},
		Amber: []uint64{3}, Hard: []uint64{1}, Reasons: map[string]string{"1": "kv", "2": "cordoned"},
		Thresholds: testThresholds, UpdatedAt: 1_700_000_000_123_456_789}
}

func TestMonitorSource(t *testing.T) {
	t.Parallel()
	mon := &fakeMonitor{
		records: []events.BusySet{recordA(), {Model: "b", Free: []uint64{7}}},
		loads: []monitor.LoadRow{
			{Model: "0-first", WorkerID: 1}, // a model without a record: skipped
			{Model: "a", WorkerID: 1, DPRank: 0, ActiveDecodeBlocks: 90, KVTotalBlocks: 100, ActivePrefillTokens: 10,
				MaxNumBatchedTokens: 4000, Busy: true, Reason: "kv"},
			{Model: "a", WorkerID: 1, DPRank: 1, ActiveDecodeBlocks: 85, KVTotalBlocks: 100, Busy: true, Reason: "kv"},
			{Model: "a", WorkerID: 3, DPRank: 0, ActiveDecodeBlocks: 70, KVTotalBlocks: 100, ActivePrefillTokens: 300,
				MaxNumBatchedTokens: 1000},
			{Model: "a", WorkerID: 4, DPRank: 0, Stale: true},
			{Model: "a", WorkerID: 6, DPRank: 0}, // not listed: skipped
			{Model: "b", WorkerID: 7, DPRank: 2, ActivePrefillTokens: 5},
		},
	}
	src := &MonitorSource{Monitor: mon, ID: "mon-1", Counts: func() (map[string]uint64, map[string]uint64, error) {
		return map[string]uint64{"a": 12}, map[string]uint64{"admitted": 30, "rejected": 12}, nil
	}}
	got, err := src.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	twelve, zero := uint64(12), uint64(0)
	lim1000, lim500 := uint64(1000), uint64(500)
	kv := events.Ptr(0.8)
	want := Snapshot{Kind: KindMonitor, Name: "mon-1", Admissions: map[string]uint64{"admitted": 30, "rejected": 12}, Models: []Model{
		{Name: "a", Thresholds: testThresholds, Rejected: &twelve, Saturation: events.Ptr(0.0),
			Counts: Counts{Busy: 2, Free: 2, Stale: 1, Cordoned: 1, Amber: 1, Hard: 1},
			Workers: []Worker{
				{ID: 1, State: StateBusy, Level: LevelHard, Reason: "kv", Ranks: []Rank{
					{Rank: 0, KVUsed: 90, KVTotal: 100, KVThreshold: kv, Prefill: 10, PrefillLimit: &lim1000, Busy: true, Reason: "kv"},
					{Rank: 1, KVUsed: 85, KVTotal: 100, KVThreshold: kv, PrefillLimit: &lim1000, Busy: true, Reason: "kv"},
				}},
				{ID: 2, State: StateCordoned, Reason: "cordoned"},
				{ID: 3, State: StateFree, Level: LevelAmber, Ranks: []Rank{
					{Rank: 0, KVUsed: 70, KVTotal: 100, KVThreshold: kv, Prefill: 300, PrefillLimit: &lim500},
				}},
				{ID: 4, State: StateStale, Ranks: []Rank{{Rank: 0, KVThreshold: kv, PrefillLimit: &lim1000, Stale: true}}},
				{ID: 5, State: StateFree},
			}},
		{Name: "b", Rejected: &zero, Counts: Counts{Free: 1}, Saturation: events.Ptr(0.0),
			Workers: []Worker{{ID: 7, State: StateFree, Ranks: []Rank{{Rank: 2, Prefill: 5}}}}},
	}}
	if !reflect.DeepEqual(got, want) {
		g, _ := json.MarshalIndent(got, "", " ")
		w, _ := json.MarshalIndent(want, "", " ")
		t.Fatalf("snapshot\n%s\nwant\n%s", g, w)
	}

	mon.err = monitor.ErrStopped
	if _, err := src.Snapshot(t.Context()); !errors.Is(err, monitor.ErrStopped) {
		t.Fatalf("error %v, want the monitor's", err)
	}
}

type fakeBusyList struct {
	records map[string]events.BusySet
	stale   map[string]bool
	ready   bool
}

func (f *fakeBusyList) Models() []string {
	var out []string
	for m := range f.records {
		out = append(out, m)
	}
	return out
}

func (f *fakeBusyList) Record(model string) (events.BusySet, time.Time, bool) {
	r, ok := f.records[model]
	return r, time.Time{}, ok
}

func (f *fakeBusyList) Decide(model string) admission.Decision {
	if f.stale[model] {
		return admission.Decision{Admit: true, Reason: admission.ReasonStale}
	}
	if f.records[model].AllBusy {
		return admission.Decision{Reason: admission.ReasonAllBusy}
	}
	return admission.Decision{Admit: true, Reason: admission.ReasonFree}
}

func (f *fakeBusyList) Ready() bool { return f.ready }

type fakeRegistry map[string][]events.WorkerEntry

func (f fakeRegistry) Models() []string {
	var out []string
	for m := range f {
		out = append(out, m)
	}
	return out
}

func (f fakeRegistry) Endpoints(model string) []events.WorkerEntry { return f[model] }

type fakeTracker []slots.Load

func (f fakeTracker) Loads(string, string) []slots.Load { return f }

func TestRouterSource(t *testing.T) {
	t.Parallel()
	list := &fakeBusyList{ready: true, stale: map[string]bool{"a": true}, records: map[string]events.BusySet{"a": recordA(),
		"d": {Model: "d", Busy: []uint64{5}, AllBusy: true, Reasons: map[string]string{"5": "prefill"}}}}
	reg := fakeRegistry{
		"a": {{Model: "a", WorkerID: 3, Endpoint: "http://w3"}, {Model: "a", WorkerID: 9, Endpoint: "http://w9"}},
		"c": {{Model: "c", WorkerID: 1, Endpoint: "http://c1"}},
	}
	tracker := fakeTracker{ // a tracker's order is by tenant before worker: the source sorts
		{Model: "a", Tenant: "default", WorkerID: 9, DPRank: 0, ActivePrefillTokens: 1},
		{Model: "a", Tenant: "other", WorkerID: 3, DPRank: 0, ActivePrefillTokens: 40, ActiveDecodeBlocks: 2},
		{Model: "a", Tenant: "default", WorkerID: 3, DPRank: 0, ActivePrefillTokens: 60, ActiveDecodeBlocks: 3},
		{Model: "c", Tenant: "default", WorkerID: 1, DPRank: 1, ActivePrefillTokens: 7},
		{Model: "z", Tenant: "default", WorkerID: 1, DPRank: 0},
	}
	src := &RouterSource{BusyList: list, Registry: reg, Tracker: tracker, ID: "r1",
		Counts: func() (map[string]uint64, map[string]uint64, error) {
			return map[string]uint64{"c": 4}, map[string]uint64{"rejected": 4}, nil
		},
		Queues: func() (map[string]uint64, error) { return map[string]uint64{"d": 7}, nil }}
	got, err := src.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	zero, four, seven := uint64(0), uint64(4), uint64(7)
	lim1000 := uint64(1000)
	kv := events.Ptr(0.8)
	want := Snapshot{Kind: KindRouter, Name: "r1", Estimates: true, Admissions: map[string]uint64{"rejected": 4}, Models: []Model{
		{Name: "a", ListStale: true, UpdatedAt: 1_700_000_000_123, Thresholds: testThresholds, Rejected: &zero, Queued: &zero,
			Saturation: events.Ptr(0.0), Counts: Counts{Busy: 2, Free: 2, Stale: 1, Cordoned: 1, Amber: 1, Hard: 1, Unlisted: 1},
			Workers: []Worker{
				{ID: 1, State: StateBusy, Level: LevelHard, Reason: "kv"},
				{ID: 2, State: StateCordoned, Reason: "cordoned"},
				{ID: 3, State: StateFree, Level: LevelAmber, Endpoint: "http://w3", Ranks: []Rank{
					{Rank: 0, KVUsed: 5, KVThreshold: kv, Prefill: 100, PrefillLimit: &lim1000}}},
				{ID: 4, State: StateStale},
				{ID: 5, State: StateFree},
				{ID: 9, State: StateUnlisted, Endpoint: "http://w9", Ranks: []Rank{
					{Rank: 0, KVThreshold: kv, Prefill: 1, PrefillLimit: &lim1000}}},
			}},
		{Name: "c", Rejected: &four, Queued: &zero, Counts: Counts{Unlisted: 1}, Workers: []Worker{
			{ID: 1, State: StateUnlisted, Endpoint: "http://c1", Ranks: []Rank{{Rank: 1, Prefill: 7}}}}},
		{Name: "d", AllBusy: true, Rejecting: true, Rejected: &zero, Queued: &seven, Counts: Counts{Busy: 1}, Saturation: events.Ptr(0.0), Workers: []Worker{
			{ID: 5, State: StateBusy, Reason: "prefill"}}},
	}}
	if !reflect.DeepEqual(got, want) {
		g, _ := json.MarshalIndent(got, "", " ")
		w, _ := json.MarshalIndent(want, "", " ")
		t.Fatalf("snapshot\n%s\nwant\n%s", g, w)
	}

	list.ready = false
	got, err = (&RouterSource{BusyList: list}).Snapshot(t.Context())
	if err != nil || got.Note == "" || got.Estimates || len(got.Models) != 2 {
		t.Fatalf("not ready: %+v, %v; want a note, no estimates, models a and d", got, err)
	}
}

// TestGatheredCounts reads the router's own admission counters.
func TestGatheredCounts(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := admission.NewMetrics(reg, 1)
	if err != nil {
		t.Fatal(err)
	}
	reject := admission.Decision{Reason: admission.ReasonAllBusy}
	admit := admission.Decision{Admit: true, Reason: admission.ReasonFree}
	m.Observe("a", reject)
	m.Observe("a", reject)
	m.Observe("b", reject) // beyond the label cap: "other"
	m.Observe("a", admit)
	rejected, outcomes, err := GatheredCounts(reg)()
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]uint64{"a": 2, "other": 1}; !reflect.DeepEqual(rejected, want) {
		t.Errorf("rejected %v, want %v", rejected, want)
	}
	if outcomes["rejected"] != 3 || outcomes["admitted"] != 1 {
		t.Errorf("outcomes %v, want 3 rejected and 1 admitted", outcomes)
	}
}

// TestGatheredQueues reads the depth of a router's queues (contract §17)
// by model, summed over the classes.
func TestGatheredQueues(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	depth := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "workermon_router_queue_depth", Help: "h"}, []string{"model", "class"})
	reg.MustRegister(depth)
	depth.WithLabelValues("a", "standard").Set(3)
	depth.WithLabelValues("a", "critical").Set(2)
	depth.WithLabelValues("b", "standard").Set(0)
	got, err := GatheredQueues(reg)()
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]uint64{"a": 5, "b": 0}; !reflect.DeepEqual(got, want) {
		t.Errorf("queued %v, want %v", got, want)
	}
}

func TestPrefillLimit(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		t          events.Thresholds
		maxBatched uint64
		want       uint64
		ok         bool
	}{
		{"off", events.Thresholds{}, 100, 0, false},
		{"tokens", events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](300)}, 0, 300, true},
		{"frac of known max", events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.5)}, 1001, 500, true},
		{"frac of unknown max", events.Thresholds{ActivePrefillTokensFrac: events.Ptr(0.001)}, 0, 10_000, true},
		{"smaller wins", events.Thresholds{ActivePrefillTokens: events.Ptr[uint64](300), ActivePrefillTokensFrac: events.Ptr(0.5)}, 1000, 300, true},
		{"huge frac", events.Thresholds{ActivePrefillTokensFrac: events.Ptr(1e300)}, 1, ^uint64(0), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, ok := PrefillLimit(tc.t, tc.maxBatched)
			if got != tc.want || ok != tc.ok {
				t.Fatalf("PrefillLimit = %d, %v; want %d, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

// BenchmarkMonitorSnapshot is one read of the board's source and its
// encoding, for a model of 200 workers of 2 ranks: the work the board does
// at most every Interval while someone watches.
func BenchmarkMonitorSnapshot(b *testing.B) {
	rec := events.BusySet{Model: "m", Thresholds: testThresholds, Reasons: map[string]string{}}
	var loads []monitor.LoadRow
	for id := uint64(1); id <= 200; id++ {
		if id%5 == 0 {
			rec.Busy = append(rec.Busy, id)
			rec.Reasons[uintKey(id)] = "kv"
		} else {
			rec.Free = append(rec.Free, id)
		}
		for rank := range uint32(2) {
			loads = append(loads, monitor.LoadRow{Model: "m", WorkerID: id, DPRank: rank, ActiveDecodeBlocks: id * 3,
				KVTotalBlocks: 1000, ActivePrefillTokens: id * 7, MaxNumBatchedTokens: 8192})
		}
	}
	src := &MonitorSource{Monitor: &fakeMonitor{records: []events.BusySet{rec}, loads: loads}}
	var size int
	for b.Loop() {
		snap, err := src.Snapshot(b.Context())
		if err != nil {
			b.Fatal(err)
		}
		data, err := json.Marshal(snap)
		if err != nil {
			b.Fatal(err)
		}
		size = len(data)
	}
	b.ReportMetric(float64(size), "bytes/event")
}
