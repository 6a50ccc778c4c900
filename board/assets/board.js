// workermon board: renders the snapshots of GET board/events. Plain
// JavaScript, no framework. Sections and tiles are kept between updates and
// touched only when what they show changed, so a model of hundreds of
// workers updates a few nodes, not the whole page.
'use strict';
(function () {
  const $ = (id) => document.getElementById(id);
  const modelsEl = $('models');
  const sections = new Map(); // model name -> section state
  const fmt = new Intl.NumberFormat('en-US');
  let lastChange = 0;
  let filter = '';
  let es = null;

  // text sets an element's text only when it differs.
  function text(el, s) {
    if (el.textContent !== s) el.textContent = s;
  }
  function attr(el, name, v) {
    if (el.getAttribute(name) !== v) el.setAttribute(name, v);
  }
  function cls(el, c) {
    if (el.className !== c) el.className = c;
  }
  function make(tag, className, parent) {
    const el = document.createElement(tag);
    if (className) el.className = className;
    if (parent) parent.appendChild(el);
    return el;
  }
  function pct(x) {
    return (x * 100).toFixed(x < 0.1 ? 1 : 0) + '%';
  }

  // ---- connection -------------------------------------------------------
  function setConn(state, label) {
    const el = $('conn');
    cls(el, 'conn conn-' + state);
    text(el, label);
  }
  // waiting says, until the first snapshot arrives, what the page waits
  // for; gotFirst removes it.
  function waiting(head, detail, down) {
    const el = $('waiting');
    if (!el) return;
    cls(el, down ? 'waiting down' : 'waiting');
    text($('waiting-head'), head);
    if (detail) text($('waiting-text'), detail);
  }
  function gotFirst() {
    const el = $('waiting');
    if (el) el.remove();
  }
  function connect() {
    es = new EventSource('board/events');
    es.addEventListener('snapshot', (e) => {
      lastChange = Date.now();
      render(JSON.parse(e.data));
      gotFirst();
      setConn('live', 'live');
    });
    es.onopen = () => {
      setConn('live', 'live');
      waiting('Connected; waiting for the first snapshot…');
    };
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED) {
        // Refused (too many viewers) or the server is gone: try again later.
        setConn('down', 'disconnected: retrying');
        waiting('Cannot reach the event stream (board/events): retrying every 5 s…',
          'The server refused the stream (too many viewers) or is not answering: check that the monitor (or router) is running and reachable from this browser.', true);
        es.close();
        setTimeout(connect, 5000);
      } else {
        setConn('wait', 'reconnecting…');
      }
    };
  }

  // ---- thresholds -------------------------------------------------------
  function thresholdsText(t) {
    const parts = [];
    if (t.active_decode_blocks_threshold != null) {
      parts.push('KV > ' + pct(t.active_decode_blocks_threshold) + ' of blocks');
    }
    if (t.active_prefill_tokens_threshold != null) {
      parts.push('prefill > ' + fmt.format(t.active_prefill_tokens_threshold) + ' tokens');
    }
    if (t.active_prefill_tokens_threshold_frac != null) {
      parts.push('prefill > ' + t.active_prefill_tokens_threshold_frac + ' × max batched tokens');
    }
    return parts.length ? parts.join(' · ') : 'none set: nothing is ever busy';
  }

  // ---- sections ---------------------------------------------------------
  function makeSection(name) {
    const el = make('section', 'model');
    el.dataset.model = name;
    const head = make('div', 'model-head', el);
    const h = make('h2', 'model-name', head);
    h.textContent = name;
    const sec = {
      el: el,
      badge: make('span', 'badge', head),
      counts: make('span', 'counts', head),
      queued: make('span', 'queued', head),
      turnedAway: make('span', 'turned-away', head),
      thresholds: make('div', 'thresholds', el),
      strip: makeStrip(el),
      tilesEl: make('div', 'tiles', el),
      tiles: new Map(), // worker id -> tile state
      countsKey: '',
    };
    sec.queued.hidden = true;
    sec.queued.title = 'requests for this model waiting in the router\'s queue now (--queue-max-wait), ' +
      'sent as workers free';
    sec.turnedAway.hidden = true;
    sec.turnedAway.title = 'requests for this model the router did not admit since it started, for any reason: ' +
      'every worker busy, sheddable requests shed, a stale list when failing closed';
    return sec;
  }

  function updateSection(sec, m, snap) {
    let c = 'model';
    if (m.all_busy) c += ' all-busy';
    if (m.list_stale) c += ' list-stale';
    if (m.workers.length === 0) c += ' no-workers';
    cls(sec.el, c);
    if (m.list_stale) {
      cls(sec.badge, m.rejecting ? 'badge all-busy' : 'badge stale');
      text(sec.badge, 'list stale · ' + (m.rejecting ? 'rejecting' : 'admitting'));
    } else if (m.all_busy) {
      cls(sec.badge, 'badge all-busy');
      text(sec.badge, m.rejecting ? 'ALL BUSY · rejecting' : 'ALL BUSY');
    } else {
      cls(sec.badge, 'badge ok');
      text(sec.badge, 'admitting');
    }
    sec.el.dataset.allBusy = m.all_busy ? 'true' : 'false';

    const n = m.counts;
    const key = [n.busy, n.free, n.stale, n.amber, n.hard, n.cordoned, n.unlisted || 0].join(',');
    if (key !== sec.countsKey) {
      sec.countsKey = key;
      sec.counts.replaceChildren();
      const add = (label, v, k) => {
        const s = make('span', 'c c-' + k, sec.counts);
        make('b', '', s).textContent = fmt.format(v);
        s.appendChild(document.createTextNode(' ' + label));
      };
      add('busy', n.busy, 'busy');
      add('free', n.free, 'free');
      add('stale', n.stale, 'stale');
      if (n.amber) add('amber', n.amber, 'amber');
      if (n.hard) add('hard', n.hard, 'hard');
      if (n.cordoned) add('cordoned', n.cordoned, 'cordoned');
      if (n.unlisted) add('unlisted', n.unlisted, 'unlisted');
    }
    // The router's queue (contract §17): shown once the source has one.
    if (m.queued != null) {
      sec.queued.hidden = false;
      const q = fmt.format(m.queued);
      if (sec.queued.dataset.v !== q) {
        sec.queued.dataset.v = q;
        sec.queued.classList.toggle('waiting', m.queued > 0);
        sec.queued.replaceChildren(document.createTextNode('queued '), make('b'));
        sec.queued.children[0].textContent = q;
      }
    } else {
      sec.queued.hidden = true;
    }
    // Every refusal for the model, whatever the reason: the header splits
    // the router's refusals into all busy and shed.
    if (m.rejected != null) {
      sec.turnedAway.hidden = false;
      const s = fmt.format(m.rejected);
      if (sec.turnedAway.dataset.v !== s) {
        sec.turnedAway.dataset.v = s;
        sec.turnedAway.replaceChildren(document.createTextNode('turned away '), make('b'),
          document.createTextNode(' (all reasons)'));
        sec.turnedAway.children[0].textContent = s;
      }
    } else {
      sec.turnedAway.hidden = true;
    }
    let th = 'thresholds: ' + thresholdsText(m.thresholds);
    if (m.updated_at) th += ' · record written ' + new Date(m.updated_at).toLocaleTimeString();
    if (m.slo) th += ' · ' + m.slo;
    text(sec.thresholds, th);
    sample(sec, m, snap);
    drawStrip(sec);
    updateTiles(sec, m, snap);
  }

  // ---- strip: the model's last minutes ----------------------------------
  // Each snapshot adds a sample per model; the strip draws the last
  // stripSpan of them: requests admitted, rejected and shed per second (from
  // the differences of the counters), requests queued, and busy workers.
  // Admitted and shed are the router's counts, which are not by model: the
  // strip shows them when the board shows one model only.
  const stripSpan = 5 * 60 * 1000;
  const stripW = 600, stripH = 48, busyH = 12;
  const SVG = 'http://www.w3.org/2000/svg';
  const series = [
    { key: 'adm', label: 'admitted', unit: '/s', cls: 's-adm' },
    { key: 'rej', label: 'rejected', unit: '/s', cls: 's-rej' },
    { key: 'shed', label: 'shed', unit: '/s', cls: 's-shed' },
    { key: 'q', label: 'queued', unit: '', cls: 's-q' },
  ];
  function svg(tag, className, parent) {
    const el = document.createElementNS(SVG, tag);
    if (className) el.setAttribute('class', className);
    if (parent) parent.appendChild(el);
    return el;
  }
  function makeStrip(parent) {
    const wrap = make('div', 'strip', parent);
    const chart = svg('svg', 'strip-chart', wrap);
    chart.setAttribute('viewBox', '0 0 ' + stripW + ' ' + (stripH + busyH + 2));
    chart.setAttribute('preserveAspectRatio', 'none');
    chart.setAttribute('role', 'img');
    const st = { wrap: wrap, chart: chart, lines: {}, samples: [], legend: make('div', 'strip-legend', wrap) };
    st.busy = svg('path', 'strip-busy', chart);
    for (const se of series) st.lines[se.key] = svg('polyline', 'strip-line ' + se.cls, chart);
    return st;
  }
  function sample(sec, m, snap) {
    const one = snap.models.length === 1 && snap.admissions;
    const a = snap.admissions || {};
    const ss = sec.strip.samples;
    ss.push({
      t: Date.now(),
      adm: one ? (a.admitted || 0) + (a.stale_open || 0) + (a.unknown_model || 0) : null,
      shed: one ? (a.shed || 0) : null,
      rej: m.rejected != null ? m.rejected : null,
      q: m.queued != null ? m.queued : null,
      busy: m.counts.busy,
      workers: m.workers.length,
    });
    const cut = Date.now() - stripSpan - 60000;
    while (ss.length > 2 && ss[1].t < cut) ss.shift();
  }
  // steps returns the series of one key as steps [t0, t1, value]: a level
  // (queued) holds from its sample to the next, and to now after the last;
  // a counter's rate over each interval between samples, then 0 to now (a
  // changed counter changes the snapshot, so no snapshot means no change).
  function steps(ss, key, now) {
    const out = [];
    for (let i = 0; i < ss.length; i++) {
      const t1 = i + 1 < ss.length ? ss[i + 1].t : now;
      if (key === 'q') {
        if (ss[i].q != null) out.push([ss[i].t, t1, ss[i].q]);
        continue;
      }
      if (i + 1 === ss.length) {
        if (ss[i][key] != null) out.push([ss[i].t, now, 0]);
        continue;
      }
      const a = ss[i][key], b = ss[i + 1][key], dt = (ss[i + 1].t - ss[i].t) / 1000;
      if (a != null && b != null && dt > 0) out.push([ss[i].t, t1, Math.max(0, b - a) / dt]);
    }
    return out;
  }
  // recent is the legend's value: the level now, or a counter's rate over
  // the last 5 s (over what there is when the samples are younger).
  function recent(ss, key, now) {
    const last = ss[ss.length - 1];
    if (!last || last[key] == null) return null;
    if (key === 'q') return last.q;
    let ref = ss[0];
    for (const s of ss) if (s.t <= now - 5000) ref = s;
    const dt = (now - ref.t) / 1000;
    return ref[key] == null || dt <= 0 ? 0 : Math.max(0, last[key] - ref[key]) / Math.max(dt, 1);
  }
  function drawStrip(sec) {
    const st = sec.strip, ss = st.samples;
    const now = Date.now();
    const x = (t) => Math.max(0, stripW * (t - (now - stripSpan)) / stripSpan).toFixed(1);
    const all = {};
    let top = 1;
    for (const se of series) {
      all[se.key] = steps(ss, se.key, now);
      for (const p of all[se.key]) if (p[2] > top) top = p[2];
    }
    const y = (v) => (stripH - (stripH - 2) * v / top).toFixed(1);
    const legend = [];
    for (const se of series) {
      const pts = [];
      for (const p of all[se.key]) pts.push(x(p[0]) + ',' + y(p[2]), x(p[1]) + ',' + y(p[2]));
      attr(st.lines[se.key], 'points', pts.join(' '));
      const v = recent(ss, se.key, now);
      st.lines[se.key].dataset.last = v == null ? '' : String(v);
      if (v != null) legend.push({ se: se, v: se.unit ? v.toFixed(1) + se.unit : fmt.format(v) });
    }
    // Busy workers: a band under the lines, its height the busy share.
    let d = '';
    for (let i = 0; i < ss.length; i++) {
      const s = ss[i], t1 = i + 1 < ss.length ? ss[i + 1].t : now;
      const h = s.workers ? busyH * s.busy / s.workers : 0;
      if (h > 0) d += 'M' + x(s.t) + ',' + (stripH + 2 + busyH) + 'V' + (stripH + 2 + busyH - h).toFixed(1) + 'H' + x(t1) + 'V' + (stripH + 2 + busyH) + 'Z';
    }
    attr(st.busy, 'd', d);
    const lastS = ss[ss.length - 1];
    const key = legend.map((l) => l.se.key + l.v).join('|') + '|' + (lastS ? lastS.busy + '/' + lastS.workers : '');
    if (st.legend.dataset.key !== key) {
      st.legend.dataset.key = key;
      st.legend.replaceChildren();
      for (const l of legend) {
        const s = make('span', 'k ' + l.se.cls, st.legend);
        make('i', '', s);
        s.appendChild(document.createTextNode(l.se.label + ' '));
        make('b', '', s).textContent = l.v;
      }
      if (lastS) {
        const s = make('span', 'k s-busyw', st.legend);
        make('i', '', s);
        s.appendChild(document.createTextNode('busy workers '));
        make('b', '', s).textContent = lastS.busy + '/' + lastS.workers;
      }
      make('span', 'k span', st.legend).textContent = 'last 5 min';
    }
  }

  // ---- tiles ------------------------------------------------------------
  const reasonShort = { kv: 'kv', prefill: 'pf', 'kv+prefill': 'kv+pf', cordoned: 'cord' };

  function tileTitle(w, m, snap) {
    const lines = ['worker ' + w.id + ': ' + w.state + (w.level ? ' (' + w.level + ')' : '') +
      (w.reason ? ', reason ' + w.reason : '')];
    if (w.endpoint) lines.push(w.endpoint);
    const est = snap.estimates ? ' (this router\u2019s estimate)' : '';
    for (const r of w.ranks || []) {
      let kv = 'KV ' + fmt.format(r.kv_used);
      if (r.kv_total) kv += ' / ' + fmt.format(r.kv_total) + ' blocks (' + pct(r.kv_used / r.kv_total) + ')';
      else kv += ' blocks (total unknown)';
      if (r.kv_threshold != null) kv += ', threshold ' + pct(r.kv_threshold);
      let pf = 'prefill ' + fmt.format(r.prefill) + ' tokens';
      if (r.prefill_limit != null) pf += ', limit ' + fmt.format(r.prefill_limit);
      let line = 'rank ' + r.rank + est + ': ' + kv + '; ' + pf;
      if (r.busy) line += '; busy (' + r.reason + ')';
      if (r.stale) line += '; stale';
      lines.push(line);
    }
    return lines.join('\n');
  }

  function makeTile(id) {
    const el = make('div', 'tile');
    el.dataset.worker = id;
    const head = make('div', 'tile-head', el);
    const t = { el: el, wid: make('span', 'wid', head), why: make('span', 'why', head), ranks: make('div', 'ranks', el), rows: [], key: '' };
    t.wid.textContent = id;
    return t;
  }

  // setBar shows value v of a scale of full, with a tick at mark (both may
  // be null: unknown scale, no threshold).
  function setBar(bar, v, full, mark, over) {
    let c = bar.kind;
    let w = 0;
    if (full > 0) {
      w = Math.min(v / full, 1);
    } else if (full === null) {
      c += ' unknown';
    }
    if (mark != null && full > 0) {
      c += ' has-mark';
      bar.mark.style.left = (Math.min(mark / full, 1) * 100).toFixed(1) + '%';
    }
    if (over) c += ' over';
    cls(bar.el, c);
    bar.fill.style.width = (w * 100).toFixed(1) + '%';
  }

  function makeBar(parent, kind) {
    const el = make('span', kind, parent);
    return { el: el, kind: kind, fill: make('i', 'fill', el), mark: make('b', 'mark', el) };
  }

  function updateTile(t, w, m, snap, prefillScale) {
    let c = 'tile s-' + w.state;
    if (w.level) c += ' l-' + w.level;
    cls(t.el, c);
    t.el.dataset.state = w.state;
    t.el.dataset.level = w.level || '';
    text(t.why, w.reason ? (reasonShort[w.reason] || w.reason) : (w.level === 'amber' ? 'amber' : (w.state === 'stale' ? 'stale' : '')));
    attr(t.el, 'title', tileTitle(w, m, snap));
    const ranks = w.ranks || [];
    while (t.rows.length < ranks.length) {
      const row = make('div', 'rank', t.ranks);
      t.rows.push({ el: row, kv: makeBar(row, 'bar kv'), pf: makeBar(row, 'bar pf') });
    }
    while (t.rows.length > ranks.length) t.rows.pop().el.remove();
    ranks.forEach((r, i) => {
      const row = t.rows[i];
      cls(row.el, r.stale ? 'rank stale' : 'rank');
      const kvOver = r.kv_total > 0 && r.kv_threshold != null && r.kv_used > r.kv_threshold * r.kv_total;
      setBar(row.kv, r.kv_used, r.kv_total > 0 ? r.kv_total : null,
        r.kv_threshold != null && r.kv_total > 0 ? r.kv_threshold * r.kv_total : null, kvOver);
      // Prefill: the limit sits at 80% of the bar; without a limit the bar
      // is relative to the model's largest prefill.
      const lim = r.prefill_limit;
      if (lim != null) {
        setBar(row.pf, r.prefill, Math.max(lim * 1.25, 1), lim, r.prefill > lim);
      } else {
        setBar(row.pf, r.prefill, prefillScale, null, false);
      }
    });
  }

  function updateTiles(sec, m, snap) {
    let prefillMax = 0;
    for (const w of m.workers) for (const r of w.ranks || []) if (r.prefill_limit == null) prefillMax = Math.max(prefillMax, r.prefill);
    const prefillScale = prefillMax > 0 ? prefillMax : 1;
    const seen = new Set();
    let prev = null;
    for (const w of m.workers) {
      let t = sec.tiles.get(w.id);
      if (!t) {
        t = makeTile(w.id);
        sec.tiles.set(w.id, t);
      }
      const want = prev ? prev.el.nextSibling : sec.tilesEl.firstChild;
      if (want !== t.el) sec.tilesEl.insertBefore(t.el, want);
      const key = JSON.stringify(w) + '|' + prefillScale + '|' + (snap.estimates ? 1 : 0);
      if (key !== t.key) {
        t.key = key;
        updateTile(t, w, m, snap, prefillScale);
      }
      seen.add(w.id);
      prev = t;
    }
    for (const [id, t] of sec.tiles) {
      if (!seen.has(id)) {
        t.el.remove();
        sec.tiles.delete(id);
      }
    }
  }

  // ---- page -------------------------------------------------------------
  function summary(snap) {
    const el = $('summary');
    el.replaceChildren();
    let workers = 0, busy = 0, free = 0, stale = 0, allBusy = 0;
    for (const m of snap.models) {
      workers += m.workers.length;
      busy += m.counts.busy;
      free += m.counts.free;
      stale += m.counts.stale;
      if (m.all_busy) allBusy++;
    }
    const item = (v, label, key, title) => {
      const s = make('span', key ? 'a-' + key : '', el);
      make('b', '', s).textContent = fmt.format(v);
      s.appendChild(document.createTextNode(' ' + label));
      if (title) s.title = title;
    };
    item(snap.models.length, snap.models.length === 1 ? 'model' : 'models');
    item(workers, 'workers');
    item(busy, 'busy');
    item(free, 'free');
    item(stale, 'stale');
    if (allBusy) {
      const alarm = make('button', 'alarm', el);
      alarm.type = 'button';
      alarm.title = 'show the first model whose workers are all busy';
      alarm.textContent = allBusy + (allBusy === 1 ? ' model ALL BUSY' : ' models ALL BUSY');
      alarm.addEventListener('click', () => {
        const first = modelsEl.querySelector('section.all-busy:not([hidden])');
        if (first) first.scrollIntoView({ behavior: 'smooth', block: 'start' });
      });
    }
    const a = snap.admissions;
    // The router's decisions since it started, by outcome: refused because
    // every worker was busy (its --reject-status, 503) apart from the
    // sheddable requests shed (its --shed-status, 429). A model's card
    // counts both, and any other refusal, as "turned away".
    if (a) {
      item(a.admitted || 0, 'admitted', 'admitted', 'requests the router let through');
      item(a.rejected || 0, 'refused: all busy', 'all-busy',
        'requests refused because every worker of their model was busy (the router\u2019s reject status, 503 by default)');
      if (a.shed) {
        item(a.shed, 'shed: low priority', 'shed',
          'sheddable requests (priority below 0) refused because every free worker was near its thresholds (the shed status, 429 by default)');
      }
    }
  }

  function applyFilter() {
    for (const [name, sec] of sections) {
      sec.el.hidden = filter !== '' && !name.toLowerCase().includes(filter);
    }
  }

  function render(snap) {
    text($('kind'), snap.kind === 'router' ? 'router board' : 'monitor board');
    text($('name'), snap.name || '');
    document.title = 'workermon ' + (snap.kind || '') + ' board' + (snap.name ? ' — ' + snap.name : '');
    const note = $('note');
    note.hidden = !snap.note;
    text(note, snap.note || '');
    if (snap.estimates) {
      note.hidden = false;
      text(note, (snap.note ? snap.note + ' ' : '') +
        'Bars show this router\u2019s own estimate of each rank\u2019s load (its requests in flight); the monitor\u2019s board shows the engines\u2019 reports.');
    }
    const err = $('error');
    err.hidden = !snap.error;
    text(err, snap.error ? 'cannot read the board\u2019s source: ' + snap.error : '');
    summary(snap);

    const seen = new Set();
    let prev = null;
    for (const m of snap.models) {
      let sec = sections.get(m.name);
      if (!sec) {
        sec = makeSection(m.name);
        sections.set(m.name, sec);
        sec.el.hidden = filter !== '' && !m.name.toLowerCase().includes(filter);
      }
      const want = prev ? prev.el.nextSibling : modelsEl.firstChild;
      if (want !== sec.el) modelsEl.insertBefore(sec.el, want);
      updateSection(sec, m, snap);
      seen.add(m.name);
      prev = sec;
    }
    for (const [name, sec] of sections) {
      if (!seen.has(name)) {
        sec.el.remove();
        sections.delete(name);
      }
    }
    $('empty').hidden = snap.models.length > 0 || !!snap.error;
  }

  function tick() {
    for (const sec of sections.values()) if (!sec.el.hidden) drawStrip(sec);
    if (!lastChange) return;
    const ago = Math.max(0, Math.round((Date.now() - lastChange) / 1000));
    text($('updated'), 'last change ' + new Date(lastChange).toLocaleTimeString() + (ago >= 2 ? ' (' + ago + ' s ago)' : ''));
  }

  $('filter').addEventListener('input', (e) => {
    filter = e.target.value.trim().toLowerCase();
    applyFilter();
  });
  setInterval(tick, 1000);
  connect();
})();
