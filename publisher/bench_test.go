package publisher_test

import (
	"sync/atomic"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

// BenchmarkUpdate measures the engine's call: every update changes the
// value, so each one marks its rank for publishing.
func BenchmarkUpdate(b *testing.B) {
	e := newEnv(b)
	const ranks = 8
	p := e.start(b, "Qwen/Qwen3-0.6B", 1, publisher.WithRanks(0, ranks))

	b.Run("one goroutine", func(b *testing.B) {
		b.ReportAllocs()
		var v uint64
		for b.Loop() {
			v++
			if err := p.Update(uint32(v%ranks), publisher.Load{ActiveDecodeBlocks: events.Some(v)}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		var next atomic.Uint32
		b.RunParallel(func(pb *testing.PB) {
			rank := next.Add(1) % ranks
			var v uint64
			for pb.Next() {
				v++
				if err := p.Update(rank, publisher.Load{ActiveDecodeBlocks: events.Some(v)}); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}
