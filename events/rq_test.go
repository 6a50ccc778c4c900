package events

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"math"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func sampleRouterQueue() RouterQueue {
	return RouterQueue{Model: "Qwen/Qwen3-0.6B", Source: "router/r1", BootID: 7, Seq: 42,
		Queued: []QueuedLevel{{Priority: 1, N: 2, OldestMs: 15}, {Priority: 0, N: 3, OldestMs: 120}, {Priority: -5, N: 1 << 40}},
		SentAt: 1_763_769_600_000_000_000}
}

// rqMap is a router-queue report as another msgpack library writes it.
func rqMap() map[string]any {
	return map[string]any{"v": 1, "model": "m", "source": "router/a", "boot_id": 1, "seq": 2, "sent_at": 3,
		"queued": map[int64]uint64{0: 3, -1: 0, 5: 1}, "oldest_ms": map[int64]uint64{0: 40, 7: 9}}
}

func TestRouterQueueRoundTrip(t *testing.T) {
	t.Parallel()
	for _, r := range []RouterQueue{sampleRouterQueue(), {Model: "m", Source: "router/x", BootID: 1, Seq: 1}} {
		b, err := MarshalRouterQueue(&r)
		if err != nil {
			t.Fatal(err)
		}
		back, err := DecodeRouterQueue(b)
		if err != nil || !reflect.DeepEqual(back, r) {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
		}
	}
}

// TestRouterQueueDecodeForeign: integer keys of any width and sign, a 0
// count dropped, the ages of priorities not queued ignored, a priority
// without an age at 0, highest priority first.
func TestRouterQueueDecodeForeign(t *testing.T) {
	t.Parallel()
	b, err := msgpack.Marshal(rqMap())
	if err != nil {
		t.Fatal(err)
	}
	r, err := DecodeRouterQueue(b)
	if err != nil {
		t.Fatal(err)
	}
	want := []QueuedLevel{{Priority: 5, N: 1}, {Priority: 0, N: 3, OldestMs: 40}}
	if !reflect.DeepEqual(r.Queued, want) || r.Source != "router/a" || r.Model != "m" || r.Seq != 2 || r.BootID != 1 || r.SentAt != 3 {
		t.Fatalf("decoded %+v, want queued %+v", r, want)
	}
	// An empty queue: an empty map, and nil.
	for _, q := range []any{map[int64]uint64{}, nil} {
		m := rqMap()
		m["queued"] = q
		b, _ := msgpack.Marshal(m)
		if r, err := DecodeRouterQueue(b); err != nil || len(r.Queued) != 0 {
			t.Errorf("queued %v: %+v, %v", q, r, err)
		}
	}
}

func TestRouterQueueDecodeErrors(t *testing.T) {
	t.Parallel()
	many := map[int64]uint64{}
	for p := range int64(MaxQueuedPriorities + 1) {
		many[p] = 1
	}
	for _, tc := range []struct {
		name string
		edit func(m map[string]any)
		want error
	}{
		{"missing queued", func(m map[string]any) { delete(m, "queued") }, ErrMissingField},
		{"missing source", func(m map[string]any) { delete(m, "source") }, ErrMissingField},
		{"missing boot_id", func(m map[string]any) { delete(m, "boot_id") }, ErrMissingField},
		{"missing seq", func(m map[string]any) { delete(m, "seq") }, ErrMissingField},
		{"missing sent_at", func(m map[string]any) { delete(m, "sent_at") }, ErrMissingField},
		{"missing model", func(m map[string]any) { delete(m, "model") }, ErrMissingField},
		{"version 2", func(m map[string]any) { m["v"] = 2 }, ErrVersion},
		{"queued a list", func(m map[string]any) { m["queued"] = []int{1} }, ErrWrongType},
		{"string priority", func(m map[string]any) { m["queued"] = map[string]int{"0": 1} }, ErrWrongType},
		{"float count", func(m map[string]any) { m["queued"] = map[int]float64{0: 1} }, ErrWrongType},
		{"negative count", func(m map[string]any) { m["queued"] = map[int]int{0: -1} }, ErrOutOfRange},
		{"negative age", func(m map[string]any) { m["oldest_ms"] = map[int]int{0: -1} }, ErrOutOfRange},
		{"priority past int64", func(m map[string]any) { m["queued"] = map[uint64]int{math.MaxUint64: 1} }, ErrOutOfRange},
		{"too many priorities", func(m map[string]any) { m["queued"] = many }, ErrOutOfRange},
		{"bad source", func(m map[string]any) { m["source"] = "" }, ErrInvalidSource},
		{"bad model", func(m map[string]any) { m["model"] = "" }, ErrInvalidModel},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			m := rqMap()
			tc.edit(m)
			b, err := msgpack.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			if r, err := DecodeRouterQueue(b); !errors.Is(err, tc.want) {
				t.Fatalf("decoded %+v, %v; want %v", r, err, tc.want)
			}
		})
	}
	// A priority twice, by hand: {"queued": {0: 1, 0: 2}} in an otherwise
	// valid report.
	r := RouterQueue{Model: "m", Source: "router/a", BootID: 1, Seq: 1}
	b, _ := MarshalRouterQueue(&r)
	dup := append([]byte(nil), b...)
	i := indexOf(dup, []byte("\xa6queued\x80"))
	if i < 0 {
		t.Fatal("no empty queued map in the encoding")
	}
	dup = append(dup[:i+7:i+7], append([]byte{0x82, 0x00, 0x01, 0x00, 0x02}, dup[i+8:]...)...)
	if _, err := DecodeRouterQueue(dup); !errors.Is(err, ErrMalformed) {
		t.Fatalf("priority twice: %v", err)
	}
	// Truncated anywhere: an error, never a crash.
	full, _ := MarshalRouterQueue(new(sampleRouterQueue()))
	for n := range len(full) {
		if _, err := DecodeRouterQueue(full[:n]); err == nil {
			t.Fatalf("truncated at %d of %d: accepted", n, len(full))
		}
	}
}

func indexOf(b, sub []byte) int {
	for i := 0; i+len(sub) <= len(b); i++ {
		if string(b[i:i+len(sub)]) == string(sub) {
			return i
		}
	}
	return -1
}

func TestRouterQueueValidate(t *testing.T) {
	t.Parallel()
	for _, q := range [][]QueuedLevel{
		{{Priority: 0, N: 0}},
		{{Priority: 0, N: 1}, {Priority: 1, N: 1}},
		{{Priority: 0, N: 1}, {Priority: 0, N: 1}},
	} {
		r := RouterQueue{Model: "m", Source: "router/a", Queued: q}
		if _, err := MarshalRouterQueue(&r); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("queued %+v: %v", q, err)
		}
	}
}

// TestRouterQueueSubject: the plain and mapped rq subjects parse, carry no
// worker, and match only a router's report of the same model.
func TestRouterQueueSubject(t *testing.T) {
	t.Parallel()
	r := sampleRouterQueue()
	for _, tc := range []struct {
		subject, source string
		want            error
	}{
		{RqSubject("wm", r.Model), "router/r1", nil},
		{"wm.part.3.rq.Qwen/Qwen3-0=2E6B", "router/r1", nil},
		{RqSubject("wm", r.Model), "engine", ErrSourceNotAllowed},
		{RqSubject("wm", "other"), "router/r1", ErrMismatch},
		{"wm.rq.Qwen/Qwen3-0=2e6B", "router/r1", ErrMismatch},
		{"wm.load.Qwen/Qwen3-0=2E6B.1.0", "router/r1", ErrMismatch},
	} {
		s, err := ParseSubject("wm", tc.subject)
		if err != nil {
			t.Fatalf("%s: %v", tc.subject, err)
		}
		r.Source = tc.source
		if err := r.Match(s); !errors.Is(err, tc.want) {
			t.Errorf("%s from %s: %v, want %v", tc.subject, tc.source, err, tc.want)
		}
	}
	s, _ := ParseSubject("wm", "wm.part.3.rq.m")
	if s != (Subject{Kind: KindRq, Mapped: true, Partition: 3, ModelKey: "m"}) {
		t.Errorf("parsed %+v", s)
	}
	for _, bad := range []string{"wm.rq", "wm.rq.", "wm.rq.m.1", "wm.part.1.rq"} {
		if s, err := ParseSubject("wm", bad); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("%s: %+v, %v", bad, s, err)
		}
	}
	if KindRq.String() != "rq" {
		t.Errorf("KindRq is %q", KindRq)
	}
}

// FuzzDecodeRouterQueue checks that no input crashes the router-queue
// decoder, and that every accepted report survives an encode/decode round
// trip.
func FuzzDecodeRouterQueue(f *testing.F) {
	r := sampleRouterQueue()
	b, _ := MarshalRouterQueue(&r)
	f.Add(b)
	m, _ := msgpack.Marshal(rqMap())
	f.Add(m)
	f.Add([]byte{0x80})
	for _, v := range loadRqVectors(f).RouterQueues {
		if b, err := hex.DecodeString(v.Hex); err == nil {
			f.Add(b)
		}
	}
	dec, enc := NewDecoder(), NewEncoder()
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := dec.RouterQueue(data)
		if err != nil {
			if Reason(err) == "other" {
				t.Fatalf("error without a reason label: %v", err)
			}
			return
		}
		b, err := enc.RouterQueue(&r)
		if err != nil {
			t.Fatalf("accepted report does not encode: %+v: %v", r, err)
		}
		back, err := dec.RouterQueue(b)
		if err != nil || !reflect.DeepEqual(back, r) {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
		}
	})
}

// rqVectors are the router_queues vectors of testdata/contract-vectors.json.
type rqVectors struct {
	RouterQueues []struct {
		Name    string                     `json:"name"`
		Subject string                     `json:"subject"`
		Hex     string                     `json:"hex"`
		Valid   bool                       `json:"valid"`
		Why     string                     `json:"why"`
		Expect  map[string]json.RawMessage `json:"expect"`
	} `json:"router_queues"`
}

func loadRqVectors(t testing.TB) rqVectors {
	t.Helper()
	data, err := os.ReadFile("../testdata/contract-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var v rqVectors
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatal(err)
	}
	if len(v.RouterQueues) == 0 {
		t.Fatal("no router_queues vectors")
	}
	return v
}

// TestRouterQueueVectors: the hand-encoded vectors of contract §22 decode,
// on their subjects, to what they expect, or are refused for their reason.
func TestRouterQueueVectors(t *testing.T) {
	t.Parallel()
	for _, v := range loadRqVectors(t).RouterQueues {
		t.Run(v.Name, func(t *testing.T) {
			t.Parallel()
			payload, err := hex.DecodeString(v.Hex)
			if err != nil {
				t.Fatal(err)
			}
			s, err := ParseSubject(DefaultSubjectPrefix, v.Subject)
			if err != nil {
				t.Fatal(err)
			}
			r, err := DecodeRouterQueue(payload)
			if err == nil {
				err = r.Match(s)
			}
			if !v.Valid {
				if err == nil {
					t.Fatalf("accepted an invalid report: %+v", r)
				}
				if got, want := Reason(err), strings.ReplaceAll(v.Why, " ", "_"); got != want {
					t.Errorf("refused for %s (%v), want %s", got, err, want)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused a valid report: %v", err)
			}
			queued, oldest := map[string]uint64{}, map[string]uint64{}
			for _, l := range r.Queued {
				p := strconv.FormatInt(l.Priority, 10)
				queued[p], oldest[p] = l.N, l.OldestMs
			}
			got := map[string]any{"model": r.Model, "source": r.Source, "boot_id": r.BootID, "seq": r.Seq,
				"queued": queued, "oldest_ms": oldest}
			for name, raw := range v.Expect {
				want := reflect.New(reflect.TypeOf(got[name]))
				if err := json.Unmarshal(raw, want.Interface()); err != nil {
					t.Fatalf("expect %s: %v", name, err)
				}
				if !reflect.DeepEqual(got[name], want.Elem().Interface()) {
					t.Errorf("%s = %v, want %s", name, got[name], raw)
				}
			}
		})
	}
}

// TestRouterQueueDecodeAllocatesQueuedOnly: a steady stream of router-queue
// reports allocates only the queued levels a report hands over (the
// monitor keeps them); the ages are decoded into the Decoder's scratch,
// and a second decode leaves the first report's levels alone.
func TestRouterQueueDecodeAllocatesQueuedOnly(t *testing.T) {
	r := RouterQueue{Model: "org/m", Source: "router/a", BootID: 1, Seq: 1, SentAt: 1,
		Queued: []QueuedLevel{{Priority: 2, N: 1, OldestMs: 30}, {Priority: 0, N: 4, OldestMs: 7}}}
	data, err := MarshalRouterQueue(&r)
	if err != nil {
		t.Fatal(err)
	}
	dec := NewDecoder()
	first, err := dec.RouterQueue(data) // interns the names
	if err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = dec.RouterQueue(data) }); n != 1 {
		t.Errorf("RouterQueue allocates %v times per report, want 1 (its queued levels)", n)
	}
	if !reflect.DeepEqual(first.Queued, r.Queued) {
		t.Errorf("first report's levels %+v after more decodes, want %+v", first.Queued, r.Queued)
	}
}
