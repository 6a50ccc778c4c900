package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/busylist"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
	"github.com/workermon/workermon/internal/kvwatch"
)

// Checker watches the chaos stack the whole run: the busy bucket (a watch
// for every put, and reads of each key every pollEvery so that a watch
// that stalls after a NATS restart hides nothing), the leases bucket, the
// monitors' /partitions, and the engines' reports.
type Checker struct {
	cfg     Config
	nc      *nats.Conn
	js      jetstream.JetStream
	busy    jetstream.KeyValue
	leases  jetstream.KeyValue
	records *Records
	fleet   *Fleet
	loop    *kvwatch.Loop
	subs    []*nats.Subscription
	http    *http.Client
	log     *slog.Logger

	mu    sync.Mutex
	blind []Window // stretches when the checker could not read the bucket
	since time.Time
}

// pollEvery is how often the checker reads each record and the leases.
const pollEvery = 250 * time.Millisecond

func newChecker(ctx context.Context, cfg Config, log *slog.Logger) (*Checker, error) {
	nc, err := nats.Connect(strings.Join(cfg.NATSURLs, ","), nats.Name("workermon-chaos-checker"),
		nats.MaxReconnects(-1), nats.ReconnectWait(200*time.Millisecond), nats.PingInterval(2*time.Second),
		nats.MaxPingsOutstanding(2), nats.IgnoreDiscoveredServers(), nats.Timeout(2*time.Second))
	if err != nil {
		return nil, fmt.Errorf("connect to NATS: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	c := &Checker{cfg: cfg, nc: nc, js: js, log: log,
		records: newRecords(cfg.StaleListAfter), fleet: newFleet(cfg.StaleAfter, time.Now()),
		http: &http.Client{Timeout: time.Second}}
	return c, nil
}

// ProvisionWorkers creates the worker registry's bucket at three replicas
// before any engine starts (an engine would create it with one).
func (c *Checker) ProvisionWorkers(ctx context.Context) error {
	return retryFor(ctx, 30*time.Second, func(ctx context.Context) error {
		_, err := c.js.CreateOrUpdateKeyValue(ctx, kvbucket.Config(events.WorkersBucket, 3))
		return err
	})
}

// Start opens the buckets and starts following them and the reports.
func (c *Checker) Start(ctx context.Context) error {
	err := retryFor(ctx, 30*time.Second, func(ctx context.Context) error {
		var err error
		if c.busy, err = c.js.KeyValue(ctx, events.BusyBucket); err != nil {
			return err
		}
		c.leases, err = c.js.KeyValue(ctx, events.LeasesBucket)
		return err
	})
	if err != nil {
		return fmt.Errorf("open the buckets: %w", err)
	}
	c.loop = kvwatch.New(kvwatch.Config{JS: c.js, Bucket: events.BusyBucket, Replicas: 3, Log: c.log,
		ErrLevel: slog.LevelDebug, Now: time.Now, OpTimeout: 2 * time.Second, ProbeEvery: time.Second,
		RetryMin: 50 * time.Millisecond, RetryMax: time.Second}, (*busySink)(c), nopStats{})
	c.loop.Start()
	for _, subj := range []string{"workermon.part.*.load.>", "workermon.part.*.bye.>"} {
		sub, err := c.nc.Subscribe(subj, c.onReport)
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", subj, err)
		}
		_ = sub.SetPendingLimits(-1, 256<<20)
		c.subs = append(c.subs, sub)
	}
	return c.nc.Flush()
}

// onReport takes a report or goodbye of an engine.
func (c *Checker) onReport(m *nats.Msg) {
	now := time.Now()
	if strings.Contains(m.Subject, ".bye.") {
		if g, err := events.DecodeGoodbye(m.Data); err == nil {
			c.fleet.Goodbye(g, now)
		}
		return
	}
	if r, err := events.DecodeLoadReport(m.Data); err == nil {
		c.fleet.Report(r, now)
	}
}

// Poll reads every model's record once; a read that fails makes the
// checker blind until the next one that succeeds.
func (c *Checker) Poll(ctx context.Context, models []string) {
	now := time.Now()
	ok := true
	for _, m := range models {
		key := events.ModelKey(m)
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		e, err := c.busy.Get(rctx, key)
		cancel()
		if err != nil {
			ok = false
			continue
		}
		if rec, err := events.DecodeBusySet(e.Value()); err == nil {
			c.records.Observe(key, e.Revision(), rec, time.Now())
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case !ok && c.since.IsZero():
		c.since = now
	case ok && !c.since.IsZero():
		c.blind = append(c.blind, Window{Start: c.since, Len: now.Sub(c.since)})
		c.since = time.Time{}
	}
}

// Blind returns the stretches when the checker could not read the bucket.
func (c *Checker) Blind(now time.Time) []Window {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := append([]Window(nil), c.blind...)
	if !c.since.IsZero() {
		out = append(out, Window{Start: c.since, Len: now.Sub(c.since)})
	}
	return out
}

// Snapshot reads the leases and the monitors' /partitions for a judgement
// of the final state.
func (c *Checker) Snapshot(ctx context.Context, monitors map[string]string, down map[string]bool, models []string) (Snapshot, error) {
	s := Snapshot{Partitions: c.cfg.Partitions, LeaseTTL: c.cfg.LeaseTTL, Heartbeat: c.cfg.Heartbeat,
		Leases: map[int]Lease{}, Announces: map[string]time.Duration{}, Held: map[string][]int{},
		Down: down, Monitors: sortedKeys(monitors), Models: models, Fleet: c.fleet}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	lister, err := c.leases.ListKeys(rctx)
	if err != nil {
		return s, fmt.Errorf("list leases: %w", err)
	}
	var keys []string
	for k := range lister.Keys() {
		keys = append(keys, k)
	}
	for _, k := range keys {
		e, err := c.leases.Get(rctx, k)
		if err != nil {
			return s, fmt.Errorf("read lease %s: %w", k, err)
		}
		age := time.Since(e.Created())
		switch {
		case strings.HasPrefix(k, "m."):
			var a busylist.Announce
			if json.Unmarshal(e.Value(), &a) == nil {
				s.Announces[a.MonitorID] = age
			}
		case strings.HasPrefix(k, "p."):
			var l busylist.LeaseValue
			var n, p int
			if _, err := fmt.Sscanf(k, "p.%d.%d", &n, &p); err != nil || n != c.cfg.Partitions {
				continue
			}
			if json.Unmarshal(e.Value(), &l) == nil {
				s.Leases[p] = Lease{Monitor: l.MonitorID, Epoch: l.Epoch, Age: age}
			}
		}
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for id, base := range monitors {
		if down[id] {
			continue
		}
		wg.Go(func() {
			var r api.PartitionsReply
			if c.getJSON(rctx, base+"/partitions", &r) == nil {
				mu.Lock()
				s.Held[r.MonitorID] = r.Held
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	s.Records = c.records.Latest()
	s.Now = time.Now()
	return s, nil
}

func (c *Checker) getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// Close stops following the stack.
func (c *Checker) Close() {
	if c.loop != nil {
		c.loop.Close()
	}
	for _, s := range c.subs {
		_ = s.Unsubscribe()
	}
	c.nc.Close()
}

// busySink is the checker as the busy bucket's kvwatch sink.
type busySink Checker

func (s *busySink) Reset() {}
func (s *busySink) Apply(e jetstream.KeyValueEntry, now time.Time) error {
	if e.Operation() != jetstream.KeyValuePut {
		s.records.Deleted(e.Key(), e.Revision())
		return nil
	}
	rec, err := events.DecodeBusySet(e.Value())
	if err != nil {
		return err
	}
	s.records.Observe(e.Key(), e.Revision(), rec, now)
	return nil
}
func (s *busySink) Publish() int { return 0 }

type nopStats struct{}

func (nopStats) Rewatched(string) {}
func (nopStats) BadRecord(string) {}
func (nopStats) Published(int)    {}

// retryFor calls f until it succeeds or d passes.
func retryFor(ctx context.Context, d time.Duration, f func(context.Context) error) error {
	deadline := time.Now().Add(d)
	for {
		rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err := f(rctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}
