package slots

import (
	"fmt"
	"runtime"
	"testing"
)

// BenchmarkPotentialLoads projects a request of 64 blocks over 1,000 ranks
// (125 workers × 8) carrying 10,000 active requests of 64 blocks each.
func BenchmarkPotentialLoads(b *testing.B) {
	cfg := DefaultConfig()
	tr, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	const workers, ranks, requests, blocks = 125, 8, 10_000, 64
	for w := range workers {
		if err := tr.Register(Worker{WorkerID: uint64(w), Model: "m", BlockSize: 16, DPSize: ranks}); err != nil {
			b.Fatal(err)
		}
	}
	for i := range requests {
		hashes := make([]uint64, blocks)
		for j := range hashes {
			hashes[j] = uint64(i*blocks + j)
		}
		if err := tr.Add(Request{Model: "m", ID: fmt.Sprint(i), WorkerID: uint64(i % workers), DPRank: uint32(i % ranks),
			Hashes: hashes, NewISLTokens: 1024}); err != nil {
			b.Fatal(err)
		}
	}
	query := make([]uint64, blocks)
	for j := range query {
		query[j] = uint64(j * 7)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tr.PotentialLoads("m", "", query, 1024); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBlockMemory reports the heap a held block hash costs
// (B/block), which Config.MaxBlocks multiplies: 250 requests of 1,000
// blocks on 50 ranks, with every hash on one rank only (distinct: the
// worst case, each hash has its own entry in the holders) or with the requests
// of a rank sharing their hashes (shared: only the request's own list
// grows).
func BenchmarkBlockMemory(b *testing.B) {
	for _, tc := range []struct {
		name   string
		shared bool
	}{{"distinct", false}, {"shared", true}} {
		b.Run(tc.name, func(b *testing.B) {
			const ranks, requests, blocks = 50, 250, 1000
			var perBlock float64
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				tr, err := New(DefaultConfig())
				if err != nil {
					b.Fatal(err)
				}
				if err := tr.Register(Worker{WorkerID: 1, Model: "m", BlockSize: 16, DPSize: ranks}); err != nil {
					b.Fatal(err)
				}
				hashes := make([]uint64, blocks)
				for i := range requests {
					for j := range hashes {
						hashes[j] = uint64(i*blocks + j)
						if tc.shared {
							hashes[j] = uint64((i%ranks)*blocks + j)
						}
					}
					if err := tr.Add(Request{Model: "m", ID: fmt.Sprint(i), WorkerID: 1, DPRank: uint32(i % ranks),
						Hashes: hashes}); err != nil {
						b.Fatal(err)
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				if s := tr.Stats(); s.Blocks != requests*blocks {
					b.Fatalf("%d blocks held, want %d", s.Blocks, requests*blocks)
				}
				perBlock = float64(after.HeapAlloc-before.HeapAlloc) / (requests * blocks)
				runtime.KeepAlive(tr)
			}
			b.ReportMetric(perBlock, "B/block")
		})
	}
}

// BenchmarkRankMemory reports the heap an empty registered rank costs
// (B/rank), which Config.MaxTotalRanks multiplies: 1,024 workers of 64
// ranks.
func BenchmarkRankMemory(b *testing.B) {
	const workers, ranks = 1024, 64
	var perRank float64
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		tr, err := New(DefaultConfig())
		if err != nil {
			b.Fatal(err)
		}
		for w := range workers {
			if err := tr.Register(Worker{WorkerID: uint64(w), Model: "m", BlockSize: 16, DPSize: ranks}); err != nil {
				b.Fatal(err)
			}
		}
		// A projection sorts the ranks once: the order is part of the cost.
		if _, err := tr.PotentialLoads("m", "", nil, 0); err != nil {
			b.Fatal(err)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		if s := tr.Stats(); s.Ranks != workers*ranks {
			b.Fatalf("%d ranks, want %d", s.Ranks, workers*ranks)
		}
		perRank = float64(after.HeapAlloc-before.HeapAlloc) / (workers * ranks)
		runtime.KeepAlive(tr)
	}
	b.ReportMetric(perRank, "B/rank")
}

// BenchmarkUnregister registers and unregisters a worker of 1,024 ranks
// with 16 requests of its own beside the other workers' active requests
// (8 blocks each): the unregistration costs per the worker's own requests,
// not per every active request of its (model, tenant).
func BenchmarkUnregister(b *testing.B) {
	for _, others := range []int{1_000, 4_000, 16_000} {
		b.Run(fmt.Sprintf("requests=%d", others), func(b *testing.B) {
			tr, err := New(DefaultConfig())
			if err != nil {
				b.Fatal(err)
			}
			const workers, ranks = 64, 8
			for w := range workers {
				if err := tr.Register(Worker{WorkerID: uint64(w), Model: "m", BlockSize: 16, DPSize: ranks}); err != nil {
					b.Fatal(err)
				}
			}
			for i := range others {
				if err := tr.Add(Request{Model: "m", ID: fmt.Sprint(i), WorkerID: uint64(i % workers), DPRank: uint32(i % ranks),
					Hashes: []uint64{1, 2, 3, 4, 5, 6, 7, uint64(i)}, NewISLTokens: 1024}); err != nil {
					b.Fatal(err)
				}
			}
			big := Worker{WorkerID: 1 << 40, Model: "m", BlockSize: 16, DPSize: MaxRanks}
			ids := make([]string, 16)
			for i := range ids {
				ids[i] = fmt.Sprint("own-", i)
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := tr.Register(big); err != nil {
					b.Fatal(err)
				}
				for i, id := range ids {
					if err := tr.Add(Request{Model: "m", ID: id, WorkerID: big.WorkerID, DPRank: uint32(i * 64),
						Hashes: []uint64{1, 2, 3}, NewISLTokens: 1024}); err != nil {
						b.Fatal(err)
					}
				}
				if err := tr.Unregister("m", "", big.WorkerID); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
