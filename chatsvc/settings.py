"""Gateway settings: one frozen dataclass built by the CLI (or by tests) and passed to create_app."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_data_dir() -> Path:
    """Where the embedded Redis keeps its append-only file (the user's data dir, XDG style)."""
    if env := os.environ.get("CHATSVC_DATA_DIR"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "chatsvc"


def api_keys_from_env(name: str = "CHATSVC_API_KEYS") -> tuple[str, ...]:
    raw = os.environ.get(name, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass(frozen=True)
class Settings:
    # Empty = no auth: every caller is the same anonymous owner.
    api_keys: tuple[str, ...] = ()
    # fnmatch patterns for browser Origins (WebSocket, state-changing HTTP) besides the server's own origin.
    allowed_origins: tuple[str, ...] = ()
    session_ttl_s: int = 7 * 24 * 3600
    # Reply streams only exist for resuming a reply, so they expire soon after it ends.
    stream_ttl_s: int = 300
    # A session reply whose last reader left (SSE disconnect, abnormal WS close) is aborted after this grace,
    # unless a client resumes it; an explicit cancel or a clean WS close aborts at once.
    abort_grace_s: float = 3.0
    max_body_bytes: int = 1 << 20
    max_message_chars: int = 32_000
    max_ws_frame_bytes: int = 64 * 1024
    max_n: int = 8
    default_session_max_tokens: int = 256
    retry_after_s: int = 1
    kv_stream_interval_s: float = 0.25
    web_dir: Path | None = None
    # fnmatch patterns for the Host header's name (DNS rebinding); "*" accepts any.
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    # Keys that may also write the shared personas (each is an API key too).
    admin_keys: tuple[str, ...] = ()
    max_personas_per_key: int = 16
    # Share of the device KV pool persona pins may hold; past it the least recently used are unpinned.
    max_pinned_fraction: float = 0.25
    # When set, /metrics needs it as a bearer token.
    metrics_key: str | None = None
    # A non-streamed reply with logprobs is built whole: n x max_tokens x (1 + top) entries at most.
    max_logprob_entries: int = 200_000
    # Per-key quotas (only with API keys).
    max_streams_per_key: int = 8
    max_sessions_per_minute: int = 30
    max_sockets_per_key: int = 16
    # A WebSocket must authenticate within this, is closed after this long without a frame while no reply
    # streams, and may send this many frames a second (bursts of twice that).
    ws_auth_timeout_s: float = 10.0
    ws_idle_timeout_s: float = 600.0
    ws_frames_per_second: float = 20.0
    max_readers_per_reply: int = 8
    # Requests of one key admitted and still waiting for their first token, as a share of the engine's
    # waiting queue (--max-waiting): one key cannot fill the queue and lock every other key out.
    max_waiting_share: float = 0.25
    # Lifetime (and longest a client may ask for) of the access tokens POST /v1/auth/token issues.
    access_token_ttl_s: int = 900
    # An SSE send that does not complete in this long (a reader whose TCP window stays full) ends the
    # stream: its generation is aborted, or its session turn loses a reader (grace/abort rules).
    sse_send_timeout_s: float = 30.0
