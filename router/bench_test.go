package router

import (
	"bytes"
	"errors"
	"io"
	"testing"

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
