"""The engine protocol: what passes between an engine client and an engine core, whatever carries it.

An engine core (``engine.core.EngineCore``) owns the model, the KV cache and the scheduler and runs the step
loop. A client (the gateway's side) sends it commands and gets back one ``StepOutput`` per step. The channel
between them is a transport's business: a queue to a thread (``engine.async_engine``), a pipe to a child
process (``engine.process``), Redis Streams to a worker on another machine (``engine.streams``). Every
transport carries the messages defined here and nothing else, so the rules of the seam are written once.

This module imports no torch and no tokenizer: a gateway without a model (``chatsvc serve --engine redis``)
imports it cheaply. Each message has one JSON form (``to_json``/``from_json``, or ``encode_command`` /
``decode_command`` for the command union), used where a message leaves the process. A reader validates every
field it decodes against the bounds its annotation carries (pydantic checks them; the thread and pipe
transports pass the objects as they are and never pay for it) and raises ``ProtocolError`` instead of
passing a malformed value on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, NotRequired, Self, TypeVar

from annotated_types import Ge, Le, MaxLen
from pydantic import (
    AllowInfNan,
    ConfigDict,
    PlainValidator,
    Strict,
    TypeAdapter,
    ValidationError,
    with_config,
)
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from engine.request import MAX_CACHE_SALT_CHARS, SamplingParams

__all__ = [
    "PROTOCOL_VERSION", "SNAPSHOT_WINDOW_S", "QueueFullError", "EngineDeadError", "StreamOverflowError", "TransportError",
    "ProtocolError", "RequestError", "RequestDelta", "AddRequest", "Abort", "Pin", "Unpin", "WantSnapshot",
    "Shutdown", "Command", "CallReply", "EngineStats", "WorkerStats", "KVSnapshot", "PoolView", "StepOutput",
    "EngineInfo", "encode_command", "decode_command", "parse", "parse_json", "dump_json",
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

# The field types that carry them (plain ``str``/``int``/``float`` to the type checker). Numbers are strict:
# a bool or a string is not an integer, and a float must be finite.
Id = Annotated[str, MaxLen(MAX_ID_CHARS)]
Text = Annotated[str, MaxLen(MAX_TEXT_CHARS)]
Count = Annotated[int, Strict(), Ge(0), Le(2**63 - 1)]
Number = Annotated[float, Strict(), AllowInfNan(False)]
TokenIds = Annotated[list[Annotated[int, Strict(), Ge(0), Le(MAX_TOKEN_ID)]], MaxLen(MAX_TOKENS_PER_MESSAGE)]
Runtime = Annotated[dict[Annotated[str, MaxLen(32)], Count | Annotated[str, MaxLen(512)] | None], MaxLen(16)]


# ---- errors --------------------------------------------------------------------------------------


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine is not running (never started, stopped, or its thread/process/worker died)."""


class TransportError(EngineDeadError):
    """A message between a client and its engine that the other side could not decode: a version skew or a
    bug, never the caller's input (a client checks a request against the same bounds before sending it), so
    the request fails as an engine failure (the gateway's 503), not as a bad request."""


class StreamOverflowError(RuntimeError):
    """A request's reader fell so far behind that its unread output passed ``StreamLimits.max_buffered``;
    the request was aborted rather than buffered without bound."""

    code = "stream_overflow"


class ProtocolError(ValueError):
    """A message of another protocol version, of no known type, or with a field out of its bounds."""


_ERROR_KINDS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "QueueFullError": QueueFullError, "EngineDeadError": EngineDeadError,
    "StreamOverflowError": StreamOverflowError, "RuntimeError": RuntimeError, "TransportError": TransportError,
}


# ---- decoding ------------------------------------------------------------------------------------

T = TypeVar("T")
_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[T]) -> TypeAdapter[T]:
    if cls not in _ADAPTERS:  # built on first use: a gateway that decodes nothing never pays for it
        _ADAPTERS[cls] = TypeAdapter(cls)
    adapter: TypeAdapter[T] = _ADAPTERS[cls]
    return adapter


def parse(cls: type[T], data: Any) -> T:
    """A message of type ``cls`` from its JSON form (as ``json.loads`` returns it), every field checked;
    unknown fields are ignored (a later version may add some). ``ProtocolError`` otherwise."""
    return _validate(cls, data, from_text=False)


def parse_json(cls: type[T], text: str | bytes) -> T:
    """As ``parse``, from the JSON text itself (one pass: the Redis path decodes every step's deltas so)."""
    return _validate(cls, text, from_text=True)


def dump_json(msg: Any) -> str:
    """A message's JSON form as text, written in one pass (the Redis path writes every step's deltas so)."""
    return _adapter(type(msg)).dump_json(msg).decode()


def _validate(cls: type[T], data: Any, from_text: bool) -> T:
    adapter = _adapter(cls)
    try:
        return adapter.validate_json(data) if from_text else adapter.validate_python(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in err["loc"]) or "message"
        raise ProtocolError(f"malformed {cls.__name__}: {where}: {err['msg']}"[:500]) from None


class _Json:
    """``to_json``/``from_json`` of a message dataclass."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return parse(cls, data)


@dataclass(frozen=True)
class RequestError(_Json):
    """A request's failure as data: the kind of error its stream raises and the message. Exceptions never
    cross a channel as objects (pickling one can fail, and JSON cannot carry one); this does, everywhere."""

    request_id: Id
    kind: Id
    message: Text

    @classmethod
    def of(cls, request_id: str, exc: BaseException) -> RequestError:
        name = type(exc).__name__
        return cls(request_id, name if name in _ERROR_KINDS else "RuntimeError", str(exc))

    def exception(self) -> Exception:
        return _ERROR_KINDS.get(self.kind, RuntimeError)(self.message)


# ---- engine -> client: a request's output --------------------------------------------------------


@dataclass
class RequestDelta(_Json):
    """What one step added to one sample of a request (the unit of streaming)."""

    request_id: Id
    index: Annotated[int, Strict(), Ge(0), Le(1 << 16)]
    text: Text
    token_ids: TokenIds
    finished: bool
    finish_reason: Id | None
    logprobs: list[dict[int, Number]] | None  # JSON object keys are strings; decoding makes them ints again
    prompt_tokens: Count
    completion_tokens: Count
    cached_tokens: Count
    request_finished: bool = False
    stop_reason: Annotated[int, Strict()] | Text | None = None


# ---- client -> engine: commands ------------------------------------------------------------------

# Bounds of the sampling parameters a message may carry: no value passes that could make the engine's step
# loop spend unbounded time or memory on one request (a stop list scanned at every token, a seed offset's
# draws skipped before the first token), nor a number the engine's arithmetic cannot take (NaN, a bigint).
# The gateway's own limits are tighter; these are what any sender is held to.
MAX_SEQS_PER_REQUEST = 1 << 10
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20

TokenId = Annotated[int, Strict(), Ge(0), Le(MAX_TOKEN_ID)]
SeqCount = Annotated[int, Strict(), Ge(1), Le(MAX_SEQS_PER_REQUEST)]
OutputTokens = Annotated[int, Strict(), Ge(0), Le(MAX_TOKENS_PER_MESSAGE)]


@with_config(ConfigDict(extra="forbid"))
class _GrammarJson(TypedDict):
    kind: Annotated[str, MaxLen(64)]
    schema: Text
    parallel: NotRequired[Annotated[bool, Strict()]]


@with_config(ConfigDict(extra="forbid"))
class _ParamsJson(TypedDict, total=False):
    """``SamplingParams`` as JSON, every field bounded; ``SamplingParams`` then checks how they combine."""

    n: SeqCount
    temperature: Number
    top_p: Number
    top_k: Annotated[int, Strict(), Ge(-1), Le(MAX_TOKEN_ID)]
    min_p: Number
    presence_penalty: Number
    frequency_penalty: Number
    repetition_penalty: Number
    seed: Annotated[int, Strict(), Ge(-(2**63)), Le(2**64 - 1)] | None
    seed_offset: Annotated[int, Strict(), Ge(0), Le(MAX_SEED_OFFSET)]
    stop: Annotated[list[Annotated[str, MaxLen(MAX_STOP_STRING_CHARS)]], MaxLen(MAX_STOP_STRINGS)]
    stop_token_ids: Annotated[list[TokenId], MaxLen(MAX_STOP_TOKEN_IDS)]
    include_stop_str_in_output: Annotated[bool, Strict()]
    ignore_eos: Annotated[bool, Strict()]
    max_tokens: Annotated[int, Strict(), Ge(1), Le(MAX_TOKENS_PER_MESSAGE)] | None
    min_tokens: OutputTokens
    logprobs: Annotated[int, Strict(), Ge(0), Le(MAX_LOGPROBS)] | None
    skip_special_tokens: Annotated[bool, Strict()]
    use_beam_search: Annotated[bool, Strict()]
    best_of: SeqCount | None
    length_penalty: Number
    early_stopping: Annotated[bool, Strict()] | Literal["never"]
    grammar: _GrammarJson | None
    reserve_output_tokens: Annotated[int, Strict(), Ge(1), Le(MAX_TOKENS_PER_MESSAGE)] | None
    cache_salt: Annotated[str, MaxLen(MAX_CACHE_SALT_CHARS)] | None
    shared_prefix_tokens: Annotated[int, Strict(), Ge(0), Le(MAX_TOKENS_PER_MESSAGE)]


def _params(data: Any) -> SamplingParams:
    """Sampling parameters from their JSON form: every field of its type and within its bound, no unknown
    field, then ``SamplingParams``'s own checks of how they combine."""
    try:
        fields = _adapter(_ParamsJson).validate_python(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in err["loc"]) or "params"
        raise ProtocolError(f"bad sampling parameters: {where}: {err['msg']}"[:500]) from None
    try:
        return SamplingParams(**fields)  # type: ignore[arg-type]  # a GrammarSpec's JSON form is decoded there
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad sampling parameters: {exc}") from None


@dataclass(frozen=True)
class AddRequest:
    """Run a request the client has already validated (``engine.request.make_request``)."""

    TYPE: ClassVar[str] = "add"
    request_id: Id
    params: Annotated[SamplingParams, PlainValidator(_params)]
    prompt_token_ids: TokenIds
    prompt: Text | None = None
    arrival_time: Number = 0.0  # time.monotonic() is one clock system-wide, so it means the same in a child


@dataclass(frozen=True)
class Abort:
    """End a request now (its stream ends with finish_reason "abort"); ``call_id`` asks for a ``CallReply``."""

    TYPE: ClassVar[str] = "abort"
    request_id: Id
    call_id: Id | None = None


@dataclass(frozen=True)
class Pin:
    """Pin the cached full blocks of a computed prefix under ``key``; the reply's result is the tokens pinned.
    ``cache_salt``: the salt the prefix was computed with (``SamplingParams.cache_salt``), whose blocks it
    pins; none for a prefix every tenant shares."""

    TYPE: ClassVar[str] = "pin"
    key: Id
    prompt_token_ids: TokenIds
    call_id: Id | None = None
    cache_salt: Id | None = None


@dataclass(frozen=True)
class Unpin:
    TYPE: ClassVar[str] = "unpin"
    key: Id


@dataclass(frozen=True)
class Warm:
    """A client opened a conversation: bring the KV blocks of its history (``prompt_token_ids``, the prompt
    its next message will extend) up the engine's KV tiers before that message arrives. Best effort, no
    reply; ``key`` (the session) allows one warm in flight at a time."""

    TYPE: ClassVar[str] = "warm"
    key: Id
    prompt_token_ids: TokenIds
    cache_salt: Id | None = None  # the salt the session's requests carry (SamplingParams.cache_salt)
    shared_prefix_tokens: Count = 0


@dataclass(frozen=True)
class WantSnapshot:
    """Attach KV pictures to the outputs for the next ``SNAPSHOT_WINDOW_S`` seconds."""

    TYPE: ClassVar[str] = "want_snapshot"


@dataclass(frozen=True)
class Shutdown:
    """Abort every open request, send their last output, and stop."""

    TYPE: ClassVar[str] = "shutdown"


Command = AddRequest | Abort | Pin | Unpin | Warm | WantSnapshot | Shutdown
_COMMANDS: dict[str, type[Command]] = {c.TYPE: c for c in (AddRequest, Abort, Pin, Unpin, Warm, WantSnapshot,
                                                           Shutdown)}


def encode_command(cmd: Command) -> dict[str, Any]:
    """A command as a JSON object: ``{"type": ..., fields...}``."""
    return {"type": cmd.TYPE, **dataclasses.asdict(cmd)}


def decode_command(data: Any) -> Command:
    """The command of a JSON object, every field checked; ``ProtocolError`` otherwise."""
    kind = data.get("type") if isinstance(data, dict) else None
    cls = _COMMANDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"not a command: type {str(kind)[:40]!r}")
    return parse(cls, data)


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

    kv_blocks_total: Count = 0
    kv_blocks_free: Count = 0
    kv_blocks_cached: Count = 0
    requests_running: Count = 0
    requests_waiting: Count = 0
    requests_swapped: Count = 0
    prefix_cache_queried_tokens: Count = 0
    prefix_cache_hit_tokens: Count = 0
    pins: tuple[Id, ...] = ()
    draining: bool = False


@dataclass(frozen=True)
class EngineStats(_Json):
    """An engine's counters. The core fills the engine's own (blocks, requests, cache, preemptions, cost
    estimates); the client adds its view (state, heartbeat age, restarts, stream counters); an engine spread
    over workers adds the routing figures. Every consumer reads these fields by name, nowhere as strings."""

    kv_blocks_total: Count = 0
    kv_blocks_free: Count = 0
    kv_blocks_cached: Count = 0
    cpu_blocks_total: Count = 0
    cpu_blocks_free: Count = 0
    prefix_cache_queried_tokens: Count = 0
    prefix_cache_hit_tokens: Count = 0
    preemptions_swap: Count = 0
    preemptions_recompute: Count = 0
    requests_running: Count = 0
    requests_waiting: Count = 0
    requests_swapped: Count = 0
    max_waiting: Count = 0
    swap_seconds_per_block: Number = 0.0
    prefill_seconds_per_token: Number = 0.0
    step_threads: Count | None = None
    step_thread_switches: Count | None = None
    # The KV tiers under the pool (engine.kv_tiers); all 0 when they are off
    kv_host_blocks_total: Count = 0
    kv_host_blocks_cached: Count = 0
    kv_host_bytes: Count = 0
    kv_host_hit_blocks: Count = 0
    kv_host_offloaded_blocks: Count = 0
    kv_disk_blocks: Count = 0
    kv_disk_bytes: Count = 0
    kv_disk_hit_blocks: Count = 0
    kv_disk_spilled_blocks: Count = 0
    kv_disk_failed_loads: Count = 0
    kv_disk_dropped_files: Count = 0
    kv_disk_write_failures: Count = 0
    kv_disk_load_seconds: Number = 0.0
    kv_warm_loaded_blocks: Count = 0
    kv_warm_read_blocks: Count = 0
    kv_host_preloaded_blocks: Count = 0
    # What the engine computes with (kernels.runtime.KernelRuntime: kernel set, ISA, dtype, threads)
    runtime: Runtime | None = None
    # The client's view
    engine_state: Annotated[str, MaxLen(64)] = "running"
    last_step_age_s: Number = 0.0
    engine_restarts: Count = 0
    stream_deltas_coalesced: Count = 0
    streams_overflowed: Count = 0
    # An engine spread over workers (chatsvc.remote_engine)
    workers: dict[Id, WorkerStats] | None = None
    route_decisions: dict[Id, Count] | None = None
    failovers: Count = 0
    hop_seconds: Number = 0.0
    hop_entries: Count = 0

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k not in ("workers", "route_decisions", "runtime")}

    def worker_view(self, pins: tuple[str, ...], draining: bool) -> WorkerStats:
        return WorkerStats(**{f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerStats)
                              if f.name not in ("pins", "draining")}, pins=pins, draining=draining)


@dataclass(frozen=True)
class PoolView:
    """Where one worker's blocks sit in a merged snapshot (block ids offset by ``offset``)."""

    worker: Id
    offset: Count
    num_blocks: Count


@dataclass(frozen=True)
class KVSnapshot(_Json):
    """The block pool at one moment: each block's state ("free", "cached", "used", "shared", "pinned") and
    reference count, the blocks each running request holds, and each pinned prefix's blocks."""

    block_size: Annotated[int, Strict(), Ge(1), Le(1 << 16)] = 16
    num_blocks: Annotated[int, Strict(), Ge(0), Le(1 << 24)] = 0
    state: list[Annotated[str, MaxLen(16)]] = field(default_factory=list)
    refcounts: list[Count] = field(default_factory=list)
    cpu_used: Count = 0
    requests: dict[Id, list[Count]] = field(default_factory=dict)
    pins: dict[Id, list[Count]] = field(default_factory=dict)
    pools: list[PoolView] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        snap = parse(cls, data)
        n = snap.num_blocks
        if len(snap.state) > n or len(snap.refcounts) > n:
            raise ProtocolError("snapshot lists are longer than its pool")
        if any(b > n for blocks in (*snap.requests.values(), *snap.pins.values()) for b in blocks):
            raise ProtocolError("a snapshot names blocks outside its pool")
        return snap


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
