package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	wmbench "github.com/workermon/workermon/bench"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
)

// benchOptions is everything `workermon bench` can be told.
type benchOptions struct {
	reports     int
	workers     int
	models      int
	flips       int
	rounds      int
	memWorkers  int
	storm       int
	stormFor    time.Duration
	jsonOut     bool
	waitTimeout time.Duration
	profileDir  string
	processes   bool
	log         logOptions
}

func defaultBenchOptions() benchOptions {
	return benchOptions{reports: 100_000, workers: 1_000, models: 10, flips: 200, rounds: 5, memWorkers: 10_000,
		storm: 1_000, stormFor: 2 * time.Second, waitTimeout: 2 * time.Minute, log: logOptions{level: "error", format: "text"}}
}

func (o *benchOptions) flags(fs *flag.FlagSet) {
	fs.IntVar(&o.reports, "reports", o.reports, "reports published for the ingest figures")
	fs.IntVar(&o.workers, "workers", o.workers, "workers the ingest reports come from")
	fs.IntVar(&o.models, "models", o.models, "models the workers serve")
	fs.IntVar(&o.flips, "flips", o.flips, "busy/free flips (and raw KV puts) timed for the latency figures")
	fs.IntVar(&o.rounds, "rounds", o.rounds, "rounds the ingest reports are sent in, each beside as many raw messages")
	fs.IntVar(&o.memWorkers, "mem-workers", o.memWorkers, "workers of 8 ranks held for the memory figure")
	fs.IntVar(&o.storm, "storm-workers", o.storm, "workers (of --models models) flipping busy/free 100 times a second in the storm")
	fs.DurationVar(&o.stormFor, "storm-for", o.stormFor, "how long the storm lasts")
	fs.BoolVar(&o.jsonOut, "json", o.jsonOut, "print the figures as one JSON object")
	fs.DurationVar(&o.waitTimeout, "timeout", o.waitTimeout, "longest wait for one phase")
	fs.StringVar(&o.profileDir, "profile", o.profileDir, "directory to write a CPU and an allocation profile of each phase to (go tool pprof)")
	fs.BoolVar(&o.processes, "processes", o.processes,
		"publisher, monitor (serve on its embedded NATS) and watcher in three processes: ingest and latency only")
	o.log.flags(fs)
}

func (o benchOptions) validate() error {
	var errs []error
	for _, f := range []struct {
		name string
		v    int
		min  int
	}{{"--reports", o.reports, 1}, {"--workers", o.workers, 1}, {"--models", o.models, 1}, {"--flips", o.flips, 2}, {"--rounds", o.rounds, 1}, {"--mem-workers", o.memWorkers, 1}, {"--storm-workers", o.storm, 1}} {
		if f.v < f.min {
			errs = append(errs, fmt.Errorf("%s %d must be at least %d", f.name, f.v, f.min))
		}
	}
	if o.stormFor <= 0 {
		errs = append(errs, fmt.Errorf("--storm-for %v must be positive", o.stormFor))
	}
	if o.rounds > o.reports {
		errs = append(errs, fmt.Errorf("--rounds %d must be at most --reports %d", o.rounds, o.reports))
	}
	if o.workers > o.models*4096 || o.storm > o.models*4096 || o.memWorkers > 1024*4096 {
		errs = append(errs, fmt.Errorf("at most 4096 workers per model (the monitor's default cap)"))
	}
	if o.waitTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--timeout %v must be positive", o.waitTimeout))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// benchResult is what `workermon bench` measures; times in microseconds.
type benchResult struct {
	Cores           int     `json:"cores"`
	NATSVersion     string  `json:"nats_server_version"`
	Reports         int     `json:"reports"`
	RawIngest       float64 `json:"raw_ingest_msgs_per_s"`
	Ingest          float64 `json:"ingest_reports_per_s"`
	IngestRatio     float64 `json:"ingest_ratio"`
	IngestRatioMin  float64 `json:"ingest_ratio_min"`
	IngestRatioMax  float64 `json:"ingest_ratio_max"`
	IngestRounds    int     `json:"ingest_rounds"`
	RawIngestCPU    float64 `json:"raw_ingest_cpu_us_per_msg"`
	IngestCPU       float64 `json:"ingest_cpu_us_per_report"`
	IngestLost      int     `json:"ingest_lost"`
	Flips           int     `json:"flips"`
	RawP50          float64 `json:"raw_kv_put_to_watch_p50_us"`
	RawP99          float64 `json:"raw_kv_put_to_watch_p99_us"`
	P50             float64 `json:"report_to_record_p50_us"`
	P99             float64 `json:"report_to_record_p99_us"`
	MemWorkers      int     `json:"mem_workers"`
	MemRanks        int     `json:"mem_ranks"`
	MemMB           float64 `json:"mem_heap_mb"`
	MemBytesPerRank float64 `json:"mem_bytes_per_rank"`
	RSSMB           float64 `json:"rss_mb"`
	StormWorkers    int     `json:"storm_workers"`
	StormReports    float64 `json:"storm_reports_per_s"`
	StormWrites     float64 `json:"storm_writes_per_s"`
	StormModels     int     `json:"storm_models"`
	StormLost       int     `json:"storm_lost_final_states"`
	StormDeadlineMS float64 `json:"storm_final_state_deadline_ms"`
	DecideNs        float64 `json:"decide_ns"`
	DecideAllocs    int64   `json:"decide_allocs"`
}

// runBench is `workermon bench`: an embedded NATS server and the monitor in
// this process, measured side by side with the raw NATS limits.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == benchChildFlag {
		// A profiled monitor: `serve` and its flags after "--".
		return wmbench.RunChild(ctx, args[1:], os.Stdin, stdout, stderr, func(ctx context.Context, args []string) error {
			if len(args) == 0 || args[0] != "serve" {
				return fmt.Errorf("%w: bench: the monitor child runs serve, not %q", errUsage, args)
			}
			return runServe(ctx, args[1:], stdout, stderr)
		})
	}
	if len(args) > 0 && args[0] == "goodput" {
		return runBenchGoodput(ctx, args[1:], stdout, stderr)
	}
	o := defaultBenchOptions()
	log, err := parseCommand("bench", args, stderr, nil, o.flags, &o.log)
	if err != nil {
		return err
	}
	if err := o.validate(); err != nil {
		return err
	}
	if o.processes {
		return runBenchProcesses(ctx, o, stdout, stderr)
	}
	res, err := bench(ctx, o, log, func(msg string) { fmt.Fprintf(stderr, "bench: %s\n", msg) })
	if err != nil {
		return err
	}
	if o.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	printBench(stdout, res)
	return nil
}

// bench runs every measurement; progress is told each phase.
func bench(ctx context.Context, o benchOptions, log *slog.Logger, progress func(string)) (benchResult, error) {
	res := benchResult{Cores: runtime.GOMAXPROCS(0), Reports: o.reports, Flips: o.flips}
	dir, err := os.MkdirTemp("", "workermon-bench-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	so := defaultServeOptions()
	so.embedded.Addr, so.embedded.DataDir, so.httpAddr = "127.0.0.1:0", dir, "127.0.0.1:0"
	so.writer.Warmup = 0
	so.monitor.Defaults = events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.5)}
	progress("starting an embedded NATS server and the monitor")
	svc, err := startService(ctx, so, log, newRegistry())
	if err != nil {
		return res, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), DefaultShutdownTimeout)
		defer cancel()
		_ = svc.Close(cctx)
	}()
	select {
	case <-svc.leaser.Settled():
	case <-time.After(o.waitTimeout):
		return res, errors.New("bench: the monitor did not take its partitions")
	case <-ctx.Done():
		return res, ctx.Err()
	}
	b := &bencher{o: o, svc: svc, progress: progress, heartbeat: so.writer.Heartbeat}
	if b.pub, err = nats.Connect(svc.natsURL, nats.Name("workermon-bench")); err != nil {
		return res, err
	}
	defer b.pub.Close()
	if b.watch, err = nats.Connect(svc.natsURL, nats.Name("workermon-bench-watch")); err != nil {
		return res, err
	}
	defer b.watch.Close()
	// Every command logs the server's version at connect (contract §14).
	for _, nc := range []*nats.Conn{b.pub, b.watch} {
		log.Info("nats: connected", "client", nc.Opts.Name, "url", nc.ConnectedUrlRedacted(),
			"server_version", nc.ConnectedServerVersion())
	}
	res.NATSVersion = b.watch.ConnectedServerVersion()
	progress("clients connected to nats-server " + res.NATSVersion + " at " + b.watch.ConnectedUrlRedacted())
	if b.js, err = jetstream.New(b.watch); err != nil {
		return res, err
	}
	if b.busy, err = b.js.KeyValue(ctx, events.BusyBucket); err != nil {
		return res, fmt.Errorf("bench: busy bucket: %w", err)
	}
	// One watcher of the sentinel's record for the whole run: creating one
	// costs a round trip to JetStream, which the ingest must not time.
	if b.sentW, err = b.busy.Watch(ctx, events.ModelKey(benchSentinel), jetstream.UpdatesOnly()); err != nil {
		return res, err
	}
	defer b.sentW.Stop()
	for _, phase := range []struct {
		name string
		run  func(context.Context, *benchResult) error
	}{
		{"ingest", b.ingest}, {"latency", b.latency}, {"storm", b.storm}, {"memory", b.memory}, {"decide", b.decide},
	} {
		// The ingest profiles its raw and workermon parts apart.
		stop, err := startProfile(o.profileDir, phase.name, phase.name != "ingest")
		if err != nil {
			return res, err
		}
		err = phase.run(ctx, &res)
		if perr := stop(); err == nil {
			err = perr
		}
		if err != nil {
			return res, err
		}
	}
	return res, nil
}

type bencher struct {
	o         benchOptions
	svc       *service
	pub       *nats.Conn // publishes the reports
	watch     *nats.Conn // watches the buckets
	js        jetstream.JetStream
	busy      jetstream.KeyValue
	sentW     jetstream.KeyWatcher // of the sentinel's record
	progress  func(string)
	sentinels uint64
	heartbeat time.Duration // the writer's
}

// benchSentinel is the model of the sentinel reports.
const benchSentinel = "bench/sentinel"

// benchRawPrefix is the first token of the raw messages' subjects: as long
// as the monitor's prefix, so that both carry subjects of the same length.
const benchRawPrefix = "benchmark"

var _ = [1]int{}[len(benchRawPrefix)-len(events.DefaultSubjectPrefix)] // same length

// report is a valid engine report.
func benchReport(model string, worker uint64, seq, used uint64) events.LoadReport {
	return events.LoadReport{Model: model, WorkerID: worker, DPSize: 1, Source: events.SourceEngine,
		ActiveDecodeBlocks: events.Some(used), KVTotalBlocks: events.Some(100), BootID: 1, Seq: seq,
		SentAt: time.Now().UnixNano()}
}

// ingest measures the monitor's ingest beside its limit in o.rounds rounds,
// each made of a raw part and then a workermon part of o.reports/o.rounds
// messages each, published over one connection as fast as it can: so both
// figures see the same load of a shared machine. The monitor's reports come
// from o.workers workers of o.models models; the raw messages are the same
// payloads on subjects of the same length, to a subscriber on another
// connection that only counts them. A workermon part ends when a sentinel
// report published after its reports has its record in the bucket (one
// subscription keeps their order, so every report before it has been
// applied). The figures are the totals over the rounds; the CPU time of the
// whole process (NATS server included) per message is measured too.
func (b *bencher) ingest(ctx context.Context, res *benchResult) error {
	b.progress(fmt.Sprintf("ingest: %d reports from %d workers of %d models, in %d rounds beside as many raw messages",
		b.o.reports, b.o.workers, b.o.models, b.o.rounds))
	enc := events.NewEncoder()
	msgs := make([]*nats.Msg, b.o.reports)
	raws := make([]*nats.Msg, b.o.reports)
	seqs := make([]uint64, b.o.workers)
	for i := range msgs {
		w := i % b.o.workers
		seqs[w]++
		model := "bench/ingest-" + strconv.Itoa(w%b.o.models)
		r := benchReport(model, uint64(w), seqs[w], uint64(10+i%30))
		data, err := enc.LoadReport(&r)
		if err != nil {
			return err
		}
		data = slices.Clone(data)
		subject := events.LoadSubject(events.DefaultSubjectPrefix, model, uint64(w), 0)
		msgs[i] = &nats.Msg{Subject: subject, Data: data}
		raws[i] = &nats.Msg{Subject: benchRawPrefix + strings.TrimPrefix(subject, events.DefaultSubjectPrefix), Data: data}
	}
	var got, want atomic.Int64
	done := make(chan struct{}, 1)
	sub, err := b.watch.Subscribe(benchRawPrefix+".>", func(*nats.Msg) {
		if got.Add(1) == want.Load() {
			done <- struct{}{}
		}
	})
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return err
	}
	if err := b.watch.Flush(); err != nil {
		return err
	}
	publish := func(msgs []*nats.Msg) error {
		for _, m := range msgs {
			if err := b.pub.PublishMsg(m); err != nil {
				return err
			}
		}
		return nil
	}
	before := metricSum(b.svc.reg, "workermon_reports_accepted_total")
	var rawTook, took, rawCPU, cpu time.Duration
	res.IngestRatioMin, res.IngestRatioMax = math.Inf(1), 0
	for round := range b.o.rounds {
		lo, hi := round*b.o.reports/b.o.rounds, (round+1)*b.o.reports/b.o.rounds
		// The limit.
		stop, err := b.cpuProfile("raw-ingest", round)
		if err != nil {
			return err
		}
		want.Store(int64(hi))
		start, cpu0 := time.Now(), cpuTime()
		if err := publish(raws[lo:hi]); err != nil {
			return err
		}
		if err := b.pub.Flush(); err != nil {
			return err
		}
		select {
		case <-done:
		case <-time.After(b.o.waitTimeout):
			return fmt.Errorf("bench: raw subscriber got %d of %d messages", got.Load(), hi)
		case <-ctx.Done():
			return ctx.Err()
		}
		rawRound, rawRoundCPU := time.Since(start), cpuTime()-cpu0
		stop()
		// The monitor.
		if stop, err = b.cpuProfile("ingest", round); err != nil {
			return err
		}
		start, cpu0 = time.Now(), cpuTime()
		if err := publish(msgs[lo:hi]); err != nil {
			return err
		}
		if err := b.sentinel(ctx); err != nil {
			return err
		}
		wmRound, wmRoundCPU := time.Since(start), cpuTime()-cpu0
		stop()
		rawTook, rawCPU, took, cpu = rawTook+rawRound, rawCPU+rawRoundCPU, took+wmRound, cpu+wmRoundCPU
		ratio := rawRound.Seconds() / wmRound.Seconds()
		res.IngestRatioMin, res.IngestRatioMax = min(res.IngestRatioMin, ratio), max(res.IngestRatioMax, ratio)
	}
	res.IngestRounds = b.o.rounds
	res.RawIngest = float64(b.o.reports) / rawTook.Seconds()
	res.Ingest = float64(b.o.reports) / took.Seconds()
	res.IngestRatio = res.Ingest / res.RawIngest
	res.RawIngestCPU = float64(rawCPU.Microseconds()) / float64(b.o.reports)
	res.IngestCPU = float64(cpu.Microseconds()) / float64(b.o.reports)
	res.IngestLost = b.o.reports + b.o.rounds - int(metricSum(b.svc.reg, "workermon_reports_accepted_total")-before)
	return nil
}

// cpuProfile, with --profile, writes a CPU profile of one part of one round
// of a phase until stop is called: go tool pprof merges the rounds given
// together.
func (b *bencher) cpuProfile(part string, round int) (stop func(), err error) {
	if b.o.profileDir == "" {
		return func() {}, nil
	}
	f, err := os.Create(filepath.Join(b.o.profileDir, fmt.Sprintf("%s-%d.cpu.pprof", part, round)))
	if err != nil {
		return nil, fmt.Errorf("bench: profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("bench: profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// sentinel publishes a report that makes a new worker of benchSentinel busy
// and waits until its record says so.
func (b *bencher) sentinel(ctx context.Context) error {
	b.sentinels++
	data, err := events.NewEncoder().LoadReport(events.Ptr(benchReport(benchSentinel, b.sentinels, 1, 90)))
	if err != nil {
		return err
	}
	if err := b.pub.Publish(events.LoadSubject(events.DefaultSubjectPrefix, benchSentinel, b.sentinels, 0), data); err != nil {
		return err
	}
	if err := b.pub.Flush(); err != nil {
		return err
	}
	return b.await(ctx, b.sentW, func(rec events.BusySet) bool { return slices.Contains(rec.Busy, b.sentinels) })
}

// await reads w until a record satisfies ok.
func (b *bencher) await(ctx context.Context, w jetstream.KeyWatcher, ok func(events.BusySet) bool) error {
	return b.awaitEntry(ctx, w, "the expected record", func(e jetstream.KeyValueEntry) bool {
		rec, err := events.DecodeBusySet(e.Value())
		return err == nil && ok(rec)
	})
}

// awaitEntry reads w until an entry satisfies ok, for up to
// o.waitTimeout; what names the awaited entry in the error.
func (b *bencher) awaitEntry(ctx context.Context, w jetstream.KeyWatcher, what string, ok func(jetstream.KeyValueEntry) bool) error {
	timeout := time.After(b.o.waitTimeout)
	for {
		select {
		case e, open := <-w.Updates():
			if !open {
				return errors.New("bench: watch ended")
			}
			if e != nil && ok(e) {
				return nil
			}
		case <-timeout:
			return fmt.Errorf("bench: %s did not come", what)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// latency times o.flips busy/free flips of one worker, each from the
// report's publish to a KV watcher seeing the matching record, each beside
// its limit: a KV put, on a bucket made as the busy bucket is, from the
// put to a watcher of the key seeing it. The two alternate, so that both
// see the same load of a shared machine.
func (b *bencher) latency(ctx context.Context, res *benchResult) error {
	b.progress(fmt.Sprintf("latency: %d busy/free flips timed from report to record, each beside a raw KV put", b.o.flips))
	pjs, err := jetstream.New(b.pub)
	if err != nil {
		return err
	}
	const rawBucket = "workermon-bench"
	kv, err := kvbucket.Open(ctx, pjs, rawBucket, 1)
	if err != nil {
		return err
	}
	defer func() { _ = pjs.DeleteKeyValue(context.WithoutCancel(ctx), rawBucket) }()
	wkv, err := b.js.KeyValue(ctx, rawBucket)
	if err != nil {
		return err
	}
	rawW, err := wkv.Watch(ctx, "k", jetstream.UpdatesOnly())
	if err != nil {
		return err
	}
	defer rawW.Stop()
	const model = "bench/latency"
	w, err := b.busy.Watch(ctx, events.ModelKey(model), jetstream.UpdatesOnly())
	if err != nil {
		return err
	}
	defer w.Stop()
	enc := events.NewEncoder()
	subject := events.LoadSubject(events.DefaultSubjectPrefix, model, 1, 0)
	rawTook := make([]time.Duration, 0, b.o.flips)
	took := make([]time.Duration, 0, b.o.flips)
	for i := range b.o.flips + 1 {
		if i > 0 { // the first flip creates the record: untimed
			start := time.Now()
			want := strconv.Itoa(i)
			if _, err := kv.Put(ctx, "k", []byte(want)); err != nil {
				return err
			}
			if err := b.awaitEntry(ctx, rawW, "the raw put", func(e jetstream.KeyValueEntry) bool {
				return string(e.Value()) == want
			}); err != nil {
				return err
			}
			rawTook = append(rawTook, time.Since(start))
		}
		busy := i%2 == 0
		used := uint64(10)
		if busy {
			used = 90
		}
		data, err := enc.LoadReport(events.Ptr(benchReport(model, 1, uint64(i+1), used)))
		if err != nil {
			return err
		}
		start := time.Now()
		if err := b.pub.Publish(subject, data); err != nil {
			return err
		}
		if err := b.await(ctx, w, func(rec events.BusySet) bool { return slices.Contains(rec.Busy, 1) == busy }); err != nil {
			return err
		}
		if i > 0 {
			took = append(took, time.Since(start))
		}
	}
	res.RawP50, res.RawP99 = percentileUS(rawTook, 50), percentileUS(rawTook, 99)
	res.P50, res.P99 = percentileUS(took, 50), percentileUS(took, 99)
	return nil
}

// memory holds o.memWorkers workers of 8 ranks and measures the growth of
// the live heap (after a collection) of the whole process.
func (b *bencher) memory(ctx context.Context, res *benchResult) error {
	const ranks = 8
	models := (b.o.memWorkers + 999) / 1000
	b.progress(fmt.Sprintf("memory: %d workers × %d ranks over %d models", b.o.memWorkers, ranks, models))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	enc := events.NewEncoder()
	for w := range b.o.memWorkers {
		model := "bench/mem-" + strconv.Itoa(w%models)
		for r := range uint32(ranks) {
			rep := benchReport(model, uint64(w), uint64(r+1), 10)
			rep.DPRank, rep.DPSize = r, ranks
			data, err := enc.LoadReport(&rep)
			if err != nil {
				return err
			}
			if err := b.pub.Publish(events.LoadSubject(events.DefaultSubjectPrefix, model, uint64(w), r), data); err != nil {
				return err
			}
		}
	}
	if err := b.sentinel(ctx); err != nil {
		return err
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	res.MemWorkers, res.MemRanks = b.o.memWorkers, b.o.memWorkers*ranks
	grown := float64(after.HeapAlloc) - float64(before.HeapAlloc)
	res.MemMB = grown / (1 << 20)
	res.MemBytesPerRank = grown / float64(res.MemRanks)
	res.RSSMB = rssMB()
	return nil
}

// storm flips o.storm workers of o.models models between busy and free 100
// times a second each for o.stormFor, then sends each worker a last report
// with a known state, and checks that every model's record ends with
// exactly those states: the writer coalesces, and must never leave a stale
// version behind.
func (b *bencher) storm(ctx context.Context, res *benchResult) error {
	const perSecond = 100
	b.progress(fmt.Sprintf("storm: %d workers flipping %d times a second for %v", b.o.storm, perSecond, b.o.stormFor))
	enc := events.NewEncoder()
	model := func(w int) string { return "bench/storm-" + strconv.Itoa(w%b.o.models) }
	seqs := make([]uint64, b.o.storm)
	send := func(w int, busy bool) error {
		seqs[w]++
		used := uint64(10)
		if busy {
			used = 90
		}
		data, err := enc.LoadReport(events.Ptr(benchReport(model(w), uint64(w), seqs[w], used)))
		if err != nil {
			return err
		}
		return b.pub.Publish(events.LoadSubject(events.DefaultSubjectPrefix, model(w), uint64(w), 0), data)
	}
	writes := metricSum(b.svc.reg, "workermon_busy_writer_writes_total")
	start := time.Now()
	tick := time.NewTicker(time.Second / perSecond)
	defer tick.Stop()
	sent, round := 0, 0
	for time.Since(start) < b.o.stormFor {
		for w := range b.o.storm {
			if err := send(w, (w+round)%2 == 0); err != nil {
				return err
			}
			sent++
		}
		round++
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// The last word: worker w busy when w%3 == 0.
	for w := range b.o.storm {
		if err := send(w, w%3 == 0); err != nil {
			return err
		}
		sent++
	}
	if err := b.sentinel(ctx); err != nil {
		return err
	}
	elapsed := time.Since(start)
	res.StormWorkers = b.o.storm
	res.StormReports = float64(sent) / elapsed.Seconds()
	res.StormWrites = (metricSum(b.svc.reg, "workermon_busy_writer_writes_total") - writes) / elapsed.Seconds()
	// The monitor has applied the last reports (the sentinel says so): each
	// model's record must show them within a few of the writer's round
	// trips. The deadline is a quarter of the writer's heartbeat, so that no
	// heartbeat re-put (the storm's writes have just refreshed every record)
	// can stand in for a final write that never came.
	deadline := time.Now().Add(b.heartbeat / 4)
	res.StormDeadlineMS = float64((b.heartbeat / 4).Milliseconds())
	for m := range min(b.o.models, b.o.storm) {
		name := model(m)
		var wantBusy, wantFree []uint64
		for w := m; w < b.o.storm; w += b.o.models {
			if w%3 == 0 {
				wantBusy = append(wantBusy, uint64(w))
			} else {
				wantFree = append(wantFree, uint64(w))
			}
		}
		res.StormModels++
		for {
			e, err := b.busy.Get(ctx, events.ModelKey(name))
			var rec events.BusySet
			if err == nil {
				rec, err = events.DecodeBusySet(e.Value())
			}
			if err == nil && slices.Equal(rec.Busy, wantBusy) && slices.Equal(rec.Free, wantFree) {
				break
			}
			if time.Now().After(deadline) {
				res.StormLost++
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nil
}

// decide times the router's admission decision on a Watcher of the bucket.
func (b *bencher) decide(ctx context.Context, res *benchResult) error {
	b.progress("router: the admission decision (Decide)")
	w, err := busylist.NewWatcher(b.js)
	if err != nil {
		return err
	}
	defer w.Close()
	wctx, cancel := context.WithTimeout(ctx, b.o.waitTimeout)
	defer cancel()
	if err := w.WaitReady(wctx); err != nil {
		return err
	}
	const n = 5_000_000
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	admitted := 0
	for range n {
		if w.Decide("bench/ingest-0").Admit {
			admitted++
		}
	}
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	if admitted != n {
		return fmt.Errorf("bench: Decide rejected %d of %d requests for a free worker", n-admitted, n)
	}
	res.DecideNs = float64(elapsed.Nanoseconds()) / n
	res.DecideAllocs = int64(after.Mallocs-before.Mallocs) / n
	return nil
}

// startProfile, when dir is not empty, writes the allocations made so far
// and, with cpu, starts a CPU profile of the phase; stop ends the CPU
// profile and writes the allocations made until then. The phase's own allocations are
// the difference: go tool pprof -sample_index=alloc_space -base
// <phase>.allocs-before.pprof <phase>.allocs.pprof.
func startProfile(dir, phase string, cpu bool) (stop func() error, err error) {
	if dir == "" {
		return func() error { return nil }, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("bench: profile: %w", err)
	}
	write := func(name string, fn func(io.Writer) error) error {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return fmt.Errorf("bench: profile: %w", err)
		}
		if err := fn(f); err != nil {
			f.Close()
			return fmt.Errorf("bench: profile %s: %w", name, err)
		}
		return f.Close()
	}
	allocs := func(name string) error {
		return write(name, func(w io.Writer) error { return pprof.Lookup("allocs").WriteTo(w, 0) })
	}
	if err := allocs(phase + ".allocs-before.pprof"); err != nil {
		return nil, err
	}
	if !cpu {
		return func() error { return allocs(phase + ".allocs.pprof") }, nil
	}
	f, err := os.Create(filepath.Join(dir, phase+".cpu.pprof"))
	if err != nil {
		return nil, fmt.Errorf("bench: profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("bench: profile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return errors.Join(f.Close(), allocs(phase+".allocs.pprof"))
	}, nil
}

// rssMB is the process's resident set size (Linux), 0 where unknown.
func rssMB() float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err == nil {
				return kb / 1024
			}
		}
	}
	return 0
}

func percentileUS(d []time.Duration, p int) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, len(s)*p/100)].Nanoseconds()) / 1e3
}

// printBench writes the figures as a table: workermon beside the raw
// limit, and their ratio or difference.
func printBench(w io.Writer, r benchResult) {
	fmt.Fprintf(w, "workermon bench: %d cores, embedded nats-server %s, everything in one process\n\n", r.Cores, r.NATSVersion)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\traw limit\tworkermon\tratio / delta")
	fmt.Fprintf(tw, "ingest (%d reports, %d rounds)\t%.0f msgs/s\t%.0f reports/s\t%.0f %% of raw (rounds %.0f–%.0f %%), %d lost\n",
		r.Reports, r.IngestRounds, r.RawIngest, r.Ingest, 100*r.IngestRatio, 100*r.IngestRatioMin, 100*r.IngestRatioMax, r.IngestLost)
	fmt.Fprintf(tw, "ingest, CPU time per message\t%.2f µs\t%.2f µs\t%.0f %% of raw\n",
		r.RawIngestCPU, r.IngestCPU, 100*r.RawIngestCPU/max(r.IngestCPU, 1e-9))
	fmt.Fprintf(tw, "report → record seen, p50 (%d flips)\t%.0f µs\t%.0f µs\t%+.0f µs\n", r.Flips, r.RawP50, r.P50, r.P50-r.RawP50)
	fmt.Fprintf(tw, "report → record seen, p99\t%.0f µs\t%.0f µs\t%+.0f µs\n", r.RawP99, r.P99, r.P99-r.RawP99)
	fmt.Fprintf(tw, "storm, %d workers × 100 flips/s\t—\t%.0f reports/s, %.0f writes/s\t%d of %d final states lost (within %.0f ms)\n",
		r.StormWorkers, r.StormReports, r.StormWrites, r.StormLost, r.StormModels, r.StormDeadlineMS)
	fmt.Fprintf(tw, "memory, %d workers × 8 ranks\t—\t%.1f MB heap growth, %.0f MB RSS\t%.0f bytes per rank\n",
		r.MemWorkers, r.MemMB, r.RSSMB, r.MemBytesPerRank)
	fmt.Fprintf(tw, "router admission (Decide)\t—\t%.1f ns\t%d allocs\n", r.DecideNs, r.DecideAllocs)
	_ = tw.Flush()
	fmt.Fprintln(w, "\nraw limit: the same embedded server without workermon, measured in turns with it (a counting subscriber;")
	fmt.Fprintln(w, "a KV put seen by a watcher). CPU time: the whole process's, NATS server included.")
}

// benchChildFlag, first, makes `workermon bench` a child process of
// `workermon bench --processes` (bench.RunChild).
const benchChildFlag = "--child"

// runBenchProcesses is `workermon bench --processes`: this binary run as
// the publisher, the monitor and the watcher.
func runBenchProcesses(ctx context.Context, o benchOptions, stdout, stderr io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	cfg := wmbench.DefaultConfig()
	cfg.Executable, cfg.Child = exe, []string{"bench", benchChildFlag}
	cfg.Serve = func(dataDir string) []string {
		return []string{"serve", "--embedded-nats-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--data-dir", dataDir,
			"--warmup", "0", "--active-decode-blocks-threshold", "0.5", "--log-level", "error"}
	}
	cfg.Reports, cfg.Workers, cfg.Models, cfg.Rounds, cfg.Flips = o.reports, o.workers, o.models, o.rounds, o.flips
	cfg.WaitTimeout, cfg.ProfileDir, cfg.Stderr = o.waitTimeout, o.profileDir, stderr
	cfg.Progress = func(msg string) { fmt.Fprintf(stderr, "bench: %s\n", msg) }
	res, err := wmbench.Run(ctx, cfg)
	if err != nil {
		return err
	}
	if o.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	wmbench.Print(stdout, res)
	return nil
}
