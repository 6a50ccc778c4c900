package scrape

import (
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"

	"github.com/workermon/workermon/events"
)

// What the SGLang mapping reads of an SGLang exposition.
const (
	// EngineSGLang is the name of the SGLang mapping.
	EngineSGLang = "sglang"
	// SGLangUsedMetric is the number of KV-cache tokens in use.
	SGLangUsedMetric = "sglang:num_used_tokens"
	// SGLangTotalMetric is the size of the KV-cache pool in tokens.
	SGLangTotalMetric = "sglang:max_total_num_tokens"
	// SGLangUsageMetric is the fraction of the pool in use, rounded by
	// SGLang to two decimals. Read only to stand in for a missing
	// SGLangUsedMetric or SGLangTotalMetric of the same series.
	SGLangUsageMetric = "sglang:token_usage"
	// SGLangRankLabel names the data-parallel rank.
	SGLangRankLabel = "dp_rank"
)

// SGLang maps an SGLang exposition (contract §13): rank = the dp_rank label
// (0 when absent); used = sglang:num_used_tokens, total =
// sglang:max_total_num_tokens, in blocks of one token (BlockSize 1). A rank
// has one series per scheduler that reports it (labels tp_rank, pp_rank,
// moe_ep_rank, ...); the used and total series with the same labels form a
// pair, and of a rank's pairs with a positive total the one with the
// highest used / total counts, never their sum.
//
// Where the contract is silent:
//
//   - Older SGLang lacks one of the two gauges; sglang:token_usage (used /
//     total, rounded by SGLang to two decimals) of the same series stands
//     in. Versions of late 2024 (label name instead of model_name) have
//     no num_used_tokens: used = round(token_usage × total). Versions of
//     2025 before max_total_num_tokens returned have no total: total =
//     round(used / token_usage), only while both are above 0. Either way
//     the pair's used / total is token_usage, so a threshold sees the
//     fraction SGLang computed, off by at most its rounding (0.005); the
//     derived count is approximate (a derived used by up to half a
//     hundredth of the total, a derived total by more when little is
//     used).
//   - A value that is negative, not finite or beyond uint64 is left out (a
//     fraction is rounded half away from zero). A rank without a complete
//     pair with a positive total reports what it has: the largest used,
//     the smallest positive total. A dp_rank label that is not a decimal
//     uint32 makes its series unusable.
//
// The leading signals (leading.go): the request gauges, the retraction
// counter and the prompt tokens computed, by the dp_rank label, a rank's
// scheduler replicas never summed; a rank named only by them is a rank too
// (its KV fields unset).
//
// SGLang exposes no count of tokens being prefilled (num_queue_reqs counts
// requests) and no batch-token capacity, so ActivePrefillTokens and
// MaxNumBatchedTokens stay unset.
type SGLang struct{}

// Engine returns EngineSGLang.
func (SGLang) Engine() string { return EngineSGLang }

// sglangSeries is one scheduler's used and total tokens, and its usage
// fraction.
type sglangSeries struct {
	used, total                 uint64
	usage                       float64
	hasUsed, hasTotal, hasUsage bool
}

// derive fills a missing used or total from the usage fraction.
func (s *sglangSeries) derive() {
	if !s.hasUsage {
		return
	}
	switch {
	case !s.hasUsed && s.hasTotal:
		if n, ok := count(s.usage * float64(s.total)); ok {
			s.used, s.hasUsed = n, true
		}
	case s.hasUsed && !s.hasTotal && s.used > 0 && s.usage > 0:
		if n, ok := count(float64(s.used) / s.usage); ok && n > 0 {
			s.total, s.hasTotal = n, true
		}
	}
}

// Loads returns the load of every rank named by the used or the total
// metric, or by a leading signal.
func (SGLang) Loads(fams Families) Snapshot {
	// Rank → label signature → series.
	ranks := map[uint32]map[string]*sglangSeries{}
	// read applies set to each sample of the metric name; with onlyKnown,
	// to the series that the metrics read before named, without naming
	// new ones.
	read := func(name string, onlyKnown bool, set func(s *sglangSeries, v float64)) {
		mf := fams[name]
		if mf == nil {
			return
		}
		for _, m := range mf.GetMetric() {
			rank, ok := rankOf(m, SGLangRankLabel)
			if !ok {
				continue
			}
			bySig := ranks[rank]
			if bySig == nil {
				if onlyKnown {
					continue
				}
				bySig = map[string]*sglangSeries{}
				ranks[rank] = bySig
			}
			sig := signature(m)
			s := bySig[sig]
			if s == nil {
				if onlyKnown {
					continue
				}
				s = &sglangSeries{}
				bySig[sig] = s
			}
			if v, ok := sampleValue(m); ok && v >= 0 {
				set(s, v)
			}
		}
	}
	read(SGLangUsedMetric, false, func(s *sglangSeries, v float64) {
		if n, ok := count(v); ok {
			s.used, s.hasUsed = max(s.used, n), true
		}
	})
	read(SGLangTotalMetric, false, func(s *sglangSeries, v float64) {
		if n, ok := count(v); ok && n > 0 && (!s.hasTotal || n < s.total) {
			s.total, s.hasTotal = n, true
		}
	})
	read(SGLangUsageMetric, true, func(s *sglangSeries, v float64) {
		s.usage, s.hasUsage = max(s.usage, v), true
	})

	lead := sglangLeading(fams)
	named := map[uint32]bool{}
	lead.ranks(named)
	for r := range named {
		if ranks[r] == nil {
			ranks[r] = map[string]*sglangSeries{}
		}
	}

	snap := Snapshot{Ranks: make([]RankLoad, 0, len(ranks))}
	if len(ranks) > 0 {
		snap.BlockSize = 1
	}
	for _, r := range sortedRanks(ranks) {
		for _, s := range ranks[r] {
			s.derive()
		}
		rl := sglangRank(r, ranks[r])
		lead.fill(&rl)
		snap.Ranks = append(snap.Ranks, rl)
	}
	return snap
}

// sglangRank picks a rank's load among its series.
func sglangRank(rank uint32, bySig map[string]*sglangSeries) RankLoad {
	rl := RankLoad{Rank: rank}
	sigs := make([]string, 0, len(bySig))
	for sig := range bySig {
		sigs = append(sigs, sig)
	}
	slices.Sort(sigs) // a deterministic choice among equal ratios

	var best *sglangSeries
	for _, sig := range sigs {
		s := bySig[sig]
		if !s.hasUsed || !s.hasTotal {
			continue
		}
		// s.used/s.total > best.used/best.total, without dividing.
		if best == nil || float64(s.used)*float64(best.total) > float64(best.used)*float64(s.total) {
			best = s
		}
	}
	if best != nil {
		rl.ActiveDecodeBlocks, rl.KVTotalBlocks = events.Some(best.used), events.Some(best.total)
		return rl
	}
	for _, sig := range sigs {
		s := bySig[sig]
		if s.hasUsed && (!rl.ActiveDecodeBlocks.Set || s.used > rl.ActiveDecodeBlocks.Value) {
			rl.ActiveDecodeBlocks = events.Some(s.used)
		}
		if s.hasTotal && (!rl.KVTotalBlocks.Set || s.total < rl.KVTotalBlocks.Value) {
			rl.KVTotalBlocks = events.Some(s.total)
		}
	}
	return rl
}

// signature identifies a series by its labels, in the order the names sort.
func signature(m *dto.Metric) string {
	pairs := make([]string, 0, len(m.GetLabel()))
	for _, lp := range m.GetLabel() {
		pairs = append(pairs, lp.GetName()+"\xff"+lp.GetValue())
	}
	slices.Sort(pairs)
	return strings.Join(pairs, "\xfe")
}
