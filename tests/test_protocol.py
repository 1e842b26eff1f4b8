"""engine/protocol.py: every message has one JSON form that round-trips, and every decoded field is checked."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from engine.grammar import GrammarSpec
from engine.protocol import (
    MAX_TEXT_CHARS,
    Abort,
    AddRequest,
    CallReply,
    EngineDeadError,
    EngineStats,
    KVSnapshot,
    Pin,
    ProtocolError,
    QueueFullError,
    RequestDelta,
    RequestError,
    Shutdown,
    Unpin,
    WantSnapshot,
    decode_command,
    encode_command,
)
from engine.request import SamplingParams


def through_json(data: object) -> object:
    return json.loads(json.dumps(data))


def test_commands_round_trip_through_json() -> None:
    params = SamplingParams(temperature=0.5, seed=7, stop=["\n"], max_tokens=9, logprobs=2)
    for cmd in (AddRequest("r", params, [1, 2, 3], "hi", 12.5), AddRequest("r2", SamplingParams(), [4]),
                AddRequest("r3", SamplingParams(cache_salt="a1b2", shared_prefix_tokens=32), [4]),
                Abort("r"), Abort("r", "c1"), Pin("persona:x", [5, 6], "c2"), Pin("k", []), Unpin("k"),
                Pin("persona:o:x", [5, 6], None, "a1b2"), WantSnapshot(), Shutdown()):
        assert decode_command(through_json(encode_command(cmd))) == cmd


def test_a_delta_round_trips_with_integer_token_ids_in_its_logprobs() -> None:
    d = RequestDelta("r", 1, "é", [5], True, "stop", [{5: -0.25, 7: -3.0}], 10, 4, 2, True, "\n")
    back = RequestDelta.from_json(through_json(d.to_json()))
    assert back == d and back.logprobs is not None and list(back.logprobs[0]) == [5, 7]


@pytest.mark.parametrize("data", [
    None, [], {"type": "reboot"}, {"type": "abort"}, {"type": "abort", "request_id": 5},
    {"type": "abort", "request_id": "x" * 1000},
    {"type": "pin", "key": "k", "prompt_token_ids": [-1]},
    {"type": "pin", "key": "k", "prompt_token_ids": [True]},
    {"type": "pin", "key": "k", "prompt_token_ids": "123"},
    {"type": "add", "request_id": "r", "params": {}, "prompt_token_ids": [2**40]},
    {"type": "add", "request_id": "r", "params": {"seed_offset": 10**12}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"temperature": -1}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"logit_bias": {"1": 2}}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": [], "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"cache_salt": 5}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"cache_salt": ""}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"cache_salt": "s" * 300}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"shared_prefix_tokens": -1}, "prompt_token_ids": [1]},
    {"type": "add", "request_id": "r", "params": {"shared_prefix_tokens": True}, "prompt_token_ids": [1]},
    {"type": "pin", "key": "k", "prompt_token_ids": [1], "cache_salt": 7},
    {"type": "pin", "key": "k", "prompt_token_ids": [1], "cache_salt": "s" * 300},
    {"type": "add", "request_id": "r", "params": {}, "prompt_token_ids": [1], "arrival_time": float("nan")},
])
def test_malformed_commands_are_protocol_errors(data: object) -> None:
    with pytest.raises(ProtocolError):
        decode_command(data)


def test_request_errors_carry_their_kind_and_come_back_as_that_exception() -> None:
    for exc in (ValueError("bad"), QueueFullError("full"), EngineDeadError("gone")):
        err = RequestError.of("r", exc)
        back = RequestError.from_json(through_json(err.to_json())).exception()
        assert type(back) is type(exc) and str(back) == str(exc)
    assert type(RequestError.of("r", KeyError("x")).exception()) is RuntimeError  # others travel as RuntimeError
    assert type(RequestError("r", "WorkerGone", "leaving").exception()) is RuntimeError
    assert CallReply("c", error=RequestError.of("", ValueError("no"))).error is not None


def test_stats_round_trip_and_refuse_bad_values() -> None:
    stats = EngineStats(kv_blocks_total=64, kv_blocks_free=10, requests_running=3, max_waiting=8,
                        swap_seconds_per_block=0.5, step_threads=2, engine_state="restarting",
                        runtime={"kernels": "cpp", "isa": "avx2", "threads": 2, "fallback": None})
    assert EngineStats.from_json(through_json(stats.to_json())) == stats
    assert "workers" not in stats.to_json()  # only an engine spread over workers has them
    assert EngineStats.from_json({"kv_blocks_total": 4, "later_field": 1}) == EngineStats(kv_blocks_total=4)
    for bad in ({"kv_blocks_total": -1}, {"requests_running": "3"}, {"swap_seconds_per_block": "x"},
                {"engine_state": 5}, {"kv_blocks_free": True}, {"runtime": {"k": 1.5}},
                {"runtime": {str(i): i for i in range(20)}}, []):
        with pytest.raises(ProtocolError):
            EngineStats.from_json(bad)


def test_snapshots_round_trip_and_refuse_blocks_outside_their_pool() -> None:
    snap = KVSnapshot(block_size=16, num_blocks=4, state=["free", "used", "pinned", "cached"], refcounts=[0, 1, 1, 0],
                      cpu_used=2, requests={"r": [1]}, pins={"persona:x": [2]})
    assert KVSnapshot.from_json(through_json(snap.to_json())) == snap
    for bad in ({"num_blocks": 2, "requests": {"r": [3]}}, {"num_blocks": 1, "state": ["free", "free"]},
                {"num_blocks": 2, "pins": {"k": "1"}}, {"block_size": 0}):
        with pytest.raises(ProtocolError):
            KVSnapshot.from_json(bad)


def test_the_seam_imports_no_torch() -> None:
    """The gateway's side of every transport (protocol, client contract, the local client, the Redis wire
    format, the model-less tokenizer loader) loads without torch."""
    code = ("import sys\n"
            "import engine.protocol, engine.client, engine.local_client, engine.streams, engine.model_files\n"
            "import chatsvc.remote_engine, chatsvc.app\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_grammar_crosses_json_and_pickle_as_the_spec_it_was() -> None:
    """The Redis transport carries a request's grammar as JSON, the process transport pickles it: both give
    the engine the same spec (same key, so the same cached compile)."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    for grammar in (spec, GrammarSpec.json_object(), GrammarSpec("tool_calls", '{"type":"object"}', True)):
        cmd = AddRequest("r", SamplingParams(max_tokens=9, grammar=grammar), [1, 2])
        back = decode_command(through_json(encode_command(cmd)))
        assert back == cmd and isinstance(back, AddRequest) and back.params.grammar is not None
        assert back.params.grammar.key == grammar.key
        assert pickle.loads(pickle.dumps(cmd)) == cmd


@pytest.mark.parametrize("grammar", [
    "json_object", {"kind": "regex", "schema": "a+"}, {"kind": "json_object", "schema": "{}"},
    {"kind": "json_schema"}, {"kind": "json_schema", "schema": 5}, {"kind": "json_object", "parallel": "yes"},
    {"kind": "json_object", "lark": "start: x"}, {"kind": "json_schema", "schema": "x" * (MAX_TEXT_CHARS + 1)},
])
def test_malformed_grammars_are_protocol_errors(grammar: object) -> None:
    with pytest.raises(ProtocolError):
        decode_command({"type": "add", "request_id": "r", "params": {"grammar": grammar}, "prompt_token_ids": [1]})
