// Package slots is the active-request accounting of Dynamo's standalone
// slot tracker (contract §11), as pure state: no HTTP, no NATS. Workers
// register contiguous data-parallel ranges per (model, tenant); requests are
// added to one rank with the block hashes of their prompt, marked prefill
// complete, and freed; the load of each rank is the number of distinct
// blocks of its active requests and the prompt tokens still to prefill, and
// a projection tells what adding a request to each rank would make of it.
// A request may also carry the KV blocks it would hold at its expected
// length (contract §21, a router's estimate); a rank sums those of its
// active requests.
//
// The errors of the methods wrap ErrInvalid, ErrNotFound, ErrConflict,
// ErrLimit or ErrTooLarge, which an HTTP layer answers 400, 404, 409, 429
// and 413 (the statuses of Dynamo's page where it gives them). Memory is
// bounded by the caps of Config; every write a cap refuses is counted by
// Reason, and every request the TTL drops, in Stats. A Tracker is safe for
// concurrent use.
package slots

import (
	"cmp"
	"errors"
	"fmt"
	"iter"
	"math"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Sentinel errors.
var (
	ErrInvalid  = errors.New("invalid request")
	ErrNotFound = errors.New("not found")
	ErrConflict = errors.New("conflict")
	ErrLimit    = errors.New("limit reached")
	// ErrTooLarge: a request carries more block hashes than
	// Config.MaxHashesPerRequest; it would be refused whatever the load.
	ErrTooLarge = errors.New("too large")
)

// DefaultTenant is the tenant of a request that names none.
const DefaultTenant = "default"

// Defaults of Config.
const (
	// DefaultRequestTTL: Dynamo's stale-request cleanup.
	DefaultRequestTTL = 300 * time.Second
	// DefaultMaxTrackers is the most (model, tenant) trackers.
	DefaultMaxTrackers = 1024
	// DefaultMaxWorkers is the most registered workers, over all trackers.
	DefaultMaxWorkers = 16384
	// DefaultMaxTotalRanks is the most data-parallel ranks of the
	// registered workers, over all trackers: 16,384 workers of 4 ranks.
	// A registered rank costs about 150 bytes of heap
	// (BenchmarkRankMemory): about 10 MB at this cap.
	DefaultMaxTotalRanks = 65536
	// DefaultMaxRequests is the most active requests, over all trackers.
	DefaultMaxRequests = 1 << 20
	// DefaultMaxHashesPerRequest is the most block hashes one add or one
	// projection may carry: a prompt of 524,288 tokens in blocks of 16.
	DefaultMaxHashesPerRequest = 32768
	// DefaultMaxBlocks is the most block hashes held by the active
	// requests, over all trackers (see Config.MaxBlocks): 2,097,152, as
	// many as 10,000 requests of 200 blocks. A held hash costs about 120
	// bytes of heap when no other request of its rank holds it, 26 when
	// five requests share it (BenchmarkBlockMemory): at most about 250 MB
	// at this cap, far less when requests share prefixes.
	DefaultMaxBlocks = 2 << 20
	// MaxRanks bounds a worker's dp_size, as the monitor bounds dp_size.
	MaxRanks = 1024
	// MaxNameLen bounds, in bytes, the model_name and tenant_id a
	// registration keeps and the request_id an add keeps (the contract's
	// longest model name).
	MaxNameLen = 256
)

// Config configures a Tracker.
type Config struct {
	// RequestTTL: a request older than this is dropped (--request-ttl).
	RequestTTL time.Duration
	// MaxTrackers, MaxWorkers (over all trackers) and MaxRequests (over
	// all trackers) bound the memory; beyond them writes fail with ErrLimit.
	MaxTrackers, MaxWorkers, MaxRequests int
	// MaxTotalRanks is the most data-parallel ranks of the registered
	// workers, over all trackers (a worker may have up to MaxRanks); a
	// registration beyond it fails with ErrLimit.
	MaxTotalRanks int
	// MaxHashesPerRequest is the most block hashes (repeats included) an
	// add or a projection may carry; beyond it they fail with ErrTooLarge.
	MaxHashesPerRequest int
	// MaxBlocks is the most block hashes the active requests hold, over
	// all trackers: each request counts its distinct hashes, so a block
	// two requests share counts twice (it is held twice in memory), and
	// the total is at least the sum of every rank's active_decode_blocks.
	// An add beyond it fails with ErrLimit.
	MaxBlocks int
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{RequestTTL: DefaultRequestTTL, MaxTrackers: DefaultMaxTrackers, MaxWorkers: DefaultMaxWorkers,
		MaxTotalRanks: DefaultMaxTotalRanks, MaxRequests: DefaultMaxRequests,
		MaxHashesPerRequest: DefaultMaxHashesPerRequest, MaxBlocks: DefaultMaxBlocks}
}

// Validate reports every problem of the configuration, joined.
func (c Config) Validate() error {
	var errs []error
	if c.RequestTTL <= 0 {
		errs = append(errs, fmt.Errorf("slots: request TTL %v must be positive", c.RequestTTL))
	}
	for _, limit := range []struct {
		name string
		v    int
	}{{"trackers", c.MaxTrackers}, {"workers", c.MaxWorkers}, {"ranks", c.MaxTotalRanks}, {"requests", c.MaxRequests},
		{"hashes per request", c.MaxHashesPerRequest}, {"blocks", c.MaxBlocks}} {
		if limit.v <= 0 {
			errs = append(errs, fmt.Errorf("slots: the cap on %s (%d) must be positive", limit.name, limit.v))
		}
	}
	return errors.Join(errs...)
}

// Reason names the cap that refused a write: the label reason of
// workermon_slots_rejected_total.
type Reason int

// The caps.
const (
	RejectedTrackers Reason = iota // Config.MaxTrackers
	RejectedWorkers                // Config.MaxWorkers
	RejectedRanks                  // Config.MaxTotalRanks
	RejectedRequests               // Config.MaxRequests
	RejectedHashes                 // Config.MaxHashesPerRequest
	RejectedBlocks                 // Config.MaxBlocks
	NumReasons                     // the number of reasons
)

var reasonNames = [NumReasons]string{"trackers", "workers", "ranks", "requests", "hashes", "blocks"}

// String returns the reason's label value.
func (r Reason) String() string {
	if r < 0 || r >= NumReasons {
		return fmt.Sprintf("Reason(%d)", int(r))
	}
	return reasonNames[r]
}

// Worker is one registration: a contiguous range of data-parallel ranks.
type Worker struct {
	WorkerID  uint64 `json:"worker_id"`
	Model     string `json:"model_name"`
	Tenant    string `json:"tenant_id"`
	BlockSize uint32 `json:"block_size"`
	DPStart   uint32 `json:"dp_start"`
	DPSize    uint32 `json:"dp_size"`
}

// ranks yields the worker's ranks in order. A range may end at 2^32
// (rank 4294967295 is legal, contract §3): the walk counts dp_size ranks,
// so it never wraps to rank 0. The range must not pass 2^32 (Register
// refuses it).
func (w Worker) ranks() iter.Seq[uint32] {
	return func(yield func(uint32) bool) {
		for i := range w.DPSize {
			if !yield(w.DPStart + i) {
				return
			}
		}
	}
}

// has reports whether r is one of the worker's ranks.
func (w Worker) has(r uint32) bool {
	return r >= w.DPStart && uint64(r) < uint64(w.DPStart)+uint64(w.DPSize)
}

// Load is one rank's current load.
type Load struct {
	Model               string `json:"model_name"`
	Tenant              string `json:"tenant_id"`
	WorkerID            uint64 `json:"worker_id"`
	DPRank              uint32 `json:"dp_rank"`
	ActivePrefillTokens uint64 `json:"active_prefill_tokens"`
	ActiveDecodeBlocks  uint64 `json:"active_decode_blocks"`
	// KVCommittedBlocks sums the CommittedBlocks of the rank's active
	// requests that carry them (contract §21), and Committed says whether
	// any does. Not in Dynamo's API: /loads leaves them out.
	KVCommittedBlocks uint64 `json:"-"`
	Committed         bool   `json:"-"`
}

// Potential is one rank's load if a request were added to it.
type Potential struct {
	WorkerID               uint64 `json:"worker_id"`
	DPRank                 uint32 `json:"dp_rank"`
	PotentialPrefillTokens uint64 `json:"potential_prefill_tokens"`
	PotentialDecodeBlocks  uint64 `json:"potential_decode_blocks"`
}

// Request is a request added to a rank.
type Request struct {
	Model, Tenant string
	ID            string
	WorkerID      uint64
	DPRank        uint32
	// Hashes are the prompt's chained block hashes, one per block.
	Hashes []uint64
	// NewISLTokens are the prompt tokens to prefill; 0: none counted.
	NewISLTokens uint64
	// CommittedBlocks, when HasCommitted, are the blocks the request would
	// hold at its expected length (contract §21), in the engine's block
	// size: a router that knows them says so. Dynamo's /add does not.
	CommittedBlocks uint64
	HasCommitted    bool
}

// HashFromSigned reads a hash sent as a signed 64-bit JSON integer
// bit-for-bit as the unsigned hash it is.
func HashFromSigned(h int64) uint64 { return uint64(h) }

type key struct{ model, tenant string }

// matches reports whether k passes the filters; an empty filter passes all.
func (k key) matches(model, tenant string) bool {
	return (model == "" || k.model == model) && (tenant == "" || k.tenant == tenant)
}

type rankKey struct {
	worker uint64
	rank   uint32
}

// rank is the state of one (worker, dp_rank).
type rank struct {
	blocks  map[uint64]uint32 // distinct block hashes of the active requests, with reference counts
	prefill tokens            // new_isl_tokens of the requests not yet prefill-complete
	// committed sums the CommittedBlocks of the active requests that carry
	// them; committers counts those requests.
	committed  tokens
	committers int
	// requests are the rank's active requests, linked through their prev
	// and next: dropping a rank (an unregistration, a moved range) walks
	// its own requests, not every request of the tracker.
	requests *request
}

// tokens is a sum of token counts that never wraps: exact in 128 bits (a
// million requests of 2^64-1 tokens cannot pass it), so that the tokens of
// a request that leaves come off exactly, and read saturated at 2^64-1.
type tokens struct{ hi, lo uint64 }

func (s *tokens) add(n uint64) {
	var carry uint64
	s.lo, carry = bits.Add64(s.lo, n, 0)
	s.hi += carry
}

func (s *tokens) sub(n uint64) {
	var borrow uint64
	s.lo, borrow = bits.Sub64(s.lo, n, 0)
	s.hi -= borrow
}

// value is the sum, or 2^64-1 when it is larger.
func (s tokens) value() uint64 {
	if s.hi != 0 {
		return math.MaxUint64
	}
	return s.lo
}

// SaturatingAdd returns a + b, or 2^64-1 when the sum is larger: loads
// (tokens, blocks) are summed without wrapping (a sum that wrapped would
// show a loaded rank as idle).
func SaturatingAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxUint64
}

// link adds an active request to the rank's list.
func (rs *rank) link(r *request) {
	r.prev, r.next = nil, rs.requests
	if rs.requests != nil {
		rs.requests.prev = r
	}
	rs.requests = r
}

// unlink removes an active request from the rank's list.
func (rs *rank) unlink(r *request) {
	if r.prev != nil {
		r.prev.next = r.next
	} else {
		rs.requests = r.next
	}
	if r.next != nil {
		r.next.prev = r.prev
	}
	r.prev, r.next = nil, nil
}

// request is an active request.
type request struct {
	id         string
	tracker    *tracker
	at         rankKey
	hashes     []uint64 // distinct
	prefill    uint64   // 0 once prefill-complete
	committed  uint64   // CommittedBlocks, when hasCommit
	hasCommit  bool
	added      time.Time
	freed      bool
	prev, next *request // the other active requests of its rank
}

// tracker is one (model, tenant).
type tracker struct {
	key       key
	blockSize uint32
	workers   map[uint64]Worker
	ranks     map[rankKey]*rank
	requests  map[string]*request
	// holders are the ranks holding each block hash: a projection looks
	// up the request's hashes, not every rank's blocks.
	holders map[uint64]holderSet
	// order is the ranks sorted by (worker, rank), rebuilt after a
	// registration changed them (stale).
	order []rankRef
	stale bool
}

// rankRef is a rank and its key.
type rankRef struct {
	key rankKey
	*rank
}

// sorted returns the ranks sorted by (worker, rank).
func (tr *tracker) sorted() []rankRef {
	if tr.stale || len(tr.order) != len(tr.ranks) {
		tr.order = tr.order[:0]
		for rk, rs := range tr.ranks {
			tr.order = append(tr.order, rankRef{rk, rs})
		}
		slices.SortFunc(tr.order, func(a, b rankRef) int {
			return cmp.Or(cmp.Compare(a.key.worker, b.key.worker), cmp.Compare(a.key.rank, b.key.rank))
		})
		tr.stale = false
	}
	return tr.order
}

// holderSet is the ranks holding one block hash. Most hashes are held by
// one rank, kept inline, so that holding a hash allocates no set of its
// own; the others spill into more.
type holderSet struct {
	first rankKey
	more  map[rankKey]struct{} // nil until a second rank holds the hash
}

// hold and release keep holders in step with a rank's blocks.
func (tr *tracker) hold(h uint64, rk rankKey) {
	hs, ok := tr.holders[h]
	switch {
	case !ok:
		tr.holders[h] = holderSet{first: rk}
	case hs.first != rk:
		if hs.more == nil {
			hs.more = make(map[rankKey]struct{}, 1)
			tr.holders[h] = hs
		}
		hs.more[rk] = struct{}{}
	}
}

func (tr *tracker) release(h uint64, rk rankKey) {
	hs, ok := tr.holders[h]
	switch {
	case !ok:
	case hs.first != rk:
		delete(hs.more, rk)
	case len(hs.more) == 0:
		delete(tr.holders, h)
	default:
		// Another holder takes first's place.
		for next := range hs.more {
			delete(hs.more, next)
			hs.first = next
			tr.holders[h] = hs
			break
		}
	}
}

// Tracker is the accounting of every (model, tenant).
type Tracker struct {
	cfg Config

	mu       sync.Mutex
	trackers map[key]*tracker
	keys     []key // of trackers, sorted; nil after a tracker came or went
	workers  int
	ranks    int
	requests int
	blocks   int        // distinct hashes held, summed over the active requests
	byAge    []*request // oldest first; freed ones are skipped

	rejected [NumReasons]atomic.Uint64
	expired  atomic.Uint64
}

// refuse counts a write the cap of reason refused and returns err.
func (t *Tracker) refuse(reason Reason, err error) error {
	t.rejected[reason].Add(1)
	return err
}

// checkID checks the request id an add keeps.
func checkID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("request_id is required: %w", ErrInvalid)
	case len(id) > MaxNameLen:
		return fmt.Errorf("request_id is %d bytes, more than %d: %w", len(id), MaxNameLen, ErrInvalid)
	}
	return nil
}

// checkHashes refuses, and counts, a request with more than the hashes
// of one request.
func (t *Tracker) checkHashes(n int) error {
	if n > t.cfg.MaxHashesPerRequest {
		return t.refuse(RejectedHashes, fmt.Errorf("%d sequence_hashes, more than the %d of one request: %w",
			n, t.cfg.MaxHashesPerRequest, ErrTooLarge))
	}
	return nil
}

// New checks cfg and returns an empty Tracker.
func New(cfg Config) (*Tracker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Tracker{cfg: cfg, trackers: make(map[key]*tracker)}, nil
}

func tenantOr(t string) string {
	if t == "" {
		return DefaultTenant
	}
	return t
}

// Register adds a worker's range, or replaces the range of a worker
// registered before (its requests on ranks no longer in the range are
// dropped). Every worker of a (model, tenant) has the same block size.
func (t *Tracker) Register(w Worker) error {
	w.Tenant = tenantOr(w.Tenant)
	switch {
	case w.Model == "":
		return fmt.Errorf("model_name is required: %w", ErrInvalid)
	case len(w.Model) > MaxNameLen || len(w.Tenant) > MaxNameLen:
		return fmt.Errorf("model_name or tenant_id longer than %d bytes: %w", MaxNameLen, ErrInvalid)
	case w.BlockSize == 0:
		return fmt.Errorf("block_size must be positive: %w", ErrInvalid)
	case w.DPSize == 0:
		return fmt.Errorf("dp_size must be positive: %w", ErrInvalid)
	case w.DPSize > MaxRanks:
		return fmt.Errorf("dp_size %d is above %d: %w", w.DPSize, MaxRanks, ErrInvalid)
	case uint64(w.DPStart)+uint64(w.DPSize) > math.MaxUint32+1:
		return fmt.Errorf("dp_start %d + dp_size %d overflows: a range may end at 2^32, never past it: %w",
			w.DPStart, w.DPSize, ErrInvalid)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	k := key{w.Model, w.Tenant}
	tr := t.trackers[k]
	if tr == nil {
		if len(t.trackers) >= t.cfg.MaxTrackers {
			return t.refuse(RejectedTrackers, fmt.Errorf("%d model/tenant trackers: %w", t.cfg.MaxTrackers, ErrLimit))
		}
		tr = &tracker{key: k, blockSize: w.BlockSize, workers: make(map[uint64]Worker),
			ranks: make(map[rankKey]*rank), requests: make(map[string]*request),
			holders: make(map[uint64]holderSet)}
	}
	old, replacing := tr.workers[w.WorkerID]
	others := len(tr.workers)
	if replacing {
		others-- // a worker registered again may change its own block size
	}
	if others > 0 && tr.blockSize != w.BlockSize {
		return fmt.Errorf("block_size %d differs from %d, the block size of the other workers of %q/%q: %w",
			w.BlockSize, tr.blockSize, w.Model, w.Tenant, ErrConflict)
	}
	if !replacing && t.workers >= t.cfg.MaxWorkers {
		return t.refuse(RejectedWorkers, fmt.Errorf("%d workers: %w", t.cfg.MaxWorkers, ErrLimit))
	}
	// A worker's ranks are its range: a replacement trades the old range
	// for the new one.
	ranks := t.ranks + int(w.DPSize)
	if replacing {
		ranks -= int(old.DPSize)
	}
	if ranks > t.cfg.MaxTotalRanks {
		return t.refuse(RejectedRanks, fmt.Errorf("%d ranks registered, %d with dp_size %d: above the cap of %d: %w",
			t.ranks, ranks, w.DPSize, t.cfg.MaxTotalRanks, ErrLimit))
	}
	if _, ok := t.trackers[k]; !ok {
		t.trackers[k] = tr
		t.keys = nil
	}
	resized := tr.blockSize != w.BlockSize
	tr.blockSize = w.BlockSize
	if replacing {
		// Its requests' block hashes are in the old block size's units:
		// with a new size every rank starts again empty.
		for r := range old.ranks() {
			if resized || !w.has(r) {
				t.dropRank(tr, rankKey{w.WorkerID, r})
			}
		}
	} else {
		t.workers++
	}
	tr.workers[w.WorkerID] = w
	for r := range w.ranks() {
		rk := rankKey{w.WorkerID, r}
		if tr.ranks[rk] == nil {
			tr.ranks[rk] = &rank{blocks: make(map[uint64]uint32)}
			t.ranks++
			tr.stale = true
		}
	}
	return nil
}

// dropRank removes a rank and its requests.
func (t *Tracker) dropRank(tr *tracker, rk rankKey) {
	rs := tr.ranks[rk]
	if rs == nil {
		return
	}
	for rs.requests != nil {
		req := rs.requests
		rs.unlink(req)
		req.freed = true
		delete(tr.requests, req.id)
		t.requests--
		t.blocks -= len(req.hashes)
	}
	for h := range rs.blocks {
		tr.release(h, rk)
	}
	t.ranks--
	delete(tr.ranks, rk)
	tr.stale = true
}

// Unregister removes a worker's range and its active requests at once.
func (t *Tracker) Unregister(model, tenant string, worker uint64) error {
	tenant = tenantOr(tenant)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	tr, err := t.tracker(model, tenant)
	if err != nil {
		return err
	}
	w, ok := tr.workers[worker]
	if !ok {
		return fmt.Errorf("worker %d is not registered for model %q tenant %q: %w", worker, model, tenant, ErrNotFound)
	}
	for r := range w.ranks() {
		t.dropRank(tr, rankKey{worker, r})
	}
	delete(tr.workers, worker)
	t.workers--
	if len(tr.workers) == 0 {
		delete(t.trackers, tr.key)
		t.keys = nil
	}
	return nil
}

// Add records a request's prompt blocks and prefill tokens on a registered
// rank.
func (t *Tracker) Add(req Request) error {
	req.Tenant = tenantOr(req.Tenant)
	if err := checkID(req.ID); err != nil {
		return err
	}
	if err := t.checkHashes(len(req.Hashes)); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	tr, err := t.tracker(req.Model, req.Tenant)
	if err != nil {
		return err
	}
	rk := rankKey{req.WorkerID, req.DPRank}
	rs := tr.ranks[rk]
	if rs == nil {
		return fmt.Errorf("worker %d rank %d is not registered for model %q tenant %q: %w",
			req.WorkerID, req.DPRank, req.Model, req.Tenant, ErrNotFound)
	}
	return t.add(tr, rk, rs, req)
}

// AddLeastLoaded adds a request to the rank of req.WorkerID (req.DPRank is
// ignored) that it would load least: the fewest prefill tokens after it,
// then the fewest blocks, then the lowest rank. A router that does not pick
// the rank itself (the engine balances its own ranks) uses it. It returns
// the rank.
func (t *Tracker) AddLeastLoaded(req Request) (uint32, error) {
	req.Tenant = tenantOr(req.Tenant)
	if err := checkID(req.ID); err != nil {
		return 0, err
	}
	if err := t.checkHashes(len(req.Hashes)); err != nil {
		return 0, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	tr, err := t.tracker(req.Model, req.Tenant)
	if err != nil {
		return 0, err
	}
	w, ok := tr.workers[req.WorkerID]
	if !ok {
		return 0, fmt.Errorf("worker %d is not registered for model %q tenant %q: %w",
			req.WorkerID, req.Model, req.Tenant, ErrNotFound)
	}
	bestKey, best, _, ok := leastLoaded(tr, w, req.Hashes)
	if !ok {
		return 0, fmt.Errorf("worker %d has no rank for model %q tenant %q: %w", req.WorkerID, req.Model, req.Tenant, ErrNotFound)
	}
	req.DPRank = bestKey.rank
	return bestKey.rank, t.add(tr, bestKey, best, req)
}

// leastLoaded finds the rank of w a request with these hashes would load
// least: the fewest prefill tokens, then the fewest blocks after it, then
// the lowest rank. p is that rank's projection without the request's own
// prefill tokens. A repeated hash of the request counts each time: an upper
// bound, enough to compare.
func leastLoaded(tr *tracker, w Worker, hashes []uint64) (rankKey, *rank, Potential, bool) {
	var best *rank
	var bestKey rankKey
	var p Potential
	for r := range w.ranks() {
		rk := rankKey{w.WorkerID, r}
		rs := tr.ranks[rk]
		if rs == nil {
			continue
		}
		blocks := uint64(len(rs.blocks))
		for _, h := range hashes {
			if _, held := rs.blocks[h]; !held {
				blocks++
			}
		}
		prefill := rs.prefill.value()
		if best == nil || prefill < p.PotentialPrefillTokens || prefill == p.PotentialPrefillTokens && blocks < p.PotentialDecodeBlocks {
			best, bestKey = rs, rk
			p = Potential{WorkerID: w.WorkerID, DPRank: r, PotentialPrefillTokens: prefill, PotentialDecodeBlocks: blocks}
		}
	}
	return bestKey, best, p, best != nil
}

// WorkerPotential projects adding a request to the worker's rank it would
// load least (as AddLeastLoaded picks it): that rank's prefill tokens +
// newISL, and its blocks + the request's blocks not on it (hashes must be
// distinct: one given twice counts twice). ok is false when
// the worker is not registered for the (model, tenant), and when the
// request has more hashes than an add accepts (not counted: the add that
// follows is).
func (t *Tracker) WorkerPotential(model, tenant string, worker uint64, hashes []uint64, newISL uint64) (p Potential, ok bool) {
	if len(hashes) > t.cfg.MaxHashesPerRequest {
		return Potential{}, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	tr := t.trackers[key{model, tenantOr(tenant)}]
	if tr == nil {
		return Potential{}, false
	}
	w, ok := tr.workers[worker]
	if !ok {
		return Potential{}, false
	}
	_, _, p, ok = leastLoaded(tr, w, hashes)
	p.PotentialPrefillTokens = SaturatingAdd(p.PotentialPrefillTokens, newISL)
	return p, ok
}

// add records req on the rank rs of tr. t.mu is held.
func (t *Tracker) add(tr *tracker, rk rankKey, rs *rank, req Request) error {
	if _, dup := tr.requests[req.ID]; dup {
		return fmt.Errorf("request %q is already active: %w", req.ID, ErrConflict)
	}
	if t.requests >= t.cfg.MaxRequests {
		return t.refuse(RejectedRequests, fmt.Errorf("%d active requests: %w", t.cfg.MaxRequests, ErrLimit))
	}
	hashes := distinct(req.Hashes)
	if t.blocks+len(hashes) > t.cfg.MaxBlocks {
		return t.refuse(RejectedBlocks, fmt.Errorf("%d block hashes held, %d more would pass the cap of %d: %w",
			t.blocks, len(hashes), t.cfg.MaxBlocks, ErrLimit))
	}
	r := &request{id: req.ID, tracker: tr, at: rk, hashes: hashes, prefill: req.NewISLTokens,
		committed: req.CommittedBlocks, hasCommit: req.HasCommitted, added: t.cfg.Now()}
	for _, h := range hashes {
		if rs.blocks[h]++; rs.blocks[h] == 1 {
			tr.hold(h, rk)
		}
	}
	rs.prefill.add(r.prefill)
	if r.hasCommit {
		rs.committed.add(r.committed)
		rs.committers++
	}
	rs.link(r)
	tr.requests[req.ID] = r
	t.requests++
	t.blocks += len(hashes)
	t.byAge = append(t.byAge, r)
	return nil
}

// distinct returns the hashes without repeats, sorted, in a slice of
// their own (a sort, not a set: an add allocates only the slice it keeps).
func distinct(hashes []uint64) []uint64 {
	if len(hashes) == 0 {
		return nil
	}
	out := slices.Clone(hashes)
	slices.Sort(out)
	return slices.Clip(slices.Compact(out))
}

// BlockSize is the block size of the (model, tenant)'s workers, 0 when
// none is registered.
func (t *Tracker) BlockSize(model, tenant string) uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if tr := t.trackers[key{model, tenantOr(tenant)}]; tr != nil {
		return tr.blockSize
	}
	return 0
}

// PrefillComplete marks a request's prompt processed: its tokens leave the
// rank's prefill count. A repeated call is a no-op.
func (t *Tracker) PrefillComplete(model, tenant, id string) error {
	tenant = tenantOr(tenant)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	tr, err := t.tracker(model, tenant)
	if err != nil {
		return err
	}
	r := tr.requests[id]
	if r == nil {
		return fmt.Errorf("request %q is not active: %w", id, ErrNotFound)
	}
	tr.ranks[r.at].prefill.sub(r.prefill)
	r.prefill = 0
	return nil
}

// Free releases a request's blocks and remaining prefill tokens. It is
// idempotent while the tracker exists, an unknown request included.
func (t *Tracker) Free(model, tenant, id string) error {
	tenant = tenantOr(tenant)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	tr, err := t.tracker(model, tenant)
	if err != nil {
		return err
	}
	if r := tr.requests[id]; r != nil {
		t.free(r)
	}
	return nil
}

// tracker gives the (model, tenant)'s tracker. t.mu is held.
func (t *Tracker) tracker(model, tenant string) (*tracker, error) {
	tr := t.trackers[key{model, tenant}]
	if tr == nil {
		return nil, fmt.Errorf("no tracker for model %q tenant %q: %w", model, tenant, ErrNotFound)
	}
	return tr, nil
}

// free removes an active request.
func (t *Tracker) free(r *request) {
	tr := r.tracker
	if rs := tr.ranks[r.at]; rs != nil {
		for _, h := range r.hashes {
			if rs.blocks[h] <= 1 {
				delete(rs.blocks, h)
				tr.release(h, r.at)
			} else {
				rs.blocks[h]--
			}
		}
		rs.prefill.sub(r.prefill)
		if r.hasCommit {
			rs.committed.sub(r.committed)
			rs.committers--
		}
		rs.unlink(r)
	}
	r.freed = true
	delete(tr.requests, r.id)
	t.requests--
	t.blocks -= len(r.hashes)
}

// expire frees the requests older than the TTL. t.mu is held.
func (t *Tracker) expire() {
	cutoff := t.cfg.Now().Add(-t.cfg.RequestTTL)
	n := 0
	for n < len(t.byAge) && (t.byAge[n].freed || !t.byAge[n].added.After(cutoff)) {
		if r := t.byAge[n]; !r.freed {
			t.free(r)
			t.expired.Add(1)
		}
		n++
	}
	if n > 0 {
		t.byAge = slices.Delete(t.byAge, 0, n)
	}
	// Freed requests deeper in the queue are skipped when they reach the
	// front; compact when they are most of it.
	if len(t.byAge) > 1024 && len(t.byAge) > 2*t.requests {
		t.byAge = slices.DeleteFunc(t.byAge, func(r *request) bool { return r.freed })
	}
}

// PotentialLoads projects adding a request with these block hashes and
// prefill tokens to each rank of the (model, tenant): the rank's prefill
// tokens + newISL, and its blocks + the request's blocks not already on it.
// Sorted by (worker id, rank).
func (t *Tracker) PotentialLoads(model, tenant string, hashes []uint64, newISL uint64) ([]Potential, error) {
	tenant = tenantOr(tenant)
	if err := t.checkHashes(len(hashes)); err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	tr, err := t.tracker(model, tenant)
	if err != nil {
		return nil, err
	}
	own := distinct(hashes)
	// The request's blocks each rank already holds.
	var shared map[rankKey]uint64
	for _, h := range own {
		hs, ok := tr.holders[h]
		if !ok {
			continue
		}
		if shared == nil {
			shared = make(map[rankKey]uint64)
		}
		shared[hs.first]++
		for rk := range hs.more {
			shared[rk]++
		}
	}
	out := make([]Potential, 0, len(tr.ranks))
	for _, r := range tr.sorted() {
		out = append(out, Potential{WorkerID: r.key.worker, DPRank: r.key.rank, PotentialPrefillTokens: SaturatingAdd(r.prefill.value(), newISL),
			PotentialDecodeBlocks: uint64(len(r.blocks)) + uint64(len(own)) - shared[r.key]})
	}
	return out, nil
}

// Stats is what the tracker holds and what it refused, for metrics.
type Stats struct {
	// Trackers, Workers, their Ranks and Requests are held now; Blocks
	// are the block hashes the active requests hold (what
	// Config.MaxBlocks caps).
	Trackers, Workers, Ranks, Requests, Blocks int
	// Rejected counts the writes each cap refused since New.
	Rejected [NumReasons]uint64
	// Expired counts the requests dropped for their age since New.
	Expired uint64
}

// Stats returns the counts of trackers, workers, ranks, active requests
// and their blocks after dropping the expired requests, and the counters.
func (t *Tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire()
	s := Stats{Trackers: len(t.trackers), Workers: t.workers, Ranks: t.ranks, Requests: t.requests, Blocks: t.blocks,
		Expired: t.expired.Load()}
	for r := range s.Rejected {
		s.Rejected[r] = t.rejected[r].Load()
	}
	return s
}
