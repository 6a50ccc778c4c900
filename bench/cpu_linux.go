package bench

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// processCPU is the CPU time the process pid has used so far: the sum of
// its threads' time on a CPU (/proc/<pid>/task/*/schedstat, in
// nanoseconds; getrusage's ticks are too coarse for a round), 0 when
// unknown.
func processCPU(pid int) time.Duration {
	files, _ := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/schedstat")
	var sum time.Duration
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		fields := strings.Fields(string(b))
		if len(fields) == 0 {
			continue
		}
		if ns, err := strconv.ParseInt(fields[0], 10, 64); err == nil {
			sum += time.Duration(ns)
		}
	}
	return sum
}

// processRSSMB is the resident set of the process pid in MB
// (/proc/<pid>/status), 0 when unknown.
func processRSSMB(pid int) float64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err == nil {
				return kb / 1024
			}
		}
	}
	return 0
}
