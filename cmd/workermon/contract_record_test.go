package main_test

import (
	"bytes"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// family classifies a msgpack code.
func family(c byte) string {
	switch {
	case msgpcode.IsFixedNum(c) && c <= msgpcode.PosFixedNumHigh:
		return "uint"
	case c == msgpcode.Uint8 || c == msgpcode.Uint16 || c == msgpcode.Uint32 || c == msgpcode.Uint64:
		return "uint"
	case msgpcode.IsFixedNum(c):
		return "negint"
	case c == msgpcode.Int8 || c == msgpcode.Int16 || c == msgpcode.Int32 || c == msgpcode.Int64:
		return "int"
	case c == msgpcode.Float || c == msgpcode.Double:
		return "float"
	case c == msgpcode.True || c == msgpcode.False:
		return "bool"
	case c == msgpcode.Nil:
		return "nil"
	case msgpcode.IsFixedString(c) || c == msgpcode.Str8 || c == msgpcode.Str16 || c == msgpcode.Str32:
		return "str"
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		return "array"
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		return "map"
	case msgpcode.IsBin(c):
		return "bin"
	}
	return fmt.Sprintf("code 0x%02x", c)
}

// rawFields returns the first code of each top-level value, by key.
func rawFields(t testing.TB, b []byte) map[string]byte {
	t.Helper()
	d := msgpack.NewDecoder(bytes.NewReader(b))
	n, err := d.DecodeMapLen()
	if err != nil {
		t.Fatalf("record is not a map: %v", err)
	}
	out := map[string]byte{}
	for i := 0; i < n; i++ {
		k, err := d.DecodeString()
		if err != nil {
			t.Fatalf("record key %d is not a string: %v", i, err)
		}
		c, err := d.PeekCode()
		if err != nil {
			t.Fatal(err)
		}
		if _, dup := out[k]; dup {
			t.Errorf("record key %q twice", k)
		}
		out[k] = c
		if err := d.Skip(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.PeekCode(); err == nil {
		t.Errorf("trailing bytes after the record map")
	}
	return out
}

// checkRawShape checks that keys hold exactly the given first bytes.
func checkRawShape(t testing.TB, b []byte, want map[string]byte) {
	t.Helper()
	got := rawFields(t, b)
	for k, w := range want {
		if g, ok := got[k]; !ok {
			t.Errorf("record lacks %q", k)
		} else if g != w {
			t.Errorf("record %q starts with 0x%02x, want 0x%02x", k, g, w)
		}
	}
}

// checkRecord checks every §6 field of a record: presence, msgpack family and
// basic invariants.
func checkRecord(t testing.TB, r record, model string) {
	t.Helper()
	codes := rawFields(t, r.raw)
	want := map[string][]string{
		"v": {"uint"}, "model": {"str"}, "busy": {"array"}, "free": {"array"}, "stale": {"array"},
		"all_busy": {"bool"}, "reasons": {"map"}, "thresholds": {"map"}, "updated_at": {"uint", "int"},
		"monitor_id": {"str"}, "epoch": {"uint"}, "seq": {"uint"}, "routers": {"uint"},
	}
	for k, fams := range want {
		c, ok := codes[k]
		if !ok {
			t.Errorf("record lacks %q: %v", k, r)
			continue
		}
		if !slices.Contains(fams, family(c)) {
			t.Errorf("record %q is %s, want %v", k, family(c), fams)
		}
	}
	if r.u64("v") != 1 {
		t.Errorf("v = %v", r.m["v"])
	}
	if r.m["model"] != model {
		t.Errorf("model = %q, want %q", r.m["model"], model)
	}
	if s, _ := r.m["monitor_id"].(string); s == "" {
		t.Errorf("empty monitor_id")
	}
	if r.u64("epoch") < 1 {
		t.Errorf("epoch = %v, want >= 1", r.m["epoch"])
	}
	if r.u64("seq") < 1 {
		t.Errorf("seq = %v, want >= 1", r.m["seq"])
	}
	if ua := r.i64("updated_at"); time.Since(time.Unix(0, ua)).Abs() > 10*time.Second {
		t.Errorf("updated_at %v is not now", time.Unix(0, ua))
	}
	seen := map[uint64]string{}
	for _, l := range []string{"busy", "free", "stale"} {
		arr, _ := r.m[l].([]any)
		ids := r.ids(l)
		for i, v := range arr {
			if _, ok := toU64(v); !ok {
				t.Errorf("%s[%d] = %v (%T), not a uint64", l, i, v, v)
			}
		}
		if !slices.IsSorted(ids) {
			t.Errorf("%s not ascending: %v", l, ids)
		}
		for _, id := range ids {
			if o, dup := seen[id]; dup {
				t.Errorf("worker %d in %s and %s", id, o, l)
			}
			seen[id] = l
		}
	}
	wantAll := len(r.free()) == 0 && len(r.busy()) > 0
	if r.allBusy() != wantAll {
		t.Errorf("all_busy = %v, want %v (free empty and busy not): %v", r.allBusy(), wantAll, r)
	}
	rs := r.reasons()
	if len(rs) != len(r.busy()) {
		t.Errorf("reasons %v do not match busy %v", rs, r.busy())
	}
	for _, id := range r.busy() {
		why, ok := rs[strconv.FormatUint(id, 10)]
		if !ok || (why != "kv" && why != "prefill" && why != "kv+prefill") {
			t.Errorf("reason of busy worker %d = %q", id, why)
		}
	}
	if m, ok := r.m["reasons"].(map[any]any); ok {
		for k, v := range m {
			if _, ok := k.(string); !ok {
				t.Errorf("reasons key %v is %T", k, k)
			}
			if _, ok := v.(string); !ok {
				t.Errorf("reasons value %v is %T", v, v)
			}
		}
	}
	for k := range r.thresholds() {
		switch k {
		case "active_decode_blocks_threshold", "active_prefill_tokens_threshold", "active_prefill_tokens_threshold_frac":
		default:
			t.Errorf("thresholds has unknown key %q", k)
		}
	}
}

// TestContractRecordShape checks every field of a record (DESIGN §6).
func TestContractRecordShape(t *testing.T) {
	t.Parallel()
	_, c, kv := startMonitorKV(t, monOpt{flags: []string{"--active-decode-blocks-threshold", "0.5", "--active-prefill-tokens-threshold", "100"}})

	t.Run("full_record", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		big := uint64(1<<64 - 1)
		// published in descending order; ids that sort differently as text
		for _, id := range []uint64{big, 1 << 40, 100, 10, 9} {
			newPub(t, c, model, id).report(0, coldLoad)
		}
		for _, id := range []uint64{big - 1, 1000, 2} {
			newPub(t, c, model, id).report(0, hotLoad)
		}
		newPub(t, c, model, 3).report(0, map[string]any{"active_decode_blocks": 60, "kv_total_blocks": 100, "active_prefill_tokens": 500})
		r := waitLists(t, kv, model, lists{busy: u64s(2, 3, 1000, big-1), free: u64s(9, 10, 100, 1<<40, big)})
		checkRecord(t, r, model)
		rs := r.reasons()
		want := map[string]string{"2": "prefill", "3": "kv+prefill", "1000": "prefill", strconv.FormatUint(big-1, 10): "prefill"}
		for k, v := range want {
			if rs[k] != v {
				t.Errorf("reasons[%q] = %q, want %q (all: %v)", k, rs[k], v, rs)
			}
		}
		th := r.thresholds()
		if v, ok := toF64(th["active_decode_blocks_threshold"]); !ok || v != 0.5 {
			t.Errorf("thresholds.active_decode_blocks_threshold = %v (%T)", th["active_decode_blocks_threshold"], th["active_decode_blocks_threshold"])
		}
		if v, ok := toU64(th["active_prefill_tokens_threshold"]); !ok || v != 100 {
			t.Errorf("thresholds.active_prefill_tokens_threshold = %v (%T)", th["active_prefill_tokens_threshold"], th["active_prefill_tokens_threshold"])
		}
		if v, ok := th["active_prefill_tokens_threshold_frac"]; ok {
			t.Errorf("unset frac threshold must be absent, is %v", v)
		}
		codes := rawFields(t, r.raw)
		if family(codes["all_busy"]) != "bool" {
			t.Errorf("all_busy type")
		}
	})
	// one worker, free or busy: the record's raw shape
	for _, tc := range []struct {
		name  string
		load  map[string]any
		lists lists
		raw   map[string]byte
	}{
		{"empty_lists_are_empty_arrays", coldLoad, lists{free: u64s(1)}, map[string]byte{"busy": 0x90, "stale": 0x90, "reasons": 0x80, "all_busy": 0xc2}},
		{"all_busy_true", hotLoad, lists{busy: u64s(1)}, map[string]byte{"free": 0x90, "stale": 0x90, "all_busy": 0xc3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			model := newModel(t)
			newPub(t, c, model, 1).report(0, tc.load)
			r := waitLists(t, kv, model, tc.lists)
			checkRecord(t, r, model)
			checkRawShape(t, r.raw, tc.raw)
		})
	}
	t.Run("seq_increases_and_heartbeat_advances_updated_at", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		newPub(t, c, model, 1).report(0, hotLoad)
		// once stale (no reports), the content stays constant until --gone-after:
		// every write in that window is a heartbeat.
		waitRecordFor(t, kv, model, "stale", tStaleAfter+3*time.Second, lists{stale: u64s(1)}.match)
		var recs []record
		start := time.Now()
		for time.Since(start) < 1200*time.Millisecond {
			r, ok := getRecord(t, kv, model)
			if ok && (len(recs) == 0 || r.rev != recs[len(recs)-1].rev) {
				recs = append(recs, r)
			}
			time.Sleep(15 * time.Millisecond)
		}
		if len(recs) < 3 {
			t.Fatalf("only %d distinct writes in 1.2s with --heartbeat %v", len(recs), tHeartbeat)
		}
		for i := 1; i < len(recs); i++ {
			a, b := recs[i-1], recs[i]
			if !(b.u64("seq") > a.u64("seq")) {
				t.Errorf("seq did not increase: %d then %d", a.u64("seq"), b.u64("seq"))
			}
			if !(b.i64("updated_at") > a.i64("updated_at")) {
				t.Errorf("updated_at did not advance: %d then %d", a.i64("updated_at"), b.i64("updated_at"))
			}
			if gap := time.Duration(b.i64("updated_at") - a.i64("updated_at")); gap > tHeartbeat+250*time.Millisecond {
				t.Errorf("heartbeat gap %v > --heartbeat %v", gap, tHeartbeat)
			}
			if !lists(lists{stale: u64s(1)}).match(b) || b.allBusy() {
				t.Errorf("content changed during heartbeats: %v", b)
			}
			if b.u64("epoch") != a.u64("epoch") || b.m["monitor_id"] != a.m["monitor_id"] {
				t.Errorf("epoch/monitor_id changed: %v -> %v", a, b)
			}
		}
	})
	t.Run("change_written_promptly", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 1)
		p.report(0, coldLoad)
		waitLists(t, kv, model, lists{free: u64s(1)})
		start := time.Now()
		p.report(0, hotLoad)
		waitLists(t, kv, model, lists{busy: u64s(1)})
		if el := time.Since(start); el > 250*time.Millisecond {
			t.Errorf("a change took %v to reach the record (heartbeat %v): written on change?", el, tHeartbeat)
		}
	})
}

// TestContractRestartWarmupEpoch: a restarted monitor (same data dir) keeps
// the records for --warmup, then writes with a higher epoch; overrides
// survive the restart.
func TestContractRestartWarmupEpoch(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"sigterm", "sigkill"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			testRestartWarmupEpoch(t, how == "sigkill")
		})
	}
}

func testRestartWarmupEpoch(t *testing.T, hard bool) {
	dataDir := t.TempDir()
	natsAddr := freeAddr(t)
	m1, c, kv := startMonitorKV(t, monOpt{dataDir: dataDir, natsAddr: natsAddr, flags: []string{"--active-prefill-tokens-threshold", "100"}})
	model := newModel(t)
	p := newPub(t, c, model, 1)
	p.report(0, map[string]any{"active_prefill_tokens": 150})
	r1 := waitLists(t, kv, model, lists{busy: u64s(1)})
	e1 := r1.u64("epoch")
	if e1 < 1 {
		t.Fatalf("epoch %d", e1)
	}
	// an override (stored in workermon-thresholds) must survive the restart
	resp := doHTTP(t, "POST", m1.base+"/busy_threshold", "application/json", []byte(fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":200}`, model)))
	if resp.code != 200 {
		t.Fatalf("POST override: %d %s", resp.code, resp.body)
	}
	waitLists(t, kv, model, lists{free: u64s(1)})
	stop := p.keepAlive(map[string]any{"active_prefill_tokens": 150})
	defer stop()
	time.Sleep(3 * tHeartbeat)
	if hard {
		m1.kill()
	} else {
		m1.stop()
	}

	// The warm-up starts when the new monitor takes the partition, just
	// before its claim. t0 must not be later than that, or a monitor that
	// keeps the warm-up would look early: it is the monitor's start, then
	// each poll that still sees no claim. margin covers the time from the
	// taking to the claim and one poll's reply, on a loaded machine.
	const warm, margin = 2 * time.Second, 250 * time.Millisecond
	t0 := time.Now()
	m2, _, kv2 := startMonitorKV(t, monOpt{dataDir: dataDir, natsAddr: natsAddr, flags: []string{"--active-prefill-tokens-threshold", "100", "--warmup", warm.String()}})
	before, ok := getRecord(t, kv, model)
	if !ok {
		t.Fatalf("record lost across the restart")
	}
	// The new monitor takes the lease (after a SIGKILL, once the old one is
	// seen unchanged for --lease-ttl) and claims the record (DESIGN §10):
	// the same record under the new epoch, seq 1, its updated_at kept;
	// nothing else is written during the warm-up that follows.
	first := waitRecordFor(t, kv2, model, "the takeover's claim", 5*time.Second, func(r record) bool {
		if r.u64("epoch") > e1 {
			return true
		}
		t0 = time.Now()
		return false
	})
	if first.u64("epoch") != e1+1 || first.u64("seq") != 1 {
		t.Errorf("record after the restart's claim: epoch %d seq %d, want epoch %d seq 1", first.u64("epoch"), first.u64("seq"), e1+1)
	}
	if first.i64("updated_at") != before.i64("updated_at") || !slices.Equal(first.busy(), before.busy()) || !slices.Equal(first.free(), before.free()) {
		t.Errorf("the claim changed the record: %v, before the restart %v", first, before)
	}
	for time.Since(t0) < warm-margin {
		r, ok := getRecord(t, kv2, model)
		if !ok {
			t.Fatalf("record deleted during warm-up (%v after the takeover)", time.Since(t0))
		}
		if r.rev != first.rev {
			t.Fatalf("record written %v after the takeover, during --warmup %v: %v", time.Since(t0), warm, r)
		}
		time.Sleep(20 * time.Millisecond)
	}
	r2 := waitRecordFor(t, kv2, model, "first write of the new monitor", warm+3*time.Second, func(r record) bool { return r.rev != first.rev })
	if el := time.Since(t0); el < warm-margin {
		t.Errorf("first write %v after the takeover, before --warmup %v", el, warm)
	}
	if e2 := r2.u64("epoch"); e2 <= e1 {
		t.Errorf("epoch after restart = %d, want > %d", e2, e1)
	}
	checkRecord(t, r2, model)
	// the override survived: 150 ≤ 200 → free
	if !r2.has("free", 1) {
		r2 = waitRecord(t, kv2, model, "worker 1 free under the stored override 200", func(r record) bool { return r.has("free", 1) })
	}
	if v, _ := toU64(r2.thresholds()["active_prefill_tokens_threshold"]); v != 200 {
		t.Errorf("record thresholds after restart: %v", r2.thresholds())
	}
	g := doHTTP(t, "GET", m2.base+"/busy_threshold", "", nil)
	if g.code != http.StatusOK || !bytes.Contains(g.body, []byte(`"active_prefill_tokens_threshold":200`)) {
		t.Errorf("GET after restart: %d %s", g.code, g.body)
	}
	// and the new epoch's seq keeps increasing
	r3 := waitRecord(t, kv2, model, "another write", func(r record) bool { return r.rev != r2.rev })
	if r3.u64("seq") <= r2.u64("seq") || r3.u64("epoch") != r2.u64("epoch") {
		t.Errorf("seq/epoch after restart: %v then %v", r2, r3)
	}
}

// TestContractWarmupFreshStart: a fresh monitor writes nothing before
// --warmup, then writes what it learned during the warm-up.
func TestContractWarmupFreshStart(t *testing.T) {
	t.Parallel()
	const warm = 1500 * time.Millisecond
	t0 := time.Now()
	_, c, kv := startMonitorKV(t, monOpt{flags: []string{"--active-prefill-tokens-threshold", "100", "--warmup", warm.String()}})
	model := newModel(t)
	stop := newPub(t, c, model, 1).keepAlive(hotLoad)
	defer stop()
	for time.Since(t0) < warm-100*time.Millisecond {
		if r, ok := getRecord(t, kv, model); ok {
			t.Fatalf("record written %v after start, during --warmup %v: %v", time.Since(t0), warm, r)
		}
		time.Sleep(20 * time.Millisecond)
	}
	r := waitLists(t, kv, model, lists{busy: u64s(1)})
	if r.u64("epoch") != 1 {
		t.Errorf("epoch of a first monitor = %d, want 1", r.u64("epoch"))
	}
}
