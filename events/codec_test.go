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
	case "waiting_requests":
		return opt(r.WaitingRequests)
	case "running_requests":
		return opt(r.RunningRequests)
	case "preemptions":
		return opt(r.Preemptions)
	case "prefilled_tokens":
		return opt(r.PrefilledTokens)
	case "kv_committed_blocks":
		return opt(r.KVCommittedBlocks)
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
		{"negative preemptions", with("preemptions", -1), ErrOutOfRange},
		{"float prefilled_tokens", with("prefilled_tokens", 1.5), ErrWrongType},
		{"string waiting_requests", with("waiting_requests", "3"), ErrWrongType},
		{"bool running_requests", with("running_requests", false), ErrWrongType},
		{"array kv_committed_blocks", with("kv_committed_blocks", []int{1}), ErrWrongType},
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

// TestLoadReportLeadingFields: the §21 fields round-trip, each absent when
// unset (left out of the payload, not written as 0), and a present 0 stays
// present.
func TestLoadReportLeadingFields(t *testing.T) {
	t.Parallel()
	base := LoadReport{Model: "m", WorkerID: 1, DPSize: 1, Source: SourceEngine, BootID: 2, Seq: 3, SentAt: 4}
	names := []string{"waiting_requests", "running_requests", "preemptions", "prefilled_tokens", "kv_committed_blocks"}
	set := []func(*LoadReport, Optional){
		func(r *LoadReport, o Optional) { r.WaitingRequests = o },
		func(r *LoadReport, o Optional) { r.RunningRequests = o },
		func(r *LoadReport, o Optional) { r.Preemptions = o },
		func(r *LoadReport, o Optional) { r.PrefilledTokens = o },
		func(r *LoadReport, o Optional) { r.KVCommittedBlocks = o },
	}
	for i, name := range names {
		for _, v := range []uint64{0, 7, math.MaxUint64} {
			t.Run(fmt.Sprintf("%s=%d", name, v), func(t *testing.T) {
				t.Parallel()
				r := base
				set[i](&r, Some(v))
				b, err := MarshalLoadReport(&r)
				if err != nil {
					t.Fatal(err)
				}
				raw := map[string]any{}
				if err := msgpackUnmarshal(b, &raw); err != nil {
					t.Fatal(err)
				}
				for _, other := range names {
					if _, ok := raw[other]; ok != (other == name) {
						t.Errorf("key %s on the wire: %v", other, ok)
					}
				}
				back, err := DecodeLoadReport(b)
				if err != nil || back != r {
					t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
				}
				if got := reportField(back, name); got != v {
					t.Errorf("%s = %v, want %d", name, got, v)
				}
			})
		}
	}
	b, err := MarshalLoadReport(&base)
	if err != nil {
		t.Fatal(err)
	}
	back, err := DecodeLoadReport(b)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if got := reportField(back, name); got != nil {
			t.Errorf("%s = %v on a report without it, want absent", name, got)
		}
	}
}

// TestBusySetLeadingFields: the record carries saturation and the two §21
// thresholds; a record written before them decodes with saturation 0 and
// both thresholds unset.
func TestBusySetLeadingFields(t *testing.T) {
	t.Parallel()
	in := BusySet{Model: "m", Saturation: 1.25,
		Thresholds: Thresholds{KVCommitted: Ptr(1.5), QueueDelayMs: Ptr[uint64](250)}}
	b, err := MarshalBusySet(&in)
	if err != nil {
		t.Fatal(err)
	}
	raw := map[string]any{}
	if err := msgpackUnmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	th, _ := raw["thresholds"].(map[string]any)
	if fmt.Sprint(raw["saturation"]) != "1.25" || fmt.Sprint(th["kv_committed_threshold"]) != "1.5" ||
		fmt.Sprint(th["queue_delay_threshold_ms"]) != "250" || len(th) != 2 {
		t.Fatalf("saturation %#v, thresholds %#v", raw["saturation"], th)
	}
	got, err := DecodeBusySet(b)
	if err != nil || got.Saturation != 1.25 || !got.Thresholds.Equal(in.Thresholds) {
		t.Fatalf("decode: %+v, %v", got, err)
	}
	delete(raw, "saturation")
	raw["thresholds"] = map[string]any{}
	old, err := msgpack.Marshal(raw)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeBusySet(old); err != nil || got.Saturation != 0 || !got.Thresholds.IsZero() {
		t.Fatalf("older record: %+v, %v", got, err)
	}
}

func TestRoundSaturation(t *testing.T) {
	t.Parallel()
	for in, want := range map[float64]float64{0: 0, 0.004: 0, 0.005: 0.01, 1.2345: 1.23, 1.235001: 1.24, 4: 4, 2.0 / 3: 0.67} {
		if got := RoundSaturation(in); got != want {
			t.Errorf("RoundSaturation(%v) = %v, want %v", in, got, want)
		}
	}
}

func TestThresholdsMergeEqualLeading(t *testing.T) {
	t.Parallel()
	a := Thresholds{ActiveDecodeBlocks: Ptr(0.5), KVCommitted: Ptr(1.0)}
	b := Thresholds{QueueDelayMs: Ptr[uint64](100), KVCommitted: Ptr(2.0)}
	m := a.Merge(b)
	if *m.KVCommitted != 2 || *m.QueueDelayMs != 100 || *m.ActiveDecodeBlocks != 0.5 {
		t.Fatalf("merge: %+v", m)
	}
	if m.Equal(a) || !m.Equal(m.Merge(Thresholds{})) {
		t.Error("Equal ignores the leading thresholds")
	}
	if (Thresholds{QueueDelayMs: Ptr[uint64](0)}).IsZero() || (Thresholds{KVCommitted: Ptr(0.0)}).IsZero() {
		t.Error("IsZero ignores the leading thresholds")
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
		{Thresholds{KVCommitted: Ptr(0.0), QueueDelayMs: Ptr[uint64](0)}, true},
		{Thresholds{KVCommitted: Ptr(4.0), QueueDelayMs: Ptr[uint64](math.MaxUint64)}, true},
		{Thresholds{KVCommitted: Ptr(4.0000001)}, false},
		{Thresholds{KVCommitted: Ptr(-0.01)}, false},
		{Thresholds{KVCommitted: Ptr(math.NaN())}, false},
		{Thresholds{KVCommitted: Ptr(math.Inf(1))}, false},
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
	if len(raw) != len(keyNames)-1 {
		t.Fatalf("benchReport encodes %d keys, want every one of the %d", len(raw), len(keyNames)-1)
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
