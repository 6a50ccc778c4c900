package main

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/workermon/workermon/internal/hostcpu"
	"github.com/workermon/workermon/scrape"
)

// Growth follows the heap and goroutines of each monitor, router and
// engine process (contract §20: none may exceed 1.5× its value after the first
// minute). A process is a service's container between two starts. Its
// baseline is the highest sample of its second minute (the heap is a saw
// tooth between collections: the highest sample is its top); a sample
// above 1.5× the baseline counts only when the next growthSustain samples
// stay above it too, so that a collection that comes late does not count
// and a leak does.
type Growth struct {
	mu    sync.Mutex
	procs map[string]*proc // service/generation → process
	out   []Violation
}

const (
	growthFactor   = 1.5
	growthFirst    = time.Minute      // a process's first minute: no baseline yet
	growthBaseline = 30 * time.Second // then the baseline's window
	growthSustain  = 3                // samples (every 5 s) above the limit in a row
)

type proc struct {
	name    string
	started time.Time
	base    map[string]float64 // metric → baseline
	above   map[string]int     // metric → samples in a row above the limit
	max     map[string]float64 // metric → highest sample after the baseline
	flagged map[string]bool
	missed  int // scrapes that failed
}

// The metrics followed, from the Go collector of every workermon process.
var growthMetrics = []string{"go_memstats_heap_alloc_bytes", "go_goroutines"}

func newGrowth() *Growth { return &Growth{procs: map[string]*proc{}} }

// Sample takes the metrics of process name (the service and the number of
// its start) started at started, read at now.
func (g *Growth) Sample(name string, started, now time.Time, values map[string]float64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	p := g.proc(name, started)
	age := now.Sub(p.started)
	if age < growthFirst {
		return
	}
	for _, m := range growthMetrics {
		v, ok := values[m]
		if !ok {
			continue
		}
		if age < growthFirst+growthBaseline {
			p.base[m] = max(p.base[m], v)
			continue
		}
		base, ok := p.base[m]
		if !ok || base == 0 {
			continue
		}
		p.max[m] = max(p.max[m], v)
		if v <= growthFactor*base {
			p.above[m] = 0
			continue
		}
		p.above[m]++
		if p.above[m] >= growthSustain && !p.flagged[m] {
			p.flagged[m] = true
			g.out = append(g.out, Violation{At: now, Rule: RuleGrowth, What: fmt.Sprintf(
				"%s: %s %.0f, above %.1f × its baseline %.0f for %d samples in a row", name, m, v, growthFactor, base, p.above[m])})
		}
	}
}

// Missed notes a scrape of process name that failed (no answer, not 200,
// not a Prometheus page): the report counts them, so that a process the
// check could not read is not mistaken for one that did not grow.
func (g *Growth) Missed(name string, started time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.proc(name, started).missed++
}

func (g *Growth) proc(name string, started time.Time) *proc {
	p := g.procs[name]
	if p == nil {
		p = &proc{name: name, started: started, base: map[string]float64{}, above: map[string]int{},
			max: map[string]float64{}, flagged: map[string]bool{}}
		g.procs[name] = p
	}
	return p
}

// GrowthRow is one process's figures for the report.
type GrowthRow struct {
	Process string             `json:"process"`
	Base    map[string]float64 `json:"baseline"`
	Max     map[string]float64 `json:"max_after"`
	Missed  int                `json:"scrapes_failed"`
}

// Close returns the violations and each process's baseline and maximum.
func (g *Growth) Close() ([]Violation, []GrowthRow) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var rows []GrowthRow
	for _, name := range slices.Sorted(maps.Keys(g.procs)) {
		p := g.procs[name]
		if len(p.base) > 0 || p.missed > 0 {
			rows = append(rows, GrowthRow{Process: name, Base: maps.Clone(p.base), Max: maps.Clone(p.max), Missed: p.missed})
		}
	}
	return slices.Clone(g.out), rows
}

// scrapeGrowth reads the growth metrics of a /metrics page.
func scrapeGrowth(ctx context.Context, client *http.Client, url string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	fams, err := scrape.Parse(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", url, err)
	}
	out := map[string]float64{}
	for _, name := range growthMetrics {
		if f := fams[name]; f != nil && len(f.GetMetric()) == 1 && f.GetMetric()[0].GetGauge() != nil {
			out[name] = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return out, nil
}

// CPU samples the host's CPU use from /proc/stat, once a second.
type CPU struct {
	mu      sync.Mutex
	samples []cpuSample
}

type cpuSample struct {
	at  time.Time
	pct float64
}

// Run samples until ctx ends; it returns at once with the error when
// /proc/stat cannot be read.
func (c *CPU) Run(ctx context.Context) error {
	prev, err := hostcpu.Read()
	if err != nil {
		return err
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-t.C:
			cur, err := hostcpu.Read()
			if err != nil || cur.Total == prev.Total {
				continue
			}
			c.mu.Lock()
			c.samples = append(c.samples, cpuSample{at: now, pct: prev.BusyPct(cur)})
			c.mu.Unlock()
			prev = cur
		}
	}
}

// Around returns the mean and the lowest of the CPU samples between from
// and to, and whether any sample fell in it.
func (c *CPU) Around(from, to time.Time) (mean, lowest float64, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var sum float64
	var n int
	for _, s := range c.samples {
		if !s.at.Before(from) && !s.at.After(to) {
			if n == 0 || s.pct < lowest {
				lowest = s.pct
			}
			sum += s.pct
			n++
		}
	}
	if n == 0 {
		return 0, 0, false
	}
	return sum / float64(n), lowest, true
}
