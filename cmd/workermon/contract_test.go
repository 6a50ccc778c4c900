package main_test

// Black-box contract suite for workermon, written only from
// /work/shared/DESIGN.md (the wire contract) and the "Choices this
// implementation makes" section of docs/contract.md.
//
// It builds ./cmd/workermon, starts `workermon serve` (and `workermon
// router`) as separate processes on free 127.0.0.1 ports, publishes
// msgpack reports and goodbyes encoded here from plain maps, and reads the
// KV buckets and HTTP APIs. It imports none of the project's packages.
//
// Run: go test -race -run Contract ./cmd/workermon

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/vmihailenco/msgpack/v5"
)

// Short intervals so the whole suite runs in well under a minute.
const (
	tWarmup     = 300 * time.Millisecond
	tHeartbeat  = 300 * time.Millisecond
	tStaleAfter = 1 * time.Second
	tGoneAfter  = 3 * time.Second

	prefix        = "workermon"
	busyBucket    = "workermon-busy"
	thrBucket     = "workermon-thresholds"
	workersBucket = "workermon-workers"

	tLeaseTTL = 300 * time.Millisecond

	allBusyBody = `{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503,"error":{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","param":null,"code":503}}`
)

var (
	buildOnce sync.Once
	buildErr  error
	binDir    string
	wmBin     string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// wmBinary builds ./cmd/workermon once per test binary.
func wmBinary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "workermon-contract-")
		if buildErr != nil {
			return
		}
		wmBin = filepath.Join(binDir, "workermon")
		cmd := exec.Command("go", "build", "-o", wmBin, ".")
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return wmBin
}

var (
	portsMu   sync.Mutex
	portsUsed = map[string]bool{}
)

// freeAddr returns a 127.0.0.1 address with a port that was free a moment
// ago and was not handed out before by this test binary.
func freeAddr(t testing.TB) string {
	t.Helper()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		a := l.Addr().String()
		l.Close()
		portsMu.Lock()
		used := portsUsed[a]
		portsUsed[a] = true
		portsMu.Unlock()
		if !used {
			return a
		}
	}
}

// ---------------------------------------------------------------------------
// processes

// syncBuf is a goroutine-safe output buffer.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (s *syncBuf) tail(n int) string {
	str := s.String()
	if len(str) > n {
		str = "…" + str[len(str)-n:]
	}
	return str
}

// proc is one workermon process.
type proc struct {
	t      testing.TB
	name   string
	args   []string
	cmd    *exec.Cmd
	out    *syncBuf
	exited chan struct{}
	err    error
}

func startProc(t testing.TB, name string, args ...string) *proc {
	t.Helper()
	return startProcEnv(t, name, nil, args...)
}

// startProcEnv starts the binary with extra environment variables.
func startProcEnv(t testing.TB, name string, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{t: t, name: name, args: args, out: &syncBuf{}, exited: make(chan struct{})}
	p.cmd = exec.Command(wmBinary(t), args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout = p.out
	p.cmd.Stderr = p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("---- output of %s (%s) ----\n%s", name, strings.Join(args, " "), p.out.tail(6000))
		}
	})
	return p
}

func (p *proc) alive() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM and waits for the exit (SIGKILL after 10s).
func (p *proc) stop() {
	if !p.alive() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.t.Errorf("%s did not exit 10s after SIGTERM", p.name)
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// kill sends SIGKILL and waits.
func (p *proc) kill() {
	if !p.alive() {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// errExited: the process exited before it was ready.
var errExited = errors.New("exited before ready")

// waitHTTP polls url until it answers 200.
func waitHTTP(t testing.TB, p *proc, url string, within time.Duration) {
	t.Helper()
	if err := waitHTTPErr(p, url, within); err != nil {
		t.Fatal(err)
	}
}

// waitHTTPErr polls url until it answers 200.
func waitHTTPErr(p *proc, url string, within time.Duration) error {
	deadline := time.Now().Add(within)
	var last string
	for time.Now().Before(deadline) {
		if !p.alive() {
			return fmt.Errorf("%s %w (%s): %v\n%s", p.name, errExited, url, p.err, p.out.tail(4000))
		}
		resp, err := http.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, b)
		} else {
			last = err.Error()
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("%s not ready within %v: %s", url, within, last)
}

// addrInUse: the process could not listen on a port picked by freeAddr
// (another process took it meanwhile): worth a retry on other ports.
func addrInUse(err error, p *proc) bool {
	return errors.Is(err, errExited) && strings.Contains(p.out.String(), "address already in use")
}

// monitor is one `workermon serve` process.
type monitor struct {
	*proc
	t        testing.TB
	natsAddr string // embedded NATS listen address ("" with --nats-url)
	natsURL  string
	httpAddr string
	dataDir  string
	base     string
}

type monOpt struct {
	flags    []string // extra flags, appended last (a repeated flag: last wins)
	natsURL  string   // use this NATS instead of the embedded one
	dataDir  string   // reuse a data dir (restart)
	natsAddr string   // reuse an embedded NATS address (restart)
	natsEnv  bool     // pass natsURL as NATS_URL in the environment, not --nats-url
}

// startMonitor starts `workermon serve` with the short intervals and flags
// and waits for /readyz.
func startMonitor(t testing.TB, o monOpt) *monitor {
	t.Helper()
	for attempt := 1; ; attempt++ {
		m, err := tryStartMonitor(t, o)
		if err == nil {
			return m
		}
		if attempt < 4 && addrInUse(err, m.proc) {
			t.Logf("port taken, retrying: %v", err)
			continue
		}
		t.Fatal(err)
	}
}

func tryStartMonitor(t testing.TB, o monOpt) (*monitor, error) {
	t.Helper()
	m := &monitor{t: t, httpAddr: freeAddr(t), dataDir: o.dataDir, natsAddr: o.natsAddr}
	if m.dataDir == "" {
		m.dataDir = t.TempDir()
	}
	args := []string{"serve", "--http-addr", m.httpAddr, "--data-dir", m.dataDir,
		"--warmup", tWarmup.String(), "--heartbeat", tHeartbeat.String(),
		"--stale-after", tStaleAfter.String(), "--gone-after", tGoneAfter.String(), "--lease-ttl", tLeaseTTL.String()}
	var env []string
	if o.natsURL != "" && o.natsEnv {
		m.natsURL = o.natsURL
		env = append(env, "NATS_URL="+o.natsURL)
	} else if o.natsURL != "" {
		m.natsURL = o.natsURL
		args = append(args, "--nats-url", o.natsURL)
	} else {
		if m.natsAddr == "" {
			m.natsAddr = freeAddr(t)
		}
		m.natsURL = "nats://" + m.natsAddr
		args = append(args, "--embedded-nats-addr", m.natsAddr)
	}
	args = append(args, o.flags...)
	m.proc = startProcEnv(t, "monitor", env, args...)
	m.base = "http://" + m.httpAddr
	return m, waitHTTPErr(m.proc, m.base+"/readyz", 15*time.Second)
}

// ---------------------------------------------------------------------------
// NATS

type natsClient struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	busy jetstream.KeyValue
}

func connect(t testing.TB, url string) *natsClient {
	t.Helper()
	var nc *nats.Conn
	var err error
	deadline := time.Now().Add(10 * time.Second)
	for {
		nc, err = nats.Connect(url, nats.ReconnectWait(50*time.Millisecond), nats.MaxReconnects(-1),
			nats.RetryOnFailedConnect(false), nats.Timeout(2*time.Second))
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return &natsClient{nc: nc, js: js}
}

// kv opens a bucket, waiting for whoever creates it.
func (c *natsClient) kv(t testing.TB, bucket string) jetstream.KeyValue {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		kv, err := c.js.KeyValue(ctx, bucket)
		cancel()
		if err == nil {
			return kv
		}
		if time.Now().After(deadline) {
			t.Fatalf("bucket %s: %v", bucket, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// busyKV is the workermon-busy bucket.
func (c *natsClient) busyKV(t testing.TB) jetstream.KeyValue {
	if c.busy == nil {
		c.busy = c.kv(t, busyBucket)
	}
	return c.busy
}

// monClient connects to a monitor's NATS.
func (m *monitor) client(t testing.TB) *natsClient {
	t.Helper()
	c := connect(t, m.natsURL)
	c.busyKV(t)
	return c
}

// startMonitorKV starts a monitor (startMonitor) and returns it with a client
// of its NATS and the workermon-busy bucket.
func startMonitorKV(t testing.TB, o monOpt) (*monitor, *natsClient, jetstream.KeyValue) {
	t.Helper()
	m := startMonitor(t, o)
	c := m.client(t)
	return m, c, c.busyKV(t)
}

// ---------------------------------------------------------------------------
// model_key (DESIGN §2), written independently from the product

func modelKey(model string) string {
	var b strings.Builder
	for i := 0; i < len(model); i++ {
		c := model[i]
		switch {
		case c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '_', c == '/', c == '-':
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, "=%02X", c)
		}
	}
	return b.String()
}

func TestContractModelKeyHelper(t *testing.T) {
	for in, want := range map[string]string{"Qwen/Qwen3-0.6B": "Qwen/Qwen3-0=2E6B", "a b": "a=20b", "x=y": "x=3Dy"} {
		if got := modelKey(in); got != want {
			t.Errorf("modelKey(%q) = %q, want %q", in, got, want)
		}
	}
}

var modelSeq atomic.Int64

// newModel returns a unique model name that needs escaping (a '.' and a ' ').
func newModel(t testing.TB) string {
	n := modelSeq.Add(1)
	name := strings.NewReplacer("/", "_", "#", "_").Replace(t.Name())
	if len(name) > 150 {
		name = name[len(name)-150:]
	}
	return fmt.Sprintf("ct/%s v%d.0", name, n)
}

// ---------------------------------------------------------------------------
// msgpack

// omit removes a key from a report built by the helpers.
type omit struct{}

// enc encodes v the way another language's msgpack library would: compact ints.
func enc(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true)
	if err := e.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// pub is one publisher instance: (worker, source, boot) with its seq counter.
type pub struct {
	t      testing.TB
	nc     *nats.Conn
	model  string
	worker uint64
	source string // "" = key omitted (engine)
	boot   uint64
	seq    uint64
	base   map[string]any // fields sent with every report (dp_start, dp_size, ...)
	mu     sync.Mutex
}

var bootSeq atomic.Uint64

func init() { bootSeq.Store(uint64(time.Now().UnixNano()) & 0xffffffff) }

func newPub(t testing.TB, c *natsClient, model string, worker uint64) *pub {
	return &pub{t: t, nc: c.nc, model: model, worker: worker, boot: bootSeq.Add(7919), base: map[string]any{}}
}

func (p *pub) withSource(s string) *pub { p.source = s; return p }
func (p *pub) withDP(start, size uint32) *pub {
	p.base["dp_start"] = start
	p.base["dp_size"] = size
	return p
}

// newBoot simulates a publisher restart.
func (p *pub) newBoot() { p.mu.Lock(); p.boot = bootSeq.Add(7919); p.seq = 0; p.mu.Unlock() }

func loadSubject(model string, worker uint64, rank uint32) string {
	return fmt.Sprintf("%s.load.%s.%d.%d", prefix, modelKey(model), worker, rank)
}

func byeSubject(model string, worker uint64) string {
	return fmt.Sprintf("%s.bye.%s.%d", prefix, modelKey(model), worker)
}

// estSubject and estByeSubject are where a router's estimates and goodbye
// go (§11): routers are accepted only there.
func estSubject(model string, worker uint64, rank uint32) string {
	return fmt.Sprintf("%s.est.%s.%d.%d", prefix, modelKey(model), worker, rank)
}

func estByeSubject(model string, worker uint64) string {
	return fmt.Sprintf("%s.est.%s.%d.bye", prefix, modelKey(model), worker)
}

// router reports whether this publisher is a router's estimator.
func (p *pub) router() bool { return strings.HasPrefix(p.source, "router/") }

// msg builds a report map for rank (no publication); seq is taken from the counter.
func (p *pub) msg(rank uint32, fields map[string]any) map[string]any {
	p.mu.Lock()
	p.seq++
	seq := p.seq
	p.mu.Unlock()
	m := map[string]any{
		"v": 1, "model": p.model, "worker_id": p.worker, "dp_rank": rank,
		"boot_id": p.boot, "seq": seq, "sent_at": time.Now().UnixNano(),
	}
	if p.source != "" {
		m["source"] = p.source
	}
	for k, v := range p.base {
		m[k] = v
	}
	for k, v := range fields {
		if _, ok := v.(omit); ok {
			delete(m, k)
			continue
		}
		m[k] = v
	}
	return m
}

// report publishes one load report for rank.
func (p *pub) report(rank uint32, fields map[string]any) map[string]any {
	m := p.msg(rank, fields)
	subject := loadSubject(p.model, p.worker, rank)
	if p.router() {
		subject = estSubject(p.model, p.worker, rank)
	}
	publish(p.t, p.nc, subject, enc(p.t, m))
	return m
}

// bye publishes a goodbye of this publisher.
func (p *pub) bye(fields map[string]any) {
	p.mu.Lock()
	p.seq++
	seq := p.seq
	p.mu.Unlock()
	m := map[string]any{"v": 1, "model": p.model, "worker_id": p.worker, "boot_id": p.boot, "seq": seq, "sent_at": time.Now().UnixNano()}
	if p.source != "" {
		m["source"] = p.source
	}
	for k, v := range fields {
		if _, ok := v.(omit); ok {
			delete(m, k)
			continue
		}
		m[k] = v
	}
	subject := byeSubject(p.model, p.worker)
	if p.router() {
		subject = estByeSubject(p.model, p.worker)
	}
	publish(p.t, p.nc, subject, enc(p.t, m))
}

func publish(t testing.TB, nc *nats.Conn, subject string, data []byte) {
	t.Helper()
	if err := nc.Publish(subject, data); err != nil {
		t.Fatalf("publish %s: %v", subject, err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}
}

// keepAlive re-publishes fields for each rank every 100ms until the test ends
// or stop is called.
func (p *pub) keepAlive(fields map[string]any, ranks ...uint32) (stop func()) {
	if len(ranks) == 0 {
		ranks = []uint32{0}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(100 * time.Millisecond)
		defer tk.Stop()
		for {
			for _, r := range ranks {
				m := p.msg(r, fields)
				b, err := msgpack.Marshal(m)
				if err == nil {
					_ = p.nc.Publish(loadSubject(p.model, p.worker, r), b)
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	p.t.Cleanup(stop)
	return stop
}

// ---------------------------------------------------------------------------
// BusySet records

type record struct {
	m   map[string]any
	raw []byte
	rev uint64
}

func decodeLoose(b []byte) (any, error) {
	d := msgpack.NewDecoder(bytes.NewReader(b))
	d.UseLooseInterfaceDecoding(true)
	d.SetMapDecoder(func(d *msgpack.Decoder) (any, error) { return d.DecodeUntypedMap() })
	var v any
	err := d.Decode(&v)
	return v, err
}

func parseRecord(b []byte, rev uint64) (record, error) {
	v, err := decodeLoose(b)
	if err != nil {
		return record{}, err
	}
	um, ok := v.(map[any]any)
	if !ok {
		return record{}, fmt.Errorf("record is %T, not a map", v)
	}
	m := map[string]any{}
	for k, v := range um {
		ks, ok := k.(string)
		if !ok {
			return record{}, fmt.Errorf("record key %v (%T) is not a string", k, k)
		}
		m[ks] = v
	}
	return record{m: m, raw: b, rev: rev}, nil
}

func toU64(v any) (uint64, bool) {
	switch x := v.(type) {
	case uint64:
		return x, true
	case int64:
		if x >= 0 {
			return uint64(x), true
		}
	}
	return 0, false
}

func toF64(v any) (float64, bool) {
	switch x := v.(type) {
	case float64:
		return x, true
	case float32:
		return float64(x), true
	case uint64:
		return float64(x), true
	case int64:
		return float64(x), true
	}
	return 0, false
}

func (r record) ids(key string) []uint64 {
	arr, _ := r.m[key].([]any)
	out := []uint64{}
	for _, v := range arr {
		u, _ := toU64(v)
		out = append(out, u)
	}
	return out
}

func (r record) busy() []uint64  { return r.ids("busy") }
func (r record) free() []uint64  { return r.ids("free") }
func (r record) stale() []uint64 { return r.ids("stale") }
func (r record) allBusy() bool   { b, _ := r.m["all_busy"].(bool); return b }
func (r record) u64(key string) uint64 {
	u, _ := toU64(r.m[key])
	return u
}
func (r record) i64(key string) int64 {
	switch x := r.m[key].(type) {
	case int64:
		return x
	case uint64:
		return int64(x)
	}
	return 0
}

func (r record) reasons() map[string]string {
	out := map[string]string{}
	if m, ok := r.m["reasons"].(map[any]any); ok {
		for k, v := range m {
			ks, _ := k.(string)
			vs, _ := v.(string)
			out[ks] = vs
		}
	}
	return out
}

func (r record) thresholds() map[string]any {
	out := map[string]any{}
	if m, ok := r.m["thresholds"].(map[any]any); ok {
		for k, v := range m {
			ks, _ := k.(string)
			out[ks] = v
		}
	}
	return out
}

func (r record) has(list string, id uint64) bool { return slices.Contains(r.ids(list), id) }

// where returns the list ("busy", "free", "stale") that holds id, or "".
func (r record) where(id uint64) string {
	for _, l := range []string{"busy", "free", "stale"} {
		if r.has(l, id) {
			return l
		}
	}
	return ""
}

func (r record) String() string {
	if r.m == nil {
		return "<no record>"
	}
	keys := make([]string, 0, len(r.m))
	for k := range r.m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	b.WriteString("{")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%s:%v", k, r.m[k])
	}
	fmt.Fprintf(&b, "} rev=%d", r.rev)
	return b.String()
}

// getRecord reads the model's record; ok=false when the key does not exist.
func getRecord(t testing.TB, kv jetstream.KeyValue, model string) (record, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	e, err := kv.Get(ctx, modelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return record{}, false
	}
	if err != nil {
		t.Logf("kv get %s: %v", modelKey(model), err)
		return record{}, false
	}
	if e.Operation() != jetstream.KeyValuePut {
		return record{}, false
	}
	r, err := parseRecord(e.Value(), e.Revision())
	if err != nil {
		t.Fatalf("record %s does not decode: %v (% x)", modelKey(model), err, e.Value())
	}
	return r, true
}

// waitRecord polls the model's record until cond holds (deadline 6s).
func waitRecord(t testing.TB, kv jetstream.KeyValue, model, what string, cond func(record) bool) record {
	t.Helper()
	return waitRecordFor(t, kv, model, what, 6*time.Second, cond)
}

func waitRecordFor(t testing.TB, kv jetstream.KeyValue, model, what string, within time.Duration, cond func(record) bool) record {
	t.Helper()
	deadline := time.Now().Add(within)
	var last record
	for {
		r, ok := getRecord(t, kv, model)
		if ok {
			last = r
			if cond(r) {
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("model %q: %s: not reached within %v; last record: %v", model, what, within, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitGone polls until the model's key does not exist.
func waitGone(t testing.TB, kv jetstream.KeyValue, model string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	var last record
	for {
		r, ok := getRecord(t, kv, model)
		if !ok {
			return
		}
		last = r
		if time.Now().After(deadline) {
			t.Fatalf("model %q: key not deleted within %v; last record: %v", model, within, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// lists is an exact expectation of the three lists.
type lists struct{ busy, free, stale []uint64 }

func (l lists) match(r record) bool {
	eq := func(a, b []uint64) bool {
		if len(a) == 0 && len(b) == 0 {
			return true
		}
		return reflect.DeepEqual(a, b)
	}
	return eq(l.busy, r.busy()) && eq(l.free, r.free()) && eq(l.stale, r.stale())
}

func waitLists(t testing.TB, kv jetstream.KeyValue, model string, l lists) record {
	t.Helper()
	return waitRecord(t, kv, model, fmt.Sprintf("busy=%v free=%v stale=%v", l.busy, l.free, l.stale), l.match)
}

var barrierSeq atomic.Uint64

func init() { barrierSeq.Store(1 << 40) }

// barrier publishes a report of a fresh worker of the same model and waits
// until it shows in the record: every earlier message of this connection for
// the model has then been handled. It returns the record.
func barrier(t testing.TB, c *natsClient, model string) record {
	t.Helper()
	id := barrierSeq.Add(1)
	p := newPub(t, c, model, id)
	p.report(0, map[string]any{"active_prefill_tokens": 0, "active_decode_blocks": 0, "kv_total_blocks": 100})
	return waitRecord(t, c.busyKV(t), model, fmt.Sprintf("barrier worker %d listed", id), func(r record) bool {
		return r.has("free", id) || r.has("busy", id)
	})
}

// checkWhere waits for the model's earlier messages to be handled (barrier)
// and wants worker id in the list want ("busy", "free", "stale", or "" for
// none); what says what a failure means.
func checkWhere(t testing.TB, c *natsClient, model string, id uint64, want, what string) {
	t.Helper()
	r := barrier(t, c, model)
	if got := r.where(id); got != want {
		t.Errorf("%s: worker %d in %q, want %q: %v", what, id, got, want, r)
	}
}

// ---------------------------------------------------------------------------
// metrics

var metricLine = func(line string) (name string, labels string, val float64, ok bool) {
	if line == "" || line[0] == '#' {
		return
	}
	sp := strings.LastIndexByte(line, ' ')
	if sp < 0 {
		return
	}
	v, err := strconv.ParseFloat(line[sp+1:], 64)
	if err != nil {
		return
	}
	id := line[:sp]
	if i := strings.IndexByte(id, '{'); i >= 0 {
		return id[:i], id[i:], v, true
	}
	return id, "", v, true
}

// metric sums the series of name whose labels contain every labelPart.
func (m *monitor) metric(t testing.TB, name string, labelParts ...string) float64 {
	t.Helper()
	return scrapeMetric(t, m.base+"/metrics", name, labelParts...)
}

func scrapeMetric(t testing.TB, url, name string, labelParts ...string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
outer:
	for sc.Scan() {
		n, l, v, ok := metricLine(sc.Text())
		if !ok || n != name {
			continue
		}
		for _, p := range labelParts {
			if !strings.Contains(l, p) {
				continue outer
			}
		}
		sum += v
	}
	return sum
}

const rejectedMetric = "workermon_reports_rejected_total"

// rejected is the total of rejected/dropped messages (all reasons, or one).
func (m *monitor) rejected(t testing.TB, reason string) float64 {
	if reason == "" {
		return m.metric(t, rejectedMetric)
	}
	return m.metric(t, rejectedMetric, `reason="`+reason+`"`)
}

// waitRejected waits until the rejection counter reaches at least want.
func (m *monitor) waitRejected(t testing.TB, reason string, want float64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := m.rejected(t, reason)
		if got >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s{reason=%q} = %v, want >= %v", rejectedMetric, reason, got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ---------------------------------------------------------------------------
// HTTP

type httpResp struct {
	code   int
	header http.Header
	body   []byte
}

func doHTTP(t testing.TB, method, url, contentType string, body []byte, hdr ...string) httpResp {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return httpResp{code: resp.StatusCode, header: resp.Header, body: b}
}

func u64s(v ...uint64) []uint64 { return v }

// getKV returns a key's value, or nil when there is none.
func getKV(t testing.TB, kv jetstream.KeyValue, key string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	e, err := kv.Get(ctx, key)
	if err != nil {
		return nil
	}
	return e.Value()
}
