package publisher_test

import (
	"errors"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
)

// A paused rank is silent (no report, no heartbeat, no goodbye) while the
// others keep their heartbeats; Update still records its load, and Resume
// publishes the latest load at once.
func TestPauseSilencesRankUntilResume(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 3, publisher.WithRanks(0, 2), publisher.WithHeartbeat(40*time.Millisecond),
		publisher.WithDebounce(time.Millisecond))
	for rank := range uint32(2) {
		if err := p.Update(rank, load(int64(rank)+1, 100, -1, -1)); err != nil {
			t.Fatalf("Update: %v", err)
		}
	}
	in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })

	if err := p.Pause(1); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if err := p.Pause(1); err != nil {
		t.Fatalf("second Pause: %v", err)
	}
	if err := p.Update(1, load(77, -1, -1, -1)); err != nil {
		t.Fatalf("Update of a paused rank: %v", err)
	}
	// A heartbeat round that began before Pause returned may still carry
	// rank 1 ahead of its rank-0 report; from the second rank-0 report on,
	// every heartbeat round began after Pause.
	rank0 := 0
	for rank0 < 6 {
		m := in.next(t)
		if m.bye != nil {
			t.Fatalf("goodbye %+v while paused", *m.bye)
		}
		switch m.report.DPRank {
		case 0:
			rank0++
		case 1:
			if rank0 >= 2 {
				t.Fatalf("report of paused rank 1 (seq %d) after %d heartbeats of rank 0", m.report.Seq, rank0)
			}
		}
	}

	if err := p.Resume(1); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	r := in.waitReport(t, func(r events.LoadReport) bool { return r.DPRank == 1 })
	if r.ActiveDecodeBlocks != events.Some(77) || r.KVTotalBlocks != events.Some(100) {
		t.Errorf("first report after Resume carries %+v, want the load recorded while paused (77 of 100)", loadOf(r))
	}
	// Heartbeats of rank 1 again.
	in.waitReport(t, func(x events.LoadReport) bool { return x.DPRank == 1 && x.Seq > r.Seq })
}

// While every rank is paused the registry entry is neither refreshed nor
// deleted; Resume writes it again at once. A second publisher, refreshed at
// the same rate, is the clock that shows the first one has stopped.
func TestPauseAllStopsRegistryRefresh(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const model = "m"
	opts := []publisher.Option{publisher.WithRanks(0, 2), publisher.WithRegistryRefresh(20 * time.Millisecond)}
	p := e.start(t, model, 1, append(opts, publisher.WithEndpoint("http://engine-1:8000"))...)
	e.start(t, model, 2, append(opts, publisher.WithEndpoint("http://engine-2:8000"))...) // the witness
	kv := workersBucket(t, e)
	key, witnessKey := events.RegistryKey(model, 1), events.RegistryKey(model, 2)
	_, rev := waitEntry(t, kv, key, 0)
	waitEntry(t, kv, key, rev) // refreshed

	if err := p.Pause(0); err != nil {
		t.Fatalf("Pause(0): %v", err)
	}
	_, rev = waitEntry(t, kv, key, rev) // one rank still runs: still refreshed
	if err := p.Pause(1); err != nil {
		t.Fatalf("Pause(1): %v", err)
	}
	// Pause has stopped the refresh before returning: the revision now is
	// the last one.
	got, err := kv.Get(t.Context(), key)
	if err != nil {
		t.Fatalf("Get after pausing every rank: %v", err)
	}
	paused := got.Revision()
	var wrev uint64
	for range 5 {
		_, wrev = waitEntry(t, kv, witnessKey, wrev)
	}
	got, err = kv.Get(t.Context(), key)
	if err != nil {
		t.Fatalf("entry of the paused worker: %v (want it kept, not deleted)", err)
	}
	if got.Revision() != paused {
		t.Errorf("entry of the paused worker rewritten (revision %d, was %d) while the witness was refreshed 5 times",
			got.Revision(), paused)
	}

	if err := p.Resume(1); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	waitEntry(t, kv, key, paused)
}

// Close of a paused publisher still says goodbye, and publishes nothing of
// the paused rank.
func TestCloseWhilePausedSaysGoodbye(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs, events.DefaultSubjectPrefix)
	p := e.start(t, "m", 4, publisher.WithDebounce(500*time.Millisecond))
	if err := p.Pause(0); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if err := p.Update(0, load(5, -1, -1, -1)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	if err := p.Close(t.Context()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if m := in.next(t); m.bye == nil {
		t.Fatalf("first message %+v, want the goodbye (the paused rank's update stays unpublished)", m)
	}
}

func TestPauseResumeErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	p := e.start(t, "m", 1, publisher.WithRanks(4, 2))
	tests := []struct {
		name string
		call func(uint32) error
		rank uint32
		want error
	}{
		{"pause below range", p.Pause, 3, publisher.ErrRankOutOfRange},
		{"pause above range", p.Pause, 6, publisher.ErrRankOutOfRange},
		{"resume below range", p.Resume, 0, publisher.ErrRankOutOfRange},
		{"pause in range", p.Pause, 5, nil},
		{"resume a rank not paused", p.Resume, 4, nil},
		{"resume in range", p.Resume, 5, nil},
	}
	for _, tt := range tests {
		if err := tt.call(tt.rank); !errors.Is(err, tt.want) {
			t.Errorf("%s: rank %d: err %v, want %v", tt.name, tt.rank, err, tt.want)
		}
	}
	if err := p.Close(t.Context()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := p.Pause(4); !errors.Is(err, publisher.ErrClosed) {
		t.Errorf("Pause after Close = %v, want ErrClosed", err)
	}
	if err := p.Resume(4); !errors.Is(err, publisher.ErrClosed) {
		t.Errorf("Resume after Close = %v, want ErrClosed", err)
	}
}
