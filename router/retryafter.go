package router

// The retry headers of the router's rejections (contract §23): every 503
// and 429 it answers for a busy model — all busy, shed, the queue's expiry
// and its full answer — carries retry-after-ms and Retry-After from the
// admission package's RetryEstimator, which the router feeds with the end
// of every request it forwarded (a slot freed) and asks with the number of
// requests queued ahead (docs/router.md, "Retry headers").

// queueAhead returns the number of requests waiting in model's queue: 0
// with flow control off. Lock-free.
func (rt *Router) queueAhead(model string) int {
	if rt.queue == nil {
		return 0
	}
	if mq := rt.queue.lookup(model); mq != nil {
		return int(mq.depth.Load())
	}
	return 0
}
