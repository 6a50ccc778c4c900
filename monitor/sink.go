package monitor

import "github.com/workermon/workermon/events"

// Sink receives the busy sets the monitor computes. Set and Delete are called
// from the monitor's loop and must not block: a Sink keeps the latest value
// per model and writes it on a goroutine of its own.
//
// Set receives the content of a record: Model, Busy, Free, Stale, AllBusy,
// Reasons and Thresholds. The Sink fills in the writer's fields (v,
// updated_at, monitor_id, epoch, seq). The slices and map are the Sink's to
// keep: the monitor never touches them again.
type Sink interface {
	Set(set events.BusySet)
	Delete(model string)
}
