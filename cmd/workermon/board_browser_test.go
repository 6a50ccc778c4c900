package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	"github.com/workermon/workermon/board"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/publisher"
)

// chromiumNames are the executables the browser test looks for on PATH;
// $WORKERMON_CHROMIUM names another.
var chromiumNames = []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless-shell"}

// findChromium returns the browser to drive, or "" when there is none.
func findChromium() string {
	if p := os.Getenv("WORKERMON_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range chromiumNames {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// serveBoard serves a board of cfg until the end of the test and returns
// its URL.
func serveBoard(t *testing.T, cfg board.Config) string {
	t.Helper()
	bd, err := board.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = bd.Close() })
	srv := httptest.NewServer(bd)
	t.Cleanup(srv.Close)
	return srv.URL
}

// screenshotDir is where the browser test saves its screenshot:
// $WORKERMON_TEST_OUTPUT when set, else the test's artifact directory
// (kept under -outputdir with `go test -artifacts`, removed otherwise).
func screenshotDir(t *testing.T) string {
	if dir := os.Getenv("WORKERMON_TEST_OUTPUT"); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	return t.ArtifactDir()
}

// TestBoardInBrowser opens the monitor's board in headless Chromium: a
// model appears with its workers, a worker made busy changes its tile
// within a second, a model with every worker busy is marked ALL BUSY, a
// cordoned worker shows it; it saves a screenshot.
func TestBoardInBrowser(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM): "+
			"install it with `apt-get install -y chromium` (.ci/run does)", chromiumNames)
	}
	t.Parallel()
	svc := testService(t, func(o *serveOptions) {
		o.monitor.Defaults.ActivePrefillTokens = events.Ptr[uint64](2048)
	})
	nc, _ := connect(t, svc.natsURL)
	const model, full = "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B-Instruct"
	var mu sync.Mutex
	pubs := map[string]*publisher.Publisher{}
	publish := func(m string, id uint64, rank uint32, decode, prefill uint64) {
		t.Helper()
		key := m + "/" + strconv.FormatUint(id, 10)
		mu.Lock()
		p := pubs[key]
		if p == nil {
			var err error
			if p, err = publisher.New(nc, m, id, publisher.WithRanks(0, 2)); err != nil {
				mu.Unlock()
				t.Fatal(err)
			}
			pubs[key] = p
			t.Cleanup(func() { _ = p.Close(context.Background()) })
		}
		mu.Unlock()
		if err := p.Update(rank, publisher.Load{ActiveDecodeBlocks: events.Some(decode), KVTotalBlocks: events.Some(1000),
			ActivePrefillTokens: events.Some(prefill), MaxNumBatchedTokens: events.Some(8192)}); err != nil {
			t.Fatal(err)
		}
	}
	// 24 workers of two ranks at loads below the thresholds; three more,
	// of another model, all over them.
	for id := uint64(11); id < 35; id++ {
		for rank := range uint32(2) {
			publish(model, id, rank, 50+(id*37+uint64(rank)*101)%700, (id*53+uint64(rank)*7)%1800)
		}
	}
	for id := uint64(1); id <= 3; id++ {
		for rank := range uint32(2) {
			publish(full, id, rank, 850+id*20, 100*id)
		}
	}

	b := openBrowser(t, chrome, "http://"+svc.httpAddr+"/")
	ctx, poll := b.ctx, b.poll
	tile := func(m string, id int) string {
		return fmt.Sprintf(`document.querySelector('section[data-model=%q] .tile[data-worker="%d"]')`, m, id)
	}

	poll("the model and its 24 workers appear, free", fmt.Sprintf(
		`document.querySelectorAll('section[data-model=%q] .tile[data-state="free"]').length === 24`, model), 15*time.Second)
	poll("the other model is marked ALL BUSY", fmt.Sprintf(
		`(s => s !== null && s.dataset.allBusy === "true" && s.querySelector('.badge').textContent.includes("ALL BUSY"))(document.querySelector('section[data-model=%q]'))`,
		full), 15*time.Second)
	poll("the bars are drawn", `[...document.querySelectorAll('.bar.kv .fill')].some(e => e.offsetWidth > 0)`, 5*time.Second)
	// The record's saturation (contract §21) in each model's header: past
	// the busy line for the model whose workers are all busy.
	poll("the saturations", fmt.Sprintf(`(f => f !== null && f.classList.contains('high') && Number(f.dataset.v) > 1)(
		document.querySelector('section[data-model=%q] .saturation'))`, full), 10*time.Second)
	if s := b.text(fmt.Sprintf(`section[data-model=%q] .saturation`, model)); !regexp.MustCompile(`^saturation 0\.\d\d$`).MatchString(s) {
		t.Errorf("%s's saturation %q, want one below 1", model, s)
	}
	// Worker 13's rank 0 counts the prompt tokens it computes: the monitor
	// measures its prefill rate, and the board writes the predicted queue
	// delay and the rate over its new bar.
	delayFig := regexp.MustCompile(`^[0-9,.]+ m?s · [0-9.]+[KMBT]?/s$`)
	var prefilled uint64
	natstest.WaitFor(t, 15*time.Second, "worker 13's queue delay on the board", func() bool {
		prefilled += 1000
		mu.Lock()
		p := pubs[model+"/13"]
		mu.Unlock()
		if err := p.Update(0, publisher.Load{PrefilledTokens: events.Some(prefilled)}); err != nil {
			t.Fatal(err)
		}
		return delayFig.MatchString(b.text(fmt.Sprintf(`section[data-model=%q] .tile[data-worker="13"] .cell:has(.bar.qd) .fig`, model)))
	})

	// Worker 11 over the KV threshold on both ranks: busy.
	publish(model, 11, 0, 950, 10)
	publish(model, 11, 1, 900, 10)
	took := poll("worker 11's tile turns busy", fmt.Sprintf(`(t => t !== null && t.dataset.state === "busy" && t.textContent.includes("kv"))(%s)`,
		tile(model, 11)), 10*time.Second) // a deadline for a loaded machine; the delay is logged
	t.Logf("worker 11's tile turned busy %v after its report was published", took.Round(time.Millisecond))

	// Worker 12 cordoned through the API: its own colour.
	resp, err := http.Post("http://"+svc.httpAddr+"/cordon", "application/json",
		strings.NewReader(fmt.Sprintf(`{"model":%q,"worker_id":12}`, model)))
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("cordon: %s", resp.Status)
	}
	poll("worker 12's tile shows the cordon", fmt.Sprintf(`(t => t !== null && t.dataset.state === "cordoned")(%s)`,
		tile(model, 12)), 10*time.Second)

	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(screenshotDir(t), "board.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(shot))
	b.checkErrors()
}

// browser is a headless Chromium page under test.
type browser struct {
	t   *testing.T
	ctx context.Context

	mu       sync.Mutex
	jsErrors []string
}

// openBrowser starts chrome and opens url in it until the test ends.
func openBrowser(t *testing.T, chrome, url string) *browser {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chrome), chromedp.NoSandbox,
		chromedp.WindowSize(1280, 900))
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancelAlloc)
	ctx, cancel := chromedp.NewContext(allocCtx)
	t.Cleanup(cancel)
	b := &browser{t: t, ctx: ctx}
	if err := chromedp.Listen(ctx, func(ev any) {
		if e, ok := ev.(*runtime.EventExceptionThrown); ok {
			b.mu.Lock()
			d := e.ExceptionDetails
			msg := fmt.Sprintf("%s (%s:%d:%d)", d.Text, d.URL, d.LineNumber+1, d.ColumnNumber+1)
			if d.Exception != nil {
				msg += ": " + d.Exception.Description
			}
			b.jsErrors = append(b.jsErrors, msg)
			b.mu.Unlock()
		}
	}); err != nil {
		t.Fatalf("start Chromium %s: %v", chrome, err)
	}
	if err := chromedp.Do(ctx, chromedp.Navigate(url)); err != nil {
		t.Fatalf("open %s: %v", url, err)
	}
	return b
}

// poll waits, in the page, until expr is true, re-checking on every change
// of the DOM.
func (b *browser) poll(what, expr string, timeout time.Duration) time.Duration {
	b.t.Helper()
	start := time.Now()
	if _, err := chromedp.Run(b.ctx, chromedp.Poll[bool](expr, chromedp.WithPollingMutation(),
		chromedp.WithPollingTimeout(timeout))); err != nil {
		b.t.Fatalf("%s: not within %v: %v", what, timeout, err)
	}
	return time.Since(start)
}

// text returns the text of the first element that selector matches ("" when
// none).
func (b *browser) text(selector string) string {
	b.t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Evaluate[string](fmt.Sprintf(
		`(e => e === null ? "" : e.textContent.replace(/\s+/g, " ").trim())(document.querySelector(%q))`, selector)))
	if err != nil {
		b.t.Fatal(err)
	}
	return s
}

// texts returns the text of every element selector matches.
func (b *browser) texts(selector string) []string {
	b.t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Evaluate[[]string](fmt.Sprintf(
		`[...document.querySelectorAll(%q)].map(e => e.textContent.replace(/\s+/g, " ").trim())`, selector)))
	if err != nil {
		b.t.Fatal(err)
	}
	return s
}

// screenshot saves the page in screenshotDir as name.
func (b *browser) screenshot(name string) {
	b.t.Helper()
	shot, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.t.Fatal(err)
	}
	path := filepath.Join(screenshotDir(b.t), name)
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		b.t.Fatal(err)
	}
	b.t.Logf("screenshot: %s (%d bytes)", path, len(shot))
}

// checkErrors fails the test if the page threw.
func (b *browser) checkErrors() {
	b.t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.jsErrors) > 0 {
		b.t.Fatalf("JavaScript errors on the page: %v", b.jsErrors)
	}
}

// heldSource is a board.Source whose first Snapshot waits until release is
// closed, as a server that has not read its state yet.
type heldSource struct {
	release chan struct{}
	snap    board.Snapshot
}

func (s *heldSource) Snapshot(ctx context.Context) (board.Snapshot, error) {
	select {
	case <-s.release:
		return s.snap, nil
	case <-ctx.Done():
		return board.Snapshot{}, ctx.Err()
	}
}

// TestBoardWaitingAndCounts opens a board whose first snapshot is held
// back: the page shows its skeleton and what it waits for, not just
// "connecting…"; once the snapshot arrives, the header names the router's
// refusals apart (all busy, shed) and the model's card counts every
// refusal as "turned away", so the two numbers no longer share a name; it
// shows the requests waiting in the router's queue (contract §17).
func TestBoardWaitingAndCounts(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM): "+
			"install it with `apt-get install -y chromium` (.ci/run does)", chromiumNames)
	}
	t.Parallel()
	turnedAway, queued := uint64(7), uint64(3)
	src := &heldSource{release: make(chan struct{}), snap: board.Snapshot{Kind: board.KindMonitor, Name: "mon-1",
		Admissions: map[string]uint64{"admitted": 40, "rejected": 5, "shed": 2},
		Models: []board.Model{{Name: "m1", AllBusy: true, Rejecting: true, Rejected: &turnedAway, Queued: &queued,
			Counts:  board.Counts{Busy: 1},
			Workers: []board.Worker{{ID: 1, State: board.StateBusy, Reason: "kv"}}}}}}
	cfg := board.DefaultConfig()
	cfg.Source, cfg.ReadTimeout = src, time.Minute
	srvURL := serveBoard(t, cfg)

	b := openBrowser(t, chrome, srvURL+"/")
	b.poll("the stream connected", `document.getElementById("conn").textContent === "live"`, 10*time.Second)
	for sel, want := range map[string]string{
		"#waiting-head":             "waiting for the first snapshot",
		"#waiting-text":             "board/events",
		"#waiting .tiles":           "",
		"#summary span:first-child": "– models",
		"#summary span:last-child":  "– stale",
		"#waiting .skeleton":        "model",
	} {
		if got := b.text(sel); !strings.Contains(strings.ToLower(got), strings.ToLower(want)) {
			t.Errorf("before the first snapshot, %s shows %q, want %q in it", sel, got, want)
		}
	}
	b.screenshot("board-waiting.png")
	close(src.release)
	b.poll("the first snapshot rendered", `document.getElementById("waiting") === null && document.querySelector('section[data-model="m1"]') !== null`,
		10*time.Second)
	for sel, want := range map[string]string{
		"#summary .a-admitted":                  "40 admitted",
		"#summary .a-all-busy":                  "5 refused: all busy",
		"#summary .a-shed":                      "2 shed: low priority",
		`section[data-model="m1"] .turned-away`: "turned away 7 (all reasons)",
		`section[data-model="m1"] .queued`:      "queued 3",
	} {
		if got := b.text(sel); got != want {
			t.Errorf("%s shows %q, want %q", sel, got, want)
		}
	}
	if got := b.text("#summary") + " " + b.text(`section[data-model="m1"] .model-head`); strings.Contains(got, "rejected") {
		t.Errorf("the header and the card still say \"rejected\": %q", got)
	}
	b.screenshot("board-counts.png")
	b.checkErrors()
}

// changingSource is a board.Source whose snapshot the test changes.
type changingSource struct {
	mu   sync.Mutex
	snap board.Snapshot
}

func (s *changingSource) Snapshot(context.Context) (board.Snapshot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.snap, nil
}

func (s *changingSource) set(admitted, rejected, shed, queued uint64, busy int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Worker 1's rank has no KV total (a router's estimate): a hatched bar.
	kvThreshold := 0.8
	workers := []board.Worker{
		{ID: 1, State: board.StateFree, Endpoint: "http://10.0.0.1:8000", Ranks: []board.Rank{{KVUsed: 40, Prefill: 10}}},
		{ID: 2, State: board.StateFree, Ranks: []board.Rank{{KVUsed: 400, KVTotal: 1000, KVThreshold: &kvThreshold, Prefill: 20}}}}
	for i := range busy {
		workers[i].State = board.StateBusy
	}
	s.snap = board.Snapshot{Kind: board.KindRouter, Name: "r1",
		Admissions: map[string]uint64{"admitted": admitted, "rejected": rejected - shed, "shed": shed},
		Models: []board.Model{{Name: "m1", Rejected: &rejected, Queued: &queued, Counts: board.Counts{Busy: busy, Free: 2 - busy},
			Workers: workers}}}
}

// TestBoardStrip: each model's card draws its last minutes from the
// snapshots it streams: admitted, rejected and shed per second, the
// requests queued and the busy workers, with a legend of the recent values
// (rates over the last 5 s, falling to 0 once nothing changes).
func TestBoardStrip(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM)", chromiumNames)
	}
	t.Parallel()
	src := &changingSource{}
	src.set(0, 0, 0, 0, 0)
	cfg := board.DefaultConfig()
	cfg.Source, cfg.Interval = src, 50*time.Millisecond
	srvURL := serveBoard(t, cfg)

	b := openBrowser(t, chrome, srvURL+"/")
	b.poll("the model's strip", `document.querySelector('section[data-model="m1"] .strip-chart') !== null`, 10*time.Second)
	// A burst: the counters rise, requests queue, both workers turn busy.
	for i := uint64(1); i <= 5; i++ {
		src.set(20*i, 6*i, 2*i, 3*i, 2)
		b.poll(fmt.Sprintf("step %d shown", i), fmt.Sprintf(
			`document.querySelector('section[data-model="m1"] .strip-legend').textContent.includes('queued %d')`, 3*i), 10*time.Second)
	}
	legend := b.text(`section[data-model="m1"] .strip-legend`)
	for _, want := range []string{"admitted", "rejected", "shed", "queued 15", "busy workers 2/2", "last 10 min"} {
		if !strings.Contains(legend, want) {
			t.Errorf("legend %q lacks %q", legend, want)
		}
	}
	for _, line := range []string{"s-adm", "s-rej", "s-shed", "s-q"} {
		b.poll(line+" drawn", fmt.Sprintf(`(l => l !== null && l.getAttribute('points').split(' ').length >= 4)(
			document.querySelector('section[data-model="m1"] .strip-line.%s'))`, line), 10*time.Second)
	}
	b.poll("a positive rate of rejections", `
		document.querySelector('section[data-model="m1"] .strip-line.s-rej').getAttribute('points').split(' ').some(p => Number(p.split(',')[1]) < 100)`,
		10*time.Second)
	b.poll("the busy band", `document.querySelector('section[data-model="m1"] .strip-busy').getAttribute('d').length > 0`, 10*time.Second)
	b.screenshot("board-strip.png")
	// The burst is over: no snapshot comes while nothing changes, and the
	// rates fall back to 0 while the queue's level holds.
	b.poll("the rates back to 0", `(l => l.includes('rejected 0.0/s') && l.includes('admitted 0.0/s') && l.includes('queued 15'))(
		document.querySelector('section[data-model="m1"] .strip-legend').textContent)`, 20*time.Second)
	b.checkErrors()
}

// TestBoardHistoryInBrowser: a page opened after a peak shows it. The
// server's sampler recorded the peak (the rejections rising, both workers
// busy) before the page opened; the page's strip draws it from
// GET /board/history left of the line marking when the page opened, under
// a y axis with its unit and scale and an x axis of minutes. The two tiles
// fill the card, writing their figures, and the hatched bar of a rank with
// no KV total is explained.
func TestBoardHistoryInBrowser(t *testing.T) {
	chrome := findChromium()
	if chrome == "" {
		t.Skipf("Chromium not found (looked for %v on PATH and $WORKERMON_CHROMIUM)", chromiumNames)
	}
	t.Parallel()
	src := &changingSource{}
	src.set(0, 0, 0, 0, 0)
	cfg := board.DefaultConfig()
	cfg.Source, cfg.HistoryInterval = src, 50*time.Millisecond
	srvURL := serveBoard(t, cfg)
	// sampled waits until the server's history holds a point of rejected.
	sampled := func(rejected uint64) {
		t.Helper()
		natstest.WaitFor(t, 10*time.Second, fmt.Sprintf("a point of %d rejected in the history", rejected), func() bool {
			resp, err := http.Get(srvURL + "/board/history")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var h board.History
			if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
				t.Fatal(err)
			}
			n := len(h.Points)
			return n > 0 && len(h.Points[n-1].Models) == 1 && h.Points[n-1].Models[0].Rejected != nil &&
				*h.Points[n-1].Models[0].Rejected == rejected
		})
	}
	sampled(0)
	// The peak: the counters rise, requests queue, both workers busy.
	for i := uint64(1); i <= 5; i++ {
		src.set(20*i, 10*i, 2*i, 3*i, 2)
		sampled(10 * i)
	}
	// Over: nothing rejected any more, the queue empty, the workers free.
	src.set(120, 50, 10, 0, 0)
	sampled(50)

	b := openBrowser(t, chrome, srvURL+"/")
	const strip = `document.querySelector('section[data-model="m1"] .strip')`
	b.poll("the strip holds samples from before the page opened", `(s => s !== null && Number(s.dataset.history) >= 7 &&
		Number(s.dataset.oldest) < Number(document.body.dataset.opened))(`+strip+`)`, 10*time.Second)
	// The rejections' line rises above 0 (y 100) left of the page's opening.
	b.poll("the peak's rejections drawn before the page opened", `(s => {
		const ox = Number(s.querySelector('.strip-opened').getAttribute('x1'));
		return s.querySelector('.strip-line.s-rej').getAttribute('points').split(' ')
			.map(p => p.split(',').map(Number)).some(([x, y]) => x < ox && y < 99);
	})(`+strip+`)`, 10*time.Second)
	b.poll("the peak's busy workers drawn", strip+`.querySelector('.strip-busy').getAttribute('d').length > 0`, 10*time.Second)
	yAxis := strings.Join(b.texts(`section[data-model="m1"] .strip-y > span`), " ")
	if !regexp.MustCompile(`^req/s [0-9.,]+ [0-9.,]+ 0 busy$`).MatchString(yAxis) {
		t.Errorf("y axis %q, want its unit, three ticks down to 0 and the busy band's label", yAxis)
	}
	if x := strings.Join(b.texts(`section[data-model="m1"] .strip-x > span`), " "); x != "−10 min −8 min −6 min −4 min −2 min now" {
		t.Errorf("x axis %q", x)
	}

	// Two workers in a 1280-pixel window: large tiles, figures written.
	b.poll("large tiles", `(t => t !== null && t.classList.contains('size-l') && t.firstElementChild.offsetWidth >= 240)(
		document.querySelector('section[data-model="m1"] .tiles'))`, 10*time.Second)
	// The bar's name ("KV") is the figure's ::before.
	if fig := b.text(`.tile[data-worker="2"] .fig`); fig != "40% · 400/1,000" {
		t.Errorf("worker 2's KV figure %q", fig)
	}
	if fig := b.text(`.tile[data-worker="1"] .fig`); fig != "40 blocks · total unknown" {
		t.Errorf("worker 1's KV figure %q", fig)
	}
	// The hatched bar: its own key in the legend, a tooltip on the bar.
	if key := b.text("#key-unknown"); !strings.Contains(key, "KV total unknown") {
		t.Errorf("legend key %q", key)
	}
	b.poll("the legend shows the hatched key", `document.getElementById('key-unknown').offsetWidth > 0`, 5*time.Second)
	b.poll("the hatched bar explains itself", `(c => c !== null && c.querySelector('.bar.unknown') !== null &&
		c.title.includes('total unknown'))(document.querySelector('.tile[data-worker="1"] .cell'))`, 5*time.Second)
	b.screenshot("board-history.png")
	b.checkErrors()
}
