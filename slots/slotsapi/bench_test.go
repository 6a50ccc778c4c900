package slotsapi_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsapi"
)

// BenchmarkPotentialLoadsHTTP is POST /potential_loads end to end over
// loopback HTTP (client encode, server decode, projection, encode of 1,000
// rows, the client reading them whole): a request of 64 blocks over 1,000 ranks (125
// workers × 8) carrying 10,000 active requests of 64 blocks each. It
// reports the p50 and p99 of the round trips as well as the mean.
func BenchmarkPotentialLoadsHTTP(b *testing.B) {
	tr, err := slots.New(slots.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	const workers, ranks, requests, blocks = 125, 8, 10_000, 64
	for w := range workers {
		if err := tr.Register(slots.Worker{WorkerID: uint64(w), Model: "m", BlockSize: 16, DPSize: ranks}); err != nil {
			b.Fatal(err)
		}
	}
	for i := range requests {
		hashes := make([]uint64, blocks)
		for j := range hashes {
			hashes[j] = uint64(i*blocks + j)
		}
		if err := tr.Add(slots.Request{Model: "m", ID: fmt.Sprint(i), WorkerID: uint64(i % workers), DPRank: uint32(i % ranks),
			Hashes: hashes, NewISLTokens: 1024}); err != nil {
			b.Fatal(err)
		}
	}
	srv := httptest.NewServer(slotsapi.Handler(tr))
	defer srv.Close()
	query := make([]int64, blocks)
	for j := range query {
		query[j] = int64(j * 7)
	}
	body, err := json.Marshal(map[string]any{"model_name": "m", "sequence_hashes": query, "new_isl_tokens": 1024})
	if err != nil {
		b.Fatal(err)
	}
	client := srv.Client()
	// The answer is checked once; in the loop the client reads it whole
	// (the end of the round trip) without decoding: decoding is the
	// client's own cost, not the service's.
	resp, err := client.Post(srv.URL+"/potential_loads", "application/json", bytes.NewReader(body))
	if err != nil {
		b.Fatal(err)
	}
	var out []slots.Potential
	err = json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || len(out) != workers*ranks {
		b.Fatalf("status %d, %d rows, %v", resp.StatusCode, len(out), err)
	}
	var took []time.Duration
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		resp, err := client.Post(srv.URL+"/potential_loads", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || n < workers*ranks*80 {
			b.Fatalf("status %d, %d bytes, %v", resp.StatusCode, n, err)
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(took[len(took)*99/100].Microseconds()), "p99-µs")
}
