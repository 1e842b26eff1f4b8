// The chat page: personas, sessions, the conversation and its live reply, wired to the gateway.

import * as api from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { MemoryView } from "./memory.js";
import { ChatSocket } from "./socket.js";

const $ = (sel) => document.querySelector(sel);
const OPTIONS_STORAGE = "chatsvc.options";
const DEFAULT_OPTIONS = { max_tokens: 256, temperature: 0.7 };

const state = {
  personas: [],
  sessionId: null,
  persona: null,
  historyShown: false,
  reply: null, // the assistant message being streamed: {node, text, tSend, tFirst, tokens}
  stopRequested: false,
};

const socket = new ChatSocket({ onFrame, onState: showConnection });
const memory = new MemoryView($("#memory"));

// ---------- personas and sessions ----------

async function loadPersonas() {
  try {
    state.personas = await api.listPersonas();
  } catch (err) {
    return handleApiError(err);
  }
  const list = $("#personas");
  list.replaceChildren();
  for (const p of state.personas) {
    const li = document.createElement("li");
    const btn = document.createElement("button");
    btn.className = "persona";
    btn.dataset.persona = p.name;
    const name = document.createElement("strong");
    name.textContent = p.name;
    const desc = document.createElement("span");
    desc.textContent = p.description || "";
    btn.append(name, desc);
    if (p.pinned_tokens) {
      const pinned = document.createElement("small");
      pinned.textContent = `${p.pinned_tokens} prompt tokens pinned in the KV cache, shared by its chats`;
      btn.append(pinned);
    }
    btn.addEventListener("click", () => newSession(p.name));
    li.append(btn);
    list.append(li);
  }
  if (!state.personas.length) $("#chat-sub").textContent = "The server offers no personas.";
}

async function refreshSessions() {
  let sessions;
  try {
    sessions = await api.listSessions();
  } catch (err) {
    return handleApiError(err);
  }
  const list = $("#sessions");
  list.replaceChildren();
  for (const s of sessions) {
    const li = document.createElement("li");
    const btn = document.createElement("button");
    btn.className = "session";
    btn.dataset.session = s.id;
    if (s.id === state.sessionId) btn.setAttribute("aria-current", "true");
    const title = document.createElement("strong");
    title.textContent = s.title || `${s.persona || "chat"} chat`;
    const sub = document.createElement("span");
    const turns = s.turns ?? s.message_count;
    const when = s.updated ?? s.updated_at ?? s.created ?? s.created_at;
    sub.textContent = [s.persona, formatTime(when), turns ? `${turns} turn${turns === 1 ? "" : "s"}` : ""]
      .filter(Boolean)
      .join(" · ");
    btn.append(title, sub);
    btn.addEventListener("click", () => openSession(s.id));
    li.append(btn);
    list.append(li);
  }
  $("#sessions-empty").hidden = sessions.length > 0;
}

async function newSession(persona) {
  let session;
  try {
    session = await api.createSession(persona);
  } catch (err) {
    return handleApiError(err);
  }
  await openSession(session.id);
  refreshSessions();
}

async function openSession(id) {
  state.sessionId = id;
  state.historyShown = false;
  state.reply = null;
  setStreaming(false);
  localStorage.setItem("chatsvc.lastSession", id);
  if (location.hash !== `#session=${id}`) history.replaceState(null, "", `#session=${encodeURIComponent(id)}`);
  $("#picker").hidden = true;
  $("#messages").hidden = false;
  $("#composer").hidden = false;
  $("#messages").replaceChildren();
  $("#chat-title").textContent = "Loading…";
  $("#chat-sub").textContent = "";
  for (const b of document.querySelectorAll("#sessions button")) {
    if (b.dataset.session === id) b.setAttribute("aria-current", "true");
    else b.removeAttribute("aria-current");
  }
  closeSidebarOnPhone();
  memory.setSession(id);
  socket.connect(id);
}

function showPicker() {
  socket.close();
  showConnection("idle");
  state.sessionId = null;
  memory.setSession(null);
  history.replaceState(null, "", location.pathname);
  localStorage.removeItem("chatsvc.lastSession");
  $("#picker").hidden = false;
  $("#messages").hidden = true;
  $("#composer").hidden = true;
  $("#chat-title").textContent = "Choose a persona";
  $("#chat-sub").textContent = "Each persona has its own system prompt, computed once and shared by all its chats.";
  closeSidebarOnPhone();
}

function showSessionHeader(personaName) {
  state.persona = personaName;
  const p = state.personas.find((x) => x.name === personaName);
  $("#chat-title").textContent = personaName || "Chat";
  $("#chat-sub").textContent = p?.description || "";
}

// ``page``: where the messages shown start ({first_index, has_more}): older ones load on request.
function renderHistory(messages, page) {
  const box = $("#messages");
  box.replaceChildren();
  for (const m of messages || []) renderStored(m);
  if (!box.children.length) {
    const hint = document.createElement("p");
    hint.className = "muted empty-hint";
    hint.textContent = "Say hello to start the conversation.";
    box.append(hint);
  }
  showEarlierButton(page);
  scrollDown(true);
}

function renderStored(m) {
  if (!["user", "assistant", "tool"].includes(m.role)) return null; // the persona's system prompt
  const node = addMessage(m.role, m.content);
  if (m.role === "tool") node.dataset.toolCallId = m.tool_call_id || "";
  if (m.role === "assistant") {
    showToolCalls(node, m.tool_calls);
    const parts = [];
    if (m.tokens != null) parts.push(`${m.tokens} tokens`);
    if (m.finish_reason) parts.push(finishLabel(m.finish_reason));
    const when = m.created ?? m.created_at;
    if (when != null) parts.push(formatTime(when));
    setMeta(node, parts.join(" · "));
    markFinish(node, m.finish_reason);
  }
  return node;
}

// A session comes with its newest messages; the older ones are read a page at a time, above them.
function showEarlierButton(page) {
  $("#messages .load-earlier")?.remove();
  if (!page?.has_more) return;
  const button = document.createElement("button");
  button.type = "button";
  button.className = "load-earlier";
  button.textContent = "Load earlier messages";
  button.addEventListener("click", () => loadEarlier(button, page.first_index));
  $("#messages").prepend(button);
}

async function loadEarlier(button, before) {
  const sid = state.sessionId;
  button.disabled = true;
  try {
    const page = await api.getMessages(sid, before);
    if (sid !== state.sessionId) return;
    const box = $("#messages");
    const height = box.scrollHeight;
    const first = button.nextSibling;
    for (const node of (page.messages || []).map(renderStored)) if (node) box.insertBefore(node, first);
    box.scrollTop += box.scrollHeight - height; // the messages being read stay where they were
    showEarlierButton(page);
  } catch (err) {
    button.disabled = false;
    handleApiError(err);
  }
}

// ---------- messages ----------

function addMessage(role, text) {
  $("#messages .empty-hint")?.remove();
  const node = document.createElement("article");
  node.className = `msg ${role}`;
  node.dataset.role = role;
  const who = document.createElement("h3");
  who.className = role === "tool" ? "tool-label" : "sr-only";
  who.textContent = { user: "You said", tool: "Tool result" }[role] || `${state.persona || "Assistant"} said`;
  const body = document.createElement("div");
  body.className = "body";
  const meta = document.createElement("div");
  meta.className = "meta";
  node.append(who, body, meta);
  setBody(node, text);
  $("#messages").append(node);
  return node;
}

function setBody(node, text) {
  const body = node.querySelector(".body");
  node.dataset.text = text;
  if (node.dataset.role === "assistant") body.replaceChildren(renderMarkdown(text));
  else body.textContent = text; // what the user typed is shown exactly as typed
}

// A reply's tool calls, each its function's name and arguments, shown as text: the page runs no tools; a
// client posts each result back as a "tool" message, which the transcript shows as a tool result.
function showToolCalls(node, calls) {
  node.querySelector(".tool-calls")?.remove();
  if (!calls || !calls.length) return;
  const list = document.createElement("ul");
  list.className = "tool-calls";
  for (const call of calls) {
    const item = document.createElement("li");
    item.className = "tool-call";
    item.dataset.callId = call.id;
    const name = document.createElement("strong");
    name.textContent = `Tool call: ${call.function?.name ?? "?"}`;
    const args = document.createElement("pre");
    args.textContent = call.function?.arguments ?? "";
    item.append(name, args);
    list.append(item);
  }
  node.querySelector(".body").after(list);
}

function setMeta(node, text) {
  node.querySelector(".meta").textContent = text;
}

function markFinish(node, reason) {
  if (!reason) return;
  node.dataset.finish = reason;
  if (reason === "abort") node.classList.add("stopped");
}

function finishLabel(reason) {
  return { abort: "stopped", stop: "finished", length: "length limit", tool_calls: "called tools" }[reason] || reason;
}

let renderQueued = false;
function queueRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    const r = state.reply;
    if (!r) return;
    // A reply that calls tools streams as the model writes the calls; they are shown once it is done.
    setBody(r.node, r.text.startsWith("<tool_call>") ? "Calling a tool…" : r.text);
    setMeta(r.node, liveMeta(r));
    scrollDown();
  });
}

function liveMeta(r) {
  const parts = [];
  if (r.tFirst) parts.push(`TTFT ${fmtSeconds(r.tFirst - r.tSend)}`);
  parts.push(`${r.tokens} tokens…`);
  return parts.join(" · ");
}

function fmtSeconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function scrollDown(force = false) {
  const box = $("#messages");
  const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 120;
  if (force || nearBottom) box.scrollTop = box.scrollHeight;
}

// ---------- sending and streaming ----------

function send() {
  const input = $("#input");
  const text = input.value.trim();
  if (!text || state.reply) return;
  if (!socket.isOpen()) {
    showBanner("Not connected to the server yet; your message was not sent.");
    return;
  }
  hideBanner();
  addMessage("user", text);
  startReplyNode();
  socket.sendMessage(text, readOptions());
  input.value = "";
  scrollDown(true);
}

function stop() {
  if (!state.reply) return;
  state.stopRequested = true;
  $("#stop").disabled = true;
  $("#stop").textContent = "Stopping…";
  socket.cancel(); // if the socket is down this is sent after the reconnect
}

// A resumed reply whose generation died with the server (a restart) would otherwise wait forever:
// if nothing arrives for a while, say so and show what the server stored.
const RESUME_TIMEOUT_MS = 30_000;
let resumeWatchdog = 0;

function armResumeWatchdog() {
  clearTimeout(resumeWatchdog);
  resumeWatchdog = setTimeout(() => {
    const r = state.reply;
    if (!r) return;
    r.node.classList.remove("streaming");
    r.node.classList.add("failed");
    setMeta(r.node, "interrupted");
    r.node.dataset.finish = "error";
    state.reply = null;
    socket.inFlight = false;
    setStreaming(false);
    showBanner("The reply was lost while the connection was down.");
  }, RESUME_TIMEOUT_MS);
}

function onFrame(frame) {
  if (frame.type !== "session") clearTimeout(resumeWatchdog);
  switch (frame.type) {
    case "session":
      onSession(frame);
      break;
    case "delta":
      onDelta(frame);
      break;
    case "done":
      onDone(frame);
      break;
    case "error":
      onError(frame);
      break;
    default:
      break; // frames this page does not know are ignored
  }
}

function onSession(frame) {
  if (frame.id && frame.id !== state.sessionId) return; // a late frame of a session we left
  showSessionHeader(frame.persona);
  if (frame.resumed) {
    if (state.stopRequested) socket.cancel();
    armResumeWatchdog();
    return; // the conversation on screen is current; the rest of the reply follows as deltas
  }
  if (!state.historyShown) {
    state.historyShown = true;
    if (Array.isArray(frame.messages)) renderHistory(frame.messages, frame);
    else loadHistoryOverRest();
    // A reply is still being generated (e.g. the page was reloaded mid-reply): follow it from its start.
    if (frame.busy && !state.reply) {
      startReplyNode();
      socket.inFlight = true;
      socket.sendRaw({ type: "resume" });
    }
  }
}

function startReplyNode() {
  const node = addMessage("assistant", "");
  node.classList.add("streaming");
  state.reply = { node, text: "", tSend: performance.now(), tFirst: 0, tokens: 0 };
  state.stopRequested = false;
  setStreaming(true);
  return state.reply;
}

async function loadHistoryOverRest() {
  try {
    const s = await api.getSession(state.sessionId);
    showSessionHeader(s.persona);
    renderHistory(s.messages, s);
  } catch (err) {
    handleApiError(err);
  }
}

function onDelta(frame) {
  // A reply this page did not start (another tab of the session, say) is shown all the same.
  const r = state.reply || startReplyNode();
  if (!r.tFirst) r.tFirst = performance.now();
  r.text += frame.text || "";
  r.tokens += frame.tokens ?? 1;
  queueRender();
}

function onDone(frame) {
  const r = state.reply;
  if (!r) return;
  const now = performance.now();
  const usage = frame.usage || {};
  const completion = usage.completion_tokens ?? r.tokens;
  // The stored reply is the whole truth: deltas written while the session store was away never arrived.
  const stored = frame.message && typeof frame.message.content === "string" ? frame.message.content : null;
  const calls = frame.message?.tool_calls;
  if (stored !== null && (stored.length > r.text.length || calls?.length)) r.text = stored;
  setBody(r.node, r.text);
  showToolCalls(r.node, calls);
  const parts = [];
  if (r.tFirst) {
    parts.push(`TTFT ${fmtSeconds(r.tFirst - r.tSend)}`);
    const seconds = (now - r.tFirst) / 1000;
    if (completion > 1 && seconds > 0) parts.push(`${((completion - 1) / seconds).toFixed(1)} tok/s`);
  }
  if (usage.prompt_tokens != null) parts.push(`${usage.prompt_tokens} prompt + ${completion} completion tokens`);
  else parts.push(`${completion} tokens`);
  parts.push(finishLabel(frame.finish_reason));
  setMeta(r.node, parts.join(" · "));
  r.node.classList.remove("streaming");
  markFinish(r.node, frame.finish_reason);
  r.node.dataset.usage = JSON.stringify(usage);
  state.reply = null;
  setStreaming(false);
  refreshSessions();
}

function onError(frame) {
  const r = state.reply;
  if (frame.code === "stream_not_found" && r) {
    // The reply ended (and its event stream expired) while we were away; it is in the history.
    r.node.remove();
    state.reply = null;
    setStreaming(false);
    loadHistoryOverRest();
    return;
  }
  if (r) {
    r.node.classList.remove("streaming");
    r.node.classList.add("failed");
    setBody(r.node, r.text);
    setMeta(r.node, "failed");
    r.node.dataset.finish = "error";
    state.reply = null;
    setStreaming(false);
  }
  showBanner(api.describeError(frame));
  const code = String(frame.code);
  if (/unauthori[sz]ed|401|403|api.?key/i.test(code)) openKeyDialog(frame.message);
  if (/not.?found|404/i.test(code) && !state.historyShown) showPicker();
}

function setStreaming(on) {
  const input = $("#input");
  input.disabled = on;
  $("#send").hidden = on;
  $("#stop").hidden = !on;
  $("#stop").disabled = false;
  $("#stop").textContent = "Stop";
  $("#messages").setAttribute("aria-busy", String(on));
  if (on) $("#stop").focus();
  else if (!$("#composer").hidden) input.focus();
}

function readOptions() {
  const maxTokens = parseInt($("#opt-max-tokens").value, 10);
  const temperature = parseFloat($("#opt-temperature").value);
  const opts = {};
  if (Number.isFinite(maxTokens)) opts.max_tokens = maxTokens;
  if (Number.isFinite(temperature)) opts.temperature = temperature;
  localStorage.setItem(OPTIONS_STORAGE, JSON.stringify(opts));
  return opts;
}

function loadOptions() {
  let opts = DEFAULT_OPTIONS;
  try {
    opts = { ...DEFAULT_OPTIONS, ...JSON.parse(localStorage.getItem(OPTIONS_STORAGE) || "{}") };
  } catch {
    // corrupt value: defaults
  }
  $("#opt-max-tokens").value = opts.max_tokens;
  $("#opt-temperature").value = opts.temperature;
}

// ---------- connection state, errors, API key ----------

function showConnection(kind, attempt = 0) {
  const pill = $("#conn");
  pill.dataset.state = kind;
  pill.textContent = {
    idle: "not connected",
    connecting: "connecting…",
    open: "connected",
    reconnecting: `reconnecting${attempt > 1 ? ` (try ${attempt})` : ""}…`,
    closed: "disconnected",
  }[kind];
  if (kind === "reconnecting" && attempt >= 3) showBanner("The server cannot be reached. Retrying…", "conn");
  if (kind === "open" && $("#banner").dataset.kind === "conn") hideBanner();
}

function showBanner(text, kind = "error") {
  $("#banner-text").textContent = text;
  $("#banner").dataset.kind = kind;
  $("#banner").hidden = false;
}

function hideBanner() {
  $("#banner").hidden = true;
  $("#banner").dataset.kind = "";
}

function handleApiError(err) {
  showBanner(api.describeError(err));
  if (err.status === 401 || err.status === 403) openKeyDialog(err.message);
}

function openKeyDialog(reason) {
  const dialog = $("#key-dialog");
  if (dialog.open) return;
  if (reason) $("#key-reason").textContent = `The server refused the request: ${reason}`;
  $("#key-input").value = api.getApiKey();
  dialog.showModal();
}

function onKeyDialogClosed() {
  const action = $("#key-dialog").returnValue;
  if (action === "save") api.setApiKey($("#key-input").value.trim());
  else if (action === "clear") api.setApiKey("");
  else return;
  hideBanner();
  reloadAll();
}

function reloadAll() {
  loadPersonas();
  refreshSessions();
  if (state.sessionId) openSession(state.sessionId);
  if (!$("#memory").hidden) memory.start();
}

// ---------- panels ----------

function toggleMemory(open = $("#memory").hidden) {
  $("#memory").hidden = !open;
  $("#toggle-memory").setAttribute("aria-expanded", String(open));
  localStorage.setItem("chatsvc.memoryOpen", open ? "1" : "");
  if (open) memory.start();
  else memory.stop();
}

const phone = window.matchMedia("(max-width: 760px)");

function toggleSidebar(open = !document.body.classList.contains("sidebar-open")) {
  document.body.classList.toggle("sidebar-open", open);
  $("#toggle-sidebar").setAttribute("aria-expanded", String(open));
  if (open) $("#new-chat").focus();
}

function closeSidebarOnPhone() {
  if (phone.matches) toggleSidebar(false);
}

function formatTime(t) {
  if (t == null || t === "") return "";
  const ms = typeof t === "number" ? (t < 1e12 ? t * 1000 : t) : Date.parse(t);
  if (!Number.isFinite(ms)) return "";
  const d = new Date(ms);
  const sameDay = d.toDateString() === new Date().toDateString();
  return sameDay
    ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })
    : d.toLocaleDateString([], { month: "short", day: "numeric" });
}

// ---------- start ----------

function wire() {
  $("#composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("#input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key !== "Escape") return;
    if (document.body.classList.contains("sidebar-open")) toggleSidebar(false);
    else if (state.reply) stop();
  });
  $("#stop").addEventListener("click", stop);
  $("#new-chat").addEventListener("click", showPicker);
  $("#toggle-memory").addEventListener("click", () => toggleMemory());
  $("#close-memory").addEventListener("click", () => toggleMemory(false));
  $("#toggle-sidebar").addEventListener("click", () => toggleSidebar());
  $("#open-key").addEventListener("click", () => openKeyDialog());
  $("#key-dialog").addEventListener("close", onKeyDialogClosed);
  $("#banner-close").addEventListener("click", hideBanner);
  for (const id of ["#opt-max-tokens", "#opt-temperature"]) $(id).addEventListener("change", readOptions);
  window.addEventListener("hashchange", () => {
    const id = sessionFromHash();
    if (id && id !== state.sessionId) openSession(id);
  });
}

function sessionFromHash() {
  const m = /^#session=(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

async function main() {
  wire();
  loadOptions();
  await loadPersonas();
  refreshSessions();
  const id = sessionFromHash() || localStorage.getItem("chatsvc.lastSession");
  if (id) openSession(id);
  else showPicker();
  if (localStorage.getItem("chatsvc.memoryOpen")) toggleMemory(true);
}

// Exposed for debugging in the console and for the browser tests (e.g. dropping the socket).
window.chatsvc = { state, socket, memory };

main();
