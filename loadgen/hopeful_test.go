package loadgen

import (
	"testing"
	"time"
)

// TestHopeful: a request in flight counts as hopeful until it can no longer
// be good: no first token within the TTFT target, or past the time its
// TPOT allows at its max_tokens.
func TestHopeful(t *testing.T) {
	t.Parallel()
	slo := SLO{TTFT: time.Second, ITL: 50 * time.Millisecond}
	start := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return start.Add(d) }
	var fs flights

	streamed := Config{Stream: true, SLO: slo}
	waiting := fs.add(streamed, start, 11)
	if n := fs.hopeful(at(999 * time.Millisecond)); n != 1 {
		t.Errorf("before the TTFT target: %d hopeful, want 1", n)
	}
	if n := fs.hopeful(at(1001 * time.Millisecond)); n != 0 {
		t.Errorf("past the TTFT target without a first token: %d hopeful, want 0", n)
	}
	// A first token at 200 ms: good while e2e ≤ 200 ms + 50 ms × 10.
	waiting.firstToken(slo, start, at(200*time.Millisecond), 11)
	if n := fs.hopeful(at(1001 * time.Millisecond)); n != 0 {
		t.Errorf("past TTFT + ITL × 10: %d hopeful, want 0", n)
	}
	if n := fs.hopeful(at(699 * time.Millisecond)); n != 1 {
		t.Errorf("within TTFT + ITL × 10: %d hopeful, want 1", n)
	}
	late := fs.add(streamed, start, 11)
	late.firstToken(slo, start, at(1200*time.Millisecond), 11)
	if n := fs.hopeful(at(699 * time.Millisecond)); n != 1 {
		t.Errorf("a first token after the target: %d hopeful, want 1 (the other)", n)
	}
	fs.remove(waiting)
	fs.remove(late)

	plain := fs.add(Config{SLO: slo}, start, 11) // not streamed: e2e ≤ 1 s + 50 ms × 10
	if fs.hopeful(at(1499*time.Millisecond)) != 1 || fs.hopeful(at(1501*time.Millisecond)) != 0 {
		t.Error("a request not streamed is hopeful until TTFT + ITL × (max_tokens − 1)")
	}
	fs.remove(plain)
	fs.add(Config{Stream: true}, start, 11) // no target: always
	if n := fs.hopeful(at(time.Hour)); n != 1 {
		t.Errorf("without a target: %d hopeful, want 1", n)
	}
}
