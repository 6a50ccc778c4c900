package board

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/monitor"
)

// TestMonitorSourceLeading: the monitor's board carries what the monitor
// derives per rank (contract §21) — the prefill rate, the predicted queue
// delay and the preemption rate, rounded to what the page shows, null while
// unknown — with the model's queue-delay threshold, and the record's
// saturation per model.
func TestMonitorSourceLeading(t *testing.T) {
	t.Parallel()
	th := events.Thresholds{KVCommitted: events.Ptr(1.0), QueueDelayMs: events.Ptr[uint64](500)}
	mon := &fakeMonitor{
		records: []events.BusySet{
			{Model: "a", Busy: []uint64{1}, Free: []uint64{2}, Reasons: map[string]string{"1": "queue_delay"},
				Thresholds: th, Saturation: 0.74},
			{Model: "b", Free: []uint64{3}},
		},
		loads: []monitor.LoadRow{
			{Model: "a", WorkerID: 1, DPRank: 0, ActivePrefillTokens: 4000, Busy: true, Reason: "queue_delay",
				PrefillRate: events.Ptr(6012.4), QueueDelayMs: events.Ptr(665.29), PreemptionRate: events.Ptr(1.0 / 3)},
			// Rate unknown: no prefilled_tokens yet.
			{Model: "a", WorkerID: 2, DPRank: 0, ActivePrefillTokens: 10},
			{Model: "b", WorkerID: 3, DPRank: 0, PrefillRate: events.Ptr(99.5), QueueDelayMs: events.Ptr(0.0),
				PreemptionRate: events.Ptr(0.0)},
		},
	}
	snap, err := (&MonitorSource{Monitor: mon}).Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Models) != 2 {
		t.Fatalf("models %+v", snap.Models)
	}
	a, b := snap.Models[0], snap.Models[1]
	if a.Saturation == nil || *a.Saturation != 0.74 || b.Saturation == nil || *b.Saturation != 0 {
		t.Errorf("saturations %v, %v: want 0.74 and 0", a.Saturation, b.Saturation)
	}
	want := [][]Rank{
		{{Rank: 0, Prefill: 4000, Busy: true, Reason: "queue_delay", DelayLimit: events.Ptr[uint64](500),
			PrefillRate: events.Ptr(6012.0), QueueDelayMs: events.Ptr(665.0), PreemptionRate: events.Ptr(0.33)}},
		{{Rank: 0, Prefill: 10, DelayLimit: events.Ptr[uint64](500)}},
	}
	for i, w := range a.Workers {
		if !reflect.DeepEqual(w.Ranks, want[i]) {
			g, _ := json.Marshal(w.Ranks)
			x, _ := json.Marshal(want[i])
			t.Errorf("worker %d's ranks %s, want %s", w.ID, g, x)
		}
	}
	r := b.Workers[0].Ranks[0]
	if r.PrefillRate == nil || *r.PrefillRate != 100 || r.QueueDelayMs == nil || *r.QueueDelayMs != 0 || r.DelayLimit != nil {
		t.Errorf("b's rank %+v: want a rate of 100, a delay of 0 (known), no delay limit", r)
	}
	// What the page reads: the names of the JSON, and an unknown value left
	// out rather than sent as 0.
	js, err := json.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{`"saturation":0.74`, `"prefill_rate":6012`, `"queue_delay_ms":665`, `"preemption_rate":0.33`,
		`"delay_limit":500`, `"queue_delay_ms":0`, `{"rank":0,"kv_used":0,"kv_total":0,"prefill":10,"delay_limit":500}`} {
		if !strings.Contains(string(js), s) {
			t.Errorf("the snapshot's JSON lacks %s:\n%s", s, js)
		}
	}
}

// TestRouterSourceSaturation: a router's board shows the saturation of
// the record it holds, and none for a model it has no record of.
func TestRouterSourceSaturation(t *testing.T) {
	t.Parallel()
	src := &RouterSource{
		BusyList: &fakeBusyList{ready: true, records: map[string]events.BusySet{"a": {Model: "a", Free: []uint64{1}, Saturation: 1.25}}},
		Registry: fakeRegistry{"z": {{WorkerID: 9, Endpoint: "http://10.0.0.9:8000"}}},
	}
	snap, err := src.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Models) != 2 || snap.Models[0].Saturation == nil || *snap.Models[0].Saturation != 1.25 || snap.Models[1].Saturation != nil {
		t.Fatalf("models %+v: want a at 1.25 and z without a saturation", snap.Models)
	}
}
