package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
)

// watcher is the router's side: it counts the raw messages and watches the
// records and the raw bucket. A command arms what to wait for; "wait"
// answers the time (Unix ns) it was seen.
type watcher struct {
	sub              *nats.Subscription
	got, want        atomic.Int64
	counted          chan int64
	sentW, flipW     jetstream.KeyWatcher
	rawW             jetstream.KeyWatcher
	stopSent, stopFl context.CancelFunc
	stopRaw          context.CancelFunc
	armed            func(ctx context.Context) (int64, error)
}

func newWatcher(ctx context.Context, nc *nats.Conn, js jetstream.JetStream) (_ *watcher, err error) {
	w := &watcher{counted: make(chan int64, 1), stopSent: func() {}, stopFl: func() {}, stopRaw: func() {}}
	defer func() {
		if err != nil {
			w.close()
		}
	}()
	if w.sub, err = nc.Subscribe(rawPrefix+".>", func(*nats.Msg) {
		if w.got.Add(1) == w.want.Load() {
			w.counted <- time.Now().UnixNano()
		}
	}); err != nil {
		return nil, err
	}
	if err := w.sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	busy, err := js.KeyValue(ctx, events.BusyBucket)
	if err != nil {
		return nil, fmt.Errorf("bench: busy bucket: %w", err)
	}
	raw, err := js.KeyValue(ctx, rawBucket)
	if err != nil {
		return nil, fmt.Errorf("bench: raw bucket: %w", err)
	}
	watch := func(kv jetstream.KeyValue, key string, stop *context.CancelFunc) (jetstream.KeyWatcher, error) {
		wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		*stop = cancel
		return kv.Watch(wctx, key, jetstream.UpdatesOnly())
	}
	if w.sentW, err = watch(busy, events.ModelKey(sentinelModel), &w.stopSent); err != nil {
		return nil, err
	}
	if w.flipW, err = watch(busy, events.ModelKey(latencyModel), &w.stopFl); err != nil {
		return nil, err
	}
	if w.rawW, err = watch(raw, rawKey, &w.stopRaw); err != nil {
		return nil, err
	}
	return w, nc.Flush()
}

func (w *watcher) close() {
	if w.sub != nil {
		_ = w.sub.Unsubscribe()
	}
	kvbucket.StopWatch(w.sentW, w.stopSent)
	kvbucket.StopWatch(w.flipW, w.stopFl)
	kvbucket.StopWatch(w.rawW, w.stopRaw)
}

// handle runs one command:
//
//	count n     arm: the raw subscriber's n-th message
//	sentinel k  arm: a sentinel record listing worker k busy
//	flip busy   arm: a latency record listing worker 1 busy (1) or free
//	rawkv i     arm: the raw key holding i
//	wait        wait for what is armed; answers when it was seen
func (w *watcher) handle(ctx context.Context, verb string, a []int) (int64, error) {
	if verb == "wait" && len(a) == 0 {
		if w.armed == nil {
			return 0, errors.New("bench: nothing armed")
		}
		armed := w.armed
		w.armed = nil
		return armed(ctx)
	}
	if len(a) != 1 {
		return 0, fmt.Errorf("bench: unknown command %s %v", verb, a)
	}
	n := a[0]
	switch verb {
	case "count":
		w.want.Store(int64(n))
		w.armed = func(ctx context.Context) (int64, error) {
			select {
			case t := <-w.counted:
				return t, nil
			case <-ctx.Done():
				return 0, ctx.Err()
			}
		}
	case "sentinel":
		w.armed = func(ctx context.Context) (int64, error) {
			return awaitRecord(ctx, w.sentW, func(r events.BusySet) bool { return slices.Contains(r.Busy, uint64(n)) })
		}
	case "flip":
		w.armed = func(ctx context.Context) (int64, error) {
			return awaitRecord(ctx, w.flipW, func(r events.BusySet) bool { return slices.Contains(r.Busy, 1) == (n == 1) })
		}
	case "rawkv":
		want := strconv.Itoa(n)
		w.armed = func(ctx context.Context) (int64, error) {
			return awaitEntry(ctx, w.rawW, func(e jetstream.KeyValueEntry) bool { return string(e.Value()) == want })
		}
	default:
		return 0, fmt.Errorf("bench: unknown command %s %v", verb, a)
	}
	return 0, nil
}

// awaitRecord reads kw until a record satisfies ok and returns when it came.
func awaitRecord(ctx context.Context, kw jetstream.KeyWatcher, ok func(events.BusySet) bool) (int64, error) {
	return awaitEntry(ctx, kw, func(e jetstream.KeyValueEntry) bool {
		rec, err := events.DecodeBusySet(e.Value())
		return err == nil && ok(rec)
	})
}

// awaitEntry reads kw until an entry satisfies ok and returns when it came
// (Unix ns). The parent bounds the wait.
func awaitEntry(ctx context.Context, kw jetstream.KeyWatcher, ok func(jetstream.KeyValueEntry) bool) (int64, error) {
	for {
		select {
		case e, open := <-kw.Updates():
			now := time.Now().UnixNano()
			if !open {
				return 0, errors.New("bench: watch ended")
			}
			if e != nil && ok(e) {
				return now, nil
			}
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}
