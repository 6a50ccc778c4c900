package board

import (
	"context"
	"testing"

	"github.com/workermon/workermon/events"
)

// TestMonitorSourceSLO: a model's SLO line reaches its snapshot; models
// without one have none.
func TestMonitorSourceSLO(t *testing.T) {
	t.Parallel()
	mon := &fakeMonitor{records: []events.BusySet{{Model: "a"}, {Model: "b"}}}
	src := &MonitorSource{Monitor: mon, SLOs: func(context.Context) map[string]string {
		return map[string]string{"a": "SLO itl ≤ 50 ms p90 enforce: steady"}
	}}
	snap, err := src.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Models) != 2 || snap.Models[0].SLO != "SLO itl ≤ 50 ms p90 enforce: steady" || snap.Models[1].SLO != "" {
		t.Fatalf("models %+v", snap.Models)
	}
}
