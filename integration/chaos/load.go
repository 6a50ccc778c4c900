package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/workermon/workermon/admission"
	"github.com/workermon/workermon/sim/stepengine"
)

// The chat workload of contract §16, in tokens.
const (
	promptMin, promptMax = 128, 512
	outputMin, outputMax = 64, 256
)

// ratedRPS is the requests per second one rank of an engine profile
// completes on the chat workload when it is full: its KV cache holds a
// batch of requests of mean context (prompt + half the output), a step of
// that batch costs the profile's step time, and a request costs its share
// of the steps that decode its output plus its prefill. For `tiny` it is
// 3.1 requests/s, against 2.8–3.1 measured by `workermon bench goodput`
// (docs/performance.md: 11.25–12.5 requests/s for 4 workers).
func ratedRPS(c stepengine.Config) float64 {
	prompt := float64(promptMin+promptMax) / 2
	output := float64(outputMin+outputMax) / 2
	ctx := prompt + output/2
	blocks := math.Ceil(ctx / float64(c.BlockSize))
	batch := math.Min(math.Floor(float64(c.KVBlocks)/blocks), float64(c.MaxNumSeqs))
	step := c.StepBase.Seconds() + batch*c.DecodePerRequest.Seconds() + batch*ctx*c.ContextPerToken.Seconds()
	perRequest := output*step/batch + prompt*c.PrefillPerToken.Seconds()
	return 1 / perRequest
}

// Priority is one class of the load's priority mix.
type Priority struct {
	Value int
	Share float64
}

// priorityMix: half standard, a third sheddable, the rest critical.
var priorityMix = []Priority{{-1, 0.3}, {0, 0.5}, {1, 0.2}}

// Outcome is how one request of the load ended.
type Outcome string

// The outcomes. Only OutViolation is a violation; OutRouterDown means a
// router the driver had killed (not an answer, contract §20).
const (
	OutOK         Outcome = "200"
	OutBusy       Outcome = "503"
	OutShed       Outcome = "429"
	OutCut        Outcome = "cut-by-engine" // a stream ended by the SSE error event while an engine was down
	OutRouterDown Outcome = "router-down"
	OutCancelled  Outcome = "client-cancel" // the client's own timeout
	OutAborted    Outcome = "end-of-run"    // still running when the load stopped
	OutViolation  Outcome = "violation"
)

// Downtimes says, for a request that ran from start to end, whether the
// router it was sent to, or an engine, was down at any time between.
type Downtimes interface {
	RouterDown(router string, start, end time.Time) bool
	EngineDown(start, end time.Time) bool
}

// Load sends streamed completions to the routers at a constant rate with
// Poisson arrivals, each router in turn, each model in turn, priorities
// from priorityMix, and classifies every answer.
type Load struct {
	Routers map[string]string // router service → base URL
	Models  []string
	RPS     float64
	Seed    uint64
	Timeout time.Duration // the client's own limit on a request
	Down    Downtimes
	// OnViolation is called with each answer that is a violation.
	OnViolation func(at time.Time, what string)

	client *http.Client
	mu     sync.Mutex
	counts map[string]map[Outcome]int // class → outcome → count
}

// Counts returns the outcomes by class.
func (l *Load) Counts() map[string]map[Outcome]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]map[Outcome]int{}
	for c, m := range l.counts {
		out[c] = map[Outcome]int{}
		for o, n := range m {
			out[c][o] = n
		}
	}
	return out
}

func className(p int) string {
	switch {
	case p < 0:
		return "sheddable"
	case p > 0:
		return "critical"
	}
	return "standard"
}

// Run sends the load until ctx ends, then waits for the requests in
// flight (they end with ctx: the client's own cancellation).
func (l *Load) Run(ctx context.Context) {
	l.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, DisableCompression: true,
		ResponseHeaderTimeout: l.Timeout}}
	l.counts = map[string]map[Outcome]int{}
	rng := rand.New(rand.NewPCG(l.Seed, l.Seed^0x5851f42d4c957f2d))
	routers := sortedKeys(l.Routers)
	var total float64
	for _, p := range priorityMix {
		total += p.Share
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	next := time.Now()
	for n := 0; ; n++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / l.RPS * float64(time.Second)))
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(next)):
		}
		x := rng.Float64() * total
		prio := priorityMix[len(priorityMix)-1].Value
		for _, p := range priorityMix {
			if x < p.Share {
				prio = p.Value
				break
			}
			x -= p.Share
		}
		router := routers[n%len(routers)]
		model := l.Models[n%len(l.Models)]
		prompt := promptMin + rng.IntN(promptMax-promptMin+1)
		output := outputMin + rng.IntN(outputMax-outputMin+1)
		wg.Go(func() {
			o, what := l.one(ctx, router, model, prio, prompt, output)
			l.mu.Lock()
			c := className(prio)
			if l.counts[c] == nil {
				l.counts[c] = map[Outcome]int{}
			}
			l.counts[c][o]++
			l.mu.Unlock()
			if o == OutViolation && l.OnViolation != nil {
				l.OnViolation(time.Now(), fmt.Sprintf("%s, %s, priority %d: %s", router, model, prio, what))
			}
		})
	}
}

// one sends one request and classifies its answer.
func (l *Load) one(ctx context.Context, router, model string, prio, prompt, output int) (Outcome, string) {
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, l.Timeout)
	defer cancel()
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": strings.Repeat("tok ", prompt),
		"max_tokens": output, "stream": true})
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, l.Routers[router]+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return OutViolation, err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(admission.PriorityHeader, strconv.Itoa(prio))
	resp, err := l.client.Do(req)
	if err != nil {
		return l.failed(ctx, rctx, router, start, "no answer: "+err.Error())
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusServiceUnavailable, http.StatusTooManyRequests:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		if resp.StatusCode == http.StatusTooManyRequests {
			return OutShed, ""
		}
		return OutBusy, ""
	default:
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return OutViolation, fmt.Sprintf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
	}
	ended, errEvent, err := readStream(resp.Body)
	switch {
	case ended:
		return OutOK, ""
	case errEvent != "":
		if l.Down.EngineDown(start, time.Now()) {
			return OutCut, ""
		}
		return OutViolation, "stream ended with an error event while no engine was down: " + errEvent
	case err != nil:
		return l.failed(ctx, rctx, router, start, "stream broken: "+err.Error())
	}
	return l.failed(ctx, rctx, router, start, "stream ended without [DONE] or a finish reason")
}

// failed classifies a request that got no answer or a broken one: the
// client's own cancellation, a router that was down, or a violation.
func (l *Load) failed(ctx, rctx context.Context, router string, start time.Time, what string) (Outcome, string) {
	switch {
	case ctx.Err() != nil:
		return OutAborted, ""
	case rctx.Err() != nil:
		return OutCancelled, ""
	case l.Down.RouterDown(router, start, time.Now()):
		return OutRouterDown, ""
	}
	return OutViolation, what
}

// readStream reads an SSE stream to its end: ended is a [DONE] or a
// finish reason; errEvent the data of an error event.
func readStream(r io.Reader) (ended bool, errEvent string, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			return true, "", nil
		}
		var chunk struct {
			Error   json.RawMessage `json:"error"`
			Choices []struct {
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(data), &chunk) != nil {
			continue
		}
		if len(chunk.Error) > 0 && string(chunk.Error) != "null" {
			return false, data, nil
		}
		for _, c := range chunk.Choices {
			if c.FinishReason != nil && *c.FinishReason != "" {
				ended = true
			}
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		return ended, "", err
	}
	return ended, "", nil
}
