package events

import (
	"errors"
	"hash/fnv"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func msgpackUnmarshal(b []byte, v any) error { return msgpack.Unmarshal(b, v) }

func TestModelKeyVectors(t *testing.T) {
	t.Parallel()
	for _, v := range loadVectors(t).ModelKeys {
		if got := ModelKey(v.Model); got != v.Key {
			t.Errorf("ModelKey(%q) = %q, want %q", v.Model, got, v.Key)
		}
		if got, err := ParseModelKey(v.Key); err != nil || got != v.Model {
			t.Errorf("ParseModelKey(%q) = %q, %v; want %q", v.Key, got, err, v.Model)
		}
		if !matchModel(v.Key, v.Model) {
			t.Errorf("matchModel(%q, %q) = false", v.Key, v.Model)
		}
	}
}

func TestParseModelKeyRejectsNonCanonical(t *testing.T) {
	t.Parallel()
	for _, key := range []string{"", "Qwen3-0=2e6B", "a=41", "a=2", "a=", "a.b", "a b", "=GG", "=FF"} {
		if m, err := ParseModelKey(key); !errors.Is(err, ErrInvalidModel) {
			t.Errorf("ParseModelKey(%q) = %q, %v; want ErrInvalidModel", key, m, err)
		}
		if matchModel(key, "a") && key != "a" {
			t.Errorf("matchModel(%q, a) = true", key)
		}
	}
}

func TestParseSubject(t *testing.T) {
	t.Parallel()
	tests := []struct {
		prefix, subject string
		want            Subject
		ok              bool
	}{
		{"workermon", "workermon.load.m.1.2", Subject{Kind: KindLoad, ModelKey: "m", WorkerID: "1", DPRank: "2"}, true},
		{"workermon", "workermon.part.3.load.m.1.2", Subject{Kind: KindLoad, Mapped: true, Partition: 3, ModelKey: "m", WorkerID: "1", DPRank: "2"}, true},
		{"workermon", "workermon.part.0.bye.m.1", Subject{Kind: KindBye, Mapped: true, ModelKey: "m", WorkerID: "1"}, true},
		{"workermon", "workermon.part.03.load.m.1.2", Subject{}, false},
		{"workermon", "workermon.part.x.load.m.1.2", Subject{}, false},
		{"workermon", "workermon.part.1.part.2.load.m.1.2", Subject{}, false},
		{"a.b", "a.b.bye.m.1", Subject{Kind: KindBye, ModelKey: "m", WorkerID: "1"}, true},
		{"workermon", "workermon.load.m.1", Subject{}, false},
		{"workermon", "workermon.bye.m.1.2", Subject{}, false},
		{"workermon", "workermon.load..1.2", Subject{}, false},
		{"workermon", "other.load.m.1.2", Subject{}, false},
		{"workermon", "workermon.hello.m.1", Subject{}, false},
		{"workermon", "workermon.est.m.1.2", Subject{Kind: KindEst, ModelKey: "m", WorkerID: "1", DPRank: "2"}, true},
		{"workermon", "workermon.est.m.1.bye", Subject{Kind: KindEstBye, ModelKey: "m", WorkerID: "1"}, true},
		{"workermon", "workermon.part.2.est.m.1.bye", Subject{Kind: KindEstBye, Mapped: true, Partition: 2, ModelKey: "m", WorkerID: "1"}, true},
		{"workermon", "workermon.est.m.1", Subject{}, false},
		{"workermon", "workermon.est.m.1.", Subject{}, false},
		{"workermon", "workermon.est.m.1.2.3", Subject{}, false},
	}
	for _, tt := range tests {
		got, err := ParseSubject(tt.prefix, tt.subject)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseSubject(%q, %q) = %+v, %v", tt.prefix, tt.subject, got, err)
		}
		if err != nil && !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("error %v does not wrap ErrInvalidSubject", err)
		}
	}
}

func TestLoadSubjectRoundTrip(t *testing.T) {
	t.Parallel()
	r := LoadReport{Model: "org/m:1.5 b", WorkerID: 18446744073709551615, DPRank: 7, DPStart: 4, DPSize: 4,
		Source: SourceEngine, BootID: 1, Seq: 1, SentAt: 1}
	s, err := ParseSubject("workermon", LoadSubject("workermon", r.Model, r.WorkerID, r.DPRank))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Match(s); err != nil {
		t.Fatal(err)
	}
	r.DPRank = 6
	if err := r.Match(s); !errors.Is(err, ErrMismatch) {
		t.Fatalf("rank mismatch accepted: %v", err)
	}
	r.DPRank, r.Source = 7, RouterSourcePrefix+"r1"
	if err := r.Match(s); !errors.Is(err, ErrSourceNotAllowed) || Reason(err) != "source_not_allowed" {
		t.Fatalf("router estimate on a load subject: %v", err)
	}
	est, err := ParseSubject("workermon", EstSubject("workermon", r.Model, r.WorkerID, r.DPRank))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Match(est); err != nil {
		t.Fatalf("router estimate on its est subject: %v", err)
	}
	r.Source = SourceEngine
	if err := r.Match(est); !errors.Is(err, ErrSourceNotAllowed) {
		t.Fatalf("engine report on an est subject: %v", err)
	}
}

func FuzzModelKey(f *testing.F) {
	for _, s := range []string{"Qwen/Qwen3-0.6B", "a b", "x=y", "über", "*>", "_/-", "\xff", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, model string) {
		key := ModelKey(model)
		if !matchModel(key, model) {
			t.Fatalf("matchModel(ModelKey(%q)) = false", model)
		}
		for i := 0; i < len(key); i++ {
			if !keepByte(key[i]) && key[i] != '=' {
				t.Fatalf("key %q has byte %q", key, key[i])
			}
		}
		back, err := ParseModelKey(key)
		if ValidateModel(model) != nil {
			if err == nil {
				t.Fatalf("ParseModelKey accepted the key of invalid model %q", model)
			}
			return
		}
		if err != nil || back != model {
			t.Fatalf("round trip of %q: %q, %v", model, back, err)
		}
	})
}

func FuzzParseModelKey(f *testing.F) {
	for _, s := range []string{"Qwen/Qwen3-0=2E6B", "=C3=BCber", "a=2e", "=", "a=4"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		model, err := ParseModelKey(key)
		if err != nil {
			return
		}
		if ModelKey(model) != key {
			t.Fatalf("ParseModelKey(%q) = %q, which encodes to %q", key, model, ModelKey(model))
		}
	})
}

func TestPartition(t *testing.T) {
	t.Parallel()
	// The standard library's FNV-1a is the reference.
	ref := func(s string) uint32 {
		h := fnv.New32a()
		_, _ = h.Write([]byte(s))
		return h.Sum32()
	}
	for _, model := range []string{"Qwen/Qwen3-0.6B", "a b", "m", "meta-llama/Llama-3.1-8B-Instruct"} {
		for _, n := range []int{2, 3, 8, 64} {
			want := int(ref(ModelKey(model)) % uint32(n))
			if got := Partition(model, n); got != want {
				t.Errorf("Partition(%q, %d) = %d, want %d", model, n, got, want)
			}
		}
		if got := Partition(model, 1); got != 0 {
			t.Errorf("Partition(%q, 1) = %d", model, got)
		}
	}
}

func TestParseWorkerKey(t *testing.T) {
	t.Parallel()
	for key, want := range map[string]struct {
		model  string
		worker uint64
		ok     bool
	}{
		"Qwen/Qwen3-0=2E6B.17":   {"Qwen/Qwen3-0.6B", 17, true},
		"m.0":                    {"m", 0, true},
		"m.18446744073709551615": {"m", 1<<64 - 1, true},
		"m":                      {},
		"m.":                     {},
		"m.01":                   {},
		"m.+1":                   {},
		"m.1.2":                  {},
		"m=2e.1":                 {},
		".1":                     {},
	} {
		model, worker, err := ParseWorkerKey(key)
		if (err == nil) != want.ok || err == nil && (model != want.model || worker != want.worker) {
			t.Errorf("ParseWorkerKey(%q) = %q, %d, %v", key, model, worker, err)
		}
	}
}
