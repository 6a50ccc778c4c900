// Package admission is the router's decision (contract §7): given a model's
// busy-set record, admit or reject a request and name the workers it may go
// to; and the HTTP middleware that answers a rejection with the contract's
// body. It reads records through the small Decider interface, which
// busylist.Watcher implements over its lock-free snapshots, so it depends
// on neither the watcher nor NATS, and never on the monitor.
//
// Users: router authors, through the Middleware or Decision.Candidates;
// workermon router (package router) for its gateway.
package admission

import (
	"errors"
	"slices"
	"time"

	"github.com/workermon/workermon/events"
)

// Sentinel errors of the package.
var (
	// ErrInvalidOption is wrapped by the constructors when an option is out
	// of range.
	ErrInvalidOption = errors.New("admission: invalid option")
	// ErrInvalidPriority is wrapped by ParsePriority when the priority
	// header is not an integer.
	ErrInvalidPriority = errors.New("admission: invalid priority")
)

// Reason says why a Decision admits or rejects.
type Reason uint8

// Reasons of a Decision (contract §7).
const (
	// ReasonFree: a fresh record with a candidate for the request's class
	// (for a standard request: not all busy); admitted, to be routed to one
	// of Decision.Free (or, for a critical request, Decision.Spare).
	ReasonFree Reason = iota + 1
	// ReasonAllBusy: a fresh record with no candidate for the request, and
	// no candidate for a standard request either (for a standard request:
	// all busy); rejected with the all-busy body of §7.
	ReasonAllBusy
	// ReasonUnknownModel: no record for the model (the monitor does not know
	// it); admitted.
	ReasonUnknownModel
	// ReasonStale: a record with no put received within stale-list-after, or
	// an updated_at older than that by the router's clock (the monitor may be
	// gone); admitted when failing open (the default), rejected otherwise.
	ReasonStale
	// ReasonNotReady: the Watcher has not loaded the bucket's initial values
	// yet; admitted when failing open, rejected otherwise.
	ReasonNotReady
	// ReasonShed: a sheddable request (contract §15) with no candidate, that
	// a standard request would have got through: every free worker is
	// amber. Rejected with the shed status and ShedMessage.
	ReasonShed
)

// String returns the reason's label: "free", "all_busy", "unknown_model",
// "stale", "not_ready" or "shed".
func (r Reason) String() string {
	switch r {
	case ReasonFree:
		return "free"
	case ReasonAllBusy:
		return "all_busy"
	case ReasonUnknownModel:
		return "unknown_model"
	case ReasonStale:
		return "stale"
	case ReasonNotReady:
		return "not_ready"
	case ReasonShed:
		return "shed"
	}
	return "none"
}

// Decision is the answer to one request.
type Decision struct {
	// Admit tells whether the request goes on.
	Admit bool
	// Reason says why.
	Reason Reason
	// Class is the request's priority class (contract §15); ClassStandard
	// for Decide.
	Class Class
	// Free, Spare and Busy are the record's lists as the request's class
	// sees them, ascending, for ReasonFree, ReasonAllBusy and ReasonShed;
	// nil otherwise (no trustworthy list: any worker may be chosen). They
	// are shared with the snapshot: read only.
	//
	// Free are the workers the request goes to first: the record's free
	// workers, without the amber ones for a sheddable request. Spare are
	// those it goes to when no worker of Free can take it: the busy workers
	// that are not hard, for a critical request only. Busy are the workers
	// it never goes to unless they are in Spare: the record's busy workers,
	// and the amber ones for a sheddable request. Free may be empty on an
	// admitted request (no busy and no free worker, only stale ones): a
	// gateway then picks among the workers not in Busy.
	Free  []uint64
	Spare []uint64
	Busy  []uint64
}

// IsBusy reports whether worker is in d.Busy: the record lists it busy (or,
// for a sheddable request, amber).
func (d Decision) IsBusy(worker uint64) bool {
	_, ok := slices.BinarySearch(d.Busy, worker)
	return ok
}

// IsFree reports whether worker is in d.Free: the record lists it free (and,
// for a sheddable request, not amber).
func (d Decision) IsFree(worker uint64) bool {
	_, ok := slices.BinarySearch(d.Free, worker)
	return ok
}

// IsSpare reports whether worker is in d.Spare: for a critical request, the
// record lists it busy but not hard.
func (d Decision) IsSpare(worker uint64) bool {
	_, ok := slices.BinarySearch(d.Spare, worker)
	return ok
}

// Candidates appends to dst the registered workers an admitted request may
// be sent to (contract §7, for a gateway, and §15 by class): those in
// d.Free; when none of them is registered, those in d.Spare (critical
// requests: busy, not hard); when none of those either, those not in
// d.Busy (for a stale or unknown record, or before the Watcher is ready:
// every registered worker). A rejected decision has no candidates.
// registered is usually Registry.Endpoints(model), sorted by worker id; the
// order is kept. dst may be a reused buffer: with enough capacity nothing
// is allocated.
func (d Decision) Candidates(dst, registered []events.WorkerEntry) []events.WorkerEntry {
	if !d.Admit {
		return dst
	}
	n := len(dst)
	for _, e := range registered {
		if d.IsFree(e.WorkerID) {
			dst = append(dst, e)
		}
	}
	if len(dst) > n {
		return dst
	}
	if len(d.Spare) > 0 {
		for _, e := range registered {
			if d.IsSpare(e.WorkerID) {
				dst = append(dst, e)
			}
		}
		if len(dst) > n {
			return dst
		}
	}
	for _, e := range registered {
		if !d.IsBusy(e.WorkerID) {
			dst = append(dst, e)
		}
	}
	return dst
}

// Outcome labels of workermon_router_admissions_total.
const (
	OutcomeAdmitted     = "admitted"      // ReasonFree
	OutcomeRejected     = "rejected"      // ReasonAllBusy
	OutcomeStaleOpen    = "stale_open"    // ReasonStale, admitted
	OutcomeStaleClosed  = "stale_closed"  // ReasonStale, rejected (fail closed)
	OutcomeUnknownModel = "unknown_model" // ReasonUnknownModel
	OutcomeNotReady     = "not_ready"     // ReasonNotReady, admitted or not
	OutcomeNoModel      = "no_model"      // the request named no model (Middleware)
	OutcomeShed         = "shed"          // ReasonShed: a sheddable request rejected with the shed status
)

// Outcome returns the decision's label in workermon_router_admissions_total.
func (d Decision) Outcome() string {
	switch d.Reason {
	case ReasonFree:
		return OutcomeAdmitted
	case ReasonAllBusy:
		return OutcomeRejected
	case ReasonStale:
		if d.Admit {
			return OutcomeStaleOpen
		}
		return OutcomeStaleClosed
	case ReasonUnknownModel:
		return OutcomeUnknownModel
	case ReasonNotReady:
		return OutcomeNotReady
	case ReasonShed:
		return OutcomeShed
	}
	return OutcomeNoModel
}

// Policy is how a router treats a list it cannot trust (contract §7).
type Policy struct {
	// StaleAfter is how long a record stays fresh: a record with no put
	// received within it, or with an updated_at older than it by the
	// router's clock, is stale (--stale-list-after).
	StaleAfter time.Duration
	// FailOpen admits requests when the list cannot be trusted: a stale
	// record, or no initial values yet.
	FailOpen bool
}

// NotReady is the decision before the bucket's initial values are in:
// ReasonNotReady, admitted when failing open.
func (p Policy) NotReady() Decision {
	return Decision{Admit: p.FailOpen, Reason: ReasonNotReady}
}

// Decide applies the router contract (§7) to one request, given the model's
// record rec (nil: none), the router's clock when it was received, and the
// router's clock now:
//
//   - no record: ReasonUnknownModel, admitted;
//   - stale record (no put received for more than StaleAfter, or an
//     updated_at older than StaleAfter by the router's clock; exactly at the
//     limit is still fresh): ReasonStale, admitted when failing open;
//   - all_busy: ReasonAllBusy, rejected;
//   - else ReasonFree, admitted, with the record's free workers.
//
// It allocates nothing; the Decision shares rec's slices.
func (p Policy) Decide(rec *events.BusySet, received, now time.Time) Decision {
	if rec == nil {
		return Decision{Admit: true, Reason: ReasonUnknownModel}
	}
	return p.DecideRecord(rec, p.Stale(rec, received, now))
}

// Stale reports whether a record received at received is stale at now, as
// Decide judges it.
func (p Policy) Stale(rec *events.BusySet, received, now time.Time) bool {
	return now.Sub(received) > p.StaleAfter || rec.UpdatedAt < now.UnixNano()-int64(p.StaleAfter)
}

// StaleAt is when a record received at received turns stale: Stale holds
// after it.
func (p Policy) StaleAt(rec *events.BusySet, received time.Time) time.Time {
	byReceipt := received.Add(p.StaleAfter)
	if byUpdate := time.Unix(0, rec.UpdatedAt).Add(p.StaleAfter); byUpdate.Before(byReceipt) {
		return byUpdate
	}
	return byReceipt
}

// DecideRecord is Decide for a record whose staleness the caller knows (a
// router that marks its records stale with a timer reads no clock per
// request). rec must not be nil.
func (p Policy) DecideRecord(rec *events.BusySet, stale bool) Decision {
	if stale {
		return Decision{Admit: p.FailOpen, Reason: ReasonStale}
	}
	if rec.AllBusy {
		return Decision{Admit: false, Reason: ReasonAllBusy, Free: rec.Free, Busy: rec.Busy}
	}
	return Decision{Admit: true, Reason: ReasonFree, Free: rec.Free, Busy: rec.Busy}
}
