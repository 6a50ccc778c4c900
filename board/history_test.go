package board

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"
)

// TestHistoryRing: the ring keeps the last points added, oldest first, at
// most its capacity; a repeated model name is held once.
func TestHistoryRing(t *testing.T) {
	t.Parallel()
	at := func(ps []HistoryPoint) []int64 {
		out := []int64{}
		for _, p := range ps {
			out = append(out, p.At)
		}
		return out
	}
	r := newHistoryRing(3)
	if got := r.points(); len(got) != 0 {
		t.Fatalf("empty ring: %v", got)
	}
	for i := range int64(5) {
		// A name built anew for each point, as each read of the source does.
		r.add(HistoryPoint{At: i, Models: []HistoryModel{{Name: fmt.Sprint("model-", 7)}, {Name: fmt.Sprint("other-", i)}}})
		want := []int64{}
		for j := max(0, i-2); j <= i; j++ {
			want = append(want, j)
		}
		if got := at(r.points()); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("after %d adds: %v, want %v", i+1, got, want)
		}
	}
	ps := r.points()
	if unsafe.StringData(ps[0].Models[0].Name) != unsafe.StringData(ps[2].Models[0].Name) {
		t.Error("the same model's name is held once per point, not shared")
	}
	if ps[2].Models[1].Name != "other-4" {
		t.Errorf("a new name: %q", ps[2].Models[1].Name)
	}
	ps[0].At = 99 // points returns a copy
	if r.points()[0].At != 2 {
		t.Error("points shares its slice with the ring")
	}
	z := newHistoryRing(0)
	z.add(HistoryPoint{At: 1})
	if len(z.points()) != 0 {
		t.Error("a ring of no capacity holds a point")
	}
}

// TestHistoryPoint: a point keeps of a snapshot what the strip draws: the
// admitted and shed counters, each model's busy and worker counts, its
// rejections and queue; at most maxModels models.
func TestHistoryPoint(t *testing.T) {
	t.Parallel()
	rej, q := uint64(9), uint64(4)
	snap := Snapshot{Admissions: map[string]uint64{"admitted": 5, "stale_open": 2, "unknown_model": 1, "shed": 3, "rejected": 9},
		Models: []Model{
			{Name: "a", Counts: Counts{Busy: 1, Free: 1}, Rejected: &rej, Queued: &q,
				Workers: []Worker{{ID: 1, State: StateBusy}, {ID: 2, State: StateFree}}},
			{Name: "b"}, {Name: "c"},
		}}
	at := time.UnixMilli(1_700_000_000_123)
	p := historyPoint(snap, at, 2)
	data, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"t":1700000000123,"admitted":8,"shed":3,"models":[{"name":"a","busy":1,"workers":2,"rejected":9,"queued":4},` +
		`{"name":"b","busy":0,"workers":0}]}`
	if string(data) != want {
		t.Errorf("point\n%s\nwant\n%s", data, want)
	}
	p = historyPoint(Snapshot{Models: []Model{}}, at, 2)
	if p.Admitted != nil || p.Shed != nil || len(p.Models) != 0 {
		t.Errorf("a snapshot without router counts: %+v", p)
	}
}

// countingSource is a Source whose rejections the test sets, and which
// counts its reads.
type countingSource struct {
	mu       sync.Mutex
	rejected uint64
	err      error
	cost     time.Duration
	reads    int
}

func (s *countingSource) set(rejected uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rejected, s.err = rejected, err
}

func (s *countingSource) Snapshot(ctx context.Context) (Snapshot, error) {
	s.mu.Lock()
	rej, err, cost := s.rejected, s.err, s.cost
	s.reads++
	s.mu.Unlock()
	time.Sleep(cost)
	return Snapshot{Kind: KindRouter, Models: []Model{{Name: "m", Rejected: &rej, Workers: []Worker{{ID: 1}}}}}, err
}

func getHistory(t *testing.T, b *Board) History {
	t.Helper()
	rec := httptest.NewRecorder()
	b.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/board/history", nil))
	if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("GET /board/history: %d %q", rec.Code, rec.Header().Get("Content-Type"))
	}
	var h History
	if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil {
		t.Fatal(err)
	}
	return h
}

// TestHistorySampler: with nobody watching, the board's sampler reads the
// source every HistoryInterval, at once first; GET /board/history serves
// the points, the last HistoryLen of them; a failed read leaves a gap;
// Close stops the sampler (synctest fails a test whose goroutines outlive
// it).
func TestHistorySampler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &countingSource{}
		b, reg := testBoard(t, src, func(c *Config) { c.HistoryLen, c.HistoryInterval = 5, time.Second })
		start := time.Now().UnixMilli()
		// Between the reads (at 0, 1, 2… s), the counter rises.
		time.Sleep(500 * time.Millisecond)
		for i := range uint64(2) {
			src.set(10*(i+1), nil)
			time.Sleep(time.Second)
		}
		synctest.Wait()
		h := getHistory(t, b)
		if h.IntervalMS != 1000 || h.Len != 5 || h.Now != time.Now().UnixMilli() {
			t.Errorf("interval %d ms, len %d, now %d (want 1000, 5, %d)", h.IntervalMS, h.Len, h.Now, time.Now().UnixMilli())
		}
		var got []string
		for _, p := range h.Points {
			got = append(got, fmt.Sprintf("%d:%d", p.At-start, *p.Models[0].Rejected))
		}
		if want := "[0:0 1000:10 2000:20]"; fmt.Sprint(got) != want {
			t.Fatalf("points %v, want %s", got, want)
		}

		// A failing read: no point, an error counted.
		src.set(30, errors.New("monitor stopped"))
		time.Sleep(time.Second)
		synctest.Wait()
		if n := len(getHistory(t, b).Points); n != 3 {
			t.Errorf("%d points after a failed read, want 3", n)
		}
		if n := counter(t, reg, "workermon_board_read_errors_total", nil); n != 1 {
			t.Errorf("read errors %v, want 1", n)
		}

		// Ten more seconds: only the last five points are kept.
		src.set(40, nil)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		h = getHistory(t, b)
		got = got[:0]
		for _, p := range h.Points {
			got = append(got, fmt.Sprintf("%d:%d", p.At-start, *p.Models[0].Rejected))
		}
		if want := "[9000:40 10000:40 11000:40 12000:40 13000:40]"; fmt.Sprint(got) != want {
			t.Fatalf("points %v, want %s", got, want)
		}
	})
}

// TestHistorySlowSource: a source whose reads take long is sampled less
// often (readShare), as the publisher reads it.
func TestHistorySlowSource(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &countingSource{cost: 500 * time.Millisecond}
		testBoard(t, src, func(c *Config) { c.HistoryLen, c.HistoryInterval = 100, time.Second })
		time.Sleep(time.Minute)
		synctest.Wait()
		src.mu.Lock()
		n := src.reads
		src.mu.Unlock()
		// A read of 0.5 s every 0.5 s × readShare (5 s) plus its own time.
		if n < 10 || n > 12 {
			t.Fatalf("%d reads of 0.5 s in a minute, want about 11 (every 5.5 s)", n)
		}
	})
}

// TestHistoryOff: HistoryLen 0 starts no sampler and serves no points.
func TestHistoryOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &countingSource{}
		b, _ := testBoard(t, src, nil)
		time.Sleep(time.Minute)
		synctest.Wait()
		if h := getHistory(t, b); len(h.Points) != 0 || src.reads != 0 {
			t.Fatalf("%d points, %d reads, want none", len(h.Points), src.reads)
		}
	})
}
