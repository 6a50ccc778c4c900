package stepengine

// The names of vLLM's metrics that a simulated engine serves, as vLLM V1
// names them (vllm/v1/metrics/loggers.py). vLLM declares the preemption
// counter as vllm:num_preemptions and the Python client appends _total; a Go
// counter is given the full name.
const (
	// MetricTTFT is the histogram of the time to first token, in seconds.
	MetricTTFT = "vllm:time_to_first_token_seconds"
	// MetricITL is the histogram of the inter-token latency, in seconds.
	MetricITL = "vllm:inter_token_latency_seconds"
	// MetricITLLegacy is the name older vLLM gives the inter-token latency
	// histogram; readers accept both.
	MetricITLLegacy = "vllm:time_per_output_token_seconds"
	// MetricE2E is the histogram of the end-to-end request latency, in
	// seconds.
	MetricE2E = "vllm:e2e_request_latency_seconds"
	// MetricWaiting is the gauge of the requests waiting.
	MetricWaiting = "vllm:num_requests_waiting"
	// MetricRunning is the gauge of the requests running.
	MetricRunning = "vllm:num_requests_running"
	// MetricPreemptions is the counter of preemptions.
	MetricPreemptions = "vllm:num_preemptions_total"
)

// TTFTBuckets returns the upper bounds of vLLM's time-to-first-token
// histogram, in seconds.
func TTFTBuckets() []float64 {
	return []float64{
		0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
		2560.0,
	}
}

// ITLBuckets returns the upper bounds of vLLM's inter-token latency
// histogram (the same as its older time-per-output-token one), in seconds.
func ITLBuckets() []float64 {
	return []float64{
		0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
	}
}

// E2EBuckets returns the upper bounds of vLLM's end-to-end request latency
// histogram, in seconds.
func E2EBuckets() []float64 {
	return []float64{
		0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
	}
}
