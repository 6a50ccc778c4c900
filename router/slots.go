package router

import (
	"encoding/json"
	"io"
	"math"
	"math/bits"
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
//
// Committed blocks (contract §21): every request also adds the KV blocks it
// would hold at its expected length, Σ over its prompt's sequences of
// ceil((prompt tokens + n × expected output) / block size), in the block
// size of the worker's registry entry, and none when the entry names no
// block size (an exception to the units rule above: text prompts count, by
// their estimated tokens). The router relays answers without reading them,
// so it knows no finished outputs to take a p90 of: the expected output is
// the request's bound, max_completion_tokens, else max_tokens, and 0 (the
// prompt alone, a lower bound) for a request with neither
// (docs/contract.md, "Choices").

// maxChoices bounds the n of a request counted in its committed blocks.
const maxChoices = 128

// promptLoad is what a request adds to a rank.
type promptLoad struct {
	tokens [][]uint32 // the token-id prompts, one per sequence
	isl    uint64     // prompt tokens: counted, or estimated from text

	// seqs are each sequence's prompt tokens, counted or estimated: the
	// engine makes a request of each.
	seqs []uint64
	// maxTokens is the output bound the request gives, 0 when none;
	// choices its n (1 when absent), at most maxChoices.
	maxTokens, choices uint64

	// The block hashes, computed once per block size.
	hashed    []uint64
	hashedFor uint32
}

// parsePrompt reads the prompt, the output bound and n of a completions or
// chat completions body. What it cannot read counts as an empty prompt, no
// bound and one choice: tracking never fails a request.
func parsePrompt(route string, body []byte) promptLoad {
	p := promptLoad{choices: 1}
	var req struct {
		Prompt              json.RawMessage `json:"prompt"`
		Messages            json.RawMessage `json:"messages"`
		MaxTokens           json.RawMessage `json:"max_tokens"`
		MaxCompletionTokens json.RawMessage `json:"max_completion_tokens"`
		N                   json.RawMessage `json:"n"`
	}
	if json.Unmarshal(body, &req) != nil {
		return p
	}
	if n, ok := count(req.MaxCompletionTokens); ok {
		p.maxTokens = n
	} else if n, ok := count(req.MaxTokens); ok {
		p.maxTokens = n
	}
	if n, ok := count(req.N); ok && n > 0 {
		p.choices = min(n, maxChoices)
	}
	if route == routeChatCompletions {
		var messages []struct {
			Content json.RawMessage `json:"content"`
		}
		if json.Unmarshal(req.Messages, &messages) != nil {
			return p
		}
		var isl uint64
		for _, m := range messages {
			isl += textTokens(m.Content)
		}
		p.isl, p.seqs = isl, []uint64{isl}
		return p
	}
	if len(req.Prompt) == 0 {
		return p
	}
	var one []uint32
	var many [][]uint32
	var texts []string
	switch {
	case json.Unmarshal(req.Prompt, &one) == nil:
		p.tokens = [][]uint32{one}
	case json.Unmarshal(req.Prompt, &many) == nil:
		p.tokens = many
	case json.Unmarshal(req.Prompt, &texts) == nil:
		for _, text := range texts {
			n := slots.TextTokens(text)
			p.isl += n
			p.seqs = append(p.seqs, n)
		}
		return p
	default:
		p.isl = textTokens(req.Prompt)
		p.seqs = []uint64{p.isl}
		return p
	}
	for _, seq := range p.tokens {
		p.isl += uint64(len(seq))
		p.seqs = append(p.seqs, uint64(len(seq)))
	}
	return p
}

// count reads a JSON non-negative integer.
func count(raw json.RawMessage) (uint64, bool) {
	if len(raw) == 0 {
		return 0, false
	}
	n, err := strconv.ParseUint(string(raw), 10, 64)
	return n, err == nil
}

// committedBlocks returns the KV blocks the request would hold at its
// expected length in blocks of blockSize tokens: Σ over its sequences of
// ceil((prompt + n × output bound) / blockSize), saturated, at least one
// sequence (of no prompt tokens when none was read). ok is false when the
// block size is unknown (0).
func (p *promptLoad) committedBlocks(blockSize uint32) (blocks uint64, ok bool) {
	if blockSize == 0 {
		return 0, false
	}
	seqs := p.seqs
	if len(seqs) == 0 {
		seqs = []uint64{0}
	}
	hi, out := bits.Mul64(p.maxTokens, max(p.choices, 1))
	if hi != 0 {
		out = math.MaxUint64
	}
	bs := uint64(blockSize)
	for _, seq := range seqs {
		tokens := slots.SaturatingAdd(seq, out)
		blocks = slots.SaturatingAdd(blocks, tokens/bs+min(tokens%bs, 1))
	}
	return blocks, true
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

// add records a request for model sent to worker, with its committed
// blocks in the block size of the worker's registry entry (none when the
// entry names none); nil when the tracker is off or does not know the
// worker (not yet synced from the registry).
func (s *slotTracker) add(model string, worker events.WorkerEntry, p *promptLoad) *slot {
	if s == nil {
		return nil
	}
	id := s.prefix + "-" + strconv.FormatUint(s.next.Add(1), 10)
	req := slots.Request{Model: model, ID: id, WorkerID: worker.WorkerID, NewISLTokens: p.isl,
		Hashes: p.hashes(s.tr.BlockSize(model, ""))}
	req.CommittedBlocks, req.HasCommitted = p.committedBlocks(worker.BlockSize)
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
