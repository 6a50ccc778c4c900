package board

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/workermon/workermon/admission"
)

// The board's history: what the strip of each model's card draws, kept by
// the server so that a page opened during a peak shows the minutes before
// it. The board's sampler goroutine reads the source every
// Config.HistoryInterval, whether or not anyone watches, and keeps the last
// Config.HistoryLen points in a ring; GET /board/history serves them.
//
// Memory is bounded: HistoryLen points of at most HistoryModels models
// each, about 100 bytes a model and point (the model's name is shared with
// the point before when it did not change): with the defaults, 300 points of
// up to 64 models, under 2 MB.

// Defaults of the history's Config fields.
const (
	// DefaultHistoryInterval is how often the sampler reads the source.
	DefaultHistoryInterval = 2 * time.Second
	// DefaultHistoryLen is how many points the history keeps: with
	// DefaultHistoryInterval, the last 10 minutes.
	DefaultHistoryLen = 300
	// DefaultHistoryModels bounds the models of one point: the first ones
	// in the snapshot's order (by name).
	DefaultHistoryModels = 64
)

// maxHistoryLen bounds Config.HistoryLen (a day at one point a second).
const maxHistoryLen = 86_400

// History is the answer of GET /board/history.
type History struct {
	// IntervalMS is Config.HistoryInterval and Len Config.HistoryLen: the
	// history covers up to IntervalMS × Len milliseconds (more when reads
	// were slow).
	IntervalMS int64 `json:"interval_ms"`
	Len        int   `json:"len"`
	// Now is the server's clock when it answered, in Unix milliseconds: a
	// page places the points against its own clock with Now.
	Now int64 `json:"now"`
	// Points, oldest first.
	Points []HistoryPoint `json:"points"`
}

// HistoryPoint is one read of the source.
type HistoryPoint struct {
	// At is when the source was read, in Unix milliseconds.
	At int64 `json:"t"`
	// Admitted and Shed are the router's admission counters, summed over
	// the models (nil when the source has no router counts): Admitted the
	// outcomes that let a request through (admitted, stale_open,
	// unknown_model), Shed the sheddable requests shed.
	Admitted *uint64 `json:"admitted,omitempty"`
	Shed     *uint64 `json:"shed,omitempty"`
	// Models, in the snapshot's order, at most Config.HistoryModels.
	Models []HistoryModel `json:"models"`
}

// HistoryModel is one model in a HistoryPoint.
type HistoryModel struct {
	Name string `json:"name"`
	// Busy counts the model's busy workers, Workers all its workers.
	Busy    int `json:"busy"`
	Workers int `json:"workers"`
	// Rejected and Queued are the model's Snapshot fields: the requests
	// turned away since the router started, and those waiting in its queue;
	// nil when the source has none.
	Rejected *uint64 `json:"rejected,omitempty"`
	Queued   *uint64 `json:"queued,omitempty"`
}

// admittedOutcomes are the admission outcomes a HistoryPoint counts as
// admitted; the page sums the same ones from a snapshot's admissions.
var admittedOutcomes = []string{admission.OutcomeAdmitted, admission.OutcomeStaleOpen, admission.OutcomeUnknownModel}

// historyPoint reduces a snapshot read at at to a point of at most
// maxModels models.
func historyPoint(snap Snapshot, at time.Time, maxModels int) HistoryPoint {
	p := HistoryPoint{At: at.UnixMilli()}
	if snap.Admissions != nil {
		var adm uint64
		for _, o := range admittedOutcomes {
			adm += snap.Admissions[o]
		}
		shed := snap.Admissions[admission.OutcomeShed]
		p.Admitted, p.Shed = &adm, &shed
	}
	models := snap.Models[:min(len(snap.Models), maxModels)]
	p.Models = make([]HistoryModel, len(models))
	for i, m := range models {
		p.Models[i] = HistoryModel{Name: m.Name, Busy: m.Counts.Busy, Workers: len(m.Workers),
			Rejected: m.Rejected, Queued: m.Queued}
	}
	return p
}

// historyRing keeps the last points added, oldest dropped: a fixed array
// of its capacity, allocated once. Not safe for concurrent use.
type historyRing struct {
	buf   []HistoryPoint
	start int // index of the oldest point
	n     int // points held
}

func newHistoryRing(capacity int) *historyRing {
	return &historyRing{buf: make([]HistoryPoint, capacity)}
}

// add appends p, dropping the oldest point when the ring is full. A model
// name equal to one of the newest point's takes that point's string, so
// that a name is held once however many points carry it. p's slices must
// not be modified afterwards.
func (r *historyRing) add(p HistoryPoint) {
	if len(r.buf) == 0 {
		return
	}
	if r.n > 0 {
		prev := r.buf[(r.start+r.n-1)%len(r.buf)].Models
		for i := range p.Models {
			// Models are sorted alike from one point to the next: look at
			// the same index first.
			if i < len(prev) && prev[i].Name == p.Models[i].Name {
				p.Models[i].Name = prev[i].Name
				continue
			}
			for j := range prev {
				if prev[j].Name == p.Models[i].Name {
					p.Models[i].Name = prev[j].Name
					break
				}
			}
		}
	}
	if r.n < len(r.buf) {
		r.buf[(r.start+r.n)%len(r.buf)] = p
		r.n++
		return
	}
	r.buf[r.start] = p
	r.start = (r.start + 1) % len(r.buf)
}

// points returns the points held, oldest first. The slice is new; the
// points share their Models with the ring, which never modifies them.
func (r *historyRing) points() []HistoryPoint {
	out := make([]HistoryPoint, 0, r.n)
	for i := range r.n {
		out = append(out, r.buf[(r.start+i)%len(r.buf)])
	}
	return out
}

// sample is the board's sampler goroutine: it reads the source every
// HistoryInterval (less often when reads are slow, see readShare), at once
// first, and adds a point to the history for each read that succeeded.
func (b *Board) sample(ctx context.Context) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		start := time.Now()
		rctx, cancel := context.WithTimeout(ctx, b.cfg.ReadTimeout)
		snap, err := b.cfg.Source.Snapshot(rctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			// A gap in the history; the publisher logs the source's errors
			// when someone watches.
			b.metrics.readErrors.Inc()
		} else {
			p := historyPoint(snap, start, b.cfg.HistoryModels)
			b.histMu.Lock()
			b.hist.add(p)
			b.histMu.Unlock()
		}
		timer.Reset(max(b.cfg.HistoryInterval, readShare*time.Since(start)))
	}
}

// history returns the history as GET /board/history answers it.
func (b *Board) history() History {
	h := History{IntervalMS: b.cfg.HistoryInterval.Milliseconds(), Len: b.cfg.HistoryLen}
	b.histMu.Lock()
	if b.hist != nil {
		h.Points = b.hist.points()
	}
	b.histMu.Unlock()
	if h.Points == nil {
		h.Points = []HistoryPoint{}
	}
	h.Now = time.Now().UnixMilli()
	return h
}

// serveHistory answers the history as JSON.
func (b *Board) serveHistory(w http.ResponseWriter, _ *http.Request) {
	data, err := json.Marshal(b.history())
	if err != nil {
		writeError(w, http.StatusInternalServerError, "board: encode the history: "+err.Error())
		return
	}
	writeJSON(w, data)
}
