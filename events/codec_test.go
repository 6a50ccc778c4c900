package events

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"slices"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

type vectorFile struct {
	Reports []struct {
		Name    string                     `json:"name"`
		Subject string                     `json:"subject"`
		Hex     string                     `json:"hex"`
		Valid   bool                       `json:"valid"`
		Expect  map[string]json.RawMessage `json:"expect"`
	} `json:"reports"`
	ModelKeys []struct {
		Model string `json:"model"`
		Key   string `json:"key"`
	} `json:"model_keys"`
}

func loadVectors(t *testing.T) vectorFile {
	t.Helper()
	data, err := os.ReadFile("../testdata/contract-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var v vectorFile
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatal(err)
	}
	if len(v.Reports) == 0 || len(v.ModelKeys) == 0 {
		t.Fatal("no vectors loaded")
	}
	return v
}

// decodeOnSubject is what the monitor does with a message: parse the
// subject, decode the payload, check that both agree.
func decodeOnSubject(subject string, payload []byte) (LoadReport, error) {
	s, err := ParseSubject(DefaultSubjectPrefix, subject)
	if err != nil {
		return LoadReport{}, err
	}
	r, err := DecodeLoadReport(payload)
	if err != nil {
		return LoadReport{}, err
	}
	return r, r.Match(s)
}

// reportField returns a report's field by its wire name, nil when absent.
func reportField(r LoadReport, name string) any {
	opt := func(o Optional) any {
		if o.Set {
			return o.Value
		}
		return nil
	}
	switch name {
	case "model":
		return r.Model
	case "worker_id":
		return r.WorkerID
	case "dp_rank":
		return uint64(r.DPRank)
	case "dp_start":
		return uint64(r.DPStart)
	case "dp_size":
		return uint64(r.DPSize)
	case "source":
		return r.Source
	case "active_decode_blocks":
		return opt(r.ActiveDecodeBlocks)
	case "kv_total_blocks":
		return opt(r.KVTotalBlocks)
	case "active_prefill_tokens":
		return opt(r.ActivePrefillTokens)
	case "max_num_batched_tokens":
		return opt(r.MaxNumBatchedTokens)
	case "boot_id":
		return r.BootID
	case "seq":
		return r.Seq
	case "sent_at":
		return uint64(r.SentAt)
	}
	return "unknown field " + name
}

func TestContractVectors(t *testing.T) {
	t.Parallel()
	for _, v := range loadVectors(t).Reports {
		t.Run(v.Name, func(t *testing.T) {
			t.Parallel()
			payload, err := hex.DecodeString(v.Hex)
			if err != nil {
				t.Fatal(err)
			}
			r, err := decodeOnSubject(v.Subject, payload)
			if !v.Valid {
				if err == nil {
					t.Fatalf("accepted an invalid report: %+v", r)
				}
				if Reason(err) == "other" {
					t.Errorf("error %v has no reason label", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("rejected a valid report: %v", err)
			}
			for name, raw := range v.Expect {
				var want any
				if string(raw) != "null" {
					var s string
					if json.Unmarshal(raw, &s) == nil {
						want = s
					} else {
						var n uint64
						if err := json.Unmarshal(raw, &n); err != nil {
							t.Fatalf("expect %s: %v", name, err)
						}
						want = n
					}
				}
				if got := reportField(r, name); !reflect.DeepEqual(got, want) {
					t.Errorf("%s = %v, want %v", name, got, want)
				}
			}
			// What we decode we must encode back to the same report.
			enc, err := MarshalLoadReport(&r)
			if err != nil {
				t.Fatal(err)
			}
			back, err := DecodeLoadReport(enc)
			if err != nil || back != r {
				t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
			}
		})
	}
}

func TestDecodeReportErrors(t *testing.T) {
	t.Parallel()
	valid := LoadReport{Model: "m", WorkerID: 1, DPSize: 1, Source: SourceEngine, BootID: 2, Seq: 3, SentAt: 4}
	// with returns the smallest valid report with the key/value pairs kv set.
	with := func(kv ...any) map[string]any {
		m := map[string]any{"v": 1, "model": "m", "worker_id": 1, "boot_id": 1, "seq": 1, "sent_at": 1}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
	tests := []struct {
		name string
		m    map[string]any
		want error
	}{
		{"missing v", map[string]any{"model": "m", "worker_id": 1, "boot_id": 1, "seq": 1, "sent_at": 1}, ErrMissingField},
		{"nil worker", with("worker_id", nil), ErrMissingField},
		{"v 2", with("v", 2), ErrVersion},
		{"model as bytes", with("model", []byte("m")), ErrWrongType},
		{"long model", with("model", string(make([]byte, 257))), ErrInvalidModel},
		{"invalid utf8 model", with("model", "\xff"), ErrInvalidModel},
		{"rank above uint32", with("dp_rank", uint64(1)<<32), ErrOutOfRange},
		{"dp_size 0", with("dp_size", 0), ErrOutOfRange},
		{"sent_at above int64", with("sent_at", uint64(math.MaxUint64)), ErrOutOfRange},
		{"bool load", with("kv_total_blocks", true), ErrWrongType},
		{"empty source", with("source", ""), ErrInvalidSource},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := DecodeLoadReport(mustMarshal(t, tt.m))
			if !errors.Is(err, tt.want) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
		})
	}
	t.Run("trailing bytes", func(t *testing.T) {
		b, _ := MarshalLoadReport(&valid)
		if _, err := DecodeLoadReport(append(b, 0xc0)); !errors.Is(err, ErrMalformed) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("too large", func(t *testing.T) {
		if _, err := DecodeLoadReport(make([]byte, MaxPayloadSize+1)); !errors.Is(err, ErrTooLarge) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("negative sent_at is allowed", func(t *testing.T) {
		r := valid
		r.SentAt = -5
		b, _ := MarshalLoadReport(&r)
		if got, err := DecodeLoadReport(b); err != nil || got.SentAt != -5 {
			t.Fatalf("got %+v, %v", got, err)
		}
	})
}

func TestGoodbyeRoundTrip(t *testing.T) {
	t.Parallel()
	g := Goodbye{Model: "Qwen/Qwen3-0.6B", WorkerID: 9, Source: "router/a", BootID: 5, Seq: 77, SentAt: 123}
	b, err := MarshalGoodbye(&g)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeGoodbye(b)
	if err != nil || got != g {
		t.Fatalf("got %+v, %v", got, err)
	}
	s, err := ParseSubject("wm", EstByeSubject("wm", g.Model, g.WorkerID))
	if err != nil {
		t.Fatal(err)
	}
	if err := got.Match(s); err != nil {
		t.Fatal(err)
	}
	engine := got
	engine.Source = SourceEngine
	if err := engine.Match(s); !errors.Is(err, ErrSourceNotAllowed) {
		t.Fatalf("engine goodbye on an est subject: %v", err)
	}
	if s, err := ParseSubject("wm", ByeSubject("wm", g.Model, g.WorkerID)); err != nil || got.Match(s) == nil || engine.Match(s) != nil {
		t.Fatalf("bye subject: router goodbye %v, engine goodbye %v (parse %v)", got.Match(s), engine.Match(s), err)
	}
	s.WorkerID = "09"
	if err := got.Match(s); !errors.Is(err, ErrMismatch) {
		t.Fatalf("leading zero accepted: %v", err)
	}
}

func TestBusySetEncodesEmptyCollections(t *testing.T) {
	t.Parallel()
	b, err := MarshalBusySet(&BusySet{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	raw := map[string]any{}
	if err := msgpackUnmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"busy", "free", "stale", "amber", "hard"} {
		if l, ok := raw[k].([]any); !ok || len(l) != 0 {
			t.Errorf("%s = %#v, want empty array", k, raw[k])
		}
	}
	if m, ok := raw["reasons"].(map[string]any); !ok || len(m) != 0 {
		t.Errorf("reasons = %#v, want empty map", raw["reasons"])
	}
	if m, ok := raw["thresholds"].(map[string]any); !ok || len(m) != 0 {
		t.Errorf("thresholds = %#v, want empty map", raw["thresholds"])
	}
	set, err := DecodeBusySet(b)
	if err != nil || set.V != 1 || set.Model != "m" {
		t.Fatalf("decode: %+v, %v", set, err)
	}
}

// TestBusySetRouters: the record's routers count (contract §17) round-trips,
// and a record written before it decodes as 0.
func TestBusySetRouters(t *testing.T) {
	t.Parallel()
	b, err := MarshalBusySet(&BusySet{Model: "m", Routers: 3})
	if err != nil {
		t.Fatal(err)
	}
	raw := map[string]any{}
	if err := msgpackUnmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(raw["routers"]) != "3" {
		t.Fatalf("routers = %#v, want 3", raw["routers"])
	}
	if got, err := DecodeBusySet(b); err != nil || got.Routers != 3 {
		t.Fatalf("decode: routers %d, %v", got.Routers, err)
	}
	delete(raw, "routers")
	old, err := msgpack.Marshal(raw)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeBusySet(old); err != nil || got.Routers != 0 {
		t.Fatalf("record without routers: routers %d, %v", got.Routers, err)
	}
}

func TestBusySetAmberHard(t *testing.T) {
	t.Parallel()
	in := BusySet{
		Model: "m", Busy: []uint64{3, 4}, Free: []uint64{1, 2}, Amber: []uint64{2}, Hard: []uint64{4},
		Reasons: map[string]string{"3": ReasonKV, "4": ReasonPrefill},
	}
	b, err := MarshalBusySet(&in)
	if err != nil {
		t.Fatal(err)
	}
	raw := map[string]any{}
	if err := msgpackUnmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]uint64{"amber": 2, "hard": 4} {
		if l, ok := raw[k].([]any); !ok || len(l) != 1 || fmt.Sprint(l[0]) != fmt.Sprint(want) {
			t.Errorf("%s = %#v, want [%d]", k, raw[k], want)
		}
	}
	got, err := DecodeBusySet(b)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.Amber, in.Amber) || !slices.Equal(got.Hard, in.Hard) || !slices.Equal(got.Busy, in.Busy) {
		t.Errorf("round trip: amber %v hard %v busy %v", got.Amber, got.Hard, got.Busy)
	}

	// A record written before contract §15 has neither key: both lists
	// decode empty, not nil, and the rest is read as before.
	delete(raw, "amber")
	delete(raw, "hard")
	old, err := msgpack.Marshal(raw)
	if err != nil {
		t.Fatal(err)
	}
	got, err = DecodeBusySet(old)
	if err != nil {
		t.Fatal(err)
	}
	if got.Amber == nil || len(got.Amber) != 0 || got.Hard == nil || len(got.Hard) != 0 {
		t.Errorf("older record: amber %#v hard %#v, want empty", got.Amber, got.Hard)
	}
	if !slices.Equal(got.Busy, in.Busy) || !slices.Equal(got.Free, in.Free) {
		t.Errorf("older record: busy %v free %v", got.Busy, got.Free)
	}
}

func TestThresholdsValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		t  Thresholds
		ok bool
	}{
		{Thresholds{}, true},
		{Thresholds{ActiveDecodeBlocks: Ptr(0.0), ActivePrefillTokensFrac: Ptr(0.0)}, true},
		{Thresholds{ActiveDecodeBlocks: Ptr(1.0)}, true},
		{Thresholds{ActiveDecodeBlocks: Ptr(1.0000001)}, false},
		{Thresholds{ActiveDecodeBlocks: Ptr(-0.1)}, false},
		{Thresholds{ActiveDecodeBlocks: Ptr(math.NaN())}, false},
		{Thresholds{ActivePrefillTokensFrac: Ptr(math.Inf(1))}, false},
		{Thresholds{ActivePrefillTokensFrac: Ptr(-1.0)}, false},
		{Thresholds{ActivePrefillTokensFrac: Ptr(3.5)}, true},
	}
	for i, tt := range tests {
		if err := tt.t.Validate(); (err == nil) != tt.ok {
			t.Errorf("%d: err = %v, want ok=%v", i, err, tt.ok)
		}
	}
}

func TestDecodeNilAfterValueIsAbsent(t *testing.T) {
	t.Parallel()
	// msgpack maps may repeat a key; the last value counts. A nil after a
	// value makes the load field absent, Value included, so that what is
	// accepted encodes back to the same report.
	str := func(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }
	b := []byte{0x88}
	for _, k := range []string{"v", "worker_id", "boot_id", "seq", "sent_at"} {
		b = append(str(b, k), 1)
	}
	b = str(str(b, "model"), "m")
	b = append(str(b, "kv_total_blocks"), 5)
	b = append(str(b, "kv_total_blocks"), 0xc0)
	r, err := DecodeLoadReport(b)
	if err != nil {
		t.Fatal(err)
	}
	if r.KVTotalBlocks != (Optional{}) {
		t.Fatalf("kv_total_blocks = %+v, want absent", r.KVTotalBlocks)
	}
}

func TestDecodeDoesNotAllocate(t *testing.T) {
	data, err := MarshalLoadReport(&benchReport)
	if err != nil {
		t.Fatal(err)
	}
	bye, err := MarshalGoodbye(&Goodbye{Model: benchReport.Model, WorkerID: 7, Source: "router/a", BootID: 1, Seq: 2, SentAt: 3})
	if err != nil {
		t.Fatal(err)
	}
	dec := NewDecoder()
	if _, err := dec.LoadReport(data); err != nil { // interns the names
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = dec.LoadReport(data) }); n != 0 {
		t.Errorf("LoadReport allocates %v times per report", n)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = dec.Goodbye(bye) }); n != 0 {
		t.Errorf("Goodbye allocates %v times per goodbye", n)
	}
	if dec.data != nil {
		t.Error("the decoder keeps the last payload")
	}
}

func TestDecoderInternIsBounded(t *testing.T) {
	t.Parallel()
	dec := NewDecoder()
	for i := range 3 * maxInterned {
		r := LoadReport{Model: fmt.Sprintf("model-%d", i), WorkerID: 1, DPSize: 1, Source: SourceEngine, BootID: 1, Seq: 1}
		b, err := MarshalLoadReport(&r)
		if err != nil {
			t.Fatal(err)
		}
		got, err := dec.LoadReport(b)
		if err != nil || got.Model != r.Model {
			t.Fatalf("got %q, %v; want %q", got.Model, err, r.Model)
		}
		if len(dec.strs) > maxInterned {
			t.Fatalf("%d strings interned, limit %d", len(dec.strs), maxInterned)
		}
	}
	long := string(make([]byte, MaxModelLen+1))
	dec.intern([]byte(long))
	if _, ok := dec.strs[long]; ok {
		t.Fatal("a string too long for any name was interned")
	}
}

func TestKnownKeyCoversEncodedKeys(t *testing.T) {
	t.Parallel()
	b, err := MarshalLoadReport(&benchReport)
	if err != nil {
		t.Fatal(err)
	}
	raw := map[string]any{}
	if err := msgpackUnmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	if len(raw) != 14 {
		t.Fatalf("benchReport encodes %d keys, want every one of the 14", len(raw))
	}
	for k := range raw {
		if got := keyNames[keyOf([]byte(k))]; got != k {
			t.Errorf("keyOf(%q) names %q", k, got)
		}
	}
	if got := keyOf([]byte("v2")); got != keyUnknown {
		t.Errorf("keyOf(v2) = %d, want keyUnknown", got)
	}
}
