// Package hostcpu reads the host's CPU time from /proc/stat, so that a
// measurement can say how busy the machine was while it ran.
package hostcpu

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Sample is the host's CPU time so far, in clock ticks of all its cores.
type Sample struct {
	// Busy is every tick but idle and iowait; Total every tick.
	Busy, Total uint64
}

// Read reads the host's CPU time. It fails where /proc/stat is missing
// (not Linux) or unreadable.
func Read() (Sample, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return Sample{}, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return parse(line)
}

// parse reads the aggregate "cpu" line of /proc/stat.
func parse(line string) (Sample, error) {
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		return Sample{}, fmt.Errorf("hostcpu: /proc/stat begins %.64q, not the cpu line", line)
	}
	var s Sample
	for i, f := range fields[1:] {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			return Sample{}, errors.Join(errors.New("hostcpu: /proc/stat"), err)
		}
		switch i {
		case 8, 9: // guest, guest_nice: counted in user and nice already (proc(5))
			continue
		case 3, 4: // idle, iowait
		default:
			s.Busy += v
		}
		s.Total += v
	}
	return s, nil
}

// BusyPct is the host's CPU use from s to t in % of all its cores; 0 when
// no tick passed between them.
func (s Sample) BusyPct(t Sample) float64 {
	if t.Total <= s.Total || t.Busy < s.Busy {
		return 0
	}
	return 100 * float64(t.Busy-s.Busy) / float64(t.Total-s.Total)
}
