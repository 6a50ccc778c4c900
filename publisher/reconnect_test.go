package publisher_test

import (
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/publisher"
)

// After a server restart the publisher keeps its boot and seq and resumes
// publishing reports and refreshing its registry entry.
func TestResumesAfterServerRestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 1,
		publisher.WithEndpoint("http://engine:8000"), publisher.WithRegistryRefresh(50*time.Millisecond))
	if err := p.Update(0, load(1, 10, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	before := in.waitReport(t, func(events.LoadReport) bool { return true })
	key := events.RegistryKey("m", 1)
	_, rev := waitEntry(t, workersBucket(t, e), key, 0)

	e.srv = natstest.Restart(t, e.srv, e.opts)

	// Without a new update the state comes again (republished on reconnect,
	// or by the heartbeat if the observer reconnected later).
	again := in.waitReport(t, func(events.LoadReport) bool { return true })
	if again.BootID != before.BootID || again.Seq <= before.Seq || loadOf(again) != loadOf(before) {
		t.Errorf("after restart %+v, want boot %d, seq > %d, load %+v", again, before.BootID, before.Seq, loadOf(before))
	}
	if err := p.Update(0, load(2, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	changed := in.waitReport(t, func(r events.LoadReport) bool { return r.ActiveDecodeBlocks.Value == 2 })
	if changed.Seq <= again.Seq || changed.KVTotalBlocks != events.Some(10) {
		t.Errorf("change after restart %+v, want seq > %d, kv_total_blocks kept", changed, again.Seq)
	}
	waitEntry(t, workersBucket(t, e), key, rev)

	// Close while the new server is up (its cleanup runs before ours).
	if err := p.Close(t.Context()); err != nil {
		t.Errorf("Close: %v", err)
	}
}
