package hostcpu

import (
	"runtime"
	"testing"
)

func TestParse(t *testing.T) {
	// user nice system idle iowait irq softirq steal
	s, err := parse("cpu  100 5 45 800 50 0 0 0 0 0")
	if err != nil {
		t.Fatal(err)
	}
	if s.Busy != 150 || s.Total != 1000 {
		t.Fatalf("parse = %+v, want busy 150 of 1000", s)
	}
	later := Sample{Busy: 250, Total: 1200}
	if got := s.BusyPct(later); got != 50 {
		t.Errorf("BusyPct = %v, want 50 (100 busy of 200 ticks)", got)
	}
	if got := later.BusyPct(s); got != 0 {
		t.Errorf("BusyPct backwards = %v, want 0", got)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4", "cpu 1 2 x 4 5", "cpu 1 2"} {
		if _, err := parse(bad); err == nil {
			t.Errorf("parse(%q): no error", bad)
		}
	}
}

func TestRead(t *testing.T) {
	s, err := Read()
	if runtime.GOOS != "linux" {
		if err == nil {
			t.Fatal("Read without /proc/stat: no error")
		}
		return
	}
	if err != nil || s.Total == 0 || s.Busy > s.Total {
		t.Fatalf("Read = %+v, %v", s, err)
	}
}

// TestGuestTicksCountedOnce: guest and guest_nice (fields 9 and 10 of the
// cpu line) are counted in user and nice already; summed again, a host
// running guests read busier than it was.
func TestGuestTicksCountedOnce(t *testing.T) {
	t.Parallel()
	s0, err := parse("cpu  0 0 0 0 0 0 0 0 0 0")
	if err != nil {
		t.Fatal(err)
	}
	s1, err := parse("cpu  100 0 0 100 0 0 0 0 50 0") // user 100 (50 of it guest), idle 100
	if err != nil {
		t.Fatal(err)
	}
	if got := s0.BusyPct(s1); got != 50 {
		t.Errorf("BusyPct = %.1f %%, want 50 (Busy %d, Total %d)", got, s1.Busy, s1.Total)
	}
}
