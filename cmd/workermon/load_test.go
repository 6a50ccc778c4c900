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

// `workermon load --sim-output-tokens` asks each request for the top of its
// workload's output range and sends the length drawn in sim_output_tokens;
// the answers' usage gives the tokens. Without a workload of ranges it is a
// configuration error.
func TestLoadSimOutputTokens(t *testing.T) {
	t.Parallel()
	var bad atomic.Int64
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			MaxTokens int `json:"max_tokens"`
			Output    int `json:"sim_output_tokens"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.MaxTokens != 256 || body.Output < 64 || body.Output > 256 {
			bad.Add(1)
		}
		requests.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range body.Output {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\" t%d\",\"finish_reason\":null}]}\n\n", i)
		}
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"stop\"}]}\n\n"+
			"data: {\"choices\":[],\"usage\":{\"completion_tokens\":%d}}\n\ndata: [DONE]\n\n", body.Output)
	}))
	defer srv.Close()
	var out, errOut strings.Builder
	code := run([]string{"load", "--target", srv.URL, "--workload", "chat", "--sim-output-tokens", "--rps", "10", "--duration", "1s",
		"--cancel-fraction", "0", "--seed", "7", "--slo-ttft", "10s", "--json"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	var r struct{ OK, Good uint64 }
	if err := json.Unmarshal([]byte(out.String()), &r); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	if r.OK == 0 || r.Good != r.OK || bad.Load() != 0 {
		t.Errorf("report %s; %d of the %d bodies without max_tokens 256 and sim_output_tokens in 64-256", out.String(), bad.Load(), requests.Load())
	}

	out.Reset()
	errOut.Reset()
	if code := run([]string{"load", "--target", srv.URL, "--sim-output-tokens", "--duration", "1s"}, &out, &errOut); code == 0 ||
		!strings.Contains(errOut.String(), "SimOutputTokens") {
		t.Errorf("--sim-output-tokens with the fixed workload: exit %d, stderr %q", code, errOut.String())
	}
}
