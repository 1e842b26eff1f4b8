// Live view of the KV block pool, fed by the SSE stream /v1/kv/stream. The stream is read with
// fetch (not EventSource) so the API key can travel in the Authorization header.

import { authHeaders, describeError } from "./api.js";

export const STATES = ["free", "cached", "used", "shared", "pinned", "swapped"];
const LABELS = {
  free: "free",
  cached: "cached (free, reusable prefix)",
  used: "used by one sequence",
  shared: "shared (refcount > 1)",
  pinned: "pinned persona prompt",
  swapped: "swapped to CPU",
};
// When a cell stands for several blocks it takes the colour of its "busiest" block.
const PRIORITY = { free: 0, cached: 1, used: 2, swapped: 2, shared: 3, pinned: 4 };
const MAX_CELLS = 2048;

export class MemoryView {
  constructor(root) {
    this.root = root;
    this.canvas = root.querySelector("#kv-canvas");
    this.cpuCanvas = root.querySelector("#cpu-canvas");
    this.status = root.querySelector("#kv-status");
    this.hover = root.querySelector("#kv-hover");
    this.sessionId = null;
    this.snapshot = null;
    this.abort = null;
    this.frame = 0;
    this.layout = null;
    this.buildLegend();
    new ResizeObserver(() => this.draw()).observe(this.canvas);
    this.canvas.addEventListener("mousemove", (ev) => this.showHover(ev));
    this.canvas.addEventListener("mouseleave", () => (this.hover.textContent = ""));
  }

  buildLegend() {
    const legend = this.root.querySelector("#kv-legend");
    for (const state of STATES) {
      const row = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = `swatch kv-${state}`;
      const label = document.createElement("span");
      label.textContent = LABELS[state];
      const count = document.createElement("b");
      count.dataset.count = state;
      count.textContent = "–";
      row.append(swatch, label, count);
      legend.append(row);
    }
  }

  setSession(id) {
    if (id === this.sessionId) return;
    this.sessionId = id;
    if (this.abort) this.start(); // reopen so the server reports this session's blocks
  }

  start() {
    this.stop();
    const ctrl = new AbortController();
    this.abort = ctrl;
    this.run(ctrl.signal);
  }

  stop() {
    if (this.abort) this.abort.abort();
    this.abort = null;
  }

  async run(signal) {
    let delay = 500;
    while (!signal.aborted) {
      try {
        const query = this.sessionId ? `?session_id=${encodeURIComponent(this.sessionId)}` : "";
        for await (const data of sseData(`/v1/kv/stream${query}`, signal)) {
          delay = 500;
          this.setStatus("live");
          this.update(JSON.parse(data));
        }
        if (!signal.aborted) this.setStatus("stream ended, reconnecting…");
      } catch (err) {
        if (signal.aborted) return;
        this.setStatus(err.status ? describeError(err) : "server unreachable, retrying…", true);
      }
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 5000);
    }
  }

  setStatus(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  update(snapshot) {
    this.snapshot = snapshot;
    // Draw at most once per animation frame however fast events arrive.
    if (!this.frame) this.frame = requestAnimationFrame(() => ((this.frame = 0), this.draw(), this.fillStats()));
  }

  fillStats() {
    const s = this.snapshot;
    if (!s) return;
    const counts = Object.fromEntries(STATES.map((k) => [k, 0]));
    const states = s.state || [];
    states.forEach((st, i) => {
      counts[st] = (counts[st] || 0) + 1;
      // A pinned persona block that sequences are reading is shared as well: count it in both rows.
      if (st === "pinned" && (s.refcounts?.[i] ?? 0) > 1) counts.shared += 1;
    });
    counts.swapped = s.cpu_used ?? (s.cpu_blocks_total ?? 0) - (s.cpu_blocks_free ?? 0);
    for (const k of STATES) this.root.querySelector(`[data-count="${k}"]`).textContent = String(counts[k]);
    const queried = s.prefix_cache_queried_tokens || 0;
    const hit = s.prefix_cache_hit_tokens || 0;
    const mine = sessionBlocks(s);
    const set = (name, value) => (this.root.querySelector(`[data-stat="${name}"]`).textContent = value);
    const group = this.layout?.group ?? 1;
    set("blocks", `${s.num_blocks ?? s.kv_blocks_total} × ${s.block_size} tokens${group > 1 ? ` (1 cell = ${group} blocks)` : ""}`);
    set("hit", queried ? `${((100 * hit) / queried).toFixed(1)}% (${hit}/${queried} tokens)` : "–");
    set("running", String(s.requests_running ?? 0));
    set("waiting", String(s.requests_waiting ?? 0));
    set("swapped", String(s.requests_swapped ?? 0));
    set("session", this.sessionId ? String(mine.length) : "–");
    set("cpu", `${counts.swapped} / ${s.cpu_blocks_total ?? 0}`);
    // The KV tiers under the pool: blocks kept, and blocks restored from them instead of recomputed.
    const hostTotal = s.kv_host_blocks_total ?? 0;
    set("host", hostTotal ? `${s.kv_host_blocks_cached ?? 0} / ${hostTotal} blocks, ${s.kv_host_hit_blocks ?? 0} restored` : "off");
    set("disk", s.kv_disk_blocks || s.kv_disk_hit_blocks
      ? `${s.kv_disk_blocks ?? 0} blocks, ${s.kv_disk_hit_blocks ?? 0} read back` : hostTotal ? "off or empty" : "off");
    this.canvas.setAttribute("aria-label",
      `KV block pool: ${STATES.map((k) => `${counts[k]} ${k}`).join(", ")}; ${mine.length} in this session`);
  }

  draw() {
    const s = this.snapshot;
    if (!s) return;
    const states = s.state || [];
    this.layout = drawGrid(this.canvas, states, s.refcounts || [], new Set(sessionBlocks(s)));
    const cpuTotal = s.cpu_blocks_total ?? 0;
    const cpuUsed = Math.min(cpuTotal, s.cpu_used ?? cpuTotal - (s.cpu_blocks_free ?? cpuTotal));
    this.cpuCanvas.hidden = cpuTotal === 0;
    if (cpuTotal) {
      const cpuStates = Array.from({ length: cpuTotal }, (_, i) => (i < cpuUsed ? "swapped" : "free"));
      drawGrid(this.cpuCanvas, cpuStates, [], new Set(), 40); // secondary: kept small
    }
  }

  showHover(ev) {
    const s = this.snapshot;
    const lay = this.layout;
    if (!s || !lay) return;
    const rect = this.canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / lay.pitch);
    const row = Math.floor((ev.clientY - rect.top) / lay.pitch);
    const cell = row * lay.cols + col;
    if (col >= lay.cols || cell >= lay.cells) return void (this.hover.textContent = "");
    const first = cell * lay.group;
    if (lay.group > 1) {
      this.hover.textContent = `blocks ${first}–${Math.min(first + lay.group, s.state.length) - 1}`;
      return;
    }
    const owners = Object.entries(s.requests || {})
      .filter(([, ids]) => ids.includes(first))
      .map(([rid]) => rid);
    const ref = s.refcounts ? `, refcount ${s.refcounts[first]}` : "";
    this.hover.textContent = `block ${first}: ${s.state[first]}${ref}${owners.length ? `, ${owners.join(", ")}` : ""}`;
  }
}

// The blocks this session's reply holds plus its persona's pinned prompt blocks, which it shares.
function sessionBlocks(s) {
  if (Array.isArray(s.session_blocks)) return s.session_blocks;
  const own = s.session?.blocks || [];
  const persona = s.session?.persona_blocks || [];
  return [...new Set([...own, ...persona])];
}

// Lays cells out to fill the canvas width; returns the geometry for hit-testing. Cells of blocks
// held by several sequences show their refcount; a pinned block in use is drawn shared with a
// pinned frame, since that is the point of pinning a persona prompt.
function drawGrid(canvas, states, refcounts, highlight, height = 220) {
  const n = states.length;
  const group = Math.max(1, Math.ceil(n / MAX_CELLS));
  const cells = Math.ceil(n / group);
  const width = canvas.clientWidth || 300;
  const pitch = Math.max(4, Math.min(18, Math.floor(Math.sqrt((width * height) / Math.max(cells, 1)))));
  const cols = Math.max(1, Math.floor(width / pitch));
  const rows = Math.ceil(cells / cols);
  const dpr = window.devicePixelRatio || 1;
  canvas.style.height = `${rows * pitch}px`;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(rows * pitch * dpr);
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const colors = stateColors(canvas);
  const gap = pitch >= 8 ? 2 : 1;
  const size = pitch - gap;
  ctx.font = `${Math.floor(size * 0.7)}px system-ui, sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let c = 0; c < cells; c++) {
    let state = "free";
    let mine = false;
    let refs = 0;
    for (let b = c * group; b < Math.min(n, (c + 1) * group); b++) {
      if (PRIORITY[states[b]] > PRIORITY[state]) state = states[b];
      refs = Math.max(refs, refcounts[b] ?? 0);
      mine ||= highlight.has(b);
    }
    const x = (c % cols) * pitch;
    const y = Math.floor(c / cols) * pitch;
    const pinnedInUse = state === "pinned" && refs > 1;
    ctx.fillStyle = colors[pinnedInUse ? "shared" : state] || colors.free;
    ctx.fillRect(x, y, size, size);
    if (pinnedInUse) {
      ctx.strokeStyle = colors.pinned;
      ctx.lineWidth = Math.max(1, size / 5);
      ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, size - ctx.lineWidth, size - ctx.lineWidth);
    }
    if (refs > 1 && size >= 12 && group === 1) {
      ctx.fillStyle = "#000";
      ctx.fillText(String(refs), x + size / 2, y + size / 2 + 0.5);
    }
    if (mine) {
      // A corner mark, so it stays visible on top of any fill or frame.
      ctx.fillStyle = colors.highlight;
      ctx.beginPath();
      ctx.moveTo(x, y);
      ctx.lineTo(x + size * 0.55, y);
      ctx.lineTo(x, y + size * 0.55);
      ctx.closePath();
      ctx.fill();
    }
  }
  return { group, cells, cols, pitch };
}

// Colours come from CSS custom properties so the legend and the canvas always agree.
function stateColors(canvas) {
  const css = getComputedStyle(canvas);
  const colors = {};
  for (const k of [...STATES, "highlight"]) colors[k] = css.getPropertyValue(`--kv-${k}`).trim() || "#888";
  return colors;
}

// Yields the data of each event of a text/event-stream response.
export async function* sseData(url, signal) {
  const res = await fetch(url, { headers: { Accept: "text/event-stream", ...authHeaders() }, signal });
  if (!res.ok) {
    const err = new Error(res.statusText || `HTTP ${res.status}`);
    err.status = res.status;
    try {
      const body = await res.json();
      err.message = body.error?.message || body.message || err.message;
    } catch {
      // not JSON
    }
    throw err;
  }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let carry = ""; // a chunk may end between the \r and \n of one line ending
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    let text = carry + value;
    carry = text.endsWith("\r") ? "\r" : "";
    if (carry) text = text.slice(0, -1);
    buffer += text.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}
