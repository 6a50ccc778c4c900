package main

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/workermon/workermon/events"
)

// Violation is one thing the checker found wrong.
type Violation struct {
	At   time.Time `json:"at"`
	Rule string    `json:"rule"`
	What string    `json:"what"`
	// Fault is the fault the violation happened around (0: none), and
	// Inconclusive says that the host's CPU stayed above 90 % around it
	// (contract §20): counted apart, not failed.
	Fault        int  `json:"fault,omitempty"`
	Inconclusive bool `json:"inconclusive,omitempty"`
}

// The rules of contract §20.
const (
	RuleEpoch    = "epoch-seq"     // a record's epoch went down, or its seq did not rise within an epoch
	RuleFailOpen = "fail-open"     // a record older than stale-list-after while a monitor was alive
	RuleRecovery = "no-final"      // no final state within 20 s of a fault's healing
	RuleLost     = "lost-final"    // no final state for over 20 s between faults
	RuleAnswer   = "router-answer" // an answer other than 200, 429, 503 or the client's cancellation
	RuleGrowth   = "growth"        // heap or goroutines above 1.5× their value after the first minute
)

// recordKey is what the checker keeps of one model's records.
type recordKey struct {
	// the last record checked for epoch and seq, by revision
	rev   uint64
	epoch uint64
	seq   uint64
	mon   string
	// the newest record seen (by revision)
	latest    events.BusySet
	latestRev uint64
	// the updated_at values seen, to find the gaps between puts
	lastUpdated int64
	// open fail-open window: since when the record has been stale
	gaps []Window
}

// Window is a stretch during which a model's record was older than
// stale-list-after: routers failed open.
type Window struct {
	Model string        `json:"model"`
	Start time.Time     `json:"start"`
	Len   time.Duration `json:"length_ns"`
	// Blind: the checker could not read the bucket for part of it.
	Blind bool `json:"blind,omitempty"`
}

// Records checks the busy bucket's records (contract §6, §10): epochs
// never down, seq rising within an epoch, and the gaps between puts.
type Records struct {
	staleListAfter time.Duration

	mu      sync.Mutex
	keys    map[string]*recordKey
	out     []Violation
	windows []Window
}

func newRecords(staleListAfter time.Duration) *Records {
	return &Records{staleListAfter: staleListAfter, keys: map[string]*recordKey{}}
}

// Observe takes one record of key at revision rev, seen at now (by the
// watch or a read). Entries are checked in revision order: one at or
// below the last checked revision is a repeat (a read after the watch, a
// re-watch) and only counts for the gaps.
func (r *Records) Observe(key string, rev uint64, rec events.BusySet, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := r.keys[key]
	if k == nil {
		k = &recordKey{}
		r.keys[key] = k
	}
	if rev > k.rev {
		if k.rev != 0 {
			switch {
			case rec.Epoch < k.epoch:
				r.out = append(r.out, Violation{At: now, Rule: RuleEpoch, What: fmt.Sprintf(
					"%s: epoch went down from %d (%s, seq %d, rev %d) to %d (%s, seq %d, rev %d)",
					key, k.epoch, k.mon, k.seq, k.rev, rec.Epoch, rec.MonitorID, rec.Seq, rev)})
			case rec.Epoch == k.epoch && rec.Seq <= k.seq:
				r.out = append(r.out, Violation{At: now, Rule: RuleEpoch, What: fmt.Sprintf(
					"%s: seq did not rise within epoch %d: %d (%s, rev %d) then %d (%s, rev %d)",
					key, rec.Epoch, k.seq, k.mon, k.rev, rec.Seq, rec.MonitorID, rev)})
			}
		}
		k.rev, k.epoch, k.seq, k.mon = rev, rec.Epoch, rec.Seq, rec.MonitorID
	}
	if rev > k.latestRev {
		k.latest, k.latestRev = rec, rev
	}
	r.updated(key, k, rec.UpdatedAt)
}

// updated notes an updated_at seen: a gap longer than stale-list-after
// since the previous one was a fail-open window.
func (r *Records) updated(key string, k *recordKey, at int64) {
	if at <= k.lastUpdated {
		return
	}
	if k.lastUpdated != 0 {
		gap := time.Duration(at - k.lastUpdated)
		if gap > r.staleListAfter {
			r.windows = append(r.windows, Window{Model: key,
				Start: time.Unix(0, k.lastUpdated).Add(r.staleListAfter), Len: gap - r.staleListAfter})
		}
	}
	k.lastUpdated = at
}

// Deleted notes a delete marker of key at rev: a marker carries no
// epoch, so it only moves the last checked revision on.
func (r *Records) Deleted(key string, rev uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := r.keys[key]
	if k == nil {
		return
	}
	if rev > k.rev {
		k.rev = rev
	}
}

// Latest returns the newest record of each key.
func (r *Records) Latest() map[string]events.BusySet {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]events.BusySet, len(r.keys))
	for key, k := range r.keys {
		if k.latestRev != 0 {
			out[key] = k.latest
		}
	}
	return out
}

// Close ends the run at now: a record stale at the end is a window still
// open. It returns the violations of epochs and seqs, and the windows.
func (r *Records) Close(now time.Time) ([]Violation, []Window) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, key := range slices.Sorted(maps.Keys(r.keys)) {
		k := r.keys[key]
		if k.lastUpdated != 0 && now.Sub(time.Unix(0, k.lastUpdated)) > r.staleListAfter {
			start := time.Unix(0, k.lastUpdated).Add(r.staleListAfter)
			r.windows = append(r.windows, Window{Model: key, Start: start, Len: now.Sub(start)})
		}
	}
	return slices.Clone(r.out), slices.Clone(r.windows)
}
