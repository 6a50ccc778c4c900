package main_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"mime"
	"net/url"
	"sort"
	"strings"
	"testing"
	"time"
)

var thrKeys = []string{"active_decode_blocks_threshold", "active_prefill_tokens_threshold", "active_prefill_tokens_threshold_frac"}

func jsonObj(t testing.TB, b []byte) map[string]any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var m map[string]any
	if err := d.Decode(&m); err != nil {
		t.Fatalf("not a JSON object: %v: %s", err, b)
	}
	return m
}

func isJSON(h httpResp) bool {
	mt, _, err := mime.ParseMediaType(h.header.Get("Content-Type"))
	return err == nil && mt == "application/json"
}

// checkAPIError: status code and a JSON {"error": "..."} body.
func checkAPIError(t testing.TB, what string, h httpResp, codes ...int) {
	t.Helper()
	ok := false
	for _, c := range codes {
		ok = ok || h.code == c
	}
	if !ok {
		t.Errorf("%s: status %d, want %v; body %s", what, h.code, codes, h.body)
		return
	}
	if !isJSON(h) {
		t.Errorf("%s: Content-Type %q, want application/json", what, h.header.Get("Content-Type"))
	}
	var m map[string]any
	if err := json.Unmarshal(h.body, &m); err != nil {
		t.Errorf("%s: error body is not JSON: %s", what, h.body)
		return
	}
	if s, ok := m["error"].(string); !ok || s == "" {
		t.Errorf("%s: body %s lacks a non-empty \"error\" string", what, h.body)
	}
}

// thrEntry is one model's thresholds as JSON values (nil = null).
type thrEntry map[string]any

func (e thrEntry) num(k string) (float64, bool) {
	n, ok := e[k].(json.Number)
	if !ok {
		return 0, false
	}
	f, err := n.Float64()
	return f, err == nil
}

func (e thrEntry) String() string { b, _ := json.Marshal(map[string]any(e)); return string(b) }

// expect compares the entry to want (nil = must be null); every key must be present.
func (e thrEntry) expect(t testing.TB, what string, want [3]any) {
	t.Helper()
	for i, k := range thrKeys {
		v, present := e[k]
		if !present {
			t.Errorf("%s: %q missing (unset must be null): %v", what, k, e)
			continue
		}
		if want[i] == nil {
			if v != nil {
				t.Errorf("%s: %s = %v, want null: %v", what, k, v, e)
			}
			continue
		}
		got, ok := e.num(k)
		if !ok || got != want[i].(float64) {
			t.Errorf("%s: %s = %v, want %v: %v", what, k, v, want[i], e)
		}
	}
}

func getThresholds(t testing.TB, base string) []thrEntry {
	t.Helper()
	h := doHTTP(t, "GET", base+"/busy_threshold", "", nil)
	if h.code != 200 {
		t.Fatalf("GET /busy_threshold: %d %s", h.code, h.body)
	}
	if !isJSON(h) {
		t.Errorf("GET /busy_threshold Content-Type %q", h.header.Get("Content-Type"))
	}
	m := jsonObj(t, h.body)
	arr, ok := m["thresholds"].([]any)
	if !ok {
		t.Fatalf("GET /busy_threshold: no thresholds array: %s", h.body)
	}
	out := []thrEntry{}
	for _, a := range arr {
		o, ok := a.(map[string]any)
		if !ok {
			t.Fatalf("entry %v is not an object", a)
		}
		out = append(out, thrEntry(o))
	}
	return out
}

func findEntry(es []thrEntry, model string) (thrEntry, bool) {
	for _, e := range es {
		if e["model"] == model {
			return e, true
		}
	}
	return nil, false
}

// replyEntry reads a POST reply: the model's effective thresholds (a flat
// object, or wrapped in {"thresholds":[…]}).
func replyEntry(t testing.TB, h httpResp, model string) thrEntry {
	t.Helper()
	m := jsonObj(t, h.body)
	if arr, ok := m["thresholds"].([]any); ok && len(arr) == 1 {
		m, _ = arr[0].(map[string]any)
	}
	e := thrEntry(m)
	if e["model"] != model {
		t.Errorf("reply model = %v, want %q: %s", e["model"], model, h.body)
	}
	return e
}

func postThr(t testing.TB, base, body string, hdr ...string) httpResp {
	t.Helper()
	return doHTTP(t, "POST", base+"/busy_threshold", "application/json", []byte(body), hdr...)
}

func deleteThr(t testing.TB, base, model string, hdr ...string) httpResp {
	t.Helper()
	return doHTTP(t, "DELETE", base+"/busy_threshold?model="+url.QueryEscape(model), "", nil, hdr...)
}

// waitEntry polls GET /busy_threshold until the model's entry satisfies cond.
func waitEntry(t testing.TB, base, model, what string, cond func(thrEntry) bool) thrEntry {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		e, ok := findEntry(getThresholds(t, base), model)
		if ok && cond(e) {
			return e
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s: last entry %v (found %v)", base, what, e, ok)
		}
		time.Sleep(30 * time.Millisecond)
	}
}

var longStale = []string{"--stale-after", "60s", "--gone-after", "120s"}

// long returns flags followed by longStale (a new slice): for tests that
// must not see a worker go stale while a loaded machine runs them.
func long(flags ...string) []string {
	return append(append([]string{}, flags...), longStale...)
}

// TestContractThresholdAPI covers DESIGN §8.
func TestContractThresholdAPI(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: append([]string{"--active-decode-blocks-threshold", "0.5"}, longStale...)})

	model := "api/Model A.1"
	// worker 1: prefill 200, kv 10/100: free under the default (kv only)
	newPub(t, c, model, 1).report(0, map[string]any{"active_prefill_tokens": 200, "active_decode_blocks": 10, "kv_total_blocks": 100, "max_num_batched_tokens": 1000})
	// worker 2 keeps the model's all_busy false
	newPub(t, c, model, 2).report(0, coldLoad)
	others := []string{"api/zz-last", "api/AA-first", "api/mm middle"}
	for _, o := range others {
		newPub(t, c, o, 1).report(0, coldLoad)
	}
	rec0 := waitLists(t, kv, model, lists{free: u64s(1, 2)})
	for _, o := range others {
		waitLists(t, kv, o, lists{free: u64s(1)})
	}

	t.Run("get_lists_every_known_model_sorted", func(t *testing.T) {
		es := getThresholds(t, m.base)
		names := []string{}
		for _, e := range es {
			s, _ := e["model"].(string)
			names = append(names, s)
		}
		if !sort.StringsAreSorted(names) {
			t.Errorf("not sorted by model: %q", names)
		}
		for _, want := range append(others, model) {
			e, ok := findEntry(es, want)
			if !ok {
				t.Errorf("model %q missing from %q", want, names)
				continue
			}
			e.expect(t, "GET "+want, [3]any{0.5, nil, nil})
		}
	})
	t.Run("set_merge_get_delete", func(t *testing.T) {
		h := postThr(t, m.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":100}`, model))
		if h.code != 200 || !isJSON(h) {
			t.Fatalf("set: %d %q %s", h.code, h.header.Get("Content-Type"), h.body)
		}
		replyEntry(t, h, model).expect(t, "set reply", [3]any{0.5, 100.0, nil})
		// takes effect at once, without a new report
		r := waitRecordFor(t, kv, model, "worker 1 busy under prefill 100", 2*time.Second, func(r record) bool { return r.has("busy", 1) })
		if r.reasons()["1"] != "prefill" {
			t.Errorf("reason %q", r.reasons()["1"])
		}
		if r.rev == rec0.rev {
			t.Errorf("no new write")
		}
		if v, _ := toU64(r.thresholds()["active_prefill_tokens_threshold"]); v != 100 {
			t.Errorf("record thresholds: %v", r.thresholds())
		}
		// merge: frac set, prefill kept
		h = postThr(t, m.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold_frac":0.75}`, model))
		if h.code != 200 {
			t.Fatalf("merge: %d %s", h.code, h.body)
		}
		replyEntry(t, h, model).expect(t, "merge reply", [3]any{0.5, 100.0, 0.75})
		// a threshold change is a content change even when the lists stay the same
		waitRecordFor(t, kv, model, "record thresholds carry frac 0.75", 2*time.Second, func(r record) bool {
			v, _ := toF64(r.thresholds()["active_prefill_tokens_threshold_frac"])
			return v == 0.75
		})
		// null leaves a field alone
		h = postThr(t, m.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":null,"active_decode_blocks_threshold":null}`, model))
		if h.code != 200 {
			t.Fatalf("null fields: %d %s", h.code, h.body)
		}
		replyEntry(t, h, model).expect(t, "null-fields reply", [3]any{0.5, 100.0, 0.75})
		// a body with only model is a get
		h = postThr(t, m.base, fmt.Sprintf(`{"model":%q}`, model))
		if h.code != 200 {
			t.Fatalf("get-only POST: %d %s", h.code, h.body)
		}
		replyEntry(t, h, model).expect(t, "get-only reply", [3]any{0.5, 100.0, 0.75})
		e, _ := findEntry(getThresholds(t, m.base), model)
		e.expect(t, "GET after set", [3]any{0.5, 100.0, 0.75})
		// others untouched
		e, _ = findEntry(getThresholds(t, m.base), others[0])
		e.expect(t, "other model", [3]any{0.5, nil, nil})
		// decode override: 10/100 > 0.05×100 → busy with kv+prefill
		h = postThr(t, m.base, fmt.Sprintf(`{"model":%q,"active_decode_blocks_threshold":0.05}`, model))
		if h.code != 200 {
			t.Fatalf("set decode: %d %s", h.code, h.body)
		}
		r = waitRecordFor(t, kv, model, "reason kv+prefill", 2*time.Second, func(r record) bool { return r.reasons()["1"] == "kv+prefill" })
		th := r.thresholds()
		if v, _ := toF64(th["active_decode_blocks_threshold"]); v != 0.05 {
			t.Errorf("record thresholds %v", th)
		}
		if v, _ := toF64(th["active_prefill_tokens_threshold_frac"]); v != 0.75 {
			t.Errorf("record thresholds %v", th)
		}
		// DELETE: back to the defaults, at once
		h = deleteThr(t, m.base, model)
		if h.code < 200 || h.code > 299 {
			t.Fatalf("DELETE: %d %s", h.code, h.body)
		}
		e, _ = findEntry(getThresholds(t, m.base), model)
		e.expect(t, "GET after DELETE", [3]any{0.5, nil, nil})
		r = waitRecordFor(t, kv, model, "worker 1 free after DELETE", 2*time.Second, lists{free: u64s(1, 2)}.match)
		th = r.thresholds()
		if _, ok := th["active_prefill_tokens_threshold"]; ok || len(th) != 1 {
			t.Errorf("record thresholds after DELETE: %v", th)
		}
	})
	t.Run("value_edges_accepted", func(t *testing.T) {
		o := others[1]
		for _, body := range []string{
			`"active_decode_blocks_threshold":0`, `"active_decode_blocks_threshold":1`, `"active_decode_blocks_threshold":1.0`,
			`"active_prefill_tokens_threshold":0`, `"active_prefill_tokens_threshold":18446744073709551615`,
			`"active_prefill_tokens_threshold_frac":0`, `"active_prefill_tokens_threshold_frac":7.5`,
		} {
			h := postThr(t, m.base, fmt.Sprintf(`{"model":%q,%s}`, o, body))
			if h.code != 200 {
				t.Errorf("POST %s: %d %s", body, h.code, h.body)
			}
		}
		h := postThr(t, m.base, fmt.Sprintf(`{"model":%q}`, o))
		e := replyEntry(t, h, o)
		if s := fmt.Sprint(e["active_prefill_tokens_threshold"]); s != "18446744073709551615" {
			t.Errorf("uint64 max threshold read back as %s", s)
		}
		deleteThr(t, m.base, o)
	})
	t.Run("errors", func(t *testing.T) {
		q := func(s string) string { return fmt.Sprintf(`{"model":%q,%s}`, model, s) }
		cases := []struct {
			name  string
			body  string
			codes []int
		}{
			{"decode_above_1", q(`"active_decode_blocks_threshold":1.5`), []int{400}},
			{"decode_negative", q(`"active_decode_blocks_threshold":-0.1`), []int{400}},
			{"frac_negative", q(`"active_prefill_tokens_threshold_frac":-1`), []int{400}},
			{"prefill_negative", q(`"active_prefill_tokens_threshold":-1`), []int{400, 422}},
			{"prefill_fraction", q(`"active_prefill_tokens_threshold":1.5`), []int{400, 422}},
			{"prefill_over_uint64", q(`"active_prefill_tokens_threshold":18446744073709551616`), []int{400, 422}},
			{"decode_NaN_token", q(`"active_decode_blocks_threshold":NaN`), []int{400}},
			{"frac_huge", q(`"active_prefill_tokens_threshold_frac":1e400`), []int{400}},
			{"decode_string", q(`"active_decode_blocks_threshold":"0.5"`), []int{422}},
			{"decode_NaN_string", q(`"active_decode_blocks_threshold":"NaN"`), []int{400, 422}},
			{"prefill_string", q(`"active_prefill_tokens_threshold":"100"`), []int{422}},
			{"frac_bool", q(`"active_prefill_tokens_threshold_frac":true`), []int{422}},
			{"frac_object", q(`"active_prefill_tokens_threshold_frac":{}`), []int{422}},
			{"model_number", `{"model":5,"active_prefill_tokens_threshold":1}`, []int{422}},
			{"bad_json", `{"model":`, []int{400}},
			{"not_json", `hello`, []int{400}},
			{"empty_body", ``, []int{400}},
			{"json_array", `[1,2]`, []int{400, 422}},
			{"json_string", `"x"`, []int{400, 422}},
			{"trailing_garbage", q(`"active_prefill_tokens_threshold":1`) + `xyz`, []int{400}},
			{"missing_model", `{"active_prefill_tokens_threshold":1}`, []int{400, 422}},
			{"empty_model", `{"model":"","active_prefill_tokens_threshold":1}`, []int{400, 404, 422}},
			{"model_too_long", `{"model":"` + strings.Repeat("m", 257) + `","active_prefill_tokens_threshold":1}`, []int{400, 404, 422}},
			{"deep_nesting", `{"model":` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + `}`, []int{400, 413, 422}},
			{"deep_nesting_unclosed", strings.Repeat(`{"a":`, 50000), []int{400, 413}},
		}
		for _, tc := range cases {
			h := postThr(t, m.base, tc.body)
			checkAPIError(t, tc.name, h, tc.codes...)
		}
		// nothing of that changed the model
		e, _ := findEntry(getThresholds(t, m.base), model)
		e.expect(t, "after rejected bodies", [3]any{0.5, nil, nil})
	})
	t.Run("unknown_model_404", func(t *testing.T) {
		h := postThr(t, m.base, `{"model":"never/seen","active_prefill_tokens_threshold":5}`)
		checkAPIError(t, "set on unknown model", h, 404)
		if _, ok := findEntry(getThresholds(t, m.base), "never/seen"); ok {
			t.Errorf("unknown model listed after a 404 set")
		}
	})
	t.Run("content_type_415", func(t *testing.T) {
		body := []byte(fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":5}`, model))
		checkAPIError(t, "text/plain", doHTTP(t, "POST", m.base+"/busy_threshold", "text/plain", body), 415)
		checkAPIError(t, "no content type", doHTTP(t, "POST", m.base+"/busy_threshold", "", body), 415)
		checkAPIError(t, "form", doHTTP(t, "POST", m.base+"/busy_threshold", "application/x-www-form-urlencoded", body), 415)
		h := doHTTP(t, "POST", m.base+"/busy_threshold", "application/json; charset=utf-8", []byte(fmt.Sprintf(`{"model":%q}`, model)))
		if h.code != 200 {
			t.Errorf("application/json; charset=utf-8: %d %s", h.code, h.body)
		}
	})
	t.Run("body_too_large_413", func(t *testing.T) {
		big := fmt.Sprintf(`{"model":%q,"pad":"%s"}`, model, strings.Repeat("x", 8<<20))
		h := postThr(t, m.base, big)
		checkAPIError(t, "8 MiB body", h, 413)
	})
	t.Run("delete_needs_model", func(t *testing.T) {
		h := doHTTP(t, "DELETE", m.base+"/busy_threshold", "", nil)
		if h.code < 400 || h.code > 499 {
			t.Errorf("DELETE without model: %d %s", h.code, h.body)
		}
	})
	if !m.alive() {
		t.Fatalf("monitor died")
	}
}

// TestContractThresholdAPISecondMonitor: an override set through one
// monitor is seen by a second monitor process on the same NATS, and back.
func TestContractThresholdAPISecondMonitor(t *testing.T) {
	t.Parallel()
	m1, c, kv := startMonitorKV(t, monOpt{flags: append([]string{"--active-decode-blocks-threshold", "0.5"}, longStale...)})
	model := "second/mon.1"
	newPub(t, c, model, 1).report(0, map[string]any{"active_prefill_tokens": 200})
	waitLists(t, kv, model, lists{free: u64s(1)})

	m2 := startMonitor(t, monOpt{natsURL: m1.natsURL, flags: append([]string{"--active-decode-blocks-threshold", "0.5"}, longStale...)})
	// m2 never saw a report of the model: it knows it from the buckets
	waitEntry(t, m2.base, model, "second monitor lists the model from the bucket", func(e thrEntry) bool { return true })

	h := postThr(t, m1.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":123}`, model))
	if h.code != 200 {
		t.Fatalf("set on m1: %d %s", h.code, h.body)
	}
	waitEntry(t, m2.base, model, "m2 sees m1's override", func(e thrEntry) bool { v, _ := e.num("active_prefill_tokens_threshold"); return v == 123 }).
		expect(t, "m2", [3]any{0.5, 123.0, nil})

	h = postThr(t, m2.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold_frac":0.3}`, model))
	if h.code != 200 {
		t.Fatalf("set on m2: %d %s", h.code, h.body)
	}
	replyEntry(t, h, model).expect(t, "m2 reply", [3]any{0.5, 123.0, 0.3})
	waitEntry(t, m1.base, model, "m1 sees m2's override", func(e thrEntry) bool { v, _ := e.num("active_prefill_tokens_threshold_frac"); return v == 0.3 }).
		expect(t, "m1", [3]any{0.5, 123.0, 0.3})

	h = deleteThr(t, m2.base, model)
	if h.code < 200 || h.code > 299 {
		t.Fatalf("DELETE on m2: %d %s", h.code, h.body)
	}
	waitEntry(t, m1.base, model, "m1 sees m2's DELETE", func(e thrEntry) bool { return e["active_prefill_tokens_threshold"] == nil }).
		expect(t, "m1 after DELETE", [3]any{0.5, nil, nil})
}

// TestContractThresholdAPIStoredInBucket: overrides live in
// workermon-thresholds as JSON under the model key.
func TestContractThresholdAPIStoredInBucket(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{flags: longStale})
	c := m.client(t)
	model := "bucket/Model x.y"
	newPub(t, c, model, 1).report(0, coldLoad)
	waitLists(t, c.busyKV(t), model, lists{free: u64s(1)})
	h := postThr(t, m.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":42,"active_decode_blocks_threshold":0.25}`, model))
	if h.code != 200 {
		t.Fatalf("set: %d %s", h.code, h.body)
	}
	tkv := c.kv(t, thrBucket)
	r := getKV(t, tkv, modelKey(model))
	if r == nil {
		t.Fatalf("no key %q in %s", modelKey(model), thrBucket)
	}
	o := jsonObj(t, r)
	if fmt.Sprint(o["active_prefill_tokens_threshold"]) != "42" || fmt.Sprint(o["active_decode_blocks_threshold"]) != "0.25" {
		t.Errorf("stored override: %s", r)
	}
	if v, ok := o["active_prefill_tokens_threshold_frac"]; ok && v != nil {
		t.Errorf("unset field stored as %v", v)
	}
}

// TestContractAdminToken: with --admin-token, sets and DELETEs need the bearer token.
func TestContractAdminToken(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{flags: append([]string{"--admin-token", "s3cret"}, longStale...)})
	c := m.client(t)
	model := "admin/model"
	newPub(t, c, model, 1).report(0, coldLoad)
	waitLists(t, c.busyKV(t), model, lists{free: u64s(1)})
	set := fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":5}`, model)
	checkAPIError(t, "set without token", postThr(t, m.base, set), 401)
	checkAPIError(t, "set with wrong token", postThr(t, m.base, set, "Authorization", "Bearer nope"), 401)
	checkAPIError(t, "set with basic auth", postThr(t, m.base, set, "Authorization", "Basic czNjcmV0"), 401)
	checkAPIError(t, "set with raw token", postThr(t, m.base, set, "Authorization", "s3cret"), 401)
	e, _ := findEntry(getThresholds(t, m.base), model)
	e.expect(t, "after unauthorized sets", [3]any{nil, nil, nil})
	if h := postThr(t, m.base, fmt.Sprintf(`{"model":%q}`, model)); h.code != 200 {
		t.Errorf("get-only POST without token: %d %s", h.code, h.body)
	}
	if h := postThr(t, m.base, set, "Authorization", "Bearer s3cret"); h.code != 200 {
		t.Errorf("set with token: %d %s", h.code, h.body)
	}
	checkAPIError(t, "DELETE without token", deleteThr(t, m.base, model), 401)
	checkAPIError(t, "DELETE with wrong token", deleteThr(t, m.base, model, "Authorization", "Bearer s3cre"), 401)
	e, _ = findEntry(getThresholds(t, m.base), model)
	e.expect(t, "after unauthorized DELETE", [3]any{nil, 5.0, nil})
	if h := deleteThr(t, m.base, model, "Authorization", "Bearer s3cret"); h.code < 200 || h.code > 299 {
		t.Errorf("DELETE with token: %d %s", h.code, h.body)
	}
	e, _ = findEntry(getThresholds(t, m.base), model)
	e.expect(t, "after DELETE", [3]any{nil, nil, nil})
}
