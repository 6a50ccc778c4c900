// Package events holds workermon's wire contract: the LoadReport and Goodbye
// messages engines publish, the BusySet record the monitor writes, the worker
// registry entry, the model_key encoding, subject builders and parsers, and
// the msgpack codec with its validation.
//
// The contract is written down in docs/contract.md; this package is its
// executable form and imports nothing else of workermon.
package events

import (
	"errors"
	"fmt"
	"strings"
)

// SchemaVersion is the only value of the `v` field this package accepts and
// writes.
const SchemaVersion = 1

// MaxPayloadSize is the largest report or goodbye accepted, in bytes.
const MaxPayloadSize = 64 << 10

// MaxModelLen is the longest model name accepted, in bytes.
const MaxModelLen = 256

// MaxSourceLen is the longest source name accepted, in bytes.
const MaxSourceLen = 128

// SourceEngine is the source of an engine's own measurements.
const SourceEngine = "engine"

// RouterSourcePrefix starts the source of a router's estimate:
// router/<router-id> (contract §11).
const RouterSourcePrefix = "router/"

// IsRouterSource reports whether src names a router's estimate.
func IsRouterSource(src string) bool { return strings.HasPrefix(src, RouterSourcePrefix) }

// DefaultSubjectPrefix is the first subject token when none is configured.
const DefaultSubjectPrefix = "workermon"

// DefaultMaxNumBatchedTokens stands in for an unknown max_num_batched_tokens
// in the fractional prefill check.
const DefaultMaxNumBatchedTokens = 10_000_000

// Bucket names of the contract.
const (
	BusyBucket       = "workermon-busy"
	ThresholdsBucket = "workermon-thresholds"
	WorkersBucket    = "workermon-workers"
	LeasesBucket     = "workermon-leases"
	CordonsBucket    = "workermon-cordons"
	// SLOBucket holds the SLOs and their controllers' status (§18).
	SLOBucket = "workermon-slo"
)

// Sentinel errors. Every validation error wraps one of them, so callers can
// count rejections by reason with errors.Is (see Reason).
var (
	ErrEmpty          = errors.New("empty payload")
	ErrTooLarge       = errors.New("payload too large")
	ErrMalformed      = errors.New("malformed msgpack")
	ErrNotMap         = errors.New("payload is not a map")
	ErrWrongType      = errors.New("field has the wrong type")
	ErrMissingField   = errors.New("required field missing")
	ErrOutOfRange     = errors.New("field out of range")
	ErrVersion        = errors.New("unsupported schema version")
	ErrInvalidModel   = errors.New("invalid model name")
	ErrInvalidSource  = errors.New("invalid source")
	ErrInvalidSubject = errors.New("invalid subject")
	ErrMismatch       = errors.New("subject does not match payload")
	// ErrSourceNotAllowed: a router's estimate on a load or bye subject, or
	// any other source on an est subject (contract §11).
	ErrSourceNotAllowed = errors.New("source not allowed on this subject")
)

// Reason maps an error of this package to a short, stable label for metrics:
// "empty", "too_large", "malformed", "not_map", "wrong_type", "missing_field",
// "out_of_range", "version", "invalid_model", "invalid_source",
// "invalid_subject", "mismatch", "source_not_allowed", or "other".
func Reason(err error) string {
	for _, r := range reasons {
		if errors.Is(err, r.err) {
			return r.label
		}
	}
	return "other"
}

var reasons = [...]struct {
	err   error
	label string
}{
	{ErrEmpty, "empty"},
	{ErrTooLarge, "too_large"},
	{ErrMalformed, "malformed"},
	{ErrNotMap, "not_map"},
	{ErrWrongType, "wrong_type"},
	{ErrMissingField, "missing_field"},
	{ErrOutOfRange, "out_of_range"},
	{ErrVersion, "version"},
	{ErrInvalidModel, "invalid_model"},
	{ErrInvalidSource, "invalid_source"},
	{ErrInvalidSubject, "invalid_subject"},
	{ErrMismatch, "mismatch"},
	{ErrSourceNotAllowed, "source_not_allowed"},
}

// fieldError names the field a validation error is about.
func fieldError(field string, err error) error {
	return fmt.Errorf("events: field %q: %w", field, err)
}
