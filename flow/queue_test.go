package flow

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

var t0 = time.Unix(1_700_000_000, 0)

// testQueue is a queue of named requests, joining one millisecond apart.
type testQueue struct {
	*Queue[string]
	t     *testing.T
	now   time.Time
	items map[string]*Item[string]
}

func newTestQueue(t *testing.T, maxRequests int, budget *Budget) *testQueue {
	return &testQueue{Queue: NewQueue[string](maxRequests, budget), t: t, now: t0, items: map[string]*Item[string]{}}
}

// add joins a request that may wait, of 100 bytes, and returns the names
// of those it pushed out.
func (q *testQueue) add(name string, p int64, tenant string) []string {
	q.t.Helper()
	return q.addBytes(name, p, tenant, 100)
}

func (q *testQueue) addBytes(name string, p int64, tenant string, bytes int64) []string {
	q.t.Helper()
	victims, err := q.try(name, p, tenant, bytes)
	if err != nil {
		q.t.Fatalf("join %s: %v", name, err)
	}
	return victims
}

func (q *testQueue) try(name string, p int64, tenant string, bytes int64) ([]string, error) {
	q.now = q.now.Add(time.Millisecond)
	it, victims, err := q.Join(Arrival{Priority: p, Tenant: tenant, Bytes: bytes, MayWait: true}, name, q.now)
	if err != nil {
		return nil, err
	}
	q.items[name] = it
	var out []string
	for _, v := range victims {
		out = append(out, v.Value)
	}
	return out, nil
}

// drain pops every request and returns their names in order.
func (q *testQueue) drain() []string {
	var out []string
	for it := q.Pop(); it != nil; it = q.Pop() {
		out = append(out, it.Value)
	}
	q.checkEmpty()
	return out
}

// checkEmpty: an empty queue keeps no level, tenant or byte.
func (q *testQueue) checkEmpty() {
	q.t.Helper()
	if q.Len() != 0 || q.Bytes() != 0 || len(q.levels) != 0 || q.Head() != nil {
		q.t.Fatalf("empty queue: len %d, bytes %d, %d levels", q.Len(), q.Bytes(), len(q.levels))
	}
}

// TestQueueOrder: higher priority first; within a priority the tenants take
// turns one request at a time; first come first served within a tenant
// (contract §17).
func TestQueueOrder(t *testing.T) {
	t.Parallel()
	q := newTestQueue(t, 100, nil)
	q.add("a1", 0, "a")
	q.add("a2", 0, "a")
	q.add("a3", 0, "a")
	q.add("b1", 0, "b")
	q.add("low", -1, "a")
	q.add("high", 5, "b")
	q.add("b2", 0, "b")
	q.add("c1", 0, "c")
	var all []string
	for it := range q.All() {
		all = append(all, it.Value)
	}
	if want := []string{"high", "a1", "a2", "a3", "b1", "b2", "c1", "low"}; !slices.Equal(all, want) {
		t.Errorf("All %v, want %v", all, want)
	}
	if h := q.Held(); h.N != 8 || h.Top != 5 || q.CountAt(0) != 6 || q.CountAt(7) != 0 {
		t.Errorf("Held %+v, CountAt(0) %d", h, q.CountAt(0))
	}
	if got, want := q.drain(), []string{"high", "a1", "b1", "c1", "a2", "b2", "a3", "low"}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
}

// TestQueueRemove: a request taken out (its client gone, or its wait over)
// leaves the queue and the turn order intact, once.
func TestQueueRemove(t *testing.T) {
	t.Parallel()
	q := newTestQueue(t, 100, nil)
	q.add("a1", 0, "a")
	q.add("b1", 0, "b")
	q.add("a2", 0, "a")
	q.add("c1", 0, "c")
	q.add("c2", 0, "c")
	if !q.Remove(q.items["b1"]) || q.Remove(q.items["b1"]) {
		t.Fatal("Remove: want true once, then false")
	}
	if !q.Remove(q.items["c2"]) {
		t.Fatal("Remove c2")
	}
	if got, want := q.drain(), []string{"a1", "c1", "a2"}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
	if q.Remove(q.items["a1"]) {
		t.Fatal("Remove of a popped request: want false")
	}
}

// TestQueueRemoveOtherQueue: an item of another queue is not this queue's
// to remove: Remove says false and leaves both queues as they were (it
// used to unlink the item from its own queue and count it out of this one).
func TestQueueRemoveOtherQueue(t *testing.T) {
	t.Parallel()
	budget := NewBudget(1000)
	a, b := newTestQueue(t, 100, budget), newTestQueue(t, 100, budget)
	a.add("a1", 0, "x")
	b.add("b1", 0, "x")
	if b.Remove(a.items["a1"]) {
		t.Fatal("Remove of another queue's item: want false")
	}
	if a.Len() != 1 || b.Len() != 1 || a.Bytes() != 100 || b.Bytes() != 100 || budget.Used() != 200 {
		t.Fatalf("after a foreign Remove: lens %d, %d, bytes %d, %d, budget %d; want 1, 1, 100, 100, 200",
			a.Len(), b.Len(), a.Bytes(), b.Bytes(), budget.Used())
	}
	if got := a.drain(); !slices.Equal(got, []string{"a1"}) {
		t.Fatalf("a drains %v", got)
	}
	if got := b.drain(); !slices.Equal(got, []string{"b1"}) {
		t.Fatalf("b drains %v", got)
	}
}

// TestQueueDirect: a newcomer the record admits goes ahead only of a queue
// (its own, or other routers', contract §22) whose top priority is lower;
// otherwise it joins, or is refused when it may not wait.
func TestQueueDirect(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name       string
		p          int64
		own        []int64 // priorities queued here
		others     Held
		admitted   bool
		mayWait    bool
		want       error
		wantJoined bool
	}{
		{name: "empty, admitted", admitted: true, mayWait: true, want: ErrAhead},
		{name: "empty, rejected", mayWait: true, wantJoined: true},
		{name: "empty, rejected, may not wait", want: ErrNoWait},
		{name: "behind equal", own: []int64{0}, admitted: true, mayWait: true, wantJoined: true},
		{name: "behind higher", p: -3, own: []int64{0}, admitted: true, mayWait: true, wantJoined: true},
		{name: "ahead of lower", p: 1, own: []int64{0, -1}, admitted: true, mayWait: true, want: ErrAhead},
		{name: "ahead of lower, may not wait", p: 1, own: []int64{0}, admitted: true, want: ErrAhead},
		{name: "behind equal, may not wait", own: []int64{0}, admitted: true, want: ErrNoWait},
		{name: "others hold equal", others: Held{N: 2, Top: 0}, admitted: true, mayWait: true, wantJoined: true},
		{name: "others hold lower", p: 1, others: Held{N: 2, Top: 0}, own: []int64{-1}, admitted: true, mayWait: true, want: ErrAhead},
		{name: "others hold higher, may not wait", p: 1, others: Held{N: 1, Top: 3}, admitted: true, want: ErrNoWait},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			q := newTestQueue(t, 100, nil)
			for i, p := range c.own {
				q.add(fmt.Sprint("q", i), p, "")
			}
			it, _, err := q.Join(Arrival{Priority: c.p, Admitted: c.admitted, MayWait: c.mayWait, Others: c.others}, "new", t0)
			if !errors.Is(err, c.want) || (it != nil) != c.wantJoined {
				t.Fatalf("Join: %v, joined %v; want %v, joined %v", err, it != nil, c.want, c.wantJoined)
			}
			if n := q.Len(); n != len(c.own)+btoi(c.wantJoined) {
				t.Fatalf("len %d", n)
			}
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestQueueFull: a full queue pushes out its newest request of the lowest
// priority for a newcomer of higher priority; at the lowest priority, the
// newest request of the tenant that holds the most there, when the
// newcomer's tenant holds fewer (contract §17, issue 35 item 7); otherwise
// it turns the newcomer away.
func TestQueueFull(t *testing.T) {
	t.Parallel()
	type req struct {
		name   string
		p      int64
		tenant string
	}
	for _, c := range []struct {
		name    string
		queued  []req
		newcome req
		evicts  string // "" : the newcomer is refused
		order   []string
	}{
		{
			name:    "higher priority pushes out the lowest's newest",
			queued:  []req{{"low-old", -1, ""}, {"low-new", -1, "x"}, {"std", 0, ""}},
			newcome: req{"high", 1, ""},
			evicts:  "low-new",
			order:   []string{"high", "std", "low-old"},
		},
		{
			name:    "lower priority than every queued one is refused",
			queued:  []req{{"a", 0, ""}, {"b", 0, "x"}, {"c", 1, ""}},
			newcome: req{"low", -1, "y"},
		},
		{
			name:    "equal priority, same tenant: refused",
			queued:  []req{{"a1", 0, "a"}, {"a2", 0, "a"}, {"a3", 0, "a"}},
			newcome: req{"a4", 0, "a"},
		},
		{
			name:    "equal priority, a tenant with nothing queued pushes out the largest's newest",
			queued:  []req{{"a1", 0, "a"}, {"a2", 0, "a"}, {"a3", 0, "a"}},
			newcome: req{"b1", 0, "b"},
			evicts:  "a3",
			order:   []string{"a1", "b1", "a2"},
		},
		{
			name:    "equal priority, tenants that hold alike: refused",
			queued:  []req{{"a1", 0, "a"}, {"b1", 0, "b"}, {"a2", 0, "a"}, {"b2", 0, "b"}},
			newcome: req{"b3", 0, "b"},
		},
		{
			name:    "equal priority, the largest tenant, not the newest request",
			queued:  []req{{"a1", 0, "a"}, {"a2", 0, "a"}, {"b1", 0, "b"}, {"a3", 0, "a"}, {"b2", 0, "b"}, {"c1", 0, "c"}},
			newcome: req{"c2", 0, "c"},
			evicts:  "a3",
			order:   []string{"a1", "b1", "c1", "a2", "b2", "c2"},
		},
		{
			name:    "equal priority, of two largest tenants the one whose newest is newer",
			queued:  []req{{"a1", 0, "a"}, {"b1", 0, "b"}, {"b2", 0, "b"}, {"a2", 0, "a"}},
			newcome: req{"c1", 0, "c"},
			evicts:  "a2",
			order:   []string{"a1", "b1", "c1", "b2"},
		},
		{
			name:    "the lowest priority, not the newcomer's, gives way first",
			queued:  []req{{"low", -1, "b"}, {"a1", 0, "a"}, {"a2", 0, "a"}},
			newcome: req{"b1", 0, "b"},
			evicts:  "low",
			order:   []string{"a1", "b1", "a2"},
		},
		{
			name:    "a higher priority is never pushed out by the tenant rule",
			queued:  []req{{"a1", 1, "a"}, {"a2", 1, "a"}, {"a3", 1, "a"}},
			newcome: req{"b1", 0, "b"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			q := newTestQueue(t, len(c.queued), nil)
			for _, r := range c.queued {
				q.add(r.name, r.p, r.tenant)
			}
			victims, err := q.try(c.newcome.name, c.newcome.p, c.newcome.tenant, 100)
			if c.evicts == "" {
				if !errors.Is(err, ErrFull) || victims != nil || q.Len() != len(c.queued) {
					t.Fatalf("Join: %v, pushed out %v, len %d; want ErrFull, nothing pushed out", err, victims, q.Len())
				}
				return
			}
			if err != nil || !slices.Equal(victims, []string{c.evicts}) {
				t.Fatalf("Join: %v, pushed out %v; want %s", err, victims, c.evicts)
			}
			if q.Remove(q.items[c.evicts]) {
				t.Error("the request pushed out is still in the queue")
			}
			if got := q.drain(); !slices.Equal(got, c.order) {
				t.Fatalf("order %v, want %v", got, c.order)
			}
		})
	}
}

// TestQueueBudget: the bytes of the queues that share a budget stay within
// it; a newcomer that does not fit pushes out, in its own model's queue, as
// few requests as make room, by the rules of a full queue, or is turned
// away with nothing pushed out; a request taken out in any way gives its
// bytes back.
func TestQueueBudget(t *testing.T) {
	t.Parallel()
	b := NewBudget(1000)
	m1, m2 := newTestQueue(t, 100, b), newTestQueue(t, 100, b)
	m1.addBytes("a", 0, "", 400)
	m2.addBytes("b", 0, "", 400)
	if b.Used() != 800 || m1.Bytes() != 400 {
		t.Fatalf("used %d, m1 %d", b.Used(), m1.Bytes())
	}
	// Too large for the budget, whatever is queued.
	if _, err := m1.try("huge", 9, "", 1001); !errors.Is(err, ErrFull) {
		t.Fatalf("a body larger than the budget: %v, want ErrFull", err)
	}
	// Does not fit, and m2 may push out nothing of its own priority's
	// single tenant: refused.
	if _, err := m2.try("c", 0, "", 300); !errors.Is(err, ErrFull) || b.Used() != 800 {
		t.Fatalf("over the budget: %v, used %d; want ErrFull, 800", err, b.Used())
	}
	// Fits exactly.
	m2.addBytes("d", -1, "", 200)
	if b.Used() != 1000 {
		t.Fatalf("used %d, want 1000", b.Used())
	}
	// Of priority 1 in m2, needing 250 bytes: pushes out the lowest
	// priority's first (d, 200 bytes), then the next (b), and no more.
	if v := m2.addBytes("e", 1, "", 250); !slices.Equal(v, []string{"d", "b"}) {
		t.Fatalf("pushed out %v, want d then b", v)
	}
	if b.Used() != 650 || m2.Bytes() != 250 {
		t.Fatalf("used %d, m2 %d; want 650, 250", b.Used(), m2.Bytes())
	}
	// m1's requests are never pushed out by m2's newcomers, nor m2's
	// one request of its own tenant and priority: refused.
	if _, err := m2.try("f", 1, "", 400); !errors.Is(err, ErrFull) || b.Used() != 650 {
		t.Fatalf("needing m1's bytes: %v, used %d", err, b.Used())
	}
	// Remove and Pop give back.
	m1.Remove(m1.items["a"])
	if b.Used() != 250 {
		t.Fatalf("used %d after Remove, want 250", b.Used())
	}
	m2.drain()
	if b.Used() != 0 {
		t.Fatalf("used %d after draining, want 0", b.Used())
	}
	m1.checkEmpty()
}

// TestQueueBudgetTenants: over the budget, a tenant that holds fewer
// requests pushes out the largest tenant's newest, as many as make room.
func TestQueueBudgetTenants(t *testing.T) {
	t.Parallel()
	q := newTestQueue(t, 100, NewBudget(1000))
	for i := range 4 {
		q.addBytes(fmt.Sprint("a", i), 0, "a", 200)
	}
	q.addBytes("b0", 0, "b", 200)
	if v := q.addBytes("b1", 0, "b", 350); !slices.Equal(v, []string{"a3", "a2"}) {
		t.Fatalf("pushed out %v, want a3 and a2", v)
	}
	// a and b hold 2 each now: b may push out no more.
	if _, err := q.try("b2", 0, "b", 200); !errors.Is(err, ErrFull) {
		t.Fatalf("tenants holding alike: %v, want ErrFull", err)
	}
	if got, want := q.drain(), []string{"a0", "b0", "a1", "b1"}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
}

// TestBudgetConcurrent: queues of several models, each under its own lock
// as the router keeps them, joining and leaving at once never hold more
// than the budget together, and give every byte back.
func TestBudgetConcurrent(t *testing.T) {
	t.Parallel()
	b := NewBudget(10_000)
	var wg sync.WaitGroup
	var over sync.Once
	for m := range 4 {
		q := NewQueue[int](1000, b)
		wg.Go(func() {
			var held []*Item[int]
			for i := range 5000 {
				a := Arrival{Priority: int64(i % 3), Tenant: fmt.Sprint(i % 5), Bytes: int64(50 + (i*m)%400), MayWait: true}
				if it, _, err := q.Join(a, i, t0); err == nil {
					held = append(held, it)
				}
				if used := b.Used(); used > b.Max() {
					over.Do(func() { t.Errorf("used %d > budget %d", used, b.Max()) })
				}
				if i%3 == 0 && len(held) > 0 {
					q.Remove(held[0])
					held = held[1:]
				}
			}
			for q.Pop() != nil {
			}
		})
	}
	wg.Wait()
	if b.Used() != 0 {
		t.Fatalf("used %d after every queue emptied, want 0", b.Used())
	}
}

// TestQueueLevels: what the queue holds at each priority, highest first:
// its requests over every tenant, and when its oldest joined (a tenant's
// head, whoever's turn it is); at most limit priorities.
func TestQueueLevels(t *testing.T) {
	t.Parallel()
	q := newTestQueue(t, 100, nil)
	if got := q.Levels(nil, 0); len(got) != 0 {
		t.Fatalf("empty queue: %v", got)
	}
	q.add("a", 0, "x") // t0+1ms
	q.add("b", 0, "y")
	q.add("c", 2, "x")
	q.add("d", -1, "x")
	q.add("e", 0, "y")
	q.Pop() // c
	q.Pop() // a: y's b is the oldest of priority 0 now
	want := []Level{{Priority: 0, N: 2, Oldest: q.items["b"].Since()}, {Priority: -1, N: 1, Oldest: q.items["d"].Since()}}
	if got := q.Levels(nil, 0); !slices.Equal(got, want) {
		t.Fatalf("Levels = %v, want %v", got, want)
	}
	if got := q.Levels(nil, 1); !slices.Equal(got, want[:1]) {
		t.Fatalf("Levels limited to 1 = %v, want %v", got, want[:1])
	}
}
