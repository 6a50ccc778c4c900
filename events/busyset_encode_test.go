package events

import (
	"bytes"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// recordGeneric decodes a record into plain maps and lists, so that two
// encodings compare by content (map order aside).
func recordGeneric(t *testing.T, data []byte) map[string]any {
	t.Helper()
	var m map[string]any
	dec := msgpack.NewDecoder(strings.NewReader(string(data)))
	dec.UseLooseInterfaceDecoding(true) // every integer as int64 or uint64
	// Nested maps keyed by integers too (queued_by, queued).
	dec.SetMapDecoder(func(d *msgpack.Decoder) (any, error) { return d.DecodeUntypedMap() })
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("decode: %v", err)
	}
	return m
}

// reflectBusySet encodes a record by reflection over its msgpack tags, nil
// lists and maps written empty: the reference AppendBusySet is checked
// against.
func reflectBusySet(t testing.TB, b *BusySet) []byte {
	t.Helper()
	rec := *b
	rec.V = SchemaVersion
	for _, l := range []*[]uint64{&rec.Busy, &rec.Free, &rec.Stale, &rec.Amber, &rec.Hard} {
		if *l == nil {
			*l = []uint64{}
		}
	}
	if rec.Reasons == nil {
		rec.Reasons = map[string]string{}
	}
	if rec.QueuedBy == nil {
		rec.QueuedBy = map[string]map[int64]uint64{}
	}
	if rec.Queued == nil {
		rec.Queued = map[int64]uint64{}
	}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true)
	if err := e.Encode(&rec); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestAppendBusySetMatchesReflection: the hand-written encoder writes what
// the msgpack tags of BusySet say, for records of every shape, and every
// field of BusySet (a field added there must be added to AppendBusySet).
func TestAppendBusySetMatchesReflection(t *testing.T) {
	t.Parallel()
	big := BusySet{Model: "org/big", Reasons: map[string]string{}}
	for i := range uint64(3000) {
		switch i % 3 {
		case 0:
			big.Busy = append(big.Busy, i)
			big.Reasons[strconv.FormatUint(i, 10)] = ReasonKV
		case 1:
			big.Free = append(big.Free, i)
		default:
			big.Stale = append(big.Stale, i)
		}
	}
	big.Amber, big.Hard = big.Free[:100], big.Busy[:50]
	tests := []struct {
		name string
		rec  BusySet
	}{
		{"empty", BusySet{Model: "m"}},
		{"every field", BusySet{V: 1, Model: "Qwen/Qwen3-0.6B", Busy: []uint64{3, 1 << 40}, Free: []uint64{1, 200, 70000},
			Stale: []uint64{math.MaxUint64}, AllBusy: true, Amber: []uint64{1}, Hard: []uint64{3},
			Reasons: map[string]string{"3": ReasonKVPrefill, "1099511627776": ReasonCordoned},
			Thresholds: Thresholds{ActiveDecodeBlocks: Ptr(0.85), ActivePrefillTokens: Ptr[uint64](1 << 33),
				ActivePrefillTokensFrac: Ptr(1.5), KVCommitted: Ptr(1.25), QueueDelayMs: Ptr[uint64](60_000)},
			Routers: 3, Saturation: 0.37,
			QueuedBy: map[string]map[int64]uint64{"router/a": {0: 3, -1: 200}, "router/b": {math.MaxInt64: 1, math.MinInt64: 1 << 40}},
			Queued:   map[int64]uint64{0: 3, -1: 200, math.MaxInt64: 1, math.MinInt64: 1 << 40}, UpdatedAt: 1_763_769_600_000_000_000, MonitorID: strings.Repeat("m", 40), Epoch: 300, Seq: 1 << 20}},
		{"negative updated_at", BusySet{Model: "m", UpdatedAt: -5_000_000}},
		{"reasons of workers not busy, busy not sorted", BusySet{Model: "m", Busy: []uint64{9, 2, 2},
			Reasons: map[string]string{"9": "kv", "2": "prefill", "10": "kv", "x": "kv", "07": "kv"}}},
		{"big", big},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			want := reflectBusySet(t, &tt.rec)
			got := AppendBusySet(nil, &tt.rec)
			if g, w := recordGeneric(t, got), recordGeneric(t, want); !reflect.DeepEqual(g, w) {
				t.Fatalf("AppendBusySet = %v\nby reflection = %v", g, w)
			}
			back, err := DecodeBusySet(got)
			if err != nil {
				t.Fatal(err)
			}
			if back.Model != tt.rec.Model || len(back.Reasons) != len(tt.rec.Reasons) ||
				!reflect.DeepEqual(back.Queued, tt.rec.Queued) && len(tt.rec.Queued) > 0 ||
				!reflect.DeepEqual(back.QueuedBy, tt.rec.QueuedBy) && len(tt.rec.QueuedBy) > 0 {
				t.Errorf("decoded %+v", back)
			}
		})
	}
	t.Run("every field of BusySet", func(t *testing.T) {
		t.Parallel()
		m := recordGeneric(t, AppendBusySet(nil, &BusySet{Model: "m"}))
		typ := reflect.TypeFor[BusySet]()
		if len(m) != typ.NumField() {
			t.Errorf("%d keys written, BusySet has %d fields", len(m), typ.NumField())
		}
		for i := range typ.NumField() {
			key, _, _ := strings.Cut(typ.Field(i).Tag.Get("msgpack"), ",")
			if _, ok := m[key]; !ok {
				t.Errorf("field %s (%q) not written", typ.Field(i).Name, key)
			}
		}
	})
}

// BenchmarkAppendBusySet compares the encoder with msgpack reflection on
// records of 1 and 10,000 workers (half busy).
func BenchmarkAppendBusySet(b *testing.B) {
	for _, workers := range []uint64{1, 10_000} {
		rec := BusySet{Model: "bench/model", Reasons: map[string]string{}, MonitorID: "host-abcdef",
			Thresholds: Thresholds{ActiveDecodeBlocks: Ptr(0.5)}, UpdatedAt: 1_763_769_600_000_000_000, Epoch: 3, Seq: 12345}
		for i := range workers {
			if i%2 == 0 {
				rec.Busy = append(rec.Busy, i)
				rec.Reasons[strconv.FormatUint(i, 10)] = ReasonKV
			} else {
				rec.Free = append(rec.Free, i)
			}
		}
		b.Run("workers="+strconv.FormatUint(workers, 10)+"/AppendBusySet", func(b *testing.B) {
			b.ReportAllocs()
			var buf []byte
			for b.Loop() {
				buf = AppendBusySet(buf[:0], &rec)
			}
		})
		b.Run("workers="+strconv.FormatUint(workers, 10)+"/reflection", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				reflectBusySet(b, &rec)
			}
		})
	}
}
