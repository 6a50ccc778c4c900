package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/workermon/workermon/sim"
	"github.com/workermon/workermon/sim/stepengine"
)

// `workermon load --json` against a simulated engine prints §16's document
// alone on stdout, with the seed on stderr, and the requests the engine
// served within the SLO count as good.
func TestLoadJSONAgainstSim(t *testing.T) {
	t.Parallel()
	cfg := sim.DefaultWorkerConfig()
	cfg.Ranks = 1
	cfg.Engine.Profile = stepengine.ProfileTiny
	cfg.Engine.DecodeSpeed = 1000 // 1 ms steps alone: a short test
	cfg.Publish.Disabled = true
	cfg.NATS.URL = "nats://127.0.0.1:1" // never dialled
	w, err := sim.NewWorker(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, w.Close)

	var out, errOut strings.Builder
	code := run([]string{"load", "--target", w.Endpoint(), "--model", w.Model(), "--workload", "chat", "--rps", "4",
		"--duration", "2s", "--cancel-fraction", "0", "--seed", "42", "--slo-ttft", "10s", "--slo-itl", "1s",
		"--priority-mix", "0=1", "--json"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	if !strings.Contains(errOut.String(), "seed 42") {
		t.Errorf("stderr %q does not print the seed", errOut.String())
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out.String()), &doc); err != nil {
		t.Fatalf("stdout is not one JSON document: %v\n%s", err, out.String())
	}
	var keys []string
	for k := range doc {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	want := []string{"attempts", "attempts_per_request", "classes", "e2e_ms", "failed", "good", "goodput_rps", "offered_rps", "ok",
		"queue_wait_ms", "queued", "rejected", "shed", "tpot_ms", "ttft_ms"}
	if !slices.Equal(keys, want) {
		t.Fatalf("keys %v; want %v", keys, want)
	}
	var r struct {
		OK, Good uint64
		Classes  map[string]struct{ Good uint64 }
		TTFT     struct{ P50 *float64 } `json:"ttft_ms"`
		Wait     struct{ P50 *float64 } `json:"queue_wait_ms"`
	}
	if err := json.Unmarshal([]byte(out.String()), &r); err != nil {
		t.Fatal(err)
	}
	if r.OK == 0 || r.Good != r.OK || r.Classes["standard"].Good != r.Good || r.TTFT.P50 == nil || r.Wait.P50 != nil {
		t.Errorf("report %s", out.String())
	}
}

// `workermon load --retries 2` sends each request again after a 503 that
// asks for 10 ms (retry-after-ms), numbering its attempts in
// X-Stainless-Retry-Count; the report counts the attempts, the 503s among
// them, and no failed request since every third attempt is served.
func TestLoadRetries(t *testing.T) {
	t.Parallel()
	var attempts, badCount atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		attempts.Add(1)
		switch r.Header.Get("X-Stainless-Retry-Count") {
		case "0", "1":
			w.Header().Set("retry-after-ms", "10")
			w.Header().Set("Retry-After", "1")
			http.Error(w, `{"error":{"message":"busy"}}`, http.StatusServiceUnavailable)
			return
		case "2":
		default:
			badCount.Add(1)
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\" t%d\",\"finish_reason\":null}]}\n\n", i)
		}
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	var out, errOut strings.Builder
	code := run([]string{"load", "--target", srv.URL, "--rps", "10", "--duration", "1s", "--cancel-fraction", "0",
		"--seed", "7", "--slo-ttft", "10s", "--retries", "2", "--json"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	var r struct {
		OK, Rejected, Attempts, Failed uint64
		PerRequest                     float64 `json:"attempts_per_request"`
	}
	if err := json.Unmarshal([]byte(out.String()), &r); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	if r.OK == 0 || r.Attempts != 3*r.OK || r.Rejected != 2*r.OK || r.Failed != 0 || r.PerRequest != 3 || badCount.Load() != 0 ||
		uint64(attempts.Load()) != r.Attempts {
		t.Errorf("report %s; the server saw %d attempts, %d with a wrong retry count", out.String(), attempts.Load(), badCount.Load())
	}
}
