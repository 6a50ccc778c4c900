package monitor

import "github.com/workermon/workermon/events"

// Sink receives the busy sets the monitor computes. Set and Delete are called
// from the monitor's loop and must not block: a Sink keeps the latest value
// per model and writes it on a goroutine of its own.
//
// Set receives the content of a record: Model, Busy, Free, Stale, AllBusy,
// Amber, Hard, Reasons, Thresholds, Routers, Saturation (a change of
// saturation alone reaches a SaturationSink instead, and no other Sink),
// QueuedBy and Queued (the routers' queues, contract §22; nil when none). The Sink fills in the writer's fields (v,
// updated_at, monitor_id, epoch, seq). The slices and map are the Sink's to
// keep: the monitor never touches them again.
type Sink interface {
	Set(set events.BusySet)
	Delete(model string)
}

// PendingSink is a Sink that can say it still holds an unwritten record of
// a model. The monitor then defers building that model's next record (a
// build copies every worker of the model) until the Sink calls
// Monitor.Kick, so that a storm of changes costs one build per write, not
// one per batch of reports. A Sink that implements it must call Kick once
// it has taken its pending records, or deferred records wait for the next
// report, command or freshness check.
type PendingSink interface {
	Sink
	// Pending reports whether a record of model given by Set has not been
	// taken for writing yet. Called from the monitor's loop; must not
	// block.
	Pending(model string) bool
}
