package main_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

var stateFlags = []string{"--active-decode-blocks-threshold", "0.5", "--active-prefill-tokens-threshold", "100"}

var (
	hotLoad  = map[string]any{"active_prefill_tokens": 500, "active_decode_blocks": 0, "kv_total_blocks": 100}
	coldLoad = map[string]any{"active_prefill_tokens": 0, "active_decode_blocks": 0, "kv_total_blocks": 100}
)

// TestContractStaleness covers --stale-after and --gone-after (DESIGN §5, §6).
func TestContractStaleness(t *testing.T) {
	t.Parallel()
	_, c, kv := startMonitorKV(t, monOpt{flags: stateFlags})

	t.Run("one_busy_beside_stale_is_all_busy", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		stop := newPub(t, c, model, 1).keepAlive(hotLoad)
		defer stop()
		newPub(t, c, model, 2).report(0, coldLoad)
		newPub(t, c, model, 3).report(0, coldLoad)
		last := time.Now()
		r := waitLists(t, kv, model, lists{busy: u64s(1), free: u64s(2, 3)})
		if r.allBusy() {
			t.Errorf("all_busy with free workers: %v", r)
		}
		r = waitRecordFor(t, kv, model, "2 and 3 stale", tStaleAfter+3*time.Second, lists{busy: u64s(1), stale: u64s(2, 3)}.match)
		if el := time.Since(last); el < tStaleAfter-100*time.Millisecond {
			t.Errorf("stale after %v, before --stale-after %v", el, tStaleAfter)
		}
		if !r.allBusy() {
			t.Errorf("one busy + stale others must be all_busy: %v", r)
		}
		// removed after --gone-after of silence
		r = waitRecordFor(t, kv, model, "2 and 3 removed", tGoneAfter+3*time.Second, lists{busy: u64s(1)}.match)
		if el := time.Since(last); el < tGoneAfter-100*time.Millisecond {
			t.Errorf("removed after %v, before --gone-after %v", el, tGoneAfter)
		}
		if !r.allBusy() {
			t.Errorf("all_busy expected: %v", r)
		}
	})
	t.Run("only_stale_is_not_all_busy_then_key_deleted", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		newPub(t, c, model, 4).report(0, hotLoad)
		last := time.Now()
		waitLists(t, kv, model, lists{busy: u64s(4)})
		r := waitRecordFor(t, kv, model, "4 stale", tStaleAfter+3*time.Second, lists{stale: u64s(4)}.match)
		if r.allBusy() {
			t.Errorf("no busy and no free worker: all_busy must be false: %v", r)
		}
		if len(r.reasons()) != 0 {
			t.Errorf("stale worker has a reason: %v", r)
		}
		waitGone(t, kv, model, tGoneAfter+3*time.Second)
		if el := time.Since(last); el < tGoneAfter-100*time.Millisecond {
			t.Errorf("key deleted after %v, before --gone-after %v", el, tGoneAfter)
		}
		// the model comes back with a new report
		newPub(t, c, model, 4).report(0, coldLoad)
		waitLists(t, kv, model, lists{free: u64s(4)})
	})
	t.Run("stale_free_worker", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		newPub(t, c, model, 5).report(0, coldLoad)
		waitLists(t, kv, model, lists{free: u64s(5)})
		r := waitRecordFor(t, kv, model, "5 stale", tStaleAfter+3*time.Second, lists{stale: u64s(5)}.match)
		if r.allBusy() {
			t.Errorf("all_busy with only stale: %v", r)
		}
	})
	t.Run("stale_worker_comes_back", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 6)
		p.report(0, hotLoad)
		waitRecordFor(t, kv, model, "6 stale", tStaleAfter+3*time.Second, lists{stale: u64s(6)}.match)
		p.report(0, map[string]any{}) // absent fields: the state it had
		waitLists(t, kv, model, lists{busy: u64s(6)})
	})
	t.Run("busy_free_stale_at_once", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		stopB := newPub(t, c, model, 30).keepAlive(hotLoad)
		defer stopB()
		stopF := newPub(t, c, model, 20).keepAlive(coldLoad)
		defer stopF()
		newPub(t, c, model, 10).report(0, coldLoad)
		r := waitRecordFor(t, kv, model, "one of each", tStaleAfter+3*time.Second, lists{busy: u64s(30), free: u64s(20), stale: u64s(10)}.match)
		if r.allBusy() {
			t.Errorf("all_busy with a free worker: %v", r)
		}
	})
}

// TestContractDedupe covers seq, boot restarts and dead boots (DESIGN §3).
func TestContractDedupe(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})

	t.Run("same_and_lower_seq_dropped", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 1)
		p.seq = 4
		p.report(0, hotLoad) // seq 5
		waitLists(t, kv, model, lists{busy: u64s(1)})
		before := m.rejected(t, "")
		p.seq = 4
		p.report(0, coldLoad) // seq 5 again
		checkWhere(t, c, model, 1, "busy", "a report with the same seq was applied")
		p.seq = 3
		p.report(0, coldLoad) // seq 4
		checkWhere(t, c, model, 1, "busy", "a report with a lower seq was applied")
		m.waitRejected(t, "", before+2)
		p.seq = 5
		p.report(0, coldLoad) // seq 6
		waitRecord(t, kv, model, "worker 1 free", func(r record) bool { return r.has("free", 1) })
	})
	t.Run("omitted_source_is_engine", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 7)
		p.seq = 9
		p.report(0, hotLoad) // seq 10, source omitted
		waitLists(t, kv, model, lists{busy: u64s(7)})
		q := newPub(t, c, model, 7).withSource("engine")
		q.boot = p.boot
		q.seq = 9
		q.report(0, coldLoad) // seq 10 again, source "engine": the same counter
		checkWhere(t, c, model, 7, "busy", "source \"engine\" and an omitted source are not the same")
		q.report(0, coldLoad) // seq 11
		waitRecord(t, kv, model, "worker 7 free", func(r record) bool { return r.has("free", 7) })
	})
	t.Run("seq_shared_by_ranks", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 2).withDP(0, 2)
		p.report(0, hotLoad) // seq 1
		p.report(1, hotLoad) // seq 2
		waitLists(t, kv, model, lists{busy: u64s(2)})
		p.seq = 1
		p.report(1, coldLoad) // seq 2 again, other rank: duplicate of the publisher's counter
		checkWhere(t, c, model, 2, "busy", "seq 2 accepted twice (counter is per publisher, shared by ranks)")
	})
	t.Run("new_boot_later_sent_at_resets", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 3).withDP(0, 2)
		p.seq = 100
		old := p.report(0, coldLoad) // boot A seq 101
		p.report(1, hotLoad)         // boot A seq 102
		waitLists(t, kv, model, lists{free: u64s(3)})
		oldBoot := p.boot
		p.newBoot()
		// boot B, seq 1 (< 102): rank 0 hot. If boot A's rank 1 state survived, the worker would be busy.
		p.report(0, hotLoad)
		checkWhere(t, c, model, 3, "free", "after a restart (new boot_id, later sent_at), the old boot's state must be dropped and the new seq accepted")
		// boot B, seq 2: rank 1 hot: now busy (shows boot B is accepted)
		p.report(1, hotLoad)
		waitRecord(t, kv, model, "worker 3 busy", func(r record) bool { return r.has("busy", 3) })
		// a late message of dead boot A (earlier sent_at, higher seq) is dropped
		before := m.rejected(t, "")
		late := map[string]any{}
		for k, v := range old {
			late[k] = v
		}
		late["seq"] = uint64(5000)
		late["sent_at"] = old["sent_at"].(int64) + 1
		late["boot_id"] = oldBoot
		late["active_prefill_tokens"] = 0
		publish(t, c.nc, loadSubject(model, 3, 0), enc(t, late))
		checkWhere(t, c, model, 3, "busy", "late message of a dead boot was applied")
		m.waitRejected(t, "", before+1)
	})
	t.Run("new_boot_compared_with_last_report_of_current_boot", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		now := time.Now().UnixNano()
		p := newPub(t, c, model, 6)
		p.report(0, map[string]any{"active_prefill_tokens": 0, "sent_at": now})
		p.report(0, map[string]any{"active_prefill_tokens": 0, "sent_at": now + int64(10*time.Second)})
		waitLists(t, kv, model, lists{free: u64s(6)})
		p.newBoot()
		// later than boot A's first report but earlier than its last: a dead boot
		p.report(0, map[string]any{"active_prefill_tokens": 500, "sent_at": now + int64(5*time.Second)})
		checkWhere(t, c, model, 6, "free", "a boot whose sent_at is earlier than the current boot's last report was accepted")
		p.report(0, map[string]any{"active_prefill_tokens": 500, "sent_at": now + int64(20*time.Second)})
		waitRecord(t, kv, model, "worker 6 busy (new boot, later sent_at)", func(r record) bool { return r.has("busy", 6) })
	})
	t.Run("new_boot_absent_fields_do_not_inherit", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 4)
		p.report(0, hotLoad)
		waitLists(t, kv, model, lists{busy: u64s(4)})
		p.newBoot()
		p.report(0, map[string]any{"kv_total_blocks": 100}) // no prefill: the old boot's 500 must be gone
		checkWhere(t, c, model, 4, "free", "a new boot inherited the old boot's prefill")
	})
	t.Run("restart_of_one_source_keeps_other", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 5)
		e.report(0, hotLoad)
		rt := newPub(t, c, model, 5).withSource("router/r1")
		rt.report(0, coldLoad)
		waitLists(t, kv, model, lists{busy: u64s(5)})
		rt.newBoot()
		rt.report(0, coldLoad)
		checkWhere(t, c, model, 5, "busy", "a router's restart dropped the engine's state")
	})
}

// TestContractGoodbye covers goodbyes (DESIGN §4).
func TestContractGoodbye(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})
	_, cs, kvs := startMonitorKV(t, monOpt{flags: stateFlags}) // --gone-after 3s

	t.Run("engine_goodbye_removes_worker", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 1).withDP(0, 2)
		e.report(0, hotLoad)
		e.report(1, hotLoad)
		rt := newPub(t, c, model, 1).withSource("router/r1")
		rt.report(0, hotLoad)
		newPub(t, c, model, 2).report(0, coldLoad)
		waitLists(t, kv, model, lists{busy: u64s(1), free: u64s(2)})
		e.bye(nil) // source omitted = engine
		r := waitLists(t, kv, model, lists{free: u64s(2)})
		if _, ok := r.reasons()["1"]; ok {
			t.Errorf("reason of a departed worker kept: %v", r)
		}
		// later reports of the same boot are dropped
		before := m.rejected(t, "")
		e.report(0, coldLoad)
		e.report(1, coldLoad)
		checkWhere(t, c, model, 1, "", "report of the same boot after goodbye brought worker 1 back")
		m.waitRejected(t, "", before+2)
		// a new boot brings it back
		e.newBoot()
		e.report(0, coldLoad)
		waitRecord(t, kv, model, "worker 1 back with a new boot", func(r record) bool { return r.has("free", 1) })
	})
	t.Run("explicit_engine_source_goodbye", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 3).withSource("engine")
		e.report(0, hotLoad)
		newPub(t, c, model, 4).report(0, coldLoad)
		waitLists(t, kv, model, lists{busy: u64s(3), free: u64s(4)})
		e.bye(nil)
		waitLists(t, kv, model, lists{free: u64s(4)})
	})
	t.Run("non_engine_goodbye_removes_only_that_source", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 5)
		e.report(0, f("active_prefill_tokens", 10))
		rt := newPub(t, c, model, 5).withSource("router/r1")
		rt.report(0, f("active_prefill_tokens", 500))
		waitLists(t, kv, model, lists{busy: u64s(5)})
		rt.bye(nil)
		waitLists(t, kv, model, lists{free: u64s(5)})
		// the engine is still there and its state still counts
		e.report(0, f("active_decode_blocks", 0))
		checkWhere(t, c, model, 5, "free", "worker 5")
	})
	t.Run("goodbye_of_last_worker_then_key_deleted", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, cs, model, 6)
		stop := e.keepAlive(hotLoad)
		waitLists(t, kvs, model, lists{busy: u64s(6)})
		stop()
		e.bye(nil)
		byeAt := time.Now()
		r := waitRecordFor(t, kvs, model, "worker 6 gone at once", tStaleAfter-200*time.Millisecond, func(r record) bool { return r.where(6) == "" })
		if r.allBusy() {
			t.Errorf("all_busy after the only worker left: %v", r)
		}
		waitGone(t, kvs, model, 20*time.Second)
		if el := time.Since(byeAt); el > tGoneAfter+2*time.Second || el < tGoneAfter-100*time.Millisecond {
			t.Errorf("key deleted %v after the goodbye, want --gone-after %v", el, tGoneAfter)
		}
	})
	t.Run("goodbye_subject_mismatch_rejected", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 7)
		e.report(0, hotLoad)
		waitLists(t, kv, model, lists{busy: u64s(7)})
		before := m.rejected(t, "")
		msg := map[string]any{"v": 1, "model": model, "worker_id": uint64(7), "boot_id": e.boot, "seq": uint64(99), "sent_at": time.Now().UnixNano()}
		publish(t, c.nc, byeSubject(model, 8), enc(t, msg))                                 // worker token 8, payload 7
		publish(t, c.nc, byeSubject(model+"x", 7), enc(t, msg))                             // other model token
		publish(t, c.nc, fmt.Sprintf("%s.bye.%s.07", prefix, modelKey(model)), enc(t, msg)) // non-canonical id
		checkWhere(t, c, model, 7, "busy", "a goodbye on a mismatched subject removed worker 7")
		m.waitRejected(t, "", before+3)
	})
}

// TestContractSubjectMismatch: subject tokens must agree with the payload.
func TestContractSubjectMismatch(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{flags: long(stateFlags...)})
	c := m.client(t)
	model := "mm/Model-1.5 b" // key mm/Model-1=2E5=20b
	p := newPub(t, c, model, 5)
	before := m.rejected(t, "")
	canon := modelKey(model)
	send := func(subject string, worker uint64, rank uint32, extra map[string]any) {
		q := newPub(t, c, model, worker)
		msg := q.msg(rank, extra)
		publish(t, c.nc, subject, enc(t, msg))
	}
	n := 0
	// worker mismatch
	send(fmt.Sprintf("%s.load.%s.%d.0", prefix, canon, 51), 50, 0, nil)
	n++
	// rank mismatch
	send(fmt.Sprintf("%s.load.%s.%d.0", prefix, canon, 52), 52, 1, map[string]any{"dp_size": 2})
	n++
	// non-canonical model keys
	for _, tok := range []string{
		"mm/Model-1=2e5=20b",   // lower-case hex
		"mm/Model-1=2E5=20=62", // over-escaped 'b'
		"=6Dm/Model-1=2E5=20b", // over-escaped 'm'
		"mm=2FModel-1=2E5=20b", // '/' escaped
		"mm/Model-1=2E5=20b-",  // different model
		"other",                // different model
	} {
		send(fmt.Sprintf("%s.load.%s.%d.0", prefix, tok, 53), 53, 0, nil)
		n++
	}
	// non-canonical decimal tokens (implementation choice: exact comparison)
	send(fmt.Sprintf("%s.load.%s.054.0", prefix, canon), 54, 0, nil)
	n++
	send(fmt.Sprintf("%s.load.%s.55.00", prefix, canon), 55, 0, nil)
	n++
	// valid report
	p.report(0, coldLoad)
	r := barrier(t, c, model)
	for _, id := range []uint64{50, 51, 52, 53, 54, 55} {
		if w := r.where(id); w != "" {
			t.Errorf("worker %d from a mismatched subject is listed in %s: %v", id, w, r)
		}
	}
	if r.where(5) != "free" {
		t.Errorf("valid worker 5 not free: %v", r)
	}
	m.waitRejected(t, "", before+float64(n))
	if got := m.rejected(t, "mismatch") + m.rejected(t, "invalid_subject"); got < float64(n)-1 {
		t.Logf("note: mismatch+invalid_subject = %v of %d", got, n)
	}
}

// TestContractHealthEndpoints: /healthz, /readyz and /metrics answer 200.
func TestContractHealthEndpoints(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{})
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		resp, err := http.Get(m.base + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("GET %s = %d", path, resp.StatusCode)
		}
	}
	if n := m.metric(t, "workermon_busy_writer_epoch"); n < 1 {
		t.Logf("note: workermon_busy_writer_epoch = %v", n)
	}
}
