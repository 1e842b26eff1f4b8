// REST access to the gateway: bearer key from localStorage, errors turned into readable text.

const KEY_STORAGE = "chatsvc.apiKey";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status; // HTTP status, 0 when the server could not be reached
    this.code = code;
  }
}

export function getApiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export function authHeaders() {
  const key = getApiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Accepts OpenAI's {"error": {...}}, a flat {"code","message"} and plain text bodies.
async function errorFromResponse(res) {
  let code = String(res.status);
  let message = res.statusText || "request failed";
  try {
    const text = await res.text();
    try {
      const body = JSON.parse(text);
      const err = body.error && typeof body.error === "object" ? body.error : body;
      message = err.message || err.detail || (typeof body.error === "string" ? body.error : message);
      code = err.code || err.type || code;
    } catch {
      if (text.trim()) message = text.trim().slice(0, 300);
    }
  } catch {
    // body unreadable: keep the status line
  }
  return new ApiError(res.status, String(code), message);
}

export async function request(method, path, body) {
  const headers = { ...authHeaders() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch {
    throw new ApiError(0, "unreachable", "The server cannot be reached.");
  }
  if (!res.ok) throw await errorFromResponse(res);
  return res.status === 204 ? null : res.json();
}

// The gateway may answer a list either bare or wrapped ({"data": [...]}, {"personas": [...]}).
export function asList(body, key) {
  if (Array.isArray(body)) return body;
  if (body && Array.isArray(body[key])) return body[key];
  if (body && Array.isArray(body.data)) return body.data;
  return [];
}

export async function listPersonas() {
  return asList(await request("GET", "/v1/personas"), "personas");
}

export async function listSessions() {
  return asList(await request("GET", "/v1/sessions"), "sessions");
}

export const createSession = (persona) => request("POST", "/v1/sessions", { persona });
export const getSession = (id) => request("GET", `/v1/sessions/${encodeURIComponent(id)}`);
// Older messages: up to ``limit`` before the index ``before`` (a page's first_index).
export const getMessages = (id, before, limit = 100) =>
  request("GET", `/v1/sessions/${encodeURIComponent(id)}/messages?before=${before}&limit=${limit}`);

// Turns any failure (ApiError, error frame, plain Error) into one sentence a person can act on.
export function describeError(err) {
  const status = Number(err.status ?? err.code);
  const code = String(err.code ?? "");
  const msg = err.message || "";
  if (status === 401 || status === 403 || /unauthori[sz]ed|api.?key/i.test(code))
    return `Not authorized: ${msg || "an API key is required"}. Set the key with the "API key" button.`;
  if (status === 429 || /queue|rate|busy|overload/i.test(code))
    return `The server is busy (${msg || "too many requests"}). Try again in a moment.`;
  if (status === 0 || code === "unreachable") return "The server cannot be reached. Retrying…";
  if (status === 400 || status === 422 || /invalid/i.test(code)) return `Invalid request: ${msg}`;
  if (status === 404 || /not_found/.test(code)) return `Not found: ${msg}`;
  return msg ? `Error${code ? ` (${code})` : ""}: ${msg}` : `Error ${code}`;
}
