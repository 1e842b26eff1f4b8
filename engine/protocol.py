"""The engine protocol: what passes between an engine client and an engine core, whatever carries it.

An engine core (``engine.core.EngineCore``) owns the model, the KV cache and the scheduler and runs the step
loop. A client (the gateway's side) sends it commands and gets back one ``StepOutput`` per step. The channel
between them is a transport's business: a queue to a thread (``engine.async_engine``), a pipe to a child
process (``engine.process``), Redis Streams to a worker on another machine (``engine.streams``). Every
transport carries the messages defined here and nothing else, so the rules of the seam are written once.

This module imports no torch and no tokenizer: a gateway without a model (``chatsvc serve --engine redis``)
imports it cheaply. Each message has one JSON form (``to_json``/``from_json``, or ``encode_command`` /
``decode_command`` for the command union), used where a message leaves the process; a reader validates every
field it decodes (types, bounds) and raises ``ProtocolError`` instead of passing a malformed value on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.request import SamplingParams

__all__ = [
    "PROTOCOL_VERSION", "SNAPSHOT_WINDOW_S", "QueueFullError", "EngineDeadError", "StreamOverflowError",
    "ProtocolError", "RequestError", "RequestDelta", "AddRequest", "Abort", "Pin", "Unpin", "WantSnapshot",
    "Shutdown", "Command", "CallReply", "EngineStats", "WorkerStats", "KVSnapshot", "PoolView", "StepOutput",
    "EngineInfo", "encode_command", "decode_command", "encode_params", "decode_params",
]

PROTOCOL_VERSION = 2
# A snapshot request keeps the engine attaching fresh KV pictures to its outputs this long: the Memory view
# polls every second, and a picture is an O(blocks) walk the engine should not take when nobody looks.
SNAPSHOT_WINDOW_S = 3.0

# Bounds every decoded field is held to: a message from another process is input, not trusted state.
MAX_ID_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1
MAX_TOKENS_PER_MESSAGE = 1 << 20
MAX_SEED_OFFSET = 1 << 20
MAX_TEXT_CHARS = 1 << 22


# ---- errors --------------------------------------------------------------------------------------


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine is not running (never started, stopped, or its thread/process/worker died)."""


class StreamOverflowError(RuntimeError):
    """A request's reader fell so far behind that its unread output passed ``StreamLimits.max_buffered``;
    the request was aborted rather than buffered without bound."""

    code = "stream_overflow"


class ProtocolError(ValueError):
    """A message of another protocol version, of no known type, or with a field out of its bounds."""


_ERROR_KINDS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "QueueFullError": QueueFullError, "EngineDeadError": EngineDeadError,
    "StreamOverflowError": StreamOverflowError, "RuntimeError": RuntimeError,
}


@dataclass(frozen=True)
class RequestError:
    """A request's failure as data: the kind of error its stream raises and the message. Exceptions never
    cross a channel as objects (pickling one can fail, and JSON cannot carry one); this does, everywhere."""

    request_id: str
    kind: str
    message: str

    @classmethod
    def of(cls, request_id: str, exc: BaseException) -> RequestError:
        name = type(exc).__name__
        return cls(request_id, name if name in _ERROR_KINDS else "RuntimeError", str(exc))

    def exception(self) -> Exception:
        return _ERROR_KINDS.get(self.kind, RuntimeError)(self.message)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RequestError:
        d = _obj(data, "error")
        return cls(_str(d.get("request_id", ""), "request_id"), _str(d["kind"], "kind"),
                   _str(d.get("message", ""), "message", MAX_TEXT_CHARS))


# ---- field checks --------------------------------------------------------------------------------


def _obj(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError(f"{what} must be an object, got {type(v).__name__}")
    return v


def _str(v: Any, what: str, limit: int = MAX_ID_CHARS) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise ProtocolError(f"{what} must be a string of at most {limit} characters")
    return v


def _opt_str(v: Any, what: str, limit: int = MAX_ID_CHARS) -> str | None:
    return None if v is None else _str(v, what, limit)


def _int(v: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}]")
    return v


def _float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ProtocolError(f"{what} must be a finite number")
    return float(v)


def _token_ids(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_TOKENS_PER_MESSAGE:
        raise ProtocolError(f"{what} must be a list of at most {MAX_TOKENS_PER_MESSAGE} token ids")
    return [_int(t, what, 0, MAX_TOKEN_ID) for t in v]


# ---- engine -> client: a request's output --------------------------------------------------------


@dataclass
class RequestDelta:
    """What one step added to one sample of a request (the unit of streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    request_finished: bool = False
    stop_reason: int | str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RequestDelta:
        d = _obj(data, "delta")
        raw_lp = d.get("logprobs")
        logprobs: list[dict[int, float]] | None = None
        if raw_lp is not None:  # JSON object keys are strings; token ids are ints
            if not isinstance(raw_lp, list):
                raise ProtocolError("logprobs must be a list")
            try:
                logprobs = [{int(k): _float(p, "logprob") for k, p in _obj(step, "logprobs").items()}
                            for step in raw_lp]
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"bad logprobs: {exc}") from None
        stop = d.get("stop_reason")
        if stop is not None and not isinstance(stop, int | str):
            raise ProtocolError("stop_reason must be a token id or a string")
        return cls(
            request_id=_str(d["request_id"], "request_id"), index=_int(d["index"], "index", 0, 1 << 16),
            text=_str(d["text"], "text", MAX_TEXT_CHARS), token_ids=_token_ids(d["token_ids"], "token_ids"),
            finished=bool(d["finished"]), finish_reason=_opt_str(d.get("finish_reason"), "finish_reason"),
            logprobs=logprobs, prompt_tokens=_int(d["prompt_tokens"], "prompt_tokens"),
            completion_tokens=_int(d["completion_tokens"], "completion_tokens"),
            cached_tokens=_int(d["cached_tokens"], "cached_tokens"),
            request_finished=bool(d.get("request_finished", False)), stop_reason=stop,
        )


# ---- client -> engine: commands ------------------------------------------------------------------


def encode_params(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def decode_params(data: Any) -> SamplingParams:
    """Sampling parameters from their JSON form, validated (``SamplingParams`` checks its own ranges)."""
    d = _obj(data, "params")
    unknown = set(d) - _PARAM_NAMES
    if unknown:
        raise ProtocolError(f"unknown sampling parameters: {sorted(unknown)[:5]}")
    _int(d.get("seed_offset", 0), "seed_offset", 0, MAX_SEED_OFFSET)
    try:
        return SamplingParams(**d)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad sampling parameters: {exc}") from None


@dataclass(frozen=True)
class AddRequest:
    """Run a request the client has already validated (``engine.request.make_request``)."""

    TYPE: ClassVar[str] = "add"
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    prompt: str | None = None
    arrival_time: float = 0.0  # time.monotonic() is one clock system-wide, so it means the same in a child


@dataclass(frozen=True)
class Abort:
    """End a request now (its stream ends with finish_reason "abort"); ``call_id`` asks for a ``CallReply``."""

    TYPE: ClassVar[str] = "abort"
    request_id: str
    call_id: str | None = None


@dataclass(frozen=True)
class Pin:
    """Pin the cached full blocks of a computed prefix under ``key``; the reply's result is the tokens pinned."""

    TYPE: ClassVar[str] = "pin"
    key: str
    prompt_token_ids: list[int]
    call_id: str | None = None


@dataclass(frozen=True)
class Unpin:
    TYPE: ClassVar[str] = "unpin"
    key: str


@dataclass(frozen=True)
class WantSnapshot:
    """Attach KV pictures to the outputs for the next ``SNAPSHOT_WINDOW_S`` seconds."""

    TYPE: ClassVar[str] = "want_snapshot"


@dataclass(frozen=True)
class Shutdown:
    """Abort every open request, send their last output, and stop."""

    TYPE: ClassVar[str] = "shutdown"


Command = AddRequest | Abort | Pin | Unpin | WantSnapshot | Shutdown
_COMMANDS: dict[str, type[Command]] = {c.TYPE: c for c in (AddRequest, Abort, Pin, Unpin, WantSnapshot, Shutdown)}


def encode_command(cmd: Command) -> dict[str, Any]:
    """A command as a JSON object: ``{"type": ..., fields...}``."""
    body = {f.name: getattr(cmd, f.name) for f in dataclasses.fields(cmd)}
    if isinstance(cmd, AddRequest):
        body["params"] = encode_params(cmd.params)
    return {"type": cmd.TYPE, **body}


def decode_command(data: Any) -> Command:
    """The command of a JSON object, every field checked; ``ProtocolError`` otherwise."""
    d = _obj(data, "command")
    cls = _COMMANDS.get(str(d.get("type", "")))
    if cls is None:
        raise ProtocolError(f"not a command: type {str(d.get('type'))[:40]!r}")
    try:
        match cls.TYPE:
            case "add":
                return AddRequest(_str(d["request_id"], "request_id"), decode_params(d["params"]),
                                  _token_ids(d["prompt_token_ids"], "prompt_token_ids"),
                                  _opt_str(d.get("prompt"), "prompt", MAX_TEXT_CHARS),
                                  _float(d.get("arrival_time", 0.0), "arrival_time"))
            case "abort":
                return Abort(_str(d["request_id"], "request_id"), _opt_str(d.get("call_id"), "call_id"))
            case "pin":
                return Pin(_str(d["key"], "key"), _token_ids(d["prompt_token_ids"], "prompt_token_ids"),
                           _opt_str(d.get("call_id"), "call_id"))
            case "unpin":
                return Unpin(_str(d["key"], "key"))
            case "want_snapshot":
                return WantSnapshot()
            case _:
                return Shutdown()
    except KeyError as exc:
        raise ProtocolError(f"{cls.TYPE} is missing {exc}") from None


@dataclass(frozen=True)
class CallReply:
    """The answer to a command that carried a ``call_id``: ``result`` (a pin's token count) or ``error``."""

    call_id: str
    result: int | None = None
    error: RequestError | None = None


# ---- numbers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStats:
    """One worker's load, as the model-less gateway sees it in the worker's beat."""

    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    requests_swapped: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    pins: tuple[str, ...] = ()
    draining: bool = False


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters. The core fills the engine's own (blocks, requests, cache, preemptions, cost
    estimates); the client adds its view (state, heartbeat age, restarts, stream counters); an engine spread
    over workers adds the routing figures. Every consumer reads these fields by name, nowhere as strings."""

    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    cpu_blocks_total: int = 0
    cpu_blocks_free: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    requests_swapped: int = 0
    max_waiting: int = 0
    swap_seconds_per_block: float = 0.0
    prefill_seconds_per_token: float = 0.0
    step_threads: int | None = None
    step_thread_switches: int | None = None
    # What the engine computes with (kernels.runtime.KernelRuntime: kernel set, ISA, dtype, threads)
    runtime: dict[str, str | int | None] | None = None
    # The client's view
    engine_state: str = "running"
    last_step_age_s: float = 0.0
    engine_restarts: int = 0
    stream_deltas_coalesced: int = 0
    streams_overflowed: int = 0
    # An engine spread over workers (chatsvc.remote_engine)
    workers: dict[str, WorkerStats] | None = None
    route_decisions: dict[str, int] | None = None
    failovers: int = 0
    hop_seconds: float = 0.0
    hop_entries: int = 0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("workers", "route_decisions", "runtime"):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: Any) -> EngineStats:
        """The counters a worker published; unknown keys are ignored, known ones checked."""
        d = _obj(data, "stats")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d or f.name in ("workers", "route_decisions"):
                continue
            v = d[f.name]
            if f.name == "engine_state":
                kwargs[f.name] = _str(v, f.name, 64)
            elif f.name == "runtime":
                kwargs[f.name] = None if v is None else _runtime(v)
            elif f.name in ("step_threads", "step_thread_switches"):
                kwargs[f.name] = None if v is None else _int(v, f.name)
            elif f.type == "float":
                kwargs[f.name] = _float(v, f.name)
            else:
                kwargs[f.name] = _int(v, f.name)
        return cls(**kwargs)

    def worker_view(self, pins: tuple[str, ...], draining: bool) -> WorkerStats:
        return WorkerStats(
            kv_blocks_total=self.kv_blocks_total, kv_blocks_free=self.kv_blocks_free,
            kv_blocks_cached=self.kv_blocks_cached, requests_running=self.requests_running,
            requests_waiting=self.requests_waiting, requests_swapped=self.requests_swapped,
            prefix_cache_queried_tokens=self.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens, pins=pins, draining=draining)


@dataclass(frozen=True)
class PoolView:
    """Where one worker's blocks sit in a merged snapshot (block ids offset by ``offset``)."""

    worker: str
    offset: int
    num_blocks: int


@dataclass(frozen=True)
class KVSnapshot:
    """The block pool at one moment: each block's state ("free", "cached", "used", "shared", "pinned") and
    reference count, the blocks each running request holds, and each pinned prefix's blocks."""

    block_size: int = 16
    num_blocks: int = 0
    state: list[str] = field(default_factory=list)
    refcounts: list[int] = field(default_factory=list)
    cpu_used: int = 0
    requests: dict[str, list[int]] = field(default_factory=dict)
    pins: dict[str, list[int]] = field(default_factory=dict)
    pools: list[PoolView] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> KVSnapshot:
        d = _obj(data, "snapshot")
        n = _int(d.get("num_blocks", 0), "num_blocks", 0, 1 << 24)

        def blocks(v: Any, what: str) -> dict[str, list[int]]:
            return {_str(k, what): [_int(b, what, 0, n) for b in _list(bs, what)]
                    for k, bs in _obj(v or {}, what).items()}

        state = [_str(s, "state", 16) for s in _list(d.get("state", []), "state")]
        refcounts = [_int(r, "refcounts") for r in _list(d.get("refcounts", []), "refcounts")]
        if len(state) > n or len(refcounts) > n:
            raise ProtocolError("snapshot lists are longer than its pool")
        return cls(block_size=_int(d.get("block_size", 16), "block_size", 1, 1 << 16), num_blocks=n,
                   state=state, refcounts=refcounts, cpu_used=_int(d.get("cpu_used", 0), "cpu_used"),
                   requests=blocks(d.get("requests"), "requests"), pins=blocks(d.get("pins"), "pins"))


def _runtime(v: Any) -> dict[str, str | int | None]:
    d = _obj(v, "runtime")
    if len(d) > 16:
        raise ProtocolError("runtime has too many entries")
    out: dict[str, str | int | None] = {}
    for k, x in d.items():
        key = _str(k, "runtime key", 32)
        out[key] = x if x is None else _int(x, key) if isinstance(x, int) else _str(x, key, 512)
    return out


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise ProtocolError(f"{what} must be a list")
    return v


# ---- engine -> client ----------------------------------------------------------------------------


@dataclass
class StepOutput:
    """Everything the core has to tell its client after one step (or one batch of commands): the deltas,
    the requests that failed, replies to calls, how many ``AddRequest`` commands it has taken in so far (so
    the client can count the ones still in flight against the waiting queue), the core's clock at sending
    (its heartbeat), its counters, and a KV picture while one is wanted."""

    deltas: list[RequestDelta] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    replies: list[CallReply] = field(default_factory=list)
    adds_seen: int = 0
    heartbeat: float = 0.0
    stats: EngineStats | None = None
    snapshot: KVSnapshot | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What a core says of itself once, when it is ready: the limits requests are validated against on the
    client side, and how it runs (for logs, ``/v1/kv`` and ``/metrics``)."""

    protocol: int
    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_waiting: int
    block_size: int
    eos_token_ids: frozenset[int]
    threads: int
    allocator: str
    omp_wait_policy: str
    runtime: dict[str, str | int | None]  # kernels.runtime.KernelRuntime.as_dict()
    runtime_summary: str  # its one line for the logs
    stats: EngineStats
    snapshot: KVSnapshot
