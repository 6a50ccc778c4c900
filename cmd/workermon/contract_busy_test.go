package main_test

import (
	"fmt"
	"testing"
	"time"
)

// busyCase publishes reports (engine source, rank 0, one worker) and checks
// the worker's final place and reason.
type busyCase struct {
	name    string
	reports []map[string]any
	busy    bool
	reason  string // checked when busy
}

func f(kv ...any) map[string]any {
	m := map[string]any{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i].(string)] = kv[i+1]
	}
	return m
}

// runBusyCases starts one monitor with flags and runs every case on its own
// model, in parallel.
func runBusyCases(t *testing.T, flags []string, cases []busyCase) {
	t.Helper()
	t.Parallel()
	_, c, kv := startMonitorKV(t, monOpt{flags: long(flags...)})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			model := newModel(t)
			const w = 7
			p := newPub(t, c, model, w)
			for _, r := range tc.reports {
				p.report(0, r)
			}
			barrier(t, c, model)
			want := "free"
			if tc.busy {
				want = "busy"
			}
			r := waitRecordFor(t, kv, model, fmt.Sprintf("worker %d %s", w, want), 2*time.Second, func(r record) bool {
				return r.has(want, w)
			})
			if tc.busy {
				if got := r.reasons()["7"]; got != tc.reason {
					t.Errorf("reasons[\"7\"] = %q, want %q; record %v", got, tc.reason, r)
				}
			} else if _, ok := r.reasons()["7"]; ok {
				t.Errorf("free worker has a reason: %v", r)
			}
		})
	}
}

func TestContractBusyRules(t *testing.T) {
	t.Run("decode_threshold_0.5", func(t *testing.T) {
		runBusyCases(t, []string{"--active-decode-blocks-threshold", "0.5"}, []busyCase{
			{name: "at_threshold_not_busy", reports: []map[string]any{f("active_decode_blocks", 50, "kv_total_blocks", 100, "active_prefill_tokens", 0)}},
			{name: "threshold_plus_1_busy", reports: []map[string]any{f("active_decode_blocks", 51, "kv_total_blocks", 100, "active_prefill_tokens", 0)}, busy: true, reason: "kv"},
			{name: "half_block_threshold_50_of_101_free", reports: []map[string]any{f("active_decode_blocks", 50, "kv_total_blocks", 101)}},
			{name: "half_block_threshold_51_of_101_busy", reports: []map[string]any{f("active_decode_blocks", 51, "kv_total_blocks", 101)}, busy: true, reason: "kv"},
			{name: "kv_total_0_unknown", reports: []map[string]any{f("active_decode_blocks", 1000, "kv_total_blocks", 0)}},
			{name: "kv_total_absent_unknown", reports: []map[string]any{f("active_decode_blocks", 1000)}},
			{name: "kv_total_set_to_0_later_unknown", reports: []map[string]any{
				f("active_decode_blocks", 90, "kv_total_blocks", 100), f("kv_total_blocks", 0)}},
			{name: "absent_field_keeps_value", reports: []map[string]any{
				f("active_decode_blocks", 90, "kv_total_blocks", 100), f("active_prefill_tokens", 3)}, busy: true, reason: "kv"},
			{name: "present_zero_sets_zero", reports: []map[string]any{
				f("active_decode_blocks", 90, "kv_total_blocks", 100), f("active_decode_blocks", 0)}},
			{name: "prefill_check_off_when_unset", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 1_000_000_000)}},
			{name: "decode_blocks_absent", reports: []map[string]any{f("kv_total_blocks", 100)}},
		})
	})
	t.Run("prefill_threshold_100", func(t *testing.T) {
		runBusyCases(t, []string{"--active-prefill-tokens-threshold", "100"}, []busyCase{
			{name: "at_threshold_not_busy", reports: []map[string]any{f("active_prefill_tokens", 100)}},
			{name: "threshold_plus_1_busy", reports: []map[string]any{f("active_prefill_tokens", 101)}, busy: true, reason: "prefill"},
			{name: "zero", reports: []map[string]any{f("active_prefill_tokens", 0)}},
			{name: "huge_uint64", reports: []map[string]any{f("active_prefill_tokens", uint64(1<<63)+5)}, busy: true, reason: "prefill"},
			{name: "decode_check_off_when_unset", reports: []map[string]any{f("active_decode_blocks", 100, "kv_total_blocks", 100, "active_prefill_tokens", 0)}},
			{name: "absent_field_keeps_value", reports: []map[string]any{f("active_prefill_tokens", 500), f("active_decode_blocks", 1)}, busy: true, reason: "prefill"},
			{name: "back_to_free", reports: []map[string]any{f("active_prefill_tokens", 500), f("active_prefill_tokens", 100)}},
		})
	})
	t.Run("prefill_frac_0.25", func(t *testing.T) {
		runBusyCases(t, []string{"--active-prefill-tokens-threshold-frac", "0.25"}, []busyCase{
			{name: "max_1000_at_250_free", reports: []map[string]any{f("active_prefill_tokens", 250, "max_num_batched_tokens", 1000)}},
			{name: "max_1000_251_busy", reports: []map[string]any{f("active_prefill_tokens", 251, "max_num_batched_tokens", 1000)}, busy: true, reason: "prefill"},
			{name: "max_1001_trunc_250_free", reports: []map[string]any{f("active_prefill_tokens", 250, "max_num_batched_tokens", 1001)}},
			{name: "max_1003_trunc_not_round_251_busy", reports: []map[string]any{f("active_prefill_tokens", 251, "max_num_batched_tokens", 1003)}, busy: true, reason: "prefill"},
			{name: "default_10M_at_2500000_free", reports: []map[string]any{f("active_prefill_tokens", 2_500_000)}},
			{name: "default_10M_2500001_busy", reports: []map[string]any{f("active_prefill_tokens", 2_500_001)}, busy: true, reason: "prefill"},
			{name: "max_0_means_default_free", reports: []map[string]any{f("active_prefill_tokens", 2_500_000, "max_num_batched_tokens", 0)}},
			{name: "max_0_means_default_busy", reports: []map[string]any{f("active_prefill_tokens", 2_500_001, "max_num_batched_tokens", 0)}, busy: true, reason: "prefill"},
			{name: "max_set_to_0_later_means_default", reports: []map[string]any{
				f("active_prefill_tokens", 300, "max_num_batched_tokens", 1000), f("max_num_batched_tokens", 0)}},
			{name: "decode_check_off_when_unset", reports: []map[string]any{f("active_decode_blocks", 100, "kv_total_blocks", 100)}},
		})
	})
	t.Run("float_as_written_0.29", func(t *testing.T) {
		// 0.29 × 100 = 28.999999999999996 in float64.
		runBusyCases(t, []string{"--active-decode-blocks-threshold", "0.29", "--active-prefill-tokens-threshold-frac", "0.29"}, []busyCase{
			{name: "decode_29_of_100_busy", reports: []map[string]any{f("active_decode_blocks", 29, "kv_total_blocks", 100, "active_prefill_tokens", 0, "max_num_batched_tokens", 100)}, busy: true, reason: "kv"},
			{name: "decode_28_of_100_free", reports: []map[string]any{f("active_decode_blocks", 28, "kv_total_blocks", 100, "active_prefill_tokens", 0, "max_num_batched_tokens", 100)}},
			{name: "prefill_29_of_100_busy", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 29, "max_num_batched_tokens", 100)}, busy: true, reason: "prefill"},
			{name: "prefill_28_of_100_free", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 28, "max_num_batched_tokens", 100)}},
			{name: "both", reports: []map[string]any{f("active_decode_blocks", 29, "kv_total_blocks", 100, "active_prefill_tokens", 29, "max_num_batched_tokens", 100)}, busy: true, reason: "kv+prefill"},
		})
	})
	t.Run("zero_thresholds", func(t *testing.T) {
		runBusyCases(t, []string{"--active-decode-blocks-threshold", "0", "--active-prefill-tokens-threshold", "0"}, []busyCase{
			{name: "all_zero_free", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 0)}},
			{name: "one_block_busy", reports: []map[string]any{f("active_decode_blocks", 1, "kv_total_blocks", 100, "active_prefill_tokens", 0)}, busy: true, reason: "kv"},
			{name: "one_token_busy", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 1)}, busy: true, reason: "prefill"},
			{name: "both_busy", reports: []map[string]any{f("active_decode_blocks", 1, "kv_total_blocks", 100, "active_prefill_tokens", 1)}, busy: true, reason: "kv+prefill"},
			{name: "kv_unknown_blocks_ignored", reports: []map[string]any{f("active_decode_blocks", 5, "kv_total_blocks", 0, "active_prefill_tokens", 0)}},
		})
	})
	t.Run("frac_0", func(t *testing.T) {
		runBusyCases(t, []string{"--active-prefill-tokens-threshold-frac", "0"}, []busyCase{
			{name: "zero_free", reports: []map[string]any{f("active_prefill_tokens", 0, "max_num_batched_tokens", 1000)}},
			{name: "one_busy", reports: []map[string]any{f("active_prefill_tokens", 1, "max_num_batched_tokens", 1000)}, busy: true, reason: "prefill"},
			{name: "one_busy_default_max", reports: []map[string]any{f("active_prefill_tokens", 1)}, busy: true, reason: "prefill"},
		})
	})
	t.Run("thresholds_1", func(t *testing.T) {
		runBusyCases(t, []string{"--active-decode-blocks-threshold", "1", "--active-prefill-tokens-threshold-frac", "1"}, []busyCase{
			{name: "decode_full_free", reports: []map[string]any{f("active_decode_blocks", 100, "kv_total_blocks", 100, "active_prefill_tokens", 0)}},
			{name: "decode_over_full_busy", reports: []map[string]any{f("active_decode_blocks", 101, "kv_total_blocks", 100, "active_prefill_tokens", 0)}, busy: true, reason: "kv"},
			{name: "prefill_at_max_free", reports: []map[string]any{f("active_prefill_tokens", 1000, "max_num_batched_tokens", 1000)}},
			{name: "prefill_over_max_busy", reports: []map[string]any{f("active_prefill_tokens", 1001, "max_num_batched_tokens", 1000)}, busy: true, reason: "prefill"},
			{name: "prefill_at_default_max_free", reports: []map[string]any{f("active_prefill_tokens", 10_000_000)}},
			{name: "prefill_over_default_max_busy", reports: []map[string]any{f("active_prefill_tokens", 10_000_001)}, busy: true, reason: "prefill"},
		})
	})
	t.Run("frac_above_1", func(t *testing.T) {
		runBusyCases(t, []string{"--active-prefill-tokens-threshold-frac", "2.5"}, []busyCase{
			{name: "at_2500_free", reports: []map[string]any{f("active_prefill_tokens", 2500, "max_num_batched_tokens", 1000)}},
			{name: "2501_busy", reports: []map[string]any{f("active_prefill_tokens", 2501, "max_num_batched_tokens", 1000)}, busy: true, reason: "prefill"},
		})
	})
	t.Run("none_set_nothing_busy", func(t *testing.T) {
		runBusyCases(t, nil, []busyCase{
			{name: "huge_load", reports: []map[string]any{f("active_decode_blocks", 1_000_000, "kv_total_blocks", 1, "active_prefill_tokens", uint64(1)<<62, "max_num_batched_tokens", 1)}},
			{name: "no_fields", reports: []map[string]any{{}}},
		})
	})
	t.Run("mixed_reasons", func(t *testing.T) {
		runBusyCases(t, []string{"--active-decode-blocks-threshold", "0.5", "--active-prefill-tokens-threshold", "100", "--active-prefill-tokens-threshold-frac", "0.5"}, []busyCase{
			{name: "kv_only", reports: []map[string]any{f("active_decode_blocks", 60, "kv_total_blocks", 100, "active_prefill_tokens", 0)}, busy: true, reason: "kv"},
			{name: "prefill_abs_only", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 101)}, busy: true, reason: "prefill"},
			{name: "prefill_frac_only", reports: []map[string]any{f("active_decode_blocks", 0, "kv_total_blocks", 100, "active_prefill_tokens", 60, "max_num_batched_tokens", 100)}, busy: true, reason: "prefill"},
			{name: "kv_and_prefill", reports: []map[string]any{f("active_decode_blocks", 60, "kv_total_blocks", 100, "active_prefill_tokens", 200)}, busy: true, reason: "kv+prefill"},
			{name: "none", reports: []map[string]any{f("active_decode_blocks", 50, "kv_total_blocks", 100, "active_prefill_tokens", 50, "max_num_batched_tokens", 100)}},
		})
	})
}

// TestContractNoneSetRecord: with no threshold at all nothing is busy,
// all_busy is false and the record's thresholds is an empty map.
func TestContractNoneSetRecord(t *testing.T) {
	t.Parallel()
	_, c, kv := startMonitorKV(t, monOpt{flags: longStale})
	model := newModel(t)
	newPub(t, c, model, 1).report(0, f("active_decode_blocks", 100, "kv_total_blocks", 100, "active_prefill_tokens", 1<<40))
	newPub(t, c, model, 2).report(0, f("active_decode_blocks", 100, "kv_total_blocks", 1, "active_prefill_tokens", 1<<40))
	r := waitLists(t, kv, model, lists{free: u64s(1, 2)})
	if r.allBusy() {
		t.Errorf("all_busy true with no thresholds: %v", r)
	}
	checkRawShape(t, r.raw, map[string]byte{"thresholds": 0x80, "reasons": 0x80, "busy": 0x90, "stale": 0x90})
}

// TestContractDP covers data-parallel aggregation (DESIGN §5).
func TestContractDP(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})
	_, cs, kvs := startMonitorKV(t, monOpt{flags: stateFlags}) // --stale-after 1s
	hot := f("active_prefill_tokens", 500, "active_decode_blocks", 0, "kv_total_blocks", 100)
	cold := f("active_prefill_tokens", 0, "active_decode_blocks", 0, "kv_total_blocks", 100)

	t.Run("busy_only_when_all_ranks_busy", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 3).withDP(0, 2)
		p.report(0, hot)
		p.report(1, cold)
		waitLists(t, kv, model, lists{free: u64s(3)})
		p.report(1, hot)
		r := waitLists(t, kv, model, lists{busy: u64s(3)})
		if !r.allBusy() || r.reasons()["3"] != "prefill" {
			t.Errorf("want all_busy and reason prefill: %v", r)
		}
		p.report(0, cold)
		waitLists(t, kv, model, lists{free: u64s(3)})
	})
	t.Run("unobserved_declared_rank_is_free", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 4).withDP(0, 3)
		p.report(0, hot)
		p.report(1, hot)
		r := barrier(t, c, model)
		if r.where(4) != "free" {
			r = waitRecordFor(t, kv, model, "worker 4 free", time.Second, func(r record) bool { return r.has("free", 4) })
		}
		p.report(2, hot)
		waitRecord(t, kv, model, "worker 4 busy", func(r record) bool { return r.has("busy", 4) })
	})
	t.Run("dp_start_offset", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 5).withDP(4, 2)
		p.report(4, hot)
		r := barrier(t, c, model)
		if r.where(5) != "free" {
			waitRecordFor(t, kv, model, "worker 5 free (rank 5 unobserved)", time.Second, func(r record) bool { return r.has("free", 5) })
		}
		p.report(5, hot)
		waitRecord(t, kv, model, "worker 5 busy", func(r record) bool { return r.has("busy", 5) })
	})
	t.Run("rank_outside_declared_range_rejected", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		before := m.rejected(t, "")
		p := newPub(t, c, model, 6).withDP(4, 2)
		p.report(3, hot) // below dp_start
		p.report(6, hot) // dp_start+dp_size
		q := newPub(t, c, model, 8)
		q.report(1, hot) // default dp_start 0, dp_size 1
		r := barrier(t, c, model)
		for _, id := range []uint64{6, 8} {
			if w := r.where(id); w != "" {
				t.Errorf("worker %d with an out-of-range rank is listed in %s: %v", id, w, r)
			}
		}
		m.waitRejected(t, "", before+3)
	})
	t.Run("reason_is_union_over_ranks", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, c, model, 9).withDP(0, 2)
		p.report(0, f("active_prefill_tokens", 0, "active_decode_blocks", 60, "kv_total_blocks", 100))
		p.report(1, f("active_prefill_tokens", 500, "active_decode_blocks", 0, "kv_total_blocks", 100))
		r := waitLists(t, kv, model, lists{busy: u64s(9)})
		if got := r.reasons()["9"]; got != "kv+prefill" {
			t.Errorf("reason = %q, want kv+prefill: %v", got, r)
		}
	})
	t.Run("stale_rank_counts_as_free", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		p := newPub(t, cs, model, 10).withDP(0, 2)
		p.report(1, hot)
		stop := p.keepAlive(hot, 0)
		defer stop()
		waitLists(t, kvs, model, lists{busy: u64s(10)})
		start := time.Now()
		// rank 1 is now silent: after --stale-after it counts as free.
		r := waitRecordFor(t, kvs, model, "worker 10 free after its rank 1 is stale", tStaleAfter+3*time.Second, func(r record) bool { return r.has("free", 10) })
		if el := time.Since(start); el < tStaleAfter-200*time.Millisecond {
			t.Errorf("rank went stale after %v, before --stale-after %v: %v", el, tStaleAfter, r)
		}
	})
}

// TestContractSources covers several sources for one worker (DESIGN §3).
func TestContractSources(t *testing.T) {
	t.Parallel()
	m, c, kv := startMonitorKV(t, monOpt{flags: long(stateFlags...)})
	_, cs, kvs := startMonitorKV(t, monOpt{flags: stateFlags}) // --stale-after 1s

	t.Run("max_over_sources_router_high", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 1)
		e.report(0, f("active_prefill_tokens", 50))
		waitLists(t, kv, model, lists{free: u64s(1)})
		rt := newPub(t, c, model, 1).withSource("router/r1")
		rt.report(0, f("active_prefill_tokens", 150))
		waitLists(t, kv, model, lists{busy: u64s(1)})
	})
	t.Run("sum_over_routers", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 11)
		e.report(0, f("active_prefill_tokens", 30))
		waitLists(t, kv, model, lists{free: u64s(11)})
		// Each router sees its share: 60 and 50 are each below 100, their
		// sum is above it, and above the engine's 30 (§11).
		newPub(t, c, model, 11).withSource("router/a").report(0, f("active_prefill_tokens", 60))
		checkWhere(t, c, model, 11, "free", "one router's 60 made the worker busy")
		newPub(t, c, model, 11).withSource("router/b").report(0, f("active_prefill_tokens", 50))
		waitRecord(t, kv, model, "worker 11 busy", func(r record) bool { return r.has("busy", 11) })
	})
	t.Run("routers_only_on_est_subjects", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 12)
		e.report(0, f("active_prefill_tokens", 30))
		waitLists(t, kv, model, lists{free: u64s(12)})
		before := m.rejected(t, "source_not_allowed")
		rt := newPub(t, c, model, 12).withSource("router/r1")
		publish(t, c.nc, loadSubject(model, 12, 0), enc(t, rt.msg(0, f("active_prefill_tokens", 500))))
		publish(t, c.nc, estSubject(model, 12, 0), enc(t, e.msg(0, f("active_prefill_tokens", 500))))
		checkWhere(t, c, model, 12, "free", "a router on a load subject, or an engine on an est subject, was heard")
		m.waitRejected(t, "source_not_allowed", before+2)
	})
	t.Run("router_low_estimate_does_not_hide_engine", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 1)
		e.report(0, f("active_prefill_tokens", 150))
		waitLists(t, kv, model, lists{busy: u64s(1)})
		rt := newPub(t, c, model, 1).withSource("router/r1")
		rt.report(0, f("active_prefill_tokens", 0, "active_decode_blocks", 0, "kv_total_blocks", 100))
		checkWhere(t, c, model, 1, "busy", "router's low estimate hid the engine's high load")
		// per-source state: the engine going down to 20 frees the worker (max(20, 0)).
		e.report(0, f("active_prefill_tokens", 20))
		waitRecord(t, kv, model, "worker 1 free", func(r record) bool { return r.has("free", 1) })
		// the router alone raising its estimate makes it busy again, engine unchanged.
		rt.report(0, f("active_prefill_tokens", 101))
		waitRecord(t, kv, model, "worker 1 busy", func(r record) bool { return r.has("busy", 1) })
	})
	t.Run("smallest_positive_capacity", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 2)
		e.report(0, f("active_decode_blocks", 400, "kv_total_blocks", 1000, "active_prefill_tokens", 0))
		waitLists(t, kv, model, lists{free: u64s(2)})
		rt := newPub(t, c, model, 2).withSource("router/r1")
		rt.report(0, f("active_decode_blocks", 0, "kv_total_blocks", 0))
		checkWhere(t, c, model, 2, "free", "unknown capacity (0) of another source counted")
		rt.report(0, f("kv_total_blocks", 600)) // 400 > 0.5×600
		r := waitRecord(t, kv, model, "worker 2 busy (kv, capacity 600)", func(r record) bool { return r.has("busy", 2) })
		if r.reasons()["2"] != "kv" {
			t.Errorf("reason %q, want kv", r.reasons()["2"])
		}
		e.report(0, f("kv_total_blocks", 500)) // 400 > 250: still busy with the smaller engine capacity
		barrier(t, c, model)
		rt.report(0, f("kv_total_blocks", 2000)) // min(500, 2000) = 500: 400 > 250 busy
		checkWhere(t, c, model, 2, "busy", "want busy with min capacity 500")
		e.report(0, f("kv_total_blocks", 1000)) // min(1000, 2000): 400 ≤ 500 free
		waitRecord(t, kv, model, "worker 2 free (capacity 1000)", func(r record) bool { return r.has("free", 2) })
	})
	t.Run("stale_source_ignored", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, cs, model, 3)
		stop := e.keepAlive(f("active_prefill_tokens", 10))
		defer stop()
		waitLists(t, kvs, model, lists{free: u64s(3)})
		rt := newPub(t, cs, model, 3).withSource("router/r1")
		rt.report(0, f("active_prefill_tokens", 500, "kv_total_blocks", 100, "active_decode_blocks", 0))
		waitLists(t, kvs, model, lists{busy: u64s(3)})
		start := time.Now()
		waitRecordFor(t, kvs, model, "worker 3 free once the router source is stale", tStaleAfter+3*time.Second, func(r record) bool { return r.has("free", 3) })
		if el := time.Since(start); el < tStaleAfter-200*time.Millisecond {
			t.Errorf("source ignored after %v, before --stale-after", el)
		}
	})
	t.Run("stale_source_capacity_ignored", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, cs, model, 4)
		stop := e.keepAlive(f("active_decode_blocks", 400, "kv_total_blocks", 1000, "active_prefill_tokens", 0))
		defer stop()
		rt := newPub(t, cs, model, 4).withSource("router/r1")
		rt.report(0, f("kv_total_blocks", 600, "active_decode_blocks", 0))
		waitLists(t, kvs, model, lists{busy: u64s(4)})
		waitRecordFor(t, kvs, model, "worker 4 free once the router's capacity is stale", tStaleAfter+3*time.Second, func(r record) bool { return r.has("free", 4) })
	})
	t.Run("union_of_declared_ranges", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		hot := f("active_prefill_tokens", 500)
		e := newPub(t, c, model, 5).withDP(0, 2)
		e.report(0, hot)
		e.report(1, hot)
		waitLists(t, kv, model, lists{busy: u64s(5)})
		// the router declares ranks 0..2: rank 2 has no state, so the worker is free.
		rt := newPub(t, c, model, 5).withSource("router/r1").withDP(0, 3)
		rt.report(0, hot)
		waitLists(t, kv, model, lists{free: u64s(5)})
		rt.report(2, hot)
		waitLists(t, kv, model, lists{busy: u64s(5)})
	})
	t.Run("stale_source_range_no_longer_declared", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		hot := f("active_prefill_tokens", 500)
		e := newPub(t, cs, model, 8).withDP(0, 2)
		stop := e.keepAlive(hot, 0, 1)
		defer stop()
		waitLists(t, kvs, model, lists{busy: u64s(8)})
		rt := newPub(t, cs, model, 8).withSource("router/r1").withDP(0, 3)
		rt.report(0, hot) // declares rank 2, never reported: free
		waitLists(t, kvs, model, lists{free: u64s(8)})
		// once the router's state is stale its range no longer counts
		waitRecordFor(t, kvs, model, "worker 8 busy again", tStaleAfter+3*time.Second, lists{busy: u64s(8)}.match)
	})
	t.Run("union_disjoint_ranges", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		hot := f("active_prefill_tokens", 500)
		e := newPub(t, c, model, 6).withDP(0, 1)
		e.report(0, hot)
		waitLists(t, kv, model, lists{busy: u64s(6)})
		rt := newPub(t, c, model, 6).withSource("router/r1").withDP(3, 1)
		rt.report(3, f("active_prefill_tokens", 0))
		waitLists(t, kv, model, lists{free: u64s(6)})
		rt.report(3, hot)
		waitLists(t, kv, model, lists{busy: u64s(6)})
	})
	t.Run("seq_is_per_source", func(t *testing.T) {
		t.Parallel()
		model := newModel(t)
		e := newPub(t, c, model, 7)
		e.seq = 1000
		e.report(0, f("active_prefill_tokens", 0))
		waitLists(t, kv, model, lists{free: u64s(7)})
		rt := newPub(t, c, model, 7).withSource("router/r1")
		rt.boot = e.boot                              // same boot id, other source: its own counter
		rt.report(0, f("active_prefill_tokens", 500)) // seq 1
		waitLists(t, kv, model, lists{busy: u64s(7)})
	})
}
