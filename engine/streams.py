"""Messages between gateways and engine workers over Redis (format version 1), and their Redis keys.

A gateway (``chatsvc serve --engine redis``, ``chatsvc.remote_engine.RemoteEngine``) holds no model; each
worker (``chatsvc worker``, ``chatsvc.worker.Worker``) runs one engine. They share only Redis. This module
names the keys, defines each message as a frozen dataclass and encodes it; it imports no Redis client, so
both sides and the tests read one definition.

Keys (``P`` is ``chatsvc:``; ``{id}`` a worker id, unique per worker process: a restarted worker is a new one)

* ``P workers`` (sorted set): worker id -> registration time. Discovery: a member whose beat key has
  expired is dead; the first gateway that sees it so removes it and its keys.
* ``P worker:{id}`` (string, TTL): the worker's ``Beat`` as JSON, rewritten every ``ttl/4`` seconds with
  the time to live ``ttl``. Its lapse is the worker's death.
* ``P worker:{id}:requests`` (stream): ``Generate`` entries. The worker reads them through the consumer
  group ``engine`` and XACKs (then deletes) an entry when its request has ended, so an entry is never
  run twice at once; it is never run again either, since a dead worker's stream is deleted with it.
* ``P worker:{id}:control`` (stream): ``Abort``, ``Pin``, ``Unpin`` and ``WantKV`` entries, read with XREAD
  from the start (the stream is as young as the worker).
* ``P worker:{id}:kv`` (string, TTL): the worker's KV block picture (``engine.kv_snapshot()``), written with
  each beat for ``KV_WINDOW_S`` seconds after a ``WantKV``.
* ``P out:{dispatch}`` (stream, TTL): what the worker sends back for one dispatch of a request: ``Deltas``
  entries (every delta one engine step produced for it, in one entry) and at most one ``Error``. The
  dispatching gateway reads it with XREAD BLOCK. A request re-dispatched after a worker died gets a new
  dispatch id, so a late write of the dead worker can never mix into the new stream.
* ``P route:session:{sid}`` (string, TTL): the worker that served the session's last turn (its prefix
  blocks are cached there): the explicit session -> worker record the router reads.
* ``P route:request:{rid}`` (string, TTL): ``{"worker", "dispatch", "base", "prompt_tokens"}`` of a running
  request, so that any gateway can abort it or, if its gateway died, take its stream over (``base``: output
  tokens streamed by earlier dispatches, before a failover; ``prompt_tokens``: the original prompt's length).
  Readers ignore fields they do not know; the last two are optional.
* ``P pins`` (hash): pin key -> JSON token ids: the prefixes (personas) a worker pins when it serves them.
* ``P reply:{call}`` (list, TTL): the one reply to a ``Pin`` that asked for it (RPUSH by the worker, BLPOP
  by the caller).

Every stream entry has three fields: ``v`` (this module's ``VERSION``), ``type`` (the message's ``TYPE``)
and ``data`` (the message's fields as a JSON object). A reader refuses another version with
``ProtocolError`` rather than guessing; a later version may add fields (readers ignore unknown ones) but
must bump ``VERSION`` to change or remove one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.engine import RequestDelta
from engine.request import SamplingParams

__all__ = ["VERSION", "Keys", "Generate", "Deltas", "Error", "Abort", "Pin", "Unpin", "WantKV", "Beat",
           "Message", "ProtocolError", "encode", "decode", "encode_delta", "decode_delta", "raise_if_cancelled"]

VERSION = 1
KV_WINDOW_S = 3.0  # a WantKV keeps the worker publishing its KV picture this long
GROUP = "engine"  # the consumer group of every request stream


class ProtocolError(ValueError):
    """An entry of another format version, or not a message of this module."""


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


# ---- gateway -> worker ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    """Run a request. ``prompt_token_ids`` already holds any tokens an earlier dispatch streamed (failover), and
    ``params.max_tokens`` counts only what is left (``params.seed_offset``: how many of them were sampled). ``pin``: a pin key whose prefix the prompt starts with; the
    worker pins it (once) if it has not yet."""

    TYPE: ClassVar[str] = "generate"
    request_id: str
    dispatch: str
    params: SamplingParams
    prompt_token_ids: list[int]
    pin: str | None = None


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True)
class Pin:
    """Pin a prefix; ``reply`` (a call id), when given, gets ``{"pinned": n}`` or ``{"error": ...}``."""

    TYPE: ClassVar[str] = "pin"
    key: str
    token_ids: list[int]
    reply: str | None = None


@dataclass(frozen=True)
class Unpin:
    TYPE: ClassVar[str] = "unpin"
    key: str


@dataclass(frozen=True)
class WantKV:
    TYPE: ClassVar[str] = "want_kv"


# ---- worker -> gateway ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Deltas:
    """The deltas one engine step (or a few, if the writer fell behind) produced for one request. ``sent``: the
    worker's wall clock when it wrote them, so the gateway can measure the Redis hop (on one machine, or
    with synchronised clocks)."""

    TYPE: ClassVar[str] = "deltas"
    deltas: list[RequestDelta]
    sent: float = 0.0


@dataclass(frozen=True)
class Error:
    """The request failed on the worker. ``kind``: ``ValueError`` (bad request), ``QueueFullError``,
    ``EngineDeadError``, ``WorkerGone`` (the worker is leaving and did not start it: run it elsewhere) or
    ``RuntimeError`` (anything else)."""

    TYPE: ClassVar[str] = "error"
    kind: str
    message: str


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
    stats: dict[str, Any] = field(default_factory=dict)  # engine.stats(): blocks, running/waiting/swapped...

    @property
    def load(self) -> int:
        return int(self.stats.get("requests_running", 0)) + int(self.stats.get("requests_waiting", 0))

    @property
    def free_blocks(self) -> int:
        return int(self.stats.get("kv_blocks_free", 0))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Beat:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


Message = Generate | Abort | Pin | Unpin | WantKV | Deltas | Error
_TYPES: dict[str, type[Message]] = {c.TYPE: c for c in (Generate, Abort, Pin, Unpin, WantKV, Deltas, Error)}


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to stop.

    redis-py (8.1) can swallow the CancelledError that a ``cancel()`` delivers while a command is in flight:
    the command completes and the caller goes on, with only ``Task.cancelling()`` left to tell. Every loop
    over Redis commands on either side calls this once per iteration, so a cancelled loop still ends."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def encode_delta(d: RequestDelta) -> dict[str, Any]:
    return dataclasses.asdict(d)


def decode_delta(data: dict[str, Any]) -> RequestDelta:
    logprobs = data.get("logprobs")
    if logprobs is not None:  # JSON object keys are strings; token ids are ints
        logprobs = [{int(k): float(v) for k, v in step.items()} for step in logprobs]
    names = {f.name for f in dataclasses.fields(RequestDelta)}
    return RequestDelta(**{**{k: v for k, v in data.items() if k in names}, "logprobs": logprobs})


def _fields(msg: Message) -> dict[str, Any]:
    match msg:
        case Generate():
            return {"request_id": msg.request_id, "dispatch": msg.dispatch, "params": dataclasses.asdict(msg.params),
                    "prompt_token_ids": msg.prompt_token_ids, "pin": msg.pin}
        case Deltas():
            return {"deltas": [encode_delta(d) for d in msg.deltas], "sent": msg.sent}
        case _:
            return dataclasses.asdict(msg)


def encode(msg: Message) -> dict[str, str]:
    """A message as the fields of one stream entry."""
    return {"v": str(VERSION), "type": msg.TYPE, "data": json.dumps(_fields(msg), separators=(",", ":"))}


def decode(entry: dict[str, str]) -> Message:
    """The message of one stream entry (its fields as XREAD returns them, decoded to str)."""
    if entry.get("v") != str(VERSION):
        raise ProtocolError(f"message format version {entry.get('v')!r}, this side speaks {VERSION}")
    cls = _TYPES.get(entry.get("type", ""))
    if cls is None or "data" not in entry:
        raise ProtocolError(f"not a worker message: {entry!r:.200}")
    data: dict[str, Any] = json.loads(entry["data"])
    if cls is Generate:
        params = {k: v for k, v in data["params"].items() if k in {f.name for f in dataclasses.fields(SamplingParams)}}
        return Generate(data["request_id"], data["dispatch"], SamplingParams(**params),
                        [int(t) for t in data["prompt_token_ids"]], data.get("pin"))
    if cls is Deltas:
        return Deltas([decode_delta(d) for d in data["deltas"]], float(data.get("sent", 0.0)))
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})
