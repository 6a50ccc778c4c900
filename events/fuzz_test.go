package events

import (
	"encoding/hex"
	"os"
	"testing"
)

func addVectorSeeds(f *testing.F) {
	data, err := os.ReadFile("../testdata/contract-vectors.json")
	if err != nil {
		f.Fatal(err)
	}
	var v vectorFile
	if err := jsonUnmarshal(data, &v); err != nil {
		f.Fatal(err)
	}
	for _, r := range v.Reports {
		b, err := hex.DecodeString(r.Hex)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
}

// FuzzDecodeLoadReport checks that no input crashes the decoder, and that
// every accepted report survives an encode/decode round trip unchanged.
func FuzzDecodeLoadReport(f *testing.F) {
	addVectorSeeds(f)
	dec, enc := NewDecoder(), NewEncoder()
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := dec.LoadReport(data)
		if err != nil {
			if Reason(err) == "other" {
				t.Fatalf("error without a reason label: %v", err)
			}
			return
		}
		b, err := enc.LoadReport(&r)
		if err != nil {
			t.Fatalf("accepted report does not encode: %+v: %v", r, err)
		}
		back, err := dec.LoadReport(b)
		if err != nil || back != r {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
		}
	})
}

// FuzzDecodeGoodbye checks that no input crashes the goodbye decoder.
func FuzzDecodeGoodbye(f *testing.F) {
	addVectorSeeds(f)
	g := Goodbye{Model: "m", WorkerID: 1, Source: SourceEngine, BootID: 1, Seq: 1, SentAt: 1}
	b, _ := MarshalGoodbye(&g)
	f.Add(b)
	dec, enc := NewDecoder(), NewEncoder()
	f.Fuzz(func(t *testing.T, data []byte) {
		g, err := dec.Goodbye(data)
		if err != nil {
			return
		}
		b, err := enc.Goodbye(&g)
		if err != nil {
			t.Fatalf("accepted goodbye does not encode: %+v: %v", g, err)
		}
		if back, err := dec.Goodbye(b); err != nil || back != g {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, g)
		}
	})
}

// FuzzDecodeBusySet checks that a hostile record never crashes a router.
func FuzzDecodeBusySet(f *testing.F) {
	b, _ := MarshalBusySet(&BusySet{Model: "m", Busy: []uint64{1}, Reasons: map[string]string{"1": "kv"}})
	f.Add(b)
	b, _ = MarshalBusySet(&BusySet{Model: "m", Busy: []uint64{1, 2}, Free: []uint64{3, 4}, Amber: []uint64{4}, Hard: []uint64{2},
		Reasons: map[string]string{"1": "kv", "2": "prefill"}})
	f.Add(b)
	b, _ = MarshalBusySet(&BusySet{Model: "m", Busy: []uint64{1}, Routers: 3, Reasons: map[string]string{"1": "kv"}})
	f.Add(b)
	b, _ = MarshalBusySet(&BusySet{Model: "m", Free: []uint64{1}, Routers: 2,
		QueuedBy: map[string]map[int64]uint64{"router/a": {0: 3, -1: 1}}, Queued: map[int64]uint64{0: 3, -1: 1}})
	f.Add(b)
	f.Add([]byte{0x80})
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = DecodeBusySet(data)
	})
}

func FuzzDecodeMigrateRequest(f *testing.F) {
	ok, _ := MarshalMigrateRequest(MigrateRequest{Model: "m", Src: 1, Dst: 2, MaxRequests: 1, Reason: MigrateReasonFailover, Epoch: 3})
	f.Add(ok)
	f.Add([]byte{0x80})
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := DecodeMigrateRequest(data)
		if err != nil {
			return
		}
		again, err := MarshalMigrateRequest(r)
		if err != nil {
			t.Fatalf("a decoded request does not encode: %v", err)
		}
		if r2, err := DecodeMigrateRequest(again); err != nil || r2 != r {
			t.Fatalf("round trip: %+v, %v; want %+v", r2, err, r)
		}
	})
}
