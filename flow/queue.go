package flow

import (
	"iter"
	"slices"
	"time"
)

// Arrival is a newcomer to a model's queue.
type Arrival struct {
	// Priority is the request's priority (contract §15): higher first.
	Priority int64
	// Tenant names whom the request is for; tenants take turns within a
	// priority ("" is a tenant too).
	Tenant string
	// Bytes is what the request holds while it waits (its body), taken
	// from the queue's Budget.
	Bytes int64
	// Admitted says whether the record would admit the request without
	// queuing.
	Admitted bool
	// MayWait is false for a request that may not wait (X-Workermon-Max-Wait:
	// 0).
	MayWait bool
	// Others is what other routers hold for the model (contract §22);
	// zero: nothing.
	Others Held
}

// Item is one queued request; Value is the caller's.
type Item[T any] struct {
	Value T

	priority int64
	tenant   string
	bytes    int64
	since    time.Time
	seq      uint64 // arrival order in the queue

	tq         *tenantQueue[T] // nil once out of the queue
	prev, next *Item[T]
}

// Priority is the item's priority.
func (it *Item[T]) Priority() int64 { return it.priority }

// Tenant is the item's tenant.
func (it *Item[T]) Tenant() string { return it.tenant }

// Bytes is what the item holds of the budget.
func (it *Item[T]) Bytes() int64 { return it.bytes }

// Since is when the item joined.
func (it *Item[T]) Since() time.Time { return it.since }

// tenantQueue is one tenant's items of one priority, first come first
// served: a list linked through the items.
type tenantQueue[T any] struct {
	name       string
	level      *level[T]
	head, tail *Item[T]
	n          int
}

// level holds the items of one priority; its tenants take turns.
type level[T any] struct {
	queue    *Queue[T] // the queue the level is of
	priority int64
	tenants  []*tenantQueue[T] // in turn order; none is empty
	next     int               // the tenant whose turn it is
	byName   map[string]*tenantQueue[T]
}

// Queue is one model's queue: its order and its limits. Not safe for
// concurrent use.
type Queue[T any] struct {
	maxRequests int
	budget      *Budget
	levels      []*level[T] // by priority, highest first; none is empty
	n           int
	bytes       int64
	seq         uint64
}

// NewQueue returns a queue that holds at most maxRequests (positive)
// requests, and takes their bytes from budget (nil: no limit on bytes).
func NewQueue[T any](maxRequests int, budget *Budget) *Queue[T] {
	return &Queue[T]{maxRequests: maxRequests, budget: budget}
}

// Len is the number of queued requests.
func (q *Queue[T]) Len() int { return q.n }

// Bytes is what the queued requests hold.
func (q *Queue[T]) Bytes() int64 { return q.bytes }

// Held is what the queue holds.
func (q *Queue[T]) Held() Held {
	if q.n == 0 {
		return Held{}
	}
	return Held{N: q.n, Top: q.levels[0].priority}
}

// CountAt is the number of queued requests of priority p.
func (q *Queue[T]) CountAt(p int64) int {
	if lvl := q.level(p); lvl != nil {
		n := 0
		for _, tq := range lvl.tenants {
			n += tq.n
		}
		return n
	}
	return 0
}

// Join queues a newcomer with value v at now. A newcomer the record admits
// goes ahead (ErrAhead) when Direct says so; one that would have to join
// but may not wait is refused (ErrNoWait). When the queue holds
// maxRequests, or the newcomer's bytes do not fit in the budget, it pushes
// out queued requests to make room, as few as needed, in this order, and is
// refused (ErrFull, nothing pushed out) when those do not make room:
//   - the requests of lower priority, the lowest priority first, the newest
//     first within a priority;
//   - then, at the newcomer's own priority, the newest request of the tenant
//     that holds the most requests there (of those, the one whose newest is
//     newer), while that tenant holds more than the newcomer's tenant.
//
// Requests of higher priority are never pushed out. Join returns the
// newcomer's item and those pushed out, already out of the queue.
func (q *Queue[T]) Join(a Arrival, v T, now time.Time) (*Item[T], []*Item[T], error) {
	if a.Admitted && Direct(a.Priority, q.Held(), a.Others) {
		return nil, nil, ErrAhead
	}
	if !a.MayWait {
		return nil, nil, ErrNoWait
	}
	victims, err := q.makeRoom(a)
	if err != nil {
		return nil, nil, err
	}
	q.seq++
	it := &Item[T]{Value: v, priority: a.Priority, tenant: a.Tenant, bytes: a.Bytes, since: now, seq: q.seq}
	q.push(it)
	return it, victims, nil
}

// makeRoom takes a's bytes from the budget, and takes out the requests that
// must leave for a to fit (their bytes go to a).
func (q *Queue[T]) makeRoom(a Arrival) ([]*Item[T], error) {
	if q.budget != nil && a.Bytes > q.budget.max {
		return nil, ErrFull
	}
	for {
		var used, needBytes int64
		if q.budget != nil {
			used = q.budget.used.Load()
			needBytes = used + a.Bytes - q.budget.max
		}
		needN := q.n + 1 - q.maxRequests
		var victims []*Item[T]
		var freed int64
		if needN > 0 || needBytes > 0 {
			var ok bool
			if victims, freed, ok = q.victims(a, needN, needBytes); !ok {
				return nil, ErrFull
			}
		}
		// Another model's queue may have taken or given back bytes since
		// the load: then plan again.
		if q.budget != nil && !q.budget.used.CompareAndSwap(used, used+a.Bytes-freed) {
			continue
		}
		for _, v := range victims {
			q.unlink(v)
		}
		return victims, nil
	}
}

// victims returns the requests that Join pushes out for a to fit: at least
// needN of them, holding at least needBytes; false when there are not
// enough that a may push out.
func (q *Queue[T]) victims(a Arrival, needN int, needBytes int64) (out []*Item[T], freed int64, ok bool) {
	enough := func() bool { return len(out) >= needN && freed >= needBytes }
	for i := len(q.levels) - 1; i >= 0 && !enough(); i-- {
		lvl := q.levels[i]
		if lvl.priority > a.Priority {
			break
		}
		// Each tenant's newest not taken yet, and how many it holds then.
		cursors := make([]*Item[T], len(lvl.tenants))
		counts := make([]int, len(lvl.tenants))
		for j, tq := range lvl.tenants {
			cursors[j], counts[j] = tq.tail, tq.n
		}
		own := 0 // the newcomer's tenant's requests at its own priority
		if tq := lvl.byName[a.Tenant]; tq != nil && lvl.priority == a.Priority {
			own = tq.n
		}
		for !enough() {
			best := -1
			for j, c := range cursors {
				switch {
				case c == nil:
				case lvl.priority == a.Priority && counts[j] <= own:
				case best < 0:
					best = j
				case lvl.priority == a.Priority && counts[j] != counts[best]:
					if counts[j] > counts[best] {
						best = j
					}
				case c.seq > cursors[best].seq:
					best = j
				}
			}
			if best < 0 {
				break
			}
			out = append(out, cursors[best])
			freed += cursors[best].bytes
			cursors[best] = cursors[best].prev
			counts[best]--
		}
	}
	return out, freed, enough()
}

// level returns the level of priority p, or nil.
func (q *Queue[T]) level(p int64) *level[T] {
	if i, found := q.find(p); found {
		return q.levels[i]
	}
	return nil
}

// find returns where the level of priority p is, or would be.
func (q *Queue[T]) find(p int64) (int, bool) {
	return slices.BinarySearchFunc(q.levels, p, func(l *level[T], p int64) int {
		switch {
		case l.priority > p:
			return -1
		case l.priority < p:
			return 1
		}
		return 0
	})
}

// push appends it to its priority and tenant; its bytes are already taken
// from the budget.
func (q *Queue[T]) push(it *Item[T]) {
	i, found := q.find(it.priority)
	if !found {
		q.levels = slices.Insert(q.levels, i, &level[T]{queue: q, priority: it.priority, byName: make(map[string]*tenantQueue[T])})
	}
	lvl := q.levels[i]
	tq := lvl.byName[it.tenant]
	if tq == nil {
		tq = &tenantQueue[T]{name: it.tenant, level: lvl}
		lvl.byName[it.tenant] = tq
		lvl.tenants = append(lvl.tenants, tq)
	}
	it.tq, it.prev = tq, tq.tail
	if tq.tail != nil {
		tq.tail.next = it
	} else {
		tq.head = it
	}
	tq.tail = it
	tq.n++
	q.n++
	q.bytes += it.bytes
}

// unlink takes it out of the queue, leaving its bytes taken from the
// budget.
func (q *Queue[T]) unlink(it *Item[T]) {
	tq := it.tq
	if it.prev != nil {
		it.prev.next = it.next
	} else {
		tq.head = it.next
	}
	if it.next != nil {
		it.next.prev = it.prev
	} else {
		tq.tail = it.prev
	}
	it.tq, it.prev, it.next = nil, nil, nil
	tq.n--
	q.n--
	q.bytes -= it.bytes
	if tq.n > 0 {
		return
	}
	lvl := tq.level
	delete(lvl.byName, tq.name)
	i := slices.Index(lvl.tenants, tq)
	lvl.tenants = slices.Delete(lvl.tenants, i, i+1)
	if i < lvl.next {
		lvl.next--
	}
	if lvl.next >= len(lvl.tenants) {
		lvl.next = 0
	}
	if len(lvl.tenants) == 0 {
		q.levels = slices.DeleteFunc(q.levels, func(l *level[T]) bool { return l == lvl })
	}
}

// Remove takes it out of the queue and gives its bytes back; false when it
// is not in the queue (popped, pushed out, removed, or of another queue).
func (q *Queue[T]) Remove(it *Item[T]) bool {
	if it.tq == nil || it.tq.level.queue != q {
		return false
	}
	q.unlink(it)
	q.budget.giveBack(it.bytes)
	return true
}

// Head returns the request to send next, nil when the queue is empty:
// highest priority, the tenant whose turn it is, first come.
func (q *Queue[T]) Head() *Item[T] {
	if q.n == 0 {
		return nil
	}
	lvl := q.levels[0]
	return lvl.tenants[lvl.next].head
}

// Pop takes the head out, gives its bytes back, and passes the turn to the
// next tenant; nil when the queue is empty.
func (q *Queue[T]) Pop() *Item[T] {
	it := q.Head()
	if it == nil {
		return nil
	}
	lvl := q.levels[0]
	turn := lvl.next
	emptied := it.tq.n == 1
	q.Remove(it)
	if !emptied && len(lvl.tenants) > 0 {
		lvl.next = (turn + 1) % len(lvl.tenants)
	}
	// An emptied tenant's removal already moved the turn to the next.
	return it
}

// All yields the queued requests by priority, highest first, then by
// tenant in turn order, then first come first. The queue must not change
// meanwhile.
func (q *Queue[T]) All() iter.Seq[*Item[T]] {
	return func(yield func(*Item[T]) bool) {
		for _, lvl := range q.levels {
			for _, tq := range lvl.tenants {
				for it := tq.head; it != nil; it = it.next {
					if !yield(it) {
						return
					}
				}
			}
		}
	}
}

// Level is what a queue holds at one priority.
type Level struct {
	Priority int64
	N        int
	// Oldest is when the oldest request of the priority joined.
	Oldest time.Time
}

// Levels appends to dst what the queue holds at each priority, highest
// first, at most limit priorities (limit ≤ 0: every one), and returns it.
func (q *Queue[T]) Levels(dst []Level, limit int) []Level {
	for i, lvl := range q.levels {
		if limit > 0 && i >= limit {
			break
		}
		l := Level{Priority: lvl.priority}
		for _, tq := range lvl.tenants {
			l.N += tq.n
			// A tenant's head is its oldest.
			if l.Oldest.IsZero() || tq.head.since.Before(l.Oldest) {
				l.Oldest = tq.head.since
			}
		}
		dst = append(dst, l)
	}
	return dst
}
