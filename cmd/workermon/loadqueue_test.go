package main

import (
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/loadgen"
)

// TestGoodputLineQueueWaits: workermon load's text report shows the answers
// that waited in a router's queue and their waits (contract §17), and
// nothing of the queue when none waited.
func TestGoodputLineQueueWaits(t *testing.T) {
	t.Parallel()
	c := loadgen.Counts{Duration: time.Second, Sent: 10, Good: 5, Queued: 4,
		QueueWait: loadgen.Latency{Count: 4, P50: 120 * time.Millisecond, P99: 900 * time.Millisecond}}
	if got := goodputLine(c); !strings.HasSuffix(got, "| queued 4, wait p50 120ms p99 900ms") {
		t.Errorf("goodput line %q: want the queued answers and their waits", got)
	}
	c.Queued, c.QueueWait = 0, loadgen.Latency{}
	if got := goodputLine(c); strings.Contains(got, "queued") {
		t.Errorf("goodput line %q: want nothing of the queue", got)
	}
}
