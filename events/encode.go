package events

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Encoder encodes reports and goodbyes into a buffer it reuses: the bytes a
// method returns are valid until the next call. One Encoder belongs to one
// goroutine.
type Encoder struct {
	buf bytes.Buffer
	e   *msgpack.Encoder
}

// NewEncoder returns an Encoder that writes the most compact integers.
func NewEncoder() *Encoder {
	enc := &Encoder{}
	enc.e = msgpack.NewEncoder(&enc.buf)
	enc.e.UseCompactInts(true)
	return enc
}

// LoadReport validates and encodes r. Absent load fields are left out.
func (enc *Encoder) LoadReport(r *LoadReport) ([]byte, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	enc.buf.Reset()
	e := enc.e
	n := 10
	for _, o := range r.optionals() {
		if o.Set {
			n++
		}
	}
	// bytes.Buffer writes never fail; the encoder's errors are nil here.
	_ = e.EncodeMapLen(n)
	enc.common(r.Model, r.WorkerID, r.Source, r.BootID, r.Seq, r.SentAt)
	enc.uint("dp_rank", uint64(r.DPRank))
	enc.uint("dp_start", uint64(r.DPStart))
	enc.uint("dp_size", uint64(r.DPSize))
	enc.optional("active_decode_blocks", r.ActiveDecodeBlocks)
	enc.optional("kv_total_blocks", r.KVTotalBlocks)
	enc.optional("active_prefill_tokens", r.ActivePrefillTokens)
	enc.optional("max_num_batched_tokens", r.MaxNumBatchedTokens)
	enc.optional("waiting_requests", r.WaitingRequests)
	enc.optional("running_requests", r.RunningRequests)
	enc.optional("preemptions", r.Preemptions)
	enc.optional("prefilled_tokens", r.PrefilledTokens)
	enc.optional("kv_committed_blocks", r.KVCommittedBlocks)
	return enc.buf.Bytes(), nil
}

// Goodbye validates and encodes g.
func (enc *Encoder) Goodbye(g *Goodbye) ([]byte, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	enc.buf.Reset()
	_ = enc.e.EncodeMapLen(7)
	enc.common(g.Model, g.WorkerID, g.Source, g.BootID, g.Seq, g.SentAt)
	return enc.buf.Bytes(), nil
}

func (enc *Encoder) common(model string, worker uint64, source string, boot, seq uint64, sentAt int64) {
	enc.uint("v", SchemaVersion)
	enc.str("model", model)
	enc.uint("worker_id", worker)
	enc.str("source", source)
	enc.uint("boot_id", boot)
	enc.uint("seq", seq)
	_ = enc.e.EncodeString("sent_at")
	_ = enc.e.EncodeInt(sentAt)
}

func (enc *Encoder) uint(key string, v uint64) {
	_ = enc.e.EncodeString(key)
	_ = enc.e.EncodeUint(v)
}

func (enc *Encoder) str(key, v string) {
	_ = enc.e.EncodeString(key)
	_ = enc.e.EncodeString(v)
}

func (enc *Encoder) optional(key string, o Optional) {
	if o.Set {
		enc.uint(key, o.Value)
	}
}

// MarshalLoadReport encodes r into a new slice.
func MarshalLoadReport(r *LoadReport) ([]byte, error) {
	b, err := NewEncoder().LoadReport(r)
	if err != nil {
		return nil, fmt.Errorf("events: marshal report: %w", err)
	}
	return b, nil
}

// MarshalGoodbye encodes g into a new slice.
func MarshalGoodbye(g *Goodbye) ([]byte, error) {
	b, err := NewEncoder().Goodbye(g)
	if err != nil {
		return nil, fmt.Errorf("events: marshal goodbye: %w", err)
	}
	return b, nil
}
