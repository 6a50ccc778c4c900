//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	prommodel "github.com/prometheus/common/model"

	"github.com/workermon/workermon/events"
)

// opTimeout bounds every request the test makes.
const opTimeout = 3 * time.Second

// observer is the test's own NATS client, connected through the mapped
// ports of the servers that run when it is made.
type observer struct {
	t  *testing.T
	nc *nats.Conn
	js jetstream.JetStream
}

// observe connects to every running NATS node of the stack. Servers of a
// cluster advertise addresses only reachable inside the network: the client
// keeps to the URLs it was given.
func (s *stack) observe() *observer {
	s.t.Helper()
	nc := s.connect("monitor", "integration-test")
	js, err := jetstream.New(nc)
	if err != nil {
		s.t.Fatalf("observer: %v", err)
	}
	return &observer{t: s.t, nc: nc, js: js}
}

// connect connects to every running NATS node of the stack, through the
// mapped ports, as user (one of passwords), under the connection name name.
// The connection is closed at the end of the test.
func (s *stack) connect(user, name string, more ...nats.Option) *nats.Conn {
	s.t.Helper()
	var urls []string
	for i, c := range s.nats {
		if inspectLifecycle(s.t, c).running {
			urls = append(urls, "nats://"+endpoint(s.t, c, "4222/tcp"))
		} else {
			s.t.Logf("%s: %s is down, not connecting to it", name, s.natsIDs[i])
		}
	}
	opts := []nats.Option{
		nats.UserInfo(user, passwords[user]),
		nats.Name(name),
		nats.IgnoreDiscoveredServers(),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(200 * time.Millisecond),
		nats.PingInterval(time.Second),
		nats.Timeout(opTimeout),
	}
	nc, err := nats.Connect(strings.Join(urls, ","), append(opts, more...)...)
	if err != nil {
		s.t.Fatalf("%s: connect to %v as %s: %v", name, urls, user, err)
	}
	s.t.Cleanup(nc.Close)
	return nc
}

func (o *observer) close() { o.nc.Close() }

// entry is one revision of the model's busy-set record.
type entry struct {
	rev uint64
	rec events.BusySet
}

func (e entry) String() string {
	r := e.rec
	age := time.Since(time.Unix(0, r.UpdatedAt)).Round(time.Millisecond)
	return fmt.Sprintf("rev=%d epoch=%d seq=%d monitor=%s free=%v busy=%v stale=%v all_busy=%v reasons=%v updated %v ago",
		e.rev, r.Epoch, r.Seq, r.MonitorID, r.Free, r.Busy, r.Stale, r.AllBusy, r.Reasons, age)
}

// record reads the model's record from the busy bucket; ok is false when
// there is none.
func (o *observer) record() (e entry, ok bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	kv, err := o.js.KeyValue(ctx, events.BusyBucket)
	if err != nil {
		return entry{}, false, err
	}
	kve, err := kv.Get(ctx, events.ModelKey(model))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return entry{}, false, nil
	}
	if err != nil {
		return entry{}, false, err
	}
	rec, err := events.DecodeBusySet(kve.Value())
	if err != nil {
		return entry{}, false, fmt.Errorf("decode revision %d: %w", kve.Revision(), err)
	}
	return entry{rev: kve.Revision(), rec: rec}, true, nil
}

// waitRecord waits until the model's record satisfies cond and returns it.
func (o *observer) waitRecord(timeout time.Duration, what string, cond func(entry) bool) entry {
	o.t.Helper()
	var got entry
	waitFor(o.t, timeout, what, func() (bool, string) {
		e, ok, err := o.record()
		switch {
		case err != nil:
			return false, "read: " + err.Error()
		case !ok:
			return false, "no record"
		}
		got = e
		return cond(e), e.String()
	})
	return got
}

// waitBothFree waits until the record lists workers 1 and 2, both free.
func (o *observer) waitBothFree(timeout time.Duration) entry {
	o.t.Helper()
	return o.waitRecord(timeout, "both workers free", func(e entry) bool { return freeAre(e.rec, 1, 2) })
}

// watch collects every revision of the model's record from now on, until
// the test ends or stop is called.
func (o *observer) watch() (entries func() []entry, stop func()) {
	o.t.Helper()
	w, cancel := o.watchKey(events.BusyBucket, events.ModelKey(model), "watch")
	ch := make(chan []entry, 1)
	ch <- nil
	done := make(chan struct{})
	go func() {
		defer close(done)
		for kve := range w.Updates() {
			if kve == nil || kve.Operation() != jetstream.KeyValuePut {
				continue
			}
			rec, err := events.DecodeBusySet(kve.Value())
			if err != nil {
				o.t.Errorf("watch: revision %d: %v", kve.Revision(), err)
				continue
			}
			all := <-ch
			ch <- append(all, entry{rev: kve.Revision(), rec: rec})
		}
	}()
	stop = func() { cancel(); <-done }
	o.t.Cleanup(stop)
	return func() []entry { all := <-ch; ch <- all; return slices.Clone(all) }, stop
}

// watchKey watches key of bucket for updates from now on, failing the test
// (what names the watch) when it cannot; cancel ends the watch.
func (o *observer) watchKey(bucket, key, what string) (w jetstream.KeyWatcher, cancel context.CancelFunc) {
	o.t.Helper()
	ctx, cancel := context.WithCancel(o.t.Context())
	octx, ocancel := context.WithTimeout(ctx, opTimeout)
	defer ocancel()
	kv, err := o.js.KeyValue(octx, bucket)
	if err != nil {
		cancel()
		o.t.Fatalf("%s: %v", what, err)
	}
	w, err = kv.Watch(ctx, key, jetstream.UpdatesOnly())
	if err != nil {
		cancel()
		o.t.Fatalf("%s: %v", what, err)
	}
	return w, cancel
}

// listed reports whether worker id is in the record, in any list.
func listed(r events.BusySet, id uint64) bool {
	return slices.Contains(r.Free, id) || slices.Contains(r.Busy, id) || slices.Contains(r.Stale, id)
}

// freeAre reports whether exactly ids are free and nothing else is listed.
func freeAre(r events.BusySet, ids ...uint64) bool {
	return slices.Equal(r.Free, ids) && len(r.Busy) == 0 && len(r.Stale) == 0 && !r.AllBusy
}

// routerClient talks to the router through its mapped port.
type routerClient struct {
	t    *testing.T
	base string
	http *http.Client
}

func (s *stack) routerClient() *routerClient {
	return &routerClient{t: s.t, base: "http://" + endpoint(s.t, s.router, "8080/tcp"),
		http: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 30 * time.Second}}
}

// routing returns the stack's observer and router client once both workers
// are free (within timeout; first is that record) and a request went
// through the router.
func (s *stack) routing(timeout time.Duration) (obs *observer, rc *routerClient, first entry) {
	s.t.Helper()
	obs = s.observe()
	rc = s.routerClient()
	first = obs.waitBothFree(timeout)
	rc.untilOK(15*time.Second, "a request served through the router")
	return obs, rc, first
}

// answer is the router's answer to one completion request.
type answer struct {
	status     int
	worker     uint64 // who served it, from the completion id cmpl-<worker>-<n>
	retryAfter string
	ctype      string
	body       string
	err        error
}

func (a answer) String() string {
	if a.err != nil {
		return "error: " + a.err.Error()
	}
	if a.status == http.StatusOK {
		return fmt.Sprintf("200 from worker %d", a.worker)
	}
	return fmt.Sprintf("%d %s", a.status, strings.TrimSpace(a.body))
}

// complete sends one non-streamed completion with a prompt of promptBytes
// bytes (about promptBytes/4 tokens to the simulated engine).
func (r *routerClient) complete(ctx context.Context, promptBytes, maxTokens int) answer {
	body, _ := json.Marshal(map[string]any{
		"model": model, "prompt": strings.Repeat("a", promptBytes), "max_tokens": maxTokens})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return answer{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := r.http.Do(req)
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"),
		ctype: resp.Header.Get("Content-Type"), body: string(data), err: err}
	if resp.StatusCode == http.StatusOK {
		var c struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal(data, &c); err != nil {
			a.err = fmt.Errorf("completion: %w: %s", err, data)
			return a
		}
		parts := strings.Split(c.ID, "-") // cmpl-<worker>-<n>
		if len(parts) != 3 {
			a.err = fmt.Errorf("completion id %q is not cmpl-<worker>-<n>", c.ID)
			return a
		}
		a.worker, a.err = strconv.ParseUint(parts[1], 10, 64)
	}
	return a
}

// spread sends n requests, conc at a time, and counts who served them; any
// answer but 200 fails the test.
func (r *routerClient) spread(n, conc, promptBytes, maxTokens int) map[uint64]int {
	r.t.Helper()
	out := make(chan answer, n)
	sem := make(chan struct{}, conc)
	for range n {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(r.t.Context(), 30*time.Second)
			defer cancel()
			out <- r.complete(ctx, promptBytes, maxTokens)
		}()
	}
	served := map[uint64]int{}
	for range n {
		a := <-out
		if a.err != nil || a.status != http.StatusOK {
			r.t.Errorf("request through the router: %v", a)
			continue
		}
		served[a.worker]++
	}
	return served
}

// untilOK repeats a small request until the router answers 200.
func (r *routerClient) untilOK(timeout time.Duration, what string) answer {
	r.t.Helper()
	var last answer
	waitFor(r.t, timeout, what, func() (bool, string) {
		ctx, cancel := context.WithTimeout(r.t.Context(), 10*time.Second)
		defer cancel()
		last = r.complete(ctx, 64, 4)
		return last.err == nil && last.status == http.StatusOK, last.String()
	})
	return last
}

// metrics scrapes the router's /metrics.
func (r *routerClient) metrics() map[string]*dto.MetricFamily {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(r.t.Context(), opTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.base+"/metrics", nil)
	resp, err := r.http.Do(req)
	if err != nil {
		r.t.Fatalf("scrape router: %v", err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(prommodel.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		r.t.Fatalf("parse router metrics: %v", err)
	}
	return mfs
}

// counter sums the samples of a counter family whose labels include want.
func counter(mfs map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	var sum float64
	mf := mfs[name]
	if mf == nil {
		return 0
	}
next:
	for _, m := range mf.GetMetric() {
		for k, v := range want {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		sum += m.GetCounter().GetValue()
	}
	return sum
}

// countsString renders answer counts by status, sorted.
func countsString(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s×%d", k, m[k]))
	}
	return joinComma(parts)
}

// servedString renders requests per worker, sorted.
func servedString(m map[uint64]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("worker %d×%d", k, m[k]))
	}
	if len(parts) == 0 {
		return "nobody"
	}
	return joinComma(parts)
}

func joinComma(parts []string) string { return strings.Join(parts, ", ") }
