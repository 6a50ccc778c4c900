package monitor

import (
	"context"
	"time"

	"github.com/workermon/workermon/events"
)

// Source is a channel of messages as a subscription delivers them (a NATS
// channel subscription), read by the monitor's own goroutine: nothing runs
// between the connection's reader and the state, and no goroutine is woken
// per message on the way. Open returns a message's subject and payload; a
// message is not kept once applied.
type Source[T any] struct {
	C    <-chan T
	Open func(T) (subject string, data []byte)
}

// RunFrom is Run, applying also the messages of src, decoded and checked
// on the monitor's goroutine; Submit may be used beside it. Messages of
// one subscription keep their order, and so do those of several
// subscriptions of one connection that share the channel.
func RunFrom[T any](ctx context.Context, m *Monitor, src Source[T]) error {
	if !m.started.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer close(m.done)
	srcLen := func() int { return len(src.C) }
	m.sourceLen.Store(&srcLen)
	s := newState(m.cfg, m.sink, m.metrics, m.log)
	dec := events.NewDecoder()
	apply := func(t T, now time.Time) {
		subject, data := src.Open(t)
		msg := decodeMessage(m.cfg.SubjectPrefix, m.cfg.Partitions, dec, subject, data)
		s.handle(&msg, now)
	}
	// drain applies what is queued behind the message that woke the loop,
	// up to maxBatch with what was applied since the last flush, on one
	// clock read (a read costs 50-60 ns on some virtual machines: as much
	// as a tenth of a report's work) and without a blocking select per
	// message. It returns how many it applied.
	drain := func(batch int, now time.Time) int {
		n := 0
		for batch+n < maxBatch {
			select {
			case t := <-src.C:
				apply(t, now)
				n++
				continue
			default:
			}
			select {
			case msg := <-m.in:
				s.handle(&msg, now)
				n++
				continue
			default:
			}
			break
		}
		return n
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var armed time.Time
	batch := 0
	applied := func(now time.Time, n int) {
		per := time.Since(now).Seconds() / float64(n)
		for range n {
			s.metrics.recompute.Observe(per)
		}
		if batch += n; batch >= maxBatch || len(m.in) == 0 && len(src.C) == 0 {
			s.flush(now)
			batch = 0
		}
	}
	for {
		select {
		case <-ctx.Done():
			s.flushAll(time.Now())
			return context.Cause(ctx)
		case t := <-src.C:
			now := time.Now()
			apply(t, now)
			applied(now, 1+drain(batch+1, now))
		case msg := <-m.in:
			now := time.Now()
			s.handle(&msg, now)
			applied(now, 1+drain(batch+1, now))
		case c := <-m.cmds:
			// A command returns once its records are with the sink.
			c.fn(s)
			s.flushAll(time.Now())
			close(c.done)
		case <-m.kick:
			s.flush(time.Now())
		case <-timer.C:
			armed = time.Time{}
			now := time.Now()
			s.expire(now)
			s.flush(now)
		}
		if next, ok := s.nextDeadline(); ok && !next.Equal(armed) {
			armed = next
			timer.Reset(time.Until(next))
		}
	}
}
