package watch

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/syncbuf"
)

var t0 = time.Date(2026, 11, 10, 12, 0, 0, 123_000_000, time.UTC)

func rec(model string, busy, free, stale []uint64, reasons map[string]string) *Record {
	return &Record{BusySet: events.BusySet{Model: model, Busy: busy, Free: free, Stale: stale,
		AllBusy: len(free) == 0 && len(busy) > 0, Reasons: reasons,
		Thresholds: events.Thresholds{ActiveDecodeBlocks: events.Ptr(0.8), ActivePrefillTokens: events.Ptr[uint64](2048)}},
		Received: t0}
}

func TestFormatLine(t *testing.T) {
	t.Parallel()
	r := rec("Qwen/Qwen3-0.6B", []uint64{11, 14}, []uint64{12, 13}, []uint64{}, map[string]string{"11": "kv", "14": "cordoned"})
	r.Amber, r.Hard, r.Saturation = []uint64{12}, []uint64{11}, 0.74
	for _, tc := range []struct {
		name string
		c    Change
		want string
	}{
		{"record", Change{Model: r.Model, Record: r, At: t0},
			"2026-11-10T12:00:00.123Z model=Qwen/Qwen3-0.6B all_busy=false busy=[11 14] free=[12 13] stale=[] amber=[12] hard=[11] reasons=[11:kv 14:cordoned] thresholds=[kv>0.8 prefill>2048] saturation=0.74"},
		{"all busy, no thresholds", Change{Model: "m", At: t0, Record: &Record{BusySet: events.BusySet{
			Model: "m", Busy: []uint64{1}, AllBusy: true}}},
			"2026-11-10T12:00:00.123Z model=m all_busy=true busy=[1] free=[] stale=[] amber=[] hard=[] reasons=[1:?] thresholds=[none] saturation=0.00"},
		{"leading thresholds", Change{Model: "m", At: t0, Record: &Record{BusySet: events.BusySet{
			Model: "m", Busy: []uint64{1}, AllBusy: true, Reasons: map[string]string{"1": "kv_committed+queue_delay"}, Saturation: 1.234,
			Thresholds: events.Thresholds{KVCommitted: events.Ptr(1.5), QueueDelayMs: events.Ptr[uint64](500)}}}},
			"2026-11-10T12:00:00.123Z model=m all_busy=true busy=[1] free=[] stale=[] amber=[] hard=[] reasons=[1:kv_committed+queue_delay] thresholds=[committed>1.5×kv delay>500ms] saturation=1.23"},
		{"deleted", Change{Model: "m", At: t0}, "2026-11-10T12:00:00.123Z model=m deleted"},
		{"quoted name", Change{Model: `a b="c"`, At: t0}, `2026-11-10T12:00:00.123Z model="a b=\"c\"" deleted`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := FormatLine(tc.c); got != tc.want {
				t.Fatalf("line\n%s\nwant\n%s", got, tc.want)
			}
		})
	}
}

func TestRender(t *testing.T) {
	t.Parallel()
	many := make([]uint64, 200)
	for i := range many {
		many[i] = uint64(1000 + i)
	}
	a := rec("a", []uint64{1, 2, 3}, []uint64{4, 5}, []uint64{6}, map[string]string{"1": "kv", "2": "prefill", "3": "cordoned"})
	a.Amber, a.Hard, a.MonitorID, a.Epoch, a.Saturation = []uint64{5}, []uint64{2}, "mon-1", 3, 1.25
	b := rec("b", nil, many, nil, nil)
	old := rec("old", []uint64{7}, nil, nil, map[string]string{"7": "kv"})
	old.Received = t0.Add(-time.Minute)
	cfg := DefaultConfig()
	cfg.Header = "nats://x"
	const cols = 60
	lines := Render(cfg, []*Record{a, b, old}, nil, t0.Add(1500*time.Millisecond), cols)
	text := strings.Join(lines, "\n")
	for _, want := range []string{
		"workermon watch  12:00:01  workermon-busy  nats://x  (Ctrl-…", // clipped to the width
		"a   admitting   busy 3  free 2  stale 1  amber 1  hard 1  saturation 1.25",
		"updated 1.5s ago by mon-1, epoch 3",
		"  busy   1:kv 2:prefill! 3:cordoned",
		"  free   4 5~",
		"  stale  6",
		"thresholds kv>0.8  prefill>2048",
		"old  STALE RECORD (routers admit)",
		"  free   1000 1001",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("screen lacks %q:\n%s", want, text)
		}
	}
	if strings.Contains(text, "\x1b") {
		t.Errorf("escapes without colour:\n%q", text)
	}
	freeLines := 0
	for _, l := range lines {
		if strings.HasPrefix(l, "  free   10") || strings.HasPrefix(l, "         1") {
			freeLines++
			if len(l) > cols {
				t.Errorf("line of %d columns, wider than %d: %q", len(l), cols, l)
			}
		}
	}
	if freeLines < 200*5/cols {
		t.Errorf("200 free workers on %d lines of %d columns", freeLines, cols)
	}

	cfg.Color = true
	if text := strings.Join(Render(cfg, []*Record{a}, nil, t0, cols), "\n"); !strings.Contains(text, escRed+"1:kv"+escReset) {
		t.Errorf("busy worker not red:\n%q", text)
	}
	if got := strings.Join(Render(cfg, nil, nil, t0, cols), "\n"); !strings.Contains(got, "loading") {
		t.Errorf("before the initial values: %q", got)
	}
}

// entry is a KV entry for the sink.
type entry struct {
	key   string
	value []byte
	rev   uint64
	op    jetstream.KeyValueOp
}

func (e entry) Bucket() string                  { return events.BusyBucket }
func (e entry) Key() string                     { return e.key }
func (e entry) Value() []byte                   { return e.value }
func (e entry) Revision() uint64                { return e.rev }
func (e entry) Created() time.Time              { return time.Time{} }
func (e entry) Delta() uint64                   { return 0 }
func (e entry) Operation() jetstream.KeyValueOp { return e.op }

func put(t *testing.T, r events.BusySet) entry {
	t.Helper()
	data, err := events.MarshalBusySet(&r)
	if err != nil {
		t.Fatal(err)
	}
	return entry{key: events.ModelKey(r.Model), value: data, op: jetstream.KeyValuePut}
}

// TestSinkChanges: a publish reports the records whose content changed,
// not heartbeat re-puts, and deletions.
func TestSinkChanges(t *testing.T) {
	t.Parallel()
	var got []string
	s := &sink{changed: make(chan struct{}, 1), onChange: func(cs []Change) {
		for _, c := range cs {
			line := c.Model + " deleted"
			if c.Record != nil {
				_, line, _ = strings.Cut(FormatLine(c), " ")
			}
			got = append(got, line)
		}
	}}
	a := events.BusySet{V: 1, Model: "a", Free: []uint64{1}, Seq: 1}
	step := func(want []string, entries ...entry) {
		t.Helper()
		got = nil
		for _, e := range entries {
			_ = s.Apply(e, t0)
		}
		s.Publish()
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Fatalf("changes\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
	s.Reset()
	step([]string{"model=a all_busy=false busy=[] free=[1] stale=[] amber=[] hard=[] reasons=[] thresholds=[none] saturation=0.00"}, put(t, a))
	a.Seq, a.UpdatedAt = 2, 99 // a heartbeat
	step(nil, put(t, a))
	a.Seq, a.Saturation = 3, 0.5 // a heartbeat carrying a new saturation: not a change of content
	step(nil, put(t, a))
	b := events.BusySet{Model: "b", Busy: []uint64{2}, AllBusy: true, Reasons: map[string]string{"2": "kv"}}
	a.Free, a.Stale = nil, []uint64{1}
	step([]string{
		"model=a all_busy=false busy=[] free=[] stale=[1] amber=[] hard=[] reasons=[] thresholds=[none] saturation=0.50",
		"model=b all_busy=true busy=[2] free=[] stale=[] amber=[] hard=[] reasons=[2:kv] thresholds=[none] saturation=0.00",
	}, put(t, a), put(t, b))
	step([]string{"a deleted"}, entry{key: "a", op: jetstream.KeyValueDelete})
	step([]string{"b deleted"}, entry{key: "b", value: []byte{0xc1}, op: jetstream.KeyValuePut}) // unreadable
	step(nil, entry{key: "c", op: jetstream.KeyValuePurge})                                      // nothing to delete

	filtered := &sink{model: "a", changed: make(chan struct{}, 1)}
	filtered.Reset()
	_ = filtered.Apply(put(t, b), t0)
	_ = filtered.Apply(put(t, events.BusySet{Model: "a"}), t0)
	filtered.Publish()
	if recs := filtered.records(); len(recs) != 1 || recs[0].Model != "a" {
		t.Fatalf("--model a keeps %v", recs)
	}
}

// busyBucket starts a server and returns a JetStream on it and its busy
// bucket, empty.
func busyBucket(t *testing.T) (jetstream.JetStream, jetstream.KeyValue) {
	t.Helper()
	srv := natstest.Start(t, nil)
	js, err := jetstream.New(natstest.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: events.BusyBucket})
	if err != nil {
		t.Fatal(err)
	}
	return js, kv
}

// TestRunScreen redraws a record written to a real bucket, and restores
// the terminal when it ends.
func TestRunScreen(t *testing.T) {
	t.Parallel()
	js, kv := busyBucket(t)
	out := &syncbuf.Buffer{}
	cfg := DefaultConfig()
	cfg.JetStream, cfg.Out, cfg.Mode, cfg.Color = js, out, Screen, true
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	natstest.WaitFor(t, 10*time.Second, "the empty bucket shown", func() bool {
		return strings.Contains(out.String(), "no record")
	})
	r := events.BusySet{Model: "m", Busy: []uint64{3}, AllBusy: true, Reasons: map[string]string{"3": "prefill"}, UpdatedAt: time.Now().UnixNano()}
	data, err := events.MarshalBusySet(&r)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(t.Context(), "m", data); err != nil {
		t.Fatal(err)
	}
	natstest.WaitFor(t, 10*time.Second, "the record drawn", func() bool {
		return strings.Contains(out.String(), "ALL BUSY") && strings.Contains(out.String(), "3:prefill")
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s := out.String()
	if !strings.HasPrefix(s, escAltOn) || !strings.HasSuffix(s, escAltOff) {
		t.Fatalf("screen not entered and restored: %.40q … %q", s, s[max(0, len(s)-40):])
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	c := Config{Mode: 7, Model: "", Redraw: 0, StaleAfter: -1}
	err := c.Validate()
	if !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("%v does not match ErrInvalidConfig", err)
	}
	for _, want := range []string{"JetStream is nil", "output is nil", "mode 7", "redraw interval 0s", "stale-after -1ns", "loads interval 0s", "loads timeout 0s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}
	c = DefaultConfig()
	c.Out, c.Model = &syncbuf.Buffer{}, strings.Repeat("x", 300)
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "model") {
		t.Errorf("a 300-byte model name: %v", err)
	}
}

// TestControlCharactersFromRecord: a record's reasons and monitor id come
// from the bucket as anybody wrote them; printed raw, a reason with a
// newline faked a whole line of the Lines output, and one with ESC painted
// or cleared the terminal. They are quoted as model names are.
func TestControlCharactersFromRecord(t *testing.T) {
	t.Parallel()
	evil := "kv\n2026-11-10T12:00:00.000Z model=other all_busy=true\x1b[2J"
	r := rec("m", []uint64{1}, []uint64{2}, nil, map[string]string{"1": evil})
	r.MonitorID = "mon\x1b]0;pwned\x07"
	line := FormatLine(Change{Model: "m", Record: r, At: t0})
	if strings.ContainsAny(line, "\n\x1b\x07") {
		t.Errorf("Lines output carries raw control characters from the record: %q", line)
	}
	for _, l := range Render(Config{}, []*Record{r}, nil, t0, 100) {
		if strings.ContainsAny(l, "\n\x1b\x07") {
			t.Errorf("Screen line carries raw control characters from the record: %q", l)
		}
	}
}
