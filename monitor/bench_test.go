package monitor

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
)

type nopSink struct{}

func (nopSink) Set(events.BusySet) {}
func (nopSink) Delete(string)      {}

// BenchmarkReport measures one report through decode, dedupe, state update,
// recompute and flush, with models of growing size: the cost must stay flat.
// "steady" reports leave the worker's class as it was (the common case);
// "flip" reports move it between busy and free, so a record is built.
func BenchmarkReport(b *testing.B) {
	for _, workers := range []int{10, 1000, 10000} {
		for _, flip := range []bool{false, true} {
			name := fmt.Sprintf("workers=%d/steady", workers)
			if flip {
				name = fmt.Sprintf("workers=%d/flip", workers)
			}
			b.Run(name, func(b *testing.B) {
				cfg := DefaultConfig()
				cfg.MaxWorkersPerModel = workers
				cfg.Defaults.ActiveDecodeBlocks = events.Ptr(0.8)
				m, err := newMetrics(nil, func() float64 { return 0 })
				if err != nil {
					b.Fatal(err)
				}
				s := newState(cfg, nopSink{}, m, slog.New(slog.DiscardHandler))
				now := time.Now()
				msgs := make([]message, 0, workers)
				var seq uint64
				encode := func(w uint64, decode uint64) message {
					seq++
					r := events.LoadReport{Model: testModel, WorkerID: w, DPSize: 1, Source: events.SourceEngine,
						ActiveDecodeBlocks: events.Some(decode), KVTotalBlocks: events.Some(100), BootID: 1, Seq: seq, SentAt: 1}
					data, err := events.MarshalLoadReport(&r)
					if err != nil {
						b.Fatal(err)
					}
					return message{events.LoadSubject(events.DefaultSubjectPrefix, testModel, w, 0), data}
				}
				for w := range uint64(workers) {
					s.handle(encode(w, 10), now)
				}
				s.flush()
				// Pre-encode enough reports with rising seq for every iteration.
				const rounds = 64
				for i := range rounds * workers {
					decode := uint64(20)
					if flip && (i/workers)%2 == 0 {
						decode = 90
					}
					msgs = append(msgs, encode(uint64(i%workers), decode))
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if i > 0 && i%len(msgs) == 0 {
						b.StopTimer()
						for j := range msgs {
							msgs[j] = encode(uint64(j%workers), 20+uint64(j/workers%2)*70*boolInt(flip))
						}
						b.StartTimer()
					}
					s.handle(msgs[i%len(msgs)], now)
					s.flush()
				}
			})
		}
	}
}

func boolInt(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}
