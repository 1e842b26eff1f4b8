"""Structured outputs: JSON-schema and tool-call grammars, compiled with llguidance, as per-row token masks.

llguidance over xgrammar, measured on this project's tokenizer (``benchmarks/grammar_engines.py`` and its
record): a schema reaches its first mask in 1-20 ms, where xgrammar spends 0.25-1.4 s per schema on a
2-core CPU precomputing masks over the whole vocabulary; its limits turn pathological schemas into errors in
milliseconds or compile them in under a second (xgrammar took 12-14 s, or past 20 s, on two of five, in C++
that a server cannot interrupt); 32-row mask fills are 1.3-2x faster; and it is a wheel without
dependencies, where xgrammar requires torch, transformers, triton and apache-tvm-ffi.

torch is imported only by the functions that handle tensors: a gateway that holds no model builds and
checks specs (``GrammarCompiler`` included) without it, as it tokenizes without it.

The pieces, in the order a request meets them:
  * ``GrammarSpec``: what a request asks for (``json_object``, ``json_schema``, ``tool_calls`` or
    ``tool_calls_auto``), hashable
    and with a stable ``key``; ``tool_call_spec`` builds one from OpenAI's ``tools`` / ``tool_choice``;
  * ``GrammarCompiler``: one per tokenizer; compiles specs in worker threads with a time bound, caching the
    results (errors included) by key, least recently used first out;
  * ``GrammarState``: one per request; follows the tokens sampled and fills the request's row of a batched
    bitmask (``engine.grammar_masks`` fills a step's rows together, off the step's critical path, and applies
    them to the logits).

JSON comes out on one line with ``", "`` and ``": "`` separators (``json.dumps``' defaults): flexible
whitespace lets a small model spend its tokens on newlines, and the fixed layout is what the gateway's
streaming parser of tool calls relies on. Objects without ``additionalProperties`` get none (as OpenAI's
strict mode and vLLM's ``disable_additional_properties`` do): a small model fills open objects with junk keys.

Tool calls use the Hermes/Qwen convention, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

It is the format most open chat models were trained on and the one their templates render past calls in,
so what the model emits and what it reads back in later turns agree; for a template without tool syntax
(SmolLM2's) the gateway renders calls in this same text. ``tool_choice="auto"`` (``tool_calls_auto``) leaves
the choice to the model: the reply is either free text that does not begin with ``<tool_call>`` or well-formed
calls, never a half-written call the gateway would have to pass off as text.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from torch import Tensor

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "CompiledGrammar", "GrammarCompiler", "GrammarError",
           "GrammarKind", "GrammarSpec", "GrammarState", "check_bitmask", "parse_tool_calls",
           "tool_call_schema", "tool_call_spec"]

GrammarKind = Literal["json_object", "json_schema", "tool_calls", "tool_calls_auto"]
_KINDS = ("json_object", "json_schema", "tool_calls", "tool_calls_auto")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# OpenAI's rule for function names.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}


class GrammarError(ValueError):
    """A schema, a tool list or a tool choice that cannot be compiled: the gateway answers 400 with it."""


# ---------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must follow. ``schema``: compact JSON text (key order kept, since properties
    are generated in it) of the JSON schema, or for ``tool_calls`` of one call (``tool_call_schema``); empty
    for ``json_object``. ``parallel``: ``tool_calls`` may emit more than one call. ``tool_calls_auto``: the
    calls of ``tool_calls``, or text instead."""

    kind: GrammarKind
    schema: str = ""
    parallel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: expected one of {', '.join(_KINDS)}")
        if (self.kind == "json_object") != (not self.schema):
            needs = "takes no" if self.kind == "json_object" else "needs a"
            raise GrammarError(f"a {self.kind} grammar {needs} schema")

    @functools.cached_property
    def key(self) -> str:
        """sha256 of the spec: the same in every process and run (unlike ``hash``): caches and logs agree."""
        return hashlib.sha256(f"{self.kind}\0{int(self.parallel)}\0{self.schema}".encode()).hexdigest()

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> GrammarSpec:
        """From a schema as a client sent it (an object or its text); whitespace does not change the key."""
        return cls("json_schema", _canonical(schema, "the JSON schema"))


def _canonical(schema: Mapping[str, Any] | str, what: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{what} must be a JSON object, not {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def tool_call_schema(tools: Sequence[Mapping[str, Any]], names: Iterable[str] | None = None
                     ) -> dict[str, Any]:
    """The JSON schema of one call, ``{"name": ..., "arguments": {...}}``, to any of ``tools`` (OpenAI's
    shape: ``{"type": "function", "function": {"name", "description", "parameters"}}``) or only ``names``."""
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not (isinstance(tool, Mapping) and tool.get("type", "function") == "function"
                and isinstance(fn, Mapping)):
            raise GrammarError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise GrammarError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-': {name!r}")
        if name in by_name:
            raise GrammarError(f"tools[{i}]: two tools are named {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema object")
        by_name[name] = params
    wanted = list(by_name) if names is None else list(names)
    for name in wanted:
        if name not in by_name:
            known = ", ".join(by_name) or "none"
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools ({known})")
    if not wanted:
        raise GrammarError("tool_choice requires a tool call but no tools were given")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": n}, "arguments": dict(by_name[n])}} for n in wanted]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_spec(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any] = "auto",
                   parallel_tool_calls: bool = True) -> GrammarSpec | None:
    """The grammar OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask for; None where the
    output is plain text: ``none``, or ``auto`` without tools. The tools are checked whatever the choice, so a
    bad list is a 400 in every case."""
    schema = tool_call_schema(tools) if tools else None
    if tool_choice == "none" or (tool_choice == "auto" and schema is None):
        return None
    if tool_choice in ("auto", "required"):
        schema = schema or tool_call_schema(tools)  # no tools: raises
        kind: GrammarKind = "tool_calls" if tool_choice == "required" else "tool_calls_auto"
        return GrammarSpec(kind, _canonical(schema, "tools"), parallel_tool_calls)
    choice = tool_choice if isinstance(tool_choice, Mapping) else {}
    fn = choice.get("function")
    if not (choice.get("type") == "function" and isinstance(fn, Mapping) and isinstance(fn.get("name"), str)):
        raise GrammarError('tool_choice must be "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}')
    # A named function is called exactly once, as OpenAI does.
    return GrammarSpec("tool_calls", _canonical(tool_call_schema(tools, [fn["name"]]), "tools"), False)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Splits a reply into its text and its ``<tool_call>`` blocks: ``(content, [{"name", "arguments"}])``,
    the arguments as JSON text (OpenAI's shape). A block that is not a complete, valid call stays in the
    text."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    pos = 0
    for m in re.finditer(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), text, re.S):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            continue
        content.append(text[pos:m.start()])
        pos = m.end()
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append({"name": call["name"], "arguments": arguments})
    content.append(text[pos:])
    return "".join(content).strip() if calls else text, calls


# Keys whose values are data (left alone) and keys whose values map names to schemas (each one recursed).
_DATA_KEYS = ("const", "enum", "default", "examples")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists properties and says
    nothing about others (what strict mode means; see the module's docstring)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _DATA_KEYS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _close_objects(s) for name, s in v.items()}
        else:
            out[k] = _close_objects(v)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec``."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    schema = _close_objects(json.loads(spec.schema))
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    # tool_calls: the blocks in Lark, each holding the call's schema (%json), then only EOS. tool_calls_auto:
    # or text, any that does not start a block (``~``: llguidance's lexeme negation).
    schema["x-guidance"] = _JSON_OPTIONS
    more = ' ("\\n" call)*' if spec.parallel else ""
    text = (f' | TEXT\nTEXT: /(.|\\n)+/ & ~/{re.escape(TOOL_CALL_OPEN)}(.|\\n)*/'
            if spec.kind == "tool_calls_auto" else "")
    lark = (f"start: calls{text}\n"
            f"calls: call{more}\n"
            f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")
    return llguidance.LLMatcher.grammar_from_lark(lark)


# ---------------------------------------------------------------------------------------------- compiling


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer: a matcher at the start, which each request's state copies."""

    spec: GrammarSpec
    _template: llguidance.LLMatcher


class GrammarCompiler:
    """Compiles specs for one tokenizer, in ``workers`` threads (llguidance releases the GIL while it builds),
    each compile bounded by ``timeout_s``; keeps the last ``cache_size`` results, failures included, so that a
    client repeating a bad or pathological schema gets its error at once rather than another compile.

    A compile past its time raises ``GrammarError`` while it runs on; llguidance's own limits (``limits``)
    end it soon after, and a second request for the spec waits on that same compile, so slow schemas never
    pile up threads. Thread-safe; ``compile_async`` waits without blocking an event loop.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, cache_size: int = 256, timeout_s: float = 5.0,
                 workers: int = 2, limits: llguidance.LLParserLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        # Without verbose errors, a message names the problem without dumping the parser's state.
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, vocab_size: int | None = None, eos_token_ids: Iterable[int] = (),
                **kwargs: Any) -> GrammarCompiler:
        """From a transformers fast tokenizer (``engine.tokenizer.Tokenizer.hf``); about a second for a 49k
        vocabulary, so build one per process. ``eos_token_ids``: what ends a constrained reply (the model's
        stop tokens; the tokenizer's EOS when empty)."""
        import llguidance.hf  # imports transformers (a second): engine.request imports this module

        eos = sorted(eos_token_ids) or None
        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos), **kwargs)

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compile of ``spec``: cached, in flight, or started now."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._build, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocks at most ``timeout_s``; ``GrammarError`` for a bad spec or a compile past its time."""
        try:
            return self.submit(spec).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._too_slow() from None

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            # Shielded: a wait that times out must not cancel the compile other requests share.
            waiting = asyncio.shield(asyncio.wrap_future(self.submit(spec)))
            return await asyncio.wait_for(waiting, self.timeout_s)
        except TimeoutError:
            raise self._too_slow() from None

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one request (compiles, or takes the cached compile)."""
        return GrammarState(self.compile(spec))

    def _too_slow(self) -> GrammarError:
        return GrammarError(f"the schema took more than {self.timeout_s:g} s to compile; simplify it")

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            grammar = _grammar(spec)
        except ValueError as e:  # llguidance's own, for a schema that is not an object
            raise GrammarError(f"invalid schema: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"unsupported or invalid schema: {matcher.get_error().splitlines()[0]}")
        return CompiledGrammar(spec, matcher)


# ---------------------------------------------------------------------------------------------- matching


class GrammarState:
    """One request's place in its grammar. Not thread-safe: the engine thread owns it, and lends it to
    ``engine.grammar_masks.MaskFiller`` while the forward runs (nothing moves it meanwhile)."""

    __slots__ = ("_matcher", "spec")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.spec = compiled.spec
        # Microseconds: the compile is shared, the state is not.
        self._matcher = compiled._template.deep_copy()

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False when the grammar refuses it (then ``error`` says why, and the
        state stays in error: a token outside the mask means the mask was not applied)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def terminated(self) -> bool:
        """Nothing but EOS may follow (the output is complete, or EOS was taken), or the state is in error."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is complete: ending here (EOS) yields a valid reply."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (a tool call's ``{"name": "``...): a jump forward can append them
        without sampling."""
        return list(self._matcher.compute_ff_tokens())

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """llguidance's matcher, for filling many rows' masks at once (``engine.grammar_masks``)."""
        return self._matcher

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]``."""
        check_bitmask(bitmask)
        if not 0 <= row < bitmask.shape[0]:  # llguidance writes where it is told: no stray writes
            raise IndexError(f"row {row} of a bitmask of {bitmask.shape[0]} rows")
        words = bitmask.shape[1]
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)


def check_bitmask(bitmask: Tensor) -> None:
    """llguidance writes through a raw pointer: only a contiguous 2-D int32 CPU tensor may take its masks."""
    import torch

    if not (bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.is_contiguous()
            and bitmask.device.type == "cpu"):
        raise ValueError("the bitmask must be a contiguous 2-D int32 CPU tensor (allocate_bitmask)")
