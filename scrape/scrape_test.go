package scrape_test

import (
	"bytes"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/scrape"
)

// rank builds a RankLoad with used and total set; a negative value leaves
// the field unset.
func rank(r uint32, used, total int64) scrape.RankLoad {
	rl := scrape.RankLoad{Rank: r}
	if used >= 0 {
		rl.ActiveDecodeBlocks = events.Some(uint64(used))
	}
	if total >= 0 {
		rl.KVTotalBlocks = events.Some(uint64(total))
	}
	return rl
}

func parseFile(t *testing.T, name string) scrape.Families {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fams, err := scrape.Parse(f)
	if err != nil {
		t.Fatalf("parse %s: %v", name, err)
	}
	return fams
}

func parseText(t *testing.T, text string) scrape.Families {
	t.Helper()
	fams, err := scrape.Parse(strings.NewReader(text))
	if err != nil {
		t.Fatalf("parse: %v\n%s", err, text)
	}
	return fams
}

// kvOnly returns snap without the leading signals of §21 (leading_test.go
// tests them).
func kvOnly(snap scrape.Snapshot) scrape.Snapshot {
	for i := range snap.Ranks {
		r := &snap.Ranks[i]
		r.WaitingRequests, r.RunningRequests, r.Preemptions, r.PrefilledTokens = events.Optional{}, events.Optional{}, nil, nil
	}
	return snap
}

// The fixtures (testdata/README.md says where they come from) give the
// loads the contract's mapping asks for.
func TestFixtures(t *testing.T) {
	t.Parallel()
	tests := []struct {
		file   string
		engine string
		want   scrape.Snapshot
	}{
		{"vllm-v1.metrics", "vllm", scrape.Snapshot{BlockSize: 16,
			Ranks: []scrape.RankLoad{rank(0, 6906, 27264)}}},
		{"vllm-v1-dp2.metrics", "vllm", scrape.Snapshot{BlockSize: 16,
			Ranks: []scrape.RankLoad{rank(0, 13248, 18432), rank(1, 867, 18432)}}},
		{"sglang.metrics", "sglang", scrape.Snapshot{BlockSize: 1,
			Ranks: []scrape.RankLoad{rank(0, 123859, 463616)}}},
		{"sglang-dp2-tp4.metrics", "sglang", scrape.Snapshot{BlockSize: 1,
			Ranks: []scrape.RankLoad{rank(0, 52310, 262144), rank(1, 201344, 262144)}}},
		// V0 engine: only gpu_cache_usage_perc, no engine label anywhere.
		// 0.610320238095238 × 26880 = 16405.4 → 16405.
		{"vllm-v0.metrics", "vllm", scrape.Snapshot{BlockSize: 16,
			Ranks: []scrape.RankLoad{rank(0, 16405, 26880)}}},
		// V1 of spring 2025: num_gpu_blocks "None", so nothing to report
		// but the rank.
		{"vllm-v1-early.metrics", "vllm", scrape.Snapshot{BlockSize: 16,
			Ranks: []scrape.RankLoad{rank(0, -1, -1)}}},
		// OpenMetrics, as prometheus_client writes it: 0.3125 × 27264.
		{"vllm-v1-openmetrics.metrics", "vllm", scrape.Snapshot{BlockSize: 16,
			Ranks: []scrape.RankLoad{rank(0, 8520, 27264)}}},
		// No num_used_tokens: round(0.42 × 161721) = round(67922.82).
		{"sglang-2024-name-label.metrics", "sglang", scrape.Snapshot{BlockSize: 1,
			Ranks: []scrape.RankLoad{rank(0, 67923, 161721)}}},
		// No max_total_num_tokens: round(171233 / 0.42) = round(407697.6).
		{"sglang-2025-no-total.metrics", "sglang", scrape.Snapshot{BlockSize: 1,
			Ranks: []scrape.RankLoad{rank(0, 171233, 407698)}}},
		// The other engine's mapping finds nothing in a page.
		{"vllm-v1.metrics", "sglang", scrape.Snapshot{Ranks: []scrape.RankLoad{}}},
		{"sglang.metrics", "vllm", scrape.Snapshot{Ranks: []scrape.RankLoad{}}},
	}
	for _, tt := range tests {
		t.Run(tt.engine+"/"+tt.file, func(t *testing.T) {
			t.Parallel()
			m, err := scrape.ForEngine(tt.engine)
			if err != nil {
				t.Fatal(err)
			}
			got := kvOnly(m.Loads(parseFile(t, tt.file)))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Loads\n got %+v\nwant %+v", got, tt.want)
			}
			for _, r := range got.Ranks {
				if r.ActivePrefillTokens.Set || r.MaxNumBatchedTokens.Set {
					t.Errorf("rank %d: prefill fields %+v, %+v: the engine exposes neither", r.Rank,
						r.ActivePrefillTokens, r.MaxNumBatchedTokens)
				}
			}
		})
	}
}

const vllmHead = "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
const vllmInfoHead = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"

func TestVLLMMapping(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		text string
		want scrape.Snapshot
	}{
		{
			name: "no engine label is rank 0",
			text: vllmHead + "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n" +
				vllmInfoHead + "vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"1000\"} 1.0\n",
			want: scrape.Snapshot{BlockSize: 32, Ranks: []scrape.RankLoad{rank(0, 500, 1000)}},
		},
		{
			name: "rounding half away from zero",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.125\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.124\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"100\"} 1\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"100\"} 1\n",
			// 12.5 → 13 (0.125 is exact in binary); 12.4 → 12
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, 13, 100), rank(1, 12, 100)}},
		},
		{
			name: "num_gpu_blocks None: total and used left out",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n" +
				vllmInfoHead + "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"None\"} 1.0\n",
			want: scrape.Snapshot{BlockSize: 16, Ranks: []scrape.RankLoad{rank(0, -1, -1)}},
		},
		{
			name: "num_gpu_blocks not an integer, negative or zero",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"2\"} 0.5\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"12.5\"} 1\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"-4\"} 1\nvllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"0\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, -1, -1), rank(1, -1, -1), rank(2, -1, -1)}},
		},
		{
			name: "no cache config at all",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.9\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, -1, -1)}},
		},
		{
			name: "total without usage",
			text: vllmInfoHead + "vllm:cache_config_info{engine=\"3\",num_gpu_blocks=\"64\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(3, -1, 64)}},
		},
		{
			name: "usage NaN, negative or infinite: used left out",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\nvllm:kv_cache_usage_perc{engine=\"1\"} -0.1\nvllm:kv_cache_usage_perc{engine=\"2\"} +Inf\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"10\"} 1\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"10\"} 1\nvllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"10\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, -1, 10), rank(1, -1, 10), rank(2, -1, 10)}},
		},
		{
			name: "usage 0 is a real 0",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.0\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"10\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, 0, 10)}},
		},
		{
			name: "engine label that is no rank is skipped",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"x\"} 0.9\nvllm:kv_cache_usage_perc{engine=\"4294967296\"} 0.9\nvllm:kv_cache_usage_perc{engine=\"2\"} 0.5\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"10\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(2, 5, 10)}},
		},
		{
			name: "repeated series: highest usage, smallest total",
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.2\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"b\"} 0.6\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"200\",x=\"1\"} 1\nvllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"100\",x=\"2\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, 60, 100)}},
		},
		{
			name: "block sizes that disagree are unknown",
			text: vllmInfoHead + "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10\"} 1\nvllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"10\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, -1, 10), rank(1, -1, 10)}},
		},
		{
			name: "untyped samples (no TYPE line) count",
			text: "vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\nvllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"8\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, 2, 8)}},
		},
		{
			name: "the legacy gpu_cache_usage_perc stands in when kv_cache_usage_perc is absent",
			text: "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.25\nvllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"8\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, 2, 8)}},
		},
		{
			name: "kv_cache_usage_perc wins over the legacy name, rank by rank",
			// Rank 0 has both (0.5 wins over 0.9); rank 1 only the legacy
			// name; rank 2 a current series that is NaN, so nothing.
			text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"2\"} NaN\n" +
				"vllm:gpu_cache_usage_perc{engine=\"0\"} 0.9\nvllm:gpu_cache_usage_perc{engine=\"1\"} 0.25\nvllm:gpu_cache_usage_perc{engine=\"2\"} 0.75\n" +
				vllmInfoHead + "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"100\"} 1\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"100\"} 1\nvllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"100\"} 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{rank(0, 50, 100), rank(1, 25, 100), rank(2, -1, 100)}},
		},
		{
			name: "a cache config without engine label is every rank's that has none",
			// vLLM before the engine label reached cache_config_info: one
			// configuration for the engines behind the API server. Rank 2
			// has a series of its own, "None": it keeps that.
			text: "vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\nvllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25\nvllm:gpu_cache_usage_perc{engine=\"2\",model_name=\"m\"} 0.25\n" +
				vllmInfoHead + "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1.0\nvllm:cache_config_info{block_size=\"16\",engine=\"2\",num_gpu_blocks=\"None\"} 1.0\n",
			want: scrape.Snapshot{BlockSize: 16, Ranks: []scrape.RankLoad{rank(0, 500, 1000), rank(1, 250, 1000), rank(2, -1, -1)}},
		},
		{
			name: "V0 page: model_name only, legacy usage, unlabelled cache config",
			text: "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.0\n" +
				vllmInfoHead + "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_cpu_blocks=\"7281\",num_gpu_blocks=\"24188\",sliding_window=\"None\",swap_space_bytes=\"4294967296\"} 1.0\n",
			want: scrape.Snapshot{BlockSize: 16, Ranks: []scrape.RankLoad{rank(0, 0, 24188)}},
		},
		{
			name: "nothing of vLLM",
			text: "# TYPE up gauge\nup 1\n",
			want: scrape.Snapshot{Ranks: []scrape.RankLoad{}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := scrape.VLLM{}.Loads(parseText(t, tt.text))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Loads\n got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestSGLangMapping(t *testing.T) {
	t.Parallel()
	used := "# TYPE sglang:num_used_tokens gauge\n"
	total := "# TYPE sglang:max_total_num_tokens gauge\n"
	tests := []struct {
		name string
		text string
		want []scrape.RankLoad
	}{
		{
			name: "no dp_rank is rank 0",
			text: used + "sglang:num_used_tokens{tp_rank=\"0\"} 10\n" + total + "sglang:max_total_num_tokens{tp_rank=\"0\"} 100\n",
			want: []scrape.RankLoad{rank(0, 10, 100)},
		},
		{
			name: "the series with the highest used/total counts, never the sum",
			// pp stage 1 has the smaller pool and the higher ratio (30/50 > 40/100).
			text: used + "sglang:num_used_tokens{dp_rank=\"0\",pp_rank=\"0\"} 40\nsglang:num_used_tokens{dp_rank=\"0\",pp_rank=\"1\"} 30\n" +
				total + "sglang:max_total_num_tokens{dp_rank=\"0\",pp_rank=\"0\"} 100\nsglang:max_total_num_tokens{dp_rank=\"0\",pp_rank=\"1\"} 50\n",
			want: []scrape.RankLoad{rank(0, 30, 50)},
		},
		{
			name: "pairs are matched by their labels, per rank",
			text: used + "sglang:num_used_tokens{dp_rank=\"1\",tp_rank=\"2\"} 90\nsglang:num_used_tokens{dp_rank=\"1\",tp_rank=\"3\"} 10\nsglang:num_used_tokens{dp_rank=\"0\",tp_rank=\"0\"} 5\n" +
				total + "sglang:max_total_num_tokens{dp_rank=\"1\",tp_rank=\"3\"} 1000\nsglang:max_total_num_tokens{dp_rank=\"1\",tp_rank=\"2\"} 100\nsglang:max_total_num_tokens{dp_rank=\"0\",tp_rank=\"0\"} 10\n",
			want: []scrape.RankLoad{rank(0, 5, 10), rank(1, 90, 100)},
		},
		{
			name: "only used: total left out",
			text: used + "sglang:num_used_tokens{dp_rank=\"0\"} 7\n",
			want: []scrape.RankLoad{rank(0, 7, -1)},
		},
		{
			name: "only total: used left out",
			text: total + "sglang:max_total_num_tokens{dp_rank=\"0\"} 70\n",
			want: []scrape.RankLoad{rank(0, -1, 70)},
		},
		{
			name: "total 0 is no pair; incomplete series give the largest used and smallest total",
			text: used + "sglang:num_used_tokens{a=\"1\"} 3\nsglang:num_used_tokens{a=\"2\"} 9\n" +
				total + "sglang:max_total_num_tokens{a=\"1\"} 0\nsglang:max_total_num_tokens{a=\"3\"} 80\nsglang:max_total_num_tokens{a=\"4\"} 60\n",
			want: []scrape.RankLoad{rank(0, 9, 60)},
		},
		{
			name: "fractions rounded; negative, NaN and huge values left out",
			text: used + "sglang:num_used_tokens{dp_rank=\"0\"} 10.5\nsglang:num_used_tokens{dp_rank=\"1\"} -1\nsglang:num_used_tokens{dp_rank=\"2\"} NaN\nsglang:num_used_tokens{dp_rank=\"3\"} 1e30\n" +
				total + "sglang:max_total_num_tokens{dp_rank=\"0\"} 100\nsglang:max_total_num_tokens{dp_rank=\"1\"} 100\nsglang:max_total_num_tokens{dp_rank=\"2\"} 100\nsglang:max_total_num_tokens{dp_rank=\"3\"} 100\n",
			want: []scrape.RankLoad{rank(0, 11, 100), rank(1, -1, 100), rank(2, -1, 100), rank(3, -1, 100)},
		},
		{
			name: "no num_used_tokens: used = round(token_usage × total)",
			// SGLang of late 2024 (label name, not model_name).
			text: "sglang:token_usage{name=\"m\"} 0.42\n" + total + "sglang:max_total_num_tokens{name=\"m\"} 161721.0\n",
			want: []scrape.RankLoad{rank(0, 67923, 161721)},
		},
		{
			name: "no max_total_num_tokens: total = round(used / token_usage)",
			text: used + "sglang:num_used_tokens{dp_rank=\"0\",tp_rank=\"0\"} 171233.0\nsglang:num_used_tokens{dp_rank=\"1\",tp_rank=\"0\"} 100\n" +
				"sglang:token_usage{dp_rank=\"0\",tp_rank=\"0\"} 0.42\nsglang:token_usage{dp_rank=\"1\",tp_rank=\"0\"} 0.5\n",
			want: []scrape.RankLoad{rank(0, 171233, 407698), rank(1, 100, 200)},
		},
		{
			name: "token_usage 0, or used 0: no total can be derived",
			text: used + "sglang:num_used_tokens{dp_rank=\"0\"} 12\nsglang:num_used_tokens{dp_rank=\"1\"} 0\n" +
				"sglang:token_usage{dp_rank=\"0\"} 0.0\nsglang:token_usage{dp_rank=\"1\"} 0.3\n",
			want: []scrape.RankLoad{rank(0, 12, -1), rank(1, 0, -1)},
		},
		{
			name: "both gauges present: token_usage is not read",
			text: used + "sglang:num_used_tokens{tp_rank=\"0\"} 10\n" + total + "sglang:max_total_num_tokens{tp_rank=\"0\"} 100\n" +
				"sglang:token_usage{tp_rank=\"0\"} 0.9\n",
			want: []scrape.RankLoad{rank(0, 10, 100)},
		},
		{
			name: "token_usage pairs only with a series of the same labels and names no rank",
			text: used + "sglang:num_used_tokens{dp_rank=\"0\",tp_rank=\"0\"} 50\n" +
				"sglang:token_usage{dp_rank=\"0\",tp_rank=\"1\"} 0.5\nsglang:token_usage{dp_rank=\"3\"} 0.5\n",
			want: []scrape.RankLoad{rank(0, 50, -1)},
		},
		{
			name: "token_usage negative, NaN or infinite is not used",
			text: "sglang:token_usage{dp_rank=\"0\"} -0.5\nsglang:token_usage{dp_rank=\"1\"} NaN\nsglang:token_usage{dp_rank=\"2\"} +Inf\n" +
				total + "sglang:max_total_num_tokens{dp_rank=\"0\"} 100\nsglang:max_total_num_tokens{dp_rank=\"1\"} 100\nsglang:max_total_num_tokens{dp_rank=\"2\"} 100\n",
			want: []scrape.RankLoad{rank(0, -1, 100), rank(1, -1, 100), rank(2, -1, 100)},
		},
		{
			name: "dp_rank that is no rank is skipped",
			text: used + "sglang:num_used_tokens{dp_rank=\"-1\"} 1\nsglang:num_used_tokens{dp_rank=\"4\"} 2\n" +
				total + "sglang:max_total_num_tokens{dp_rank=\"4\"} 20\n",
			want: []scrape.RankLoad{rank(4, 2, 20)},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := scrape.SGLang{}.Loads(parseText(t, tt.text))
			want := scrape.Snapshot{BlockSize: 1, Ranks: tt.want}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("Loads\n got %+v\nwant %+v", got, want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	for _, text := range []string{
		"vllm:kv_cache_usage_perc{engine=\"0\" 0.5\n",                   // unclosed labels
		"vllm:kv_cache_usage_perc{engine=\"0\"} half\n",                 // not a number
		"# TYPE x gauge\n# TYPE x counter\nx 1\n",                       // second TYPE
		"<html><body>404 Not Found</body></html>\n",                     // not an exposition
		"vllm:kv_cache_usage_perc{engine=\"0\",engine=\"1\"} 0.5\n",     // duplicate label
		"vllm:kv_cache_usage_perc{engine=\"0\"} 0.5 12 extra\n",         // junk after timestamp
		"vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usa", // cut short
		"vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\r\r\n",              // a CR that is not a line end
		// OpenMetrics-only syntax the text parser does not take:
		"# TYPE c counter\nc_total 1.0 # {trace_id=\"a\"} 1.0\n# EOF\n", // exemplar
		"vllm:kv_cache_usage_perc{engine=\"0\"} 0.5 1700000000.123\n",   // float timestamp
		"# TYPE build info\nbuild_info{version=\"1\"} 1.0\n# EOF\n",     // info type
	} {
		if _, err := scrape.Parse(strings.NewReader(text)); !errors.Is(err, scrape.ErrParse) {
			t.Errorf("Parse(%q) = %v, want ErrParse", text, err)
		}
	}
	// Quoted UTF-8 names (the newer text format) parse.
	fams, err := scrape.Parse(strings.NewReader("{\"vllm:kv_cache_usage_perc\",engine=\"0\"} 0.5\n"))
	if err != nil || fams["vllm:kv_cache_usage_perc"] == nil {
		t.Errorf("quoted metric name: %v, %v", fams, err)
	}
}

// A saved page differs from the served one in ways that carry no meaning:
// no newline after its last line, CR LF line ends, a byte-order mark. Each
// fixture, so altered, maps exactly as the original.
func TestParseSavedPages(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob(filepath.Join("testdata", "*.metrics"))
	if err != nil || len(files) == 0 {
		t.Fatalf("fixtures: %v, %v", files, err)
	}
	alter := map[string]func([]byte) []byte{
		"no final newline": func(b []byte) []byte { return bytes.TrimRight(b, "\n") },
		"CR LF":            func(b []byte) []byte { return bytes.ReplaceAll(b, []byte("\n"), []byte("\r\n")) },
		"byte-order mark":  func(b []byte) []byte { return append([]byte("\ufeff"), b...) },
		"all three": func(b []byte) []byte {
			return append([]byte("\ufeff"), bytes.ReplaceAll(bytes.TrimRight(b, "\n"), []byte("\n"), []byte("\r\n"))...)
		},
	}
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for how, f := range alter {
			t.Run(filepath.Base(file)+"/"+how, func(t *testing.T) {
				t.Parallel()
				orig := parseText(t, string(data))
				fams, err := scrape.Parse(bytes.NewReader(f(bytes.Clone(data))))
				if err != nil {
					t.Fatalf("parse: %v", err)
				}
				if len(fams) != len(orig) {
					t.Errorf("%d families, want %d", len(fams), len(orig))
				}
				for _, m := range []scrape.Mapping{scrape.VLLM{}, scrape.SGLang{}} {
					if got, want := m.Loads(fams), m.Loads(orig); !reflect.DeepEqual(got, want) {
						t.Errorf("%s: Loads\n got %+v\nwant %+v", m.Engine(), got, want)
					}
				}
			})
		}
	}
}

// The OpenMetrics page and the classic page of the same engine state give
// the same load: the _total and _created samples, the # EOF line and the
// counter families named without _total do not disturb the mapping.
func TestOpenMetricsPage(t *testing.T) {
	t.Parallel()
	om := parseFile(t, "vllm-v1-openmetrics.metrics")
	if om["vllm:prompt_tokens_total"] == nil || om["vllm:prompt_tokens_created"] == nil {
		t.Errorf("counter samples missing: %v", slices.Sorted(maps.Keys(om)))
	}
	classic := parseText(t, "# TYPE vllm:kv_cache_usage_perc gauge\n"+
		"vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 0.3125\n"+
		"# TYPE vllm:cache_config_info gauge\n"+
		"vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"27264\"} 1.0\n"+
		// The leading signals: a counter's family is named without _total
		// in OpenMetrics, its sample with it, as in the classic text.
		"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 4.0\n"+
		"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 0.0\n"+
		"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 0.0\n"+
		"# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 9216.0\n")
	if got, want := (scrape.VLLM{}).Loads(om), (scrape.VLLM{}).Loads(classic); !reflect.DeepEqual(got, want) {
		t.Errorf("Loads\n got %+v\nwant %+v", got, want)
	}
}

func TestForEngine(t *testing.T) {
	t.Parallel()
	for _, name := range scrape.Engines() {
		m, err := scrape.ForEngine(name)
		if err != nil || m.Engine() != name {
			t.Errorf("ForEngine(%q) = %v, %v", name, m, err)
		}
	}
	if _, err := scrape.ForEngine("tgi"); !errors.Is(err, scrape.ErrUnknownEngine) {
		t.Errorf("ForEngine(tgi) = %v, want ErrUnknownEngine", err)
	}
}

func BenchmarkParseAndMap(b *testing.B) {
	data, err := os.ReadFile(filepath.Join("testdata", "vllm-v1-dp2.metrics"))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		fams, err := scrape.Parse(strings.NewReader(string(data)))
		if err != nil {
			b.Fatal(err)
		}
		_ = scrape.VLLM{}.Loads(fams)
	}
}
