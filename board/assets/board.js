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
  const compact = new Intl.NumberFormat('en-US', { notation: 'compact', maximumFractionDigits: 1 });
  // dur writes milliseconds as "640 ms" or, from 10 s, "12.3 s".
  function dur(ms) {
    return ms < 10000 ? fmt.format(Math.round(ms)) + ' ms' : (ms / 1000).toFixed(1) + ' s';
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
    if (t.kv_committed_threshold != null) {
      parts.push('committed KV > ' + t.kv_committed_threshold + ' × blocks');
    }
    if (t.queue_delay_threshold_ms != null) {
      parts.push('queue delay > ' + dur(t.queue_delay_threshold_ms));
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
      saturation: make('span', 'saturation', head),
      queued: make('span', 'queued', head),
      turnedAway: make('span', 'turned-away', head),
      thresholds: make('div', 'thresholds', el),
      strip: makeStrip(el),
      tilesEl: make('div', 'tiles', el),
      tiles: new Map(), // worker id -> tile state
      countsKey: '',
    };
    sec.saturation.hidden = true;
    sec.saturation.title = 'the model\u2019s saturation: for each fresh, uncordoned worker its load \u00f7 the limit ' +
      'of the thresholds in force, averaged; 1.00 is the busy line (a worker above 1 is busy), 0 with no threshold set. ' +
      'Autoscale on it (workermon_model_saturation) with a target under 1';
    sec.queued.hidden = true;
    sec.queued.title = 'requests for this model waiting in the router\'s queue now (--queue-max-wait), ' +
      'sent as workers free; beside them, those the other routers hold queued (the record\'s queued_by)';
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
    // The saturation (contract §21): the record's, once there is one.
    if (m.saturation != null) {
      sec.saturation.hidden = false;
      const v = m.saturation.toFixed(2);
      if (sec.saturation.dataset.v !== v) {
        sec.saturation.dataset.v = v;
        sec.saturation.classList.toggle('high', m.saturation >= 1);
        sec.saturation.replaceChildren(document.createTextNode('saturation '), make('b'));
        sec.saturation.children[0].textContent = v;
      }
    } else {
      sec.saturation.hidden = true;
    }
    // The router's queue (contract §17): shown once the source has one.
    if (m.queued != null) {
      sec.queued.hidden = false;
      const q = fmt.format(m.queued);
      // Beside it, the other routers' queues (contract §22).
      const o = m.queued_others != null ? fmt.format(m.queued_others) : '';
      if (sec.queued.dataset.v !== q + '/' + o) {
        sec.queued.dataset.v = q + '/' + o;
        sec.queued.classList.toggle('waiting', m.queued > 0 || m.queued_others > 0);
        sec.queued.replaceChildren(document.createTextNode('queued '), make('b'));
        sec.queued.children[0].textContent = q;
        if (o !== '') {
          sec.queued.appendChild(document.createTextNode(' · other routers '));
          make('b', '', sec.queued).textContent = o;
        }
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
  // The strip draws a model's last stripSpan from samples: requests
  // admitted, rejected and shed per second (from the differences of the
  // counters), requests queued, and busy workers. The samples before the
  // page opened come from the server's history (GET board/history, read once
  // at open); each snapshot of the stream then adds one. Admitted and shed
  // are the router's counts, which are not by model: the strip shows them
  // when the board shows one model only.
  const stripSpan = 10 * 60 * 1000;
  // The chart's coordinates: stripW wide (stretched to the card), lines
  // in [0, linesH], the busy band in [linesH + bandGap, stripH]; CSS draws
  // it stripH pixels high, so that the axis's labels sit at the same y.
  const stripW = 1000, linesH = 100, bandGap = 6, busyH = 22, stripH = linesH + bandGap + busyH;
  const xTickEvery = 2 * 60 * 1000;
  const SVG = 'http://www.w3.org/2000/svg';
  const series = [
    { key: 'adm', label: 'admitted', unit: '/s', cls: 's-adm' },
    { key: 'rej', label: 'rejected', unit: '/s', cls: 's-rej' },
    { key: 'shed', label: 'shed', unit: '/s', cls: 's-shed' },
    { key: 'q', label: 'queued', unit: '', cls: 's-q' },
  ];
  const pageOpened = Date.now();
  document.body.dataset.opened = String(pageOpened);
  // history holds the server's samples of the models that have no section
  // yet, by model; null until board/history answered.
  let history = null;

  function svg(tag, className, parent) {
    const el = document.createElementNS(SVG, tag);
    if (className) el.setAttribute('class', className);
    if (parent) parent.appendChild(el);
    return el;
  }
  function makeStrip(parent) {
    const wrap = make('div', 'strip', parent);
    const plot = make('div', 'strip-plot', wrap);
    const yAxis = make('div', 'strip-y', plot);
    yAxis.setAttribute('aria-hidden', 'true');
    const chart = svg('svg', 'strip-chart', plot);
    chart.setAttribute('viewBox', '0 0 ' + stripW + ' ' + stripH);
    chart.setAttribute('preserveAspectRatio', 'none');
    chart.setAttribute('role', 'img');
    make('div', '', plot);
    const xAxis = make('div', 'strip-x', plot);
    xAxis.setAttribute('aria-hidden', 'true');
    const st = {
      wrap: wrap, chart: chart, yAxis: yAxis, xAxis: xAxis, lines: {}, samples: [], top: 0,
      grid: svg('g', 'strip-grid', chart), band: svg('rect', 'strip-band', chart),
    };
    st.band.setAttribute('x', '0');
    st.band.setAttribute('y', String(linesH + bandGap));
    st.band.setAttribute('width', String(stripW));
    st.band.setAttribute('height', String(busyH));
    st.busy = svg('path', 'strip-busy', chart);
    st.opened = svg('line', 'strip-opened', chart);
    for (const se of series) st.lines[se.key] = svg('polyline', 'strip-line ' + se.cls, chart);
    // The y axis: the unit, the scale's ticks (set by drawStrip) and the
    // band's label.
    make('span', 'strip-unit', yAxis).textContent = 'req/s';
    st.yTicks = [0, 1, 2].map(() => make('span', 'tick', yAxis));
    const band = make('span', 'tick band', yAxis);
    band.textContent = 'busy';
    band.style.top = (linesH + bandGap + busyH / 2) + 'px';
    for (let t = stripSpan; t >= 0; t -= xTickEvery) {
      const s = make('span', 'tick', xAxis);
      s.textContent = t === 0 ? 'now' : '\u2212' + t / 60000 + ' min';
      s.style.left = (100 * (1 - t / stripSpan)) + '%';
    }
    st.legend = make('div', 'strip-legend', wrap);
    return st;
  }
  // sampleOf is one sample of a model: when, the admitted and shed
  // counters (null but for a board of one model), the model's rejected
  // counter and queue (null when unknown), its busy and total workers.
  function sampleOf(t, adm, shed, rej, q, busy, workers) {
    return { t: t, adm: adm, shed: shed, rej: rej, q: q, busy: busy, workers: workers };
  }
  // admittedOf sums the outcomes that let a request through, as the
  // server's history does.
  function admittedOf(a) {
    return (a.admitted || 0) + (a.stale_open || 0) + (a.unknown_model || 0);
  }
  function sample(sec, m, snap) {
    const one = snap.models.length === 1 && snap.admissions;
    const a = snap.admissions || {};
    const ss = sec.strip.samples;
    ss.push(sampleOf(Date.now(), one ? admittedOf(a) : null, one ? (a.shed || 0) : null,
      m.rejected != null ? m.rejected : null, m.queued != null ? m.queued : null, m.counts.busy, m.workers.length));
    const cut = Date.now() - stripSpan - 60000;
    while (ss.length > 2 && ss[1].t < cut) ss.shift();
  }
  // loadHistory asks the server for the last minutes, once: the strips
  // then start before the page opened.
  function loadHistory() {
    fetch('board/history', { cache: 'no-store' })
      .then((r) => (r.ok ? r.json() : null))
      .then((h) => {
        history = new Map();
        if (!h || !Array.isArray(h.points)) return;
        // The server's clock, against ours: its points are placed on ours.
        const skew = h.now - Date.now();
        for (const p of h.points) {
          const one = p.models.length === 1 && p.admitted != null;
          for (const m of p.models) {
            if (!history.has(m.name)) history.set(m.name, []);
            history.get(m.name).push(sampleOf(p.t - skew, one ? p.admitted : null, one ? p.shed : null,
              m.rejected != null ? m.rejected : null, m.queued != null ? m.queued : null, m.busy, m.workers));
          }
        }
        for (const [name, sec] of sections) {
          seedHistory(sec, name);
          drawStrip(sec);
        }
      })
      .catch(() => { history = new Map(); });
  }
  // seedHistory puts the server's samples of a model before the ones the
  // stream brought.
  function seedHistory(sec, name) {
    if (!history || !history.has(name)) return;
    const st = sec.strip;
    const first = st.samples.length ? st.samples[0].t : Infinity;
    const older = history.get(name).filter((s) => s.t < first);
    history.delete(name);
    st.samples = older.concat(st.samples);
    st.wrap.dataset.history = String(older.length);
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
  // niceTop is the y axis's top: the smallest of 1, 2, 2.5, 5 × 10^k at
  // least v (and at least 1).
  function niceTop(v) {
    if (!(v > 1)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  function tickText(v) {
    return v >= 10 || Number.isInteger(v) ? fmt.format(v) : String(+v.toFixed(2));
  }
  function drawStrip(sec) {
    const st = sec.strip, ss = st.samples;
    const now = Date.now(), from = now - stripSpan;
    const x = (t) => Math.max(0, stripW * (t - from) / stripSpan).toFixed(1);
    const all = {};
    let max = 0;
    for (const se of series) {
      all[se.key] = steps(ss, se.key, now);
      for (const p of all[se.key]) if (p[1] > from && p[2] > max) max = p[2];
    }
    const top = niceTop(max);
    const y = (v) => (linesH - (linesH - 2) * v / top).toFixed(1);
    if (top !== st.top) {
      st.top = top;
      st.grid.replaceChildren();
      [top, top / 2, 0].forEach((v, i) => {
        const l = svg('line', '', st.grid);
        l.setAttribute('x1', '0');
        l.setAttribute('x2', String(stripW));
        l.setAttribute('y1', y(v));
        l.setAttribute('y2', y(v));
        st.yTicks[i].textContent = tickText(v);
        st.yTicks[i].style.top = y(v) + 'px';
      });
      st.wrap.dataset.top = String(top);
    }
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
    const base = linesH + bandGap + busyH;
    let d = '';
    for (let i = 0; i < ss.length; i++) {
      const s = ss[i], t1 = i + 1 < ss.length ? ss[i + 1].t : now;
      const h = s.workers ? busyH * s.busy / s.workers : 0;
      if (h > 0 && t1 > from) d += 'M' + x(s.t) + ',' + base + 'V' + (base - h).toFixed(1) + 'H' + x(t1) + 'V' + base + 'Z';
    }
    attr(st.busy, 'd', d);
    // When this page opened: what is left of it came from the server.
    const ox = x(pageOpened);
    for (const [k, v] of [['x1', ox], ['x2', ox], ['y1', '0'], ['y2', String(stripH)]]) attr(st.opened, k, v);
    st.wrap.dataset.oldest = ss.length ? String(ss[0].t) : '';
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
      const span = make('span', 'k span', st.legend);
      span.textContent = 'last 10 min; queued in requests, on the same scale; dotted: this page opened';
    }
  }

  // ---- tiles ------------------------------------------------------------
  // reasonShort shortens each check of a reason for the tile's corner.
  const reasonParts = { kv: 'kv', prefill: 'pf', kv_committed: 'kvc', queue_delay: 'delay', cordoned: 'cord' };
  function reasonShort(reason) {
    return reason.split('+').map((p) => reasonParts[p] || p).join('+');
  }
  const unknownDelay = 'queue delay unknown (hatched): the monitor has not measured this rank\u2019s prefill rate yet ' +
    '(its engine does not report prefilled_tokens, has not prefilled since it started, or restarted)';
  const unknownKV = 'KV total unknown (hatched): this router counts the KV blocks of the requests it has in flight, ' +
    'but not the size of the rank\u2019s cache, so it cannot draw a share; the monitor\u2019s board has the engines\u2019 totals.';

  // rankBars are the bars of a rank's row, left to right. Each names its
  // class (the bar's colour in board.css) and label and, from the rank and
  // the model's scales (the largest prefill and queue delay of its ranks
  // without a limit), gives the bar: its value v out of full (null:
  // unknown, hatched), the threshold's tick at mark (null: none), whether it
  // is past it, the figure large tiles write over it and a tooltip. An
  // entry with shown(m, snap) appears only in the models where that is
  // true. To show another per-rank value, add an entry here.
  const rankBars = [
    {
      cls: 'kv', label: 'KV',
      of(r) {
        const known = r.kv_total > 0;
        const mark = known && r.kv_threshold != null ? r.kv_threshold * r.kv_total : null;
        return {
          v: r.kv_used, full: known ? r.kv_total : null, mark: mark, over: mark != null && r.kv_used > mark,
          figure: known ? pct(r.kv_used / r.kv_total) + ' \u00b7 ' + fmt.format(r.kv_used) + '/' + fmt.format(r.kv_total)
            : fmt.format(r.kv_used) + ' blocks \u00b7 total unknown',
          title: known ? 'KV blocks in use' : unknownKV,
        };
      },
    },
    {
      cls: 'pf', label: 'PF',
      of(r, scale) {
        // The limit sits at 80% of the bar; without a limit the bar is
        // relative to the model's largest prefill.
        const lim = r.prefill_limit;
        if (lim != null) {
          return { v: r.prefill, full: Math.max(lim * 1.25, 1), mark: lim, over: r.prefill > lim,
            figure: fmt.format(r.prefill) + '/' + fmt.format(lim) + ' tok', title: 'tokens being prefilled, against the limit' };
        }
        return { v: r.prefill, full: scale.prefill, mark: null, over: false,
          figure: fmt.format(r.prefill) + ' tok', title: 'tokens being prefilled' };
      },
    },
    {
      // The predicted queue delay (contract §21): the prefill tokens ÷ the
      // rank's measured prefill rate, the time to first token a request
      // sent now would wait. Shown on the monitor's board for the models
      // with a queue-delay threshold or a measured rate.
      cls: 'qd', label: 'QD',
      shown(m, snap) {
        return snap.kind !== 'router' && (m.thresholds.queue_delay_threshold_ms != null ||
          m.workers.some((w) => (w.ranks || []).some((r) => r.prefill_rate != null)));
      },
      of(r, scale) {
        // The figure: the delay · the prefill rate in tokens per second.
        const rate = r.prefill_rate != null ? ' \u00b7 ' + compact.format(r.prefill_rate) + '/s' : '';
        if (r.queue_delay_ms == null) {
          return { v: 0, full: null, mark: null, over: false, figure: 'rate unknown', title: unknownDelay };
        }
        const lim = r.delay_limit;
        const title = 'predicted queue delay: ' + fmt.format(r.prefill) + ' prefill tokens at ' +
          fmt.format(r.prefill_rate) + ' tokens/s' + (lim != null ? ', against the threshold ' + dur(lim) : '');
        if (lim != null) {
          return { v: r.queue_delay_ms, full: Math.max(lim * 1.25, 1), mark: lim, over: r.queue_delay_ms > lim,
            figure: dur(r.queue_delay_ms) + rate, title: title };
        }
        return { v: r.queue_delay_ms, full: scale.delay, mark: null, over: false, figure: dur(r.queue_delay_ms) + rate, title: title };
      },
    },
  ];
  // barsOf are the rankBars a model's rows show.
  function barsOf(m, snap) {
    return rankBars.filter((rb) => !rb.shown || rb.shown(m, snap));
  }

  function tileTitle(w, m, snap) {
    const lines = ['worker ' + w.id + ': ' + w.state + (w.level ? ' (' + w.level + ')' : '') +
      (w.reason ? ', reason ' + w.reason : '')];
    if (w.endpoint) lines.push(w.endpoint);
    const est = snap.estimates ? ' (this router\u2019s estimate)' : '';
    for (const r of w.ranks || []) {
      let kv = 'KV ' + fmt.format(r.kv_used);
      if (r.kv_total) kv += ' / ' + fmt.format(r.kv_total) + ' blocks (' + pct(r.kv_used / r.kv_total) + ')';
      else kv += ' blocks (total unknown: the bar is hatched)';
      if (r.kv_threshold != null) kv += ', threshold ' + pct(r.kv_threshold);
      let pf = 'prefill ' + fmt.format(r.prefill) + ' tokens';
      if (r.prefill_limit != null) pf += ', limit ' + fmt.format(r.prefill_limit);
      let line = 'rank ' + r.rank + est + ': ' + kv + '; ' + pf;
      if (r.queue_delay_ms != null) {
        line += '; queue delay ' + dur(r.queue_delay_ms) + ' at ' + fmt.format(r.prefill_rate) + ' tokens/s' +
          (r.delay_limit != null ? ' (threshold ' + dur(r.delay_limit) + ')' : '');
      } else if (r.delay_limit != null) {
        line += '; queue delay unknown (threshold ' + dur(r.delay_limit) + ')';
      }
      if (r.preemption_rate != null) line += '; ' + r.preemption_rate + ' preemptions/s';
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
    const t = { el: el, wid: make('span', 'wid', head), host: make('span', 'host', head), why: make('span', 'why', head),
      ranks: make('div', 'ranks', el), rows: [], key: '' };
    t.wid.textContent = id;
    return t;
  }

  // setBar draws b, what a rankBars entry gave.
  function setBar(bar, b) {
    let c = 'bar ' + bar.kind;
    let w = 0;
    if (b.full > 0) {
      w = Math.min(b.v / b.full, 1);
    } else if (b.full === null) {
      c += ' unknown';
    }
    if (b.mark != null && b.full > 0) {
      c += ' has-mark';
      bar.mark.style.left = (Math.min(b.mark / b.full, 1) * 100).toFixed(1) + '%';
    }
    if (b.over) c += ' over';
    cls(bar.el, c);
    bar.fill.style.width = (w * 100).toFixed(1) + '%';
    text(bar.fig, b.figure);
    attr(bar.cell, 'title', b.title);
  }

  function makeBar(parent, kind, label) {
    const cell = make('span', 'cell', parent);
    const fig = make('span', 'fig', cell);
    fig.dataset.label = label;
    const el = make('span', 'bar ' + kind, cell);
    return { cell: cell, fig: fig, el: el, kind: kind, fill: make('i', 'fill', el), mark: make('b', 'mark', el) };
  }

  function hostOf(endpoint) {
    try {
      return new URL(endpoint).host;
    } catch (e) {
      return endpoint;
    }
  }

  function updateTile(t, w, m, snap, scale) {
    let c = 'tile s-' + w.state;
    if (w.level) c += ' l-' + w.level;
    cls(t.el, c);
    t.el.dataset.state = w.state;
    t.el.dataset.level = w.level || '';
    text(t.why, w.reason ? reasonShort(w.reason) : (w.level === 'amber' ? 'amber' : (w.state === 'stale' ? 'stale' : '')));
    text(t.host, w.endpoint ? hostOf(w.endpoint) : '');
    attr(t.el, 'title', tileTitle(w, m, snap));
    const ranks = w.ranks || [];
    const bars = barsOf(m, snap);
    const barsKey = bars.map((rb) => rb.cls).join(' ');
    if (t.barsKey !== barsKey) {
      // Another set of bars: the rows are built anew.
      t.barsKey = barsKey;
      while (t.rows.length) t.rows.pop().el.remove();
    }
    while (t.rows.length < ranks.length) {
      const row = make('div', 'rank', t.ranks);
      const label = make('span', 'rank-label', row);
      t.rows.push({ el: row, label: label, bars: bars.map((rb) => makeBar(row, rb.cls, rb.label)) });
    }
    while (t.rows.length > ranks.length) t.rows.pop().el.remove();
    ranks.forEach((r, i) => {
      const row = t.rows[i];
      cls(row.el, r.stale ? 'rank stale' : 'rank');
      text(row.label, 'r' + r.rank);
      bars.forEach((rb, j) => setBar(row.bars[j], rb.of(r, scale)));
    });
  }

  // tileWidth is the width tiles get in a row of w pixels: the widest,
  // up to 360 px, that puts every worker on one row, or else on two or
  // three rows of tiles at least 150 px wide; else small tiles of 78 px and
  // more, as many rows as it takes.
  const tileGap = 8;
  function tileWidth(w, n) {
    for (const rows of [1, 2, 3]) {
      const per = Math.max(1, Math.ceil(n / rows));
      const tw = Math.floor((w - tileGap * (per - 1)) / per);
      if (tw >= 150) return Math.min(tw, 360);
    }
    return 78;
  }
  // sizeTiles sizes a model's tiles to the card: large ones write their
  // figures over the bars, small ones only draw them.
  function sizeTiles(sec) {
    const n = sec.tiles.size;
    const w = sec.tilesEl.clientWidth || modelsEl.clientWidth - 40;
    const key = n + '/' + w;
    if (sec.sizeKey === key || w <= 0) return;
    sec.sizeKey = key;
    const tw = tileWidth(w, n);
    sec.tilesEl.style.setProperty('--tile-min', tw + 'px');
    cls(sec.tilesEl, 'tiles ' + (tw >= 240 ? 'size-l' : tw >= 150 ? 'size-m' : 'size-s'));
  }

  function updateTiles(sec, m, snap) {
    let prefillMax = 0, delayMax = 0;
    for (const w of m.workers) {
      for (const r of w.ranks || []) {
        if (r.prefill_limit == null) prefillMax = Math.max(prefillMax, r.prefill);
        if (r.delay_limit == null && r.queue_delay_ms != null) delayMax = Math.max(delayMax, r.queue_delay_ms);
      }
    }
    const scale = { prefill: prefillMax > 0 ? prefillMax : 1, delay: delayMax > 0 ? delayMax : 1 };
    // The bars shown depend on the whole model: a change redraws its tiles.
    const barsKey = barsOf(m, snap).map((rb) => rb.cls).join(' ');
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
      const key = JSON.stringify(w) + '|' + scale.prefill + '|' + scale.delay + '|' + barsKey + '|' + (snap.estimates ? 1 : 0);
      if (key !== t.key) {
        t.key = key;
        updateTile(t, w, m, snap, scale);
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
    sizeTiles(sec);
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
        seedHistory(sec, m.name);
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
    // The legend explains the hatched KV bars when some are drawn.
    $('key-unknown').hidden = !snap.models.some((m) => m.workers.some((w) => (w.ranks || []).some((r) => !(r.kv_total > 0))));
    $('key-delay').hidden = !snap.models.some((m) => barsOf(m, snap).some((rb) => rb.cls === 'qd'));
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
  window.addEventListener('resize', () => {
    for (const sec of sections.values()) sizeTiles(sec);
  });
  setInterval(tick, 1000);
  loadHistory();
  connect();
})();
