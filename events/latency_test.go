package events

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func sampleLatency() LatencyReport {
	return LatencyReport{
		Model: "Qwen/Qwen3-0.6B", WorkerID: 7, Source: "router/r1", WindowMs: 1000,
		TTFT:     []LatencyBucket{{K: 0, N: 1}, {K: 60, N: 12}, {K: 150, N: 2}},
		ITL:      []LatencyBucket{{K: 30, N: 400}},
		Rejected: 3, Queued: 5, SentAt: 1_700_000_000_000_000_000,
	}
}

func TestLatencyReportRoundTrip(t *testing.T) {
	t.Parallel()
	r := sampleLatency()
	b, err := MarshalLatencyReport(&r)
	if err != nil {
		t.Fatal(err)
	}
	back, err := DecodeLatencyReport(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, r) {
		t.Fatalf("round trip: %+v, want %+v", back, r)
	}
	// The maps are keyed by msgpack integers (another library reads them so).
	d := msgpack.NewDecoder(bytes.NewReader(b))
	d.SetMapDecoder(func(d *msgpack.Decoder) (any, error) { return d.DecodeUntypedMap() })
	v, err := d.DecodeInterface()
	if err != nil {
		t.Fatal(err)
	}
	generic := v.(map[any]any)
	ttft, ok := generic["ttft"].(map[any]any)
	if !ok {
		t.Fatalf("ttft is %T", generic["ttft"])
	}
	for k := range ttft {
		switch k.(type) {
		case int8, uint8, int16, uint16, int32, uint32, int64, uint64:
		default:
			t.Errorf("ttft key %v is %T, want an integer", k, k)
		}
	}
}

// latMap is a latency report as a generic map, for hand-made payloads.
func latMap() map[string]any {
	return map[string]any{
		"v": 1, "model": "m", "worker_id": 3, "source": "engine", "window_ms": 1000,
		"ttft": map[int]uint64{5: 2, 1: 3}, "itl": map[int]uint64{}, "rejected": 0, "queued": 0,
		"sent_at": int64(12345),
	}
}

func TestDecodeLatencyReport(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		edit func(m map[string]any)
		want error
	}{
		{"valid", func(map[string]any) {}, nil},
		{"unknown key ignored", func(m map[string]any) { m["extra"] = []int{1} }, nil},
		{"nil maps are empty", func(m map[string]any) { m["ttft"], m["itl"] = nil, nil }, nil},
		{"source defaults to engine", func(m map[string]any) { delete(m, "source") }, nil},
		{"missing v", func(m map[string]any) { delete(m, "v") }, ErrMissingField},
		{"missing model", func(m map[string]any) { delete(m, "model") }, ErrMissingField},
		{"missing worker", func(m map[string]any) { delete(m, "worker_id") }, ErrMissingField},
		{"missing window", func(m map[string]any) { delete(m, "window_ms") }, ErrMissingField},
		{"missing sent_at", func(m map[string]any) { delete(m, "sent_at") }, ErrMissingField},
		{"zero window", func(m map[string]any) { m["window_ms"] = 0 }, ErrOutOfRange},
		{"version 2", func(m map[string]any) { m["v"] = 2 }, ErrVersion},
		{"bad model", func(m map[string]any) { m["model"] = "" }, ErrInvalidModel},
		{"string window", func(m map[string]any) { m["window_ms"] = "1000" }, ErrWrongType},
		{"ttft not a map", func(m map[string]any) { m["ttft"] = []int{1} }, ErrWrongType},
		{"string bucket key", func(m map[string]any) { m["ttft"] = map[string]int{"1": 2} }, ErrWrongType},
		{"bucket past 150", func(m map[string]any) { m["itl"] = map[int]int{151: 2} }, ErrOutOfRange},
		{"negative bucket", func(m map[string]any) { m["itl"] = map[int]int{-1: 2} }, ErrOutOfRange},
		{"negative count", func(m map[string]any) { m["itl"] = map[int]int{1: -2} }, ErrOutOfRange},
		{"string count", func(m map[string]any) { m["itl"] = map[int]string{1: "2"} }, ErrWrongType},
		{"negative rejected", func(m map[string]any) { m["rejected"] = -1 }, ErrOutOfRange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			m := latMap()
			tc.edit(m)
			b, err := msgpack.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			r, err := DecodeLatencyReport(b)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("decode: %v", err)
				}
				if len(r.TTFT) > 0 && (r.TTFT[0] != LatencyBucket{K: 1, N: 3}) {
					t.Errorf("buckets not sorted: %+v", r.TTFT)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("decode = %v, want %v", err, tc.want)
			}
			if Reason(err) == "other" {
				t.Errorf("error without a reason label: %v", err)
			}
		})
	}
	// A bucket twice (msgpack maps may repeat keys).
	dup := []byte{0x86, 0xa1, 'v', 1, 0xa5, 'm', 'o', 'd', 'e', 'l', 0xa1, 'm', 0xa9, 'w', 'o', 'r', 'k', 'e', 'r', '_', 'i', 'd', 1,
		0xa9, 'w', 'i', 'n', 'd', 'o', 'w', '_', 'm', 's', 1, 0xa7, 's', 'e', 'n', 't', '_', 'a', 't', 1,
		0xa3, 'i', 't', 'l', 0x82, 1, 1, 1, 2}
	if _, err := DecodeLatencyReport(dup); !errors.Is(err, ErrMalformed) {
		t.Errorf("bucket twice: %v, want ErrMalformed", err)
	}
	for _, b := range [][]byte{nil, {0x90}, {0x81}, {0x81, 0xa3, 'i', 't', 'l', 0x8f}} {
		if _, err := DecodeLatencyReport(b); err == nil || Reason(err) == "other" {
			t.Errorf("% x: %v", b, err)
		}
	}
}

func TestLatencySubjects(t *testing.T) {
	t.Parallel()
	r := sampleLatency()
	for _, tc := range []struct {
		subject string
		source  string
		kind    Kind
		want    error
	}{
		{LatrSubject("wm", r.Model, 7), "router/r1", KindLatr, nil},
		{LatSubject("wm", r.Model, 7), "engine", KindLat, nil},
		{"wm.part.3.latr.Qwen/Qwen3-0=2E6B.7", "router/r1", KindLatr, nil},
		{LatSubject("wm", r.Model, 7), "router/r1", KindLat, ErrSourceNotAllowed},
		{LatrSubject("wm", r.Model, 7), "engine", KindLatr, ErrSourceNotAllowed},
		{LatSubject("wm", r.Model, 8), "engine", KindLat, ErrMismatch},
		{LatSubject("wm", "other", 7), "engine", KindLat, ErrMismatch},
	} {
		s, err := ParseSubject("wm", tc.subject)
		if err != nil {
			t.Fatalf("%s: %v", tc.subject, err)
		}
		if s.Kind != tc.kind || s.DPRank != "" {
			t.Errorf("%s: kind %s rank %q", tc.subject, s.Kind, s.DPRank)
		}
		r.Source = tc.source
		if err := r.Match(s); !errors.Is(err, tc.want) {
			t.Errorf("%s with source %s: Match = %v, want %v", tc.subject, tc.source, err, tc.want)
		}
	}
	for _, bad := range []string{"wm.lat.m", "wm.lat.m.1.2", "wm.latr.m.", "wm.lat..1"} {
		if _, err := ParseSubject("wm", bad); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("%s: %v, want ErrInvalidSubject", bad, err)
		}
	}
	if got := LatSubject("wm", "a b", 1); got != "wm.lat.a=20b.1" {
		t.Errorf("LatSubject = %s", got)
	}
}

func TestLatencyBucketOf(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ms   float64
		want uint8
	}{{0.2, 0}, {1, 0}, {2, 8}, {100, 53}, {1e9, 150}} {
		if got := LatencyBucketOf(tc.ms); got != tc.want {
			t.Errorf("LatencyBucketOf(%v) = %d, want %d", tc.ms, got, tc.want)
		}
	}
}

func TestLatencyReportValidate(t *testing.T) {
	t.Parallel()
	r := sampleLatency()
	r.ITL = []LatencyBucket{{K: 3, N: 1}, {K: 3, N: 1}}
	if _, err := MarshalLatencyReport(&r); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("buckets twice: %v", err)
	}
	r = sampleLatency()
	r.WindowMs = 0
	if _, err := MarshalLatencyReport(&r); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("zero window: %v", err)
	}
}

// FuzzDecodeLatencyReport checks that no input crashes the latency decoder,
// and that every accepted report survives an encode/decode round trip.
func FuzzDecodeLatencyReport(f *testing.F) {
	r := sampleLatency()
	b, _ := MarshalLatencyReport(&r)
	f.Add(b)
	m, _ := msgpack.Marshal(latMap())
	f.Add(m)
	dec, enc := NewDecoder(), NewEncoder()
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := dec.LatencyReport(data)
		if err != nil {
			if Reason(err) == "other" {
				t.Fatalf("error without a reason label: %v", err)
			}
			return
		}
		b, err := enc.LatencyReport(&r)
		if err != nil {
			t.Fatalf("accepted report does not encode: %+v: %v", r, err)
		}
		back, err := dec.LatencyReport(b)
		if err != nil || !reflect.DeepEqual(back, r) {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
		}
	})
}
