package busylist

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
)

// Reason says why a Decision admits or rejects.
type Reason uint8

// Reasons of a Decision (contract §7).
const (
	// ReasonFree: a fresh record that is not all busy; admitted, to be routed
	// to one of Decision.Free.
	ReasonFree Reason = iota + 1
	// ReasonAllBusy: a fresh record with every worker busy; rejected.
	ReasonAllBusy
	// ReasonUnknownModel: no record for the model (the monitor does not know
	// it); admitted.
	ReasonUnknownModel
	// ReasonStale: a record with no put received within stale-list-after, or
	// an updated_at older than that by the router's clock (the monitor may be
	// gone); admitted when failing open (the default), rejected otherwise.
	ReasonStale
	// ReasonNotReady: the Watcher has not loaded the bucket's initial values
	// yet; admitted when failing open, rejected otherwise.
	ReasonNotReady
)

// String returns the reason's label: "free", "all_busy", "unknown_model",
// "stale" or "not_ready".
func (r Reason) String() string {
	switch r {
	case ReasonFree:
		return "free"
	case ReasonAllBusy:
		return "all_busy"
	case ReasonUnknownModel:
		return "unknown_model"
	case ReasonStale:
		return "stale"
	case ReasonNotReady:
		return "not_ready"
	}
	return "none"
}

// Decision is the answer to one request.
type Decision struct {
	// Admit tells whether the request goes on.
	Admit bool
	// Reason says why.
	Reason Reason
	// Free and Busy are the record's free and busy workers, ascending, for
	// ReasonFree and ReasonAllBusy; nil otherwise (no trustworthy list: any
	// worker may be chosen). They are shared with the snapshot: read only.
	// Free may be empty on an admitted request (no busy and no free worker,
	// only stale ones): a gateway then picks among the workers not in Busy.
	Free []uint64
	Busy []uint64
}

// IsBusy reports whether the record lists worker as busy.
func (d Decision) IsBusy(worker uint64) bool {
	_, ok := slices.BinarySearch(d.Busy, worker)
	return ok
}

// IsFree reports whether the record lists worker as free.
func (d Decision) IsFree(worker uint64) bool {
	_, ok := slices.BinarySearch(d.Free, worker)
	return ok
}

// Candidates appends to dst the registered workers an admitted request may
// be sent to (contract §7, for a gateway): those the record lists as free;
// when none of them is registered, those it does not list as busy (for a
// stale or unknown record, or before the Watcher is ready: every registered
// worker). A rejected decision has no candidates. registered is usually
// Registry.Endpoints(model), sorted by worker id; the order is kept. dst may
// be a reused buffer: with enough capacity nothing is allocated.
func (d Decision) Candidates(dst, registered []events.WorkerEntry) []events.WorkerEntry {
	if !d.Admit {
		return dst
	}
	n := len(dst)
	for _, e := range registered {
		if d.IsFree(e.WorkerID) {
			dst = append(dst, e)
		}
	}
	if len(dst) > n {
		return dst
	}
	for _, e := range registered {
		if !d.IsBusy(e.WorkerID) {
			dst = append(dst, e)
		}
	}
	return dst
}

// Outcome labels of workermon_router_admissions_total.
const (
	OutcomeAdmitted     = "admitted"      // ReasonFree
	OutcomeRejected     = "rejected"      // ReasonAllBusy
	OutcomeStaleOpen    = "stale_open"    // ReasonStale, admitted
	OutcomeStaleClosed  = "stale_closed"  // ReasonStale, rejected (fail closed)
	OutcomeUnknownModel = "unknown_model" // ReasonUnknownModel
	OutcomeNotReady     = "not_ready"     // ReasonNotReady, admitted or not
	OutcomeNoModel      = "no_model"      // the request named no model (Middleware)
)

// Outcome returns the decision's label in workermon_router_admissions_total.
func (d Decision) Outcome() string {
	switch d.Reason {
	case ReasonFree:
		return OutcomeAdmitted
	case ReasonAllBusy:
		return OutcomeRejected
	case ReasonStale:
		if d.Admit {
			return OutcomeStaleOpen
		}
		return OutcomeStaleClosed
	case ReasonUnknownModel:
		return OutcomeUnknownModel
	case ReasonNotReady:
		return OutcomeNotReady
	}
	return OutcomeNoModel
}

// Decide applies the router contract (§7) to one request for model:
//
//   - no snapshot yet: ReasonNotReady, admitted when failing open;
//   - no record: ReasonUnknownModel, admitted;
//   - stale record (no put received for more than stale-list-after, or an
//     updated_at older than stale-list-after by the router's clock; exactly
//     at the limit is still fresh): ReasonStale, admitted when failing open;
//   - all_busy: ReasonAllBusy, rejected;
//   - else ReasonFree, admitted, with the record's free workers.
//
// It reads the current snapshot without a lock and allocates nothing; it is
// safe for any number of goroutines.
func (w *Watcher) Decide(model string) Decision {
	p := w.state.cur.Load()
	if p == nil {
		return Decision{Admit: w.failOpen, Reason: ReasonNotReady}
	}
	e := (*p)[model]
	if e == nil {
		return Decision{Admit: true, Reason: ReasonUnknownModel}
	}
	now := w.now()
	if now.Sub(e.received) > w.staleAfter || e.rec.UpdatedAt < now.UnixNano()-int64(w.staleAfter) {
		return Decision{Admit: w.failOpen, Reason: ReasonStale}
	}
	if e.rec.AllBusy {
		return Decision{Admit: false, Reason: ReasonAllBusy, Free: e.rec.Free, Busy: e.rec.Busy}
	}
	return Decision{Admit: true, Reason: ReasonFree, Free: e.rec.Free, Busy: e.rec.Busy}
}

// DefaultMaxModelLabels is how many distinct models get their own label in
// workermon_router_requests_rejected_total before the rest share "other".
const DefaultMaxModelLabels = 100

// AdmissionOtherModel is the model label shared by the models beyond the cap
// and by model names that are not valid (contract §2).
const AdmissionOtherModel = "other"

// AdmissionMetrics counts admission decisions:
//
//   - workermon_router_admissions_total{outcome}: every decision, by outcome
//     (admitted, rejected, stale_open, stale_closed, unknown_model, not_ready,
//     no_model);
//   - workermon_router_requests_rejected_total{model}: rejected requests by
//     model.
//
// The model label's cardinality is capped: the first maxModelLabels distinct
// models rejected get their own label, later ones (and invalid model names,
// which a client can make up at will) are counted under "other". Admitted
// requests are counted by outcome only. Observe takes no lock and allocates
// nothing, except the first time a model is rejected.
//
// Share one AdmissionMetrics between the Middlewares and the gateway of a
// process: a second one on the same registry shares the collectors but keeps
// a cap of its own.
type AdmissionMetrics struct {
	outcomes  map[string]prometheus.Counter // fixed at construction
	rejected  *prometheus.CounterVec
	other     prometheus.Counter
	maxModels int

	// models maps the models with a label of their own to their counters;
	// copied on write (at most maxModels times) under mu.
	models atomic.Pointer[map[string]prometheus.Counter]
	mu     sync.Mutex
}

// NewAdmissionMetrics returns counters registered on reg (not registered when
// reg is nil; collectors already registered there are shared). maxModelLabels
// must be positive; see DefaultMaxModelLabels.
func NewAdmissionMetrics(reg prometheus.Registerer, maxModelLabels int) (*AdmissionMetrics, error) {
	if maxModelLabels <= 0 {
		return nil, fmt.Errorf("busylist: new admission metrics: %w: max model labels %d is not positive",
			ErrInvalidOption, maxModelLabels)
	}
	outcomes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "workermon_router_admissions_total",
		Help: "Admission decisions of the router, by outcome: admitted, rejected, stale_open, stale_closed, unknown_model, not_ready, no_model.",
	}, []string{"outcome"})
	rejected := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "workermon_router_requests_rejected_total",
		Help: `Requests the router rejected, by model ("other" beyond the label cap).`,
	}, []string{"model"})
	if err := errors.Join(RegisterShared(reg, &outcomes), RegisterShared(reg, &rejected)); err != nil {
		return nil, fmt.Errorf("busylist: new admission metrics: %w", err)
	}
	m := &AdmissionMetrics{
		outcomes:  make(map[string]prometheus.Counter),
		rejected:  rejected,
		other:     rejected.WithLabelValues(AdmissionOtherModel),
		maxModels: maxModelLabels,
	}
	m.models.Store(&map[string]prometheus.Counter{})
	for _, o := range []string{OutcomeAdmitted, OutcomeRejected, OutcomeStaleOpen, OutcomeStaleClosed,
		OutcomeUnknownModel, OutcomeNotReady, OutcomeNoModel} {
		m.outcomes[o] = outcomes.WithLabelValues(o)
	}
	return m, nil
}

// Observe counts the decision d taken for model.
func (m *AdmissionMetrics) Observe(model string, d Decision) {
	m.outcomes[d.Outcome()].Inc()
	if !d.Admit {
		m.rejectedCounter(model).Inc()
	}
}

// ObserveNoModel counts a request that named no model and was let through.
func (m *AdmissionMetrics) ObserveNoModel() { m.outcomes[OutcomeNoModel].Inc() }

// rejectedCounter returns the model's rejection counter, giving the model a
// label of its own while there is room.
func (m *AdmissionMetrics) rejectedCounter(model string) prometheus.Counter {
	models := *m.models.Load()
	if c, ok := models[model]; ok {
		return c
	}
	if len(models) >= m.maxModels || events.ValidateModel(model) != nil {
		return m.other
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	models = *m.models.Load()
	if c, ok := models[model]; ok {
		return c
	}
	if len(models) >= m.maxModels {
		return m.other
	}
	c := m.rejected.WithLabelValues(model)
	next := make(map[string]prometheus.Counter, len(models)+1)
	maps.Copy(next, models)
	next[model] = c
	m.models.Store(&next)
	return c
}
