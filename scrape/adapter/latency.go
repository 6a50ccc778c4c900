package adapter

import (
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
)

// DefaultLatencyWindow is Config.LatencyWindow by default.
const DefaultLatencyWindow = time.Second

// latencyState is what the loop keeps between two latency windows.
type latencyState struct {
	ttft, itl *scrape.Histogram // at the start of the window
	since     time.Time         // zero before the first good scrape
	enc       *events.Encoder
}

// latency publishes the engine's latency window (contract §18) once a
// window has passed since the last one: the samples its TTFT and ITL
// histograms gained, as an engine's report on the lat subject. A window
// without samples is not sent.
func (a *Adapter) latency(r result, now time.Time) {
	st := &a.lat
	if a.cfg.LatencyWindow <= 0 || r.ttft == nil && r.itl == nil {
		return
	}
	if st.since.IsZero() {
		st.ttft, st.itl, st.since = r.ttft, r.itl, now
		return
	}
	if now.Sub(st.since) < a.cfg.LatencyWindow {
		return
	}
	rep := events.LatencyReport{
		Model: a.cfg.Model, WorkerID: a.cfg.WorkerID, Source: events.SourceEngine,
		WindowMs: uint64(max(now.Sub(st.since).Milliseconds(), 1)),
		TTFT:     scrape.Window(st.ttft, r.ttft), ITL: scrape.Window(st.itl, r.itl), SentAt: now.UnixNano(),
	}
	st.ttft, st.itl, st.since = r.ttft, r.itl, now
	if len(rep.TTFT) == 0 && len(rep.ITL) == 0 {
		return
	}
	if !a.cfg.Conn.IsConnected() {
		// Not into the reconnect buffer: a reconnect would deliver the
		// outage's windows as a burst, each for an interval long past
		// (the monitors drop those older than --stale-after, but not the
		// rest). The connection keeps its buffer for the load reports,
		// whose seq and boot_id order them. The window's samples are
		// dropped with it.
		return
	}
	if st.enc == nil {
		st.enc = events.NewEncoder()
	}
	data, err := st.enc.LatencyReport(&rep)
	if err == nil {
		err = a.cfg.Conn.Publish(events.LatSubject(a.cfg.SubjectPrefix, a.cfg.Model, a.cfg.WorkerID), data)
	}
	if err != nil {
		a.ranks.Fail(err, "what", "latency window")
	}
}
