// The chat WebSocket: hello on every (re)connect, automatic reconnect with backoff, and resume of
// the reply in flight from the last delta id seen, so no text is lost or shown twice.

import { getApiKey } from "./api.js";

const BACKOFF_MS = [300, 700, 1500, 3000, 5000];

export class ChatSocket {
  // handlers: onFrame(frame), onState("connecting" | "open" | "reconnecting" | "closed", attempt)
  constructor(handlers) {
    this.handlers = handlers;
    this.ws = null;
    this.sessionId = null;
    this.attempt = 0;
    this.timer = null;
    this.inFlight = false; // a reply is streaming (or was when the socket dropped)
    this.lastId = null; // id of the last delta applied
    this.resuming = false;
    this.opened = 0; // sockets opened so far (shown nowhere; tests and debugging read it)
  }

  connect(sessionId) {
    this.close();
    this.sessionId = sessionId;
    this.attempt = 0;
    this.inFlight = false;
    this.lastId = null;
    this.open();
  }

  open() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${proto}://${location.host}/v1/ws`);
    this.ws = ws;
    this.handlers.onState(this.attempt ? "reconnecting" : "connecting", this.attempt);
    ws.onopen = () => {
      this.opened += 1;
      const hello = { type: "hello", session_id: this.sessionId };
      const key = getApiKey();
      if (key) hello.api_key = key;
      ws.send(JSON.stringify(hello));
    };
    ws.onmessage = (ev) => {
      let frame;
      try {
        frame = JSON.parse(ev.data);
      } catch {
        return; // not ours
      }
      this.receive(frame);
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws) return; // replaced by a newer socket on purpose
      this.ws = null;
      // 4401/4403: the key was refused; 1008: policy violation. Retrying cannot help.
      if ([1008, 4401, 4403].includes(ev.code)) {
        this.handlers.onState("closed", 0);
        this.handlers.onFrame({ type: "error", code: ev.code === 1008 ? "unauthorized" : String(ev.code),
          message: ev.reason || "the server refused the connection" });
        return;
      }
      const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)];
      this.attempt += 1;
      this.handlers.onState("reconnecting", this.attempt);
      this.timer = setTimeout(() => this.open(), delay);
    };
  }

  receive(frame) {
    if (frame.type === "session") {
      this.attempt = 0;
      this.handlers.onState("open", 0);
      if (this.inFlight) {
        // The reply kept going on the server while we were away: ask for the rest only.
        this.resuming = true;
        const resume = { type: "resume" };
        if (this.lastId !== null) resume.after = this.lastId;
        this.sendRaw(resume);
        frame = { ...frame, resumed: true };
      }
    } else if (frame.type === "delta") {
      if (frame.id !== undefined && frame.id !== null) {
        if (this.lastId !== null && !isAfter(frame.id, this.lastId)) return; // already shown
        this.lastId = frame.id;
      }
      this.resuming = false;
    } else if (frame.type === "done" || (frame.type === "error" && this.inFlight)) {
      this.inFlight = false;
      this.resuming = false;
    }
    this.handlers.onFrame(frame);
  }

  isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  sendMessage(content, params) {
    this.inFlight = true;
    this.lastId = null;
    return this.sendRaw({ type: "message", content, ...params });
  }

  cancel() {
    return this.sendRaw({ type: "cancel" });
  }

  sendRaw(frame) {
    if (!this.isOpen()) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  close() {
    clearTimeout(this.timer);
    const ws = this.ws;
    this.ws = null;
    if (ws) ws.close(1000, "client closed");
  }
}

// Delta ids look like "<turn>:<ms>-<seq>" (turn number and Redis stream id); any id is compared
// as its run of numbers when both ids have the same shape, else they only need to differ.
export function isAfter(id, last) {
  const a = idKey(id);
  const b = idKey(last);
  if (a.shape === b.shape && a.nums.length) {
    for (let i = 0; i < a.nums.length; i++) {
      if (a.nums[i] !== b.nums[i]) return a.nums[i] > b.nums[i];
    }
    return false;
  }
  return id !== last;
}

function idKey(id) {
  const s = String(id);
  return { shape: s.replace(/\d+/g, "#"), nums: (s.match(/\d+/g) || []).map(Number) };
}
