package main_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestContractRestartWithoutReports: a restarted monitor that hears from
// no worker of a model still owns the model's key once its warm-up is over:
// it re-puts it at least every --heartbeat (DESIGN §6: "re-put at least every
// --heartbeat even when unchanged, so a router can tell a live monitor's list
// from a dead one's") until it deletes it after --gone-after.
func TestContractRestartWithoutReports(t *testing.T) {
	t.Parallel()
	dataDir := t.TempDir()
	natsAddr := freeAddr(t)
	m1, c, kv := startMonitorKV(t, monOpt{dataDir: dataDir, natsAddr: natsAddr, flags: stateFlags})
	model := newModel(t)
	newPub(t, c, model, 1).report(0, hotLoad)
	r1 := waitLists(t, kv, model, lists{busy: u64s(1)})
	m1.stop()

	t0 := time.Now()
	m2 := startMonitor(t, monOpt{dataDir: dataDir, natsAddr: natsAddr, flags: stateFlags})
	kv2 := m2.client(t).busyKV(t)
	var writes []record
	var gone time.Duration
	last := r1
	for time.Since(t0) < tGoneAfter+2*time.Second {
		r, ok := getRecord(t, kv2, model)
		if !ok {
			gone = time.Since(t0)
			break
		}
		// The takeover's claim (DESIGN §10) re-puts the record as it was,
		// under the new epoch with seq 1 and updated_at kept: not a write of
		// the new monitor's lists.
		claim := r.u64("seq") == 1 && r.i64("updated_at") == r1.i64("updated_at")
		if r.rev != last.rev && !claim {
			writes = append(writes, r)
		}
		last = r
		time.Sleep(20 * time.Millisecond)
	}
	if gone == 0 {
		t.Fatalf("key of a model without workers not deleted within --gone-after after the restart")
	}
	// between the end of the warm-up and the deletion, the key must be heartbeated
	span := gone - tWarmup
	want := int(span/(tHeartbeat+200*time.Millisecond)) - 1
	if len(writes) < want {
		t.Errorf("after the warm-up the new monitor wrote the key %d times in %v before deleting it (heartbeat %v): "+
			"the dead monitor's list (all_busy=%v, epoch %d) stayed unrefreshed", len(writes), span, tHeartbeat, r1.allBusy(), r1.u64("epoch"))
	}
	for _, w := range writes {
		if w.u64("epoch") <= r1.u64("epoch") {
			t.Errorf("write with epoch %d after restart", w.u64("epoch"))
		}
		if w.has("busy", 1) || w.has("free", 1) {
			t.Errorf("a worker not heard since the restart is listed busy/free: %v", w)
		}
	}
}

// TestContractEpochFromBucket: epoch = 1 + the highest epoch found in the
// bucket at start; an existing bucket's settings are left alone; unreadable
// records do not stop the monitor.
func TestContractEpochFromBucket(t *testing.T) {
	t.Parallel()
	natsURL := startNATS(t)
	c := connect(t, natsURL)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	bkv, err := c.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: busyBucket, History: 5})
	if err != nil {
		t.Fatal(err)
	}
	old := recordBytes("old/model", u64s(1), nil, time.Now().Add(-time.Hour), 9)
	// epoch 41 in an otherwise normal record
	rec, _ := parseRecord(old, 0)
	rec.m["epoch"] = uint64(41)
	if _, err := bkv.Put(ctx, modelKey("old/model"), enc(t, rec.m)); err != nil {
		t.Fatal(err)
	}
	rec.m["epoch"] = uint64(7)
	if _, err := bkv.Put(ctx, modelKey("old/model2"), enc(t, rec.m)); err != nil {
		t.Fatal(err)
	}
	if _, err := bkv.Put(ctx, "garbage", []byte{0xc1, 0x00, 0xff}); err != nil {
		t.Fatal(err)
	}
	m := startMonitor(t, monOpt{natsURL: natsURL, flags: stateFlags})
	model := newModel(t)
	newPub(t, c, model, 1).report(0, coldLoad)
	r := waitLists(t, bkv, model, lists{free: u64s(1)})
	if e := r.u64("epoch"); e != 42 {
		t.Errorf("epoch = %d, want 1 + 41 = 42", e)
	}
	st, err := bkv.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.History() != 5 {
		t.Errorf("existing bucket's history changed to %d", st.History())
	}
	if !m.alive() {
		t.Fatalf("monitor died")
	}
}

// TestContractBucketsCreated: buckets are created by whoever needs them
// first, history 1; the workers bucket with a 30s TTL.
func TestContractBucketsCreated(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{})
	c := m.client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, b := range []string{busyBucket, thrBucket} {
		kv := c.kv(t, b)
		st, err := kv.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.History() != 1 {
			t.Errorf("%s history %d, want 1", b, st.History())
		}
	}
	// a router on an empty NATS creates what it needs
	natsURL := startNATS(t)
	startRouter(t, natsURL)
	c2 := connect(t, natsURL)
	wkv := c2.kv(t, workersBucket)
	st, err := wkv.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.TTL() != 30*time.Second || st.History() != 1 {
		t.Errorf("%s created with TTL %v history %d, want 30s and 1", workersBucket, st.TTL(), st.History())
	}
}

// TestContractThresholdBucketDirect: an override written straight into
// workermon-thresholds (as another replica would) takes effect.
func TestContractThresholdBucketDirect(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: append([]string{"--active-decode-blocks-threshold", "0.5"}, longStale...)})
	model := "direct/Model.v2"
	newPub(t, c, model, 1).report(0, map[string]any{"active_prefill_tokens": 200, "kv_total_blocks": 100, "active_decode_blocks": 10})
	waitLists(t, kv, model, lists{free: u64s(1)})
	tkv := c.kv(t, thrBucket)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	put := func(v string) {
		t.Helper()
		if _, err := tkv.Put(ctx, modelKey(model), []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	// a model known only from an override in the bucket: listed by its name
	// (the key decoded), and settable
	ghost := "ghost/Model x.y=z"
	if _, err := tkv.Put(ctx, modelKey(ghost), []byte(`{"active_prefill_tokens_threshold":7}`)); err != nil {
		t.Fatal(err)
	}
	waitEntry(t, m.base, ghost, "model known from an override only", func(e thrEntry) bool { return true }).
		expect(t, "ghost", [3]any{0.5, 7.0, nil})
	if h := postThr(t, m.base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold_frac":0.5}`, ghost)); h.code != 200 {
		t.Errorf("set on a model known from an override: %d %s", h.code, h.body)
	}
	put(`{"active_prefill_tokens_threshold":100}`)
	r := waitLists(t, kv, model, lists{busy: u64s(1)})
	if r.reasons()["1"] != "prefill" {
		t.Errorf("reason %q", r.reasons()["1"])
	}
	waitEntry(t, m.base, model, "GET shows the bucket's override", func(e thrEntry) bool { v, _ := e.num("active_prefill_tokens_threshold"); return v == 100 }).
		expect(t, "GET", [3]any{0.5, 100.0, nil})
	put(`{"active_prefill_tokens_threshold":null,"active_decode_blocks_threshold":0.05,"active_prefill_tokens_threshold_frac":null}`)
	r = waitRecord(t, kv, model, "kv only", func(r record) bool { return r.reasons()["1"] == "kv" })
	if _, ok := r.thresholds()["active_prefill_tokens_threshold"]; ok {
		t.Errorf("null must inherit the default (unset): %v", r.thresholds())
	}
	// hostile values in the bucket do not stop the monitor
	put(`not json`)
	put(`{"active_decode_blocks_threshold":7}`)
	put(`{"active_prefill_tokens_threshold":"x"}`)
	time.Sleep(200 * time.Millisecond)
	if !m.alive() {
		t.Fatalf("monitor died on a bad override")
	}
	if h := doHTTP(t, "GET", m.base+"/busy_threshold", "", nil); h.code != 200 {
		t.Errorf("GET after bad overrides: %d", h.code)
	}
	// deleting the key: back to the defaults
	if err := tkv.Delete(ctx, modelKey(model)); err != nil {
		t.Fatal(err)
	}
	r = waitLists(t, kv, model, lists{free: u64s(1)})
	if th := r.thresholds(); len(th) != 1 {
		t.Errorf("thresholds after the override's deletion: %v", th)
	}
}

// TestContractSubjectPrefixAndEnv: --subject-prefix and NATS_URL.
func TestContractSubjectPrefixAndEnv(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: []string{"--subject-prefix", "acme.wm", "--active-prefill-tokens-threshold", "100"}})
	model := newModel(t)
	p := newPub(t, c, model, 1)
	msg := p.msg(0, hotLoad)
	publish(t, c.nc, fmt.Sprintf("acme.wm.load.%s.1.0", modelKey(model)), enc(t, msg))
	waitLists(t, kv, model, lists{busy: u64s(1)})
	// the default prefix is not listened to
	q := newPub(t, c, model, 2)
	q.report(0, coldLoad) // on workermon.load...
	msg = newPub(t, c, model, 3).msg(0, coldLoad)
	publish(t, c.nc, fmt.Sprintf("acme.wm.load.%s.3.0", modelKey(model)), enc(t, msg))
	r := waitRecord(t, kv, model, "worker 3", func(r record) bool { return r.has("free", 3) })
	if r.where(2) != "" {
		t.Errorf("report on the default prefix accepted with --subject-prefix acme.wm: %v", r)
	}
	bye := map[string]any{"v": 1, "model": model, "worker_id": uint64(1), "boot_id": p.boot, "seq": uint64(100), "sent_at": time.Now().UnixNano()}
	publish(t, c.nc, fmt.Sprintf("acme.wm.bye.%s.1", modelKey(model)), enc(t, bye))
	waitLists(t, kv, model, lists{free: u64s(3)})

	// a second monitor given NATS_URL in the environment (no --nats-url)
	m2 := startMonitor(t, monOpt{natsURL: m.natsURL, natsEnv: true, flags: longStale})
	waitEntry(t, m2.base, model, "monitor started with NATS_URL sees the model", func(thrEntry) bool { return true })
}

// TestContractGoodbyeOfDeadBoot: a goodbye from a boot that was replaced
// (earlier sent_at) does not remove the restarted worker.
func TestContractGoodbyeOfDeadBoot(t *testing.T) {
	t.Parallel()
	_, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})
	model := newModel(t)
	p := newPub(t, c, model, 1)
	p.report(0, hotLoad)
	oldBoot, oldSeq, oldAt := p.boot, p.seq, time.Now().UnixNano()
	waitLists(t, kv, model, lists{busy: u64s(1)})
	p.newBoot()
	p.report(0, hotLoad)
	barrier(t, c, model)
	bye := map[string]any{"v": 1, "model": model, "worker_id": uint64(1), "boot_id": oldBoot, "seq": oldSeq + 1, "sent_at": oldAt}
	publish(t, c.nc, byeSubject(model, 1), enc(t, bye))
	checkWhere(t, c, model, 1, "busy", "a late goodbye of the dead boot removed the restarted worker")
}

// TestContractModelNames: the record key is model_key(model); the record's
// model is the name itself.
func TestContractModelNames(t *testing.T) {
	t.Parallel()
	_, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})
	for _, name := range []string{"Qwen/Qwen3-0.6B", "a b", "x=y", "m*>.~!é😀", "A", strings.Repeat("z", 256), "under_score-dash/slash", "tab\tnew\nline"} {
		name := name
		t.Run(fmt.Sprintf("%.20q", name), func(t *testing.T) {
			t.Parallel()
			newPub(t, c, name, 1).report(0, coldLoad)
			r := waitLists(t, kv, name, lists{free: u64s(1)})
			if r.m["model"] != name {
				t.Errorf("record model %q, want %q", r.m["model"], name)
			}
		})
	}
}

// TestContractManyRanks: a worker with 8 DP ranks is busy only once all 8 are.
func TestContractManyRanks(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})
	model := newModel(t)
	p := newPub(t, c, model, 1).withDP(16, 8)
	for r := uint32(16); r < 23; r++ {
		p.report(r, hotLoad)
	}
	checkWhere(t, c, model, 1, "free", "7 of 8 ranks busy: want free")
	p.report(23, hotLoad)
	waitRecord(t, kv, model, "all 8 ranks busy", func(r record) bool { return r.has("busy", 1) })
	// a huge declared range is rejected or bounded, never a crash
	before := m.rejected(t, "")
	q := newPub(t, c, model, 2).withDP(0, 1<<32-1)
	q.report(0, hotLoad)
	edge := newPub(t, c, model, 3).withDP(1<<32-1, 2)
	edge.report(1<<32-1, hotLoad)
	r := barrier(t, c, model)
	if !m.alive() {
		t.Fatalf("monitor died")
	}
	if w := r.where(2); w == "busy" {
		t.Errorf("worker declaring 4294967295 ranks with one reported is busy: %v", r)
	}
	t.Logf("dp_size 2^32-1: worker 2 in %q, dp_start 2^32-1 size 2: worker 3 in %q; rejected +%v", r.where(2), r.where(3), m.rejected(t, "")-before)
	if resp, err := http.Get(m.base + "/healthz"); err != nil || resp.StatusCode != 200 {
		t.Errorf("healthz: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
}

// TestContractRouterRegistryDeletion: a deregistered worker gets no more requests.
func TestContractRouterRegistryDeletion(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	r := startRouter(t, natsURL)
	model := newModel(t)
	e1, e2 := newEngine(t, 1, nil), newEngine(t, 2, nil)
	registerEngines(t, wkv, model, e1, e2)
	keepRecord(t, bkv, model, nil, u64s(1, 2))
	waitRoutedTo(t, r.base, model, 1, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := wkv.Delete(ctx, fmt.Sprintf("%s.%d", modelKey(model), 1)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	checkOnlyRoutedTo(t, r.base, model, 10, 2, "deregistered", e1)
	// the router found via NATS_URL (no --nats-url)
	addr := freeAddr(t)
	p := startProcEnv(t, "router-env", []string{"NATS_URL=" + natsURL}, "router", "--http-addr", addr, "--stale-list-after", "1s")
	waitHTTP(t, p, "http://"+addr+"/readyz", 15*time.Second)
	waitRoutedTo(t, "http://"+addr, model, 2)
}

// TestContractRouterRecordDeleted: when the monitor deletes a model's key the
// router no longer applies the old list (no record: admit).
func TestContractRouterRecordDeleted(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	addr := freeAddr(t)
	p := startProc(t, "router", "router", "--nats-url", natsURL, "--http-addr", addr, "--stale-list-after", "30s")
	base := "http://" + addr
	waitHTTP(t, p, base+"/readyz", 15*time.Second)
	for _, op := range []string{"delete", "purge"} {
		model := newModel(t)
		e := newEngine(t, 1, nil)
		register(t, wkv, model, 1, e.srv.URL)
		putRecord(t, bkv, model, u64s(1), nil, time.Now(), 1)
		waitAllBusy(t, base, "/v1/completions", model, 503)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		var err error
		if op == "delete" {
			err = bkv.Delete(ctx, modelKey(model))
		} else {
			err = bkv.Purge(ctx, modelKey(model))
		}
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		waitRoutedTo(t, base, model, 1)
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("%s: admitted only %v after the key's %s", model, el, op)
		}
	}
	// an updated_at older than stale-list-after (30s) fails open even with fresh puts
	model := newModel(t)
	e := newEngine(t, 1, nil)
	register(t, wkv, model, 1, e.srv.URL)
	putRecord(t, bkv, model, u64s(1), nil, time.Now().Add(-time.Minute), 1)
	time.Sleep(200 * time.Millisecond)
	putRecord(t, bkv, model, u64s(1), nil, time.Now().Add(-time.Minute), 2)
	waitRoutedTo(t, base, model, 1)
}

// TestContractRouterNoMigrationForChat: only a streamed /v1/completions with
// one string prompt migrates.
func TestContractRouterNoMigrationForChat(t *testing.T) {
	t.Parallel()
	natsURL, bkv, wkv := routerNATS(t)
	r := startRouter(t, natsURL, "--migration-limit", "2")
	for _, tc := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":%q,"messages":[{"role":"user","content":"x"}],"max_tokens":10,"stream":true}`},
		{"/v1/completions", `{"model":%q,"prompt":["a","b"],"max_tokens":10,"stream":true}`},
		{"/v1/completions", `{"model":%q,"prompt":"a","max_tokens":10}`},
	} {
		model := newModel(t)
		cut := func(e *engine, w http.ResponseWriter, r *http.Request, body []byte) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, sseChunk("partial", nil, nil))
		}
		e1, e2 := newEngine(t, 1, cut), newEngine(t, 2, cut)
		registerEngines(t, wkv, model, e1, e2)
		keepRecord(t, bkv, model, nil, u64s(1, 2))
		time.Sleep(300 * time.Millisecond)
		h := doHTTP(t, "POST", r.base+tc.path, "application/json", []byte(fmt.Sprintf(tc.body, model)))
		if n := e1.hits.Load() + e2.hits.Load(); n != 1 {
			t.Errorf("%s %s: %d engine calls, want 1 (not migratable); status %d", tc.path, tc.body, n, h.code)
		}
	}
}

// TestContractServeRejectsBadThresholdFlags: out-of-range threshold flags stop
// `workermon serve` at start with a non-zero exit.
func TestContractServeRejectsBadThresholdFlags(t *testing.T) {
	t.Parallel()
	for _, fl := range [][]string{
		{"--active-decode-blocks-threshold", "1.5"},
		{"--active-decode-blocks-threshold", "-0.1"},
		{"--active-decode-blocks-threshold", "NaN"},
		{"--active-prefill-tokens-threshold", "-1"},
		{"--active-prefill-tokens-threshold-frac", "-1"},
	} {
		args := append([]string{"serve", "--http-addr", freeAddr(t), "--embedded-nats-addr", freeAddr(t), "--data-dir", t.TempDir()}, fl...)
		p := startProc(t, "serve-bad-flag", args...)
		select {
		case <-p.exited:
			if p.err == nil {
				t.Errorf("%v: exit status 0", fl)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("%v: still running", fl)
		}
	}
}
