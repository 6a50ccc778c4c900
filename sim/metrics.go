package sim

import (
	"net/http"
	"strconv"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// The part of vLLM's Prometheus page (V1 engine) that a Worker serves at
// GET /metrics, so that `workermon scrape --engine vllm` can read a
// simulated engine as it reads a real one. Names, HELP texts and labels are
// vLLM's; the engine label is the data-parallel rank.
const (
	vllmRunning     = "vllm:num_requests_running"
	vllmWaiting     = "vllm:num_requests_waiting"
	vllmUsage       = "vllm:kv_cache_usage_perc"
	vllmCacheConfig = "vllm:cache_config_info"
)

// handleMetrics serves the worker's load as vLLM would: per rank, the
// requests running and waiting, the fraction of KV-cache blocks in use
// (blocks filled / blocks in total, from the engine loop's last snapshot),
// and vllm:cache_config_info with the rank's num_gpu_blocks and the block
// size.
func (w *Worker) handleMetrics(rw http.ResponseWriter, _ *http.Request) {
	s := w.Stats()
	gauge := func(name, help string) *dto.MetricFamily {
		return &dto.MetricFamily{Name: ptr(name), Help: ptr(help), Type: dto.MetricType_GAUGE.Enum()}
	}
	running := gauge(vllmRunning, "Number of requests in model execution batches.")
	waiting := gauge(vllmWaiting, "Number of requests waiting to be processed.")
	usage := gauge(vllmUsage, "KV-cache usage. 1 means 100 percent usage.")
	info := gauge(vllmCacheConfig, "Information of the LLMEngine CacheConfig")
	blockSize := strconv.Itoa(w.cfg.Engine.BlockSize)
	for _, r := range s.Ranks {
		engine := strconv.FormatUint(uint64(r.Rank), 10)
		labels := []*dto.LabelPair{
			{Name: ptr("engine"), Value: ptr(engine)},
			{Name: ptr("model_name"), Value: ptr(s.Model)},
		}
		sample := func(mf *dto.MetricFamily, v float64) {
			mf.Metric = append(mf.Metric, &dto.Metric{Label: labels, Gauge: &dto.Gauge{Value: ptr(v)}})
		}
		sample(running, float64(r.Running))
		sample(waiting, float64(r.Waiting))
		used := 0.0
		if r.KVTotalBlocks > 0 {
			used = float64(r.ActiveDecodeBlocks) / float64(r.KVTotalBlocks)
		}
		sample(usage, used)
		info.Metric = append(info.Metric, &dto.Metric{
			Label: []*dto.LabelPair{
				{Name: ptr("block_size"), Value: ptr(blockSize)},
				{Name: ptr("engine"), Value: ptr(engine)},
				{Name: ptr("num_gpu_blocks"), Value: ptr(strconv.FormatUint(r.KVTotalBlocks, 10))},
			},
			Gauge: &dto.Gauge{Value: ptr(1.0)},
		})
	}
	rw.Header().Set("Content-Type", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	for _, mf := range []*dto.MetricFamily{running, waiting, usage, info} {
		if _, err := expfmt.MetricFamilyToText(rw, mf); err != nil {
			return // the client went away
		}
	}
}

// ptr returns a pointer to v, as the protobuf-generated types want.
func ptr[T any](v T) *T { return &v }
