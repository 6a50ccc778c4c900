package main

import (
	"bytes"
	"encoding/json"
	"runtime"
	"strings"
	"testing"

	wmbench "github.com/workermon/workermon/bench"
)

// TestBenchCommand runs `workermon bench` small, with --json: every figure
// is measured (positive), nothing is lost, and the progress goes to stderr.
func TestBenchCommand(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	err := runBench(t.Context(), []string{"--reports", "2000", "--workers", "100", "--models", "4", "--flips", "10",
		"--mem-workers", "200", "--storm-workers", "40", "--storm-for", "300ms", "--json"}, &stdout, &stderr)
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, stderr.String())
	}
	var r wmbench.InProcessResult
	if err := json.Unmarshal(stdout.Bytes(), &r); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, stdout.String())
	}
	if r.RawIngest <= 0 || r.Ingest <= 0 || r.IngestRatio <= 0 || r.RawP50 <= 0 || r.P50 <= 0 || r.P99 < r.P50 ||
		r.MemRanks != 1600 || r.DecideNs <= 0 || r.Cores < 1 || r.StormReports <= 0 || r.StormWrites <= 0 || r.StormModels != 4 ||
		r.QueuesModels != 4 || r.QueuesReports <= 0 || r.QueuesWrites <= 0 || r.QueuesStormWrites <= 0 {
		t.Fatalf("figures missing: %+v", r)
	}
	if r.IngestLost != 0 || r.DecideAllocs != 0 || r.StormLost != 0 {
		t.Fatalf("lost %d reports and %d final states, Decide allocates %d: %+v", r.IngestLost, r.StormLost, r.DecideAllocs, r)
	}
	if r.IngestRounds != 5 || r.IngestRatioMin <= 0 || r.IngestRatioMax < r.IngestRatioMin || r.StormDeadlineMS <= 0 ||
		runtime.GOOS == "linux" && (r.RawIngestCPU <= 0 || r.IngestCPU <= 0) {
		t.Fatalf("rounds, CPU or storm deadline missing: %+v", r)
	}
	if !strings.Contains(stderr.String(), "bench: ingest: 2000 reports from 100 workers of 4 models, in 5 rounds") {
		t.Errorf("no progress line on stderr:\n%s", stderr.String())
	}
	if r.NATSVersion == "" || !strings.Contains(stderr.String(), "bench: clients connected to nats-server "+r.NATSVersion+" at nats://") {
		t.Errorf("NATS server version %q not reported on stderr:\n%s", r.NATSVersion, stderr.String())
	}
	if err := runBench(t.Context(), []string{"--flips", "1"}, &stdout, &stderr); err == nil {
		t.Error("--flips 1 accepted")
	}
}
