// Package busylist is the busy-set bucket (workermon-busy, contract §6): the
// monitor side's Writer of one record per model, with its epoch and
// sequence, change detection, heartbeat re-puts and retries; beside it the
// monitor side's Leaser of partitions (bucket workermon-leases, contract
// §10), which takes, renews and gives back this monitor's partition leases
// and tells the Writer which partitions it may still write (self-fencing);
// and the router side's Watcher, which keeps every model's record in a
// lock-free immutable snapshot and answers admission decisions from it
// (package admission).
//
// Users: workermon serve (the Writer, as the monitor's Sink, and the
// Leaser); routers and workermon router (the Watcher, with admission's
// Middleware or Decision).
package busylist

import "errors"

// Sentinel errors of the package.
var (
	// ErrWatcherClosed is returned by WaitReady when the Watcher was closed
	// before its initial values arrived.
	ErrWatcherClosed = errors.New("busylist: watcher closed")
	// ErrInvalidOption is wrapped by the constructors when an option is out
	// of range.
	ErrInvalidOption = errors.New("busylist: invalid option")
	// ErrWriterRunning is returned by Writer.Run when the Writer has already
	// been run.
	ErrWriterRunning = errors.New("busylist: writer already started")
	// ErrWriterStopped is returned by the Writer's partition commands when
	// its Run has returned.
	ErrWriterStopped = errors.New("busylist: writer stopped")
)
