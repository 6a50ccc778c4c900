package router

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/events"
)

// BenchmarkCandidatesAndPick measures the per-request worker choice: the
// candidates of a decision and the power-of-two pick. Neither allocates.
func BenchmarkCandidatesAndPick(b *testing.B) {
	var l loads
	l.init()
	registered := make([]events.WorkerEntry, 16)
	for i := range registered {
		registered[i] = events.WorkerEntry{WorkerID: uint64(i), Endpoint: "http://10.0.0." + string(rune('a'+i)) + ":8000"}
		l.counter(registered[i].Endpoint)
	}
	d := admission.Decision{Admit: true, Reason: admission.ReasonFree, Free: []uint64{1, 3, 5, 7, 9, 11}, Busy: []uint64{0, 2}}
	b.ReportAllocs()
	for b.Loop() {
		var buf [8]events.WorkerEntry
		cands := d.Candidates(buf[:0], registered)
		if _, ok := l.pick(cands, nil); !ok {
			b.Fatal("no pick")
		}
	}
}

// FuzzSSEReader checks that the reader never fails on any input and that
// the events it returns, followed by the unfinished rest, are the input.
func FuzzSSEReader(f *testing.F) {
	f.Add([]byte("data: {\"a\":1}\n\ndata: [DONE]\n\n"))
	f.Add([]byte(": c\r\n\r\nevent: x\ndata:y\ndata\n\n\n\ndata: partial"))
	f.Add([]byte("\n\n\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		sr := newSSEReader(bytes.NewReader(in))
		var out []byte
		for {
			ev, err := sr.next()
			if err != nil {
				if errors.Is(err, errEventTooLarge) {
					return
				}
				if !errors.Is(err, io.EOF) {
					t.Fatal(err)
				}
				out = append(out, ev...)
				break
			}
			if !bytes.HasSuffix(ev, []byte("\n")) {
				t.Fatalf("event %q does not end a line", ev)
			}
			_, _ = sseData(ev, nil)
			out = append(out, ev...)
		}
		if !bytes.Equal(out, in) {
			t.Fatalf("events %q != input %q", out, in)
		}
	})
}

// hotPathFixture is what a request that does not wait goes through with
// flow control on (contract §17): its headers checked, its class decided on
// a record, and the look at its model's queue, empty.
func hotPathFixture(tb testing.TB) (hot, decide func() bool, _ *modelQueue) {
	tb.Helper()
	m, err := newQueueMetrics(nil, 10)
	if err != nil {
		tb.Fatal(err)
	}
	f := newFakeFleet(1, 2)
	q := newQueues(queueLimits{maxWait: time.Second, maxRequests: DefaultQueueMaxRequests, maxBytes: DefaultQueueMaxBytes,
		pace: DefaultQueuePace}, f.deps(), m)
	mq := q.forModel("m")
	q.forModel("other")
	rec := events.BusySet{Model: "m", Free: []uint64{1, 3}, Busy: []uint64{2}, Amber: []uint64{3}}
	cl := admission.PrepareClasses(&rec)
	p := admission.Policy{StaleAfter: time.Second, FailOpen: true}
	req := httptest.NewRequest(http.MethodPost, PathCompletions, nil)
	req.Header.Set(MaxWaitHeader, "500")
	req.Header.Set(TenantHeader, "team-a")
	qh0 := queueHeaders{maxWait: 500 * time.Millisecond, tenant: "team-a"}
	return func() bool {
			qh, msg := parseQueueHeaders(req)
			if msg != "" {
				return false
			}
			d := p.DecideClassRecord(&rec, &cl, admission.ClassStandard, false)
			return d.Admit && !q.waits(req, "m", d, qh)
		}, func() bool {
			d := p.DecideClassRecord(&rec, &cl, admission.ClassStandard, false)
			return d.Admit && !q.waits(req, "m", d, qh0)
		}, mq
}

// TestQueueHotPathNoAlloc: with flow control on and the model's queue
// empty, a request that does not wait allocates nothing (and takes no
// lock: the queue is read through an atomic map and an atomic depth).
func TestQueueHotPathNoAlloc(t *testing.T) { // not parallel: AllocsPerRun
	hot, _, mq := hotPathFixture(t)
	if !hot() {
		t.Fatal("the request would wait")
	}
	if n := testing.AllocsPerRun(1000, func() { _ = hot() }); n != 0 {
		t.Errorf("%v allocs/op, want 0", n)
	}
	// Held locked: a request that does not wait never takes it.
	mq.mu.Lock()
	defer mq.mu.Unlock()
	if !hot() {
		t.Fatal("the request would wait")
	}
}

// BenchmarkQueueHotPath measures hotPathFixture: the decision and the look
// at the empty queue (decide), and the same with the headers checked first
// (headers).
func BenchmarkQueueHotPath(b *testing.B) {
	hot, decide, _ := hotPathFixture(b)
	for name, f := range map[string]func() bool{"decide": decide, "headers": hot} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if !f() {
					b.Fatal("would wait")
				}
			}
		})
	}
}

// BenchmarkRequestModel: reading the model of a request body, a chat
// request of 1 KB and one of 1 MB (a long conversation): a full parse that
// validates the JSON, then the scan for the last top-level "model".
func BenchmarkRequestModel(b *testing.B) {
	for _, size := range []int{1 << 10, 1 << 20} {
		msg := strings.Repeat("lorem ipsum ", size/12)
		body := []byte(`{"messages":[{"role":"user","content":"` + msg + `"}],"max_tokens":64,"stream":true,"model":"Qwen/Qwen3-0.6B"}`)
		b.Run(fmt.Sprintf("%dKB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if m, msg := requestModel(body); m != "Qwen/Qwen3-0.6B" {
					b.Fatal(msg)
				}
			}
		})
	}
}
