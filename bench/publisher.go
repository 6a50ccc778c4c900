package bench

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// report is a valid engine report.
func report(model string, worker uint64, seq, used uint64) events.LoadReport {
	return events.LoadReport{Model: model, WorkerID: worker, DPSize: 1, Source: events.SourceEngine,
		ActiveDecodeBlocks: events.Some(used), KVTotalBlocks: events.Some(100), BootID: 1, Seq: seq,
		SentAt: time.Now().UnixNano()}
}

// publisher is the engine's side: it publishes the reports, the raw
// messages and the raw KV puts.
type publisher struct {
	nc         *nats.Conn
	kv         jetstream.KeyValue
	enc        *events.Encoder
	msgs, raws []*nats.Msg
	flipSubj   string
}

func newPublisher(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, o childOptions) (*publisher, error) {
	p := &publisher{nc: nc, enc: events.NewEncoder(),
		flipSubj: events.LoadSubject(events.DefaultSubjectPrefix, latencyModel, 1, 0)}
	var err error
	if p.kv, err = js.KeyValue(ctx, rawBucket); err != nil {
		return nil, fmt.Errorf("bench: raw bucket: %w", err)
	}
	p.msgs = make([]*nats.Msg, o.reports)
	p.raws = make([]*nats.Msg, o.reports)
	seqs := make([]uint64, o.workers)
	for i := range p.msgs {
		w := i % o.workers
		seqs[w]++
		model := "bench/ingest-" + strconv.Itoa(w%o.models)
		data, err := p.enc.LoadReport(events.Ptr(report(model, uint64(w), seqs[w], uint64(10+i%30))))
		if err != nil {
			return nil, err
		}
		data = slices.Clone(data)
		subject := events.LoadSubject(events.DefaultSubjectPrefix, model, uint64(w), 0)
		p.msgs[i] = &nats.Msg{Subject: subject, Data: data}
		p.raws[i] = &nats.Msg{Subject: rawPrefix + strings.TrimPrefix(subject, events.DefaultSubjectPrefix), Data: data}
	}
	return p, nil
}

// handle runs one command and returns the time (Unix ns) it started at:
//
//	raw lo hi        publish raw messages lo to hi
//	reports lo hi k  publish reports lo to hi, then sentinel k
//	put i            put i in the raw bucket
//	flip i busy      publish flip i of the latency worker, busy (1) or not
func (p *publisher) handle(ctx context.Context, verb string, a []int) (int64, error) {
	ranged := func() error {
		if len(a) < 2 || a[0] < 0 || a[0] > a[1] || a[1] > len(p.msgs) {
			return fmt.Errorf("bench: %s %v: bad range", verb, a)
		}
		return nil
	}
	publish := func(msgs []*nats.Msg) error {
		for _, m := range msgs {
			if err := p.nc.PublishMsg(m); err != nil {
				return err
			}
		}
		return nil
	}
	switch {
	case verb == "raw" && len(a) == 2:
		if err := ranged(); err != nil {
			return 0, err
		}
		start := time.Now().UnixNano()
		if err := publish(p.raws[a[0]:a[1]]); err != nil {
			return 0, err
		}
		return start, p.nc.Flush()
	case verb == "reports" && len(a) == 3:
		if err := ranged(); err != nil {
			return 0, err
		}
		sentinel, err := p.enc.LoadReport(events.Ptr(report(sentinelModel, uint64(a[2]), 1, 90)))
		if err != nil {
			return 0, err
		}
		sentinel = slices.Clone(sentinel)
		start := time.Now().UnixNano()
		if err := publish(p.msgs[a[0]:a[1]]); err != nil {
			return 0, err
		}
		if err := p.nc.Publish(events.LoadSubject(events.DefaultSubjectPrefix, sentinelModel, uint64(a[2]), 0), sentinel); err != nil {
			return 0, err
		}
		return start, p.nc.Flush()
	case verb == "put" && len(a) == 1:
		value := []byte(strconv.Itoa(a[0]))
		start := time.Now().UnixNano()
		_, err := p.kv.Put(ctx, rawKey, value)
		return start, err
	case verb == "flip" && len(a) == 2:
		used := uint64(10)
		if a[1] == 1 {
			used = 90
		}
		data, err := p.enc.LoadReport(events.Ptr(report(latencyModel, 1, uint64(a[0]+1), used)))
		if err != nil {
			return 0, err
		}
		start := time.Now().UnixNano()
		return start, p.nc.Publish(p.flipSubj, data)
	}
	return 0, fmt.Errorf("bench: unknown command %s %v", verb, a)
}
