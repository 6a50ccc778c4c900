package sim_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/sim"
)

// complete sends a non-streamed completion and returns its status; any
// goroutine may call it.
func complete(ctx context.Context, w *sim.Worker, prompt string, maxTokens int) (int, error) {
	resp, err := tryPost(ctx, w.Endpoint()+"/v1/completions",
		map[string]any{"model": w.Model(), "prompt": prompt, "max_tokens": maxTokens})
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0, err
	}
	return resp.StatusCode, nil
}

// completeAll sends n completions at once and reports an error unless all
// succeed; any goroutine may call it.
func completeAll(t *testing.T, w *sim.Worker, n int, prompt string, maxTokens int) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			if s, err := complete(t.Context(), w, prompt, maxTokens); err != nil || s != http.StatusOK {
				t.Errorf("request %d: status %d, error %v", i, s, err)
			}
		})
	}
	wg.Wait()
}

func TestLoadRisesAndFalls(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	cfg := workerConfig(e.srv)
	cfg.Engine.DecodeSpeed = 40 // 20 tokens: half a second
	w := startWorker(t, cfg)

	idle := in.waitReport(t, "capacities", func(r events.LoadReport) bool { return r.WorkerID == w.ID() })
	if idle.KVTotalBlocks != events.Some(sim.DefaultKVBlocks) ||
		idle.MaxNumBatchedTokens != events.Some(sim.DefaultMaxNumBatchedTokens) ||
		idle.ActiveDecodeBlocks != events.Some(0) || idle.ActivePrefillTokens != events.Some(0) ||
		idle.Source != events.SourceEngine || idle.DPSize != 1 {
		t.Fatalf("first report %+v", idle)
	}

	done := make(chan struct{})
	go func() {
		defer close(done)
		completeAll(t, w, 6, strings.Repeat("word ", 20), 20)
	}()
	busy := in.waitReport(t, "decode blocks", func(r events.LoadReport) bool {
		return r.ActiveDecodeBlocks.Value > 6 // more than one request's worth
	})
	if busy.KVTotalBlocks != idle.KVTotalBlocks || busy.BootID != idle.BootID || busy.Seq <= idle.Seq {
		t.Errorf("busy report %+v after %+v", busy, idle)
	}
	<-done
	in.waitReport(t, "no load", func(r events.LoadReport) bool {
		return r.ActiveDecodeBlocks.Value == 0 && r.ActivePrefillTokens.Value == 0
	})
	// Stats is stored after the engine step that answered the client.
	waitUntil(t, "all served in stats", func() bool {
		s := w.Stats()
		return s.Served == 6 && s.InFlight == 0 && s.Ranks[0].ActiveDecodeBlocks == 0
	})
}

func TestCancelFreesAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	cfg := workerConfig(e.srv)
	cfg.Engine.DecodeSpeed = 10 // 500 tokens: 50 seconds
	w := startWorker(t, cfg)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	resp := post(t, ctx, w.Endpoint()+"/v1/completions",
		map[string]any{"model": w.Model(), "prompt": "hello", "max_tokens": 500, "stream": true})
	defer resp.Body.Close()
	buf := make([]byte, 1)
	if _, err := resp.Body.Read(buf); err != nil { // the first token is on its way
		t.Fatal(err)
	}
	in.waitReport(t, "decode blocks", func(r events.LoadReport) bool { return r.ActiveDecodeBlocks.Value > 0 })

	cancel()
	start := time.Now()
	in.waitReport(t, "freed blocks", func(r events.LoadReport) bool {
		return r.ActiveDecodeBlocks.Value == 0 && r.ActivePrefillTokens.Value == 0
	})
	// Finishing the 500 tokens would take 50 s: a bound of 10 s tells a
	// freed request from a finished one on a machine however loaded.
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("blocks freed %v after the cancellation", took)
	}
	waitUntil(t, "cancellation counted", func() bool {
		s := w.Stats()
		return s.Cancelled == 1 && s.InFlight == 0
	})
}

func TestKVCapacityQueues(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	cfg := workerConfig(e.srv)
	// 8 blocks of 16 tokens; each request reserves ceil((26+40)/16) = 5.
	cfg.Engine.KVBlocks = 8
	cfg.Engine.DecodeSpeed = 100
	w := startWorker(t, cfg)
	prompt := strings.Repeat("abcd", 25) // 26 tokens

	done := make(chan struct{})
	go func() {
		defer close(done)
		completeAll(t, w, 3, prompt, 40)
	}()
	waitUntil(t, "a queued request", func() bool { return w.Stats().Ranks[0].Waiting >= 1 })
	// The queue shows as prefill load; the blocks in use never pass the
	// capacity.
	in.waitReport(t, "queued prefill tokens", func(r events.LoadReport) bool {
		if r.ActiveDecodeBlocks.Value > 8 {
			t.Errorf("%d blocks in use of 8", r.ActiveDecodeBlocks.Value)
		}
		return r.ActivePrefillTokens.Value >= 2*26 // two queued
	})
	<-done
	waitUntil(t, "all served in stats", func() bool {
		s := w.Stats()
		return s.Served == 3 && s.Ranks[0].Waiting == 0 && s.Ranks[0].Running == 0
	})
}

func TestRegistryAndGoodbye(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	cfg := workerConfig(e.srv)
	cfg.WorkerID = 42
	cfg.DPStart, cfg.Ranks = 4, 2
	w := startWorker(t, cfg)
	entry := waitEntry(t, e, w)
	if entry.Endpoint != w.Endpoint() || entry.DPStart != 4 || entry.DPSize != 2 || entry.BootID != w.BootID() {
		t.Errorf("registry entry %+v; endpoint %s, boot %d", entry, w.Endpoint(), w.BootID())
	}
	r := in.waitReport(t, "rank 5", func(r events.LoadReport) bool { return r.DPRank == 5 })
	if r.DPStart != 4 || r.DPSize != 2 {
		t.Errorf("report %+v", r)
	}

	boot := w.BootID()
	if err := w.Close(t.Context()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	bye := in.waitBye(t)
	if bye.WorkerID != 42 || bye.BootID != boot || bye.Source != events.SourceEngine {
		t.Errorf("goodbye %+v", bye)
	}
	if _, err := registryEntry(t, e, w); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("registry entry after Close: %v; want ErrKeyNotFound", err)
	}
	if w.State() != sim.StateClosed || w.BootID() != 0 {
		t.Errorf("state %v, boot %d after Close", w.State(), w.BootID())
	}
	if err := w.Close(t.Context()); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// registryEntry reads w's registry entry.
func registryEntry(t *testing.T, e *env, w *sim.Worker) (events.WorkerEntry, error) {
	t.Helper()
	js, err := jetstream.New(e.obs)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(t.Context(), events.WorkersBucket)
	if err != nil {
		return events.WorkerEntry{}, err
	}
	got, err := kv.Get(t.Context(), events.RegistryKey(w.Model(), w.ID()))
	if err != nil {
		return events.WorkerEntry{}, err
	}
	var entry events.WorkerEntry
	if err := json.Unmarshal(got.Value(), &entry); err != nil {
		t.Fatalf("decode registry entry: %v", err)
	}
	return entry, nil
}

// waitEntry waits for w's registry entry.
func waitEntry(t *testing.T, e *env, w *sim.Worker) events.WorkerEntry {
	t.Helper()
	var entry events.WorkerEntry
	waitUntil(t, "registry entry", func() bool {
		var err error
		entry, err = registryEntry(t, e, w)
		return err == nil
	})
	return entry
}

func TestCloseDrains(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := workerConfig(e.srv)
	cfg.Engine.DecodeSpeed = 50 // 15 tokens: 0.3 seconds
	w := startWorker(t, cfg)

	status := make(chan int, 1)
	go func() {
		s, err := complete(t.Context(), w, "hello", 15)
		if err != nil {
			t.Errorf("request in flight during Close: %v", err)
		}
		status <- s
	}()
	waitUntil(t, "a request in flight", func() bool { return w.Stats().InFlight == 1 })
	if err := w.Close(t.Context()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if s := <-status; s != http.StatusOK {
		t.Errorf("request in flight during Close: status %d", s)
	}
	if s := w.Stats(); s.Served != 1 || s.State != sim.StateClosed {
		t.Errorf("stats %+v", s)
	}
}

// leading returns the five fields of contract §21 of a report.
func leading(r events.LoadReport) [5]events.Optional {
	return [5]events.Optional{r.WaitingRequests, r.RunningRequests, r.Preemptions, r.PrefilledTokens, r.KVCommittedBlocks}
}

// Every report of a rank carries the five leading signals of contract §21,
// on change and on heartbeat, and a new boot (Unmute) goes on from the
// engine's counters.
func TestLeadingSignalsReported(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	in := subscribe(t, e.obs)
	cfg := workerConfig(e.srv)
	cfg.Engine.DecodeSpeed = 40 // 20 tokens: half a second
	w := startWorker(t, cfg)

	idle := in.waitReport(t, "a first report", func(r events.LoadReport) bool { return r.WorkerID == w.ID() })
	zero := events.Some(0)
	if got := leading(idle); got != [5]events.Optional{zero, zero, zero, zero, zero} {
		t.Fatalf("first report's leading signals %+v, want all present and 0", got)
	}

	prompt := strings.Repeat("word ", 20) // 26 tokens
	const n, maxTokens, output = 6, 40, 20
	done := make(chan struct{})
	go func() {
		defer close(done)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				resp, err := tryPost(t.Context(), w.Endpoint()+"/v1/completions", map[string]any{"model": w.Model(),
					"prompt": prompt, "max_tokens": maxTokens, "sim_output_tokens": output})
				if err != nil {
					t.Errorf("request %d: %v", i, err)
					return
				}
				defer resp.Body.Close()
				_, _ = io.Copy(io.Discard, resp.Body)
				if resp.StatusCode != http.StatusOK {
					t.Errorf("request %d: status %d", i, resp.StatusCode)
				}
			})
		}
		wg.Wait()
	}()
	// While they run, each commits its max_tokens, ceil((26+40)/16) = 5
	// blocks, until one finishes; then the p90 of the outputs, 20:
	// ceil((26+20)/16) = 3 (on a slow host a request may arrive that late).
	busy := in.waitReport(t, "running requests", func(r events.LoadReport) bool {
		return r.RunningRequests.Value > 0 && r.PrefilledTokens.Value > 0
	})
	if c, k := busy.KVCommittedBlocks.Value, busy.WaitingRequests.Value+busy.RunningRequests.Value; c != 5*k && c != 3*k {
		t.Errorf("kv_committed_blocks %d for %d waiting and %d running, want 5 each (or 3 once one finished)",
			c, busy.WaitingRequests.Value, busy.RunningRequests.Value)
	}
	<-done
	end := in.waitReport(t, "the end", func(r events.LoadReport) bool {
		return r.RunningRequests.Value == 0 && r.WaitingRequests.Value == 0 && r.PrefilledTokens.Value == n*26
	})
	if end.KVCommittedBlocks != zero || end.Preemptions != zero {
		t.Errorf("after the end: %+v", leading(end))
	}
	heartbeat := in.waitReport(t, "a heartbeat", func(r events.LoadReport) bool { return r.Seq > end.Seq })
	if leading(heartbeat) != leading(end) {
		t.Errorf("heartbeat's leading signals %+v, want %+v", leading(heartbeat), leading(end))
	}

	w.Mute()
	if err := w.Unmute(t.Context()); err != nil {
		t.Fatalf("Unmute: %v", err)
	}
	back := in.waitReport(t, "a report of the new boot", func(r events.LoadReport) bool { return r.BootID != end.BootID })
	if leading(back) != leading(end) {
		t.Errorf("new boot's leading signals %+v, want the engine's %+v", leading(back), leading(end))
	}
}
