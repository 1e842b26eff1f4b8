"""engine/grammar.py on the real tokenizer (SmolLM2's 49,152 tokens): walks that pick the best allowed token
under random logits end in JSON that validates; bad input, pathological schemas and the cache.

A walk under random logits visits grammar states a model would rarely reach (every allowed token gets its
turn), which is what a constraint must hold for; its strings and arrays are bounded so that walks end.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest
import torch

from engine.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarState,
    parse_tool_calls,
    tool_call_schema,
    tool_call_spec,
)
from engine.grammar_masks import allocate_bitmask, apply_bitmask
from engine.model_files import load_tokenizer
from engine.tokenizer import Tokenizer

PERSON: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "role": {"enum": ["admin", "user", "guest"]}}}
ARTICLE: dict[str, Any] = {
    "type": "object", "required": ["title", "tags", "author", "sections"],
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "published": {"type": "boolean"},
        "author": {"type": "object", "required": ["name"],
                   "properties": {"name": {"type": "string", "maxLength": 12},
                                  "karma": {"type": "integer", "minimum": -5, "maximum": 5}}},
        "sections": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "object", "required": ["heading", "level"],
                               "properties": {"heading": {"type": "string", "maxLength": 10},
                                              "level": {"enum": [1, 2, 3]}}}}}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["query", "limit"],
        "properties": {"query": {"type": "string", "maxLength": 16},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 10}}}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: an empty object
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
          for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok, _ = load_tokenizer()
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    _, config = load_tokenizer()
    return GrammarCompiler.from_hf(tokenizer.hf, config.vocab_size, tokenizer.eos_token_ids)


def _validate(value: Any, schema: dict[str, Any]) -> None:
    """jsonschema where installed; else the subset these schemas use, by hand."""
    try:
        import jsonschema
    except ImportError:
        assert _valid(value, schema), (value, schema)
    else:
        jsonschema.validate(value, schema)


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    if "anyOf" in schema:
        return any(_valid(value, s) for s in schema["anyOf"])
    if "const" in schema:
        return bool(value == schema["const"])
    if "enum" in schema:
        return value in schema["enum"] and type(value) in {type(v) for v in schema["enum"]}
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        closed = schema.get("additionalProperties", True) is False
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (not closed or set(value) <= set(props))
                and all(_valid(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list)
                and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
                and all(_valid(v, schema.get("items", {})) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    if kind == "integer":
        low, high = schema.get("minimum", -(10**18)), schema.get("maximum", 10**18)
        return type(value) is int and low <= value <= high
    if kind == "boolean":
        return isinstance(value, bool)
    return True


def walk(compiler: GrammarCompiler, tok: Tokenizer, spec: GrammarSpec, seed: int, max_steps: int = 500
         ) -> str:
    """Greedy-like generation: each step the highest of fresh random logits among the allowed tokens, until
    EOS. The logits are wider than the vocabulary, as a padded LM head's are."""
    state = compiler.state(spec)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    tokens: list[int] = []
    for _ in range(max_steps):
        state.fill(bitmask, 0)
        logits = torch.randn(1, compiler.vocab_size + 64, generator=gen)
        apply_bitmask(logits, bitmask, [0], compiler.vocab_size)
        token = int(logits.argmax())
        assert token < compiler.vocab_size
        assert state.accept(token), state.error
        if token in tok.eos_token_ids:
            assert state.terminated
            return tok.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no EOS after {max_steps} tokens: {tok.decode(tokens)[:300]!r}")


@pytest.mark.parametrize("schema", [PERSON, ARTICLE], ids=["flat", "nested"])
def test_walks_give_valid_json(compiler: GrammarCompiler, tokenizer: Tokenizer, schema: dict[str, Any]
                               ) -> None:
    spec = GrammarSpec.json_schema(schema)
    for seed in range(6):
        text = walk(compiler, tokenizer, spec, seed)
        value = json.loads(text)
        _validate(value, schema)
        # One line with json.dumps' separators: the layout the gateway's tool-call streaming relies on.
        assert text == json.dumps(value, ensure_ascii=False), text


def test_objects_without_additional_properties_get_none(compiler: GrammarCompiler, tokenizer: Tokenizer
                                                        ) -> None:
    spec = GrammarSpec.json_schema(ARTICLE)  # it says nothing about additional properties anywhere
    for seed in range(4):
        value = json.loads(walk(compiler, tokenizer, spec, 100 + seed))
        assert set(value) <= set(ARTICLE["properties"])
        assert set(value["author"]) <= {"name", "karma"}


def test_json_object_accepts_json_and_refuses_text(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = compiler.state(GrammarSpec.json_object())
    for token in tokenizer.encode('{"a": [1, 2.5, "x"], "b": {"c": null}}'):
        assert state.accept(token), state.error
    assert state.accepting and state.terminated  # the object is closed: only EOS may follow
    (eos,) = tokenizer.eos_token_ids
    assert state.accept(eos)
    refused = compiler.state(GrammarSpec.json_object())
    assert not refused.accept(tokenizer.encode("Sure")[0])
    assert refused.error and refused.terminated


def test_required_tool_calls_validate(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    spec = tool_call_spec(TOOLS, "required", parallel_tool_calls=True)
    assert spec is not None and spec.kind == "tool_calls" and spec.parallel
    seen = set()
    for seed in range(8):
        text = walk(compiler, tokenizer, spec, seed)
        content, calls = parse_tool_calls(text)
        assert calls and content == "", text
        for call in calls:
            seen.add(call["name"])
            _validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    assert len(seen) > 1  # the union is open to every tool


def test_named_tool_choice_calls_that_tool_once(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    spec = tool_call_spec(TOOLS, {"type": "function", "function": {"name": "search"}})
    assert spec is not None and not spec.parallel
    for seed in range(4):
        text = walk(compiler, tokenizer, spec, seed)
        assert text.startswith('<tool_call>\n{"name": "search", "arguments": {')
        assert text.endswith("</tool_call>")
        _, calls = parse_tool_calls(text)
        assert [c["name"] for c in calls] == ["search"]
        _validate(json.loads(calls[0]["arguments"]), PARAMS["search"])


def test_forced_tokens_spell_the_call_prefix(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    spec = tool_call_spec(TOOLS, {"type": "function", "function": {"name": "ping"}})
    assert spec is not None
    forced = tokenizer.decode(compiler.state(spec).forced_tokens())
    assert forced.startswith('<tool_call>\n{"name": "ping", "arguments": {')


def test_tool_choice_none_and_auto_without_tools_do_not_constrain() -> None:
    assert tool_call_spec(TOOLS, "none") is None
    assert tool_call_spec([], "auto") is None


def test_auto_allows_text_or_whole_calls_only(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """``auto``: any text that does not begin a call, or calls that follow the schema; never a call's tag
    followed by something else (the gateway could not tell it from a broken call)."""
    spec = tool_call_spec(TOOLS, "auto", parallel_tool_calls=False)
    assert spec is not None and spec.kind == "tool_calls_auto" and not spec.parallel
    auto: GrammarSpec = spec

    def accepts(text: str) -> bool:
        state = compiler.state(auto)
        return all(state.accept(t) for t in tokenizer.encode(text)) and state.accepting

    assert accepts("It is sunny. <tool_call> is how I would call a tool.")
    assert accepts('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert not accepts("<tool_call> sunny")
    assert not accepts('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>')
    assert not accepts('<tool_call>\n{"name": "ping", "arguments": {"x": 1}}\n</tool_call>')


@pytest.mark.parametrize(("tools", "choice", "message"), [
    (TOOLS + [TOOLS[0]], "auto", "two tools are named 'get_weather'"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([], "required", "no tools were given"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "function.name must be"),
    ([{"type": "retrieval"}], "auto", r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", "parameters must be"),
])
def test_bad_tools_are_grammar_errors(tools: list[dict[str, Any]], choice: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        tool_call_spec(tools, choice)


@pytest.mark.parametrize(("schema", "message"), [
    ('{"type": "object",', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"type": "strin"}, "Invalid type"),
    ({"not": {"type": "string"}}, "Unimplemented keys"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "invalid schema"),
])
def test_invalid_or_unsupported_schemas_are_grammar_errors(compiler: GrammarCompiler, schema: Any,
                                                           message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(GrammarSpec.json_schema(schema))


def test_pathological_schemas_error_in_bounded_time(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler.from_hf(tokenizer.hf, timeout_s=5.0)
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    start = time.monotonic()
    with pytest.raises(GrammarError, match="recursion"):
        compiler.compile(GrammarSpec.json_schema(deep))
    assert time.monotonic() - start < 5.0
    # Past the time bound: an error at the bound, not a stall; asking again waits on the same compile.
    huge = GrammarSpec.json_schema({"enum": [f"value-{i}" for i in range(60000)]})
    slow = GrammarCompiler.from_hf(tokenizer.hf, timeout_s=0.05)
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(GrammarError, match="took more than 0.05 s"):
            slow.compile(huge)
        assert time.monotonic() - start < 1.0
    assert slow.submit(huge) is slow.submit(huge)


async def test_compile_async_waits_off_the_loop(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler.from_hf(tokenizer.hf, timeout_s=0.05)
    assert (await compiler.compile_async(GrammarSpec.json_object())).spec.kind == "json_object"
    huge = GrammarSpec.json_schema({"enum": [f"item-{i}" for i in range(60000)]})
    with pytest.raises(GrammarError, match="took more than"):
        await compiler.compile_async(huge)
    assert not compiler.submit(huge).cancelled()  # the timed-out wait left the shared compile running


def test_cache_returns_the_same_compile_and_evicts_the_oldest(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler.from_hf(tokenizer.hf, cache_size=2)
    a, b, c = (GrammarSpec.json_schema({"type": "object", "properties": {k: {"type": "integer"}}})
               for k in "abc")
    first = compiler.compile(a)
    assert compiler.compile(GrammarSpec.json_schema(json.dumps(json.loads(a.schema), indent=2))) is first
    old_b = compiler.compile(b)
    assert compiler.compile(a) is first  # a is now the most recent, b the oldest
    compiler.compile(c)
    assert compiler.compile(a) is first
    assert compiler.compile(b) is not old_b  # b was evicted: compiled again
    bad = GrammarSpec.json_schema({"not": {}})
    assert compiler.submit(bad) is compiler.submit(bad)  # errors are cached too


def test_spec_keys_are_stable() -> None:
    spec = GrammarSpec.json_schema('{ "type": "object",\n  "properties": {"x": {"type": "string"}} }')
    assert spec.schema == '{"type":"object","properties":{"x":{"type":"string"}}}'
    assert spec.key == hashlib.sha256(b'json_schema\x000\x00' + spec.schema.encode()).hexdigest()
    assert spec == GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "string"}}})
    # Key order is kept (it is the order properties are generated in), so it tells schemas apart.
    assert GrammarSpec.json_schema({"b": 1, "a": 2}).key != GrammarSpec.json_schema({"a": 2, "b": 1}).key
    assert GrammarSpec.json_object().key != spec.key
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("regex", "a+")  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="needs a schema"):
        GrammarSpec("json_schema")


def test_parse_tool_calls_keeps_text_and_bad_blocks() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 2}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     {"name": "search", "arguments": '{"query": "x", "limit": 2}'}]
    broken = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_state_copies_are_independent(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(PERSON))
    a, b = GrammarState(compiled), GrammarState(compiled)
    for token in tokenizer.encode('{"name": "Bo", "age": 3, "role": "user"}'):
        assert a.accept(token), a.error
    assert a.terminated and not b.terminated
    assert b.accept(tokenizer.encode("{")[0])
    assert tool_call_schema(TOOLS, ["ping"])["properties"]["name"] == {"const": "ping"}
