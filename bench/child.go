package bench

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
)

// Names shared by the processes.
const (
	// sentinelModel is the model of the sentinel reports that end an
	// ingest round.
	sentinelModel = "bench/sentinel"
	// latencyModel is the model whose worker 1 flips for the latency.
	latencyModel = "bench/latency"
	// rawBucket is the bucket of the raw KV put → watch, made as the busy
	// bucket is; rawKey its key.
	rawBucket, rawKey = "workermon-bench", "k"
	// rawPrefix is the first token of the raw messages' subjects: as long
	// as the monitor's prefix, so that both carry subjects of the same
	// length.
	rawPrefix = "benchmark"
)

var _ = [1]int{}[len(rawPrefix)-len(events.DefaultSubjectPrefix)] // same length

// Roles of the children.
const (
	rolePublisher = "publisher"
	roleWatcher   = "watcher"
	roleMonitor   = "monitor"
)

// childOptions is what a child is told on its command line.
type childOptions struct {
	role                     string
	natsURL                  string
	reports, workers, models int
	cpuProfile               string
}

func (o *childOptions) args() []string {
	a := []string{"--role", o.role, "--nats", o.natsURL, "--reports", strconv.Itoa(o.reports),
		"--workers", strconv.Itoa(o.workers), "--models", strconv.Itoa(o.models)}
	if o.cpuProfile != "" {
		a = append(a, "--cpuprofile", o.cpuProfile)
	}
	return a
}

// RunChild is a child process of Run, told its role by args: the
// publisher or the watcher, which read commands from stdin and answer on
// stdout until stdin ends, or the monitor, profiled (serve is called with
// the arguments after "--", and runs until ctx ends).
func RunChild(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer,
	serve func(ctx context.Context, args []string) error) (err error) {
	var o childOptions
	fs := flag.NewFlagSet("bench child", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.role, "role", "", "publisher, watcher or monitor")
	fs.StringVar(&o.natsURL, "nats", "", "NATS URL")
	fs.IntVar(&o.reports, "reports", DefaultReports, "ingest reports")
	fs.IntVar(&o.workers, "workers", DefaultWorkers, "ingest workers")
	fs.IntVar(&o.models, "models", DefaultModels, "ingest models")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "file to write a CPU profile to")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return fmt.Errorf("bench: profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return fmt.Errorf("bench: profile: %w", err)
		}
		defer func() {
			pprof.StopCPUProfile()
			err = errors.Join(err, f.Close())
		}()
	}
	switch o.role {
	case roleMonitor:
		return serve(ctx, fs.Args())
	case rolePublisher, roleWatcher:
	default:
		return fmt.Errorf("bench: unknown role %q", o.role)
	}
	nc, err := nats.Connect(o.natsURL, nats.Name("workermon-bench-"+o.role))
	if err != nil {
		return fmt.Errorf("bench: %s: %w", o.role, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	var handle func(ctx context.Context, verb string, args []int) (int64, error)
	if o.role == rolePublisher {
		p, err := newPublisher(ctx, nc, js, o)
		if err != nil {
			return err
		}
		handle = p.handle
	} else {
		w, err := newWatcher(ctx, nc, js)
		if err != nil {
			return err
		}
		defer w.close()
		handle = w.handle
	}
	return serveCommands(ctx, stdin, stdout, handle)
}

// serveCommands answers each line of stdin, "verb n n ...", with "ok t"
// or "err message" on stdout, after a first line "ready".
func serveCommands(ctx context.Context, stdin io.Reader, stdout io.Writer,
	handle func(ctx context.Context, verb string, args []int) (int64, error)) error {
	out := bufio.NewWriter(stdout)
	reply := func(format string, a ...any) error {
		fmt.Fprintf(out, format+"\n", a...)
		return out.Flush()
	}
	if err := reply("ready"); err != nil {
		return err
	}
	sc := bufio.NewScanner(stdin)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		args := make([]int, 0, len(fields)-1)
		for _, f := range fields[1:] {
			n, err := strconv.Atoi(f)
			if err != nil {
				return fmt.Errorf("bench: command %q: %w", sc.Text(), err)
			}
			args = append(args, n)
		}
		t, err := handle(ctx, fields[0], args)
		if err != nil {
			if rerr := reply("err %s", strings.ReplaceAll(err.Error(), "\n", "; ")); rerr != nil {
				return rerr
			}
			continue
		}
		if err := reply("ok %d", t); err != nil {
			return err
		}
	}
	return sc.Err()
}

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
