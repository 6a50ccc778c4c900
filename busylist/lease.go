package busylist

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// This file holds the pure part of the leases (contract §10): the values
// kept in the leases bucket, their keys, and the book of what a monitor has
// observed of the bucket, with the local time each key last changed. Expiry
// is by observation: a lease whose key has not changed for the TTL on the
// observer's clock is expired, on every NATS version.

// LeaseValue is a partition's lease, the JSON value of key p.<P>.<p>.
type LeaseValue struct {
	MonitorID  string `json:"monitor_id"`
	Instance   string `json:"instance"`
	Epoch      uint64 `json:"epoch"`
	AcquiredAt int64  `json:"acquired_at"`
}

// Announce is a monitor's presence, the JSON value of key m.<monitor_id>.
type Announce struct {
	MonitorID  string `json:"monitor_id"`
	Instance   string `json:"instance"`
	Partitions []int  `json:"partitions"`
	StartedAt  int64  `json:"started_at"`
}

// LeaseKey is the key of partition p's lease among n partitions.
func LeaseKey(n, p int) string { return "p." + strconv.Itoa(n) + "." + strconv.Itoa(p) }

// AnnounceKey is the key of a monitor's presence.
func AnnounceKey(monitorID string) string { return "m." + monitorID }

// parseLeaseKey splits p.<n>.<p>.
func parseLeaseKey(key string) (n, p int, ok bool) {
	rest, ok := strings.CutPrefix(key, "p.")
	if !ok {
		return 0, 0, false
	}
	ns, ps, ok := strings.Cut(rest, ".")
	if !ok {
		return 0, 0, false
	}
	n, err1 := strconv.Atoi(ns)
	p, err2 := strconv.Atoi(ps)
	if err1 != nil || err2 != nil || n < 1 || p < 0 || p >= n {
		return 0, 0, false
	}
	return n, p, true
}

// leaseSeen is one observed key.
type leaseSeen struct {
	rev   uint64
	seen  time.Time // observer's clock when rev was first seen
	lease LeaseValue
	ann   Announce
	mark  bool // met during the current full sync
}

// leaseBook is what a monitor has observed of the leases bucket. Only its
// owner's goroutines use it, under the Leaser's lock.
type leaseBook struct {
	parts    int
	self     string // this monitor's id
	instance string // this process's nonce

	leases   map[int]*leaseSeen    // partition → its lease key
	monitors map[string]*leaseSeen // monitor id → its announce key
	// foreign are the lease keys of another partition count in the bucket,
	// as last observed: added on a put, removed on a delete, by a full sync
	// that does not meet them, and by sweep once the bucket's max age has
	// passed since they were seen.
	foreign map[string]*leaseSeen
	// dupe is the announce of another process that announced this
	// monitor's id since the last takeDupe, seen live (not in a full sync).
	dupe *Announce
	// top is the highest lease epoch ever observed for each partition,
	// kept when its key goes: a lease re-created after its key disappeared
	// (the bucket's max age passed during an outage, a purge, a recreated
	// bucket) still gets a higher epoch than any before it.
	top map[int]uint64
	// syncing is true between a reset and the publish that ends it.
	syncing bool
}

func newLeaseBook(parts int, self, instance string) *leaseBook {
	return &leaseBook{parts: parts, self: self, instance: instance,
		leases: make(map[int]*leaseSeen), monitors: make(map[string]*leaseSeen),
		foreign: make(map[string]*leaseSeen), top: make(map[int]uint64)}
}

// reset begins a full sync: keys not met before the next publish are gone.
func (b *leaseBook) reset() {
	b.syncing = true
	for _, s := range b.leases {
		s.mark = false
	}
	for _, m := range []map[string]*leaseSeen{b.monitors, b.foreign} {
		for _, s := range m {
			s.mark = false
		}
	}
}

// publish ends a full sync.
func (b *leaseBook) publish() {
	if !b.syncing {
		return
	}
	b.syncing = false
	maps.DeleteFunc(b.leases, func(_ int, s *leaseSeen) bool { return !s.mark })
	maps.DeleteFunc(b.monitors, func(_ string, s *leaseSeen) bool { return !s.mark })
	maps.DeleteFunc(b.foreign, func(_ string, s *leaseSeen) bool { return !s.mark })
}

// sweep forgets the keys seen more than maxAge ago: the server has removed
// them by then (the bucket's max age counts from their put, which came
// before they were seen), without a delete that a watch would deliver.
func (b *leaseBook) sweep(now time.Time, maxAge time.Duration) {
	old := func(s *leaseSeen) bool { return now.Sub(s.seen) > maxAge }
	maps.DeleteFunc(b.leases, func(_ int, s *leaseSeen) bool { return old(s) })
	maps.DeleteFunc(b.monitors, func(_ string, s *leaseSeen) bool { return old(s) })
	maps.DeleteFunc(b.foreign, func(_ string, s *leaseSeen) bool { return old(s) })
}

// foreignKey returns a lease key of another partition count in the
// bucket (the first in order), or "" when there is none.
func (b *leaseBook) foreignKey() string {
	if len(b.foreign) == 0 {
		return ""
	}
	return slices.Min(slices.Collect(maps.Keys(b.foreign)))
}

// takeDupe returns the announce of another process seen announcing this
// monitor's id since the last call (nil when none), and forgets it.
func (b *leaseBook) takeDupe() *Announce {
	d := b.dupe
	b.dupe = nil
	return d
}

// forget drops partition p's lease as observed at revision rev: its key is
// known to be gone (read back as not found) although no delete was seen, as
// when the bucket's max age removed it during an outage. A later revision
// seen meanwhile is kept.
func (b *leaseBook) forget(p int, rev uint64) {
	if s := b.leases[p]; s != nil && s.rev <= rev {
		delete(b.leases, p)
	}
}

// apply records one entry of the bucket seen at now. An entry whose revision
// was seen before keeps its first sighting: a re-watch does not make an old
// lease look fresh.
func (b *leaseBook) apply(e jetstream.KeyValueEntry, now time.Time) error {
	key := e.Key()
	del := e.Operation() != jetstream.KeyValuePut
	if id, ok := strings.CutPrefix(key, "m."); ok {
		if del {
			delete(b.monitors, id)
			return nil
		}
		var a Announce
		if err := json.Unmarshal(e.Value(), &a); err != nil || a.MonitorID != id {
			delete(b.monitors, id)
			return fmt.Errorf("busylist: bad monitor announce %s: %v", key, err)
		}
		s := b.monitors[id]
		if s == nil || s.rev != e.Revision() {
			// Another process announcing this id now: alive. An announce met
			// in a full sync may be a dead process's last one, and is not
			// counted.
			if id == b.self && a.Instance != b.instance && !b.syncing {
				b.dupe = &a
			}
			s = &leaseSeen{rev: e.Revision(), seen: now, ann: a}
			b.monitors[id] = s
		}
		s.mark = true
		return nil
	}
	n, p, ok := parseLeaseKey(key)
	if !ok {
		return fmt.Errorf("busylist: unexpected key %q in the leases bucket", key)
	}
	if n != b.parts {
		if del {
			delete(b.foreign, key)
			return nil
		}
		s := b.foreign[key]
		if s == nil || s.rev != e.Revision() {
			s = &leaseSeen{rev: e.Revision(), seen: now}
			b.foreign[key] = s
		}
		s.mark = true
		return nil
	}
	if del {
		delete(b.leases, p)
		return nil
	}
	var v LeaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		// An unreadable lease still holds its key: it expires like any other.
		v = LeaseValue{}
	}
	s := b.leases[p]
	if s == nil || s.rev != e.Revision() {
		s = &leaseSeen{rev: e.Revision(), seen: now, lease: v}
		b.leases[p] = s
	}
	s.mark = true
	b.top[p] = max(b.top[p], v.Epoch)
	return nil
}

// live counts the monitors whose announce changed within ttl of now,
// this one included.
func (b *leaseBook) live(now time.Time, ttl time.Duration) int {
	n := 1
	for id, s := range b.monitors {
		if id != b.self && now.Sub(s.seen) < ttl {
			n++
		}
	}
	return n
}

// free returns the partitions that may be taken at now: those without a
// lease, then those whose lease has not changed for ttl, each with the
// revision a compare-and-set must name (0: create) and the highest lease
// epoch observed for it (the expired lease's, or an earlier one's when its
// key went). held are the partitions not to take (this monitor's).
func (b *leaseBook) free(now time.Time, ttl time.Duration, held func(int) bool) []leaseCandidate {
	var absent, expired []leaseCandidate
	for p := range b.parts {
		if held(p) {
			continue
		}
		s := b.leases[p]
		switch {
		case s == nil:
			absent = append(absent, leaseCandidate{p: p, epoch: b.top[p]})
		case now.Sub(s.seen) >= ttl:
			expired = append(expired, leaseCandidate{p: p, rev: s.rev, epoch: max(s.lease.Epoch, b.top[p])})
		}
	}
	return slices.Concat(absent, expired)
}

// leaseCandidate is a partition that may be taken.
type leaseCandidate struct {
	p     int
	rev   uint64 // 0: no key, create it
	epoch uint64 // highest lease epoch observed for the partition
}

// fairShare is the most partitions one of live monitors takes.
func fairShare(parts, live int) int {
	return (parts + live - 1) / max(live, 1)
}
