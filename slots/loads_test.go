package slots

import (
	"fmt"
	"math"
	"slices"
	"testing"
)

// TestLoadPages: the pages of any size, filtered or not, are Loads' list
// in order; a tracker that goes between two pages, the cursor's own
// included, ends the listing of its ranks and no other.
func TestLoadPages(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	for _, m := range []string{"b", "a", "c"} {
		for _, tenant := range []string{"t2", "", "t1"} {
			for w := range uint64(3) {
				must(t, tr.Register(Worker{WorkerID: 10 - w, Model: m, Tenant: tenant, BlockSize: 16, DPStart: uint32(w), DPSize: 3}))
			}
		}
	}
	must(t, tr.Add(Request{Model: "a", ID: "x", WorkerID: 9, DPRank: 2, Hashes: []uint64{1, 2}, NewISLTokens: 4}))
	collect := func(model, tenant string, size int) []Load {
		out := []Load{}
		for page := range tr.LoadPages(model, tenant, size) {
			out = append(out, page...)
		}
		return out
	}
	for _, f := range [][2]string{{"", ""}, {"a", ""}, {"", "t1"}, {"c", "default"}, {"z", ""}} {
		want := tr.Loads(f[0], f[1])
		for _, size := range []int{0, 1, 2, 3, 7, 9, 26, 27, 28, 1000} {
			if got := collect(f[0], f[1], size); !slices.Equal(got, want) {
				t.Errorf("filter %q, pages of %d: %v, want %v", f, size, got, want)
			}
		}
	}
	if l := tr.Loads("", ""); len(l) != 81 || l[0].Model != "a" || l[0].Tenant != "default" || l[0].WorkerID != 8 || l[0].DPRank != 2 {
		t.Fatalf("loads %d rows, first %+v", len(l), l[0])
	}
	// The cursor's tracker, then the next one, go while the listing stops.
	var got []Load
	pages := 0
	for page := range tr.LoadPages("", "", 5) {
		got = append(got, page...)
		if pages++; pages == 1 {
			for w := range uint64(3) {
				must(t, tr.Unregister("a", "default", 10-w))
				must(t, tr.Unregister("a", "t1", 10-w))
			}
		}
	}
	want := append(tr.Loads("a", "default")[:0:0], got[:5]...)
	want = append(want, tr.Loads("a", "t2")...)
	want = append(want, tr.Loads("b", "")...)
	want = append(want, tr.Loads("c", "")...)
	if !slices.Equal(got, want) {
		t.Errorf("listing across removals:\n%v\nwant\n%v", fmt.Sprint(got), fmt.Sprint(want))
	}
}

// TestWorkerPages: the pages of any size, filtered or not, are the
// workers sorted by (model, tenant, worker id), the largest worker id
// included.
func TestWorkerPages(t *testing.T) {
	t.Parallel()
	tr, _ := newTracker(t, nil)
	var want []Worker
	for _, m := range []string{"a", "b"} {
		for _, tenant := range []string{"default", "t1"} {
			for _, id := range []uint64{0, 5, 6, math.MaxUint64} {
				w := Worker{WorkerID: id, Model: m, Tenant: tenant, BlockSize: 16, DPStart: uint32(id % 7), DPSize: uint32(1 + id%3)}
				want = append(want, w)
			}
		}
	}
	for _, i := range []int{9, 3, 14, 0, 7, 1, 15, 12, 2, 5, 8, 10, 4, 6, 11, 13} {
		must(t, tr.Register(want[i]))
	}
	if got := tr.Workers("", ""); !slices.Equal(got, want) {
		t.Fatalf("workers %v, want %v", got, want)
	}
	collect := func(model, tenant string, size int) []Worker {
		out := []Worker{}
		for page := range tr.WorkerPages(model, tenant, size) {
			out = append(out, page...)
		}
		return out
	}
	for _, f := range [][2]string{{"", ""}, {"a", ""}, {"", "t1"}, {"b", "default"}, {"z", ""}} {
		want := tr.Workers(f[0], f[1])
		for _, size := range []int{0, 1, 2, 3, 4, 5, 15, 16, 17} {
			if got := collect(f[0], f[1], size); !slices.Equal(got, want) {
				t.Errorf("filter %q, pages of %d: %v, want %v", f, size, got, want)
			}
		}
	}
}
