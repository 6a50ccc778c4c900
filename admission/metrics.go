package admission

import (
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/promreg"
)

// DefaultMaxModelLabels is how many distinct models get their own label in
// workermon_router_requests_rejected_total before the rest share "other".
const DefaultMaxModelLabels = 100

// OtherModel is the model label shared by the models beyond the cap
// and by model names that are not valid (contract §2).
const OtherModel = "other"

// Metrics counts admission decisions:
//
//   - workermon_router_admissions_total{outcome}: every decision, by outcome
//     (admitted, rejected, stale_open, stale_closed, unknown_model, not_ready,
//     no_model, shed);
//   - workermon_router_class_decisions_total{class,decision}: every decision
//     on a request that names a model, by priority class (sheddable,
//     standard, critical; contract §15) and decision (admitted, rejected);
//   - workermon_router_requests_rejected_total{model}: rejected requests by
//     model.
//
// The model label's cardinality is capped: the first maxModelLabels distinct
// models rejected get their own label, later ones (and invalid model names,
// which a client can make up at will) are counted under "other". Admitted
// requests are counted by outcome only. Observe takes no lock and allocates
// nothing, except the first time a model is rejected.
//
// Share one Metrics between the Middlewares and the gateway of a
// process: a second one on the same registry shares the collectors but keeps
// a cap of its own.
type Metrics struct {
	outcomes  map[string]prometheus.Counter     // fixed at construction
	classes   [NumClasses][2]prometheus.Counter // by class, then rejected (0) or admitted (1)
	rejected  *prometheus.CounterVec
	other     prometheus.Counter
	maxModels int

	// models maps the models with a label of their own to their counters;
	// copied on write (at most maxModels times) under mu.
	models atomic.Pointer[map[string]prometheus.Counter]
	mu     sync.Mutex
}

// NewMetrics returns counters registered on reg (not registered when
// reg is nil; collectors already registered there are shared). maxModelLabels
// must be positive; see DefaultMaxModelLabels.
func NewMetrics(reg prometheus.Registerer, maxModelLabels int) (*Metrics, error) {
	if maxModelLabels <= 0 {
		return nil, fmt.Errorf("admission: new metrics: %w: max model labels %d is not positive",
			ErrInvalidOption, maxModelLabels)
	}
	outcomes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "workermon_router_admissions_total",
		Help: "Admission decisions of the router, by outcome: admitted, rejected, stale_open, stale_closed, unknown_model, not_ready, no_model, shed.",
	}, []string{"outcome"})
	classes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "workermon_router_class_decisions_total",
		Help: "Admission decisions of the router on requests that name a model, by priority class (sheddable, standard, critical) and decision (admitted, rejected).",
	}, []string{"class", "decision"})
	rejected := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "workermon_router_requests_rejected_total",
		Help: `Requests the router rejected, by model ("other" beyond the label cap).`,
	}, []string{"model"})
	if err := errors.Join(promreg.Shared(reg, &outcomes), promreg.Shared(reg, &rejected), promreg.Shared(reg, &classes)); err != nil {
		return nil, fmt.Errorf("admission: new metrics: %w", err)
	}
	m := &Metrics{
		outcomes:  make(map[string]prometheus.Counter),
		rejected:  rejected,
		other:     rejected.WithLabelValues(OtherModel),
		maxModels: maxModelLabels,
	}
	m.models.Store(&map[string]prometheus.Counter{})
	for _, o := range []string{OutcomeAdmitted, OutcomeRejected, OutcomeStaleOpen, OutcomeStaleClosed,
		OutcomeUnknownModel, OutcomeNotReady, OutcomeNoModel, OutcomeShed} {
		m.outcomes[o] = outcomes.WithLabelValues(o)
	}
	for _, c := range Classes() {
		m.classes[c][0] = classes.WithLabelValues(c.String(), "rejected")
		m.classes[c][1] = classes.WithLabelValues(c.String(), "admitted")
	}
	return m, nil
}

// Observe counts the decision d taken for model.
func (m *Metrics) Observe(model string, d Decision) {
	m.outcomes[d.Outcome()].Inc()
	if d.Class < NumClasses {
		admitted := 0
		if d.Admit {
			admitted = 1
		}
		m.classes[d.Class][admitted].Inc()
	}
	if !d.Admit {
		m.rejectedCounter(model).Inc()
	}
}

// ObserveNoModel counts a request that named no model and was let through.
func (m *Metrics) ObserveNoModel() { m.outcomes[OutcomeNoModel].Inc() }

// rejectedCounter returns the model's rejection counter, giving the model a
// label of its own while there is room.
func (m *Metrics) rejectedCounter(model string) prometheus.Counter {
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
