// Package scrape turns an inference engine's Prometheus exposition (its
// /metrics page) into the load of each of its data-parallel ranks, in the
// units of the wire contract (contract §13). It is pure: Parse reads bytes,
// a Mapping reads parsed metric families, and nothing here talks to the
// network or reads a clock; package scrape/adapter polls an engine and
// publishes what a Mapping finds.
//
// A Mapping knows one engine's metric names and labels:
//
//   - VLLM: rank = the engine label (0 when absent); total blocks = the
//     integer num_gpu_blocks label of vllm:cache_config_info; used blocks =
//     round(vllm:kv_cache_usage_perc × total), or of the older
//     vllm:gpu_cache_usage_perc for a rank the current name does not name.
//   - SGLang: rank = the dp_rank label (0 when absent); used =
//     sglang:num_used_tokens, total = sglang:max_total_num_tokens (blocks of
//     one token), the one that older versions lack derived from
//     sglang:token_usage; of a rank's several series (tp_rank, pp_rank,
//     moe_ep_rank) the one with the highest used / total counts, never
//     their sum.
//
// Both also read the leading signals of contract §21 (requests waiting and
// running, preemptions, prompt tokens computed; leading.go has the names).
//
// A field the exposition does not give is left out of the load (its
// events.Optional is unset, its Counter nil), never reported as 0.
//
//	fams, err := scrape.Parse(resp.Body)
//	...
//	snap := scrape.VLLM{}.Loads(fams)
//	for _, r := range snap.Ranks { ... r.Rank, r.ActiveDecodeBlocks ... }
package scrape

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/workermon/workermon/events"
)

// Sentinel errors.
var (
	// ErrUnknownEngine: ForEngine was given a name no Mapping has.
	ErrUnknownEngine = errors.New("unknown engine")
	// ErrParse: the exposition is not valid Prometheus text format.
	ErrParse = errors.New("invalid exposition")
)

// Families is a parsed exposition: its metric families by name.
type Families map[string]*dto.MetricFamily

// Parse reads a Prometheus text exposition (format 0.0.4, metric and label
// names in UTF-8) with the Prometheus library's parser. The error wraps
// ErrParse and names the line; a partial result is never returned, as the
// Prometheus server, too, rejects a scrape it cannot parse whole.
//
// Three differences of form that carry no meaning are smoothed before the
// parser sees the bytes, because saved pages have them: a last line
// without its newline gets one, a leading UTF-8 byte-order mark is
// dropped, and CR LF line ends become LF. A page cut short in transit is
// the HTTP layer's to catch (the body read fails), not the parser's.
//
// The OpenMetrics text that prometheus_client writes for these engines'
// counters, gauges, histograms and summaries (when a client asks for it)
// also parses: "# EOF" is a comment to the text parser, and each _total
// and _created sample becomes a family of its own. OpenMetrics-only syntax
// (exemplars, float timestamps, the info, stateset and unknown types) is
// an error.
func Parse(r io.Reader) (Families, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(newLineReader(r))
	if err != nil {
		return nil, fmt.Errorf("scrape: parse exposition: %w: %w", ErrParse, err)
	}
	return Families(fams), nil
}

// lineReader passes r through, dropping a leading UTF-8 byte-order mark
// and the CR of every CR LF, and adding a final LF when the input does not
// end with one. A raw CR LF cannot sit inside a valid sample (a label
// value writes a line feed as \n), so only line ends change.
type lineReader struct {
	r       *bufio.Reader
	started bool // the byte-order mark has been looked for
	last    byte // the last byte given out; 0 before any
	done    bool // r is exhausted and the final LF, if due, was given
}

func newLineReader(r io.Reader) *lineReader { return &lineReader{r: bufio.NewReader(r)} }

// Read fills p one byte at a time from the buffered reader.
func (l *lineReader) Read(p []byte) (int, error) {
	if !l.started {
		l.started = true
		if bom, err := l.r.Peek(3); err == nil && string(bom) == "\ufeff" {
			_, _ = l.r.Discard(3)
		}
	}
	n := 0
	for n < len(p) {
		if l.done {
			break
		}
		c, err := l.r.ReadByte()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return n, err
			}
			l.done = true
			if l.last != 0 && l.last != '\n' {
				p[n], l.last = '\n', '\n'
				n++
			}
			break
		}
		if c == '\r' {
			if next, err := l.r.Peek(1); err == nil && next[0] == '\n' {
				continue
			}
		}
		p[n], l.last = c, c
		n++
	}
	if n == 0 && l.done {
		return 0, io.EOF
	}
	return n, nil
}

// RankLoad is one rank's load as the exposition gives it. An unset field is
// one the engine does not expose (or exposes in a form that cannot be
// read): it is left out of the reports.
type RankLoad struct {
	Rank                uint32
	ActiveDecodeBlocks  events.Optional // KV-cache blocks in use
	KVTotalBlocks       events.Optional // KV-cache blocks in total
	ActivePrefillTokens events.Optional // tokens being prefilled
	MaxNumBatchedTokens events.Optional // batch-token capacity

	// The leading signals of contract §21 (see leading.go): the requests
	// waiting and running, and the engine's counters of preemptions and
	// prompt tokens computed, series by series (a CounterSum makes the
	// reports' counters of them).
	WaitingRequests events.Optional
	RunningRequests events.Optional
	Preemptions     Counter
	PrefilledTokens Counter
}

// Snapshot is what a Mapping reads from one exposition.
type Snapshot struct {
	// Ranks holds every rank the exposition names, ascending, each once.
	Ranks []RankLoad
	// BlockSize is the number of tokens per block of the loads' block
	// counts when the engine says (0: unknown).
	BlockSize uint32
}

// A Mapping reads one engine's load from its exposition. Implementations
// are pure and safe for concurrent use.
type Mapping interface {
	// Engine returns the engine's name, as --engine takes it.
	Engine() string
	// Loads returns every rank's load found in fams.
	Loads(fams Families) Snapshot
}

var (
	_ Mapping = VLLM{}
	_ Mapping = SGLang{}
)

// Engines returns the names ForEngine knows, sorted.
func Engines() []string { return []string{EngineSGLang, EngineVLLM} }

// ForEngine returns the Mapping of the engine name ("vllm", "sglang"); the
// error wraps ErrUnknownEngine.
func ForEngine(name string) (Mapping, error) {
	switch name {
	case EngineVLLM:
		return VLLM{}, nil
	case EngineSGLang:
		return SGLang{}, nil
	}
	return nil, fmt.Errorf("scrape: engine %q: %w (known: %s)", name, ErrUnknownEngine, strings.Join(Engines(), ", "))
}

// sampleValue returns the value of a gauge, untyped or counter sample; ok is
// false for other types and for values that are not finite.
func sampleValue(m *dto.Metric) (v float64, ok bool) {
	switch {
	case m.GetGauge() != nil:
		v = m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		v = m.GetUntyped().GetValue()
	case m.GetCounter() != nil:
		v = m.GetCounter().GetValue()
	default:
		return 0, false
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return v, true
}

// label returns the value of the label name of m and whether it is there.
func label(m *dto.Metric, name string) (string, bool) {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue(), true
		}
	}
	return "", false
}

// rankOf reads the rank label of m: absent or empty is rank 0, a label that
// is not a decimal uint32 makes the series unusable (ok false).
func rankOf(m *dto.Metric, name string) (rank uint32, ok bool) {
	v, present := label(m, name)
	if !present || v == "" {
		return 0, true
	}
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil {
		return 0, false
	}
	return uint32(n), true
}

// count converts a non-negative finite v to a whole count, rounded half
// away from zero; ok is false when it does not fit a uint64.
func count(v float64) (uint64, bool) {
	if math.IsNaN(v) || v < 0 {
		return 0, false
	}
	r := math.Round(v)
	if r >= math.Exp2(64) { // also +Inf
		return 0, false
	}
	return uint64(r), true
}

// sortedRanks returns the keys of m ascending.
func sortedRanks[V any](m map[uint32]V) []uint32 {
	ranks := make([]uint32, 0, len(m))
	for r := range m {
		ranks = append(ranks, r)
	}
	slices.Sort(ranks)
	return ranks
}
