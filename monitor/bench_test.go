package monitor

import (
	"fmt"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
)

// raw is a message as it arrives.
type raw struct {
	subject string
	data    []byte
}

type nopSink struct{}

func (nopSink) Set(events.BusySet) {}
func (nopSink) Delete(string)      {}

// takingSink is a PendingSink whose writer takes the model's last record
// only when take is called: between two takes the record stays pending and
// the monitor builds no new one (as when a write is in flight).
type takingSink struct {
	pending bool
	builds  int
}

func (s *takingSink) Set(events.BusySet)  { s.pending = true; s.builds++ }
func (s *takingSink) Delete(string)       {}
func (s *takingSink) Pending(string) bool { return s.pending }
func (s *takingSink) take()               { s.pending = false }

// BenchmarkReport measures one report through decode, subject check,
// dedupe, state update, busy rules and the hand-off to the Sink, on one
// goroutine, with models of growing size: the cost must stay flat where the
// record does not change.
//
//   - steady: reports that leave the worker's class as it was (the common
//     case: heartbeats, small changes of load).
//   - flip: every report moves a worker between busy and free, and the Sink
//     takes every record at once (nopSink), so a record is built after each:
//     the worst case, proportional to the model's size.
//   - flip-take-k: the same flips with a Sink that takes the record every k
//     flips, as the busylist.Writer does when a write is in flight (one
//     build per write, monitor.PendingSink): the build is spread over k
//     flips. A write's round trip on one machine is a few hundred µs, in
//     which a storm makes tens to hundreds of flips of one model.
func BenchmarkReport(b *testing.B) {
	for _, workers := range []int{10, 1000, 10000} {
		for _, mode := range []string{"steady", "flip", "flip-take-10", "flip-take-100"} {
			b.Run(fmt.Sprintf("workers=%d/%s", workers, mode), func(b *testing.B) {
				benchReport(b, workers, mode)
			})
		}
	}
}

func benchReport(b *testing.B, workers int, mode string) {
	flip := mode != "steady"
	every := 1
	if k, ok := strings.CutPrefix(mode, "flip-take-"); ok {
		every, _ = strconv.Atoi(k)
	}
	cfg := DefaultConfig()
	cfg.MaxWorkersPerModel = workers
	cfg.Defaults.ActiveDecodeBlocks = events.Ptr(0.8)
	m, err := newMetrics(nil, func() float64 { return 0 })
	if err != nil {
		b.Fatal(err)
	}
	var sink Sink = nopSink{}
	taking := &takingSink{}
	if every > 1 {
		sink = taking
	}
	s := newState(cfg, sink, m, slog.New(slog.DiscardHandler))
	dec := events.NewDecoder()
	now := time.Now()
	var seq uint64
	encode := func(w uint64, decode uint64) raw {
		seq++
		r := events.LoadReport{Model: testModel, WorkerID: w, DPSize: 1, Source: events.SourceEngine,
			ActiveDecodeBlocks: events.Some(decode), KVTotalBlocks: events.Some(100), BootID: 1, Seq: seq, SentAt: 1}
		data, err := events.MarshalLoadReport(&r)
		if err != nil {
			b.Fatal(err)
		}
		return raw{events.LoadSubject(events.DefaultSubjectPrefix, testModel, w, 0), data}
	}
	// handle is what the loop does to one message.
	handle := func(r raw) {
		msg := decodeMessage(events.DefaultSubjectPrefix, 0, dec, r.subject, r.data)
		s.handle(&msg, now)
	}
	for w := range uint64(workers) {
		handle(encode(w, 10))
	}
	s.flushAll(now)
	// Enough reports with rising seq for a round of every worker; rounds
	// alternate busy and free when flipping.
	const rounds = 64
	msgs := make([]raw, 0, rounds*workers)
	fill := func() {
		msgs = msgs[:0]
		for i := range rounds * workers {
			decode := uint64(20)
			if flip && (i/workers)%2 == 0 {
				decode = 90
			}
			msgs = append(msgs, encode(uint64(i%workers), decode))
		}
	}
	fill()
	taking.builds = 0
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i > 0 && i%len(msgs) == 0 {
			b.StopTimer()
			fill()
			b.StartTimer()
		}
		if i%every == 0 {
			taking.take()
		}
		handle(msgs[i%len(msgs)])
		s.flush(now)
	}
	if every > 1 {
		b.ReportMetric(float64(taking.builds)/float64(b.N), "builds/op")
	}
}

// BenchmarkApplyScale measures the apply of one steady report (state
// update, busy rules, no record change: decoding is BenchmarkDecodeLoadReport
// of package events, a constant) with 1,000 to 100,000 workers of 8 ranks,
// and 1,000 of one rank, 1,000 workers per model, every rank reporting in turn; and the heap the
// state holds per rank (heap-B/rank, the live heap after a collection
// beside the empty state's). The cost must stay flat as the fleet grows.
func BenchmarkApplyScale(b *testing.B) {
	for _, sc := range []struct{ workers, ranks int }{{1_000, 1}, {1_000, 8}, {10_000, 8}, {100_000, 8}} {
		workers, ranks := sc.workers, sc.ranks
		b.Run(fmt.Sprintf("workers=%d/ranks=%d", workers, ranks), func(b *testing.B) {
			const perModel = 1000
			cfg := DefaultConfig()
			cfg.Defaults.ActiveDecodeBlocks = events.Ptr(0.8)
			m, err := newMetrics(nil, func() float64 { return 0 })
			if err != nil {
				b.Fatal(err)
			}
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			s := newState(cfg, nopSink{}, m, slog.New(slog.DiscardHandler))
			now := time.Now()
			models := make([]string, (workers+perModel-1)/perModel)
			for i := range models {
				models[i] = "bench/scale-" + strconv.Itoa(i)
			}
			seqs := make([]uint64, workers)
			var msg message
			msg.kind = events.KindLoad
			report := func(i int, used uint64) {
				w := (i / ranks) % workers
				seqs[w]++
				msg.report = events.LoadReport{Model: models[w/perModel], WorkerID: uint64(w), DPRank: uint32(i % ranks),
					DPSize: uint32(ranks), Source: events.SourceEngine, ActiveDecodeBlocks: events.Some(used),
					KVTotalBlocks: events.Some(100), BootID: 1, Seq: seqs[w], SentAt: 1}
				s.handle(&msg, now)
			}
			for i := range workers * ranks {
				report(i, 10)
			}
			s.flushAll(now)
			runtime.GC()
			runtime.ReadMemStats(&after)
			perRank := float64(after.HeapAlloc-before.HeapAlloc) / float64(workers*ranks)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				report(i, 10+uint64(i%20)) // below the threshold: steady
				s.flush(now)
			}
			b.ReportMetric(perRank, "heap-B/rank")
			runtime.KeepAlive(s)
		})
	}
}
