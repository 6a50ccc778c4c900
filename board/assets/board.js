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
  function connect() {
    es = new EventSource('board/events');
    es.addEventListener('snapshot', (e) => {
      lastChange = Date.now();
      render(JSON.parse(e.data));
      setConn('live', 'live');
    });
    es.onopen = () => setConn('live', 'live');
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED) {
        // Refused (too many viewers) or the server is gone: try again later.
        setConn('down', 'disconnected: retrying');
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
      rejected: make('span', 'rejected', head),
      thresholds: make('div', 'thresholds', el),
      tilesEl: make('div', 'tiles', el),
      tiles: new Map(), // worker id -> tile state
      countsKey: '',
    };
    sec.rejected.hidden = true;
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
    if (m.rejected != null) {
      sec.rejected.hidden = false;
      const s = fmt.format(m.rejected);
      if (sec.rejected.dataset.v !== s) {
        sec.rejected.dataset.v = s;
        sec.rejected.replaceChildren(document.createTextNode('rejected '), make('b'));
        sec.rejected.lastChild.textContent = s;
      }
    } else {
      sec.rejected.hidden = true;
    }
    let th = 'thresholds: ' + thresholdsText(m.thresholds);
    if (m.updated_at) th += ' · record written ' + new Date(m.updated_at).toLocaleTimeString();
    text(sec.thresholds, th);
    updateTiles(sec, m, snap);
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
    const item = (v, label) => {
      const s = make('span', '', el);
      make('b', '', s).textContent = fmt.format(v);
      s.appendChild(document.createTextNode(' ' + label));
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
    if (a) {
      item(a.admitted || 0, 'admitted');
      item(a.rejected || 0, 'rejected');
      if (a.shed) item(a.shed, 'shed (low priority)');
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
