package events

import (
	"encoding/json"
	"testing"
)

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

var benchReport = LoadReport{
	Model: "Qwen/Qwen3-0.6B", WorkerID: 7, DPRank: 1, DPStart: 0, DPSize: 2, Source: SourceEngine,
	ActiveDecodeBlocks: Some(812), KVTotalBlocks: Some(1024), ActivePrefillTokens: Some(4096),
	MaxNumBatchedTokens: Some(8192), WaitingRequests: Some(3), RunningRequests: Some(41), Preemptions: Some(2),
	PrefilledTokens: Some(1 << 33), KVCommittedBlocks: Some(1300), BootID: 12345678901234567890, Seq: 991, SentAt: 1763769600000000000,
}

func BenchmarkEncodeLoadReport(b *testing.B) {
	enc := NewEncoder()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := enc.LoadReport(&benchReport); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeLoadReport(b *testing.B) {
	data, _ := MarshalLoadReport(&benchReport)
	dec := NewDecoder()
	b.ReportAllocs()
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := dec.LoadReport(data); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseAndMatchSubject(b *testing.B) {
	subject := LoadSubject(DefaultSubjectPrefix, benchReport.Model, benchReport.WorkerID, benchReport.DPRank)
	b.ReportAllocs()
	for b.Loop() {
		s, err := ParseSubject(DefaultSubjectPrefix, subject)
		if err != nil {
			b.Fatal(err)
		}
		if err := benchReport.Match(s); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkModelKey(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		_ = ModelKey(benchReport.Model)
	}
}
