package main_test

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/workermon/workermon/bench"
)

// TestBenchProcesses runs `workermon bench --processes` tiny: the binary
// runs itself as the publisher, the monitor (serve) and the watcher, and
// every figure comes back measured, with nothing lost; each process
// writes its CPU profile.
func TestBenchProcesses(t *testing.T) {
	t.Parallel()
	profiles := t.TempDir()
	cmd := exec.CommandContext(t.Context(), wmBinary(t), "bench", "--processes", "--json", "--reports", "2000",
		"--workers", "100", "--models", "4", "--flips", "4", "--profile", profiles)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("bench --processes: %v\n%s", err, stderr.String())
	}
	var r bench.Result
	if err := json.Unmarshal(stdout.Bytes(), &r); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, stdout.String())
	}
	if r.Reports != 2000 || r.IngestRounds != 5 || r.Flips != 4 || r.RawIngest <= 0 || r.Ingest <= 0 ||
		r.IngestRatioMin <= 0 || r.IngestRatioMax < r.IngestRatioMin || r.RawP50 <= 0 || r.P50 <= 0 ||
		r.RawP99 < r.RawP50 || r.P99 < r.P50 || r.NATSVersion == "" || r.Cores < 1 {
		t.Fatalf("figures missing: %+v", r)
	}
	if r.IngestLost != 0 {
		t.Errorf("%d reports lost", r.IngestLost)
	}
	if runtime.GOOS == "linux" && (r.RawIngestCPU <= 0 || r.IngestCPU <= 0 || r.IngestCPUEach[1] <= 0 || r.MonitorRSSMB <= 0) {
		t.Errorf("CPU time or RSS missing: %+v", r)
	}
	for _, role := range []string{"monitor", "publisher", "watcher"} {
		if fi, err := os.Stat(filepath.Join(profiles, role+".cpu.pprof")); err != nil || fi.Size() == 0 {
			t.Errorf("no CPU profile of the %s: %v", role, err)
		}
	}
	for _, line := range []string{"bench: monitor ready: nats-server " + r.NATSVersion, "bench: ingest: 2000 reports", "bench: latency: 4 busy/free flips"} {
		if !strings.Contains(stderr.String(), line) {
			t.Errorf("no %q on stderr:\n%s", line, stderr.String())
		}
	}
}
