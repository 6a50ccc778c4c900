package main

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"time"
)

// Kind is a kind of fault (contract §20).
type Kind string

// The faults, in the order the contract lists them.
const (
	KillMonitor  Kind = "kill-monitor"  // kill -9 a monitor; started again 5 s later
	PauseMonitor Kind = "pause-monitor" // SIGSTOP a monitor for 5–20 s, then SIGCONT
	RestartNATS  Kind = "restart-nats"  // stop a NATS node; started again 5 s later
	CutMonitor   Kind = "cut-monitor"   // a monitor's network cut for 10 s
	KillRouter   Kind = "kill-router"   // kill -9 a router; started again 5 s later
	KillEngine   Kind = "kill-engine"   // kill -9 an engine; started again 5 s later
)

// Kinds lists every kind of fault.
var Kinds = []Kind{KillMonitor, PauseMonitor, RestartNATS, CutMonitor, KillRouter, KillEngine}

// Topology is what the faults can hit: the services of deploy/chaos/compose.yml.
type Topology struct {
	NATS, Monitors, Routers, Engines []string
}

// targets returns the services a kind of fault may hit.
func (t Topology) targets(k Kind) []string {
	switch k {
	case RestartNATS:
		return t.NATS
	case KillRouter:
		return t.Routers
	case KillEngine:
		return t.Engines
	}
	return t.Monitors
}

// Fault is one planned fault: Gap after the previous fault healed (and its
// recovery was judged), Kind hits Target for Down (the time between the
// fault and its healing: the restart 5 s later, the SIGCONT, the network
// back).
type Fault struct {
	N      int           `json:"n"`
	Kind   Kind          `json:"kind"`
	Target string        `json:"target"`
	Gap    time.Duration `json:"gap_ns"`
	Down   time.Duration `json:"down_ns"`
}

func (f Fault) String() string {
	return fmt.Sprintf("#%d +%v %s %s for %v", f.N, f.Gap, f.Kind, f.Target, f.Down)
}

// restartAfter is how long something killed stays down (contract §20).
const restartAfter = 5 * time.Second

// cutFor is how long a monitor's network stays cut.
const cutFor = 10 * time.Second

// shortRun is the length below which a run injects each kind once, 10–20 s
// apart, in seeded order.
const shortRun = 5 * time.Minute

// Schedule draws the faults of a run of the given length from seed alone:
// the same seed, length and topology give the same faults. A run shorter
// than shortRun gets each kind once in a seeded order, 10–20 s apart;
// a longer one a kind drawn at random every 15–45 s, as many as their gaps
// and downtimes fit in the run (the recovery checks may stretch a run: the
// next fault waits until the previous one's recovery is judged).
func Schedule(seed uint64, length time.Duration, topo Topology) []Fault {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	between := func(lo, hi time.Duration) time.Duration {
		// whole tenths of a second, so that the printed schedule reads well
		steps := int64((hi - lo) / (100 * time.Millisecond))
		return lo + time.Duration(rng.Int64N(steps+1))*100*time.Millisecond
	}
	fault := func(n int, k Kind, gap time.Duration) Fault {
		targets := topo.targets(k)
		f := Fault{N: n, Kind: k, Target: targets[rng.IntN(len(targets))], Gap: gap}
		switch k {
		case PauseMonitor:
			f.Down = between(5*time.Second, 20*time.Second)
		case CutMonitor:
			f.Down = cutFor
		default:
			f.Down = restartAfter
		}
		return f
	}
	var out []Fault
	if length < shortRun {
		order := append([]Kind(nil), Kinds...)
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for i, k := range order {
			out = append(out, fault(i+1, k, between(10*time.Second, 20*time.Second)))
		}
		return out
	}
	var at time.Duration
	for n := 1; ; n++ {
		f := fault(n, Kinds[rng.IntN(len(Kinds))], between(15*time.Second, 45*time.Second))
		at += f.Gap + f.Down
		if at > length {
			return out
		}
		out = append(out, f)
	}
}

// scheduleString prints a schedule, one fault a line.
func scheduleString(faults []Fault) string {
	var b strings.Builder
	for _, f := range faults {
		fmt.Fprintf(&b, "  %s\n", f)
	}
	return b.String()
}
