package admission

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/workermon/workermon/events"
)

// This file holds the priority classes of contract §15: a request's class
// from its X-Workermon-Priority header, the per-class lists a record is
// prepared with when it arrives, and the decision by class over them.

// PriorityHeader is the request header that carries a request's priority
// (contract §15): an integer, 0 when absent; higher is more important.
const PriorityHeader = "X-Workermon-Priority"

// ShedMessage is the message of the rejection of a sheddable request that a
// standard one would have got through (contract §15).
const ShedMessage = "Service temporarily unavailable for low-priority requests: workers are near capacity, please retry later"

// DefaultShedStatus is the status of that rejection (--shed-status).
const DefaultShedStatus = http.StatusTooManyRequests

// Class is a request's priority class (contract §15). The zero value is
// ClassStandard.
type Class uint8

// Priority classes.
const (
	// ClassStandard: priority 0, the default. Candidates: the free
	// workers; rejected when the record is all_busy (contract §7).
	ClassStandard Class = iota
	// ClassSheddable: priority below 0. Candidates: the free workers that
	// are not amber.
	ClassSheddable
	// ClassCritical: priority above 0. Candidates: the free workers, then
	// the busy workers that are not hard.
	ClassCritical

	// NumClasses is the number of classes, for arrays indexed by Class.
	NumClasses = 3
)

// String returns the class's label: "standard", "sheddable" or "critical".
func (c Class) String() string {
	switch c {
	case ClassSheddable:
		return "sheddable"
	case ClassCritical:
		return "critical"
	}
	return "standard"
}

// Classes returns the classes in the order of their labels in metrics and
// summaries: sheddable, standard, critical.
func Classes() [NumClasses]Class {
	return [NumClasses]Class{ClassSheddable, ClassStandard, ClassCritical}
}

// ClassOf returns the class of a priority: below 0 sheddable, 0 standard,
// above 0 critical.
func ClassOf(priority int64) Class {
	switch {
	case priority < 0:
		return ClassSheddable
	case priority > 0:
		return ClassCritical
	}
	return ClassStandard
}

// ParsePriority returns the class of a PriorityHeader value: "" is 0
// (standard); otherwise a decimal integer, optionally signed, surrounding
// spaces ignored. An integer beyond int64 keeps its sign's class. Anything
// else wraps ErrInvalidPriority. It allocates only on error.
func ParsePriority(v string) (Class, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return ClassStandard, nil
	}
	p, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) {
			// A number, just a large one: ParseInt saturates with its sign.
			return ClassOf(p), nil
		}
		return ClassStandard, fmt.Errorf("%w: %s %.32q is not an integer", ErrInvalidPriority, PriorityHeader, v)
	}
	return ClassOf(p), nil
}

// ClassFromRequest returns the class of r from its PriorityHeader (see
// ParsePriority). The header given more than once wraps
// ErrInvalidPriority: which of its values counts is not for the router to
// guess (a proxy in between may have added one).
func ClassFromRequest(r *http.Request) (Class, error) {
	switch vs := r.Header.Values(PriorityHeader); len(vs) {
	case 0:
		return ClassStandard, nil
	case 1:
		return ParsePriority(vs[0])
	default:
		return ClassStandard, fmt.Errorf("%w: %s is given %d times; give it once", ErrInvalidPriority, PriorityHeader, len(vs))
	}
}

// ClassLists are what deciding by class needs of a record beyond its own
// lists, computed once when the record arrives (PrepareClasses), so that a
// decision allocates nothing. With the zero value every class is decided
// as a standard request: use PrepareClasses.
type ClassLists struct {
	// shed is free minus amber: a sheddable request's candidates.
	shed []uint64
	// avoid is busy plus amber: the workers a sheddable request's fallback
	// (a registered worker the record does not list) skips.
	avoid []uint64
	// spare is busy minus hard: a critical request's second choice.
	spare []uint64
	ready bool
}

// PrepareClasses computes the class lists of rec, whose lists must be
// ascending (busylist.Watcher sorts them). The lists it returns share rec's
// where they are the same; nothing is modified.
func PrepareClasses(rec *events.BusySet) ClassLists {
	return ClassLists{
		shed:  minus(rec.Free, rec.Amber),
		avoid: union(rec.Busy, rec.Amber),
		spare: minus(rec.Busy, rec.Hard),
		ready: true,
	}
}

// minus returns the ascending a without the elements of the ascending b; a
// itself when nothing is removed.
func minus(a, b []uint64) []uint64 {
	if len(b) == 0 || len(a) == 0 {
		return a
	}
	out := make([]uint64, 0, len(a))
	for _, id := range a {
		if _, ok := slices.BinarySearch(b, id); !ok {
			out = append(out, id)
		}
	}
	if len(out) == len(a) {
		return a
	}
	return out
}

// union returns the ascending union of the ascending a and b; a itself
// when b adds nothing.
func union(a, b []uint64) []uint64 {
	extra := minus(b, a)
	if len(extra) == 0 {
		return a
	}
	out := slices.Concat(a, extra)
	slices.Sort(out)
	return out
}

// DecideClassRecord is DecideRecord for a request of class c (contract §15),
// with rec's class lists cl from PrepareClasses. For a fresh record:
//
//   - standard: exactly DecideRecord (all_busy rejects);
//   - sheddable: admitted to the free workers that are not amber; when there
//     is none while some worker is busy or amber, rejected — ReasonShed
//     when a standard request would have been admitted, ReasonAllBusy when
//     not;
//   - critical: admitted to the free workers, then the busy ones that are
//     not hard; when there is none while some worker is busy, rejected
//     (ReasonAllBusy).
//
// A record with no free, busy or amber worker (only stale ones) admits every
// class, as §7 admits a standard request. A stale record is judged by the
// Policy whatever the class. It allocates nothing; the Decision shares the
// record's and cl's slices.
func (p Policy) DecideClassRecord(rec *events.BusySet, cl *ClassLists, c Class, stale bool) Decision {
	if stale {
		return Decision{Admit: p.FailOpen, Reason: ReasonStale, Class: c}
	}
	if !cl.ready || c == ClassStandard {
		// DecideRecord's answer, built in place: copying a Decision twice
		// costs more than the rest of the decision.
		return Decision{Admit: !rec.AllBusy, Reason: standardReason(rec.AllBusy), Class: c, Free: rec.Free, Busy: rec.Busy}
	}
	if c == ClassSheddable {
		d := Decision{Admit: true, Reason: ReasonFree, Class: c, Free: cl.shed, Busy: cl.avoid}
		if len(cl.shed) == 0 && len(cl.avoid) > 0 {
			d.Admit, d.Reason = false, ReasonShed
			if rec.AllBusy {
				d.Reason = ReasonAllBusy
			}
		}
		return d
	}
	d := Decision{Admit: true, Reason: ReasonFree, Class: c, Free: rec.Free, Spare: cl.spare, Busy: rec.Busy}
	if len(rec.Free) == 0 && len(cl.spare) == 0 && len(rec.Busy) > 0 {
		d.Admit, d.Reason = false, ReasonAllBusy
	}
	return d
}

// standardReason is the reason of a standard request's decision on a fresh
// record.
func standardReason(allBusy bool) Reason {
	if allBusy {
		return ReasonAllBusy
	}
	return ReasonFree
}

// ClassDecider is a Decider that also decides by priority class (contract
// §15); *busylist.Watcher is one. The Middleware uses DecideClass when its
// Decider has it.
type ClassDecider interface {
	Decider
	// DecideClass takes the decision for a request of class c for model.
	DecideClass(model string, c Class) Decision
}
