package main

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/monitor"
)

// leadingPub publishes one engine's reports with the fields of §21.
type leadingPub struct {
	t      *testing.T
	nc     *nats.Conn
	worker uint64
	seq    uint64
}

func (p *leadingPub) send(r events.LoadReport) {
	p.t.Helper()
	p.seq++
	r.Model, r.WorkerID, r.DPSize, r.Source = e2eModel, p.worker, 1, events.SourceEngine
	r.BootID, r.Seq, r.SentAt = 100+p.worker, p.seq, time.Now().UnixNano()
	r.KVTotalBlocks = events.Some(100)
	data, err := events.MarshalLoadReport(&r)
	if err != nil {
		p.t.Fatal(err)
	}
	if err := p.nc.Publish(events.LoadSubject(events.DefaultSubjectPrefix, e2eModel, p.worker, 0), data); err != nil {
		p.t.Fatal(err)
	}
	if err := p.nc.Flush(); err != nil {
		p.t.Fatal(err)
	}
}

// TestLeadingSignals is §21 end to end, on a monitor over NATS: an engine
// whose committed blocks pass kv_committed_threshold × kv_total_blocks is
// busy for kv_committed, one whose active prefill tokens ÷ its measured
// prefill rate pass queue_delay_threshold_ms is busy for queue_delay, both
// thresholds set through /busy_threshold; the record carries the
// thresholds and the saturation, /loads the derived values, and
// workermon_model_saturation the exact mean.
func TestLeadingSignals(t *testing.T) {
	t.Parallel()
	svc := testService(t, func(o *serveOptions) { longLived(o); o.adminToken = e2eToken })
	nc, busy := connect(t, svc.natsURL)
	saturation := func() float64 {
		return metricValue(t, svc.reg, "workermon_model_saturation", "model", e2eModel)
	}

	// Worker 1: 40 of 100 blocks held (0.5 of the default 0.8), 150
	// committed.
	w1 := &leadingPub{t: t, nc: nc, worker: 1}
	w1.send(events.LoadReport{ActiveDecodeBlocks: events.Some(40), KVCommittedBlocks: events.Some(150)})
	natstest.WaitFor(t, 15*time.Second, "worker 1 free at saturation 0.5", func() bool {
		b, ok := record(t, busy, e2eModel)
		return ok && slices.Equal(b.Free, []uint64{1}) && b.Saturation == 0.5
	})
	code, _, body := call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`","kv_committed_threshold":1}`)
	if code != http.StatusOK || !strings.Contains(string(body), `"kv_committed_threshold":1,"queue_delay_threshold_ms":null`) {
		t.Fatalf("set kv_committed_threshold = %d %s", code, body)
	}
	natstest.WaitFor(t, 15*time.Second, "worker 1 busy for kv_committed", func() bool {
		b, _ := record(t, busy, e2eModel)
		return slices.Equal(b.Busy, []uint64{1}) && b.Reasons["1"] == events.ReasonKVCommitted && b.Saturation == 1.5 &&
			b.Thresholds.KVCommitted != nil && *b.Thresholds.KVCommitted == 1
	})
	if got := saturation(); got != 1.5 {
		t.Fatalf("workermon_model_saturation = %v, want 1.5", got)
	}

	// Worker 2: 4000 tokens waiting, 250 computed every 50 ms or slower:
	// at most 5000 tokens/s, so at least 800 ms of queue.
	w2 := &leadingPub{t: t, nc: nc, worker: 2}
	var prefilled uint64
	for range 30 {
		w2.send(events.LoadReport{ActiveDecodeBlocks: events.Some(10), ActivePrefillTokens: events.Some(4000),
			PrefilledTokens: events.Some(prefilled), WaitingRequests: events.Some(3), RunningRequests: events.Some(8)})
		prefilled += 250
		time.Sleep(50 * time.Millisecond) // pacing the engine, not waiting for an outcome
	}
	var row monitor.LoadRow
	natstest.WaitFor(t, 15*time.Second, "worker 2's queue delay in GET /loads", func() bool {
		code, _, body := call(t, svc, "GET", "/loads?model="+e2eModel, "", "")
		var reply struct{ Loads []monitor.LoadRow }
		if code != http.StatusOK || json.Unmarshal(body, &reply) != nil {
			return false
		}
		for _, r := range reply.Loads {
			if r.WorkerID == 2 && r.QueueDelayMs != nil && r.PrefilledTokens != nil && *r.PrefilledTokens == prefilled-250 {
				row = r
				return true
			}
		}
		return false
	})
	if row.PrefillRate == nil || *row.PrefillRate <= 0 || *row.PrefillRate > 5000*1.01 || *row.QueueDelayMs < 800*0.99 ||
		*row.WaitingRequests != 3 || *row.RunningRequests != 8 {
		t.Fatalf("worker 2's row: rate %v delay %v waiting %v running %v", row.PrefillRate, row.QueueDelayMs, row.WaitingRequests, row.RunningRequests)
	}
	if b, _ := record(t, busy, e2eModel); !slices.Equal(b.Free, []uint64{2}) {
		t.Fatalf("worker 2 busy before a queue-delay threshold: %+v", b)
	}
	code, _, body = call(t, svc, "POST", "/busy_threshold", e2eToken, `{"model":"`+e2eModel+`","queue_delay_threshold_ms":500}`)
	if code != http.StatusOK || !strings.Contains(string(body), `"kv_committed_threshold":1,"queue_delay_threshold_ms":500`) {
		t.Fatalf("set queue_delay_threshold_ms = %d %s", code, body)
	}
	// Worker 2's saturation is its delay ÷ 500 ms, at least 1.6; the mean
	// with worker 1's 1.5 is at least 1.55.
	var rec events.BusySet
	natstest.WaitFor(t, 15*time.Second, "worker 2 busy for queue_delay", func() bool {
		rec, _ = record(t, busy, e2eModel)
		return slices.Equal(rec.Busy, []uint64{1, 2}) && rec.AllBusy && rec.Reasons["2"] == events.ReasonQueueDelay
	})
	if rec.Saturation < 1.55 || rec.Saturation > 4 || rec.Thresholds.QueueDelayMs == nil || *rec.Thresholds.QueueDelayMs != 500 {
		t.Fatalf("record: saturation %v thresholds %+v", rec.Saturation, rec.Thresholds)
	}
	if got := saturation(); got < 1.55 || got > 4 {
		t.Fatalf("workermon_model_saturation = %v, want the mean of 1.5 and ≥ 1.6", got)
	}

	// Out of range or of the wrong type: refused as the other thresholds are.
	for body, want := range map[string]int{
		`{"model":"` + e2eModel + `","kv_committed_threshold":5}`:      http.StatusBadRequest,
		`{"model":"` + e2eModel + `","queue_delay_threshold_ms":"1"}`:  http.StatusUnprocessableEntity,
		`{"model":"` + e2eModel + `","queue_delay_threshold_ms":-100}`: http.StatusBadRequest,
	} {
		if code, _, got := call(t, svc, "POST", "/busy_threshold", e2eToken, body); code != want {
			t.Errorf("POST %s = %d %s, want %d", body, code, got, want)
		}
	}
}
