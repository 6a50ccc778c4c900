package bench

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/promreg"
)

// queueRouters is how many routers report their queues per model in the
// queues phase.
const queueRouters = 3

// queuePace is the routers' --queue-pace in the queues phase: each reports
// its queue at most once per pace, the default's.
const queuePace = 20 * time.Millisecond

// queues measures what the routers' queue reports (contract §22) add to
// the record writes under a burst, in the storm's shape: for StormFor,
// queueRouters routers per storm model report queues that fill and drain
// (the counts change on every report, once a pace; a priority comes or
// goes every 25 reports), first over workers that hold still, then beside
// the storm's flipping workers. Steady workers alone, for the same time,
// are the baseline: their heartbeat re-puts.
func (b *inproc) queues(ctx context.Context, res *InProcessResult) error {
	models := min(b.o.Models, b.o.StormWorkers)
	b.progress(fmt.Sprintf("queues: %d routers × %d models reporting their queues every %v for %v, steady then storming workers",
		queueRouters, models, queuePace, b.o.StormFor))
	enc := events.NewEncoder()
	model := func(w int) string { return "bench/storm-" + strconv.Itoa(w%b.o.Models) }
	seqs := make([]uint64, b.o.StormWorkers)
	report := func(w int, busy bool) error {
		seqs[w]++
		used := uint64(10)
		if busy {
			used = 90
		}
		data, err := enc.LoadReport(events.Ptr(inprocReport(model(w), uint64(w), 1_000_000+seqs[w], used)))
		if err != nil {
			return err
		}
		return b.pub.Publish(events.LoadSubject(events.DefaultSubjectPrefix, model(w), uint64(w), 0), data)
	}
	var rqSeq uint64
	rq := func(m, r, round int) error {
		rqSeq++
		q := events.RouterQueue{Model: model(m), Source: "router/bench-" + strconv.Itoa(r), BootID: 1, Seq: rqSeq,
			SentAt: time.Now().UnixNano()}
		if (round/25)%2 == 1 {
			q.Queued = append(q.Queued, events.QueuedLevel{Priority: 1, N: 1})
		}
		q.Queued = append(q.Queued, events.QueuedLevel{Priority: 0, N: uint64(1 + (round+r*7)%50)})
		data, err := enc.RouterQueue(&q)
		if err != nil {
			return err
		}
		return b.pub.Publish(events.RqSubject(events.DefaultSubjectPrefix, model(m)), data)
	}
	// run sends, every pace for StormFor, the queue reports (with queues)
	// and the workers' reports (storming: flipped every 10 ms; else as the
	// storm left them, every second), and returns the record writes and
	// the queue reports per second.
	run := func(withQueues, storming bool) (writes, reports float64, err error) {
		before := promreg.Sum(b.mon.Gatherer(), "workermon_busy_writer_writes_total")
		start := time.Now()
		tick := time.NewTicker(time.Second / 100)
		defer tick.Stop()
		sent := 0
		for round := 0; time.Since(start) < b.o.StormFor; round++ {
			for w := range b.o.StormWorkers {
				switch {
				case storming:
					err = report(w, (w+round)%2 == 0)
				case round%100 == 0:
					err = report(w, w%3 == 0) // the storm's last word: no change
				}
				if err != nil {
					return 0, 0, err
				}
			}
			if withQueues && round%int(queuePace/(time.Second/100)) == 0 {
				for m := range models {
					for r := range queueRouters {
						if err := rq(m, r, round); err != nil {
							return 0, 0, err
						}
						sent++
					}
				}
			}
			select {
			case <-tick.C:
			case <-ctx.Done():
				return 0, 0, ctx.Err()
			}
		}
		if err := b.sentinel(ctx); err != nil {
			return 0, 0, err
		}
		elapsed := time.Since(start).Seconds()
		return (promreg.Sum(b.mon.Gatherer(), "workermon_busy_writer_writes_total") - before) / elapsed, float64(sent) / elapsed, nil
	}
	var err error
	if res.QueuesBaseWrites, _, err = run(false, false); err != nil {
		return err
	}
	if res.QueuesWrites, res.QueuesReports, err = run(true, false); err != nil {
		return err
	}
	if res.QueuesStormWrites, _, err = run(true, true); err != nil {
		return err
	}
	res.QueuesModels = models
	return nil
}
