package publisher_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

func TestReportMatchesSubjectAndOptions(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 11, 5, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name   string
		model  string
		worker uint64
		rank   uint32
		opts   []publisher.Option
		prefix string
		source string
		start  uint32
		size   uint32
	}{
		{name: "defaults", model: "Qwen/Qwen3-0.6B", worker: 7, prefix: events.DefaultSubjectPrefix,
			source: events.SourceEngine, size: 1},
		{name: "escaped model and options", model: "a b=c.d", worker: 1 << 63, rank: 5,
			opts: []publisher.Option{publisher.WithRanks(4, 2), publisher.WithSubjectPrefix("acme.wm"),
				publisher.WithSource("router/r1")},
			prefix: "acme.wm", source: "router/r1", start: 4, size: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			in := subscribe(t, e.obs, tt.prefix)
			opts := append([]publisher.Option{publisher.WithClock(func() time.Time { return at })}, tt.opts...)
			p := e.start(t, tt.model, tt.worker, opts...)
			if err := p.Update(tt.rank, load(10, 100, 20, 200)); err != nil {
				t.Fatalf("Update: %v", err)
			}
			m := in.next(t)
			if m.report == nil {
				t.Fatalf("got a goodbye, want a report")
			}
			want := events.LoadReport{
				Model: tt.model, WorkerID: tt.worker, DPRank: tt.rank, DPStart: tt.start, DPSize: tt.size,
				Source: tt.source, ActiveDecodeBlocks: events.Some(10), KVTotalBlocks: events.Some(100),
				ActivePrefillTokens: events.Some(20), MaxNumBatchedTokens: events.Some(200),
				BootID: p.BootID(), Seq: 1, SentAt: at.UnixNano(),
			}
			if *m.report != want {
				t.Errorf("report\n got %+v\nwant %+v", *m.report, want)
			}
			subject := events.LoadSubject // an engine's; a router's estimates go on est subjects
			if events.IsRouterSource(tt.source) {
				subject = events.EstSubject
			}
			if wantSubj := subject(tt.prefix, tt.model, tt.worker, tt.rank); m.subject != wantSubj {
				t.Errorf("subject %q, want %q", m.subject, wantSubj)
			}
		})
	}
}

func TestUpdateRejectsRankOutsideRange(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	p := e.start(t, "m", 1, publisher.WithRanks(4, 2))
	tests := []struct {
		rank    uint32
		wantErr error
	}{
		{0, publisher.ErrRankOutOfRange},
		{3, publisher.ErrRankOutOfRange},
		{4, nil},
		{5, nil},
		{6, publisher.ErrRankOutOfRange},
		{^uint32(0), publisher.ErrRankOutOfRange},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.rank), func(t *testing.T) {
			err := p.Update(tt.rank, load(1, -1, -1, -1))
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Errorf("Update(%d) = %v, want %v", tt.rank, err, tt.wantErr)
			}
		})
	}
}

// Updates to different ranks in quick succession are all published: the
// coalescing keeps one latest value per rank, not one for all.
func TestCoalescesPerRank(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 1, publisher.WithRanks(0, 3), publisher.WithDebounce(50*time.Millisecond))
	want := map[uint32]uint64{0: 11, 1: 22, 2: 33}
	for rank, v := range want {
		if err := p.Update(rank, load(int64(v), -1, -1, -1)); err != nil {
			t.Fatalf("Update: %v", err)
		}
	}
	got := map[uint32]uint64{}
	for len(got) < len(want) {
		r := in.waitReport(t, func(events.LoadReport) bool { return true })
		got[r.DPRank] = r.ActiveDecodeBlocks.Value
	}
	for rank, v := range want {
		if got[rank] != v {
			t.Errorf("rank %d: active_decode_blocks %d, want %d", rank, got[rank], v)
		}
	}
}

// A burst of updates to one rank gives a few reports, the latest value last.
func TestBurstCoalesces(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 1, publisher.WithDebounce(20*time.Millisecond))
	const n = 1000
	for v := range n {
		if err := p.Update(0, load(int64(v+1), -1, -1, -1)); err != nil {
			t.Fatalf("Update: %v", err)
		}
	}
	var values []uint64
	in.waitReport(t, func(r events.LoadReport) bool {
		values = append(values, r.ActiveDecodeBlocks.Value)
		return r.ActiveDecodeBlocks.Value == n
	})
	if len(values) > 10 {
		t.Errorf("%d reports for a burst of %d updates, want a few", len(values), n)
	}
	for i := 1; i < len(values); i++ {
		if values[i] < values[i-1] {
			t.Errorf("values go back: %v", values)
		}
	}
}

func TestHeartbeatRepublishesUnchangedState(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	const every = 50 * time.Millisecond
	p := e.start(t, "m", 1, publisher.WithRanks(0, 2), publisher.WithDebounce(time.Millisecond),
		publisher.WithHeartbeat(every))
	want := map[uint32]publisher.Load{0: load(5, 100, -1, -1), 1: load(-1, -1, 7, 8192)}
	for rank, l := range want {
		if err := p.Update(rank, l); err != nil {
			t.Fatalf("Update: %v", err)
		}
	}
	// Each rank keeps coming with its full state, about a heartbeat apart
	// by the publisher's clock.
	count := map[uint32]int{}
	last := map[uint32]int64{}
	for count[0] < 4 || count[1] < 4 {
		r := in.waitReport(t, func(events.LoadReport) bool { return true })
		if got := loadOf(r); got != want[r.DPRank] {
			t.Errorf("rank %d: load %+v, want %+v", r.DPRank, got, want[r.DPRank])
		}
		if prev, ok := last[r.DPRank]; ok && time.Duration(r.SentAt-prev) < every/2 {
			t.Errorf("rank %d: heartbeats %v apart, want about %v", r.DPRank, time.Duration(r.SentAt-prev), every)
		}
		last[r.DPRank] = r.SentAt
		count[r.DPRank]++
	}
}

// seq is one counter for all ranks: strictly increasing in publish order,
// with concurrent updates to several ranks, round after round.
func TestSeqIncreasesAcrossRanks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	const ranks, rounds, perRound = 4, 5, 100
	p := e.start(t, "m", 1, publisher.WithRanks(0, ranks), publisher.WithDebounce(time.Millisecond))
	var lastSeq uint64
	reports := 0
	for round := range rounds {
		var wg sync.WaitGroup
		for rank := range uint32(ranks) {
			wg.Go(func() {
				for v := range perRound {
					if err := p.Update(rank, load(int64(round*perRound+v+1), -1, -1, -1)); err != nil {
						t.Errorf("Update: %v", err)
						return
					}
				}
			})
		}
		wg.Wait()
		done := map[uint32]bool{}
		for len(done) < ranks {
			r := in.waitReport(t, func(events.LoadReport) bool { return true })
			if r.Seq <= lastSeq {
				t.Fatalf("seq %d after %d", r.Seq, lastSeq)
			}
			if r.BootID != p.BootID() {
				t.Fatalf("boot_id %d, want %d", r.BootID, p.BootID())
			}
			lastSeq = r.Seq
			reports++
			if r.ActiveDecodeBlocks.Value == uint64((round+1)*perRound) {
				done[r.DPRank] = true
			}
		}
	}
	if reports < ranks*rounds {
		t.Errorf("%d reports, want at least %d", reports, ranks*rounds)
	}
}

// A field absent from an update keeps its value; a present zero sets zero;
// a field never set stays absent on the wire.
func TestAbsentFieldKeepsValue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 1)
	steps := []updateStep{
		{"first", load(5, 100, -1, -1), load(5, 100, -1, -1)},
		{"add prefill only", load(-1, -1, 7, -1), load(5, 100, 7, -1)},
		{"zero is a value", load(0, -1, -1, -1), load(0, 100, 7, -1)},
		{"set all", load(1, 2, 3, 4), load(1, 2, 3, 4)},
		{"change one", load(-1, 200, -1, -1), load(1, 200, 3, 4)},
	}
	updateSteps(t, p, in, steps)
}

// updateStep is one Update of rank 0 and the load the next report must
// carry.
type updateStep struct {
	name   string
	update publisher.Load
	want   publisher.Load
}

// updateSteps makes each step's Update in turn and checks the report that
// follows it.
func updateSteps(t *testing.T, p *publisher.Publisher, in *inbox, steps []updateStep) {
	t.Helper()
	var prev publisher.Load
	for _, s := range steps {
		if err := p.Update(0, s.update); err != nil {
			t.Fatalf("%s: Update: %v", s.name, err)
		}
		// A heartbeat may still carry the previous state; the next
		// different report must be the new one.
		r := in.waitReport(t, func(r events.LoadReport) bool { return loadOf(r) != prev })
		if got := loadOf(r); got != s.want {
			t.Errorf("%s: load\n got %+v\nwant %+v", s.name, got, s.want)
		}
		prev = s.want
	}
}

// An update that changes nothing publishes nothing before the heartbeat.
func TestUnchangedUpdateIsNotPublished(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 1, publisher.WithDebounce(time.Millisecond))
	if err := p.Update(0, load(5, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	first := in.waitReport(t, func(events.LoadReport) bool { return true })
	for range 10 {
		if err := p.Update(0, load(5, -1, -1, -1)); err != nil {
			t.Fatalf("Update: %v", err)
		}
	}
	if err := p.Update(0, load(6, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	// Reports are published in order: the next one is the change (or,
	// rarely, a heartbeat with the old value just before it).
	next := in.waitReport(t, func(r events.LoadReport) bool { return r.ActiveDecodeBlocks.Value == 6 })
	if next.Seq > first.Seq+2 {
		t.Errorf("seq %d after %d: unchanged updates were published", next.Seq, first.Seq)
	}
}

// The leading signals of contract §21 reach the wire as given, only those
// set: an unknown one is absent, never 0. The counters never go down within
// the boot: a value below the previous one is a restart of the engine's
// count, added to what was published.
func TestLeadingFieldsOnTheWire(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 1)
	steps := []updateStep{
		{"request counts only", leading(3, 1, -1, -1, -1), leading(3, 1, -1, -1, -1)},
		{"counters and committed", leading(-1, -1, 5, 100, 40), leading(3, 1, 5, 100, 40)},
		{"zero is a value", leading(0, 0, 7, 160, 0), leading(0, 0, 7, 160, 0)},
		{"the engine's counts restart", leading(-1, -1, 2, 30, -1), leading(0, 0, 9, 190, 0)},
		{"and grow again", leading(-1, -1, 4, 30, -1), leading(0, 0, 11, 190, 0)},
	}
	updateSteps(t, p, in, steps)
}
