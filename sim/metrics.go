package sim

import (
	"cmp"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"

	"github.com/workermon/workermon/sim/stepengine"
)

// The part of vLLM's Prometheus page (V1 engine) that a Worker serves at
// GET /metrics, so that `workermon scrape --engine vllm` can read a
// simulated engine as it reads a real one. Names, HELP texts and labels are
// vLLM's; the engine label is the data-parallel rank.
const (
	vllmRunning     = stepengine.MetricRunning
	vllmWaiting     = stepengine.MetricWaiting
	vllmPreemptions = stepengine.MetricPreemptions
	vllmUsage       = "vllm:kv_cache_usage_perc"
	vllmCacheConfig = "vllm:cache_config_info"
)

// Labels of vLLM's per-engine metrics.
const (
	labelModel  = "model_name"
	labelEngine = "engine"
)

// latencyMetrics are vLLM's latency histograms of one worker, per rank
// (engine label = the rank), with vLLM's names, HELP texts and bucket
// bounds. The engine loop observes; GET /metrics gathers.
type latencyMetrics struct {
	reg         *prometheus.Registry
	ttftH, itlH []prometheus.Observer
	e2eH        []prometheus.Observer
	ttftV, itlV *prometheus.HistogramVec
	e2eV        *prometheus.HistogramVec
}

var _ observer = (*latencyMetrics)(nil)

// newLatencyMetrics returns the histograms of ranks ranks from dpStart of a
// worker serving model, each rank's series present from the start.
func newLatencyMetrics(model string, dpStart uint32, ranks int) *latencyMetrics {
	vec := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: name, Help: help, Buckets: buckets,
			ConstLabels: prometheus.Labels{labelModel: model},
		}, []string{labelEngine})
	}
	m := &latencyMetrics{
		reg:   prometheus.NewRegistry(),
		ttftV: vec(stepengine.MetricTTFT, "Histogram of time to first token in seconds.", stepengine.TTFTBuckets()),
		itlV:  vec(stepengine.MetricITL, "Histogram of inter-token latency in seconds.", stepengine.ITLBuckets()),
		e2eV:  vec(stepengine.MetricE2E, "Histogram of e2e request latency in seconds.", stepengine.E2EBuckets()),
	}
	m.reg.MustRegister(m.ttftV, m.itlV, m.e2eV)
	for i := range ranks {
		engine := strconv.FormatUint(uint64(dpStart)+uint64(i), 10)
		m.ttftH = append(m.ttftH, m.ttftV.WithLabelValues(engine))
		m.itlH = append(m.itlH, m.itlV.WithLabelValues(engine))
		m.e2eH = append(m.e2eH, m.e2eV.WithLabelValues(engine))
	}
	return m
}

func (m *latencyMetrics) ttft(rank int, d time.Duration) { m.ttftH[rank].Observe(d.Seconds()) }
func (m *latencyMetrics) itl(rank int, d time.Duration)  { m.itlH[rank].Observe(d.Seconds()) }
func (m *latencyMetrics) e2e(rank int, d time.Duration)  { m.e2eH[rank].Observe(d.Seconds()) }

// handleMetrics serves the worker's load as vLLM would: per rank, the
// requests running and waiting, the preemptions so far, the fraction of
// KV-cache blocks in use (blocks held / blocks in total, from the engine
// loop's last snapshot), vllm:cache_config_info with the rank's
// num_gpu_blocks and the block size, and the histograms of the time to first
// token, the inter-token latency and the end-to-end latency.
func (w *Worker) handleMetrics(rw http.ResponseWriter, _ *http.Request) {
	s := w.Stats()
	gauge := func(name, help string) *dto.MetricFamily {
		return &dto.MetricFamily{Name: ptr(name), Help: ptr(help), Type: dto.MetricType_GAUGE.Enum()}
	}
	running := gauge(vllmRunning, "Number of requests in model execution batches.")
	waiting := gauge(vllmWaiting, "Number of requests waiting to be processed.")
	usage := gauge(vllmUsage, "KV-cache usage. 1 means 100 percent usage.")
	info := gauge(vllmCacheConfig, "Information of the LLMEngine CacheConfig")
	preemptions := &dto.MetricFamily{Name: ptr(vllmPreemptions), Help: ptr("Cumulative number of preemption from the engine."),
		Type: dto.MetricType_COUNTER.Enum()}
	blockSize := strconv.Itoa(w.blockSize)
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
		preemptions.Metric = append(preemptions.Metric, &dto.Metric{Label: labels,
			Counter: &dto.Counter{Value: ptr(float64(r.Preemptions))}})
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
	fams := []*dto.MetricFamily{running, waiting, preemptions, usage, info}
	if hist, err := w.metrics.reg.Gather(); err == nil {
		fams = append(fams, hist...)
	}
	slices.SortFunc(fams, func(a, b *dto.MetricFamily) int { return cmp.Compare(a.GetName(), b.GetName()) })
	rw.Header().Set("Content-Type", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	for _, mf := range fams {
		if _, err := expfmt.MetricFamilyToText(rw, mf); err != nil {
			return // the client went away
		}
	}
}

// ptr returns a pointer to v, as the protobuf-generated types want.
func ptr[T any](v T) *T { return &v }
