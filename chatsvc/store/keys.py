"""The gateway's Redis key layout: every key the store reads or writes is named here.

Keys (prefix ``chatsvc:``; ``{id}`` is written with its braces, a Redis Cluster hash tag):
- ``personas``                 hash name -> JSON {system_prompt, description}: the shared personas; the field
                               ``:seeded`` (never a persona name) is set once the defaults were written (so
                               deletions stick)
- ``owner:<owner>:personas``   hash name -> JSON: one owner's own personas
- ``session:{id}``             hash: id, owner, persona, prompt_sha (the system prompt's ``prompt:<sha>``; a
                               session stored before prompts were shared holds system_prompt itself), title,
                               created, updated, turns, response_format (JSON text or ""), replied (the last
                               turn whose reply is stored: ``turns - 1`` while one runs), trimmed_messages
                               (the oldest messages retention dropped), history_bytes (the message list's
                               bytes), user_messages (user messages ever stored, trimmed ones included)
- ``session:{id}:messages``    list of JSON messages, the oldest ``trimmed_messages`` gone
- ``prompt:<sha256>``          a system prompt, stored once for every session that uses it; its TTL is
                               refreshed whenever a session reads it
- ``session:{id}:lock``        held while a reply is generated: the 409 guard. Its value is the owner
                               token ``instance|nonce|turn``; it has a short TTL its owner refreshes
- ``owner:<owner>:sessions``   sorted set of session ids by creation time
- ``stream:{id}:<turn>``       Redis Stream of one reply's events, short TTL
- ``stream:{id}:<turn>:readers`` sorted set: readers of a running reply on gateways other than the one
                               generating it -> their lease's end (ms)
- ``instance:<name>``          the nonce of the live gateway process called ``name``, short TTL (heartbeat)
- ``instance:<name>:locks``    session ids whose lock that instance took (found again without SCAN)
- ``instance:<name>:control``  list of JSON requests to the gateway ``name`` about the turns it generates
- ``instances``                names of instances that may hold locks
- ``owner:<owner>:quota:<kind>`` sorted set: one owner's places in one quota (``<id>:<weight>``) -> when
                               the place lapses (ms, Redis time) unless its gateway renews it

Redis Cluster: every key a script touches is one session's (all tagged ``{id}``, so in one hash slot) or
the personas hash alone.
"""

from __future__ import annotations

P = "chatsvc:"
PERSONAS = P + "personas"
INSTANCES = P + "instances"


def id_tag(sid: str) -> str:
    """A session id as its keys hold it: a hash tag, so a Redis Cluster keeps them in one slot."""
    return "{" + sid + "}"


def session_key(sid: str) -> str:
    """The session's hash; its messages and lock are this key with ``:messages`` and ``:lock``."""
    return f"{P}session:{id_tag(sid)}"


def messages_key(sid: str) -> str:
    return session_key(sid) + ":messages"


def lock_key(sid: str) -> str:
    return session_key(sid) + ":lock"


def stream_prefix(sid: str) -> str:
    """The session's reply streams are this prefix and the turn number."""
    return f"{P}stream:{id_tag(sid)}:"


def stream_key(sid: str, turn: int) -> str:
    return f"{stream_prefix(sid)}{turn}"


def readers_key(sid: str, turn: int) -> str:
    return stream_key(sid, turn) + ":readers"


def prompt_key(sha: str) -> str:
    return f"{P}prompt:{sha}"


def owner_sessions_key(owner: str) -> str:
    return f"{P}owner:{owner}:sessions"


def owner_personas_key(owner: str) -> str:
    return f"{P}owner:{owner}:personas"


def quota_key(owner: str, kind: str) -> str:
    return f"{P}owner:{owner}:quota:{kind}"


def instance_key(name: str) -> str:
    return f"{P}instance:{name}"


def locks_key(name: str) -> str:
    return instance_key(name) + ":locks"


def control_key(name: str) -> str:
    return instance_key(name) + ":control"
