package events

import (
	"encoding/json"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// wireReport is the report as msgpack's reflection decoder would read it:
// the baseline our hand-written decoder is measured against.
type wireReport struct {
	V                   uint64  `msgpack:"v" json:"v"`
	Model               string  `msgpack:"model" json:"model"`
	WorkerID            uint64  `msgpack:"worker_id" json:"worker_id"`
	DPRank              uint32  `msgpack:"dp_rank" json:"dp_rank"`
	DPStart             uint32  `msgpack:"dp_start" json:"dp_start"`
	DPSize              uint32  `msgpack:"dp_size" json:"dp_size"`
	Source              string  `msgpack:"source" json:"source"`
	ActiveDecodeBlocks  *uint64 `msgpack:"active_decode_blocks" json:"active_decode_blocks"`
	KVTotalBlocks       *uint64 `msgpack:"kv_total_blocks" json:"kv_total_blocks"`
	ActivePrefillTokens *uint64 `msgpack:"active_prefill_tokens" json:"active_prefill_tokens"`
	MaxNumBatchedTokens *uint64 `msgpack:"max_num_batched_tokens" json:"max_num_batched_tokens"`
	WaitingRequests     *uint64 `msgpack:"waiting_requests" json:"waiting_requests"`
	RunningRequests     *uint64 `msgpack:"running_requests" json:"running_requests"`
	Preemptions         *uint64 `msgpack:"preemptions" json:"preemptions"`
	PrefilledTokens     *uint64 `msgpack:"prefilled_tokens" json:"prefilled_tokens"`
	KVCommittedBlocks   *uint64 `msgpack:"kv_committed_blocks" json:"kv_committed_blocks"`
	BootID              uint64  `msgpack:"boot_id" json:"boot_id"`
	Seq                 uint64  `msgpack:"seq" json:"seq"`
	SentAt              int64   `msgpack:"sent_at" json:"sent_at"`
}

// BenchmarkDecodeBaseline decodes the same payload with msgpack's
// reflection-based Unmarshal (no validation) and, for scale, the JSON form
// with encoding/json.
func BenchmarkDecodeBaseline(b *testing.B) {
	data, _ := MarshalLoadReport(&benchReport)
	b.Run("msgpack-reflect", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var r wireReport
			if err := msgpack.Unmarshal(data, &r); err != nil {
				b.Fatal(err)
			}
		}
	})
	var r wireReport
	_ = msgpack.Unmarshal(data, &r)
	js, _ := json.Marshal(&r)
	b.Run("json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var r wireReport
			if err := json.Unmarshal(js, &r); err != nil {
				b.Fatal(err)
			}
		}
	})
}
