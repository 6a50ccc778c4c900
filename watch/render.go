package watch

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/workermon/workermon/events"
)

// lineTime is the layout of a line's time: RFC 3339 with milliseconds.
const lineTime = "2006-01-02T15:04:05.000Z07:00"

// lineWriter writes the Lines rendering.
type lineWriter struct {
	w   io.Writer
	buf bytes.Buffer
}

// write writes one line per change, in one write.
func (l *lineWriter) write(changes []Change) error {
	l.buf.Reset()
	for _, c := range changes {
		l.buf.WriteString(FormatLine(c))
		l.buf.WriteByte('\n')
	}
	_, err := l.w.Write(l.buf.Bytes())
	return err
}

// FormatLine renders a change as one line:
//
//	2026-11-10T12:00:00.123Z model=Qwen/Qwen3-0.6B all_busy=false busy=[11] free=[12 13] stale=[] amber=[12] hard=[] reasons=[11:kv] thresholds=[kv>0.8 prefill>2048] saturation=0.74
//	2026-11-10T12:00:09.456Z model=Qwen/Qwen3-0.6B deleted
//
// A model name with a space, a quote, '=' or a character that is not
// printable is quoted. The saturation (contract §21) is the record's as of
// that change: a change of it alone is not a change of content.
//
// When the watch reads the monitor's loads (c.Loads), the line goes on
// with the leading values of every busy and free worker as of the last
// reading, Unknown ("–") where the monitor has none:
//
//	… saturation=0.74 queue_delay=[11:399ms 12:–] prefill_rate=[11:6013tok/s 12:–] preemption_rate=[11:0.00/s 12:–]
func FormatLine(c Change) string {
	var b strings.Builder
	b.WriteString(c.At.Format(lineTime))
	b.WriteString(" model=")
	b.WriteString(QuoteModel(c.Model))
	if c.Record == nil {
		b.WriteString(" deleted")
		return b.String()
	}
	r := &c.Record.BusySet
	b.WriteString(" all_busy=")
	b.WriteString(strconv.FormatBool(r.AllBusy))
	for _, l := range []struct {
		name string
		ids  []uint64
	}{{"busy", r.Busy}, {"free", r.Free}, {"stale", r.Stale}, {"amber", r.Amber}, {"hard", r.Hard}} {
		b.WriteString(" " + l.name + "=[")
		for i, id := range l.ids {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(strconv.FormatUint(id, 10))
		}
		b.WriteByte(']')
	}
	b.WriteString(" reasons=[")
	for i, id := range r.Busy {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strconv.FormatUint(id, 10) + ":" + reasonOf(r, id))
	}
	b.WriteString("] thresholds=[" + thresholdsText(r.Thresholds, " ") + "]")
	b.WriteString(" saturation=" + strconv.FormatFloat(r.Saturation, 'f', 2, 64))
	if c.Loads != nil {
		ids := slices.Sorted(slices.Values(slices.Concat(r.Busy, r.Free)))
		for _, col := range leadingColumns {
			b.WriteString(" " + col.name + "=[")
			for i, id := range ids {
				if i > 0 {
					b.WriteByte(' ')
				}
				b.WriteString(strconv.FormatUint(id, 10) + ":" + col.format(c.Loads.worker(c.Model, id)))
			}
			b.WriteByte(']')
		}
	}
	return b.String()
}

// leadingColumns are the leading values a worker is shown with: their
// names on a line, their heads on the screen, and how each is rendered.
var leadingColumns = []struct {
	name, head string
	format     func(Leading) string
}{
	{"queue_delay", "delay", func(l Leading) string { return FormatDelay(l.QueueDelayMs) }},
	{"prefill_rate", "prefill", func(l Leading) string { return FormatPrefillRate(l.PrefillRate) }},
	{"preemption_rate", "preempt", func(l Leading) string { return FormatPreemptionRate(l.PreemptionRate) }},
}

// QuoteModel renders a model name — or any other text of a record, a
// reason or a monitor id — for a terminal: as it is when every rune of it
// is printable and it holds no space, '"' or '=', else quoted with Go's
// escapes, so that text carrying terminal escapes, tabs or invalid UTF-8
// can neither paint the screen nor fake rows or columns.
func QuoteModel(m string) string {
	if strings.ContainsAny(m, " \"=") || strings.ContainsFunc(m, func(r rune) bool { return !unicode.IsPrint(r) || r == utf8.RuneError }) {
		return strconv.Quote(m)
	}
	return m
}

// reasonOf returns why a busy worker is busy, "?" when the record does not
// say.
func reasonOf(r *events.BusySet, id uint64) string {
	if s, ok := r.Reasons[strconv.FormatUint(id, 10)]; ok && s != "" {
		return QuoteModel(s) // from the bucket: a newline or ESC must not reach the terminal
	}
	return "?"
}

// thresholdsText renders the thresholds in force: kv>0.8 prefill>2048
// prefill>0.5×max committed>1.5×kv delay>500ms; "none" when none is set.
func thresholdsText(t events.Thresholds, sep string) string {
	var parts []string
	if t.ActiveDecodeBlocks != nil {
		parts = append(parts, "kv>"+strconv.FormatFloat(*t.ActiveDecodeBlocks, 'g', -1, 64))
	}
	if t.ActivePrefillTokens != nil {
		parts = append(parts, "prefill>"+strconv.FormatUint(*t.ActivePrefillTokens, 10))
	}
	if t.ActivePrefillTokensFrac != nil {
		parts = append(parts, "prefill>"+strconv.FormatFloat(*t.ActivePrefillTokensFrac, 'g', -1, 64)+"×max")
	}
	if t.KVCommitted != nil {
		parts = append(parts, "committed>"+strconv.FormatFloat(*t.KVCommitted, 'g', -1, 64)+"×kv")
	}
	if t.QueueDelayMs != nil {
		parts = append(parts, "delay>"+strconv.FormatUint(*t.QueueDelayMs, 10)+"ms")
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, sep)
}

// ANSI escapes of the screen.
const (
	escHome      = "\x1b[H"
	escClearEOL  = "\x1b[K"
	escClearDown = "\x1b[J"
	escAltOn     = "\x1b[?1049h\x1b[?25l" // alternate screen, cursor hidden
	escAltOff    = "\x1b[?25h\x1b[?1049l"
	escReset     = "\x1b[0m"
	escBold      = "\x1b[1m"
	escDim       = "\x1b[2m"
	escRed       = "\x1b[31m"
	escGreen     = "\x1b[32m"
	escYellow    = "\x1b[33m"
	escMagenta   = "\x1b[35m"
	escAlarm     = "\x1b[1;97;41m" // bold white on red
	escOK        = "\x1b[30;42m"   // black on green
	escHard      = "\x1b[1;4;31m"  // bold underlined red
)

// runScreen redraws the screen on every change (at most every Redraw) and
// every second (the ages), until ctx ends. loads is nil when the watch does
// not read the monitor's loads.
func runScreen(ctx context.Context, cfg Config, s *sink, loads *poller) error {
	if _, err := io.WriteString(cfg.Out, escAltOn); err != nil {
		return fmt.Errorf("watch: write: %w", err)
	}
	defer func() { _, _ = io.WriteString(cfg.Out, escAltOff) }()
	sc := &screen{cfg: cfg}
	tick := time.NewTicker(refresh)
	defer tick.Stop()
	var last time.Time
	for {
		var l *Loads
		if loads != nil {
			l = loads.cur.Load()
		}
		if err := sc.draw(s.records(), l, cfg.Now()); err != nil {
			return err
		}
		last = time.Now()
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		case <-s.changed:
			// Coalesce: wait out the rest of the redraw interval.
			if wait := cfg.Redraw - time.Since(last); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-ctx.Done():
					t.Stop()
					return nil
				case <-t.C:
				}
			}
		}
	}
}

// screen renders the Screen view.
type screen struct {
	cfg   Config
	buf   bytes.Buffer
	lines []string
}

// draw renders recs as of now and writes the whole screen in one write.
func (sc *screen) draw(recs []*Record, loads *Loads, now time.Time) error {
	cols, rows := DefaultWidth, DefaultHeight
	if sc.cfg.Size != nil {
		if c, r := sc.cfg.Size(); c > 0 && r > 0 {
			cols, rows = c, r
		}
	}
	lines := sc.render(recs, loads, now, cols)
	if len(lines) > rows {
		more := len(lines) - rows + 1
		lines = append(lines[:rows-1], sc.paint(escDim, fmt.Sprintf("… %d more lines: enlarge the terminal or pick one model with --model", more)))
	}
	sc.buf.Reset()
	sc.buf.WriteString(escHome)
	for _, l := range lines {
		sc.buf.WriteString(l)
		sc.buf.WriteString(escClearEOL + "\r\n")
	}
	sc.buf.WriteString(escClearDown)
	if _, err := sc.cfg.Out.Write(sc.buf.Bytes()); err != nil {
		return fmt.Errorf("watch: write: %w", err)
	}
	return nil
}

// paint wraps s in an ANSI colour when colours are on.
func (sc *screen) paint(esc, s string) string {
	if !sc.cfg.Color || esc == "" {
		return s
	}
	return esc + s + escReset
}

// Render returns the Screen view of recs at now, cols wide, without
// escapes other than colours (when cfg.Color). loads is the last reading
// of the monitor's loads, nil when the watch does not read them: then the
// workers are listed by state, else one line each with its leading values.
func Render(cfg Config, recs []*Record, loads *Loads, now time.Time, cols int) []string {
	sc := &screen{cfg: cfg}
	return sc.render(recs, loads, now, cols)
}

func (sc *screen) render(recs []*Record, loads *Loads, now time.Time, cols int) []string {
	sc.lines = sc.lines[:0]
	head := "workermon watch  " + now.Format("15:04:05") + "  " + events.BusyBucket
	if sc.cfg.Header != "" {
		head += "  " + sc.cfg.Header
	}
	head += "  (Ctrl-C quits)"
	sc.lines = append(sc.lines, sc.paint(escBold, clip(head, cols)))
	sc.status(loads, now, cols)
	switch {
	case recs == nil:
		sc.lines = append(sc.lines, "", "loading the bucket…")
		return sc.lines
	case len(recs) == 0 && sc.cfg.Model != "":
		sc.lines = append(sc.lines, "", "no record of model "+QuoteModel(sc.cfg.Model)+": no monitor lists it")
		return sc.lines
	case len(recs) == 0:
		sc.lines = append(sc.lines, "", "no record: no monitor lists a model")
		return sc.lines
	}
	for _, r := range recs {
		sc.model(r, loads, now, cols)
	}
	return sc.lines
}

// statusLines bounds the lines of the status of the loads' readings: an
// error of the HTTP client is long.
const statusLines = 3

// status renders, under the header, how the leading values are read: the
// hint that says how to get them when they are not, the monitor and the
// age of the last reading, or why the readings fail (since when).
func (sc *screen) status(loads *Loads, now time.Time, cols int) {
	var text, esc string
	switch {
	case loads == nil && sc.cfg.Hint == "":
		return
	case loads == nil:
		text, esc = sc.cfg.Hint, escDim
	case loads.Err != "":
		text, esc = "leading values from "+loads.From+": failing since "+loads.FailingSince.Format("15:04:05"), escYellow
		if loads.Workers != nil {
			text += " (showing those read " + now.Sub(loads.At).Round(100*time.Millisecond).String() + " ago)"
		} else {
			text += " (shown as " + Unknown + ")"
		}
		text += ": " + loads.Err
	case loads.At.IsZero():
		text, esc = "leading values: reading "+loads.From+"…", escDim
	default:
		text, esc = "leading values from "+loads.From+", read "+now.Sub(loads.At).Round(100*time.Millisecond).String()+" ago", escDim
	}
	for _, l := range wrap(text, cols, statusLines) {
		sc.lines = append(sc.lines, sc.paint(esc, l))
	}
}

// model renders one model: a header line, its thresholds and either one
// wrapped block per list or, with the monitor's loads, one line per worker.
func (sc *screen) model(r *Record, loads *Loads, now time.Time, cols int) {
	b := &r.BusySet
	age := now.Sub(r.Received)
	if u := time.Unix(0, b.UpdatedAt); b.UpdatedAt > 0 && now.Sub(u) > age {
		age = now.Sub(u)
	}
	var status string
	switch {
	case age > sc.cfg.StaleAfter:
		status = sc.paint(escDim, "STALE RECORD (routers admit)")
	case b.AllBusy:
		status = sc.paint(escAlarm, " ALL BUSY ")
	default:
		status = sc.paint(escOK, " admitting ")
	}
	sc.lines = append(sc.lines, "",
		sc.paint(escBold, QuoteModel(b.Model))+"  "+status+fmt.Sprintf("  busy %d  free %d  stale %d  amber %d  hard %d  saturation %.2f",
			len(b.Busy), len(b.Free), len(b.Stale), len(b.Amber), len(b.Hard), b.Saturation),
		"  thresholds "+thresholdsText(b.Thresholds, "  ")+
			sc.paint(escDim, fmt.Sprintf("   updated %s ago by %s, epoch %d", age.Round(100*time.Millisecond), QuoteModel(b.MonitorID), b.Epoch)))
	hard := map[uint64]bool{}
	for _, id := range b.Hard {
		hard[id] = true
	}
	amber := map[uint64]bool{}
	for _, id := range b.Amber {
		amber[id] = true
	}
	if loads != nil {
		sc.workers(b, loads, hard, amber, cols)
		return
	}
	sc.list("busy", b.Busy, cols, func(id uint64) (string, string) {
		reason := reasonOf(b, id)
		switch {
		case reason == events.ReasonCordoned:
			return strconv.FormatUint(id, 10) + ":cordoned", escMagenta
		case hard[id]:
			return strconv.FormatUint(id, 10) + ":" + reason + "!", escHard
		}
		return strconv.FormatUint(id, 10) + ":" + reason, escRed
	})
	sc.list("free", b.Free, cols, func(id uint64) (string, string) {
		if amber[id] {
			return strconv.FormatUint(id, 10) + "~", escYellow
		}
		return strconv.FormatUint(id, 10), escGreen
	})
	sc.list("stale", b.Stale, cols, func(id uint64) (string, string) { return strconv.FormatUint(id, 10), escDim })
}

// list renders ids after a label, wrapped at cols; each id as item makes
// it (its text and colour).
func (sc *screen) list(label string, ids []uint64, cols int, item func(uint64) (string, string)) {
	prefix := fmt.Sprintf("  %-6s ", label)
	indent := strings.Repeat(" ", len(prefix))
	if len(ids) == 0 {
		sc.lines = append(sc.lines, prefix+"—")
		return
	}
	var line strings.Builder
	line.WriteString(prefix)
	width := len(prefix)
	for _, id := range ids {
		text, esc := item(id)
		if width > len(prefix) && width+1+len(text) > cols {
			sc.lines = append(sc.lines, line.String())
			line.Reset()
			line.WriteString(indent)
			width = len(indent)
		}
		if width > len(prefix) {
			line.WriteByte(' ')
			width++
		}
		line.WriteString(sc.paint(esc, text))
		width += len(text)
	}
	sc.lines = append(sc.lines, line.String())
}

// maxStateWidth bounds the state column of the workers' table: a busy
// worker's reasons may be long (kv+prefill+kv_committed+queue_delay).
const maxStateWidth = 24

// workers renders one line per worker of b, busy ones first, then free,
// then stale: its id, its state and its leading values, in columns; each
// line cut at cols.
func (sc *screen) workers(b *events.BusySet, loads *Loads, hard, amber map[uint64]bool, cols int) {
	type row struct {
		cells []string
		esc   string // the state's colour
	}
	head := row{cells: []string{"worker", "state"}, esc: escDim}
	for _, c := range leadingColumns {
		head.cells = append(head.cells, c.head)
	}
	rows := []row{head}
	add := func(id uint64, state, esc string) {
		l := loads.worker(b.Model, id)
		cells := []string{strconv.FormatUint(id, 10), clip(state, maxStateWidth)}
		for _, c := range leadingColumns {
			cells = append(cells, c.format(l))
		}
		rows = append(rows, row{cells: cells, esc: esc})
	}
	for _, id := range b.Busy {
		reason := reasonOf(b, id)
		switch {
		case reason == events.ReasonCordoned:
			add(id, "cordoned", escMagenta)
		case hard[id]:
			add(id, "busy:"+reason+"!", escHard)
		default:
			add(id, "busy:"+reason, escRed)
		}
	}
	for _, id := range b.Free {
		if amber[id] {
			add(id, "free~", escYellow)
		} else {
			add(id, "free", escGreen)
		}
	}
	for _, id := range b.Stale {
		add(id, "stale", escDim)
	}
	if len(rows) == 1 {
		sc.lines = append(sc.lines, "  no worker")
		return
	}
	widths := make([]int, len(head.cells))
	for _, r := range rows {
		for i, c := range r.cells {
			widths[i] = max(widths[i], utf8.RuneCountInString(c))
		}
	}
	for i, r := range rows {
		// The head is dim whole; a worker's state only is coloured.
		var line strings.Builder
		room := cols
		for j, c := range r.cells {
			if room <= 0 {
				break
			}
			if j < len(r.cells)-1 {
				c += strings.Repeat(" ", widths[j]-utf8.RuneCountInString(c))
			}
			c = "  " + c
			if n := utf8.RuneCountInString(c); n > room {
				c = clip(c, room)
			}
			room -= utf8.RuneCountInString(c)
			if text, ok := strings.CutPrefix(c, "  "); ok && i > 0 && j == 1 {
				trimmed := strings.TrimRight(text, " ")
				c = "  " + sc.paint(r.esc, trimmed) + text[len(trimmed):]
			}
			line.WriteString(c)
		}
		l := strings.TrimRight(line.String(), " ")
		if i == 0 {
			l = sc.paint(escDim, l)
		}
		sc.lines = append(sc.lines, l)
	}
}

// wrap cuts s into lines of at most cols runes, at most n of them, after
// a space where there is one, the last line ending in "…" when s goes on.
func wrap(s string, cols, n int) []string {
	cols = max(cols, 1)
	var out []string
	r := []rune(s)
	for len(r) > 0 && len(out) < n {
		if len(r) <= cols {
			return append(out, string(r))
		}
		if len(out) == n-1 {
			return append(out, clip(string(r), cols))
		}
		cut := cols
		for i := cols; i > 0; i-- {
			if r[i] == ' ' {
				cut = i
				break
			}
		}
		out = append(out, strings.TrimRight(string(r[:cut]), " "))
		r = r[cut:]
		for len(r) > 0 && r[0] == ' ' {
			r = r[1:]
		}
	}
	return out
}

// clip cuts s to n runes.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:max(n-1, 0)]) + "…"
}
