package scrape

import (
	"strconv"

	"github.com/workermon/workermon/events"
)

// What the VLLM mapping reads of a vLLM exposition.
const (
	// EngineVLLM is the name of the VLLM mapping.
	EngineVLLM = "vllm"
	// VLLMUsageMetric is the fraction of KV-cache blocks in use, 0 to 1.
	VLLMUsageMetric = "vllm:kv_cache_usage_perc"
	// VLLMLegacyUsageMetric is the same fraction under its older name,
	// the only one of the V0 engine and of V1 before mid-2025 (about 0.9),
	// deprecated (and later hidden by default) since. Read for a rank that
	// VLLMUsageMetric does not name.
	VLLMLegacyUsageMetric = "vllm:gpu_cache_usage_perc"
	// VLLMCacheConfigMetric is the info gauge that carries the cache
	// configuration as labels.
	VLLMCacheConfigMetric = "vllm:cache_config_info"
	// VLLMRankLabel names the data-parallel rank (vLLM's engine index).
	VLLMRankLabel = "engine"
	// VLLMBlocksLabel of VLLMCacheConfigMetric is the number of KV-cache
	// blocks of one engine.
	VLLMBlocksLabel = "num_gpu_blocks"
	// VLLMBlockSizeLabel of VLLMCacheConfigMetric is the number of tokens
	// per block.
	VLLMBlockSizeLabel = "block_size"
)

// VLLM maps a vLLM exposition (contract §13): rank = the engine label (0
// when absent); total blocks = the integer in vllm:cache_config_info's
// num_gpu_blocks label; used blocks = round(vllm:kv_cache_usage_perc ×
// total).
//
// Where the contract is silent:
//
//   - Older vLLM: a rank that vllm:kv_cache_usage_perc does not name takes
//     its usage from vllm:gpu_cache_usage_perc, the same fraction under the
//     name of the V0 engine and of V1 before mid-2025 (about 0.9).
//   - A vllm:cache_config_info series without an engine label (vLLM before
//     the label was added to it) is rank 0's, and gives its total also to
//     every rank that has no series of its own: vLLM writes one cache
//     configuration for all the engines behind an API server.
//   - A rank's total is left out when its num_gpu_blocks is absent, not a
//     decimal integer, or 0 (vLLM writes "None" before its cache is sized,
//     and some V1 versions never fill it in), and its used blocks with it
//     (there is nothing to multiply). A usage that is negative or not
//     finite is left out.
//   - When a rank has several series (an exposition that repeats it), the
//     highest usage and the smallest positive total count, so that busy is
//     never hidden. An engine label that is not a decimal uint32 makes its
//     series unusable.
//
// The leading signals (leading.go): the request gauges, the preemption
// counter and the computed prompt tokens, by the engine label; a rank named
// only by them is a rank too (its KV fields unset).
//
// vLLM exposes no count of tokens being prefilled (num_requests_waiting
// counts requests) and no batch-token capacity, so ActivePrefillTokens and
// MaxNumBatchedTokens stay unset. BlockSize is the block_size label when
// every series agrees on one positive integer.
type VLLM struct{}

// Engine returns EngineVLLM.
func (VLLM) Engine() string { return EngineVLLM }

// vllmRank is what a page says of one rank.
type vllmRank struct {
	usage          float64 // fraction of blocks in use
	total          uint64
	hasUsage, hasT bool
}

// Loads returns the load of every rank named by a usage metric, the cache
// configuration or a leading signal.
func (VLLM) Loads(fams Families) Snapshot {
	ranks := map[uint32]*vllmRank{}
	get := func(r uint32) *vllmRank {
		d := ranks[r]
		if d == nil {
			d = &vllmRank{}
			ranks[r] = d
		}
		return d
	}

	// Usage: the current name first; the legacy name only for the ranks
	// the current name does not name at all. readUsage returns the ranks
	// the metric names.
	readUsage := func(name string, skip map[uint32]bool) map[uint32]bool {
		named := map[uint32]bool{}
		mf := fams[name]
		if mf == nil {
			return named
		}
		for _, m := range mf.GetMetric() {
			rank, ok := rankOf(m, VLLMRankLabel)
			if !ok || skip[rank] {
				continue
			}
			named[rank] = true
			d := get(rank)
			v, ok := sampleValue(m)
			if !ok || v < 0 {
				continue
			}
			if !d.hasUsage || v > d.usage {
				d.usage, d.hasUsage = v, true
			}
		}
		return named
	}
	readUsage(VLLMLegacyUsageMetric, readUsage(VLLMUsageMetric, nil))

	var blockSize uint32
	blockSizeOK := true
	var shared vllmRank // the series without an engine label
	own := map[uint32]bool{}
	if mf := fams[VLLMCacheConfigMetric]; mf != nil {
		for _, m := range mf.GetMetric() {
			rank, ok := rankOf(m, VLLMRankLabel)
			if !ok {
				continue
			}
			d := get(rank)
			engine, _ := label(m, VLLMRankLabel)
			if engine != "" {
				own[rank] = true
			}
			if v, ok := label(m, VLLMBlocksLabel); ok {
				if n, err := strconv.ParseUint(v, 10, 64); err == nil && n > 0 {
					if !d.hasT || n < d.total {
						d.total, d.hasT = n, true
					}
					if engine == "" && (!shared.hasT || n < shared.total) {
						shared.total, shared.hasT = n, true
					}
				}
			}
			bsText, _ := label(m, VLLMBlockSizeLabel)
			bs, err := strconv.ParseUint(bsText, 10, 32)
			switch {
			case err != nil || bs == 0:
				blockSizeOK = false
			case blockSize == 0:
				blockSize = uint32(bs)
			case uint32(bs) != blockSize:
				blockSizeOK = false
			}
		}
	}
	if !blockSizeOK {
		blockSize = 0
	}
	lead := vllmLeading(fams)
	named := map[uint32]bool{}
	lead.ranks(named)
	for r := range named {
		get(r)
	}
	if shared.hasT {
		for r, d := range ranks {
			if !own[r] && !d.hasT {
				d.total, d.hasT = shared.total, true
			}
		}
	}

	snap := Snapshot{Ranks: make([]RankLoad, 0, len(ranks)), BlockSize: blockSize}
	for _, r := range sortedRanks(ranks) {
		d := ranks[r]
		rl := RankLoad{Rank: r}
		lead.fill(&rl)
		if d.hasT {
			rl.KVTotalBlocks = events.Some(d.total)
			if d.hasUsage {
				if used, ok := count(d.usage * float64(d.total)); ok {
					rl.ActiveDecodeBlocks = events.Some(used)
				}
			}
		}
		snap.Ranks = append(snap.Ranks, rl)
	}
	return snap
}
