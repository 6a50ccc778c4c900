package main

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/workermon/workermon/events"
)

// Lease is a partition's lease as the checker read it.
type Lease struct {
	Monitor string
	Epoch   uint64
	Age     time.Duration // since the key last changed (server time of the put)
}

// Snapshot is what the final state is judged on (contract §20): the
// leases, the monitors' announces and what each monitor says it holds,
// the latest records, the fleet.
type Snapshot struct {
	Now        time.Time
	Partitions int
	LeaseTTL   time.Duration
	Heartbeat  time.Duration
	Leases     map[int]Lease            // partition → lease
	Announces  map[string]time.Duration // monitor id → age of its announce
	Held       map[string][]int         // monitor id → partitions it says it holds (/partitions); absent when it did not answer
	Down       map[string]bool          // monitors the driver has down (killed, paused, cut)
	Monitors   []string                 // every monitor of the stack: each one not down must be live
	Records    map[string]events.BusySet
	Models     []string // the models whose records must be there
	Fleet      *Fleet
}

// Final says whether s is a final state: every monitor that is not down
// live again (its announce fresh, its /partitions answering), every
// partition held by one live monitor, none holding more than ceil(P / live monitors), every record
// fresh, written by its partition's holder under the lease's epoch, and
// equal to what the fleet's reports make it. It returns why not.
func (s Snapshot) Final() (bool, string) {
	var why []string
	live := map[string]bool{}
	for id, age := range s.Announces {
		if age < s.LeaseTTL && !s.Down[id] {
			if _, answered := s.Held[id]; answered {
				live[id] = true
			}
		}
	}
	if len(live) == 0 {
		return false, "no live monitor"
	}
	for _, id := range s.Monitors {
		if !s.Down[id] && !live[id] {
			age, ok := s.Announces[id]
			_, answered := s.Held[id]
			why = append(why, fmt.Sprintf("%s not live yet (announce %v ago: %v, answers /partitions: %v)", id, age.Round(time.Millisecond), ok, answered))
		}
	}
	share := (s.Partitions + len(live) - 1) / len(live)
	count := map[string]int{}
	for p := range s.Partitions {
		l, ok := s.Leases[p]
		switch {
		case !ok:
			why = append(why, fmt.Sprintf("partition %d has no lease", p))
			continue
		case !live[l.Monitor]:
			why = append(why, fmt.Sprintf("partition %d held by %s, not live", p, l.Monitor))
			continue
		case l.Age >= s.LeaseTTL:
			why = append(why, fmt.Sprintf("partition %d: lease of %s not renewed for %v", p, l.Monitor, l.Age.Round(time.Millisecond)))
		}
		count[l.Monitor]++
		var holders []string
		for id, held := range s.Held {
			if slices.Contains(held, p) {
				holders = append(holders, id)
			}
		}
		slices.Sort(holders)
		if len(holders) != 1 || holders[0] != l.Monitor {
			why = append(why, fmt.Sprintf("partition %d leased to %s, held by %v", p, l.Monitor, holders))
		}
	}
	for id, n := range count {
		if n > share {
			why = append(why, fmt.Sprintf("%s holds %d partitions, more than ceil(%d/%d) = %d", id, n, s.Partitions, len(live), share))
		}
	}
	for _, model := range s.Models {
		rec, ok := s.Records[events.ModelKey(model)]
		if !ok {
			why = append(why, model+": no record")
			continue
		}
		p := events.Partition(model, s.Partitions)
		age := s.Now.Sub(time.Unix(0, rec.UpdatedAt))
		if age > 2*s.Heartbeat {
			why = append(why, fmt.Sprintf("%s: record %v old", model, age.Round(time.Millisecond)))
		}
		if l, ok := s.Leases[p]; ok && (rec.MonitorID != l.Monitor || rec.Epoch != l.Epoch) {
			why = append(why, fmt.Sprintf("%s: record by %s epoch %d, partition %d leased to %s epoch %d",
				model, rec.MonitorID, rec.Epoch, p, l.Monitor, l.Epoch))
		}
		if d := s.Fleet.Check(rec, s.Now); d != "" {
			why = append(why, model+": "+d)
		}
	}
	slices.Sort(why)
	return len(why) == 0, strings.Join(why, "; ")
}
