//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// TestWorkerCannotSpeakForAnother connects with worker 2's NATS credentials
// (user engine-2 of deploy/nats/compose.conf) and tries to speak for worker
// 1: load reports claiming every rank of worker 1 is full, a goodbye in
// worker 1's boot, and a registry entry sending worker 1's requests
// elsewhere, each on worker 1's own subject. The messages are valid and
// agree with their subjects, so the monitor's own checks (contract §3)
// would take them: only the server's subject permissions stand in the way.
// The server denies and logs every one of them (and the test accepts
// exactly those denials), the busy record never shows worker 1 busy, and
// the registry keeps worker 1's own entry. Sent with worker 1's credentials
// instead, the same put is accepted and the same reports make worker 1
// busy: the permissions, not the payloads, kept the record clean.
func TestWorkerCannotSpeakForAnother(t *testing.T) {
	// Thresholds on (decode 0.4 of 64 blocks), so that a forged report of a
	// full KV cache makes a rank busy.
	s := startStack(t, stackOptions{natsNodes: 1, sims: 2,
		monitorArgs: overloadMonitorArgs, simArgs: overloadSimArgs})
	obs := s.observe()
	obs.waitBothFree(15 * time.Second)
	own := obs.registryEntry(1)
	t.Logf("worker 1's registry entry, written by sim1 as engine-1 (revision %d): %s", own.rev, own.raw)

	victim, intruder := engineUser(1), engineUser(2)
	f := newForgery(t, own.entry)
	bye := f.goodbye(own.entry.BootID) // worker 1 leaving, in its own boot
	var denied clientErrors
	forger := s.connect(intruder, "forger", nats.ErrorHandler(denied.handler))
	t.Logf("connected to NATS as %s (worker 2's credentials), to speak for worker 1", intruder)
	for _, subject := range f.subjects() {
		s.expectViolation(intruder, subject)
	}
	s.expectViolation(intruder, bye.subject)

	// (a) and (b): the forged reports, for six heartbeats of the monitor.
	entries, stopWatch := obs.watch()
	window := 6 * heartbeat
	start := time.Now()
	rounds, reads := 0, 0
	for time.Since(start) < window {
		f.publish(forger)
		if rounds == 0 {
			if err := forger.Publish(bye.subject, bye.data); err != nil {
				t.Fatalf("publish the forged goodbye: %v", err)
			}
		}
		if err := forger.FlushTimeout(opTimeout); err != nil {
			t.Fatalf("flush as %s: %v", intruder, err)
		}
		rounds++
		e, ok, err := obs.record()
		switch {
		case err != nil || !ok:
			t.Fatalf("record while forging: ok=%v err=%v", ok, err)
		case slices.Contains(e.rec.Busy, 1) || !freeAre(e.rec, 1, 2):
			t.Fatalf("record while %s forged worker 1's reports: %v, want both workers free", intruder, e)
		}
		reads++
		time.Sleep(100 * time.Millisecond)
	}
	stopWatch()
	t.Logf("as %s: %d rounds of %d forged reports (one per rank of worker 1) and 1 forged goodbye in %v",
		intruder, rounds, len(f.subjects()), time.Since(start).Round(time.Millisecond))

	// (a) The server denied them, and said so in its log and to the client.
	for _, subject := range append(f.subjects(), bye.subject) {
		s.waitViolation(10*time.Second, violation{user: intruder, subject: subject})
	}
	got := denied.wait(t, 5*time.Second, append(f.subjects(), bye.subject))
	t.Logf("%s's client was told %d time(s), first: %v", intruder, len(got), got[0])

	// (b) The record never showed worker 1 busy, or anything but both free.
	seen := entries()
	if len(seen) < 4 {
		t.Errorf("only %d record(s) written during the %v of forging, want a heartbeat every %v", len(seen), window, heartbeat)
	}
	for _, e := range seen {
		if slices.Contains(e.rec.Busy, 1) || !freeAre(e.rec, 1, 2) {
			t.Errorf("record written while %s forged worker 1's reports: %v, want both workers free", intruder, e)
		}
	}
	t.Logf("during the forgery: %d reads and %d records written (revisions %d to %d), every one with workers 1 and 2 free",
		reads, len(seen), firstRev(seen), lastRev(seen))

	// (c) A registry put for worker 1's key is refused and changes nothing.
	key := events.RegistryKey(model, 1)
	subject := "$KV." + events.WorkersBucket + "." + key
	s.expectViolation(intruder, subject)
	regUpdates, stopRegWatch := obs.watchRegistry(key)
	hijack := own.entry
	hijack.Endpoint, hijack.RegisteredAt = "http://sim2:8000", time.Now().UnixNano()
	data, err := json.Marshal(&hijack)
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kvPut(t, forger, key, data)
	if err == nil {
		t.Errorf("%s's put of worker 1's registry key %s was accepted (revision %d)", intruder, key, rev)
	} else {
		t.Logf("%s's put of %s (endpoint %s) was refused: %v", intruder, key, hijack.Endpoint, err)
	}
	s.waitViolation(10*time.Second, violation{user: intruder, subject: subject})
	time.Sleep(time.Second)
	stopRegWatch()
	after := obs.registryEntry(1)
	if after.entry.Endpoint != own.entry.Endpoint || after.entry.BootID != own.entry.BootID {
		t.Errorf("worker 1's registry entry changed: %s, was %s", after.raw, own.raw)
	}
	for _, u := range regUpdates() {
		if !strings.Contains(u, `"endpoint":"`+own.entry.Endpoint+`"`) {
			t.Errorf("worker 1's registry key was written with %s", u)
		}
	}
	t.Logf("worker 1's registry entry after the refused put (revision %d): endpoint %s, boot %d; writes of the key meanwhile: %d (sim1's refreshes only)",
		after.rev, after.entry.Endpoint, after.entry.BootID, len(regUpdates()))

	// Controls, with worker 1's own credentials: the same put is accepted,
	// and the same reports make worker 1 busy.
	owner := s.connect(victim, "owner")
	t.Logf("connected to NATS as %s (worker 1's credentials)", victim)
	rev, err = kvPut(t, owner, key, after.raw)
	if err != nil {
		t.Fatalf("%s's put of its own registry key %s (its entry as it stands): %v", victim, key, err)
	}
	t.Logf("%s's put of %s (its entry as it stands) was accepted: revision %d", victim, key, rev)

	ctx, stopForging := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			f.publish(owner)
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
	busy := obs.waitRecord(10*time.Second, "the same reports sent as "+victim+" making worker 1 busy", func(e entry) bool {
		return slices.Contains(e.rec.Busy, 1)
	})
	stopForging()
	wg.Wait()
	if r := busy.rec.Reasons["1"]; r != "kv" && r != "kv+prefill" {
		t.Errorf("worker 1 busy for %q, want kv", r)
	}
	obs.waitRecord(10*time.Second, "worker 1 free again once the reports stopped", func(e entry) bool { return freeAre(e.rec, 1, 2) })
}

// forgery builds load reports for a worker: every declared rank of its
// registry entry with a full KV cache, as its engine, in a boot of its own.
type forgery struct {
	t     *testing.T
	entry events.WorkerEntry
	boot  uint64
	seq   uint64
}

func newForgery(t *testing.T, e events.WorkerEntry) *forgery {
	f := &forgery{t: t, entry: e, boot: rand.Uint64()}
	// Show that the first report is one the monitor would take: valid,
	// and its subject agrees with its payload.
	r := f.report(e.DPStart)
	data, err := events.MarshalLoadReport(&r)
	if err != nil {
		t.Fatal(err)
	}
	subject := f.subjects()[0]
	dec, err := events.DecodeLoadReport(data)
	if err != nil {
		t.Fatalf("forged report does not decode: %v", err)
	}
	parsed, err := events.ParseSubject(events.DefaultSubjectPrefix, subject)
	if err == nil {
		err = dec.Match(parsed)
	}
	if err != nil {
		t.Fatalf("forged report does not agree with %s: %v", subject, err)
	}
	t.Logf("forged report: %d bytes of msgpack on %s, worker %d rank %d of ranks [%d, %d), source %q, boot %d, %d of %d KV blocks: valid and agreeing with its subject",
		len(data), subject, dec.WorkerID, dec.DPRank, dec.DPStart, dec.DPStart+dec.DPSize, dec.Source, dec.BootID,
		dec.ActiveDecodeBlocks.Value, dec.KVTotalBlocks.Value)
	return f
}

// kvBlocks is the simulated ranks' KV cache (overloadSimArgs).
const kvBlocks = 64

func (f *forgery) report(rank uint32) events.LoadReport {
	f.seq++
	return events.LoadReport{
		Model: model, WorkerID: f.entry.WorkerID, DPRank: rank, DPStart: f.entry.DPStart, DPSize: f.entry.DPSize,
		Source:             events.SourceEngine,
		ActiveDecodeBlocks: events.Some(kvBlocks), KVTotalBlocks: events.Some(kvBlocks),
		BootID: f.boot, Seq: f.seq, SentAt: time.Now().UnixNano(),
	}
}

// subjects are the worker's load subjects, one per declared rank.
func (f *forgery) subjects() []string {
	var out []string
	for rank := f.entry.DPStart; rank < f.entry.DPStart+f.entry.DPSize; rank++ {
		out = append(out, events.LoadSubject(events.DefaultSubjectPrefix, model, f.entry.WorkerID, rank))
	}
	return out
}

// publish sends one report per declared rank on nc, not flushed.
func (f *forgery) publish(nc *nats.Conn) {
	for i, subject := range f.subjects() {
		r := f.report(f.entry.DPStart + uint32(i))
		data, err := events.MarshalLoadReport(&r)
		if err != nil {
			f.t.Errorf("marshal: %v", err)
			return
		}
		if err := nc.Publish(subject, data); err != nil {
			f.t.Errorf("publish %s: %v", subject, err)
			return
		}
	}
}

type message struct {
	subject string
	data    []byte
}

// goodbye builds the worker's goodbye as its engine, in boot.
func (f *forgery) goodbye(boot uint64) message {
	g := events.Goodbye{Model: model, WorkerID: f.entry.WorkerID, Source: events.SourceEngine,
		BootID: boot, Seq: 1 << 40, SentAt: time.Now().UnixNano()}
	data, err := events.MarshalGoodbye(&g)
	if err != nil {
		f.t.Fatal(err)
	}
	return message{subject: events.ByeSubject(events.DefaultSubjectPrefix, model, f.entry.WorkerID), data: data}
}

// clientErrors collects the asynchronous errors the server sends a
// connection (the -ERR of a denied publish).
type clientErrors struct {
	mu   sync.Mutex
	errs []error
}

func (c *clientErrors) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs = append(c.errs, err)
}

// wait waits until there is a permissions violation for each subject and
// returns them all.
func (c *clientErrors) wait(t *testing.T, timeout time.Duration, subjects []string) []error {
	t.Helper()
	var got []error
	waitFor(t, timeout, "the client told of the denials", func() (bool, string) {
		c.mu.Lock()
		got = slices.Clone(c.errs)
		c.mu.Unlock()
		var missing []string
		for _, subject := range subjects {
			if !slices.ContainsFunc(got, func(err error) bool {
				return errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), fmt.Sprintf("Publish to %q", subject))
			}) {
				missing = append(missing, subject)
			}
		}
		if len(missing) > 0 {
			return false, fmt.Sprintf("%d error(s), no denial yet of %s", len(got), joinComma(missing))
		}
		return true, fmt.Sprintf("%d error(s), a denial of each of the %d subjects", len(got), len(subjects))
	})
	return got
}

// registered is a worker's entry in the registry bucket.
type registered struct {
	rev   uint64
	raw   []byte
	entry events.WorkerEntry
}

// registryEntry reads worker id's entry from the registry bucket.
func (o *observer) registryEntry(id uint64) registered {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(o.t.Context(), opTimeout)
	defer cancel()
	kv, err := o.js.KeyValue(ctx, events.WorkersBucket)
	if err != nil {
		o.t.Fatalf("registry: %v", err)
	}
	kve, err := kv.Get(ctx, events.RegistryKey(model, id))
	if err != nil {
		o.t.Fatalf("registry entry of worker %d: %v", id, err)
	}
	r := registered{rev: kve.Revision(), raw: kve.Value()}
	if err := json.Unmarshal(r.raw, &r.entry); err != nil {
		o.t.Fatalf("registry entry of worker %d: %v: %s", id, err, r.raw)
	}
	return r
}

// watchRegistry collects every value written to a registry key from now
// on, until stop is called.
func (o *observer) watchRegistry(key string) (values func() []string, stop func()) {
	o.t.Helper()
	w, cancel := o.watchKey(events.WorkersBucket, key, "watch registry")
	var mu sync.Mutex
	var all []string
	done := make(chan struct{})
	go func() {
		defer close(done)
		for kve := range w.Updates() {
			if kve == nil {
				continue
			}
			mu.Lock()
			all = append(all, fmt.Sprintf("%s revision %d: %s", kve.Operation(), kve.Revision(), kve.Value()))
			mu.Unlock()
		}
	}()
	stop = func() { cancel(); <-done }
	o.t.Cleanup(stop)
	return func() []string { mu.Lock(); defer mu.Unlock(); return slices.Clone(all) }, stop
}

// kvPut puts a value in the registry bucket on nc's behalf.
func kvPut(t *testing.T, nc *nats.Conn, key string, value []byte) (uint64, error) {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), opTimeout)
	defer cancel()
	kv, err := js.KeyValue(ctx, events.WorkersBucket)
	if err != nil {
		return 0, fmt.Errorf("open bucket %s: %w", events.WorkersBucket, err)
	}
	return kv.Put(ctx, key, value)
}

func firstRev(es []entry) uint64 {
	if len(es) == 0 {
		return 0
	}
	return es[0].rev
}

func lastRev(es []entry) uint64 {
	if len(es) == 0 {
		return 0
	}
	return es[len(es)-1].rev
}
