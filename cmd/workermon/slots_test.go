package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/promtest"
	"github.com/workermon/workermon/slots"
)

// slotsTestClock is a clock a test moves.
type slotsTestClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *slotsTestClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *slotsTestClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// slotsTestDo sends a request and returns its status, Allow header and
// body.
func slotsTestDo(t *testing.T, method, url, body string) (int, string, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Allow"), string(b)
}

// slotsTestMetric reads a workermon_slots_* series from reg; -1 when
// absent.
func slotsTestMetric(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	if v, ok := promtest.Value(t, reg, name, labels); ok {
		return v
	}
	return -1
}

// TestSlotsCommand: the slot tracker serves its API, counts what it holds,
// what its caps refuse and what the TTL drops on /metrics, and answers a
// wrong method on /metrics 405.
func TestSlotsCommand(t *testing.T) {
	t.Parallel()
	clock := &slotsTestClock{t: time.Unix(1_800_000_000, 0)}
	o := defaultSlotsOptions()
	o.httpAddr = "127.0.0.1:0"
	o.tracker.Now = clock.now
	o.tracker.MaxWorkers, o.tracker.MaxTotalRanks, o.tracker.MaxHashesPerRequest, o.tracker.MaxBlocks = 2, 3, 3, 4
	reg := newRegistry()
	svc, err := startSlots(t.Context(), o, slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, svc.close)
	base := "http://" + svc.http.addr
	for _, step := range []struct {
		method, path, body string
		status             int
	}{
		{"POST", "/register", `{"worker_id":7,"model_name":"llama-3-8b","block_size":16,"dp_size":2}`, 201},
		{"POST", "/register", `{"worker_id":8,"model_name":"llama-3-8b","block_size":16,"dp_size":2}`, 429},
		{"POST", "/register", `{"worker_id":8,"model_name":"llama-3-8b","block_size":16,"dp_size":1}`, 201},
		{"POST", "/register", `{"worker_id":9,"model_name":"llama-3-8b","block_size":16,"dp_size":1}`, 429},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"a","worker_id":7,"sequence_hashes":[1,2,3]}`, 201},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"b","worker_id":7,"sequence_hashes":[1,2,3,4]}`, 413},
		{"POST", "/potential_loads", `{"model_name":"llama-3-8b","sequence_hashes":[1,2,3,4]}`, 413},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"b","worker_id":7,"dp_rank":1,"sequence_hashes":[5,6]}`, 429},
		{"POST", "/add", `{"model_name":"llama-3-8b","request_id":"b","worker_id":7,"dp_rank":1,"sequence_hashes":[5]}`, 201},
	} {
		if status, _, body := slotsTestDo(t, step.method, base+step.path, step.body); status != step.status {
			t.Errorf("%s %s %s: %d %s, want %d", step.method, step.path, step.body, status, body, step.status)
		}
	}
	for name, want := range map[string]float64{
		"workermon_slots_trackers": 1, "workermon_slots_workers": 2, "workermon_slots_ranks": 3, "workermon_slots_requests": 2,
		"workermon_slots_blocks": 4, "workermon_slots_expired_total": 0,
	} {
		if got := slotsTestMetric(t, reg, name, nil); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	for reason, want := range map[string]float64{"trackers": 0, "workers": 1, "ranks": 1, "requests": 0, "hashes": 2, "blocks": 1} {
		if got := slotsTestMetric(t, reg, "workermon_slots_rejected_total", map[string]string{"reason": reason}); got != want {
			t.Errorf("workermon_slots_rejected_total{reason=%q} = %v, want %v", reason, got, want)
		}
	}
	// Both requests pass the TTL: the next read drops them and counts them.
	clock.add(o.tracker.RequestTTL)
	if got := slotsTestMetric(t, reg, "workermon_slots_expired_total", nil); got != 2 {
		t.Errorf("workermon_slots_expired_total = %v after the TTL, want 2", got)
	}
	if got := slotsTestMetric(t, reg, "workermon_slots_blocks", nil); got != 0 {
		t.Errorf("workermon_slots_blocks = %v after the TTL, want 0", got)
	}
	// /metrics over HTTP, and a wrong method on it.
	if status, _, body := slotsTestDo(t, "GET", base+"/metrics", ""); status != http.StatusOK ||
		!strings.Contains(body, `workermon_slots_rejected_total{reason="hashes"} 2`) {
		t.Errorf("GET /metrics: %d\n%s", status, body)
	}
	if status, allow, body := slotsTestDo(t, "POST", base+"/metrics", ""); status != http.StatusMethodNotAllowed ||
		allow != "GET, HEAD" || !strings.HasPrefix(body, `{"error":`) {
		t.Errorf("POST /metrics: %d, Allow %q, %s; want 405, Allow \"GET, HEAD\", {\"error\": ...}", status, allow, body)
	}
}

// TestSlotsFlags: the caps are flags of both workermon slots and workermon
// router, and a cap that is not positive is refused before anything
// starts.
func TestSlotsFlags(t *testing.T) {
	t.Parallel()
	args := []string{"--request-ttl", "1m", "--max-trackers", "2", "--max-workers", "3", "--max-requests", "4",
		"--max-hashes-per-request", "5", "--max-blocks", "6", "--max-ranks", "7"}
	want := slots.Config{RequestTTL: time.Minute, MaxTrackers: 2, MaxWorkers: 3, MaxRequests: 4, MaxHashesPerRequest: 5,
		MaxBlocks: 6, MaxTotalRanks: 7}
	so, ro := defaultSlotsOptions(), defaultRouterOptions()
	for name, c := range map[string]struct {
		flags func(*flag.FlagSet)
		got   *slots.Config
	}{"slots": {so.flags, &so.tracker}, "router": {ro.flags, &ro.slots}} {
		fs := flag.NewFlagSet(name, flag.ContinueOnError)
		c.flags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got := *c.got; got.Now != nil || fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", want) {
			t.Errorf("%s: %+v, want %+v", name, got, want)
		}
	}
	for _, bad := range []string{"--max-hashes-per-request=0", "--max-blocks=-1", "--max-ranks=0"} {
		o := defaultSlotsOptions()
		fs := flag.NewFlagSet("slots", flag.ContinueOnError)
		o.flags(fs)
		if err := fs.Parse([]string{bad}); err != nil {
			t.Fatal(err)
		}
		if err := o.validate(); err == nil {
			t.Errorf("workermon slots %s was accepted", bad)
		}
		r := defaultRouterOptions()
		fs = flag.NewFlagSet("router", flag.ContinueOnError)
		r.flags(fs)
		if err := fs.Parse([]string{bad}); err != nil {
			t.Fatal(err)
		}
		if err := r.validate(); err == nil {
			t.Errorf("workermon router %s was accepted", bad)
		}
	}
	o := defaultSlotsOptions()
	o.httpAddr, o.tracker.RequestTTL = "127.0.0.1:0", 0
	if _, err := startSlots(t.Context(), o, slog.New(slog.DiscardHandler), newRegistry()); err == nil {
		t.Error("a zero --request-ttl was accepted")
	}
}

// TestRouterPublishFlag: the router's flag is --publish (contract §9);
// the old name --publish-estimates is refused with a message naming the
// new one.
func TestRouterPublishFlag(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args    []string
		want    bool
		wantErr string
	}{
		{nil, true, ""},
		{[]string{"--publish=false"}, false, ""},
		{[]string{"--publish"}, true, ""},
		{[]string{"--publish-estimates=false"}, true, "is now --publish"},
		{[]string{"--publish-estimates"}, true, "is now --publish"},
	} {
		o := defaultRouterOptions()
		fs := flag.NewFlagSet("router", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.flags(fs)
		err := fs.Parse(tc.args)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%v: error %v, want one with %q", tc.args, err, tc.wantErr)
		case o.estimates.publish != tc.want:
			t.Errorf("%v: publish %v, want %v", tc.args, o.estimates.publish, tc.want)
		}
	}
}

// TestRouterSlotsMetrics: the router exports its embedded tracker's
// workermon_slots_* families, the refusals of its caps included, and
// answers a wrong method on /loads with the API's 405.
func TestRouterSlotsMetrics(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	o := defaultRouterOptions()
	o.natsURL = srv.ClientURL()
	o.httpAddr = "127.0.0.1:0"
	o.slots.MaxHashesPerRequest = 2
	reg := newRegistry()
	svc, err := startRouter(o, slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, svc.Close)
	base := "http://" + svc.httpAddr
	if status, _, body := slotsTestDo(t, "POST", base+"/potential_loads", `{"model_name":"m","sequence_hashes":[1,2,3]}`); status != http.StatusRequestEntityTooLarge {
		t.Errorf("POST /potential_loads of 3 hashes: %d %s, want 413", status, body)
	}
	if got := slotsTestMetric(t, reg, "workermon_slots_rejected_total", map[string]string{"reason": "hashes"}); got != 1 {
		t.Errorf("the router's workermon_slots_rejected_total{reason=\"hashes\"} = %v, want 1", got)
	}
	for _, name := range []string{"workermon_slots_requests", "workermon_slots_blocks", "workermon_slots_expired_total"} {
		if got := slotsTestMetric(t, reg, name, nil); got != 0 {
			t.Errorf("the router's %s = %v, want 0", name, got)
		}
	}
	if status, allow, body := slotsTestDo(t, "POST", base+"/loads", ""); status != http.StatusMethodNotAllowed || allow != "GET, HEAD" {
		t.Errorf("POST /loads on the router: %d, Allow %q, %s; want 405", status, allow, body)
	}
}

// TestRegistryRankRangeEndingAt2To32: `workermon slots --from-registry`
// and `workermon router` track a registry entry whose ranks end exactly at
// 2^32 (rank 4294967295 on GET /loads), and drop an entry whose ranks pass
// 2^32, counted in workermon_router_watch_bad_records_total{reason="bad_range"}
// (issue 23 item 16).
func TestRegistryRankRangeEndingAt2To32(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, nil)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range []events.WorkerEntry{
		{Model: "m1", WorkerID: 8, Endpoint: "http://a", DPStart: math.MaxUint32, DPSize: 1, BlockSize: 16},
		{Model: "m1", WorkerID: 9, Endpoint: "http://b", DPStart: math.MaxUint32, DPSize: 2, BlockSize: 16},
	} {
		data, _ := json.Marshal(e)
		routerTestPut(t, js, events.WorkersBucket, events.RegistryKey(e.Model, e.WorkerID), data)
	}
	slotsReg, routerReg := newRegistry(), newRegistry()
	so := defaultSlotsOptions()
	so.httpAddr, so.fromRegistry, so.natsURL = "127.0.0.1:0", true, srv.ClientURL()
	ssvc, err := startSlots(t.Context(), so, slog.New(slog.DiscardHandler), slotsReg)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, ssvc.close)
	ro := defaultRouterOptions()
	ro.httpAddr, ro.natsURL = "127.0.0.1:0", srv.ClientURL()
	rsvc, err := startRouter(ro, slog.New(slog.DiscardHandler), routerReg)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, rsvc.Close)
	for name, c := range map[string]struct {
		base string
		reg  prometheus.Gatherer
	}{"slots": {"http://" + ssvc.http.addr, slotsReg}, "router": {"http://" + rsvc.httpAddr, routerReg}} {
		natstest.WaitFor(t, 15*time.Second, name+": rank 4294967295 on /loads", func() bool {
			_, _, body := slotsTestDo(t, "GET", c.base+"/loads", "")
			return strings.Contains(body, `"worker_id":8,"dp_rank":4294967295,`)
		})
		if _, _, body := slotsTestDo(t, "GET", c.base+"/loads", ""); strings.Contains(body, `"worker_id":9`) {
			t.Errorf("%s: the range past 2^32 is tracked: %s", name, body)
		}
		lbl := map[string]string{"bucket": events.WorkersBucket, "reason": "bad_range"}
		if got := slotsTestMetric(t, c.reg, "workermon_router_watch_bad_records_total", lbl); got != 1 {
			t.Errorf(`%s: workermon_router_watch_bad_records_total{reason="bad_range"} = %v, want 1`, name, got)
		}
	}
}
