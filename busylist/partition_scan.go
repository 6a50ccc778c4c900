package busylist

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
)

// Reading a partition's records without reading the bucket (contract §10):
// the last message of every key is listed with its headers only, which
// carry the writer's epoch (every record put and delete marker of a Writer
// writing with headers has them), and only the values of the partition's
// keys are fetched, when they are needed. A listing of 100,000 keys is a
// few megabytes of headers, whatever the size of the records.

// The headers a Writer puts on every record and delete marker it writes:
// its epoch and its monitor id. A delete marker has no body, so they are
// what tells a later create whether a writer of a higher epoch deleted the
// key.
const (
	headerEpoch   = "Workermon-Epoch"
	headerMonitor = "Workermon-Monitor-Id"
	// headerKVOp is the KV API's operation header: DEL or PURGE on a
	// delete or purge marker.
	headerKVOp = "KV-Operation"
)

// scanFetchBatch is how many heads the listing's pulls ask for at once.
const scanFetchBatch = 1024

// keyHead is the last message of one key of the busy bucket, as listed.
type keyHead struct {
	model, key string
	part       int
	rev        uint64
	deleted    bool   // a delete or purge marker
	epoch      uint64 // valid when epochKnown
	epochKnown bool   // the message carried headerEpoch
	monitor    string // headerMonitor; "" when absent
	data       []byte // the record, when listed with values (scanRecords)
	hasData    bool
}

// readHead fills h's marker, epoch and monitor id from a message's headers.
func readHead(h *keyHead, hdr nats.Header) {
	op := hdr.Get(headerKVOp)
	h.deleted = op == "DEL" || op == "PURGE"
	if v := hdr.Get(headerEpoch); v != "" {
		if e, err := strconv.ParseUint(v, 10, 64); err == nil {
			h.epoch, h.epochKnown = e, true
		}
	}
	h.monitor = hdr.Get(headerMonitor)
}

// scanHeads lists the last message of every key of the bucket kv, headers
// only, and returns those of the models whose partition among parts want
// accepts (every one when want is nil), markers included. idle bounds the
// wait for each next batch, not the whole listing: a large bucket on a
// slow server takes as long as it takes, while a server that stops
// answering fails it. A mirrored bucket, whose stream the subjects below do
// not name, is read with its values.
func scanHeads(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, parts int, want func(int) bool,
	idle time.Duration,
) ([]keyHead, error) {
	return scanKeys(ctx, js, kv, parts, want, idle, false)
}

// scanRecordsUpTo is the largest partition count for which a takeover
// lists the bucket with its values (scanRecords) rather than its headers
// followed by a read of each of the partition's records: a partition is
// then at least half the bucket, and one listing costs less than a request
// per record.
const scanRecordsUpTo = 2

// scanRecords is scanHeads with the records' values: one listing of the
// whole bucket, for a partition that is a large part of it.
func scanRecords(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, parts int, want func(int) bool,
	idle time.Duration,
) ([]keyHead, error) {
	return scanKeys(ctx, js, kv, parts, want, idle, true)
}

// scanKeys is scanHeads, with the values of the records when values.
func scanKeys(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, parts int, want func(int) bool,
	idle time.Duration, values bool,
) ([]keyHead, error) {
	bucket := kv.Bucket()
	sctx, cancel := context.WithTimeout(ctx, idle)
	stream, err := js.Stream(sctx, "KV_"+bucket)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("busylist: list bucket %s: %w", bucket, err)
	}
	info := stream.CachedInfo()
	if info.Config.Mirror != nil {
		return scanValues(ctx, kv, parts, want, idle)
	}
	var heads []keyHead
	if info.State.Msgs == 0 {
		return nil, nil
	}
	cctx, cancel := context.WithTimeout(ctx, idle)
	cons, err := stream.OrderedConsumer(cctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{"$KV." + bucket + ".>"}, DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy,
		HeadersOnly: !values, InactiveThreshold: max(2*idle, time.Second),
	})
	cancel()
	if err != nil {
		return nil, fmt.Errorf("busylist: list bucket %s: %w", bucket, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(scanFetchBatch))
	if err != nil {
		return nil, fmt.Errorf("busylist: list bucket %s: %w", bucket, err)
	}
	defer it.Stop()
	prefix := len("$KV." + bucket + ".")
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		m, err := it.Next(jetstream.NextMaxWait(idle))
		if err != nil {
			return nil, fmt.Errorf("busylist: list bucket %s: %w", bucket, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return nil, fmt.Errorf("busylist: list bucket %s: %w", bucket, err)
		}
		if model, err := events.ParseModelKey(m.Subject()[min(prefix, len(m.Subject())):]); err == nil {
			if p := events.Partition(model, parts); want == nil || want(p) {
				h := keyHead{model: model, key: events.ModelKey(model), part: p, rev: md.Sequence.Stream}
				readHead(&h, m.Headers())
				if values && !h.deleted {
					h.data, h.hasData = m.Data(), true
					if !h.epochKnown {
						bodyHead(&h, h.data)
					}
				}
				heads = append(heads, h)
			}
		}
		if md.NumPending == 0 {
			return heads, nil
		}
	}
}

// scanValues is scanHeads for a bucket whose stream cannot be listed by
// subject: its live records are read with their values, and their epochs
// decoded from them (no marker is listed).
func scanValues(ctx context.Context, kv jetstream.KeyValue, parts int, want func(int) bool, idle time.Duration,
) ([]keyHead, error) {
	var heads []keyHead
	rctx, cancel := context.WithTimeout(ctx, idle)
	defer cancel()
	err := kvbucket.ReadAll(rctx, kv, func(e jetstream.KeyValueEntry) {
		model, err := events.ParseModelKey(e.Key())
		if err != nil {
			return
		}
		p := events.Partition(model, parts)
		if want != nil && !want(p) {
			return
		}
		h := keyHead{model: model, key: e.Key(), part: p, rev: e.Revision(), data: e.Value(), hasData: true}
		bodyHead(&h, e.Value())
		heads = append(heads, h)
	})
	return heads, err
}

// fetchEach calls fn, from up to writerMaxInFlight goroutines at once,
// with each head of heads for which need is true and the last message of
// its key (nil when it has none now, and for a marker, which is not read;
// the value listed, when the listing had them),
// each read bounded by timeout. It returns when every call has returned.
func fetchEach(ctx context.Context, kv jetstream.KeyValue, stream jetstream.Stream, heads []keyHead,
	need func(*keyHead) bool, timeout time.Duration, fn func(h *keyHead, m *rawRecord, err error),
) {
	slots := make(chan struct{}, writerMaxInFlight)
	var wg sync.WaitGroup
	for i := range heads {
		h := &heads[i]
		if need != nil && !need(h) {
			continue
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return
		}
		wg.Go(func() {
			defer func() { <-slots }()
			var m *rawRecord
			var err error
			switch {
			case h.hasData:
				m = &rawRecord{head: *h, data: h.data}
			case !h.deleted:
				m, err = readLast(ctx, kv, stream, h.key, timeout)
			}
			fn(h, m, err)
		})
	}
	wg.Wait()
}

// rawRecord is the last message of a key: a record or a marker.
type rawRecord struct {
	head keyHead
	data []byte
}

// readLast reads the last message of key, marker or record, with its
// headers (nil, nil when the key never had one). Without the bucket's
// stream (a mirror) it reads through the KV API, which hides markers: a
// deleted key then reads as nil.
func readLast(ctx context.Context, kv jetstream.KeyValue, stream jetstream.Stream, key string, timeout time.Duration,
) (*rawRecord, error) {
	octx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	model, _ := events.ParseModelKey(key)
	if stream == nil {
		e, err := kv.Get(octx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		r := &rawRecord{head: keyHead{model: model, key: key, rev: e.Revision()}, data: e.Value()}
		bodyHead(&r.head, e.Value())
		return r, nil
	}
	m, err := stream.GetLastMsgForSubject(octx, "$KV."+kv.Bucket()+"."+key)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	r := &rawRecord{head: keyHead{model: model, key: key, rev: m.Sequence}, data: m.Data}
	readHead(&r.head, m.Header)
	if !r.head.epochKnown && !r.head.deleted {
		bodyHead(&r.head, m.Data)
	}
	return r, nil
}

// bodyHead fills h's epoch and monitor id from a record's body, leniently
// decoded: a record written without the headers.
func bodyHead(h *keyHead, data []byte) {
	var rec struct {
		Epoch     uint64 `msgpack:"epoch"`
		MonitorID string `msgpack:"monitor_id"`
	}
	if msgpack.Unmarshal(data, &rec) == nil {
		h.epoch, h.epochKnown, h.monitor = rec.Epoch, true, rec.MonitorID
	}
}

// partitionEpochs returns, for each partition among parts that want
// accepts, the highest epoch among its records and delete markers in the
// busy bucket kv (contract §10: a new holder's epoch is above it). Only
// the headers of the bucket are listed; a record without the epoch header
// (written by an older version) has its value fetched.
func partitionEpochs(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, parts int,
	want func(int) bool, timeout time.Duration,
) ([]uint64, error) {
	heads, err := scanHeads(ctx, js, kv, parts, want, timeout)
	if err != nil {
		return nil, err
	}
	top := make([]uint64, parts)
	var unknown []keyHead
	for _, h := range heads {
		switch {
		case h.epochKnown:
			top[h.part] = max(top[h.part], h.epoch)
		case !h.deleted:
			unknown = append(unknown, h)
		}
	}
	if len(unknown) == 0 {
		return top, nil
	}
	stream, err := bucketStream(ctx, js, kv, timeout)
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	var failed error
	fetchEach(ctx, kv, stream, unknown, nil, timeout, func(h *keyHead, m *rawRecord, err error) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case err != nil:
			failed = err
		case m != nil && m.head.epochKnown:
			top[h.part] = max(top[h.part], m.head.epoch)
		}
	})
	if failed != nil {
		return nil, fmt.Errorf("busylist: read records of bucket %s: %w", kv.Bucket(), failed)
	}
	return top, ctx.Err()
}

// bucketStream returns the stream of bucket kv, or nil for a mirror (read
// through the KV API).
func bucketStream(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, timeout time.Duration,
) (jetstream.Stream, error) {
	sctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	stream, err := js.Stream(sctx, "KV_"+kv.Bucket())
	if err != nil {
		return nil, fmt.Errorf("busylist: open the stream of bucket %s: %w", kv.Bucket(), err)
	}
	if stream.CachedInfo().Config.Mirror != nil {
		return nil, nil
	}
	return stream, nil
}
