// Warren management UI: a single page on top of the RabbitMQ-compatible HTTP API (/api/...).
// Plain JavaScript, no libraries, no build step. Every piece of server-provided text reaches the
// page through textContent / setAttribute (the `h` helper below), never through innerHTML.
'use strict';

(function () {
  // ------------------------------------------------------------------------------------------
  // Constants and state
  // ------------------------------------------------------------------------------------------
  const AUTH_KEY = 'warren.auth';
  const USER_KEY = 'warren.user';
  const REFRESH_KEY = 'warren.refresh';
  const VHOST_KEY = 'warren.vhost';
  const MAX_ROWS = 500;
  const HISTORY = 60;
  const DASH = '–';
  const EXCHANGE_TYPES = ['direct', 'fanout', 'topic', 'headers', 'x-consistent-hash', 'x-modulus-hash', 'x-delayed-message'];
  const QUEUE_TYPES = ['classic', 'quorum'];
  const NO_YES = [['false', 'No'], ['true', 'Yes']];
  const DURABILITY = [['true', 'Durable'], ['false', 'Transient']];

  const state = {
    auth: null, // base64 "user:pass"
    user: null, // whoami answer
    vhosts: [], // names, from /api/vhosts
    overview: null,
    view: null,
    timer: null,
    history: [],
    exchangeTypes: EXCHANGE_TYPES,
  };

  const enc = encodeURIComponent;
  const $ = (sel, root) => (root || document).querySelector(sel);

  // ------------------------------------------------------------------------------------------
  // DOM helpers (text is always set with textContent / setAttribute)
  // ------------------------------------------------------------------------------------------
  function add(el, children) {
    for (const c of children.flat(Infinity)) {
      if (c == null || c === false) continue;
      el.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    const late = {};
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v == null || v === false) continue;
        if (k === 'class') el.className = v;
        else if (k === 'text') el.textContent = v;
        else if (k === 'value' || k === 'checked' || k === 'selected') late[k] = v;
        else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
        else el.setAttribute(k, v === true ? '' : String(v));
      }
    }
    add(el, children);
    Object.assign(el, late);
    return el;
  }

  const SVGNS = 'http://www.w3.org/2000/svg';
  function s(tag, attrs, ...children) {
    const el = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v != null) el.setAttribute(k, String(v));
    return add(el, children);
  }

  function clear(el) {
    while (el.firstChild) el.removeChild(el.firstChild);
    return el;
  }

  function setText(el, text) {
    const t = text == null ? DASH : String(text);
    if (el.textContent !== t) el.textContent = t;
  }

  function option(value, label, selected) {
    return h('option', { value, selected: !!selected }, label == null ? value : label);
  }

  /** Replace the options of a select, keeping the user's choice when it still exists. */
  function fillSelect(select, items, fallback) {
    const cur = select.value;
    const want = items.map((i) => (Array.isArray(i) ? i : [i, i]));
    const have = Array.from(select.options).map((o) => [o.value, o.textContent]);
    if (JSON.stringify(want) !== JSON.stringify(have)) {
      clear(select);
      for (const [v, l] of want) select.appendChild(option(v, l));
    }
    const values = want.map((w) => w[0]);
    if (values.includes(cur)) select.value = cur;
    else if (fallback != null && values.includes(fallback)) select.value = fallback;
  }

  // ------------------------------------------------------------------------------------------
  // Formatting
  // ------------------------------------------------------------------------------------------
  function fmtNum(n) {
    if (n == null || n === '' || Number.isNaN(Number(n))) return DASH;
    return Number(n).toLocaleString('en-US');
  }

  function fmtRate(r) {
    if (r == null || Number.isNaN(Number(r))) return DASH;
    const v = Number(r);
    if (v === 0) return '0.0/s';
    if (v < 10) return v.toFixed(1) + '/s';
    return Math.round(v).toLocaleString('en-US') + '/s';
  }

  function fmtBytes(b) {
    if (b == null || Number.isNaN(Number(b))) return DASH;
    let v = Number(b);
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? String(v) : v.toFixed(v < 10 ? 1 : 0)) + ' ' + units[i];
  }

  function fmtDuration(ms) {
    if (ms == null || ms === '' || Number.isNaN(Number(ms))) return DASH;
    const v = Number(ms);
    if (v < 1000) return Math.round(v) + ' ms';
    const sec = v / 1000;
    if (sec < 60) return sec.toFixed(sec < 10 ? 1 : 0) + ' s';
    const m = Math.floor(sec / 60), rs = Math.floor(sec % 60);
    if (m < 60) return m + 'm ' + rs + 's';
    const hr = Math.floor(m / 60), rm = m % 60;
    if (hr < 24) return hr + 'h ' + rm + 'm';
    const d = Math.floor(hr / 24), rh = hr % 24;
    return d + 'd ' + rh + 'h';
  }

  function fmtBool(b) {
    if (b == null) return DASH;
    return b ? 'yes' : 'no';
  }

  function fmtTime(ms) {
    if (ms == null) return DASH;
    const d = new Date(Number(ms));
    if (Number.isNaN(d.getTime())) return DASH;
    const p = (n) => String(n).padStart(2, '0');
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
  }

  function fmtValue(v) {
    if (v == null) return '';
    if (typeof v === 'object') return JSON.stringify(v);
    return String(v);
  }

  function rate(obj, key) {
    const ms = obj && obj.message_stats;
    const d = ms && ms[key + '_details'];
    return d && d.rate != null ? d.rate : null;
  }

  function tagsOf(x) {
    if (x == null) return [];
    if (Array.isArray(x)) return x.filter(Boolean).map(String);
    return String(x).split(',').map((t) => t.trim()).filter(Boolean);
  }

  function exchangeLabel(name) {
    return name === '' ? '(AMQP default)' : name;
  }

  // Hash segment for an exchange: the default exchange ("") is addressed as amq.default, as
  // RabbitMQ's API does (amq.* names are reserved, so this cannot clash).
  function exchangeSeg(name) {
    return name === '' ? 'amq.default' : name;
  }

  function queueHref(vhost, name) {
    return '#/queues/' + enc(vhost) + '/' + enc(name);
  }

  function exchangeHref(vhost, name) {
    return '#/exchanges/' + enc(vhost) + '/' + enc(exchangeSeg(name));
  }

  function link(href, text, attrs) {
    return h('a', Object.assign({ href }, attrs || {}), text);
  }

  /** A list of "key: value" lines for arguments / definitions / properties. */
  function kvList(obj, cls) {
    if (!obj || typeof obj !== 'object' || Object.keys(obj).length === 0) return h('span', { class: 'muted' }, DASH);
    return h('div', { class: 'kv ' + (cls || '') },
      Object.keys(obj).sort().map((k) => h('div', null, h('span', { class: 'kv-k' }, k + ': '), h('span', { class: 'kv-v' }, fmtValue(obj[k])))));
  }

  function features(o, kind) {
    const out = [];
    const tag = (t, title, cls) => h('abbr', { class: 'feat ' + (cls || ''), title }, t);
    if (o.durable) out.push(tag('D', 'durable'));
    if (o.auto_delete) out.push(tag('AD', 'auto-delete'));
    if (o.exclusive) out.push(tag('Excl', 'exclusive'));
    if (kind === 'exchange' && o.internal) out.push(tag('I', 'internal'));
    const args = o.arguments || {};
    for (const k of Object.keys(args).sort()) {
      if (k === 'x-queue-type') continue;
      out.push(tag(shortArg(k), k + ': ' + fmtValue(args[k]), 'arg'));
    }
    if (o.policy) out.push(tag(o.policy, 'policy ' + o.policy, 'policy'));
    return out.length ? out : h('span', { class: 'muted' }, DASH);
  }

  function shortArg(k) {
    const map = {
      'x-message-ttl': 'TTL', 'x-expires': 'Exp', 'x-max-length': 'Lim', 'x-max-length-bytes': 'Lim B',
      'x-dead-letter-exchange': 'DLX', 'x-dead-letter-routing-key': 'DLK', 'x-max-priority': 'Pri',
      'x-overflow': 'Ovfl', 'x-single-active-consumer': 'SAC', 'x-queue-mode': 'Mode',
      'alternate-exchange': 'AE', 'x-delayed-type': 'Delayed', 'x-delivery-limit': 'DelLim',
    };
    return map[k] || 'Args';
  }

  // ------------------------------------------------------------------------------------------
  // API client
  // ------------------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, body, message) {
      super(message);
      this.status = status;
      this.body = body;
    }
  }

  function basicAuth(user, pass) {
    const bytes = new TextEncoder().encode(user + ':' + pass);
    let bin = '';
    for (const b of bytes) bin += String.fromCharCode(b);
    return btoa(bin);
  }

  /** "/api/" + URL-encoded segments. */
  function P(...segs) {
    return '/api/' + segs.map((x) => enc(x)).join('/');
  }

  async function api(method, path, body, opts) {
    const o = opts || {};
    const headers = {
      'X-Requested-With': 'XMLHttpRequest',
      Authorization: 'Basic ' + (o.auth || state.auth || ''),
      Accept: 'application/json',
    };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    Object.assign(headers, o.headers || {});
    let resp;
    try {
      resp = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : (typeof body === 'string' ? body : JSON.stringify(body)),
        cache: 'no-store',
        credentials: 'omit',
      });
    } catch (e) {
      throw new ApiError(0, null, 'Cannot reach the broker (' + e.message + ')');
    }
    const text = await resp.text();
    let data = null;
    if (text) {
      try { data = JSON.parse(text); } catch (_) { data = text; }
    }
    if (!resp.ok) {
      let reason;
      if (data && typeof data === 'object') reason = data.reason || data.error || JSON.stringify(data);
      else reason = (typeof data === 'string' && data) || resp.statusText;
      const err = new ApiError(resp.status, data, `${reason} (HTTP ${resp.status})`);
      // RabbitMQ's API (and Warren's) answers 401 both for bad credentials and for a user whose
      // tags do not allow the request ("Not administrator user"): only a failing whoami means
      // the session itself is gone.
      if (resp.status === 401 && !o.auth && state.auth) {
        if (!(await sessionStillValid())) {
          sessionExpired();
          err.expired = true;
        } else {
          err.message = `Not authorized: ${reason} (HTTP 401)`;
        }
      }
      throw err;
    }
    if (o.withStatus) return { status: resp.status, data };
    return data;
  }

  let sessionCheck = null;
  function sessionStillValid() {
    if (!sessionCheck) {
      const auth = state.auth;
      sessionCheck = api('GET', '/api/whoami', undefined, { auth })
        .then(() => true, (e) => e.status !== 401)
        .finally(() => { setTimeout(() => { sessionCheck = null; }, 0); });
    }
    return sessionCheck;
  }

  // ------------------------------------------------------------------------------------------
  // Notifications and small widgets
  // ------------------------------------------------------------------------------------------
  function flash(message, kind) {
    const area = $('#flash');
    const box = h('div', { class: 'flash flash-' + (kind || 'ok'), role: kind === 'err' ? 'alert' : 'status' },
      h('span', null, message),
      h('button', { type: 'button', class: 'flash-close', title: 'Dismiss', onclick: () => box.remove() }, '×'));
    area.appendChild(box);
    if (kind !== 'err') setTimeout(() => box.remove(), 5000);
    while (area.children.length > 3) area.firstChild.remove();
  }

  function setResult(el, text, kind) {
    el.className = 'result result-' + (kind || 'ok');
    el.textContent = text;
    el.hidden = !text;
  }

  function result(id) {
    return h('div', { id, class: 'result', 'data-testid': id, role: 'status', hidden: true });
  }

  /** Run an async action from a button: disable it, show the outcome in `out`. */
  async function runAction(button, out, fn) {
    if (button) button.disabled = true;
    if (out) setResult(out, 'Working…', 'pending');
    try {
      const msg = await fn();
      if (out) {
        if (msg && typeof msg === 'object') setResult(out, msg.text, msg.kind);
        else setResult(out, msg || 'Done.', 'ok');
      }
      return true;
    } catch (e) {
      if (out) setResult(out, e.message, 'err');
      else flash(e.message, 'err');
      return false;
    } finally {
      if (button) button.disabled = false;
    }
  }

  function section(title, body, opts) {
    const o = opts || {};
    const key = 'warren.section.' + (o.key || title);
    let open = localStorage.getItem(key);
    open = open == null ? o.open !== false : open === 'open';
    const d = h('details', { class: 'section', open, id: o.id },
      h('summary', null, title, o.extra || null),
      h('div', { class: 'section-body' }, body));
    d.addEventListener('toggle', () => localStorage.setItem(key, d.open ? 'open' : 'closed'));
    return d;
  }

  function viewError() {
    return h('div', { class: 'view-error', id: 'view-error', role: 'alert', hidden: true });
  }

  /**
   * A row of labelled stat boxes. defs: [id, label, value], value(obj) giving the text shown;
   * update(obj) sets every box from one API object.
   */
  function statRow(defs) {
    const values = defs.map(([id]) => h('div', { class: 'stat-value', id, 'data-testid': id }, DASH));
    const el = h('div', { class: 'stats' }, defs.map(([, label], i) =>
      h('div', { class: 'stat' }, values[i], h('div', { class: 'stat-label' }, label))));
    return { el, update: (obj) => defs.forEach(([, , value], i) => setText(values[i], value(obj))) };
  }

  /** Stat values: a count, or a message rate (key as in message_stats). */
  const countOf = (key) => (o) => fmtNum(o[key]);
  const rateStat = (key) => (o) => fmtRate(rate(o, key));

  /** The ready / unacked / total message counts, ids `${prefix}-messages-*`. */
  function messageCountDefs(prefix) {
    return [
      [prefix + '-messages-ready', 'Ready', countOf('messages_ready')],
      [prefix + '-messages-unacked', 'Unacked', countOf('messages_unacknowledged')],
      [prefix + '-messages-total', 'Total', countOf('messages')],
    ];
  }

  /** Message rate boxes, ids `${prefix}-rate-${name}`; defs: [name, label, message_stats key (default: name)]. */
  function rateStats(prefix, defs) {
    return statRow(defs.map(([n, label, key]) => [`${prefix}-rate-${n}`, label, rateStat(key || n)]));
  }

  /** A form laid out as a two-column grid of labels and controls. */
  function formGrid(rows) {
    return h('div', { class: 'form-grid' }, rows.map((r) => {
      if (!r) return null;
      const [label, control, hint] = r;
      const forId = control && control.id;
      return [
        h('label', { class: 'f-label', for: forId || null }, label),
        h('div', { class: 'f-ctl' }, control, hint ? h('div', { class: 'hint' }, hint) : null),
      ];
    }));
  }

  function input(id, attrs) {
    return h('input', Object.assign({ id, name: id, 'data-testid': id, type: 'text', autocomplete: 'off', spellcheck: 'false' }, attrs || {}));
  }

  function textarea(id, attrs) {
    return h('textarea', Object.assign({ id, name: id, 'data-testid': id, rows: 3, spellcheck: 'false' }, attrs || {}));
  }

  function select(id, items, value) {
    const sel = h('select', { id, name: id, 'data-testid': id });
    for (const i of items) {
      const [v, l] = Array.isArray(i) ? i : [i, i];
      sel.appendChild(option(v, l));
    }
    if (value != null) sel.value = value;
    return sel;
  }

  function button(label, attrs) {
    return h('button', Object.assign({ type: 'button', class: 'btn' }, attrs || {}), label);
  }

  /** Parse a JSON object typed by the user; empty means {}. */
  function parseObject(text, what) {
    const t = (text || '').trim();
    if (!t) return {};
    let v;
    try { v = JSON.parse(t); } catch (e) { throw new Error(`${what}: not valid JSON (${e.message})`); }
    if (!v || typeof v !== 'object' || Array.isArray(v)) throw new Error(`${what}: must be a JSON object like {"key": "value"}`);
    return v;
  }
  /** A hint line of links ("Add: a | b | c"); clicking one calls pick(item). Items: names, or [name, ...]. */
  function helperLinks(lead, items, pick) {
    return h('div', { class: 'hint helpers' }, lead, items.map((item, i) => [
      i ? ' | ' : null,
      h('a', {
        href: '#', class: 'helper', onclick: (e) => {
          e.preventDefault();
          pick(item);
        },
      }, Array.isArray(item) ? item[0] : item),
    ]));
  }

  /** Links under a JSON textarea that insert a common key with a sample value. */
  function jsonHelpers(area, keys) {
    return helperLinks('Add: ', keys, ([k, sample]) => {
      let obj = {};
      try { obj = parseObject(area.value, 'arguments'); } catch (_) { return; }
      obj[k] = sample;
      area.value = JSON.stringify(obj, null, 1).replace(/\n\s*/g, ' ');
      area.focus();
    });
  }

  /** The trimmed value of a required text input; an error naming `what` when it is empty. */
  function required(el, what) {
    const v = el.value.trim();
    if (!v) throw new Error(`${what} is required.`);
    return v;
  }

  function vhostSelect(id) {
    const sel = select(id, []);
    syncVhostSelect(sel);
    return sel;
  }

  function syncVhostSelect(sel) {
    const fallback = state.vhostFilter || (state.vhosts.includes('/') ? '/' : state.vhosts[0]);
    fillSelect(sel, state.vhosts, fallback);
  }

  // ------------------------------------------------------------------------------------------
  // Sortable table with change detection (rows are only rebuilt when their data changed, so a
  // refresh does not disturb the page)
  // ------------------------------------------------------------------------------------------
  function table(cfg) {
    const columns = cfg.columns;
    let sortKey = cfg.sort ? cfg.sort[0] : null;
    let reverse = cfg.sort ? !!cfg.sort[1] : false;
    let rows = [];
    let signature = null;
    const thead = h('thead');
    const tbody = h('tbody');
    const foot = h('div', { class: 'table-foot muted' });
    const tbl = h('table', { class: 'list', id: cfg.id, 'data-testid': cfg.id }, thead, tbody);
    const el = h('div', { class: 'table-wrap' }, tbl, foot);

    function value(col, row) {
      if (col.get) return col.get(row);
      return row[col.key];
    }

    function drawHeader() {
      clear(thead);
      if (columns.some((c) => c.group)) {
        const tr = h('tr', { class: 'groups' });
        let i = 0;
        while (i < columns.length) {
          const g = columns[i].group || '';
          let span = 1;
          while (i + span < columns.length && (columns[i + span].group || '') === g) span++;
          tr.appendChild(h('th', { colspan: span, class: g ? 'group' : 'group empty' }, g));
          i += span;
        }
        thead.appendChild(tr);
      }
      const tr = h('tr');
      for (const col of columns) {
        const sortable = col.sortable !== false && !col.action;
        const th = h('th', { class: (col.num ? 'num ' : '') + (sortable ? 'sortable' : ''), title: col.title || null },
          col.label,
          sortKey === col.key ? h('span', { class: 'sort-ind' }, reverse ? ' ▼' : ' ▲') : null);
        if (sortable) {
          th.addEventListener('click', () => {
            if (sortKey === col.key) reverse = !reverse;
            else { sortKey = col.key; reverse = false; }
            drawHeader();
            draw(true);
          });
        }
        tr.appendChild(th);
      }
      thead.appendChild(tr);
    }

    function sorted() {
      if (!sortKey) return rows;
      const col = columns.find((c) => c.key === sortKey);
      if (!col) return rows;
      const out = rows.slice().sort((a, b) => {
        const va = value(col, a), vb = value(col, b);
        if (va == null && vb == null) return 0;
        if (va == null) return 1;
        if (vb == null) return -1;
        if (typeof va === 'number' && typeof vb === 'number') return va - vb;
        return String(va).localeCompare(String(vb), undefined, { numeric: true });
      });
      if (reverse) out.reverse();
      return out;
    }

    function draw(force, extra) {
      const list = sorted();
      const shown = list.slice(0, cfg.limit || MAX_ROWS);
      const sig = JSON.stringify([shown, extra === undefined ? null : extra]);
      if (!force && sig === signature) return;
      signature = sig;
      clear(tbody);
      if (shown.length === 0) {
        tbody.appendChild(h('tr', { class: 'empty' }, h('td', { colspan: columns.length }, cfg.empty || 'Nothing to show.')));
      }
      for (const row of shown) {
        const attrs = cfg.rowAttrs ? cfg.rowAttrs(row) : {};
        const tr = h('tr', attrs);
        for (const col of columns) {
          let content;
          if (col.cell) content = col.cell(row);
          else if (col.fmt) content = col.fmt(value(col, row), row);
          else content = fmtValue(value(col, row));
          tr.appendChild(h('td', { class: (col.num ? 'num ' : '') + (col.cls || ''), 'data-col': col.key }, content));
        }
        tbody.appendChild(tr);
      }
      const total = rows.length;
      foot.textContent = list.length > shown.length
        ? `Showing ${shown.length} of ${total} items; use the filter to narrow the list.`
        : (cfg.counter ? `${total} item${total === 1 ? '' : 's'}` : '');
    }

    drawHeader();
    draw(true);
    return {
      el,
      update(newRows, extra) { rows = newRows || []; draw(false, extra); },
    };
  }

  function nameFilter(rows, text, useRegex, get) {
    const t = (text || '').trim();
    if (!t) return rows;
    const pick = get || ((r) => r.name);
    if (useRegex) {
      let re;
      try { re = new RegExp(t, 'i'); } catch (_) { return rows; }
      return rows.filter((r) => re.test(pick(r)));
    }
    const low = t.toLowerCase();
    return rows.filter((r) => String(pick(r)).toLowerCase().includes(low));
  }

  function filterBar(id, onchange) {
    const box = input(id, { type: 'search', placeholder: 'Filter by name', class: 'filter', oninput: onchange });
    const re = h('input', { type: 'checkbox', id: id + '-regex', onchange });
    const count = h('span', { class: 'muted filter-count', id: id + '-count' });
    const bar = h('div', { class: 'filterbar' }, h('label', { for: id }, 'Filter: '), box,
      h('label', { class: 'check' }, re, ' Regex'), count);
    return { el: bar, box, re, count };
  }

  /** Table columns: a number, a message rate (key as in message_stats), the row's action button. */
  const numCol = (key, label, more) => Object.assign({ key, label, num: true, fmt: fmtNum }, more);
  const rateCol = (key, label, statKey) => ({ key, label, num: true, get: (r) => rate(r, statKey || key), fmt: fmtRate });
  const actionCol = (cell) => ({ key: 'actions', label: '', action: true, cell });

  /** The same header group for each of `cols`. */
  function grouped(group, cols) {
    return cols.map((c) => Object.assign({ group }, c));
  }

  // ------------------------------------------------------------------------------------------
  // Page building blocks: list pages, forms and buttons that run an action
  // ------------------------------------------------------------------------------------------
  /** "/api/<kind>", or "/api/<kind>/<vhost>" when a vhost is given. */
  function apiPath(kind, vhost) {
    return vhost ? P(kind, vhost) : '/api/' + kind;
  }

  /**
   * A list page: a filter bar over a sortable table (id `<tab>-table`) of GET /api/<tab>, narrowed
   * to the vhost chosen in the header, then the caller's `sections`.
   * cfg: { tab, title, table: table() config (id and sort by name by default), filterText(row)
   * (what the filter matches; the name by default), byVhost (narrowed as /api/vhosts/<vhost>/<tab>
   * rather than /api/<tab>/<vhost>), sections, refresh() (more to do on each refresh) }.
   */
  function listView(cfg) {
    const err = viewError();
    let rows = [];
    const fb = filterBar(cfg.tab + '-filter', () => render());
    const tbl = table(Object.assign({ id: cfg.tab + '-table', sort: ['name'] }, cfg.table));
    function render() {
      const shown = nameFilter(rows, fb.box.value, fb.re.checked, cfg.filterText);
      tbl.update(shown);
      setText(fb.count, `${shown.length} of ${rows.length}`);
    }
    const el = h('div', { class: 'view' }, h('h1', null, cfg.title), err,
      section('All ' + cfg.tab, [fb.el, tbl.el]), cfg.sections);
    async function refresh() {
      const vh = state.vhostFilter;
      rows = await api('GET', cfg.byVhost && vh ? P('vhosts', vh, cfg.tab) : apiPath(cfg.tab, vh)) || [];
      render();
      if (cfg.refresh) cfg.refresh();
    }
    return { tab: cfg.tab, title: cfg.title, el, refresh };
  }

  /**
   * A form: `intro`, a grid of `rows`, a submit button labelled `label` with its result line, then
   * `extra`. Submitting runs `action` (see runAction; its answer is the message shown), then empties
   * the inputs in `reset` and refreshes the view. Element ids are `<id>-form`, `<id>-submit` and
   * `<id>-result` unless formId / submitId / resultId say otherwise.
   */
  function actionForm(cfg) {
    const submitId = cfg.submitId || cfg.id + '-submit';
    const submit = h('button', { type: 'submit', class: 'btn btn-primary', id: submitId, 'data-testid': submitId }, cfg.label);
    const out = result(cfg.resultId || cfg.id + '-result');
    return h('form', {
      id: cfg.formId || cfg.id + '-form', novalidate: true, onsubmit: (e) => {
        e.preventDefault();
        runAction(submit, out, async () => {
          const msg = await cfg.action();
          for (const el of cfg.reset || []) el.value = '';
          refreshNow();
          return msg;
        });
      },
    }, cfg.intro, formGrid(cfg.rows), h('div', { class: 'form-actions' }, submit, out), cfg.extra);
  }

  /** A button that asks `question` first (when there is one), then runs `fn` as an action reporting to `out`. */
  function actionButton(label, attrs, question, out, fn) {
    return button(label, Object.assign({}, attrs, {
      onclick: (e) => {
        if (question && !confirm(question)) return;
        runAction(e.currentTarget, out, fn);
      },
    }));
  }

  /** A small red button for a table row: asks `question` (when given), DELETEs `path`, flashes `done`. */
  function deleteButton(label, testid, question, path, done) {
    return actionButton(label, { class: 'btn btn-small btn-danger', 'data-testid': testid }, question, null, async () => {
      await api('DELETE', path);
      flash(done);
      refreshNow();
    });
  }

  /** Unbind, for a row of a bindings table (none for the default exchange's implicit bindings). */
  function unbindButton(b) {
    if (b.source === '') return null;
    const kind = b.destination_type === 'exchange' ? 'e' : 'q';
    return deleteButton('Unbind', 'unbind', null, P('bindings', b.vhost, 'e', b.source, kind, b.destination, b.properties_key), 'Binding removed.');
  }

  /** A bindings table: `end` (the column of the binding's other end), routing key, arguments, Unbind. */
  function bindingsTable(cfg, end) {
    return table(Object.assign({}, cfg, {
      columns: [
        end,
        { key: 'routing_key', label: 'Routing key' },
        { key: 'arguments', label: 'Arguments', cell: (b) => kvList(b.arguments), sortable: false },
        actionCol(unbindButton),
      ],
    }));
  }

  /**
   * The "add binding" form of an exchange or queue page: the binding's other end (input `id` with a
   * datalist `<id>-list` that the page fills; `prefix` goes before it), routing key and arguments.
   * POSTs to path(other end); done(other end) is the message shown. Returns { el, list }.
   */
  function bindForm(cfg) {
    const other = input(cfg.id, { list: cfg.id + '-list', required: true });
    const list = h('datalist', { id: cfg.id + '-list' });
    const rk = input('bind-routing-key');
    const args = textarea('bind-arguments', { rows: 2, placeholder: '{"x-match": "all"}' });
    const el = actionForm({
      id: 'bind', label: 'Bind',
      rows: [[cfg.label, h('span', { class: cfg.prefix ? 'inline' : null }, cfg.prefix, other, list)], ['Routing key', rk], ['Arguments (JSON)', args]],
      action: async () => {
        const v = other.value;
        if (!v) throw new Error(cfg.missing);
        await api('POST', cfg.path(v), { routing_key: rk.value, arguments: parseObject(args.value, 'Arguments') });
        return cfg.done(v);
      },
    });
    return { el, list };
  }

  // ------------------------------------------------------------------------------------------
  // Charts (inline SVG, history kept in memory while the page is open)
  // ------------------------------------------------------------------------------------------
  const COLORS = ['#d9480f', '#1c7ed6', '#2f9e44', '#ae3ec9', '#f08c00'];

  function chart(id, title, series, fmt) {
    const legend = h('div', { class: 'legend' });
    const box = h('div', { class: 'chart', id });
    const svgEl = s('svg', { viewBox: '0 0 300 80', preserveAspectRatio: 'none', class: 'chart-svg' });
    const maxLabel = h('div', { class: 'chart-max muted' });
    add(box, [h('div', { class: 'chart-title' }, title), maxLabel, svgEl, legend]);
    function update(points) {
      clear(svgEl);
      clear(legend);
      let max = 0;
      for (const p of points) for (const se of series) max = Math.max(max, Number(p[se.key]) || 0);
      const top = max > 0 ? max * 1.1 : 1;
      maxLabel.textContent = 'max ' + fmt(max);
      for (let gy = 0; gy <= 4; gy++) {
        svgEl.appendChild(s('line', { x1: 0, x2: 300, y1: gy * 20, y2: gy * 20, class: 'grid' }));
      }
      series.forEach((se, i) => {
        const n = points.length;
        if (n > 0) {
          const step = 300 / Math.max(HISTORY - 1, 1);
          const x0 = 300 - (n - 1) * step;
          const pts = points.map((p, j) => `${(x0 + j * step).toFixed(1)},${(80 - ((Number(p[se.key]) || 0) / top) * 78).toFixed(1)}`);
          svgEl.appendChild(s('polyline', { points: pts.join(' '), fill: 'none', stroke: COLORS[i % COLORS.length], 'stroke-width': 1.6, 'vector-effect': 'non-scaling-stroke' }));
          const [lx, ly] = pts[n - 1].split(',');
          svgEl.appendChild(s('line', { x1: lx, x2: lx, y1: ly, y2: ly, stroke: COLORS[i % COLORS.length], 'stroke-width': 5, 'stroke-linecap': 'round', 'vector-effect': 'non-scaling-stroke' }));
        }
        const last = n ? points[n - 1][se.key] : null;
        legend.appendChild(h('span', { class: 'legend-item' },
          h('i', { class: 'swatch', style: 'background:' + COLORS[i % COLORS.length] }), se.label + ' ',
          h('b', null, fmt(last))));
      });
    }
    update([]);
    return { el: box, update };
  }

  // ------------------------------------------------------------------------------------------
  // Views. Each view: { tab, el, refresh() }. A view builds its forms once; refresh() only
  // updates tables and numbers, so a periodic refresh never loses what the user typed.
  // ------------------------------------------------------------------------------------------

  // ---- Overview -----------------------------------------------------------------------------
  function overviewView() {
    const err = viewError();
    const alarmBanner = h('div', { id: 'overview-alarms', 'data-testid': 'overview-alarms', class: 'alarm-banner ok' }, 'Checking alarms…');
    const totals = statRow(messageCountDefs('overview'));
    const objects = statRow([
      ['connections', 'Connections'], ['channels', 'Channels'], ['exchanges', 'Exchanges'], ['queues', 'Queues'], ['consumers', 'Consumers'],
    ].map(([k, label]) => ['overview-' + k, label, countOf(k)]));
    const rates = rateStats('overview', [
      ['publish', 'Publish'], ['confirm', 'Publisher confirm'], ['deliver', 'Deliver / get', 'deliver_get'],
      ['redeliver', 'Redelivered'], ['ack', 'Consumer ack'],
    ]);
    const qChart = chart('chart-queued', 'Queued messages', [
      { key: 'ready', label: 'Ready' }, { key: 'unacked', label: 'Unacked' }, { key: 'total', label: 'Total' },
    ], fmtNum);
    const rChart = chart('chart-rates', 'Message rates', [
      { key: 'publish', label: 'Publish' }, { key: 'deliver', label: 'Deliver/get' }, { key: 'ack', label: 'Ack' }, { key: 'redeliver', label: 'Redeliver' },
    ], fmtRate);

    const nodeName = h('span', { id: 'overview-node-name', 'data-testid': 'overview-node-name' }, DASH);
    const clusterName = h('span', { id: 'overview-cluster-name' }, DASH);
    const version = h('span', { id: 'overview-version' }, DASH);
    const nodes = table({
      id: 'nodes-table',
      rowAttrs: (n) => ({ 'data-node': n.name }),
      columns: [
        { key: 'name', label: 'Name', cell: (n) => h('b', null, n.name) },
        { key: 'running', label: 'State', cell: (n) => (n.running === false ? h('span', { class: 'badge badge-err' }, 'down') : h('span', { class: 'badge badge-ok' }, 'running')) },
        { key: 'mem_used', label: 'Memory', cell: (n) => meter(n.mem_used, n.mem_limit, n.mem_alarm, 'used', 'high watermark'), sortable: false },
        { key: 'disk_free', label: 'Disk space', cell: (n) => diskMeter(n), sortable: false },
        { key: 'uptime', label: 'Uptime', fmt: (v) => fmtDuration(v) },
        { key: 'alarms', label: 'Alarms', cell: (n) => nodeAlarms(n), sortable: false },
      ],
    });
    const listeners = table({
      id: 'listeners-table',
      columns: [
        { key: 'protocol', label: 'Protocol' },
        { key: 'node', label: 'Node' },
        { key: 'ip_address', label: 'Bound to' },
        { key: 'port', label: 'Port', num: true },
      ],
    });

    const el = h('div', { class: 'view' },
      h('h1', null, 'Overview'),
      err,
      alarmBanner,
      section('Totals', [
        h('div', { class: 'stat-group' }, h('h3', null, 'Messages'), totals.el),
        h('div', { class: 'stat-group' }, h('h3', null, 'Objects'), objects.el),
      ]),
      section('Message rates', [rates.el, h('div', { class: 'charts' }, qChart.el, rChart.el)]),
      section('Nodes', [
        h('dl', { class: 'inline-facts' },
          h('dt', null, 'Cluster'), h('dd', null, clusterName),
          h('dt', null, 'Node'), h('dd', null, nodeName),
          h('dt', null, 'Version'), h('dd', null, version)),
        nodes.el,
      ]),
      section('Ports and contexts', listeners.el, { open: true }),
    );

    async function refresh() {
      const [ov, nd, al] = await Promise.allSettled([
        api('GET', '/api/overview'),
        api('GET', '/api/nodes'),
        api('GET', '/api/health/checks/alarms'),
      ]);
      if (ov.status === 'rejected') throw ov.reason;
      const o = ov.value;
      state.overview = o;
      updateHeader(o);
      const qt = o.queue_totals || {};
      totals.update(qt);
      objects.update(o.object_totals || {});
      rates.update(o);
      setText(nodeName, o.node);
      setText(clusterName, o.cluster_name);
      setText(version, productLine(o));

      state.history.push({
        t: Date.now(),
        ready: qt.messages_ready || 0, unacked: qt.messages_unacknowledged || 0, total: qt.messages || 0,
        publish: rate(o, 'publish') || 0, deliver: rate(o, 'deliver_get') || 0, ack: rate(o, 'ack') || 0, redeliver: rate(o, 'redeliver') || 0,
      });
      while (state.history.length > HISTORY) state.history.shift();
      qChart.update(state.history);
      rChart.update(state.history);

      listeners.update(o.listeners || []);
      if (nd.status === 'fulfilled') nodes.update(nd.value || []);

      let nodeAlarm = false;
      if (nd.status === 'fulfilled') nodeAlarm = (nd.value || []).some((n) => n.mem_alarm || n.disk_free_alarm);
      if (al.status === 'fulfilled' && !nodeAlarm) {
        alarmBanner.className = 'alarm-banner ok';
        setText(alarmBanner, 'No resource alarms in effect.');
      } else if (al.status === 'rejected' && al.reason.status !== 503 && !nodeAlarm) {
        alarmBanner.className = 'alarm-banner unknown';
        setText(alarmBanner, 'Alarm state unknown: ' + al.reason.message);
      } else {
        alarmBanner.className = 'alarm-banner alarm';
        const reason = al.status === 'rejected' && al.reason.body && al.reason.body.reason;
        const parts = [];
        if (nd.status === 'fulfilled') {
          for (const n of nd.value || []) {
            if (n.mem_alarm) parts.push(`memory alarm on ${n.name}`);
            if (n.disk_free_alarm) parts.push(`disk alarm on ${n.name}`);
          }
        }
        setText(alarmBanner, 'Resource alarm in effect: publishers are blocked. ' + (reason || parts.join(', ')));
      }
    }

    return { tab: 'overview', title: 'Overview', el, refresh };
  }

  function meter(used, limit, alarm, usedWord, limitWord) {
    const pct = limit ? Math.min(100, (Number(used) / Number(limit)) * 100) : 0;
    return h('div', { class: 'meter-wrap' },
      h('div', { class: 'meter' + (alarm ? ' meter-alarm' : '') }, h('div', { class: 'meter-fill', style: `width:${pct.toFixed(1)}%` })),
      h('div', { class: 'meter-text' + (alarm ? ' text-alarm' : '') },
        `${fmtBytes(used)} ${usedWord}`, h('span', { class: 'muted' }, ` / ${fmtBytes(limit)} ${limitWord}`)));
  }

  function diskMeter(n) {
    const alarm = !!n.disk_free_alarm;
    return h('div', { class: 'meter-wrap' },
      h('div', { class: 'meter-text' + (alarm ? ' text-alarm' : '') },
        `${fmtBytes(n.disk_free)} free`, h('span', { class: 'muted' }, ` / ${fmtBytes(n.disk_free_limit)} low watermark`)));
  }

  function nodeAlarms(n) {
    const out = [];
    if (n.mem_alarm) out.push(h('span', { class: 'badge badge-err', 'data-testid': 'mem-alarm' }, 'memory alarm'));
    if (n.disk_free_alarm) out.push(h('span', { class: 'badge badge-err', 'data-testid': 'disk-alarm' }, 'disk alarm'));
    return out.length ? out : h('span', { class: 'badge badge-ok' }, 'none');
  }

  function productLine(o) {
    const prod = o.product_name ? `${o.product_name} ${o.product_version || ''}`.trim() : null;
    const rmq = o.rabbitmq_version ? `RabbitMQ API ${o.rabbitmq_version}` : null;
    return [prod, rmq].filter(Boolean).join(' · ') || DASH;
  }

  // ---- Connections --------------------------------------------------------------------------
  function connectionsView() {
    const reason = input('close-reason', { value: 'Closed via management UI', size: 40 });
    const closeButton = (c) => actionButton('Close', { class: 'btn btn-small btn-danger close-connection', 'data-testid': 'close-connection' },
      `Close connection "${c.name}"?`, null, async () => {
        await api('DELETE', P('connections', c.name), undefined, { headers: { 'X-Reason': reason.value || 'Closed via management UI' } });
        flash(`Connection "${c.name}" closed.`);
        refreshNow();
        // The broker drops the connection once the client answers connection.close.
        setTimeout(() => refreshNow(), 1000);
      });
    return listView({
      tab: 'connections',
      title: 'Connections',
      byVhost: true,
      filterText: (c) => c.name + ' ' + (clientName(c) || ''),
      table: {
        rowAttrs: (c) => ({ 'data-connection': c.name }),
        columns: [
          ...grouped('Overview', [
            { key: 'name', label: 'Name', cell: (c) => [h('div', null, c.name), clientName(c) ? h('div', { class: 'muted small' }, clientName(c)) : null] },
            { key: 'vhost', label: 'Virtual host' },
            { key: 'user', label: 'User' },
            { key: 'state', label: 'State', cell: (c) => stateBadge(c.state) },
          ]),
          ...grouped('Details', [
            { key: 'ssl', label: 'TLS', fmt: (v) => (v ? '●' : '○') },
            { key: 'protocol', label: 'Protocol' },
            { key: 'client', label: 'Client', get: (c) => clientProduct(c) },
            numCol('channels', 'Channels'),
            { key: 'connected_at', label: 'Connected', fmt: (v) => fmtTime(v) },
          ]),
          ...grouped('Network', [
            { key: 'recv', label: 'From client', num: true, get: (c) => rateOf(c.recv_oct_details), fmt: fmtByteRate },
            { key: 'send', label: 'To client', num: true, get: (c) => rateOf(c.send_oct_details), fmt: fmtByteRate },
          ]),
          actionCol(closeButton),
        ],
      },
      sections: section('Close connections', formGrid([['Reason sent to the client', reason, 'Sent as the X-Reason header; the client sees it in connection.close.']]), { open: true }),
    });
  }

  function fmtByteRate(v) {
    return v == null ? DASH : fmtBytes(v) + '/s';
  }

  function rateOf(d) {
    return d && d.rate != null ? d.rate : null;
  }

  function clientName(c) {
    const cp = c.client_properties || {};
    return cp.connection_name || c.user_provided_name || null;
  }

  function clientProduct(c) {
    const cp = c.client_properties || {};
    const prod = [cp.product, cp.version].filter(Boolean).join(' ');
    return prod || null;
  }

  function stateBadge(st) {
    if (st == null) return DASH;
    const cls = st === 'running' ? 'badge-ok' : (st === 'idle' ? 'badge-idle' : (st === 'flow' ? 'badge-warn' : 'badge-err'));
    return h('span', { class: 'badge ' + cls }, st);
  }

  // ---- Channels -----------------------------------------------------------------------------
  function channelsView() {
    return listView({
      tab: 'channels',
      title: 'Channels',
      byVhost: true,
      table: {
        rowAttrs: (c) => ({ 'data-channel': c.name }),
        columns: [
          ...grouped('Overview', [
            { key: 'name', label: 'Channel' },
            { key: 'vhost', label: 'Virtual host' },
            { key: 'user', label: 'User' },
            { key: 'mode', label: 'Mode', get: (c) => (c.confirm ? 'C' : '') + (c.transactional ? 'T' : ''), title: 'C = confirm, T = transactional' },
            { key: 'state', label: 'State', cell: (c) => stateBadge(c.state) },
          ]),
          ...grouped('Details', [
            numCol('consumer_count', 'Consumers'),
            numCol('prefetch_count', 'Prefetch'),
            numCol('global_prefetch_count', 'Global prefetch'),
            numCol('messages_unacknowledged', 'Unacked'),
            numCol('messages_unconfirmed', 'Unconfirmed'),
          ]),
          ...grouped('Message rates', [
            rateCol('publish', 'Publish'),
            rateCol('confirm', 'Confirm'),
            rateCol('deliver', 'Deliver / get', 'deliver_get'),
            rateCol('ack', 'Ack'),
          ]),
        ],
      },
    });
  }

  // ---- Exchanges ----------------------------------------------------------------------------
  function exchangesView() {
    const vh = vhostSelect('add-exchange-vhost');
    const name = input('add-exchange-name', { required: true });
    const type = h('select', { id: 'add-exchange-type', 'data-testid': 'add-exchange-type' });
    fillSelect(type, state.exchangeTypes, 'direct');
    const durable = select('add-exchange-durable', DURABILITY, 'true');
    const autoDelete = select('add-exchange-auto-delete', NO_YES, 'false');
    const internal = select('add-exchange-internal', NO_YES, 'false');
    const args = textarea('add-exchange-arguments', { placeholder: '{"alternate-exchange": "my-ae"}', rows: 2 });
    const form = actionForm({
      id: 'add-exchange',
      label: 'Add exchange',
      reset: [name],
      rows: [
        ['Virtual host', vh], ['Name', name], ['Type', type], ['Durability', durable], ['Auto delete', autoDelete],
        ['Internal', internal], ['Arguments (JSON)', args, jsonHelpers(args, [['alternate-exchange', 'my-ae'], ['x-delayed-type', 'direct']])],
      ],
      action: async () => {
        const n = required(name, 'Name');
        const body = {
          type: type.value, durable: durable.value === 'true', auto_delete: autoDelete.value === 'true',
          internal: internal.value === 'true', arguments: parseObject(args.value, 'Arguments'),
        };
        await api('PUT', P('exchanges', vh.value, n), body);
        return `Exchange "${n}" declared in vhost "${vh.value}".`;
      },
    });

    return listView({
      tab: 'exchanges',
      title: 'Exchanges',
      filterText: (x) => exchangeLabel(x.name),
      table: {
        rowAttrs: (x) => ({ 'data-exchange': x.name, 'data-vhost': x.vhost }),
        columns: [
          { key: 'vhost', label: 'Virtual host' },
          { key: 'name', label: 'Name', cell: (x) => link(exchangeHref(x.vhost, x.name), exchangeLabel(x.name), { class: 'name-link' }) },
          { key: 'type', label: 'Type' },
          { key: 'features', label: 'Features', cell: (x) => features(x, 'exchange'), sortable: false },
          rateCol('in', 'Message rate in', 'publish_in'),
          rateCol('out', 'Message rate out', 'publish_out'),
        ],
      },
      sections: section('Add a new exchange', form, { key: 'add-exchange' }),
      refresh: () => {
        syncVhostSelect(vh);
        fillSelect(type, state.exchangeTypes, 'direct');
      },
    });
  }

  function exchangeView(vhost, seg) {
    const name = seg === 'amq.default' ? '' : seg;
    const apiName = exchangeSeg(name);
    const isDefault = name === '';
    const err = viewError();
    const details = h('dl', { class: 'details', id: 'exchange-details' });
    const rates = rateStats('exchange', [['in', 'Publish in', 'publish_in'], ['out', 'Publish out', 'publish_out']]);

    const outTbl = bindingsTable({
      id: 'exchange-bindings-table',
      empty: isDefault ? 'The default exchange is implicitly bound to every queue, with the queue name as routing key.' : 'No bindings.',
      rowAttrs: (b) => ({ 'data-destination': b.destination }),
    }, { key: 'destination', label: 'To', cell: (b) => [b.destination_type === 'exchange' ? link(exchangeHref(b.vhost, b.destination), b.destination) : link(queueHref(b.vhost, b.destination), b.destination), h('span', { class: 'muted small' }, ' (' + b.destination_type + ')')] });
    const inTbl = bindingsTable({
      id: 'exchange-bindings-in-table',
      empty: 'No exchange-to-exchange bindings to this exchange.',
    }, { key: 'source', label: 'From', cell: (b) => link(exchangeHref(b.vhost, b.source), exchangeLabel(b.source)) });

    // Add binding from this exchange.
    const destType = select('bind-destination-type', [['q', 'To queue'], ['e', 'To exchange']], 'q');
    destType.addEventListener('change', () => refreshNow());
    const bind = bindForm({
      id: 'bind-destination',
      label: 'Destination',
      prefix: destType,
      missing: 'Destination is required.',
      path: (d) => P('bindings', vhost, 'e', apiName, destType.value, d),
      done: (d) => `Bound to ${destType.value === 'q' ? 'queue' : 'exchange'} "${d}".`,
    });

    const pub = publishForm(P('exchanges', vhost, apiName, 'publish'));

    const delBtn = actionButton('Delete this exchange', { class: 'btn btn-danger', id: 'exchange-delete', 'data-testid': 'exchange-delete' },
      `Delete exchange "${name}" in vhost "${vhost}"?`, null, async () => {
        await api('DELETE', P('exchanges', vhost, apiName));
        flash(`Exchange "${name}" deleted.`);
        location.hash = '#/exchanges';
      });
    const builtin = isDefault || name.startsWith('amq.');

    const el = h('div', { class: 'view' },
      h('div', { class: 'crumbs' }, link('#/exchanges', 'Exchanges'), ' › virtual host ', h('span', { class: 'mono' }, vhost)),
      h('h1', null, 'Exchange: ', h('span', { class: 'entity-name', id: 'exchange-name' }, exchangeLabel(name))),
      err,
      section('Overview', [details, rates.el], { key: 'x-overview' }),
      isDefault ? null : section('Bindings', [
        h('h3', null, 'From this exchange'), outTbl.el,
        h('h3', null, 'To this exchange'), inTbl.el,
        h('h3', null, 'Add binding from this exchange'), bind.el,
      ], { key: 'x-bindings' }),
      isDefault ? section('Bindings', h('p', { class: 'muted' }, 'The default exchange is implicitly bound to every queue, with the queue name as routing key. It cannot be bound or unbound explicitly.'), { key: 'x-bindings' }) : null,
      section('Publish message', pub, { key: 'x-publish' }),
      builtin ? null : section('Delete this exchange', delBtn, { key: 'x-delete' }),
    );

    async function refresh() {
      const x = await api('GET', P('exchanges', vhost, apiName));
      fillDetails(details, [
        ['Virtual host', x.vhost], ['Type', x.type], ['Features', features(x, 'exchange')],
        ['Durable', fmtBool(x.durable)], ['Auto delete', fmtBool(x.auto_delete)], ['Internal', fmtBool(x.internal)],
        ['Arguments', kvList(x.arguments)], ['Policy', x.policy || DASH],
      ]);
      rates.update(x);
      if (!isDefault) {
        const [src, dst, qs] = await Promise.all([
          api('GET', P('exchanges', vhost, apiName, 'bindings', 'source')),
          api('GET', P('exchanges', vhost, apiName, 'bindings', 'destination')).catch(() => []),
          api('GET', destType.value === 'q' ? P('queues', vhost) : P('exchanges', vhost)).catch(() => []),
        ]);
        outTbl.update(src || []);
        inTbl.update(dst || []);
        fillSelect(bind.list, (qs || []).map((o) => o.name).filter(Boolean));
      }
    }
    return { tab: 'exchanges', title: 'Exchange ' + exchangeLabel(name), el, refresh };
  }

  /** Key/value details list (the left-hand "Details" box of RabbitMQ's object pages). */
  function fillDetails(dl, pairs) {
    const sig = JSON.stringify(pairs.map(([k, v]) => [k, v instanceof Node ? v.textContent : v]));
    if (dl.dataset.sig === sig) return;
    dl.dataset.sig = sig;
    clear(dl);
    for (const [k, v] of pairs) dl.appendChild(detail(k, v));
  }

  /**
   * The "Publish message" form, POSTing to `path` (an exchange's publish endpoint). With `fixedKey`
   * (the queue page) the routing key is that, not an input.
   */
  function publishForm(path, fixedKey) {
    const rk = fixedKey == null ? input('publish-routing-key') : null;
    const mode = select('publish-delivery-mode', [['1', '1 - Non-persistent'], ['2', '2 - Persistent']], '2');
    const props = textarea('publish-properties', { rows: 2, placeholder: '{"content_type": "text/plain", "headers": {"k": "v"}}' });
    const encoding = select('publish-encoding', [['string', 'String'], ['base64', 'Base64']], 'string');
    const payload = textarea('publish-payload', { rows: 4 });
    return actionForm({
      id: 'publish',
      label: 'Publish message',
      intro: h('p', { class: 'hint' }, rk ? null : `Published through the default exchange with routing key "${fixedKey}", so it goes to this queue.`),
      rows: [
        rk ? ['Routing key', rk] : null,
        ['Delivery mode', mode],
        ['Properties (JSON)', props, jsonHelpers(props, [['content_type', 'text/plain'], ['headers', { key: 'value' }], ['message_id', 'id-1'], ['expiration', '60000'], ['priority', 1]])],
        ['Payload encoding', encoding],
        ['Payload', payload],
      ],
      action: async () => {
        const properties = parseObject(props.value, 'Properties');
        if (properties.delivery_mode == null) properties.delivery_mode = Number(mode.value);
        const body = {
          properties,
          routing_key: rk ? rk.value : fixedKey,
          payload: payload.value,
          payload_encoding: encoding.value,
        };
        const r = await api('POST', path, body);
        if (r && r.routed === false) return { text: 'Message published, but not routed.', kind: 'warn' };
        return 'Message published.';
      },
    });
  }

  // ---- Queues -------------------------------------------------------------------------------
  function queuesView() {
    const vh = vhostSelect('add-queue-vhost');
    const type = select('add-queue-type', QUEUE_TYPES, 'classic');
    const name = input('add-queue-name', { required: true });
    const durable = select('add-queue-durable', DURABILITY, 'true');
    const autoDelete = select('add-queue-auto-delete', NO_YES, 'false');
    const args = textarea('add-queue-arguments', { rows: 2, placeholder: '{"x-message-ttl": 60000}' });
    const form = actionForm({
      id: 'add-queue',
      label: 'Add queue',
      reset: [name],
      rows: [
        ['Virtual host', vh], ['Type', type], ['Name', name], ['Durability', durable], ['Auto delete', autoDelete],
        ['Arguments (JSON)', args, jsonHelpers(args, [
          ['x-message-ttl', 60000], ['x-expires', 1800000], ['x-max-length', 1000], ['x-max-length-bytes', 1048576],
          ['x-overflow', 'reject-publish'], ['x-dead-letter-exchange', 'dlx'], ['x-dead-letter-routing-key', 'dead'],
          ['x-max-priority', 10], ['x-single-active-consumer', true], ['x-delivery-limit', 20]])],
      ],
      action: async () => {
        const n = required(name, 'Name');
        const a = parseObject(args.value, 'Arguments');
        if (type.value !== 'classic' && a['x-queue-type'] == null) a['x-queue-type'] = type.value;
        await api('PUT', P('queues', vh.value, n), { durable: durable.value === 'true', auto_delete: autoDelete.value === 'true', arguments: a });
        return `Queue "${n}" declared in vhost "${vh.value}".`;
      },
    });

    return listView({
      tab: 'queues',
      title: 'Queues',
      table: {
        rowAttrs: (q) => ({ 'data-queue': q.name, 'data-vhost': q.vhost }),
        columns: [
          ...grouped('Overview', [
            { key: 'vhost', label: 'Virtual host' },
            { key: 'name', label: 'Name', cell: (q) => link(queueHref(q.vhost, q.name), q.name, { class: 'name-link' }) },
            { key: 'type', label: 'Type' },
            { key: 'features', label: 'Features', cell: (q) => features(q, 'queue'), sortable: false },
            { key: 'state', label: 'State', cell: (q) => stateBadge(q.state) },
          ]),
          ...grouped('Messages', [
            numCol('messages_ready', 'Ready'),
            numCol('messages_unacknowledged', 'Unacked'),
            numCol('messages', 'Total'),
            numCol('consumers', 'Consumers'),
            numCol('oldest_ready_message_age_ms', 'Oldest ready', { fmt: fmtDuration, title: 'Age of the oldest ready message' }),
          ]),
          ...grouped('Message rates', [
            rateCol('publish', 'Incoming'),
            rateCol('deliver', 'Deliver / get', 'deliver_get'),
            rateCol('ack', 'Ack'),
          ]),
        ],
      },
      sections: section('Add a new queue', form, { key: 'add-queue' }),
      refresh: () => syncVhostSelect(vh),
    });
  }

  function queueView(vhost, name) {
    const err = viewError();
    const details = h('dl', { class: 'details', id: 'queue-details' });
    const counts = statRow(messageCountDefs('queue').concat([
      ['queue-consumers', 'Consumers', countOf('consumers')],
      ['queue-message-bytes', 'Message bytes', (q) => fmtBytes(q.message_bytes)],
      ['queue-oldest-ready-age', 'Oldest ready', (q) => fmtDuration(q.oldest_ready_message_age_ms)],
    ]));
    const rates = rateStats('queue', [['publish', 'Incoming'], ['deliver', 'Deliver / get', 'deliver_get'], ['ack', 'Ack'], ['redeliver', 'Redelivered']]);
    // The work-queue contract's figures (docs/http-queue-api.md): held back, claimed, how old
    // the oldest claim is, the attempt 99% of acks succeeded within, retries, duplicates.
    const lease = (key) => (q) => (q.leases || {})[key];
    const work = statRow([
      ['queue-scheduled', 'Scheduled', countOf('messages_scheduled')],
      ['queue-leased', 'Claimed', (q) => fmtNum(lease('leased')(q))],
      ['queue-oldest-lease-age', 'Oldest claim', (q) => fmtDuration(lease('oldest_lease_age_ms')(q))],
      ['queue-attempts-p99', 'Attempts p99', (q) => { const v = lease('acked_attempts_p99')(q); return v == null ? DASH : String(v); }],
      ['queue-retries-delayed', 'Delayed retries', (q) => fmtNum(lease('retries_delayed')(q))],
      ['queue-quarantined', 'Quarantined', (q) => fmtNum(lease('quarantined')(q))],
      ['queue-deduplicated', 'Duplicates dropped', (q) => fmtNum(lease('deduplicated')(q))],
    ]);

    const consumers = table({
      id: 'queue-consumers-table',
      empty: 'No consumers.',
      rowAttrs: (c) => ({ 'data-consumer-tag': c.consumer_tag }),
      columns: [
        { key: 'channel', label: 'Channel', get: (c) => (c.channel_details || {}).name },
        { key: 'consumer_tag', label: 'Consumer tag' },
        { key: 'ack_required', label: 'Ack required', fmt: fmtBool },
        { key: 'exclusive', label: 'Exclusive', fmt: fmtBool },
        numCol('prefetch_count', 'Prefetch'),
        { key: 'active', label: 'Active', fmt: fmtBool },
        { key: 'arguments', label: 'Arguments', cell: (c) => kvList(c.arguments), sortable: false },
      ],
    });

    const bindings = bindingsTable({
      id: 'queue-bindings-table',
      empty: 'No bindings.',
      rowAttrs: (b) => ({ 'data-source': b.source, 'data-routing-key': b.routing_key }),
    }, { key: 'source', label: 'From', cell: (b) => (b.source === '' ? h('span', { class: 'muted' }, '(Default exchange binding)') : link(exchangeHref(b.vhost, b.source), b.source)) });

    // Add binding to this queue.
    const bind = bindForm({
      id: 'bind-exchange',
      label: 'From exchange',
      missing: 'Exchange name is required.',
      path: (x) => P('bindings', vhost, 'e', x, 'q', name),
      done: (x) => `Bound from exchange "${x}".`,
    });

    // Get messages.
    const ackmode = select('get-ackmode', [
      ['ack_requeue_true', 'Nack message requeue true'],
      ['ack_requeue_false', 'Automatic ack'],
      ['reject_requeue_true', 'Reject requeue true'],
      ['reject_requeue_false', 'Reject requeue false'],
    ], 'ack_requeue_true');
    const getEncoding = select('get-encoding', [['auto', 'Auto string / base64'], ['base64', 'base64']], 'auto');
    const getCount = input('get-count', { type: 'number', min: 1, value: '1', class: 'narrow' });
    const truncate = input('get-truncate', { type: 'number', min: 1, value: '50000', class: 'narrow' });
    const getResult = h('div', { id: 'get-result', 'data-testid': 'get-result', class: 'messages' });
    const getForm = actionForm({
      id: 'get',
      label: 'Get message(s)',
      resultId: 'get-status',
      intro: h('p', { class: 'hint' }, 'Getting messages is a destructive action: with "Automatic ack" they leave the queue; the other modes put them back (marked redelivered) or drop them.'),
      rows: [['Ack mode', ackmode], ['Encoding', getEncoding], ['Messages', getCount], ['Truncate (bytes)', truncate]],
      extra: getResult,
      action: async () => {
        const count = Math.max(1, parseInt(getCount.value, 10) || 1);
        const body = { count, ackmode: ackmode.value, encoding: getEncoding.value };
        const t = parseInt(truncate.value, 10);
        if (t > 0) body.truncate = t;
        const msgs = await api('POST', P('queues', vhost, name, 'get'), body);
        showMessages(getResult, msgs || []);
        return (msgs || []).length ? `${msgs.length} message${msgs.length === 1 ? '' : 's'} fetched.` : 'Queue is empty.';
      },
    });

    const pub = publishForm(P('exchanges', vhost, 'amq.default', 'publish'), name);

    // Browse (GET /v1/queues/{vhost}/{queue}/messages): read without claiming anything.
    const browseState = select('browse-state', [['ready', 'Ready'], ['scheduled', 'Scheduled'], ['unacked', 'Claimed and unacked']], 'ready');
    const browseFrom = input('browse-from', { type: 'number', min: 0, value: '0', class: 'narrow' });
    const browseLimit = input('browse-limit', { type: 'number', min: 1, max: 1000, value: '20', class: 'narrow' });
    const browsed = table({
      id: 'browse-table',
      empty: 'No messages.',
      rowAttrs: (m) => ({ 'data-position': m.position }),
      columns: [
        numCol('position', 'Position'),
        { key: 'state', label: 'State' },
        { key: 'payload', label: 'Payload', get: (m) => (m.payload_encoding === 'string' ? String(m.payload).slice(0, 200) : `(${m.payload_bytes} bytes, base64)`) },
        { key: 'routing_key', label: 'Routing key' },
        numCol('delivery_count', 'Deliveries'),
        { key: 'enqueued_at', label: 'Enqueued', fmt: fmtTime },
        { key: 'ready_at', label: 'Ready at', fmt: (v) => (v == null ? DASH : fmtTime(v)) },
        { key: 'worker', label: 'Claimed by', fmt: (v) => v || DASH },
        { key: 'lease_expires_at', label: 'Lease until', fmt: (v) => (v == null ? DASH : fmtTime(v)) },
      ],
    });
    const browseForm = actionForm({
      id: 'browse',
      label: 'Browse',
      resultId: 'browse-status',
      intro: h('p', { class: 'hint' }, 'Reads messages without claiming or removing them, in the order the queue hands them out (scheduled ones by due time).'),
      rows: [['State', browseState], ['From position', browseFrom], ['Messages', browseLimit]],
      extra: browsed.el,
      action: async () => {
        const q = `state=${browseState.value}&from=${Math.max(0, parseInt(browseFrom.value, 10) || 0)}&limit=${Math.max(1, parseInt(browseLimit.value, 10) || 20)}`;
        const r = await api('GET', '/v1/queues/' + enc(vhost) + '/' + enc(name) + '/messages?' + q);
        const msgs = (r && r.messages) || [];
        browsed.update(msgs);
        return `${msgs.length} message${msgs.length === 1 ? '' : 's'}` + (r && r.next_from != null ? `; more from position ${r.next_from}.` : '.');
      },
    });

    // Move messages out (a redrive, /v1/queues/{vhost}/{queue}/redrive): back to where each
    // died (x-death) or into a named queue, at a rate, up to a count, those the filter picks.
    const redriveTo = input('redrive-to', { placeholder: 'blank: each message\'s x-death origin' });
    const redriveMax = input('redrive-max', { type: 'number', min: 1, class: 'narrow', placeholder: 'all' });
    const redriveRate = input('redrive-rate', { type: 'number', min: 1, value: '500', class: 'narrow' });
    const redriveOrigin = input('redrive-origin', { placeholder: 'any' });
    const redriveReason = select('redrive-reason', [['', 'any'], ['rejected', 'rejected'], ['expired', 'expired'], ['maxlen', 'maxlen'], ['delivery_limit', 'delivery_limit']], '');
    const redriveProgress = h('div', { id: 'redrive-progress', 'data-testid': 'redrive-progress', class: 'hint' });
    const redriveForm = actionForm({
      id: 'redrive',
      label: 'Move messages',
      resultId: 'redrive-status',
      intro: h('p', { class: 'hint' }, 'Moves ready messages out of this queue (typically a dead-letter queue), each exactly once even if the broker stops mid-way (run it again to finish).'),
      rows: [['Destination queue', redriveTo], ['Messages (most)', redriveMax], ['Rate (msg/s)', redriveRate], ['Only from queue', redriveOrigin], ['Only reason', redriveReason]],
      extra: redriveProgress,
      action: async () => {
        const body = { rate: parseInt(redriveRate.value, 10) || 500, filter: {} };
        if (redriveTo.value) body.destination = redriveTo.value;
        if (parseInt(redriveMax.value, 10) > 0) body.max_messages = parseInt(redriveMax.value, 10);
        if (redriveOrigin.value) body.filter.origin = redriveOrigin.value;
        if (redriveReason.value) body.filter.reason = redriveReason.value;
        let task = await api('POST', '/v1/queues/' + enc(vhost) + '/' + enc(name) + '/redrive', body);
        const show = (t) => {
          redriveProgress.textContent = `Redrive ${t.id}: ${t.status}, moved ${t.moved}, duplicates ${t.duplicates}, skipped ${t.skipped}, refused ${t.refused}` + (t.error ? ` (${t.error})` : '');
        };
        show(task);
        while (task.status === 'RUNNING') {
          await new Promise((r) => setTimeout(r, 300));
          task = await api('GET', '/v1/redrives/' + task.id);
          show(task);
          refreshNow();
        }
        return `Redrive ${task.id} ${task.status.toLowerCase()}: ${task.moved} moved.`;
      },
    });

    const actionsOut = result('queue-action-result');
    const purgeBtn = actionButton('Purge messages', { class: 'btn btn-warn', id: 'queue-purge', 'data-testid': 'queue-purge' },
      `Purge all ready messages from queue "${name}"?`, actionsOut, async () => {
        await api('DELETE', P('queues', vhost, name, 'contents'));
        refreshNow();
        return 'Queue purged.';
      });
    const ifUnused = h('input', { type: 'checkbox', id: 'delete-if-unused' });
    const ifEmpty = h('input', { type: 'checkbox', id: 'delete-if-empty' });
    const deleteBtn = actionButton('Delete queue', { class: 'btn btn-danger', id: 'queue-delete', 'data-testid': 'queue-delete' },
      `Delete queue "${name}" in vhost "${vhost}"? Its messages are lost.`, actionsOut, async () => {
        const q = [];
        if (ifUnused.checked) q.push('if-unused=true');
        if (ifEmpty.checked) q.push('if-empty=true');
        await api('DELETE', P('queues', vhost, name) + (q.length ? '?' + q.join('&') : ''));
        flash(`Queue "${name}" deleted.`);
        location.hash = '#/queues';
        return 'Queue deleted.';
      });

    const el = h('div', { class: 'view' },
      h('div', { class: 'crumbs' }, link('#/queues', 'Queues'), ' › virtual host ', h('span', { class: 'mono' }, vhost)),
      h('h1', null, 'Queue: ', h('span', { class: 'entity-name', id: 'queue-name', 'data-testid': 'queue-name' }, name)),
      err,
      section('Overview', [
        h('div', { class: 'overview-grid' },
          h('div', null, h('h3', null, 'Details'), details),
          h('div', null, h('h3', null, 'Messages'), counts.el, h('h3', null, 'Work queue'), work.el, h('h3', null, 'Message rates'), rates.el)),
      ], { key: 'q-overview' }),
      section('Consumers', consumers.el, { key: 'q-consumers' }),
      section('Bindings', [bindings.el, h('h3', null, 'Add binding to this queue'), bind.el], { key: 'q-bindings' }),
      section('Publish message', pub, { key: 'q-publish' }),
      section('Get messages', getForm, { key: 'q-get' }),
      section('Browse messages', browseForm, { key: 'q-browse' }),
      section('Move messages', redriveForm, { key: 'q-redrive' }),
      section('Purge and delete', [
        h('div', { class: 'danger-zone' },
          h('div', null, purgeBtn, h('span', { class: 'hint' }, ' Removes all ready messages.')),
          h('div', null, deleteBtn, ' ', h('label', { class: 'check' }, ifUnused, ' only if unused'), ' ', h('label', { class: 'check' }, ifEmpty, ' only if empty'))),
        actionsOut,
      ], { key: 'q-danger' }),
    );

    let gone = false;
    async function refresh() {
      let q;
      try {
        q = await api('GET', P('queues', vhost, name));
      } catch (e) {
        if (e.status === 404) {
          gone = true;
          throw new ApiError(404, null, `Queue "${name}" does not exist in vhost "${vhost}" (it may have been deleted).`);
        }
        throw e;
      }
      gone = false;
      const args = Object.assign({}, q.arguments || {});
      fillDetails(details, [
        ['Virtual host', q.vhost], ['Type', q.type], ['Features', features(q, 'queue')], ['State', stateBadge(q.state)],
        ['Durable', fmtBool(q.durable)], ['Auto delete', fmtBool(q.auto_delete)], ['Exclusive', fmtBool(q.exclusive)],
        ['Arguments', kvList(args)], ['Policy', q.policy || DASH],
        ['Effective policy definition', q.effective_policy_definition ? kvList(q.effective_policy_definition) : DASH],
        ['Node', q.node],
      ]);
      counts.update(q);
      work.update(q);
      rates.update(q);
      const [bs, cs, xs] = await Promise.all([
        api('GET', P('queues', vhost, name, 'bindings')),
        api('GET', P('consumers', vhost)).catch(() => null),
        api('GET', P('exchanges', vhost)).catch(() => []),
      ]);
      bindings.update(bs || []);
      if (cs) consumers.update(cs.filter((c) => c.queue && c.queue.name === name && c.queue.vhost === vhost));
      fillSelect(bind.list, (xs || []).map((x) => x.name).filter(Boolean));
    }
    return { tab: 'queues', title: 'Queue ' + name, el, refresh, isGone: () => gone };
  }

  function showMessages(container, msgs) {
    clear(container);
    msgs.forEach((m, i) => {
      const props = Object.assign({}, m.properties || {});
      const headers = props.headers;
      delete props.headers;
      container.appendChild(h('div', { class: 'message', 'data-testid': 'message' },
        h('div', { class: 'message-title' }, `Message ${i + 1}`),
        h('dl', { class: 'details message-meta' },
          detail('Exchange', exchangeLabel(m.exchange || '')),
          detail('Routing key', m.routing_key),
          detail('Redelivered', h('span', { class: 'message-redelivered' }, fmtBool(m.redelivered))),
          detail('Messages remaining', h('span', { class: 'message-remaining' }, fmtNum(m.message_count))),
          detail('Properties', h('span', { class: 'message-properties', 'data-testid': 'message-properties' }, kvList(props))),
          detail('Headers', kvList(headers)),
          detail('Payload', h('span', { class: 'muted' }, `${fmtNum(m.payload_bytes)} bytes, encoding: ${m.payload_encoding}`))),
        h('pre', { class: 'payload message-payload', 'data-testid': 'message-payload' }, m.payload == null ? '' : String(m.payload))));
    });
  }

  function detail(k, v) {
    return h('div', { class: 'detail' }, h('dt', null, k), h('dd', null, v == null || v === '' ? DASH : v));
  }

  // ---- Admin --------------------------------------------------------------------------------
  const ADMIN_SECTIONS = [
    ['users', 'Users'], ['vhosts', 'Virtual hosts'], ['permissions', 'Permissions'], ['policies', 'Policies'],
  ];

  function adminView(sub) {
    const current = ADMIN_SECTIONS.some(([k]) => k === sub) ? sub : 'users';
    const inner = { users: usersPanel, vhosts: vhostsPanel, permissions: permissionsPanel, policies: policiesPanel }[current]();
    const nav = h('nav', { class: 'subtabs' }, ADMIN_SECTIONS.map(([k, label]) =>
      h('a', { href: '#/admin/' + k, class: k === current ? 'active' : '', id: 'admin-' + k }, label)));
    const err = viewError();
    const el = h('div', { class: 'view admin' }, h('h1', null, 'Admin'), nav, err, inner.el);
    return { tab: 'admin', title: 'Admin', el, refresh: inner.refresh };
  }

  function usersPanel() {
    let perms = [];
    const tbl = table({
      id: 'users-table',
      sort: ['name'],
      rowAttrs: (u) => ({ 'data-user': u.name }),
      columns: [
        { key: 'name', label: 'Name' },
        { key: 'tags', label: 'Tags', get: (u) => tagsOf(u.tags).join(', '), cell: (u) => tagsOf(u.tags).map((t) => h('span', { class: 'tag' }, t)) },
        { key: 'vhosts', label: 'Can access virtual hosts', get: (u) => perms.filter((p) => p.user === u.name).map((p) => p.vhost).sort().join(', ') || 'No access' },
        { key: 'password', label: 'Has password', get: (u) => (u.password_hash ? '●' : '○') },
        actionCol((u) => deleteButton('Delete', 'delete-user', `Delete user "${u.name}"?`, P('users', u.name), `User "${u.name}" deleted.`)),
      ],
    });
    const uname = input('add-user-name', { required: true });
    const pw = input('add-user-password', { type: 'password', autocomplete: 'new-password' });
    const tags = input('add-user-tags', { placeholder: 'administrator' });
    const tagLinks = helperLinks('Set: ', ['administrator', 'monitoring', 'policymaker', 'management', 'impersonator', 'none'], (t) => {
      if (t === 'none') { tags.value = ''; return; }
      const cur = tagsOf(tags.value);
      if (!cur.includes(t)) cur.push(t);
      tags.value = cur.join(', ');
    });
    const form = actionForm({
      id: 'add-user',
      label: 'Add / update user',
      reset: [uname, pw],
      rows: [['Username', uname], ['Password', pw, 'Leave empty for a user without password.'], ['Tags', tags, tagLinks]],
      action: async () => {
        const n = required(uname, 'Username');
        const body = { tags: tagsOf(tags.value).join(',') };
        if (pw.value) body.password = pw.value;
        else body.password_hash = '';
        await api('PUT', P('users', n), body);
        return `User "${n}" saved.` + (body.password == null ? ' It has no password (it cannot log in with one).' : '');
      },
    });
    const el = h('div', null, section('All users', tbl.el, { key: 'users' }), section('Add a user', form, { key: 'add-user' }));
    async function refresh() {
      const [users, p] = await Promise.all([api('GET', '/api/users'), api('GET', '/api/permissions').catch(() => [])]);
      perms = p || [];
      tbl.update(users || [], perms);
    }
    return { el, refresh };
  }

  function vhostsPanel() {
    const tbl = table({
      id: 'vhosts-table',
      sort: ['name'],
      rowAttrs: (v) => ({ 'data-vhost': v.name }),
      columns: [
        { key: 'name', label: 'Name' },
        { key: 'description', label: 'Description', get: (v) => v.description || (v.metadata || {}).description || '' },
        { key: 'tags', label: 'Tags', get: (v) => tagsOf(v.tags || (v.metadata || {}).tags).join(', ') },
        { key: 'default_queue_type', label: 'Default queue type' },
        numCol('messages_ready', 'Ready'),
        numCol('messages_unacknowledged', 'Unacked'),
        numCol('messages', 'Total'),
        actionCol((v) => deleteButton('Delete', 'delete-vhost', `Delete virtual host "${v.name}" and everything in it?`, P('vhosts', v.name), `Virtual host "${v.name}" deleted.`)),
      ],
    });
    const name = input('add-vhost-name', { required: true });
    const desc = input('add-vhost-description');
    const tags = input('add-vhost-tags');
    const dqt = select('add-vhost-default-queue-type', [['', '(broker default)'], ['classic', 'classic'], ['quorum', 'quorum']], '');
    const form = actionForm({
      id: 'add-vhost',
      label: 'Add virtual host',
      reset: [name],
      rows: [['Name', name], ['Description', desc], ['Tags', tags], ['Default queue type', dqt]],
      action: async () => {
        const n = required(name, 'Name');
        const body = {};
        if (desc.value) body.description = desc.value;
        if (tags.value) body.tags = tagsOf(tags.value).join(',');
        if (dqt.value) body.default_queue_type = dqt.value;
        await api('PUT', P('vhosts', n), body);
        return `Virtual host "${n}" added.`;
      },
    });
    const el = h('div', null, section('All virtual hosts', tbl.el, { key: 'vhosts' }), section('Add a virtual host', form, { key: 'add-vhost' }));
    async function refresh() {
      tbl.update(await api('GET', '/api/vhosts') || []);
    }
    return { el, refresh };
  }

  function permissionsPanel() {
    const tbl = table({
      id: 'permissions-table',
      sort: ['user'],
      rowAttrs: (p) => ({ 'data-user': p.user, 'data-vhost': p.vhost }),
      columns: [
        { key: 'user', label: 'User' },
        { key: 'vhost', label: 'Virtual host' },
        { key: 'configure', label: 'Configure regexp', cls: 'mono' },
        { key: 'write', label: 'Write regexp', cls: 'mono' },
        { key: 'read', label: 'Read regexp', cls: 'mono' },
        actionCol((p) => deleteButton('Clear', 'clear-permission', `Clear permissions of "${p.user}" on "${p.vhost}"?`, P('permissions', p.vhost, p.user), 'Permissions cleared.')),
      ],
    });
    const user = select('perm-user', []);
    const vh = vhostSelect('perm-vhost');
    const conf = input('perm-configure', { value: '.*', class: 'mono' });
    const write = input('perm-write', { value: '.*', class: 'mono' });
    const read = input('perm-read', { value: '.*', class: 'mono' });
    const form = actionForm({
      id: 'perm',
      label: 'Set permission',
      rows: [['User', user], ['Virtual host', vh], ['Configure regexp', conf], ['Write regexp', write], ['Read regexp', read]],
      action: async () => {
        if (!user.value) throw new Error('Choose a user.');
        await api('PUT', P('permissions', vh.value, user.value), { configure: conf.value, write: write.value, read: read.value });
        return `Permissions of "${user.value}" on "${vh.value}" set.`;
      },
    });
    const el = h('div', null, section('All permissions', tbl.el, { key: 'permissions' }), section('Set permission', form, { key: 'set-permission' }));
    async function refresh() {
      const [p, users] = await Promise.all([api('GET', '/api/permissions'), api('GET', '/api/users').catch(() => [])]);
      tbl.update(p || []);
      fillSelect(user, (users || []).map((u) => u.name));
      syncVhostSelect(vh);
    }
    return { el, refresh };
  }

  function policyColumns(kind, del) {
    return [
      { key: 'vhost', label: 'Virtual host' },
      { key: 'name', label: 'Name' },
      { key: 'pattern', label: 'Pattern', cls: 'mono' },
      { key: 'apply-to', label: 'Apply to' },
      { key: 'definition', label: 'Definition', cell: (p) => kvList(p.definition), sortable: false },
      { key: 'priority', label: 'Priority', num: true },
      del ? actionCol((p) => deleteButton('Delete', 'delete-policy', `Delete ${kind} "${p.name}" in "${p.vhost}"?`, P('policies', p.vhost, p.name), `Policy "${p.name}" deleted.`)) : null,
    ].filter(Boolean);
  }

  function policiesPanel() {
    const tbl = table({ id: 'policies-table', sort: ['name'], rowAttrs: (p) => ({ 'data-policy': p.name, 'data-vhost': p.vhost }), columns: policyColumns('policy', true), empty: 'No policies.' });
    const opTbl = table({ id: 'operator-policies-table', sort: ['name'], columns: policyColumns('operator policy', false), empty: 'No operator policies.' });
    const opNote = h('p', { class: 'muted', id: 'operator-policies-note' });
    const vh = vhostSelect('policy-vhost');
    const name = input('policy-name', { required: true });
    const pattern = input('policy-pattern', { placeholder: '^amq\\.', class: 'mono', required: true });
    const applyTo = select('policy-apply-to', [['all', 'Exchanges and queues'], ['queues', 'Queues'], ['classic_queues', 'Classic queues'], ['quorum_queues', 'Quorum queues'], ['exchanges', 'Exchanges']], 'queues');
    const priority = input('policy-priority', { type: 'number', value: '0', class: 'narrow' });
    const def = textarea('policy-definition', { rows: 3, placeholder: '{"max-length": 1000}' });
    const form = actionForm({
      id: 'policy',
      label: 'Add / update policy',
      reset: [name],
      rows: [
        ['Virtual host', vh], ['Name', name], ['Pattern', pattern, 'Regular expression matched against queue / exchange names.'], ['Apply to', applyTo], ['Priority', priority],
        ['Definition (JSON)', def, jsonHelpers(def, [
          ['max-length', 1000], ['max-length-bytes', 1048576], ['overflow', 'reject-publish'], ['message-ttl', 60000], ['expires', 1800000],
          ['dead-letter-exchange', 'dlx'], ['dead-letter-routing-key', 'dead'], ['delivery-limit', 20], ['alternate-exchange', 'my-ae']])],
      ],
      action: async () => {
        const n = required(name, 'Name');
        if (!pattern.value) throw new Error('Pattern is required.');
        const definition = parseObject(def.value, 'Definition');
        if (Object.keys(definition).length === 0) throw new Error('Definition must not be empty.');
        await api('PUT', P('policies', vh.value, n), { pattern: pattern.value, definition, priority: parseInt(priority.value, 10) || 0, 'apply-to': applyTo.value });
        return `Policy "${n}" saved.`;
      },
    });
    const el = h('div', null,
      section('User policies', tbl.el, { key: 'policies' }),
      section('Add / update a policy', form, { key: 'add-policy' }),
      section('Operator policies', [opNote, opTbl.el], { key: 'operator-policies' }));
    async function refresh() {
      const v = state.vhostFilter;
      const [p, op] = await Promise.all([
        api('GET', apiPath('policies', v)),
        state.operatorPolicies === false ? Promise.resolve(null) : api('GET', apiPath('operator-policies', v)).catch((e) => e),
      ]);
      tbl.update(p || []);
      if (op instanceof Error && (op.status === 404 || op.status === 405)) state.operatorPolicies = false;
      if (state.operatorPolicies === false) {
        opTbl.el.hidden = true;
        setText(opNote, 'This broker does not expose operator policies (GET /api/operator-policies: not found).');
      } else if (op instanceof Error) {
        setText(opNote, 'Could not load operator policies: ' + op.message);
      } else if (op) {
        state.operatorPolicies = true;
        opTbl.el.hidden = false;
        setText(opNote, 'Operator policies are read-only here.');
        opTbl.update(op);
      }
      syncVhostSelect(vh);
    }
    return { el, refresh };
  }

  // ---- Definitions --------------------------------------------------------------------------
  function definitionsView() {
    const err = viewError();
    const exportVhost = select('definitions-export-vhost', [['', 'All virtual hosts']], '');
    const dlOut = result('definitions-download-result');
    const dl = actionButton('Download broker definitions', { class: 'btn btn-primary', id: 'definitions-download', 'data-testid': 'definitions-download' }, null, dlOut, async () => {
      const v = exportVhost.value;
      const data = await api('GET', apiPath('definitions', v));
      const text = JSON.stringify(data, null, 2);
      const blob = new Blob([text], { type: 'application/json' });
      const url = URL.createObjectURL(blob);
      const node = (state.overview && state.overview.node) || 'warren';
      const d = new Date();
      const stamp = `${d.getFullYear()}-${String(d.getMonth() + 1).padStart(2, '0')}-${String(d.getDate()).padStart(2, '0')}`;
      const fname = `${node.replace(/[^A-Za-z0-9_.@-]+/g, '_')}${v ? '_' + v.replace(/[^A-Za-z0-9_.-]+/g, '_') : ''}_${stamp}.json`;
      const a = h('a', { href: url, download: fname, hidden: true });
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
      return `Downloaded ${fname} (${summarize(data)}).`;
    });

    const importVhost = select('definitions-import-vhost', [['', 'All virtual hosts']], '');
    const file = h('input', { type: 'file', id: 'definitions-file', 'data-testid': 'definitions-file', accept: '.json,application/json' });
    const preview = h('div', { class: 'hint', id: 'definitions-preview' });
    let parsed = null;
    file.addEventListener('change', async () => {
      parsed = null;
      setText(preview, '');
      const f = file.files && file.files[0];
      if (!f) return;
      try {
        parsed = JSON.parse(await f.text());
        if (!parsed || typeof parsed !== 'object' || Array.isArray(parsed)) throw new Error('not a JSON object');
        setText(preview, `${f.name}: ${summarize(parsed)}`);
      } catch (e) {
        parsed = null;
        setText(preview, `${f.name}: not a definitions file (${e.message})`);
      }
    });
    const form = actionForm({
      id: 'definitions-upload',
      submitId: 'definitions-upload',
      resultId: 'definitions-result',
      label: 'Upload broker definitions',
      rows: [['Definitions file', file, preview], ['Import into', importVhost]],
      action: async () => {
        const f = file.files && file.files[0];
        if (!f) throw new Error('Choose a definitions file first.');
        let body = parsed;
        if (!body) {
          try { body = JSON.parse(await f.text()); } catch (e2) { throw new Error('The file is not valid JSON: ' + e2.message); }
        }
        const r = await api('POST', apiPath('definitions', importVhost.value), body, { withStatus: true });
        return `Definitions imported from ${f.name} (HTTP ${r.status}): ${summarize(body)}.`;
      },
    });

    const el = h('div', { class: 'view' }, h('h1', null, 'Definitions'), err,
      section('Export definitions', [
        h('p', { class: 'hint' }, 'Users, virtual hosts, permissions, policies, queues, exchanges and bindings, as JSON (the format of rabbitmqctl export_definitions / RabbitMQ\'s management UI).'),
        formGrid([['Virtual host', exportVhost]]),
        h('div', { class: 'form-actions' }, dl, dlOut)], { key: 'def-export' }),
      section('Import definitions', [
        h('p', { class: 'hint' }, 'Objects in the file are created or updated; nothing is deleted.'),
        form], { key: 'def-import' }));

    async function refresh() {
      const opts = [['', 'All virtual hosts']].concat(state.vhosts.map((v) => [v, v]));
      fillSelect(exportVhost, opts, '');
      fillSelect(importVhost, opts, '');
    }
    return { tab: 'definitions', title: 'Definitions', el, refresh };
  }

  function summarize(d) {
    if (!d || typeof d !== 'object') return 'empty';
    const keys = ['users', 'vhosts', 'permissions', 'policies', 'queues', 'exchanges', 'bindings'];
    const parts = keys.filter((k) => Array.isArray(d[k])).map((k) => `${d[k].length} ${k}`);
    return parts.join(', ') || 'no known sections';
  }

  // ------------------------------------------------------------------------------------------
  // Routing, refresh loop, header
  // ------------------------------------------------------------------------------------------
  function parseHash() {
    const raw = location.hash.replace(/^#\/?/, '');
    return raw.split('/').filter((x, i, a) => x !== '' || i < a.length - 1).map((x) => {
      try { return decodeURIComponent(x); } catch (_) { return x; }
    });
  }

  function viewFor(segs) {
    const [top, a, b] = segs;
    switch (top) {
      case undefined: case '': case 'overview': return overviewView();
      case 'connections': return connectionsView();
      case 'channels': return channelsView();
      case 'exchanges': return a != null && b != null ? exchangeView(a, b) : exchangesView();
      case 'queues': return a != null && b != null ? queueView(a, b) : queuesView();
      case 'admin': return adminView(a);
      case 'definitions': return definitionsView();
      default: return null;
    }
  }

  function route() {
    if (!state.auth) return;
    const segs = parseHash();
    let view = viewFor(segs);
    if (!view) {
      view = { tab: '', title: 'Not found', el: h('div', { class: 'view' }, h('h1', null, 'Not found'), h('p', null, 'No such page. ', link('#/', 'Go to the overview.'))), refresh: async () => {} };
    }
    state.view = view;
    const main = $('#main');
    clear(main).appendChild(view.el);
    document.title = `${view.title} · Warren`;
    for (const a of document.querySelectorAll('#tabs a')) a.classList.toggle('active', a.dataset.tab === view.tab);
    refreshNow();
  }

  let running = null;
  let queued = false;

  /** Refresh the current view now (coalesced: at most one refresh runs, one more may queue). */
  function refreshNow() {
    if (running) { queued = true; return running; }
    running = (async () => {
      do {
        queued = false;
        await doRefresh();
      } while (queued);
    })().finally(() => {
      running = null;
      schedule();
    });
    return running;
  }

  async function doRefresh() {
    const view = state.view;
    if (!view || !state.auth) return;
    const errBox = view.el.querySelector('.view-error');
    try {
      await loadVhosts();
      await view.refresh();
      if (errBox) errBox.hidden = true;
      const d = new Date();
      setText($('#last-updated'), 'Updated ' + d.toLocaleTimeString('en-GB'));
    } catch (e) {
      if (e.expired || !state.auth) return;
      if (errBox && state.view === view) {
        errBox.textContent = e.message;
        errBox.hidden = false;
      }
    }
  }

  async function loadVhosts() {
    try {
      const vs = await api('GET', '/api/vhosts');
      state.vhosts = (vs || []).map((v) => v.name).sort();
    } catch (e) {
      if (e.expired) throw e;
      // Not fatal: some users may not list vhosts.
    }
    const sel = $('#vhost-filter');
    fillSelect(sel, [['', 'All']].concat(state.vhosts.map((v) => [v, v])), '');
    if (state.vhostFilter && !state.vhosts.includes(state.vhostFilter) && state.vhosts.length) {
      state.vhostFilter = '';
      sessionStorage.removeItem(VHOST_KEY);
    }
    sel.value = state.vhostFilter || '';
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = null;
    if (!state.auth) return;
    const ms = Number($('#refresh-interval').value);
    if (ms > 0) state.timer = setTimeout(() => refreshNow(), ms);
  }

  function updateHeader(o) {
    setText($('#hdr-node'), o.node);
    setText($('#hdr-cluster'), o.cluster_name);
    setText($('#hdr-version'), productLine(o));
    setText($('#footer-product'), o.product_name ? `${o.product_name} ${o.product_version || ''}`.trim() : 'Warren');
    if (Array.isArray(o.exchange_types) && o.exchange_types.length) {
      state.exchangeTypes = o.exchange_types.filter((t) => t.enabled !== false).map((t) => t.name);
    }
  }

  function applyUserToTabs() {
    const tags = tagsOf(state.user && state.user.tags);
    const admin = tags.includes('administrator');
    $('#nav-admin').hidden = !(admin || tags.includes('policymaker'));
    $('#nav-definitions').hidden = !admin;
  }

  // ------------------------------------------------------------------------------------------
  // Login / logout
  // ------------------------------------------------------------------------------------------
  function showLogin(message) {
    clearTimeout(state.timer);
    state.view = null;
    $('#app-shell').hidden = true;
    $('#login-screen').hidden = false;
    const errEl = $('#login-error');
    if (message) { errEl.textContent = message; errEl.hidden = false; } else { errEl.hidden = true; }
    const u = $('#login-username');
    if (!u.value) u.value = sessionStorage.getItem(USER_KEY) || '';
    (u.value ? $('#login-password') : u).focus();
  }

  function showApp() {
    $('#login-screen').hidden = true;
    $('#app-shell').hidden = false;
    setText($('#hdr-user'), state.user.name);
    applyUserToTabs();
    api('GET', '/api/overview').then((o) => { state.overview = o; updateHeader(o); }).catch(() => {});
    route();
  }

  function sessionExpired() {
    state.auth = null;
    sessionStorage.removeItem(AUTH_KEY);
    $('#main').textContent = '';
    showLogin('Your credentials were rejected; please log in again.');
  }

  async function login(user, pass) {
    const auth = basicAuth(user, pass);
    const who = await api('GET', '/api/whoami', undefined, { auth });
    state.auth = auth;
    state.user = who;
    sessionStorage.setItem(AUTH_KEY, auth);
    sessionStorage.setItem(USER_KEY, user);
  }

  function logout() {
    state.auth = null;
    state.user = null;
    state.history = [];
    sessionStorage.removeItem(AUTH_KEY);
    clear($('#main'));
    $('#login-password').value = '';
    showLogin(null);
  }

  function init() {
    const refreshSel = $('#refresh-interval');
    const saved = localStorage.getItem(REFRESH_KEY);
    if (saved != null && Array.from(refreshSel.options).some((o) => o.value === saved)) refreshSel.value = saved;
    refreshSel.addEventListener('change', () => {
      localStorage.setItem(REFRESH_KEY, refreshSel.value);
      schedule();
    });
    $('#refresh-now').addEventListener('click', () => refreshNow());
    state.vhostFilter = sessionStorage.getItem(VHOST_KEY) || '';
    const vf = $('#vhost-filter');
    vf.addEventListener('change', () => {
      state.vhostFilter = vf.value;
      sessionStorage.setItem(VHOST_KEY, vf.value);
      route();
    });
    $('#logout').addEventListener('click', (e) => { e.preventDefault(); logout(); });
    window.addEventListener('hashchange', route);

    $('#login-form').addEventListener('submit', async (e) => {
      e.preventDefault();
      const u = $('#login-username').value;
      const p = $('#login-password').value;
      const btn = $('#login-submit');
      const errEl = $('#login-error');
      if (!u) { errEl.textContent = 'Enter a username.'; errEl.hidden = false; return; }
      btn.disabled = true;
      errEl.hidden = true;
      try {
        await login(u, p);
        $('#login-password').value = '';
        showApp();
      } catch (err) {
        if (err.status === 401) {
          const reason = err.body && err.body.reason;
          errEl.textContent = reason && !/^login failed\.?$/i.test(reason)
            ? `Login failed: ${reason}`
            : 'Login failed: wrong username or password, or this user may not log in from here.';
        } else {
          errEl.textContent = 'Login failed: ' + err.message;
        }
        errEl.hidden = false;
      } finally {
        btn.disabled = false;
      }
    });

    const stored = sessionStorage.getItem(AUTH_KEY);
    if (stored) {
      state.auth = stored;
      api('GET', '/api/whoami').then((who) => {
        state.user = who;
        showApp();
      }).catch((e) => {
        if (!e.expired) {
          state.auth = null;
          showLogin('Cannot check the stored session: ' + e.message);
        }
      });
    } else {
      showLogin(null);
    }
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', init);
  else init();
})();
