package watch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
	"unicode/utf8"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
	"github.com/workermon/workermon/monitor"
)

func TestFormatLeading(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		got  string
		want string
	}{
		{"delay unknown", FormatDelay(nil), "–"},
		{"delay zero is known", FormatDelay(events.Ptr(0.0)), "0ms"},
		{"delay ms", FormatDelay(events.Ptr(399.2)), "399ms"},
		{"delay rounds up to a second", FormatDelay(events.Ptr(999.6)), "1.0s"},
		{"delay seconds", FormatDelay(events.Ptr(12_345.0)), "12.3s"},
		{"delay a minute", FormatDelay(events.Ptr(59_960.0)), "60s"},
		{"delay minutes", FormatDelay(events.Ptr(95_000.0)), "95s"},
		{"prefill unknown", FormatPrefillRate(nil), "–"},
		{"prefill zero is known", FormatPrefillRate(events.Ptr(0.0)), "0tok/s"},
		{"prefill", FormatPrefillRate(events.Ptr(6012.6)), "6013tok/s"},
		{"preemptions unknown", FormatPreemptionRate(nil), "–"},
		{"preemptions zero is known", FormatPreemptionRate(events.Ptr(0.0)), "0.00/s"},
		{"preemptions", FormatPreemptionRate(events.Ptr(0.254)), "0.25/s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if tc.got != tc.want {
				t.Fatalf("%q, want %q", tc.got, tc.want)
			}
		})
	}
}

// TestLeadingOf: a worker's delay is its slowest fresh rank's, its rates
// the sums over its fresh ranks; a rank that does not know a value adds
// nothing, a worker none of whose fresh ranks knows it leaves it unknown,
// and stale ranks count for nothing.
func TestLeadingOf(t *testing.T) {
	t.Parallel()
	row := func(model string, worker uint64, rank uint32, delay, prefill, preempt *float64) monitor.LoadRow {
		return monitor.LoadRow{Model: model, WorkerID: worker, DPRank: rank, QueueDelayMs: delay, PrefillRate: prefill, PreemptionRate: preempt}
	}
	stale := row("m", 1, 2, events.Ptr(9999.0), events.Ptr(1e6), events.Ptr(50.0))
	stale.Stale = true
	onlyStale := row("m", 4, 0, events.Ptr(1.0), events.Ptr(1.0), events.Ptr(1.0))
	onlyStale.Stale = true
	got := LeadingOf([]monitor.LoadRow{
		row("m", 1, 0, events.Ptr(400.0), events.Ptr(5000.0), events.Ptr(0.5)),
		row("m", 1, 1, events.Ptr(800.0), events.Ptr(1000.0), nil),
		stale,
		row("m", 2, 0, nil, nil, events.Ptr(0.0)),
		row("m", 2, 1, nil, nil, nil),
		onlyStale,
		row("other", 1, 0, events.Ptr(10.0), events.Ptr(7.0), events.Ptr(0.0)),
	})
	show := func(l Leading) string {
		return FormatDelay(l.QueueDelayMs) + " " + FormatPrefillRate(l.PrefillRate) + " " + FormatPreemptionRate(l.PreemptionRate)
	}
	for _, tc := range []struct {
		model  string
		worker uint64
		want   string
	}{
		{"m", 1, "800ms 6000tok/s 0.50/s"},
		{"m", 2, "– – 0.00/s"},
		{"m", 3, "– – –"}, // not in /loads
		{"m", 4, "– – –"}, // only a stale rank
		{"other", 1, "10ms 7tok/s 0.00/s"},
	} {
		if s := show(got[tc.model][tc.worker]); s != tc.want {
			t.Errorf("%s worker %d: %s, want %s", tc.model, tc.worker, s, tc.want)
		}
	}
}

func TestFormatLineLeading(t *testing.T) {
	t.Parallel()
	r := rec("m", []uint64{11}, []uint64{12, 10}, []uint64{13}, map[string]string{"11": "queue_delay"})
	loads := &Loads{From: "http://mon:8090", At: t0, Workers: map[string]map[uint64]Leading{"m": {
		11: {QueueDelayMs: events.Ptr(1234.0), PrefillRate: events.Ptr(6012.6), PreemptionRate: events.Ptr(0.0)},
		12: {PreemptionRate: events.Ptr(0.25)},
	}}}
	const head = "2026-11-10T12:00:00.123Z model=m all_busy=false busy=[11] free=[12 10] stale=[13] amber=[] hard=[] reasons=[11:queue_delay] thresholds=[kv>0.8 prefill>2048] saturation=0.00"
	for _, tc := range []struct {
		name  string
		loads *Loads
		want  string
	}{
		{"without loads", nil, head},
		{"with loads", loads, head + " queue_delay=[10:– 11:1.2s 12:–] prefill_rate=[10:– 11:6013tok/s 12:–] preemption_rate=[10:– 11:0.00/s 12:0.25/s]"},
		{"before the first reading", &Loads{From: "x"}, head + " queue_delay=[10:– 11:– 12:–] prefill_rate=[10:– 11:– 12:–] preemption_rate=[10:– 11:– 12:–]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := FormatLine(Change{Model: "m", Record: r, At: t0, Loads: tc.loads}); got != tc.want {
				t.Fatalf("line\n%s\nwant\n%s", got, tc.want)
			}
		})
	}
}

// TestRenderLeading: with the monitor's loads each worker has a line with
// its state and leading values, unknown ones as "–" (never 0); the status
// line under the header says where they come from, or why they fail;
// without loads the header says how to get them. No line is wider than the
// terminal.
func TestRenderLeading(t *testing.T) {
	t.Parallel()
	r := rec("m", []uint64{1, 2, 3}, []uint64{4, 5}, []uint64{6},
		map[string]string{"1": "kv+prefill+kv_committed+queue_delay", "2": "queue_delay", "3": "cordoned"})
	r.Amber, r.Hard = []uint64{5}, []uint64{2}
	workers := map[string]map[uint64]Leading{"m": {
		1: {QueueDelayMs: events.Ptr(399.2), PrefillRate: events.Ptr(6012.6), PreemptionRate: events.Ptr(0.0)},
		2: {QueueDelayMs: events.Ptr(12_345.0), PrefillRate: events.Ptr(80.0), PreemptionRate: events.Ptr(1.5)},
		4: {PreemptionRate: events.Ptr(0.0)},
	}}
	now := t0.Add(1500 * time.Millisecond)
	ok := &Loads{From: "http://mon:8090", Workers: workers, At: t0}
	failing := &Loads{From: "http://mon:8090", Workers: workers, At: t0, FailingSince: t0,
		Err: `api: monitor unreachable at http://mon:8090: dial tcp: connection refused \x1b[2J`}
	gone := &Loads{From: "http://mon:8090", At: t0, FailingSince: t0, Err: "timeout"}
	cfg := DefaultConfig()
	cfg.Hint = "leading values: add --monitor-url"
	for _, tc := range []struct {
		name    string
		loads   *Loads
		cols    int
		want    []string
		notWant []string
	}{
		{"no loads: the hint, the lists", nil, 100,
			[]string{"leading values: add --monitor-url", "  busy   1:kv+prefill+kv_committed+queue_delay 2:queue_delay! 3:cordoned", "  free   4 5~"},
			[]string{"preempt", "–"}},
		{"reading", &Loads{From: "http://mon:8090"}, 100,
			[]string{"leading values: reading http://mon:8090…",
				"  worker  state                     delay  prefill  preempt",
				"  1       busy:kv+prefill+kv_comm…  –      –        –",
				"  6       stale                     –      –        –"},
			[]string{"0ms", "0tok/s", "0.00/s"}},
		{"read", ok, 100,
			[]string{"leading values from http://mon:8090, read 1.5s ago",
				"  worker  state                     delay  prefill    preempt",
				"  1       busy:kv+prefill+kv_comm…  399ms  6013tok/s  0.00/s",
				"  2       busy:queue_delay!         12.3s  80tok/s    1.50/s",
				"  3       cordoned                  –      –          –",
				"  4       free                      –      –          0.00/s",
				"  5       free~                     –      –          –",
				"  6       stale                     –      –          –"},
			[]string{"add --monitor-url"}},
		{"failing, values kept", failing, 100,
			[]string{"leading values from http://mon:8090: failing since 12:00:00 (showing those read 1.5s ago): api:\nmonitor unreachable at http://mon:8090: dial tcp: connection refused \\x1b[2J",
				"  2       busy:queue_delay!         12.3s  80tok/s    1.50/s"},
			nil},
		{"failing too long", gone, 100,
			[]string{"leading values from http://mon:8090: failing since 12:00:00 (shown as –): timeout", "  2       busy:queue_delay!         –      –        –"},
			nil},
		{"narrow", ok, 30,
			[]string{"  worker  state              …", "  2       busy:queue_delay!  …"},
			nil},
		{"very narrow", ok, 9,
			[]string{"  worker", "  2     …"},
			nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			lines := Render(cfg, []*Record{r}, tc.loads, now, tc.cols)
			text := strings.Join(lines, "\n")
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("screen lacks %q:\n%s", w, text)
				}
			}
			for _, w := range tc.notWant {
				if strings.Contains(text, w) {
					t.Errorf("screen shows %q:\n%s", w, text)
				}
			}
			for _, l := range lines {
				if strings.Contains(l, "admitting") || strings.HasPrefix(l, "  thresholds") {
					continue // the model's head lines are not cut, as before the leading values
				}
				if n := utf8.RuneCountInString(l); n > tc.cols {
					t.Errorf("line of %d columns, wider than %d: %q", n, tc.cols, l)
				}
				if strings.ContainsAny(l, "\x1b\n") {
					t.Errorf("raw control characters: %q", l)
				}
			}
		})
	}

	colour := cfg
	colour.Color = true
	text := strings.Join(Render(colour, []*Record{r}, ok, now, 100), "\n")
	for _, want := range []string{escHard + "busy:queue_delay!" + escReset, escGreen + "free" + escReset, escDim + "  worker"} {
		if !strings.Contains(text, want) {
			t.Errorf("screen lacks %q:\n%q", want, text)
		}
	}
}

// fakeLoads answers the poller's readings with what the test scripted.
type fakeLoads struct {
	mu    sync.Mutex
	rows  []monitor.LoadRow
	err   error
	block bool // wait for the reading's context to end
	calls int
}

func (f *fakeLoads) set(rows []monitor.LoadRow, err error, block bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rows, f.err, f.block = rows, err, block
}

func (f *fakeLoads) read(ctx context.Context, model string) ([]monitor.LoadRow, error) {
	f.mu.Lock()
	rows, err, block := f.rows, f.err, f.block
	f.calls++
	f.mu.Unlock()
	if block {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return rows, err
}

// TestPoller runs the poller on a fake clock: it reads at once and every
// interval; a reading that hangs ends at the timeout; failures are logged
// once when they begin and the recovery once, however many readings fail;
// the values of the last good reading stay until they are older than
// stale-after; it stops with its context.
func TestPoller(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeLoads{}
		delay := 250.0
		f.set([]monitor.LoadRow{{Model: "m", WorkerID: 1, QueueDelayMs: &delay}}, nil, false)
		var logs bytes.Buffer // written on the poller's goroutine, read once it waits
		cfg := DefaultConfig()
		cfg.Loads, cfg.LoadsFrom, cfg.Model, cfg.Now = f.read, "http://mon", "m", time.Now
		cfg.LoadsEvery, cfg.LoadsTimeout, cfg.StaleAfter = time.Second, 500*time.Millisecond, 3*time.Second
		changed := make(chan struct{}, 1)
		p := newPoller(cfg, slog.New(slog.NewTextHandler(&logs, nil)), changed)
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan struct{})
		go func() {
			defer close(done)
			p.run(ctx)
		}()
		start := time.Now()
		synctest.Wait()
		l := p.cur.Load()
		if got := FormatDelay(l.worker("m", 1).QueueDelayMs); got != "250ms" || !l.At.Equal(start) || l.Err != "" {
			t.Fatalf("after the first reading: %s at %v err %q", got, l.At, l.Err)
		}
		select {
		case <-changed:
		default:
			t.Fatal("a reading does not ask for a redraw")
		}

		// The monitor hangs: each reading ends at the timeout; the values
		// stay while younger than stale-after (3s), then are dropped.
		f.set(nil, nil, true)
		time.Sleep(time.Second) // the next tick
		synctest.Wait()
		time.Sleep(cfg.LoadsTimeout)
		synctest.Wait()
		l = p.cur.Load()
		if !strings.Contains(l.Err, "deadline exceeded") ||
			!l.FailingSince.Equal(start.Add(1500*time.Millisecond)) || l.Workers == nil {
			t.Fatalf("after a reading timed out: %+v", l)
		}
		f.set(nil, errors.New("api: monitor answered 500: \x1b[2Jboom"), false)
		time.Sleep(4 * time.Second) // four more failed readings, the last past stale-after
		synctest.Wait()
		l = p.cur.Load()
		if l.Workers != nil || l.Err != `api: monitor answered 500: \x1b[2Jboom` || !l.FailingSince.Equal(start.Add(1500*time.Millisecond)) {
			t.Fatalf("after failing past stale-after: %+v", l)
		}
		if got := strings.Count(logs.String(), "cannot read the monitor's loads"); got != 1 {
			t.Fatalf("%d failure logs for one spell of failures, want 1:\n%s", got, logs.String())
		}

		f.set([]monitor.LoadRow{{Model: "m", WorkerID: 1}}, nil, false)
		time.Sleep(time.Second)
		synctest.Wait()
		l = p.cur.Load()
		if l.Err != "" || l.Workers == nil || l.worker("m", 1).QueueDelayMs != nil {
			t.Fatalf("after the recovery: %+v", l)
		}
		if got := strings.Count(logs.String(), "reading the monitor's loads again"); got != 1 {
			t.Fatalf("%d recovery logs, want 1:\n%s", got, logs.String())
		}
		f.mu.Lock()
		calls := f.calls
		f.mu.Unlock()
		if calls != 7 {
			t.Errorf("%d readings in 6.5s at one a second, want 7", calls)
		}
		cancel()
		<-done // the bubble's end would report a poller left running
	})
}

// TestRunScreenLoads runs the watch on a screen against a real bucket and a
// fake monitor: the worker's leading values are drawn, and the watch ends,
// its reader with it, when its context ends.
func TestRunScreenLoads(t *testing.T) {
	t.Parallel()
	js, kv := busyBucket(t)
	r := events.BusySet{Model: "m", Free: []uint64{3}, UpdatedAt: time.Now().UnixNano()}
	data, err := events.MarshalBusySet(&r)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(t.Context(), "m", data); err != nil {
		t.Fatal(err)
	}
	f := &fakeLoads{}
	f.set([]monitor.LoadRow{{Model: "m", WorkerID: 3, QueueDelayMs: events.Ptr(420.0), PrefillRate: events.Ptr(900.0)}}, nil, false)
	out := &syncbuf.Buffer{}
	cfg := DefaultConfig()
	cfg.JetStream, cfg.Out, cfg.Mode = js, out, Screen
	cfg.Loads, cfg.LoadsFrom = f.read, "http://mon:8090"
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	natstest.WaitFor(t, 10*time.Second, "the worker's leading values drawn", func() bool {
		return strings.Contains(out.String(), fmt.Sprintf("  3       free   420ms  900tok/s  %s", Unknown))
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
