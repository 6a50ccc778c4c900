package main_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// raw is pre-encoded msgpack.
type raw []byte

// rawMap encodes an ordered map; values of type raw are written as they are.
func rawMap(t testing.TB, kv ...any) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true)
	if err := e.EncodeMapLen(len(kv) / 2); err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		if r, ok := kv[i].(raw); ok {
			buf.Write(r)
		} else if err := e.Encode(kv[i]); err != nil {
			t.Fatal(err)
		}
		if r, ok := kv[i+1].(raw); ok {
			buf.Write(r)
		} else if err := e.Encode(kv[i+1]); err != nil {
			t.Fatal(err)
		}
	}
	return buf.Bytes()
}

// reportKV returns the ordered key/values of a valid report, with overrides
// (omit{} removes a key).
func reportKV(model string, worker uint64, over map[string]any) []any {
	base := []any{
		"v", 1, "model", model, "worker_id", worker, "dp_rank", 0, "boot_id", uint64(77), "seq", uint64(1),
		"sent_at", time.Now().UnixNano(), "active_prefill_tokens", 0, "kv_total_blocks", 100, "active_decode_blocks", 0,
	}
	out := []any{}
	seen := map[string]bool{}
	for i := 0; i < len(base); i += 2 {
		k := base[i].(string)
		seen[k] = true
		v := base[i+1]
		if o, ok := over[k]; ok {
			if _, del := o.(omit); del {
				continue
			}
			v = o
		}
		out = append(out, k, v)
	}
	for k, v := range over {
		if !seen[k] {
			if _, del := v.(omit); !del {
				out = append(out, k, v)
			}
		}
	}
	return out
}

func hdr(code byte, n uint64, width int) raw {
	b := []byte{code}
	switch width {
	case 1:
		b = append(b, byte(n))
	case 2:
		b = binary.BigEndian.AppendUint16(b, uint16(n))
	case 4:
		b = binary.BigEndian.AppendUint32(b, uint32(n))
	case 8:
		b = binary.BigEndian.AppendUint64(b, n)
	}
	return b
}

func nested(depth int, open byte, leaf []byte) raw {
	b := bytes.Repeat([]byte{open}, depth)
	return append(b, leaf...)
}

// TestContractHostileInput: malformed and hostile payloads are rejected and
// counted, never a crash; unknown keys are ignored (DESIGN §3).
func TestContractHostileInput(t *testing.T) {
	t.Parallel()
	// long --stale-after: accepted workers must still be free when checked
	m, c, kv := startMonitorKV(t, monOpt{flags: append(append([]string{}, stateFlags...), longStale...)})
	model := "hostile/model.1"
	nextID := uint64(1000)
	type hcase struct {
		name    string
		payload func(id uint64) []byte
		subject func(id uint64) string // default load subject of id rank 0
	}
	valid := func(id uint64, over map[string]any) []byte { return rawMap(t, reportKV(model, id, over)...) }
	mustReject := []hcase{
		{name: "empty", payload: func(uint64) []byte { return nil }},
		{name: "text", payload: func(uint64) []byte { return []byte("hello, world") }},
		{name: "json", payload: func(id uint64) []byte {
			return []byte(fmt.Sprintf(`{"v":1,"model":%q,"worker_id":%d,"boot_id":1,"seq":1,"sent_at":1}`, model, id))
		}},
		{name: "never_used_c1", payload: func(uint64) []byte { return []byte{0xc1} }},
		{name: "nil", payload: func(uint64) []byte { return []byte{0xc0} }},
		{name: "int", payload: func(uint64) []byte { return []byte{0x05} }},
		{name: "string", payload: func(uint64) []byte { return enc(t, "report") }},
		{name: "array", payload: func(id uint64) []byte { return enc(t, []any{1, model, id}) }},
		{name: "array_of_valid_map", payload: func(id uint64) []byte { return append([]byte{0x91}, valid(id, nil)...) }},
		{name: "truncated_half", payload: func(id uint64) []byte { b := valid(id, nil); return b[:len(b)/2] }},
		{name: "truncated_last_byte", payload: func(id uint64) []byte { b := valid(id, nil); return b[:len(b)-1] }},
		{name: "trailing_bytes", payload: func(id uint64) []byte { return append(valid(id, nil), 0x00) }},
		{name: "two_maps", payload: func(id uint64) []byte { return append(valid(id, nil), valid(id, nil)...) }},
		// wrong types of known keys
		{name: "worker_id_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"worker_id": fmt.Sprint(id)}) }},
		{name: "model_int", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": 42}) }},
		{name: "model_bin", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": []byte(model)}) }},
		{name: "seq_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"seq": "1"}) }},
		{name: "boot_id_bool", payload: func(id uint64) []byte { return valid(id, map[string]any{"boot_id": true}) }},
		{name: "sent_at_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"sent_at": "now"}) }},
		{name: "dp_rank_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_rank": "0"}) }},
		{name: "dp_size_array", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_size": []int{1}}) }},
		{name: "source_int", payload: func(id uint64) []byte { return valid(id, map[string]any{"source": 7}) }},
		{name: "prefill_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"active_prefill_tokens": "100"}) }},
		{name: "kv_total_map", payload: func(id uint64) []byte { return valid(id, map[string]any{"kv_total_blocks": map[string]any{"a": 1}}) }},
		{name: "decode_blocks_bool", payload: func(id uint64) []byte { return valid(id, map[string]any{"active_decode_blocks": false}) }},
		{name: "max_batched_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"max_num_batched_tokens": "x"}) }},
		{name: "v_string", payload: func(id uint64) []byte { return valid(id, map[string]any{"v": "1"}) }},
		{name: "worker_id_ext", payload: func(id uint64) []byte { return valid(id, map[string]any{"worker_id": raw{0xd4, 0x01, byte(id)}}) }},
		{name: "worker_id_timestamp", payload: func(id uint64) []byte { return valid(id, map[string]any{"worker_id": time.Unix(int64(id), 0)}) }},
		// negative values
		{name: "worker_id_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"worker_id": -int64(id)}) }},
		{name: "seq_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"seq": -1}) }},
		{name: "boot_id_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"boot_id": -5}) }},
		{name: "dp_rank_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_rank": -1}) }},
		{name: "dp_size_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_size": -1}) }},
		{name: "prefill_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"active_prefill_tokens": -5}) }},
		{name: "decode_blocks_negative_int64", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"active_decode_blocks": raw(hdr(0xd3, uint64(1<<64-1), 8))})
		}},
		{name: "v_negative", payload: func(id uint64) []byte { return valid(id, map[string]any{"v": -1}) }},
		// floats where integers are due
		{name: "worker_id_float", payload: func(id uint64) []byte { return valid(id, map[string]any{"worker_id": float64(id)}) }},
		{name: "seq_float", payload: func(id uint64) []byte { return valid(id, map[string]any{"seq": 1.5}) }},
		{name: "sent_at_float", payload: func(id uint64) []byte { return valid(id, map[string]any{"sent_at": float64(time.Now().UnixNano())}) }},
		{name: "prefill_float32", payload: func(id uint64) []byte { return valid(id, map[string]any{"active_prefill_tokens": float32(10)}) }},
		{name: "dp_rank_float", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_rank": 0.0}) }},
		// out of range
		{name: "dp_rank_over_uint32", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"dp_rank": uint64(1) << 32, "dp_size": uint64(1) << 33})
		}, subject: func(id uint64) string {
			return fmt.Sprintf("%s.load.%s.%d.%d", prefix, modelKey(model), id, uint64(1)<<32)
		}},
		{name: "dp_size_over_uint32", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_size": uint64(1) << 32}) }},
		{name: "dp_start_over_uint32", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_start": uint64(1) << 32}) }},
		{name: "dp_size_zero", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_size": 0}) }},
		{name: "dp_rank_outside", payload: func(id uint64) []byte { return valid(id, map[string]any{"dp_rank": 2, "dp_size": 2}) },
			subject: func(id uint64) string { return loadSubject(model, id, 2) }},
		{name: "sent_at_over_int64", payload: func(id uint64) []byte { return valid(id, map[string]any{"sent_at": uint64(1) << 63}) }},
		// huge lengths
		{name: "map32_huge", payload: func(uint64) []byte { return hdr(0xdf, 0xffffffff, 4) }},
		{name: "map16_short", payload: func(uint64) []byte { return hdr(0xde, 0xffff, 2) }},
		{name: "str32_huge_value", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": raw(hdr(0xdb, 0xffffffff, 4))}) }},
		{name: "str32_huge_key", payload: func(id uint64) []byte { return append(hdr(0x81, 0, 0), hdr(0xdb, 0xfffffff0, 4)...) }},
		{name: "array32_huge_unknown", payload: func(id uint64) []byte { return valid(id, map[string]any{"zz": raw(hdr(0xdd, 0xffffffff, 4))}) }},
		{name: "map32_huge_unknown", payload: func(id uint64) []byte { return valid(id, map[string]any{"zz": raw(hdr(0xdf, 0xffffffff, 4))}) }},
		{name: "bin32_huge_unknown", payload: func(id uint64) []byte { return valid(id, map[string]any{"zz": raw(hdr(0xc6, 0xffffffff, 4))}) }},
		{name: "ext32_huge_unknown", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"zz": raw(append(hdr(0xc9, 0xffffffff, 4), 1))})
		}},
		// over 64 KiB
		{name: "over_64KiB", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"padding": strings.Repeat("x", 64*1024)})
		}},
		{name: "over_64KiB_by_one", payload: func(id uint64) []byte {
			b := valid(id, map[string]any{"padding": ""})
			pad := 64*1024 + 1 - len(b) // str8/16 header length grows: adjust below
			b = valid(id, map[string]any{"padding": strings.Repeat("y", pad-2)})
			for len(b) < 64*1024+1 {
				pad++
				b = valid(id, map[string]any{"padding": strings.Repeat("y", pad-2)})
			}
			return b
		}},
		// deep nesting in a known key
		{name: "model_deep_array", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": nested(20000, 0x91, []byte{0x01})}) }},
		// missing required keys
		{name: "missing_v", payload: func(id uint64) []byte { return valid(id, map[string]any{"v": omit{}}) }},
		{name: "missing_model", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": omit{}}) }},
		{name: "missing_worker_id", payload: func(id uint64) []byte { return valid(id, map[string]any{"worker_id": omit{}}) }},
		{name: "missing_boot_id", payload: func(id uint64) []byte { return valid(id, map[string]any{"boot_id": omit{}}) }},
		{name: "missing_seq", payload: func(id uint64) []byte { return valid(id, map[string]any{"seq": omit{}}) }},
		{name: "missing_sent_at", payload: func(id uint64) []byte { return valid(id, map[string]any{"sent_at": omit{}}) }},
		{name: "nil_seq", payload: func(id uint64) []byte { return valid(id, map[string]any{"seq": nil}) }},
		{name: "empty_map", payload: func(uint64) []byte { return []byte{0x80} }},
		// invalid model names (on the canonical key of the bytes)
		{name: "model_empty", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": ""}) },
			subject: func(id uint64) string { return fmt.Sprintf("%s.load.%s.%d.0", prefix, "=00", id) }},
		{name: "model_257_bytes", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": strings.Repeat("m", 257)}) },
			subject: func(id uint64) string { return loadSubject(strings.Repeat("m", 257), id, 0) }},
		{name: "model_invalid_utf8", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": "bad\xff\xfe"}) },
			subject: func(id uint64) string { return loadSubject("bad\xff\xfe", id, 0) }},
		// version
		{name: "v_2", payload: func(id uint64) []byte { return valid(id, map[string]any{"v": 2}) }},
		{name: "v_0", payload: func(id uint64) []byte { return valid(id, map[string]any{"v": 0}) }},
		// source not a valid name
		{name: "source_empty", payload: func(id uint64) []byte { return valid(id, map[string]any{"source": ""}) }},
		{name: "source_control_char", payload: func(id uint64) []byte { return valid(id, map[string]any{"source": "router/\x00x"}) }},
		// goodbyes
		{name: "bye_garbage", payload: func(uint64) []byte { return []byte{0xc1, 0xff} },
			subject: func(id uint64) string { return byeSubject(model, id) }},
		{name: "bye_array", payload: func(id uint64) []byte { return enc(t, []any{1, 2}) },
			subject: func(id uint64) string { return byeSubject(model, id) }},
		{name: "bye_wrong_type", payload: func(id uint64) []byte {
			return rawMap(t, "v", 1, "model", model, "worker_id", "x", "boot_id", 1, "seq", 1, "sent_at", 1)
		}, subject: func(id uint64) string { return byeSubject(model, id) }},
		{name: "bye_missing_boot", payload: func(id uint64) []byte {
			return rawMap(t, "v", 1, "model", model, "worker_id", id, "seq", 1, "sent_at", 1)
		}, subject: func(id uint64) string { return byeSubject(model, id) }},
		{name: "bye_too_large", payload: func(id uint64) []byte {
			return rawMap(t, "v", 1, "model", model, "worker_id", id, "boot_id", 1, "seq", 1, "sent_at", 1, "pad", strings.Repeat("z", 70000))
		}, subject: func(id uint64) string { return byeSubject(model, id) }},
	}
	// These must not crash; whether they are accepted is not fixed.
	survive := []hcase{
		{name: "deep_array_unknown_key", payload: func(id uint64) []byte { return valid(id, map[string]any{"zz": nested(60000, 0x91, []byte{0xc0})}) }},
		{name: "deep_map_unknown_key", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"zz": nested(20000, 0x81, nil)})
		}},
		{name: "deep_array_before_everything", payload: func(id uint64) []byte {
			return rawMap(t, append([]any{"aaa", nested(60000, 0x91, []byte{0x01})}, reportKV(model, id, nil)...)...)
		}},
		{name: "duplicate_keys", payload: func(id uint64) []byte {
			return rawMap(t, append(reportKV(model, id, nil), "seq", 2, "worker_id", id)...)
		}},
		{name: "bye_unknown_worker", payload: func(id uint64) []byte {
			return rawMap(t, "v", 1, "model", model, "worker_id", id, "boot_id", 1, "seq", 1, "sent_at", 1)
		}, subject: func(id uint64) string { return byeSubject(model, id) }},
		{name: "bye_unknown_model", payload: func(id uint64) []byte {
			return rawMap(t, "v", 1, "model", "nobody/knows", "worker_id", id, "boot_id", 1, "seq", 1, "sent_at", 1)
		}, subject: func(id uint64) string { return byeSubject("nobody/knows", id) }},
		{name: "odd_subject_tokens", payload: func(id uint64) []byte { return valid(id, nil) },
			subject: func(id uint64) string { return fmt.Sprintf("%s.load.%s.x.y", prefix, modelKey(model)) }},
	}
	// These must be accepted: the worker shows.
	accept := []hcase{
		{name: "unknown_keys_of_every_type", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"future_str": "x", "future_map": map[string]any{"a": []any{1, "b", nil}}, "future_float": 1.5,
				"future_bin": []byte{1, 2}, "future_nil": nil, "future_neg": -7, "future_ext": raw{0xd4, 0x05, 0x01}, "future_bool": true})
		}},
		{name: "full_width_uint_encodings", payload: func(id uint64) []byte {
			return rawMap(t, "v", raw(hdr(0xcf, 1, 8)), "model", model, "worker_id", raw(hdr(0xcf, id, 8)), "dp_rank", raw(hdr(0xce, 0, 4)),
				"boot_id", raw(hdr(0xcf, 99, 8)), "seq", raw(hdr(0xcf, 1, 8)), "sent_at", raw(hdr(0xd3, uint64(time.Now().UnixNano()), 8)),
				"active_prefill_tokens", raw(hdr(0xcd, 0, 2)), "kv_total_blocks", raw(hdr(0xcc, 100, 1)))
		}},
		{name: "positive_values_in_signed_formats", payload: func(id uint64) []byte {
			return rawMap(t, "v", raw(hdr(0xd0, 1, 1)), "model", model, "worker_id", raw(hdr(0xd3, id, 8)), "dp_rank", raw(hdr(0xd2, 0, 4)),
				"boot_id", raw(hdr(0xd3, 99, 8)), "seq", raw(hdr(0xd1, 1, 2)), "sent_at", raw(hdr(0xd3, uint64(time.Now().UnixNano()), 8)),
				"active_prefill_tokens", raw(hdr(0xd3, 0, 8)), "kv_total_blocks", raw(hdr(0xd0, 100, 1)))
		}},
		{name: "str8_str16_keys_and_model", payload: func(id uint64) []byte {
			s8 := func(s string) raw { return append(hdr(0xd9, uint64(len(s)), 1), s...) }
			s16 := func(s string) raw { return append(hdr(0xda, uint64(len(s)), 2), s...) }
			return rawMap(t, s8("v"), 1, s16("model"), s16(model), s8("worker_id"), id, "boot_id", 5, "seq", 1, "sent_at", time.Now().UnixNano())
		}},
		{name: "optional_nil_is_absent", payload: func(id uint64) []byte {
			return valid(id, map[string]any{"dp_start": nil, "dp_size": nil, "source": nil, "active_prefill_tokens": nil, "max_num_batched_tokens": nil})
		}},
		{name: "non_string_key_skipped", payload: func(id uint64) []byte { return rawMap(t, append(reportKV(model, id, nil), 7, "x", true, 1)...) }},
		{name: "negative_sent_at", payload: func(id uint64) []byte { return valid(id, map[string]any{"sent_at": -5}) }},
		{name: "just_under_64KiB", payload: func(id uint64) []byte {
			pad := 60000
			b := valid(id, map[string]any{"padding": strings.Repeat("y", pad)})
			for len(b) < 64*1024 {
				pad++
				b = valid(id, map[string]any{"padding": strings.Repeat("y", pad)})
			}
			if len(b) > 64*1024 {
				pad--
				b = valid(id, map[string]any{"padding": strings.Repeat("y", pad)})
			}
			return b
		}},
		{name: "minimal_required_only", payload: func(id uint64) []byte {
			return rawMap(t, "v", 1, "model", model, "worker_id", id, "boot_id", 5, "seq", 1, "sent_at", time.Now().UnixNano())
		}},
		{name: "max_uint64_worker", payload: func(uint64) []byte { return valid(^uint64(0), nil) },
			subject: func(uint64) string { return loadSubject(model, ^uint64(0), 0) }},
		{name: "model_256_bytes", payload: func(id uint64) []byte { return valid(id, map[string]any{"model": strings.Repeat("é", 128)}) },
			subject: func(id uint64) string { return loadSubject(strings.Repeat("é", 128), id, 0) }},
	}

	subjectOf := func(h hcase, id uint64) string {
		if h.subject != nil {
			return h.subject(id)
		}
		return loadSubject(model, id, 0)
	}
	before := m.rejected(t, "")
	rejectIDs := map[uint64]string{}
	for _, h := range mustReject {
		nextID++
		rejectIDs[nextID] = h.name
		publish(t, c.nc, subjectOf(h, nextID), h.payload(nextID))
	}
	survID := map[uint64]string{}
	for _, h := range survive {
		nextID++
		survID[nextID] = h.name
		publish(t, c.nc, subjectOf(h, nextID), h.payload(nextID))
	}
	acceptIDs := map[uint64]string{}
	for _, h := range accept {
		nextID++
		id := nextID
		if h.name == "max_uint64_worker" {
			id = ^uint64(0)
		}
		acceptIDs[id] = h.name
		publish(t, c.nc, subjectOf(h, nextID), h.payload(nextID))
	}
	if !m.alive() {
		t.Fatalf("monitor died: %v", m.err)
	}
	r := barrier(t, c, model)
	for id, name := range rejectIDs {
		if w := r.where(id); w != "" {
			t.Errorf("%s: worker %d was accepted (listed in %s)", name, id, w)
		}
	}
	for id, name := range acceptIDs {
		if name == "model_256_bytes" {
			continue
		}
		if w := r.where(id); w != "free" {
			t.Errorf("%s: worker %d should be accepted and free, is in %q", name, id, w)
		}
	}
	// the 256-byte model is valid: it gets its own record
	waitRecordFor(t, kv, strings.Repeat("é", 128), "256-byte model accepted", 3*time.Second, func(r record) bool { return r.where(1000+uint64(len(mustReject)+len(survive)+len(accept))) == "free" })
	if !t.Failed() && len(r.reasons()) != 0 {
		t.Errorf("reasons: %v", r)
	}
	if !m.alive() {
		t.Fatalf("monitor died: %v", m.err)
	}
	resp, err := http.Get(m.base + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz after hostile input: %v %v", resp, err)
	}
	resp.Body.Close()
	want := before + float64(len(mustReject))
	deadline := time.Now().Add(5 * time.Second)
	for m.rejected(t, "") < want && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("%d must-reject payloads; %s grew by %v", len(mustReject), rejectedMetric, m.rejected(t, "")-before)
	if got := m.rejected(t, ""); got < want {
		t.Errorf("%s grew by %v, want >= %d (one per rejected message)", rejectedMetric, got-before, len(mustReject))
		resp, _ := http.Get(m.base + "/metrics")
		var b bytes.Buffer
		b.ReadFrom(resp.Body)
		resp.Body.Close()
		for _, l := range strings.Split(b.String(), "\n") {
			if strings.HasPrefix(l, rejectedMetric) {
				t.Log(l)
			}
		}
	}
	// rejected messages do not make models known to the API
	for _, e := range getThresholds(t, m.base) {
		name, _ := e["model"].(string)
		if name != model && name != strings.Repeat("é", 128) {
			t.Errorf("GET /busy_threshold lists %.80q, known only from a rejected message", name)
		}
	}
	// still works
	newPub(t, c, model, 1).report(0, hotLoad)
	waitRecord(t, kv, model, "worker 1 busy after the hostile input", func(r record) bool { return r.has("busy", 1) })
}
