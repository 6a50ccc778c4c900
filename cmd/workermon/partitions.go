package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
	"github.com/workermon/workermon/monitor"
)

// What `workermon serve` does with partitions and leases (contract §10):
// the intake of each partition it holds, the reports that arrive on plain
// subjects while partitions are configured, and /partitions.

// intakeQueue is how many received messages wait for the monitor's loop
// before NATS drops the next ones as a slow consumer: about the 64 MiB of
// reports the subscriptions buffered before they delivered to the loop's
// channel themselves.
const intakeQueue = 1 << 18

// intake is the monitor's subscriptions, per partition held. They deliver
// into one channel that the monitor's goroutine reads itself
// (monitor.RunFrom): no goroutine between the connection's reader and the
// state.
type intake struct {
	nc     *nats.Conn
	mon    *monitor.Monitor
	prefix string
	parts  int
	log    *slog.Logger
	msgs   chan *nats.Msg

	mu   sync.Mutex
	subs map[int][]*nats.Subscription
	// failed holds, per partition, the error of its last start when it
	// failed: the monitor cannot hear it.
	failed map[int]error
	// held[p] is true while partition p is subscribed; read by the plain
	// subjects' callback.
	held []atomic.Bool

	plain     []*nats.Subscription // with more than one partition: subjects the servers did not map
	unmapped  atomic.Uint64
	unmapLog  *retry.ErrLog
	unmapLock sync.Mutex
}

func newIntake(nc *nats.Conn, mon *monitor.Monitor, prefix string, parts int, log *slog.Logger) *intake {
	return &intake{nc: nc, mon: mon, prefix: prefix, parts: parts, log: log, msgs: make(chan *nats.Msg, intakeQueue),
		subs: make(map[int][]*nats.Subscription), failed: make(map[int]error), held: make([]atomic.Bool, parts),
		unmapLog: retry.NewErrLog(log, slog.LevelWarn, "serve: reports on subjects the NATS servers did not map")}
}

// source is what the monitor's loop reads the subscriptions from.
func (in *intake) source() monitor.Source[*nats.Msg] {
	return monitor.Source[*nats.Msg]{C: in.msgs, Open: func(m *nats.Msg) (string, []byte) { return m.Subject, m.Data }}
}

// subjects are what partition p's subscriptions listen to: with one
// partition the load, bye, est, lat, latr and rq subjects under the prefix
// (not the rescheduler's migrate requests, §12), else the mapped subjects
// of p.
// Reports and goodbyes keep one publisher's order: one connection delivers
// them, in order, into one channel.
func (in *intake) subjects(p int) []string {
	if in.parts == 1 {
		return []string{in.prefix + ".load.>", in.prefix + ".bye.>", in.prefix + ".est.>", in.prefix + ".lat.>", in.prefix + ".latr.>",
			in.prefix + ".rq.>"}
	}
	return []string{events.PartitionWildcard(in.prefix, p)}
}

// start subscribes to partition p. A failure is kept, for /readyz, until
// a later start of p succeeds.
func (in *intake) start(p int, hooks *serveHooks) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.subs == nil || in.subs[p] != nil {
		return nil // closed, or already subscribed
	}
	err := in.subscribe(p, hooks)
	if err != nil {
		in.failed[p] = err
		return err
	}
	delete(in.failed, p)
	return nil
}

// subscribe subscribes to partition p, under mu.
func (in *intake) subscribe(p int, hooks *serveHooks) error {
	var subs []*nats.Subscription
	var err error
	if hooks != nil && hooks.subscribe != nil {
		err = hooks.subscribe(p)
	}
	for _, subject := range in.subjects(p) {
		if err != nil {
			break
		}
		var sub *nats.Subscription
		if sub, err = in.nc.ChanSubscribe(subject, in.msgs); err != nil {
			err = fmt.Errorf("serve: subscribe %s: %w", subject, err)
			break
		}
		subs = append(subs, sub)
	}
	if err == nil {
		// One round trip: from here on the server routes the partition's
		// reports to us, so a held partition is one that listens.
		if err = in.nc.FlushTimeout(5 * time.Second); err != nil {
			err = fmt.Errorf("serve: subscribe to partition %d: %w", p, err)
		}
	}
	if err != nil {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
		return err
	}
	in.subs[p] = subs
	in.held[p].Store(true)
	return nil
}

// unheard returns the partitions whose last subscription failed, with the
// error.
func (in *intake) unheard() map[int]error {
	in.mu.Lock()
	defer in.mu.Unlock()
	return maps.Clone(in.failed)
}

// stop unsubscribes from partition p.
func (in *intake) stop(p int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.held[p].Store(false)
	for _, sub := range in.subs[p] {
		_ = sub.Unsubscribe()
	}
	delete(in.subs, p)
}

// watchPlain, with more than one partition, subscribes to the plain load,
// bye and est subjects. They receive only what a server without the
// partition mapping let through: counted, logged, and applied when this
// monitor holds the model's partition.
func (in *intake) watchPlain() error {
	if in.parts == 1 {
		return nil
	}
	for _, kind := range []string{"load", "bye", "est", "lat", "latr", "rq"} {
		subject := in.prefix + "." + kind + ".>"
		sub, err := in.nc.Subscribe(subject, in.onPlain)
		if err != nil {
			return fmt.Errorf("serve: subscribe %s: %w", subject, err)
		}
		in.plain = append(in.plain, sub)
	}
	return nil
}

func (in *intake) onPlain(m *nats.Msg) {
	n := in.unmapped.Add(1)
	in.unmapLock.Lock()
	in.unmapLog.Fail(fmt.Errorf("report on %s: the NATS servers lack the partition mapping (workermon nats-config --partitions %d)",
		m.Subject, in.parts), "count", n)
	in.unmapLock.Unlock()
	rest := strings.TrimPrefix(m.Subject, in.prefix+".")
	_, rest, _ = strings.Cut(rest, ".") // the kind
	key, _, _ := strings.Cut(rest, ".")
	if p := events.PartitionOfKey(key, in.parts); in.held[p].Load() {
		in.mon.Submit(m.Subject, m.Data)
	}
}

// healthLines, with more than one partition, writes to /healthz how many
// reports arrived on plain subjects, and a warning when some did.
func (in *intake) healthLines(w io.Writer) {
	if in.parts == 1 {
		return
	}
	n := in.unmapped.Load()
	fmt.Fprintf(w, "unmapped_reports %d\n", n)
	if n > 0 {
		fmt.Fprintf(w, "warning: reports arrive on subjects the NATS servers did not map to a partition; add the mapping (workermon nats-config --partitions %d)\n", in.parts)
	}
}

// close unsubscribes from everything.
func (in *intake) close() {
	in.mu.Lock()
	defer in.mu.Unlock()
	for p, subs := range in.subs {
		in.held[p].Store(false)
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}
	in.subs = nil
	for _, sub := range in.plain {
		_ = sub.Unsubscribe()
	}
}

// addPartitionMappings configures the embedded server with the partition
// mappings every server of a deployment needs (contract §10).
func addPartitionMappings(s *server.Server, prefix string, parts int) error {
	if parts < 2 {
		return nil
	}
	acc := s.GlobalAccount()
	for _, m := range events.PartitionMappings(prefix, parts) {
		if err := acc.AddMapping(m.From, m.To); err != nil {
			return fmt.Errorf("serve: map %s to %s: %w", m.From, m.To, err)
		}
	}
	return nil
}

// servePartitions answers GET /partitions.
func (svc *service) servePartitions(w http.ResponseWriter, _ *http.Request) {
	l := svc.leaser
	reply := api.PartitionsReply{Partitions: svc.parts, MonitorID: svc.monitorID, Instance: l.Instance(),
		LeaseTTL: svc.leaseTTL.String(), Held: l.Held(), Unmapped: svc.intake.unmapped.Load(), List: l.Partitions()}
	if reply.Held == nil {
		reply.Held = []int{}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(reply)
}

// leaseCallbacks connects the leaser to the writer and the intake. Each
// partition's callbacks run in order on a goroutine of their own, so the
// intake of a partition is started and stopped only there.
func (svc *service) leaseCallbacks(cfg *busylist.LeaserConfig, hooks *serveHooks) {
	cfg.OnAcquire = func(ctx context.Context, p int, epoch uint64) {
		if hooks != nil && hooks.acquire != nil {
			hooks.acquire(p, epoch)
		}
		// Claim first (a late put of the old holder fails from then on),
		// then listen; the writer's warm-up counts from then.
		if err := svc.writer.Acquire(ctx, p, epoch); err != nil {
			svc.log.Warn("partition not claimed", "partition", p, "err", err)
		}
		if !svc.leaser.Holds(p) {
			// Abandoned by a claim that found a higher epoch (or lost
			// meanwhile): not listened to.
			return
		}
		if err := svc.intake.start(p, hooks); err != nil {
			// A monitor never renews a partition it does not hear: given
			// back, taken again after a backoff (by this monitor or another).
			svc.log.Error("partition taken but not subscribed; giving it back", "partition", p, "err", err)
			svc.leaser.GiveBack(p)
			return
		}
		if err := svc.writer.Listening(ctx, p); err != nil {
			svc.log.Warn("partition's warm-up not started", "partition", p, "err", err)
		}
	}
	cfg.OnRelease = func(ctx context.Context, p int) {
		svc.intake.stop(p)
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := svc.writer.Release(rctx, p); err != nil {
			svc.log.Warn("partition released without its final write", "partition", p, "err", err)
		}
	}
	cfg.OnLose = func(p int) {
		svc.intake.stop(p)
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := svc.writer.Drop(dctx, p); err != nil {
			svc.log.Warn("lost partition not dropped by the writer", "partition", p, "err", err)
		}
	}
}

// serveHooks are what tests put in the way of the leases' callbacks; nil
// outside tests.
type serveHooks struct {
	// acquire is called first when a partition is taken.
	acquire func(p int, epoch uint64)
	// subscribe is called before a partition is subscribed to; an error
	// fails the subscription.
	subscribe func(p int) error
}

// warnReplicas, on a NATS cluster, warns about the leases and busy buckets
// kept on fewer than three replicas (contract §10): the node that holds
// them would be a single point of failure.
func warnReplicas(ctx context.Context, js jetstream.JetStream, nc *nats.Conn, replicas int, log *slog.Logger) {
	if nc.ConnectedClusterName() == "" {
		return
	}
	for _, bucket := range []string{events.LeasesBucket, events.BusyBucket} {
		n := replicas
		octx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if kv, err := js.KeyValue(octx, bucket); err == nil {
			if st, err := kv.Status(octx); err == nil {
				if s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo }); ok && s.StreamInfo() != nil {
					n = s.StreamInfo().Config.Replicas
				}
			}
		}
		cancel()
		if n < 3 {
			log.Warn("on a NATS cluster this bucket should have 3 replicas (--replicas 3 when it is created)",
				"bucket", bucket, "replicas", n, "cluster", nc.ConnectedClusterName())
		}
	}
}
