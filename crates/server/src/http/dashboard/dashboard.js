// Petrel's dashboard: polls the HTTP API (docs/http.md) once a second and updates the page in
// place. No dependencies and no inline code, so it runs under `default-src 'self'`. Data from the
// server only ever goes into textContent, never into markup.
"use strict";

(() => {
  const POLL_MS = 1000;
  const $ = (id) => document.getElementById(id);

  // ---- formatting -----------------------------------------------------------------------------

  function fmtBytes(n) {
    if (n == null) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? String(n) : n.toFixed(n < 10 ? 1 : 0)) + " " + units[i];
  }

  function fmtDuration(secs) {
    if (secs == null) return "—";
    const d = Math.floor(secs / 86400), h = Math.floor(secs / 3600) % 24;
    const m = Math.floor(secs / 60) % 60, s = Math.floor(secs) % 60;
    if (d) return `${d}d ${h}h`;
    if (h) return `${h}h ${m}m`;
    if (m) return `${m}m ${s}s`;
    return `${s}s`;
  }

  function fmtRate(r) {
    if (r == null) return "";
    return r < 10 ? r.toFixed(1) : String(Math.round(r));
  }

  // Short axis labels: 950, 1.2k, 34M.
  function fmtShort(v) {
    const abs = Math.abs(v);
    if (abs >= 1e9) return +(v / 1e9).toFixed(1) + "G";
    if (abs >= 1e6) return +(v / 1e6).toFixed(1) + "M";
    if (abs >= 1e3) return +(v / 1e3).toFixed(1) + "k";
    return String(+v.toFixed(abs < 10 ? 1 : 0));
  }

  // Counts stay plain integers (no separators) so a cell's text is the figure itself.
  function plain(v) {
    if (v == null) return "—";
    if (typeof v === "boolean") return v ? "yes" : "no";
    return String(v);
  }

  // ---- tables ---------------------------------------------------------------------------------

  // Keeps a tbody's rows in step with `items`, one row per key (on the row as data-KEYATTR),
  // changing only the cells whose text changed so that a row keeps its identity between polls.
  // `columns` are [field, cellFn, numeric]; cellFn(item) gives the text or {text, title}.
  function syncTable(table, items, keyAttr, keyFn, columns) {
    const body = table.tBodies[0];
    if (items.length === 0) {
      if (!body.querySelector("tr.none")) {
        body.replaceChildren();
        const tr = body.insertRow(), td = tr.insertCell();
        tr.className = "none";
        td.colSpan = columns.length;
        td.textContent = "none";
      }
      return;
    }
    const existing = new Map();
    for (const tr of Array.from(body.rows)) {
      if (tr.className === "none") tr.remove();
      else existing.set(tr.dataset[keyAttr], tr);
    }
    items.forEach((item, i) => {
      const key = keyFn(item);
      let tr = existing.get(key);
      if (tr) {
        existing.delete(key);
      } else {
        tr = document.createElement("tr");
        tr.dataset[keyAttr] = key;
        for (const [field, , numeric] of columns) {
          const td = tr.insertCell();
          td.dataset.field = field;
          if (numeric) td.className = "num";
        }
      }
      columns.forEach(([, cellFn], c) => {
        const value = cellFn(item);
        const text = typeof value === "object" && value !== null ? value.text : value;
        const title = typeof value === "object" && value !== null ? value.title : "";
        const td = tr.cells[c];
        if (td.textContent !== text) td.textContent = text;
        if ((td.title || "") !== (title || "")) td.title = title || "";
      });
      if (body.rows[i] !== tr) body.insertBefore(tr, body.rows[i] || null);
    });
    for (const tr of existing.values()) tr.remove();
  }

  const byName = (a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0);
  const bytesCell = (n) => ({ text: fmtBytes(n), title: n == null ? "" : n + " bytes" });

  // Queue counters from the previous poll, for the in/s and out/s columns.
  let lastQueues = new Map();
  let lastQueuesAt = 0;

  function renderQueues(data, now) {
    const queues = (data.queues || []).slice().sort(byName);
    const secs = (now - lastQueuesAt) / 1000;
    const rates = new Map();
    for (const q of queues) {
      const prev = lastQueues.get(q.name);
      // Blank on the first sample, and where a counter went back (the queue was recreated).
      if (prev && secs > 0 && q.offered >= prev.offered && q.delivered >= prev.delivered) {
        rates.set(q.name, [(q.offered - prev.offered) / secs, (q.delivered - prev.delivered) / secs]);
      }
    }
    lastQueues = new Map(queues.map((q) => [q.name, { offered: q.offered, delivered: q.delivered }]));
    lastQueuesAt = now;
    syncTable($("queues"), queues, "queue", (q) => q.name, [
      ["name", (q) => ({ text: q.name, title: q.name })],
      ["messages", (q) => plain(q.messages), true],
      ["bytes", (q) => bytesCell(q.bytes), true],
      ["open_reads", (q) => ({ text: plain(q.open_reads), title: fmtBytes(q.open_read_bytes) }), true],
      ["waiters", (q) => plain(q.waiters), true],
      ["in_per_sec", (q) => fmtRate((rates.get(q.name) || [])[0]), true],
      ["out_per_sec", (q) => fmtRate((rates.get(q.name) || [])[1]), true],
      ["expired", (q) => plain(q.expired), true],
      ["durable", (q) => plain(q.config ? q.config.durable : null)],
    ]);
  }

  function renderTopics(data) {
    const topics = (data.topics || []).slice().sort(byName);
    syncTable($("topics"), topics, "topic", (t) => t.name, [
      ["name", (t) => ({ text: t.name, title: t.name })],
      ["durable", (t) => plain(t.durable)],
      ["subscribers", (t) => plain(t.subscribers), true],
      ["published", (t) => plain(t.published), true],
      ["delivered", (t) => plain(t.delivered), true],
      ["slow_subscribers_ended", (t) => plain(t.slow_subscribers_ended), true],
    ]);
    const groups = [];
    for (const t of topics) {
      for (const g of (t.groups || []).slice().sort(byName)) groups.push({ topic: t.name, ...g });
    }
    syncTable($("groups"), groups, "group", (g) => g.topic + "/" + g.name, [
      ["topic", (g) => g.topic],
      ["group", (g) => g.name],
      ["committed", (g) => ({ text: plain(g.committed), title: "next offset " + plain(g.next_offset) }), true],
      ["lag", (g) => plain(g.lag), true],
      ["open", (g) => plain(g.open), true],
    ]);
  }

  function renderConnections(data) {
    const conns = (data.connections || []).slice().sort((a, b) => a.id - b.id);
    syncTable($("connections-table"), conns, "connection", (c) => String(c.id), [
      ["id", (c) => plain(c.id), true],
      ["peer", (c) => plain(c.peer)],
      ["user", (c) => plain(c.user)],
      ["protocol", (c) => plain(c.protocol)],
      ["tls", (c) => plain(c.tls)],
      ["requests", (c) => plain(c.requests), true],
      ["received_bytes", (c) => bytesCell(c.received_bytes), true],
      ["sent_bytes", (c) => bytesCell(c.sent_bytes), true],
      ["connected_secs", (c) => ({ text: fmtDuration(c.connected_secs), title: c.connected_secs + " s" }), true],
    ]);
  }

  function renderServer(s) {
    $("version").textContent = s.version || "";
    $("uptime").textContent = fmtDuration(s.uptime_secs);
    $("connections").textContent = plain(s.connections);
    $("queue-count").textContent = plain(s.queues);
    $("topic-count").textContent = plain(s.topics);
    const mem = s.memory || {};
    const max = mem.max_memory_bytes;
    $("memory").textContent = fmtBytes(mem.queued_bytes) + " / " + (max ? fmtBytes(max) : "no limit");
    $("memory").title = max ? ((100 * mem.queued_bytes) / max).toFixed(1) + "% of max_memory_bytes" : "";
  }

  // ---- charts ---------------------------------------------------------------------------------

  let lastSamples = null;

  // Rates between successive cumulative samples, and the depth at each one.
  function series(samples) {
    const t = [], rateIn = [], rateOut = [], depth = [];
    for (let i = 1; i < samples.length; i++) {
      const a = samples[i - 1], b = samples[i];
      const secs = (b.at_ms - a.at_ms) / 1000;
      if (secs <= 0) continue;
      t.push(b.at_ms);
      rateIn.push(Math.max(0, (b.offered - a.offered) / secs));
      rateOut.push(Math.max(0, (b.delivered - a.delivered) / secs));
      depth.push(b.messages);
    }
    return { t, rateIn, rateOut, depth };
  }

  // The smallest 1, 2 or 5 times a power of ten at or above v, so the axis top reads well.
  function niceCeil(v) {
    if (v <= 0) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function timeLabel(secsAgo) {
    if (secsAgo === 0) return "now";
    return secsAgo % 60 === 0 ? `-${secsAgo / 60}m` : `-${secsAgo}s`;
  }

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  // Draws lines [{values, color}] against times `t` (ms, ascending) on a canvas sized by CSS.
  function drawChart(canvas, t, lines) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (!w || !h) return;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
    const ink = cssVar("--muted"), grid = cssVar("--grid");
    const left = 44, right = 8, top = 8, bottom = 18;
    const pw = w - left - right, ph = h - top - bottom;

    let max = 0;
    for (const l of lines) for (const v of l.values) if (v > max) max = v;
    const yMax = niceCeil(max);
    // At least a minute across, so the first few samples do not stretch over the whole width.
    const end = t.length ? t[t.length - 1] : 0;
    const span = Math.max(60, t.length ? Math.ceil((end - t[0]) / 1000) : 60);
    const x = (ms) => left + pw - ((end - ms) / 1000 / span) * pw;
    const y = (v) => top + ph - (v / yMax) * ph;

    // Horizontal grid lines and value labels at 0, half and the top.
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (const v of [0, yMax / 2, yMax]) {
      const yy = Math.round(y(v)) + 0.5;
      g.strokeStyle = grid;
      g.beginPath(); g.moveTo(left, yy); g.lineTo(left + pw, yy); g.stroke();
      g.fillStyle = ink;
      g.fillText(fmtShort(v), left - 6, yy);
    }
    // Time ticks: a step that gives at most six of them across the span.
    const step = [10, 15, 30, 60, 120, 300, 600, 1200].find((s) => span / s <= 6) || 1800;
    g.textBaseline = "top";
    for (let ago = 0; ago <= span; ago += step) {
      const xx = left + pw - (ago / span) * pw;
      g.fillStyle = ink;
      // The end labels align inwards so they stay clear of the value labels and the edge.
      g.textAlign = ago === 0 ? "right" : xx - left < 12 ? "left" : "center";
      g.fillText(timeLabel(ago), ago === 0 ? left + pw : xx, top + ph + 4);
    }

    if (t.length < 2) {
      g.textAlign = "center";
      g.textBaseline = "middle";
      g.fillText("collecting samples…", left + pw / 2, top + ph / 2);
    }
    g.lineWidth = 1.5;
    g.lineJoin = "round";
    for (const l of lines) {
      g.strokeStyle = l.color;
      g.beginPath();
      l.values.forEach((v, i) => (i ? g.lineTo(x(t[i]), y(v)) : g.moveTo(x(t[i]), y(v))));
      g.stroke();
    }
  }

  function drawCharts() {
    if (!lastSamples) return;
    const s = series(lastSamples.samples || []);
    drawChart($("chart-rates"), s.t, [
      { values: s.rateIn, color: cssVar("--in") },
      { values: s.rateOut, color: cssVar("--out") },
    ]);
    drawChart($("chart-depth"), s.t, [{ values: s.depth, color: cssVar("--depth") }]);
  }

  // ---- polling --------------------------------------------------------------------------------

  class HttpError extends Error {}

  async function getJson(path) {
    let response;
    try {
      response = await fetch("api/v1/" + path, {
        credentials: "same-origin",
        cache: "no-store",
        headers: { Accept: "application/json" },
      });
    } catch (e) {
      throw new HttpError("the server does not answer");
    }
    if (!response.ok) {
      const body = await response.json().catch(() => null);
      const reason = body && body.reason ? ": " + body.reason : "";
      throw new HttpError(`${response.status} ${response.statusText}${reason}`.trim());
    }
    return response.json();
  }

  // Each part renders on its own, so one refused route (say a user who may not list
  // connections) leaves the others live and is named in the banner.
  const parts = [
    ["server", renderServer],
    ["queues", renderQueues],
    ["topics", renderTopics],
    ["connections", renderConnections],
    ["samples", (data) => { lastSamples = data; drawCharts(); }],
  ];

  let timer = 0;
  let busy = false;

  async function poll() {
    clearTimeout(timer);
    // One poll at a time; a hidden tab stops polling until it shows again.
    if (busy || document.hidden) return;
    busy = true;
    try {
      const results = await Promise.allSettled(parts.map(([path]) => getJson(path)));
      const now = performance.now();
      const failures = [];
      results.forEach((r, i) => {
        const [path, render] = parts[i];
        if (r.status === "rejected") {
          failures.push(path + " — " + (r.reason instanceof HttpError ? r.reason.message : String(r.reason)));
          return;
        }
        try {
          render(r.value, now);
        } catch (e) {
          failures.push(path + " — unexpected answer: " + e.message);
        }
      });
      const status = $("status");
      const clock = new Date().toLocaleTimeString();
      if (failures.length) {
        status.textContent = `Update failed at ${clock}: ${failures.join("; ")}`;
        status.hidden = false;
      } else {
        status.hidden = true;
        status.textContent = "";
      }
      if (failures.length < parts.length) $("updated").textContent = clock;
    } finally {
      busy = false;
      timer = setTimeout(poll, POLL_MS);
    }
  }

  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });

  let resizePending = false;
  window.addEventListener("resize", () => {
    if (resizePending) return;
    resizePending = true;
    requestAnimationFrame(() => { resizePending = false; drawCharts(); });
  });

  poll();
})();
