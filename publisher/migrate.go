package publisher

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/retry"
)

// MigrateHandler is an engine's answer to the rescheduler (contract §12):
// cut up to req.MaxRequests of the running requests that the router marked
// continuable (request header X-Workermon-Migratable: 1), ending each one's
// stream without [DONE] or a finish reason so that the router continues it
// on another worker, and return how many it cut. It must return within
// ctx, which ends after DefaultMigrateTimeout; it is never called for a
// request of an older epoch or for another worker.
type MigrateHandler func(ctx context.Context, req events.MigrateRequest) (migrated int)

// DefaultMigrateTimeout bounds one MigrateHandler call: the monitor stops
// waiting for the answer after its --rescheduling-timeout (1 s by default).
const DefaultMigrateTimeout = time.Second

// migrateQueue is how many migrate requests may wait for the handler; the
// rescheduler sends at most one per worker per round.
const migrateQueue = 16

// WithMigrateHandler makes the Publisher answer the rescheduler's migrate
// requests for this worker with h. The engine's NATS user needs subscribe
// permission on <prefix>.migrate.<model_key>.<worker_id> and may reply
// (allow_responses). Only the engine source may take them.
func WithMigrateHandler(h MigrateHandler) Option {
	return func(o *options) error {
		if h == nil {
			return fmt.Errorf("publisher: WithMigrateHandler: nil handler: %w", ErrInvalidConfig)
		}
		o.migrate = h
		return nil
	}
}

// migrator receives the migrate requests of one worker and hands them to
// the handler, one at a time, on a goroutine of the Publisher.
type migrator struct {
	p       *Publisher
	handler MigrateHandler
	sub     *nats.Subscription
	msgs    chan *nats.Msg
	epoch   uint64 // the highest seen
	badLog  *retry.ErrLog
}

// startMigrator subscribes to the worker's migrate subject. The loop runs
// until ctx ends; the subscription is dropped by stop.
func (p *Publisher) startMigrator(ctx context.Context) error {
	m := &migrator{p: p, handler: p.opts.migrate, msgs: make(chan *nats.Msg, migrateQueue),
		badLog: retry.NewErrLog(p.log, slog.LevelWarn, "workermon publisher: migrate request")}
	subject := events.MigrateSubject(p.opts.prefix, p.model, p.workerID)
	sub, err := p.nc.ChanSubscribe(subject, m.msgs)
	if err != nil {
		return fmt.Errorf("publisher: subscribe %s: %w", subject, err)
	}
	m.sub = sub
	p.migrator = m
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case msg := <-m.msgs:
				m.handle(ctx, msg)
			}
		}
	}()
	return nil
}

// stop drops the subscription; requests still queued get no answer (the
// monitor counts them as timeouts).
func (m *migrator) stop() {
	if m != nil {
		_ = m.sub.Unsubscribe()
	}
}

// handle answers one request: the handler's count, or 0 for a request it
// must not act on.
func (m *migrator) handle(ctx context.Context, msg *nats.Msg) {
	migrated := 0
	req, err := events.DecodeMigrateRequest(msg.Data)
	switch {
	case err != nil:
		m.badLog.Fail(err, "subject", msg.Subject)
	case req.Model != m.p.model || req.Src != m.p.workerID:
		m.badLog.Fail(fmt.Errorf("for model %q worker %d, not this one", req.Model, req.Src), "subject", msg.Subject)
	case req.Epoch < m.epoch:
		m.badLog.Fail(fmt.Errorf("epoch %d is below %d, seen before: from a monitor that lost the partition", req.Epoch, m.epoch))
	default:
		m.epoch = req.Epoch
		hctx, cancel := context.WithTimeout(ctx, DefaultMigrateTimeout)
		migrated = min(max(m.handler(hctx, req), 0), int(min(req.MaxRequests, 1<<20)))
		cancel()
		m.p.log.Debug("workermon publisher: migrate request", "reason", req.Reason, "dst", req.Dst,
			"max_requests", req.MaxRequests, "migrated", migrated, "epoch", req.Epoch)
	}
	if msg.Reply == "" {
		return
	}
	data, err := events.MarshalMigrateReply(events.MigrateReply{Migrated: uint64(migrated)})
	if err == nil {
		err = msg.Respond(data)
	}
	if err != nil {
		m.p.log.Warn("workermon publisher: migrate answer not sent", "err", err)
	}
}
