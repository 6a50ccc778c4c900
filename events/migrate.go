package events

import (
	"fmt"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
)

// Rescheduling reasons of a MigrateRequest (contract §12).
const (
	MigrateReasonDecodeLoad = "decode_load"
	MigrateReasonFailover   = "failover"
)

// MigratableHeader is the request header with which a router marks a
// request whose stream it can continue elsewhere; an engine may cut only
// those (contract §12).
const MigratableHeader = "X-Workermon-Migratable"

// MigrateRequest asks an engine to cut running requests so that the router
// continues them elsewhere (contract §12), msgpack on
// <prefix>.migrate.<model_key>.<src_worker_id>.
type MigrateRequest struct {
	V           uint64 `msgpack:"v"`
	Model       string `msgpack:"model"`
	Src         uint64 `msgpack:"src"`
	Dst         uint64 `msgpack:"dst"`
	DstEndpoint string `msgpack:"dst_endpoint"`
	MaxRequests uint64 `msgpack:"max_requests"`
	Reason      string `msgpack:"reason"`
	// Epoch is the monitor's epoch for the model's partition: an engine
	// ignores a request whose epoch is below the highest it has seen.
	Epoch uint64 `msgpack:"epoch"`
}

// MigrateReply is an engine's answer: how many requests it cut.
type MigrateReply struct {
	V        uint64 `msgpack:"v"`
	Migrated uint64 `msgpack:"migrated"`
}

// MigrateSubject is the subject a migrate request for worker src of model
// is sent on.
func MigrateSubject(prefix, model string, src uint64) string {
	return prefix + ".migrate." + ModelKey(model) + "." + strconv.FormatUint(src, 10)
}

// MigrateWildcard matches the migrate requests of every model for worker.
func MigrateWildcard(prefix string, worker uint64) string {
	return prefix + ".migrate.*." + strconv.FormatUint(worker, 10)
}

// MarshalMigrateRequest encodes r with v = 1.
func MarshalMigrateRequest(r MigrateRequest) ([]byte, error) {
	r.V = SchemaVersion
	if err := r.validate(); err != nil {
		return nil, err
	}
	return msgpack.Marshal(&r)
}

// DecodeMigrateRequest decodes and checks a migrate request.
func DecodeMigrateRequest(data []byte) (MigrateRequest, error) {
	var r MigrateRequest
	if len(data) > MaxPayloadSize {
		return r, fmt.Errorf("events: migrate request of %d bytes: %w", len(data), ErrTooLarge)
	}
	if err := msgpack.Unmarshal(data, &r); err != nil {
		return MigrateRequest{}, fmt.Errorf("events: decode migrate request: %w: %v", ErrMalformed, err)
	}
	if r.V != SchemaVersion {
		return MigrateRequest{}, fmt.Errorf("events: migrate request version %d: %w", r.V, ErrVersion)
	}
	return r, r.validate()
}

func (r MigrateRequest) validate() error {
	if err := ValidateModel(r.Model); err != nil {
		return err
	}
	if r.Src == r.Dst {
		return fmt.Errorf("events: migrate request from worker %d to itself: %w", r.Src, ErrOutOfRange)
	}
	return nil
}

// MarshalMigrateReply encodes r with v = 1.
func MarshalMigrateReply(r MigrateReply) ([]byte, error) {
	r.V = SchemaVersion
	return msgpack.Marshal(&r)
}

// DecodeMigrateReply decodes an engine's answer.
func DecodeMigrateReply(data []byte) (MigrateReply, error) {
	var r MigrateReply
	if err := msgpack.Unmarshal(data, &r); err != nil {
		return MigrateReply{}, fmt.Errorf("events: decode migrate reply: %w: %v", ErrMalformed, err)
	}
	if r.V != SchemaVersion {
		return MigrateReply{}, fmt.Errorf("events: migrate reply version %d: %w", r.V, ErrVersion)
	}
	return r, nil
}
