"""engine.streams: every message survives encode/decode; other versions, foreign and malformed entries are
refused with ProtocolError."""

from __future__ import annotations

import json

import pytest

from engine.protocol import (
    Abort,
    AddRequest,
    EngineStats,
    Pin,
    ProtocolError,
    RequestDelta,
    RequestError,
    Unpin,
    WantSnapshot,
)
from engine.request import SamplingParams
from engine.streams import VERSION, Beat, Deltas, Generate, Keys, decode, encode, pin_value, read_pin


def test_every_message_round_trips() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], max_tokens=40, min_tokens=2)
    delta = RequestDelta("r1", 0, "hé", [5, 6], False, None, [{5: -0.1, 9: -2.5}, {6: -0.3}], 12, 2, 0)
    msgs = [Generate(AddRequest("r1", params, [1, 2, 3]), "d1", "persona:x"),
            Generate(AddRequest("r2", SamplingParams(), [4]), "d2"),
            Abort("r1"), Pin("persona:x", [1, 2], "call-1"), Unpin("persona:x"), WantSnapshot(),
            Deltas([delta, RequestDelta("r1", 0, "", [7], True, "length", None, 12, 3, 0, True)], 1764547200.25),
            RequestError("r1", "QueueFullError", "full")]
    for msg in msgs:
        entry = encode(msg)
        assert set(entry) == {"v", "type", "data"} and entry["v"] == str(VERSION)
        assert decode(entry) == msg
    logprobs = decode(encode(msgs[6])).deltas[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and logprobs[0] == {5: -0.1, 9: -2.5}  # token ids stay ints through JSON


def test_other_versions_and_foreign_entries_are_refused() -> None:
    entry = encode(Abort("r1"))
    with pytest.raises(ProtocolError, match="version"):
        decode({**entry, "v": str(VERSION + 1)})
    with pytest.raises(ProtocolError):
        decode({**entry, "type": "reboot"})
    with pytest.raises(ProtocolError):
        decode({"v": str(VERSION), "type": "abort"})


def test_a_newer_writer_may_add_fields() -> None:
    entry = encode(Abort("r1"))
    entry["data"] = json.dumps({**json.loads(entry["data"]), "reason": "later field"})
    assert decode(entry) == Abort("r1")
    beat = Beat(worker="w", pid=1, host="h", model_name="m", max_model_len=512, block_size=16, time=1.0,
                pins=["p"], stats=EngineStats(requests_running=2, requests_waiting=1, kv_blocks_free=7))
    text = json.dumps({**json.loads(beat.to_json()), "gpu": "none"})
    assert Beat.from_json(text) == beat and beat.load == 3 and beat.free_blocks == 7


def test_keys_share_one_prefix() -> None:
    k = Keys("x:")
    names = [k.workers, k.pins, k.beat("w"), k.requests("w"), k.control("w"), k.kv("w"), k.out("d"), k.session("s"),
             k.request("r"), k.reply("c")]
    assert all(n.startswith("x:") for n in names) and len(set(names)) == len(names)


@pytest.mark.parametrize("data", [
    {"add": {"type": "add", "request_id": "r", "params": None, "prompt_token_ids": [1]}, "dispatch": "d"},
    {"add": {"type": "add", "request_id": "r", "params": {}, "prompt_token_ids": [1]}, "dispatch": 5},
    {"add": {"type": "add", "request_id": "r", "params": {"seed_offset": 10**30}, "prompt_token_ids": [1]},
     "dispatch": "d"},
    {"add": {"type": "add", "request_id": "r", "params": {}, "prompt_token_ids": [-1]}, "dispatch": "d"},
    {"add": {"type": "add", "request_id": "r", "params": {"logit_bias": {}}, "prompt_token_ids": [1]},
     "dispatch": "d"},
    {"add": {"type": "abort", "request_id": "r"}, "dispatch": "d"},
    [],
    *({"add": {"type": "add", "request_id": "r", "params": params, "prompt_token_ids": [1]}, "dispatch": "d"}
      for params in ({"temperature": float("nan")}, {"top_p": float("inf")}, {"top_k": 10**12}, {"seed": 2**64},
                     {"stop": ["ab"] * 100_000}, {"stop": ["x" * 5000]}, {"stop_token_ids": [2**40]},
                     {"n": 10**6}, {"max_tokens": 10**30}, {"ignore_eos": 1}, {"grammar": {"kind": "json_object"}},
                     {"grammar": {"kind": "json_object", "schema": "", "extra": 1}})),
])
def test_a_malformed_generate_entry_is_a_protocol_error(data: object) -> None:
    with pytest.raises(ProtocolError):
        decode({"v": str(VERSION), "type": "generate", "data": json.dumps(data)})


@pytest.mark.parametrize("kind,data", [("abort", ["r1"]), ("abort", {"request_id": 5}), ("pin", {"key": "k"}),
                                       ("deltas", {"deltas": [{"request_id": "r"}]}), ("error", {"kind": 3}),
                                       ("shutdown", {}), ("add", {})])
def test_a_malformed_or_misplaced_entry_is_a_protocol_error(kind: str, data: object) -> None:
    with pytest.raises(ProtocolError):
        decode({"v": str(VERSION), "type": kind, "data": json.dumps(data)})


def test_a_pin_value_carries_its_salt_and_a_bad_one_is_refused() -> None:
    """The ``pins`` hash holds what a worker pins, salt included: an owner's persona is pinned under the
    owner's salt on whichever worker first serves it."""
    pin = read_pin(pin_value("persona:o:x", [1, 2, 3], "a1b2"))
    assert (pin.key, pin.prompt_token_ids, pin.cache_salt) == ("persona:o:x", [1, 2, 3], "a1b2")
    assert read_pin(pin_value("persona:x", [4], None)).cache_salt is None
    for raw in ("[1, 2, 3]", '{"key": "k", "prompt_token_ids": [-1]}', "not json"):
        with pytest.raises(ProtocolError):
            read_pin(raw)
