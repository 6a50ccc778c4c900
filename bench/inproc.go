package bench

import (
	"context"
	"errors"
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
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/promreg"
)

// InProcessMonitor is a running monitor on its embedded NATS server, in
// this process: `workermon serve` as cmd/workermon starts it, with a KV
// threshold of 0.5 and no warm-up.
type InProcessMonitor interface {
	// NATSURL is its NATS server's URL.
	NATSURL() string
	// Gatherer is its metrics' registry.
	Gatherer() prometheus.Gatherer
	// Settled is closed once it holds its partitions.
	Settled() <-chan struct{}
	// Heartbeat is its busy-set writer's heartbeat.
	Heartbeat() time.Duration
	Close(ctx context.Context) error
}

// InProcessConfig is one run of `workermon bench` (everything in one
// process).
type InProcessConfig struct {
	// StartMonitor starts the monitor.
	StartMonitor func(ctx context.Context) (InProcessMonitor, error)

	Reports, Workers, Models, Flips, Rounds int
	// MemWorkers is how many workers of 8 ranks the memory figure holds.
	MemWorkers int
	// StormWorkers flip busy/free 100 times a second for StormFor.
	StormWorkers int
	StormFor     time.Duration
	// WaitTimeout bounds the wait for one phase.
	WaitTimeout time.Duration
	// ProfileDir, when not empty, receives a CPU and an allocation profile
	// of each phase.
	ProfileDir string
	// Log receives the clients' connection lines; nil discards them.
	Log *slog.Logger
	// Progress, when not nil, is told each phase.
	Progress func(string)
}

// Defaults of the one-process run beside those of Config.
const (
	DefaultMemWorkers   = 10_000
	DefaultStormWorkers = 1_000
	DefaultStormFor     = 2 * time.Second
)

// DefaultInProcessConfig returns the default sizes; StartMonitor is the
// caller's.
func DefaultInProcessConfig() InProcessConfig {
	return InProcessConfig{Reports: DefaultReports, Workers: DefaultWorkers, Models: DefaultModels, Flips: DefaultFlips,
		Rounds: DefaultRounds, MemWorkers: DefaultMemWorkers, StormWorkers: DefaultStormWorkers, StormFor: DefaultStormFor,
		WaitTimeout: DefaultWaitTimeout}
}

// Validate reports every problem of c, joined, wrapping ErrInvalidConfig.
func (c InProcessConfig) Validate() error {
	var errs []error
	for _, f := range []struct {
		name string
		v    int
		min  int
	}{{"--reports", c.Reports, 1}, {"--workers", c.Workers, 1}, {"--models", c.Models, 1}, {"--flips", c.Flips, 2}, {"--rounds", c.Rounds, 1}, {"--mem-workers", c.MemWorkers, 1}, {"--storm-workers", c.StormWorkers, 1}} {
		if f.v < f.min {
			errs = append(errs, fmt.Errorf("%s %d must be at least %d", f.name, f.v, f.min))
		}
	}
	if c.StormFor <= 0 {
		errs = append(errs, fmt.Errorf("--storm-for %v must be positive", c.StormFor))
	}
	if c.Rounds > c.Reports {
		errs = append(errs, fmt.Errorf("--rounds %d must be at most --reports %d", c.Rounds, c.Reports))
	}
	if c.Workers > c.Models*4096 || c.StormWorkers > c.Models*4096 || c.MemWorkers > 1024*4096 {
		errs = append(errs, fmt.Errorf("at most 4096 workers per model (the monitor's default cap)"))
	}
	if c.WaitTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--timeout %v must be positive", c.WaitTimeout))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// InProcessResult is what InProcess measures; times in microseconds.
type InProcessResult struct {
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
	// The routers' queue reports (contract §22) in the storm's shape: the
	// record writes per second of steady workers alone (heartbeats), with
	// the queue reports, and with the queue reports beside the storm.
	QueuesModels      int     `json:"queues_models"`
	QueuesReports     float64 `json:"queues_reports_per_s"`
	QueuesBaseWrites  float64 `json:"queues_steady_writes_per_s"`
	QueuesWrites      float64 `json:"queues_writes_per_s"`
	QueuesStormWrites float64 `json:"queues_storm_writes_per_s"`
	DecideNs          float64 `json:"decide_ns"`
	DecideAllocs      int64   `json:"decide_allocs"`
}

// bench runs every measurement; progress is told each phase.
// InProcess runs every measurement of `workermon bench`: an embedded NATS
// server and the monitor in this process, measured side by side with the
// raw NATS limits.
func InProcess(ctx context.Context, cfg InProcessConfig) (InProcessResult, error) {
	res := InProcessResult{Cores: runtime.GOMAXPROCS(0), Reports: cfg.Reports, Flips: cfg.Flips}
	if err := cfg.Validate(); err != nil {
		return res, err
	}
	progress := cfg.Progress
	if progress == nil {
		progress = func(string) {}
	}
	progress("starting an embedded NATS server and the monitor")
	mon, err := cfg.StartMonitor(ctx)
	if err != nil {
		return res, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
		defer cancel()
		_ = mon.Close(cctx)
	}()
	select {
	case <-mon.Settled():
	case <-time.After(cfg.WaitTimeout):
		return res, errors.New("bench: the monitor did not take its partitions")
	case <-ctx.Done():
		return res, ctx.Err()
	}
	b := &inproc{o: cfg, mon: mon, progress: progress, heartbeat: mon.Heartbeat()}
	if b.pub, err = nats.Connect(mon.NATSURL(), nats.Name("workermon-bench")); err != nil {
		return res, err
	}
	defer b.pub.Close()
	if b.watch, err = nats.Connect(mon.NATSURL(), nats.Name("workermon-bench-watch")); err != nil {
		return res, err
	}
	defer b.watch.Close()
	// Every command logs the server's version at connect (contract §14).
	if cfg.Log != nil {
		for _, nc := range []*nats.Conn{b.pub, b.watch} {
			cfg.Log.Info("nats: connected", "client", nc.Opts.Name, "url", nc.ConnectedUrlRedacted(),
				"server_version", nc.ConnectedServerVersion())
		}
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
		run  func(context.Context, *InProcessResult) error
	}{
		{"ingest", b.ingest}, {"latency", b.latency}, {"storm", b.storm}, {"queues", b.queues}, {"memory", b.memory},
		{"decide", b.decide},
	} {
		// The ingest profiles its raw and workermon parts apart.
		stop, err := startProfile(cfg.ProfileDir, phase.name, phase.name != "ingest")
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

type inproc struct {
	o         InProcessConfig
	mon       InProcessMonitor
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
func inprocReport(model string, worker uint64, seq, used uint64) events.LoadReport {
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
func (b *inproc) ingest(ctx context.Context, res *InProcessResult) error {
	b.progress(fmt.Sprintf("ingest: %d reports from %d workers of %d models, in %d rounds beside as many raw messages",
		b.o.Reports, b.o.Workers, b.o.Models, b.o.Rounds))
	enc := events.NewEncoder()
	msgs := make([]*nats.Msg, b.o.Reports)
	raws := make([]*nats.Msg, b.o.Reports)
	seqs := make([]uint64, b.o.Workers)
	for i := range msgs {
		w := i % b.o.Workers
		seqs[w]++
		model := "bench/ingest-" + strconv.Itoa(w%b.o.Models)
		r := inprocReport(model, uint64(w), seqs[w], uint64(10+i%30))
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
	before := promreg.Sum(b.mon.Gatherer(), "workermon_reports_accepted_total")
	var rawTook, took, rawCPU, cpu time.Duration
	res.IngestRatioMin, res.IngestRatioMax = math.Inf(1), 0
	for round := range b.o.Rounds {
		lo, hi := round*b.o.Reports/b.o.Rounds, (round+1)*b.o.Reports/b.o.Rounds
		// The limit.
		stop, err := b.cpuProfile("raw-ingest", round)
		if err != nil {
			return err
		}
		want.Store(int64(hi))
		start, cpu0 := time.Now(), selfCPU()
		if err := publish(raws[lo:hi]); err != nil {
			return err
		}
		if err := b.pub.Flush(); err != nil {
			return err
		}
		select {
		case <-done:
		case <-time.After(b.o.WaitTimeout):
			return fmt.Errorf("bench: raw subscriber got %d of %d messages", got.Load(), hi)
		case <-ctx.Done():
			return ctx.Err()
		}
		rawRound, rawRoundCPU := time.Since(start), selfCPU()-cpu0
		stop()
		// The monitor.
		if stop, err = b.cpuProfile("ingest", round); err != nil {
			return err
		}
		start, cpu0 = time.Now(), selfCPU()
		if err := publish(msgs[lo:hi]); err != nil {
			return err
		}
		if err := b.sentinel(ctx); err != nil {
			return err
		}
		wmRound, wmRoundCPU := time.Since(start), selfCPU()-cpu0
		stop()
		rawTook, rawCPU, took, cpu = rawTook+rawRound, rawCPU+rawRoundCPU, took+wmRound, cpu+wmRoundCPU
		ratio := rawRound.Seconds() / wmRound.Seconds()
		res.IngestRatioMin, res.IngestRatioMax = min(res.IngestRatioMin, ratio), max(res.IngestRatioMax, ratio)
	}
	res.IngestRounds = b.o.Rounds
	res.RawIngest = float64(b.o.Reports) / rawTook.Seconds()
	res.Ingest = float64(b.o.Reports) / took.Seconds()
	res.IngestRatio = res.Ingest / res.RawIngest
	res.RawIngestCPU = float64(rawCPU.Microseconds()) / float64(b.o.Reports)
	res.IngestCPU = float64(cpu.Microseconds()) / float64(b.o.Reports)
	res.IngestLost = b.o.Reports + b.o.Rounds - int(promreg.Sum(b.mon.Gatherer(), "workermon_reports_accepted_total")-before)
	return nil
}

// cpuProfile, with --profile, writes a CPU profile of one part of one round
// of a phase until stop is called: go tool pprof merges the rounds given
// together.
func (b *inproc) cpuProfile(part string, round int) (stop func(), err error) {
	if b.o.ProfileDir == "" {
		return func() {}, nil
	}
	f, err := os.Create(filepath.Join(b.o.ProfileDir, fmt.Sprintf("%s-%d.cpu.pprof", part, round)))
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
func (b *inproc) sentinel(ctx context.Context) error {
	b.sentinels++
	data, err := events.NewEncoder().LoadReport(events.Ptr(inprocReport(benchSentinel, b.sentinels, 1, 90)))
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
func (b *inproc) await(ctx context.Context, w jetstream.KeyWatcher, ok func(events.BusySet) bool) error {
	return b.awaitEntry(ctx, w, "the expected record", func(e jetstream.KeyValueEntry) bool {
		rec, err := events.DecodeBusySet(e.Value())
		return err == nil && ok(rec)
	})
}

// awaitEntry reads w until an entry satisfies ok, for up to
// o.waitTimeout; what names the awaited entry in the error.
func (b *inproc) awaitEntry(ctx context.Context, w jetstream.KeyWatcher, what string, ok func(jetstream.KeyValueEntry) bool) error {
	timeout := time.After(b.o.WaitTimeout)
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
func (b *inproc) latency(ctx context.Context, res *InProcessResult) error {
	b.progress(fmt.Sprintf("latency: %d busy/free flips timed from report to record, each beside a raw KV put", b.o.Flips))
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
	rawTook := make([]time.Duration, 0, b.o.Flips)
	took := make([]time.Duration, 0, b.o.Flips)
	for i := range b.o.Flips + 1 {
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
		data, err := enc.LoadReport(events.Ptr(inprocReport(model, 1, uint64(i+1), used)))
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
func (b *inproc) memory(ctx context.Context, res *InProcessResult) error {
	const ranks = 8
	models := (b.o.MemWorkers + 999) / 1000
	b.progress(fmt.Sprintf("memory: %d workers × %d ranks over %d models", b.o.MemWorkers, ranks, models))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	enc := events.NewEncoder()
	for w := range b.o.MemWorkers {
		model := "bench/mem-" + strconv.Itoa(w%models)
		for r := range uint32(ranks) {
			rep := inprocReport(model, uint64(w), uint64(r+1), 10)
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
	res.MemWorkers, res.MemRanks = b.o.MemWorkers, b.o.MemWorkers*ranks
	grown := float64(after.HeapAlloc) - float64(before.HeapAlloc)
	res.MemMB = grown / (1 << 20)
	res.MemBytesPerRank = grown / float64(res.MemRanks)
	res.RSSMB = processRSSMB(os.Getpid())
	return nil
}

// storm flips o.storm workers of o.models models between busy and free 100
// times a second each for o.stormFor, then sends each worker a last report
// with a known state, and checks that every model's record ends with
// exactly those states: the writer coalesces, and must never leave a stale
// version behind.
func (b *inproc) storm(ctx context.Context, res *InProcessResult) error {
	const perSecond = 100
	b.progress(fmt.Sprintf("storm: %d workers flipping %d times a second for %v", b.o.StormWorkers, perSecond, b.o.StormFor))
	enc := events.NewEncoder()
	model := func(w int) string { return "bench/storm-" + strconv.Itoa(w%b.o.Models) }
	seqs := make([]uint64, b.o.StormWorkers)
	send := func(w int, busy bool) error {
		seqs[w]++
		used := uint64(10)
		if busy {
			used = 90
		}
		data, err := enc.LoadReport(events.Ptr(inprocReport(model(w), uint64(w), seqs[w], used)))
		if err != nil {
			return err
		}
		return b.pub.Publish(events.LoadSubject(events.DefaultSubjectPrefix, model(w), uint64(w), 0), data)
	}
	writes := promreg.Sum(b.mon.Gatherer(), "workermon_busy_writer_writes_total")
	start := time.Now()
	tick := time.NewTicker(time.Second / perSecond)
	defer tick.Stop()
	sent, round := 0, 0
	for time.Since(start) < b.o.StormFor {
		for w := range b.o.StormWorkers {
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
	for w := range b.o.StormWorkers {
		if err := send(w, w%3 == 0); err != nil {
			return err
		}
		sent++
	}
	if err := b.sentinel(ctx); err != nil {
		return err
	}
	elapsed := time.Since(start)
	res.StormWorkers = b.o.StormWorkers
	res.StormReports = float64(sent) / elapsed.Seconds()
	res.StormWrites = (promreg.Sum(b.mon.Gatherer(), "workermon_busy_writer_writes_total") - writes) / elapsed.Seconds()
	// The monitor has applied the last reports (the sentinel says so): each
	// model's record must show them within a few of the writer's round
	// trips. The deadline is a quarter of the writer's heartbeat, so that no
	// heartbeat re-put (the storm's writes have just refreshed every record)
	// can stand in for a final write that never came.
	deadline := time.Now().Add(b.heartbeat / 4)
	res.StormDeadlineMS = float64((b.heartbeat / 4).Milliseconds())
	for m := range min(b.o.Models, b.o.StormWorkers) {
		name := model(m)
		var wantBusy, wantFree []uint64
		for w := m; w < b.o.StormWorkers; w += b.o.Models {
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
func (b *inproc) decide(ctx context.Context, res *InProcessResult) error {
	b.progress("router: the admission decision (Decide)")
	w, err := busylist.NewWatcher(b.js)
	if err != nil {
		return err
	}
	defer w.Close()
	wctx, cancel := context.WithTimeout(ctx, b.o.WaitTimeout)
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

// PrintInProcess writes the figures as a table: workermon beside the raw
// limit, and their ratio or difference.
func PrintInProcess(w io.Writer, r InProcessResult) {
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
	fmt.Fprintf(tw, "queues, %d routers × %d models every %v\t—\t%.0f reports/s: %.0f writes/s (steady workers %.0f), storm %.0f\t%+.1f writes/s per model; %+.0f in the storm\n",
		queueRouters, r.QueuesModels, queuePace, r.QueuesReports, r.QueuesWrites, r.QueuesBaseWrites, r.QueuesStormWrites,
		(r.QueuesWrites-r.QueuesBaseWrites)/float64(max(r.QueuesModels, 1)), r.QueuesStormWrites-r.StormWrites)
	fmt.Fprintf(tw, "memory, %d workers × 8 ranks\t—\t%.1f MB heap growth, %.0f MB RSS\t%.0f bytes per rank\n",
		r.MemWorkers, r.MemMB, r.RSSMB, r.MemBytesPerRank)
	fmt.Fprintf(tw, "router admission (Decide)\t—\t%.1f ns\t%d allocs\n", r.DecideNs, r.DecideAllocs)
	_ = tw.Flush()
	fmt.Fprintln(w, "\nraw limit: the same embedded server without workermon, measured in turns with it (a counting subscriber;")
	fmt.Fprintln(w, "a KV put seen by a watcher). CPU time: the whole process's, NATS server included.")
}
