package router

import (
	"encoding/json"
	"io"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/slots"
)

// Slot tracking (contract §11): with Config.Slots set, every request sent
// to a worker is added to the tracker on the worker's least-loaded rank,
// marked prefill complete at the first bytes of the worker's answer (the
// first token), and freed when that answer ends, fails or is cancelled. A
// prompt of token ids adds its chained block hashes in the engine's block
// size and its length in tokens; a text prompt adds its estimated tokens
// (4 characters a token) and no blocks: text gives no block hashes an
// engine would share.

// promptLoad is what a request adds to a rank.
type promptLoad struct {
	tokens [][]uint32 // the token-id prompts, one per sequence
	isl    uint64     // prompt tokens: counted, or estimated from text

	// The block hashes, computed once per block size.
	hashed    []uint64
	hashedFor uint32
}

// parsePrompt reads the prompt of a completions or chat completions body.
// What it cannot read counts as an empty prompt: tracking never fails a
// request.
func parsePrompt(route string, body []byte) promptLoad {
	var p promptLoad
	if route == routeChatCompletions {
		var req struct {
			Messages []struct {
				Content json.RawMessage `json:"content"`
			} `json:"messages"`
		}
		if json.Unmarshal(body, &req) != nil {
			return p
		}
		for _, m := range req.Messages {
			p.isl += textTokens(m.Content)
		}
		return p
	}
	var req struct {
		Prompt json.RawMessage `json:"prompt"`
	}
	if json.Unmarshal(body, &req) != nil || len(req.Prompt) == 0 {
		return p
	}
	var one []uint32
	var many [][]uint32
	switch {
	case json.Unmarshal(req.Prompt, &one) == nil:
		p.tokens = [][]uint32{one}
	case json.Unmarshal(req.Prompt, &many) == nil:
		p.tokens = many
	default:
		p.isl = textTokens(req.Prompt)
		return p
	}
	for _, seq := range p.tokens {
		p.isl += uint64(len(seq))
	}
	return p
}

// textTokens estimates the tokens of a prompt or message content: a string,
// an array of strings, or an array of content parts with "text".
func textTokens(raw json.RawMessage) uint64 {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return slots.TextTokens(s)
	}
	var parts []json.RawMessage
	if json.Unmarshal(raw, &parts) != nil {
		return 0
	}
	var n uint64
	for _, part := range parts {
		var obj struct {
			Text string `json:"text"`
		}
		if json.Unmarshal(part, &s) == nil {
			n += slots.TextTokens(s)
		} else if json.Unmarshal(part, &obj) == nil {
			n += slots.TextTokens(obj.Text)
		}
	}
	return n
}

// hashes returns the prompt's distinct block hashes in blocks of blockSize
// tokens; only the request's goroutine calls it.
func (p *promptLoad) hashes(blockSize uint32) []uint64 {
	if len(p.tokens) == 0 || blockSize == 0 {
		return nil
	}
	if p.hashedFor != blockSize {
		n := 0
		for _, seq := range p.tokens {
			n += len(seq) / int(blockSize)
		}
		p.hashed = slices.Grow(p.hashed[:0], n)
		for _, seq := range p.tokens {
			p.hashed = slots.AppendBlockHashes(p.hashed, seq, blockSize)
		}
		if len(p.tokens) > 1 {
			// Sequences sharing a prefix share its blocks, which a rank
			// holds once (contract §11): the projection must count them
			// once. One sequence's chained hashes are distinct already.
			slices.Sort(p.hashed)
			p.hashed = slices.Compact(p.hashed)
		}
		p.hashedFor = blockSize
	}
	return p.hashed
}

// slotTracker adds the router's requests to a slots.Tracker.
type slotTracker struct {
	tr     *slots.Tracker
	prefix string // of request ids: the router id
	next   atomic.Uint64
}

// slot is one request on one worker, held in the tracker until released.
type slot struct {
	tr          *slots.Tracker
	model, id   string
	prefillOnce sync.Once
	releaseOnce sync.Once
}

// add records a request for model sent to worker; nil when the tracker is
// off or does not know the worker (not yet synced from the registry).
func (s *slotTracker) add(model string, worker uint64, p *promptLoad) *slot {
	if s == nil {
		return nil
	}
	id := s.prefix + "-" + strconv.FormatUint(s.next.Add(1), 10)
	req := slots.Request{Model: model, ID: id, WorkerID: worker, NewISLTokens: p.isl,
		Hashes: p.hashes(s.tr.BlockSize(model, ""))}
	if _, err := s.tr.AddLeastLoaded(req); err != nil {
		return nil
	}
	return &slot{tr: s.tr, model: model, id: id}
}

// leastPotential picks, among the candidates not tried, the worker whose
// projection with this request is the smallest, in blocks: its least
// loaded rank's prefill tokens over the block size plus its blocks. A tie
// goes to fewer requests in flight. ok is false when the tracker knows none
// of them.
func (s *slotTracker) leastPotential(model string, cands []events.WorkerEntry, tried []uint64, p *promptLoad, inFlight func(string) int64) (events.WorkerEntry, bool) {
	bs := s.tr.BlockSize(model, "")
	if bs == 0 {
		return events.WorkerEntry{}, false
	}
	hashes := p.hashes(bs)
	var best events.WorkerEntry
	bestCost, found := 0.0, false
	for _, c := range cands {
		if slices.Contains(tried, c.WorkerID) {
			continue
		}
		pot, ok := s.tr.WorkerPotential(model, "", c.WorkerID, hashes, p.isl)
		if !ok {
			continue
		}
		cost := float64(pot.PotentialPrefillTokens)/float64(bs) + float64(pot.PotentialDecodeBlocks)
		if !found || cost < bestCost || cost == bestCost && inFlight(c.Endpoint) < inFlight(best.Endpoint) {
			best, bestCost, found = c, cost, true
		}
	}
	return best, found
}

// prefilled marks the request prefill complete; idempotent, nil-safe.
func (sl *slot) prefilled() {
	if sl != nil {
		sl.prefillOnce.Do(func() { _ = sl.tr.PrefillComplete(sl.model, "", sl.id) })
	}
}

// release frees the request; idempotent, nil-safe.
func (sl *slot) release() {
	if sl != nil {
		sl.releaseOnce.Do(func() { _ = sl.tr.Free(sl.model, "", sl.id) })
	}
}

// firstRead calls its slot's prefilled at the first bytes read: the first
// token of the worker's answer.
type firstRead struct {
	io.ReadCloser
	slot *slot
}

func (f *firstRead) Read(p []byte) (int, error) {
	n, err := f.ReadCloser.Read(p)
	if n > 0 {
		f.slot.prefilled()
	}
	return n, err
}
