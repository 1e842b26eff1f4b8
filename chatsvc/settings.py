"""Gateway settings: one frozen dataclass built by the CLI (or by tests) and passed to create_app.

Each default is written once, here: a field the CLI exposes names its flag and help in its metadata
(``_flag``) and ``chatsvc serve`` builds that flag from the field. The TTLs of session keys are constants
here too, for the modules that write such keys without a ``Settings`` at hand.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# An idle session (its hash, messages, owner index and engine-worker affinity) expires this long after
# its last turn.
SESSION_TTL_S = 7 * 24 * 3600
# Reply streams only exist for resuming a reply, so they expire soon after it ends.
STREAM_TTL_S = 300


def default_data_dir() -> Path:
    """Where the embedded Redis keeps its append-only file (the user's data dir, XDG style)."""
    if env := os.environ.get("CHATSVC_DATA_DIR"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "chatsvc"


def split_csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def api_keys_from_env(name: str = "CHATSVC_API_KEYS") -> tuple[str, ...]:
    return split_csv(os.environ.get(name, ""))


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def _flag(default: Any, flag: str, help: str) -> Any:  # noqa: A002 - argparse's word
    """A setting ``chatsvc serve`` sets with ``flag`` (its type is the field's)."""
    return field(default=default, metadata={"flag": flag, "help": help})


@dataclass(frozen=True)
class Settings:
    # Empty = no auth: every caller is the same anonymous owner.
    api_keys: tuple[str, ...] = ()
    # fnmatch patterns for browser Origins (WebSocket, state-changing HTTP) besides the server's own origin.
    allowed_origins: tuple[str, ...] = ()
    session_ttl_s: int = _flag(SESSION_TTL_S, "--session-ttl", "idle session TTL in seconds")
    stream_ttl_s: int = STREAM_TTL_S
    # A session reply whose last reader left (SSE disconnect, abnormal WS close) is aborted after this grace,
    # unless a client resumes it; an explicit cancel or a clean WS close aborts at once.
    abort_grace_s: float = _flag(
        3.0, "--abort-grace", "seconds a session reply keeps generating without readers before it is aborted")
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
    max_personas_per_key: int = _flag(16, "--max-personas-per-key", "personas each API key may own")
    max_pinned_fraction: float = _flag(
        0.25, "--max-pinned-fraction",
        "share of the KV pool persona pins may hold; least recently used are unpinned past it")
    # When set, /metrics needs it as a bearer token.
    metrics_key: str | None = None
    # A non-streamed reply with logprobs is built whole: n x max_tokens x (1 + top) entries at most.
    max_logprob_entries: int = 200_000
    # Per-key quotas (only with API keys).
    max_streams_per_key: int = _flag(
        8, "--max-streams-per-key",
        "concurrent generations per API key (OpenAI requests, session turns and persona writes, on every "
        "gateway sharing the Redis)")
    max_sequences_per_key: int = _flag(
        16, "--max-sequences-per-key",
        "concurrent sequences per API key: a request counts n, best_of or its beam width")
    max_kv_streams_per_key: int = _flag(4, "--max-kv-streams-per-key", "open /v1/kv/stream connections per API key")
    # A quota place (a generation, a socket) whose gateway stops renewing it (crashed) lapses this long after
    # the last renewal.
    quota_lease_ttl_s: float = 30.0
    max_sessions_per_minute: int = _flag(30, "--max-sessions-per-minute", "new sessions per API key a minute")
    max_live_sessions_per_key: int = _flag(
        1000, "--max-live-sessions-per-key",
        "sessions an API key may hold at once (deleted or expired ones do not count)")
    max_sockets_per_key: int = _flag(16, "--max-sockets-per-key", "open WebSockets per API key")
    # Prefill work per key: the prompt tokens of OpenAI requests, session turns and persona writes, in a
    # one-minute sliding window shared through Redis (chatsvc.rates); and each key's share of the pins.
    max_prefill_tokens_per_minute: int = _flag(
        100_000, "--max-prefill-tokens-per-minute",
        "prompt tokens per API key a minute (OpenAI requests, session turns and persona writes, on every "
        "gateway sharing the Redis); a prompt larger than this alone is refused (413)")
    max_pinned_share_per_key: float = _flag(
        0.5, "--max-pinned-share-per-key",
        "share of the persona pin budget one API key's own personas may hold; past it its own least "
        "recently used pins are unpinned")
    # A WebSocket must authenticate within this, is closed after this long without a frame while no reply
    # streams, and may send this many frames a second (bursts of twice that).
    ws_auth_timeout_s: float = 10.0
    ws_idle_timeout_s: float = 600.0
    ws_frames_per_second: float = 20.0
    # A WebSocket frame that cannot be sent in this long (the client stopped reading) ends the reply's pump.
    ws_send_timeout_s: float = 30.0
    max_readers_per_reply: int = 8
    # Requests of one key admitted and still waiting for their first token, as a share of the engine's
    # waiting queue (--max-waiting): one key cannot fill the queue and lock every other key out.
    max_waiting_share: float = _flag(
        0.25, "--max-waiting-share", "share of the engine's waiting queue one API key's requests may hold")
    # Lifetime (and longest a client may ask for) of the access tokens POST /v1/auth/token issues.
    access_token_ttl_s: int = 900
    # An SSE send that does not complete in this long (a reader whose TCP window stays full) ends the
    # stream: its generation is aborted, or its session turn loses a reader (grace/abort rules).
    sse_send_timeout_s: float = 30.0
    # A client has this long to send a request's headers (from its connection, or a kept-alive connection's
    # next first byte), then this long for its body (chatsvc.http_timeouts): 408 and close past either.
    header_timeout_s: float = _flag(10.0, "--header-timeout",
                                    "seconds a client may take to send a request's headers (408 and close past it)")
    body_timeout_s: float = _flag(60.0, "--body-timeout",
                                  "seconds a client may take to send a request's body once its headers are in")
    # Each session's stored history: the oldest whole turns are dropped past either cap, never below twice
    # the model's context (chatsvc.store.turns.Retention), so what the model sees is unchanged.
    history_max_messages: int = _flag(1000, "--history-max-messages",
                                      "messages kept per session; older turns are dropped (never below what "
                                      "the model's context can show)")
    history_max_bytes: int = _flag(1 << 20, "--history-max-bytes",
                                   "bytes of messages kept per session; older turns are dropped (never below "
                                   "what the model's context can show)")
    # GET /v1/sessions/{id} and the WebSocket hello show this many of the newest messages; a client pages
    # older ones (GET /v1/sessions/{id}/messages) up to max_history_page at a time.
    history_page: int = 100
    max_history_page: int = 1000
    # On SIGTERM, how long in-flight turns may take to finish while new ones get 503 (chatsvc.drain).
    drain_timeout_s: float = _flag(30.0, "--drain-timeout",
                                   "on SIGTERM, seconds in-flight turns may take to finish before the gateway exits "
                                   "(new ones get 503 meanwhile; 0: exit at once)")
    # At the drain timeout, behind engine workers, the turns still running go to another gateway instead of
    # being cut (chatsvc.drain); an engine in this process ignores it (its requests end with the gateway).
    drain_handoff: bool = _flag(True, "--drain-handoff",
                                "with --engine redis: at the drain timeout, hand the replies still running to "
                                "another gateway (their clients resume them there) instead of storing them as "
                                "interrupted")
    # The operator's server secret(s) (chatsvc.keyring): this file, one a line, the first current; without it
    # $CHATSVC_SECRET and $CHATSVC_SECRET_PREVIOUS; neither: a generated one kept in Redis.
    secret_file: Path | None = _flag(
        None, "--secret-file",
        "file of server secrets, one a line: the first signs access tokens, the others are still accepted "
        "(default: $CHATSVC_SECRET, $CHATSVC_SECRET_PREVIOUS)")
    secret_reload_interval_s: float = _flag(
        60.0, "--secret-reload-interval", "seconds between re-reads of --secret-file (SIGHUP re-reads at once)")


def flag_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The settings that have a ``chatsvc serve`` flag of their own."""
    return tuple(f for f in dataclasses.fields(Settings) if "flag" in f.metadata)
