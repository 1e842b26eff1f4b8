"""Messages between gateways and engine workers over Redis (format version 2), and their Redis keys.

A gateway (``chatsvc serve --engine redis``, ``chatsvc.remote_engine.RemoteEngine``) holds no model; each
worker (``chatsvc worker``, ``chatsvc.worker.Worker``) runs one engine. They share only Redis. This module
names the keys and encodes the messages of ``engine.protocol`` as stream entries, with the two that exist only
here: ``Generate`` (an ``AddRequest`` with its dispatch and persona pin) and ``Deltas`` (one step's deltas
for one request). It imports no Redis client and no torch, so both sides and the tests read one definition.
Every entry read is decoded into a typed message with every field checked (``engine.protocol``): a malformed
entry is a ``ProtocolError``, never a value passed on.

Keys (``P`` is ``chatsvc:``; ``{id}`` a worker id, unique per worker process: a restarted worker is a new one)

* ``P workers`` (sorted set): worker id -> registration time. Discovery: a member whose beat key has
  expired is dead; the first gateway that sees it so removes it and its keys.
* ``P worker:{id}`` (string, TTL): the worker's ``Beat`` as JSON, rewritten every ``ttl/4`` seconds with
  the time to live ``ttl``. Its lapse is the worker's death.
* ``P worker:{id}:requests`` (stream): ``Generate`` entries. The worker reads them through the consumer
  group ``engine`` and XACKs (then deletes) an entry when its request has ended, so an entry is never
  run twice at once; it is never run again either, since a dead worker's stream is deleted with it.
* ``P worker:{id}:control`` (stream): ``Abort``, ``Pin``, ``Unpin``, ``Warm`` and ``WantSnapshot`` entries, read with XREAD
  from the start (the stream is as young as the worker).
* ``P worker:{id}:kv`` (string, TTL): the worker's KV block picture (``engine.kv_snapshot()``), written with
  each beat for ``SNAPSHOT_WINDOW_S`` seconds after a ``WantSnapshot``.
* ``P out:{dispatch}`` (stream, TTL): what the worker sends back for one dispatch of a request: ``Deltas``
  entries (every delta one engine step produced for it, in one entry) and at most one ``RequestError``. The
  dispatching gateway reads it with XREAD BLOCK. A request re-dispatched after a worker died gets a new
  dispatch id, so a late write of the dead worker can never mix into the new stream.
* ``P route:session:{sid}`` (string, TTL): the KV home (``Beat.home``) of the worker that served the
  session's last turn (its prefix blocks are cached there): the worker id, or the name of its disk tier's
  directory, which a worker restarted on that directory has too. The record the router reads.
* ``P route:request:{rid}`` (string, TTL): ``{"worker", "dispatch", "base", "prompt_tokens"}`` of a running
  request, so that any gateway can abort it or, if its gateway died, take its stream over (``base``: output
  tokens streamed by earlier dispatches, before a failover; ``prompt_tokens``: the original prompt's length).
  Readers ignore fields they do not know; the last two are optional.
* ``P pins`` (hash): pin key -> a ``Pin`` as JSON (its token ids and ``cache_salt``): the prefixes (personas) a
  worker pins when it serves them (``pin_value``, ``read_pin``).
* ``P reply:{call}`` (list, TTL): the one reply to a ``Pin`` that asked for it (RPUSH by the worker, BLPOP
  by the caller).
* ``P dead_letter`` (stream, capped at about ``DEAD_LETTER_MAXLEN`` entries): every entry either side read and
  could not decode: ``stream`` (where it was), ``id``, ``reason`` and ``entry`` (its fields as JSON, cut at
  ``DEAD_LETTER_ENTRY_CHARS``), for an operator to look at (``XREVRANGE chatsvc:dead_letter + - COUNT 10``).

Every stream entry has three fields: ``v`` (this module's ``VERSION``), ``type`` (the message's ``TYPE``)
and ``data`` (the message's fields as a JSON object). A reader refuses another version with
``ProtocolError`` rather than guessing; a later version may add fields (readers ignore unknown ones) but
must bump ``VERSION`` to change or remove one.

A reader that cannot decode an entry drops it into the dead-letter stream, answers its sender where the entry
names one it can reach (``reply_target``: a ``Generate`` of this version gets a ``RequestError`` of kind
``TransportError`` on its output stream, so the gateway fails the request at once instead of waiting) and reads
on: no entry stops a loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from annotated_types import MaxLen, MinLen

from engine.protocol import (
    MAX_ID_CHARS,
    Abort,
    AddRequest,
    EngineStats,
    Id,
    Number,
    Pin,
    ProtocolError,
    RequestDelta,
    RequestError,
    Unpin,
    WantSnapshot,
    Warm,
    dump_json,
    encode_command,
    parse_json,
)

__all__ = ["VERSION", "GROUP", "Keys", "Generate", "Deltas", "Beat", "Message", "encode", "decode", "Entry",
           "entries", "raise_if_cancelled", "DEAD_LETTER_MAXLEN", "dead_letter", "reply_target", "call_target"]

VERSION = 2
GROUP = "engine"  # the consumer group of every request stream
MAX_ENTRY_BYTES = 64 << 20  # a larger entry is refused unread
DEAD_LETTER_MAXLEN = 1000
DEAD_LETTER_ENTRY_CHARS = 16 << 10  # of a dead entry's fields: enough to see what it was, bounded


@dataclass(frozen=True)
class Keys:
    prefix: str = "chatsvc:"

    @property
    def workers(self) -> str:
        return f"{self.prefix}workers"

    @property
    def pins(self) -> str:
        return f"{self.prefix}pins"

    def beat(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}"

    def requests(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:requests"

    def control(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:control"

    def kv(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:kv"

    def out(self, dispatch: str) -> str:
        return f"{self.prefix}out:{dispatch}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}route:session:{session_id}"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}route:request:{request_id}"

    def reply(self, call: str) -> str:
        return f"{self.prefix}reply:{call}"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}dead_letter"


# ---- messages only this transport has ------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    """Run a request: ``add`` already holds any tokens an earlier dispatch streamed (failover), and its
    ``params.max_tokens`` counts only what is left (``params.seed_offset``: how many were sampled).
    ``dispatch`` names this dispatch's output stream; ``pin``: a pin key whose prefix the prompt starts with,
    which the worker pins (once) if it has not yet."""

    TYPE: ClassVar[str] = "generate"
    add: AddRequest
    dispatch: Annotated[str, MinLen(1), MaxLen(64)]
    pin: Id | None = None


@dataclass(frozen=True)
class Deltas:
    """The deltas one engine step (or a few, if the writer fell behind) produced for one request. ``sent``: the
    worker's wall clock when it wrote them, so the gateway can measure the Redis hop (on one machine, or
    with synchronised clocks)."""

    TYPE: ClassVar[str] = "deltas"
    deltas: list[RequestDelta]
    sent: Number = 0.0


@dataclass(frozen=True)
class Beat:
    """A worker's registration and load, rewritten with every heartbeat."""

    worker: str
    pid: int
    host: str
    model_name: str
    max_model_len: int
    block_size: int
    time: float  # the worker's wall clock at writing
    draining: bool = False
    pins: list[str] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    kv_home: str = ""  # the disk tier's lasting name (engine.kv_disk.kv_home); "" without a disk tier

    @property
    def home(self) -> str:
        """Where this worker's cached KV lives: its disk tier's directory, outliving the process, else the
        process itself (the pool and host tier die with it)."""
        return self.kv_home or self.worker

    @property
    def load(self) -> int:
        return self.stats.requests_running + self.stats.requests_waiting

    @property
    def free_blocks(self) -> int:
        return self.stats.kv_blocks_free

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "stats": self.stats.to_json()})

    @classmethod
    def from_json(cls, text: str) -> Beat:
        return parse_json(cls, text)


Message = Generate | Abort | Pin | Unpin | Warm | WantSnapshot | Deltas | RequestError
# What a stream entry's ``type`` may name (commands other than these travel only inside a Generate).
_TYPES: dict[str, type[Message]] = {
    "error": RequestError, **{c.TYPE: c for c in (Generate, Deltas, Abort, Pin, Unpin, Warm, WantSnapshot)}}


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to stop.

    redis-py can swallow the CancelledError that a ``cancel()`` delivers while a command is in flight: the
    command completes and the caller goes on, with only ``Task.cancelling()`` left to tell. Every loop over
    Redis commands on either side calls this once per iteration, so a cancelled loop still ends."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


Entry = dict[str, str]  # a stream entry's fields, as XREAD returns them (decoded to str)


def pin_value(key: str, token_ids: list[int], cache_salt: str | None) -> str:
    """The ``pins`` hash's value for a prefix: the ``Pin`` a worker applies when it first serves it."""
    return dump_json(Pin(key, token_ids, None, cache_salt))


def read_pin(raw: str | bytes) -> Pin:
    """A ``pins`` hash value, every field checked; ``ProtocolError`` otherwise."""
    return parse_json(Pin, raw)


def entries(resp: list[tuple[str, list[tuple[str, Entry]]]] | None) -> list[tuple[str, Entry]]:
    """The (entry id, fields) pairs of an XREAD/XREADGROUP reply, over all its streams."""
    return [entry for _stream, stream_entries in resp or [] for entry in stream_entries]


def encode(msg: Message) -> dict[str, str]:
    """A message as the fields of one stream entry."""
    if isinstance(msg, Generate):  # its add travels in its command form, type and all
        data = json.dumps({**dataclasses.asdict(msg), "add": encode_command(msg.add)}, separators=(",", ":"))
    else:
        data = dump_json(msg)
    kind = "error" if isinstance(msg, RequestError) else msg.TYPE
    return {"v": str(VERSION), "type": kind, "data": data}


def decode(entry: dict[str, str]) -> Message:
    """The message of one stream entry (its fields as XREAD returns them, decoded to str); ``ProtocolError``
    for anything that is not a well-formed message of this version."""
    if not isinstance(entry, dict) or entry.get("v") != str(VERSION):
        raise ProtocolError(f"message format version {str(entry.get('v') if isinstance(entry, dict) else None)[:20]!r}, "
                            f"this side speaks {VERSION}")
    kind, raw = entry.get("type", ""), entry.get("data")
    cls = _TYPES.get(kind)
    if cls is None:
        raise ProtocolError(f"not a worker message: type {str(kind)[:40]!r}")
    if not isinstance(raw, str) or len(raw) > MAX_ENTRY_BYTES:
        raise ProtocolError("an entry's data must be a JSON object of bounded size")
    return parse_json(cls, raw)


def dead_letter(stream: str, entry_id: str, fields: object, reason: str) -> dict[str, str]:
    """The dead-letter entry of an entry that could not be decoded: where it was, why, and (cut) what."""
    try:
        raw = json.dumps(fields, ensure_ascii=False)
    except (TypeError, ValueError):
        raw = repr(fields)
    return {"stream": stream[:MAX_ID_CHARS], "id": str(entry_id)[:64], "reason": reason[:1000],
            "entry": raw[:DEAD_LETTER_ENTRY_CHARS]}


_DISPATCH = re.compile(r"[A-Za-z0-9_-]{1,64}")


def reply_target(fields: object) -> tuple[str, str] | None:
    """(request id, dispatch) of an undecodable ``Generate`` entry of this version, if its JSON still names
    them: its sender reads that dispatch's output stream and can be told. None for an entry of another version
    (its sender would not read the answer either) or one that names no dispatch."""
    if not isinstance(fields, dict) or fields.get("v") != str(VERSION) or fields.get("type") != Generate.TYPE:
        return None
    raw = fields.get("data")
    if not isinstance(raw, str) or len(raw) > MAX_ENTRY_BYTES:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("add"), dict):
        return None
    dispatch, request_id = data.get("dispatch"), data["add"].get("request_id")
    if not isinstance(dispatch, str) or not _DISPATCH.fullmatch(dispatch):
        return None
    if not isinstance(request_id, str) or len(request_id) > MAX_ID_CHARS:
        request_id = ""
    return request_id, dispatch


def call_target(fields: object) -> str | None:
    """The ``call_id`` an undecodable control entry of this version asks its answer under, if any."""
    if not isinstance(fields, dict) or fields.get("v") != str(VERSION) or not isinstance(fields.get("data"), str):
        return None
    raw = fields["data"]
    if len(raw) > MAX_ENTRY_BYTES:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    call = data.get("call_id") if isinstance(data, dict) else None
    return call if isinstance(call, str) and _DISPATCH.fullmatch(call) else None
