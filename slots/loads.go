package slots

import (
	"cmp"
	"iter"
	"maps"
	"math"
	"slices"
)

// This file lists the ranks' loads and the workers: at once (Loads,
// Workers) or a page at a time (LoadPages, WorkerPages), sorted by (model,
// tenant, worker id, rank).

// compareKeys orders trackers by (model, tenant).
func compareKeys(a, b key) int {
	return cmp.Or(cmp.Compare(a.model, b.model), cmp.Compare(a.tenant, b.tenant))
}

// compareRanks orders ranks by (worker, rank).
func compareRanks(a, b rankKey) int {
	return cmp.Or(cmp.Compare(a.worker, b.worker), cmp.Compare(a.rank, b.rank))
}

// sortedKeys returns the trackers' keys sorted by (model, tenant), rebuilt
// after a tracker came or went. t.mu is held.
func (t *Tracker) sortedKeys() []key {
	if t.keys == nil && len(t.trackers) > 0 {
		t.keys = slices.SortedFunc(maps.Keys(t.trackers), compareKeys)
	}
	return t.keys
}

// keysFrom returns the sorted tracker keys from k on (the one after it
// when it went), or all of them when the cursor has not started. t.mu is held.
func (t *Tracker) keysFrom(k key, started bool) []key {
	keys := t.sortedKeys()
	if !started {
		return keys
	}
	i, _ := slices.BinarySearchFunc(keys, k, compareKeys)
	return keys[i:]
}

// rankAt compares a rank with a rank key, for a binary search of sorted ranks.
func rankAt(r rankRef, at rankKey) int { return compareRanks(r.key, at) }

// pages yields what fill appends, at most size at a time (size < 1: one),
// each listing with a cursor of its own; fill locks the tracker itself.
// The page's slice is reused: it is valid until the loop goes on.
func pages[T, C any](size int, fill func(dst []T, c *C, limit int) []T) iter.Seq[[]T] {
	size = max(size, 1)
	return func(yield func([]T) bool) {
		var c C
		page := make([]T, 0, size)
		for {
			page = fill(page[:0], &c, size)
			if len(page) == 0 || !yield(page) || len(page) < size {
				return
			}
		}
	}
}

// loadCursor is where a listing of loads stopped: at the rank at of the
// tracker k, once started.
type loadCursor struct {
	k       key
	at      rankKey
	started bool
}

// appendLoads appends the loads after c to dst, in order, at most limit
// of them (limit < 1: all), and moves c to the last one. t.mu is held.
func (t *Tracker) appendLoads(dst []Load, model, tenant string, c *loadCursor, limit int) []Load {
	n := 0
	for _, k := range t.keysFrom(c.k, c.started) {
		if !k.matches(model, tenant) {
			continue
		}
		ranks := t.trackers[k].sorted()
		j := 0
		if c.started && k == c.k {
			var found bool
			j, found = slices.BinarySearchFunc(ranks, c.at, rankAt)
			if found {
				j++
			}
		}
		for _, r := range ranks[j:] {
			if limit > 0 && n == limit {
				return dst
			}
			dst = append(dst, Load{Model: k.model, Tenant: k.tenant, WorkerID: r.key.worker, DPRank: r.key.rank,
				ActivePrefillTokens: r.prefill.value(), ActiveDecodeBlocks: uint64(len(r.blocks)),
				KVCommittedBlocks: r.committed.value(), Committed: r.committers > 0})
			c.k, c.at, c.started = k, r.key, true
			n++
		}
	}
	return dst
}

// Loads lists every registered rank's load, filtered by model and tenant
// when they are not empty, sorted by (model, tenant, worker id, rank).
func (t *Tracker) Loads(model, tenant string) []Load {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	return t.appendLoads([]Load{}, model, tenant, &loadCursor{}, 0)
}

// LoadPages yields what Loads lists, in the same order, at most size loads
// at a time (size < 1: one). The tracker is locked only while a page is
// copied, never while the caller handles it: a listing of many ranks
// written to a slow reader holds neither the lock nor more than a page of
// memory. Each page is one moment's view; the listing as a whole is not (a
// rank registered or dropped between two pages may be missing or
// listed). The page's slice is reused: it is valid until the loop goes on.
func (t *Tracker) LoadPages(model, tenant string, size int) iter.Seq[[]Load] {
	return pages(size, func(dst []Load, c *loadCursor, limit int) []Load {
		t.mu.Lock()
		defer t.mu.Unlock()
		t.expire()
		return t.appendLoads(dst, model, tenant, c, limit)
	})
}

// workerCursor is where a listing of workers stopped: at the worker id of
// the tracker k, once started.
type workerCursor struct {
	k       key
	id      uint64
	started bool
}

// appendWorkers appends the workers after c to dst, in order, at most
// limit of them (limit < 1: all), and moves c to the last one. A tracker's
// workers are found in order through its sorted ranks (every worker has
// its ranks there), a binary search a worker. t.mu is held.
func (t *Tracker) appendWorkers(dst []Worker, model, tenant string, c *workerCursor, limit int) []Worker {
	n := 0
	for _, k := range t.keysFrom(c.k, c.started) {
		if !k.matches(model, tenant) {
			continue
		}
		tr := t.trackers[k]
		ranks := tr.sorted()
		j := 0
		if c.started && k == c.k {
			if c.id == math.MaxUint64 {
				continue
			}
			j, _ = slices.BinarySearchFunc(ranks, rankKey{c.id + 1, 0}, rankAt)
		}
		for j < len(ranks) {
			if limit > 0 && n == limit {
				return dst
			}
			id := ranks[j].key.worker
			dst = append(dst, tr.workers[id])
			c.k, c.id, c.started = k, id, true
			n++
			if id == math.MaxUint64 {
				break
			}
			next, _ := slices.BinarySearchFunc(ranks[j:], rankKey{id + 1, 0}, rankAt)
			j += next
		}
	}
	return dst
}

// Workers lists the registrations, filtered by model and tenant when they
// are not empty, sorted by (model, tenant, worker id).
func (t *Tracker) Workers(model, tenant string) []Worker {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.appendWorkers([]Worker{}, model, tenant, &workerCursor{}, 0)
}

// WorkerPages yields what Workers lists, in the same order, at most size
// workers at a time (size < 1: one), as LoadPages does the loads: the
// tracker is locked only while a page is copied, each page is one moment's
// view, and the page's slice is valid until the loop goes on.
func (t *Tracker) WorkerPages(model, tenant string, size int) iter.Seq[[]Worker] {
	return pages(size, func(dst []Worker, c *workerCursor, limit int) []Worker {
		t.mu.Lock()
		defer t.mu.Unlock()
		return t.appendWorkers(dst, model, tenant, c, limit)
	})
}
