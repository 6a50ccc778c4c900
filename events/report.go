package events

import (
	"fmt"
	"math"
	"unicode/utf8"
)

// Optional is a load field that may be absent from a report. An absent field
// keeps the value the monitor already has; a present zero sets it to zero.
type Optional struct {
	Value uint64
	Set   bool
}

// Some returns a present value.
func Some(v uint64) Optional { return Optional{Value: v, Set: true} }

// LoadReport is one rank's load as one source measured it (contract §3).
type LoadReport struct {
	Model    string
	WorkerID uint64
	DPRank   uint32
	DPStart  uint32
	DPSize   uint32 // 0 on the wire means absent; Decode turns it into 1
	Source   string

	ActiveDecodeBlocks  Optional
	KVTotalBlocks       Optional
	ActivePrefillTokens Optional
	MaxNumBatchedTokens Optional

	// The leading signals of contract §21. WaitingRequests, RunningRequests,
	// Preemptions and PrefilledTokens count only from the engine source;
	// Preemptions and PrefilledTokens are counters per BootID.
	WaitingRequests   Optional // requests waiting to be scheduled, preempted ones included
	RunningRequests   Optional // requests scheduled
	Preemptions       Optional // preemptions since the publisher started
	PrefilledTokens   Optional // prompt tokens computed since the publisher started
	KVCommittedBlocks Optional // blocks the running and waiting requests would hold at their expected length

	BootID uint64
	Seq    uint64
	SentAt int64 // publisher clock, Unix nanoseconds
}

// optionals returns the report's load fields in wire order: those of §3,
// then those of §21.
func (r *LoadReport) optionals() [9]Optional {
	return [...]Optional{r.ActiveDecodeBlocks, r.KVTotalBlocks, r.ActivePrefillTokens, r.MaxNumBatchedTokens,
		r.WaitingRequests, r.RunningRequests, r.Preemptions, r.PrefilledTokens, r.KVCommittedBlocks}
}

// Validate checks the fields a decoded or hand-built report must satisfy.
func (r *LoadReport) Validate() error {
	if err := ValidateModel(r.Model); err != nil {
		return err
	}
	if err := ValidateSource(r.Source); err != nil {
		return err
	}
	return r.validateRanks()
}

// validateRanks checks the declared ranks and the rank of the report.
func (r *LoadReport) validateRanks() error {
	if r.DPSize == 0 {
		return fieldError("dp_size", fmt.Errorf("must be at least 1: %w", ErrOutOfRange))
	}
	if uint64(r.DPStart)+uint64(r.DPSize) > math.MaxUint32+1 {
		return fieldError("dp_size", fmt.Errorf("dp_start+dp_size overflows uint32: %w", ErrOutOfRange))
	}
	if r.DPRank < r.DPStart || uint64(r.DPRank) >= uint64(r.DPStart)+uint64(r.DPSize) {
		return fieldError("dp_rank", fmt.Errorf("%d is not in [%d, %d): %w",
			r.DPRank, r.DPStart, uint64(r.DPStart)+uint64(r.DPSize), ErrOutOfRange))
	}
	return nil
}

// Match checks that the subject's tokens are those of the payload.
func (r *LoadReport) Match(s Subject) error {
	if !s.Kind.reports() || !matchModel(s.ModelKey, r.Model) || !matchUint(s.WorkerID, r.WorkerID) ||
		!matchUint(s.DPRank, uint64(r.DPRank)) {
		return fmt.Errorf("events: report of worker %d rank %d of %q on subject tokens %q.%q.%q: %w",
			r.WorkerID, r.DPRank, r.Model, s.ModelKey, s.WorkerID, s.DPRank, ErrMismatch)
	}
	return matchSource(s.Kind, r.Source)
}

// matchSource checks that the source may speak on a subject of kind k:
// routers only on est subjects, and only routers there (contract §11), so
// that NATS permissions can let a router estimate without letting it speak
// for an engine.
func matchSource(k Kind, src string) error {
	if IsRouterSource(src) != k.estimates() {
		return fmt.Errorf("events: source %q on a %s subject: %w", src, k, ErrSourceNotAllowed)
	}
	return nil
}

// Goodbye says that a worker (engine source) or one of its sources leaves
// (contract §4).
type Goodbye struct {
	Model    string
	WorkerID uint64
	Source   string
	BootID   uint64
	Seq      uint64
	SentAt   int64
}

// Validate checks the fields of a goodbye.
func (g *Goodbye) Validate() error {
	if err := ValidateModel(g.Model); err != nil {
		return err
	}
	return ValidateSource(g.Source)
}

// Match checks that the subject's tokens are those of the payload.
func (g *Goodbye) Match(s Subject) error {
	if s.Kind != KindBye && s.Kind != KindEstBye || !matchModel(s.ModelKey, g.Model) || !matchUint(s.WorkerID, g.WorkerID) {
		return fmt.Errorf("events: goodbye of worker %d of %q on subject tokens %q.%q: %w",
			g.WorkerID, g.Model, s.ModelKey, s.WorkerID, ErrMismatch)
	}
	return matchSource(s.Kind, g.Source)
}

// ValidateSource checks a source name: 1 to MaxSourceLen bytes of printable
// UTF-8 ("engine", or "router/<id>" for a router's estimate).
func ValidateSource(src string) error {
	if src == "" || len(src) > MaxSourceLen || !utf8.ValidString(src) {
		return fieldError("source", fmt.Errorf("must be 1 to %d bytes of UTF-8: %w", MaxSourceLen, ErrInvalidSource))
	}
	for _, r := range src {
		if r < 0x20 || r == 0x7f {
			return fieldError("source", fmt.Errorf("control character: %w", ErrInvalidSource))
		}
	}
	return nil
}
