package loadgen

import (
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/workermon/workermon/admission"
)

func TestParsePriorityMix(t *testing.T) {
	t.Parallel()
	mix, err := ParsePriorityMix("-1=0.5, 0=0.4,1=0.1")
	if err != nil || !slices.Equal(mix, []PriorityShare{{-1, 0.5}, {0, 0.4}, {1, 0.1}}) {
		t.Fatalf("mix %v, %v", mix, err)
	}
	if mix, err := ParsePriorityMix(""); mix != nil || err != nil {
		t.Errorf("empty: %v, %v", mix, err)
	}
	for _, bad := range []string{"-1", "x=1", "1=y", "1=-0.5", "1=NaN", "1=+Inf", "1=0.5,1=0.5", "0=0,1=0", "1=0.5,"} {
		if _, err := ParsePriorityMix(bad); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%q: %v, want ErrInvalidConfig", bad, err)
		}
	}
	cfg := DefaultConfig()
	cfg.PriorityMix = []PriorityShare{{1, -1}}
	if err := cfg.Validate(); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Validate with a negative share: %v", err)
	}
}

// TestChooserDeterministic: the same seed gives the same priorities, in the
// mix's shares.
func TestChooserDeterministic(t *testing.T) {
	t.Parallel()
	mix := []PriorityShare{{-1, 0.5}, {0, 0.4}, {1, 0.1}}
	seq := func(seed uint64) []int {
		c := newChooser(mix, seed)
		out := make([]int, 10000)
		for i := range out {
			out[i] = c.next()
		}
		return out
	}
	a, b, other := seq(7), seq(7), seq(8)
	if !slices.Equal(a, b) {
		t.Error("the same seed gave different priorities")
	}
	if slices.Equal(a, other) {
		t.Error("two seeds gave the same priorities")
	}
	var n [3]int
	for _, i := range a {
		n[i]++
	}
	for i, want := range []float64{0.5, 0.4, 0.1} {
		if got := float64(n[i]) / float64(len(a)); got < want-0.03 || got > want+0.03 {
			t.Errorf("priority %d: share %.3f, want %.1f", mix[i].Priority, got, want)
		}
	}
}

// classTransport answers by the request's priority header: 429 below 0,
// 503 above 0 on every other call, else a stream whose first event comes
// after 10 ms and the rest after 100 ms more. It remembers the headers.
type classTransport struct {
	headers chan string
}

// slowBody is a stream: its first event at once, the rest after a pause.
type slowBody struct {
	parts []string
}

func (b *slowBody) Read(p []byte) (int, error) {
	if len(b.parts) == 0 {
		return 0, io.EOF
	}
	if len(b.parts) == 1 {
		time.Sleep(100 * time.Millisecond)
	}
	n := copy(p, b.parts[0])
	if b.parts[0] = b.parts[0][n:]; b.parts[0] == "" {
		b.parts = b.parts[1:]
	}
	return n, nil
}

func (*slowBody) Close() error { return nil }

func (f *classTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	p, set := r.Header.Get(admission.PriorityHeader), len(r.Header.Values(admission.PriorityHeader)) > 0
	if !set {
		p = "none"
	}
	f.headers <- p
	resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Request: r}
	switch {
	case strings.HasPrefix(p, "-"):
		resp.StatusCode, resp.Body = http.StatusTooManyRequests, io.NopCloser(strings.NewReader("{}"))
	case p == "2":
		resp.StatusCode, resp.Body = http.StatusServiceUnavailable, io.NopCloser(strings.NewReader("{}"))
	default:
		time.Sleep(10 * time.Millisecond)
		all := sseAnswer(3)
		cut := strings.Index(all, "\n\n") + 2
		resp.Body = &slowBody{parts: []string{all[:cut], all[cut:]}}
	}
	return resp, nil
}

// TestPriorityMixRun: the header carries the mix's priorities, the answers
// are counted by class, TTFT is the time to the first event.
func TestPriorityMixRun(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ft := &classTransport{headers: make(chan string, 10000)}
		cfg := DefaultConfig()
		cfg.Transport, cfg.CancelFraction, cfg.RPS, cfg.Seed = ft, 0, 50, 3
		cfg.PriorityMix = []PriorityShare{{-1, 0.5}, {0, 0.3}, {2, 0.2}}
		g, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := runFor(t, g, 10*time.Second)
		checkSum(t, s.Total)
		close(ft.headers)
		seen := map[string]int{}
		for h := range ft.headers {
			seen[h]++
		}
		if len(seen) != 3 || seen["-1"] == 0 || seen["0"] == 0 || seen["2"] == 0 {
			t.Fatalf("headers sent %v", seen)
		}
		if len(s.Classes) != 3 {
			t.Fatalf("classes %+v", s.Classes)
		}
		shed, std, crit := s.Classes[0], s.Classes[1], s.Classes[2]
		if shed.Class != admission.ClassSheddable || std.Class != admission.ClassStandard || crit.Class != admission.ClassCritical {
			t.Fatalf("class order %v %v %v", shed.Class, std.Class, crit.Class)
		}
		if shed.Total.TooMany != uint64(seen["-1"]) || shed.Total.OK != 0 || shed.Statuses[429] != shed.Total.TooMany {
			t.Errorf("sheddable %+v %v", shed.Total, shed.Statuses)
		}
		if crit.Total.Unavailable != uint64(seen["2"]) || crit.Total.OK != 0 {
			t.Errorf("critical %+v", crit.Total)
		}
		if std.Total.OK != uint64(seen["0"]) || std.Total.OK+std.Total.Aborted != std.Total.Sent {
			t.Errorf("standard %+v", std.Total)
		}
		if l := std.Total.TTFT; l.Count != std.Total.OK || l.P50 != 10*time.Millisecond || l.P99 != 10*time.Millisecond {
			t.Errorf("standard TTFT %+v, want 10ms", l)
		}
		if l := std.Total.Latency; l.P50 != 110*time.Millisecond {
			t.Errorf("standard latency %+v, want 110ms", l)
		}
		if s.Total.TooMany != shed.Total.TooMany || s.Total.TTFT.Count != s.Total.OK {
			t.Errorf("total %+v", s.Total)
		}
		if w := shed.Window; w.Sent == 0 || w.TooMany == 0 {
			t.Errorf("sheddable window %+v", w)
		}
	})
}

// TestNoPriorityHeader: with NoPriorityHeader the requests carry no header
// but are counted by the class the mix gives them, in the same sequence as
// with the header.
func TestNoPriorityHeader(t *testing.T) {
	t.Parallel()
	run := func(off bool) (Stats, map[string]int) {
		var s Stats
		seen := map[string]int{}
		synctest.Test(t, func(t *testing.T) {
			ft := &classTransport{headers: make(chan string, 10000)}
			cfg := DefaultConfig()
			cfg.Transport, cfg.CancelFraction, cfg.RPS, cfg.Seed = ft, 0, 50, 11
			cfg.PriorityMix, cfg.NoPriorityHeader = []PriorityShare{{-1, 0.5}, {0, 0.5}}, off
			g, err := New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			s = runFor(t, g, 4*time.Second)
			close(ft.headers)
			for h := range ft.headers {
				seen[h]++
			}
		})
		return s, seen
	}
	on, seenOn := run(false)
	off, seenOff := run(true)
	if len(seenOff) != 1 || seenOff["none"] == 0 {
		t.Errorf("headers sent without the header: %v", seenOff)
	}
	if on.Classes[0].Total.Sent != off.Classes[0].Total.Sent || off.Classes[0].Total.Sent != uint64(seenOn["-1"]) {
		t.Errorf("sheddable sent: %d with the header, %d without, %d headers", on.Classes[0].Total.Sent, off.Classes[0].Total.Sent, seenOn["-1"])
	}
	if off.Classes[0].Total.OK != off.Classes[0].Total.Sent-off.Classes[0].Total.Aborted {
		t.Errorf("without the header the sheddable requests are standard: %+v", off.Classes[0].Total)
	}
}
