from __future__ import annotations

import pytest

from chatsvc.personas import DEFAULT_PERSONA, DEFAULT_PERSONAS, system_prefix_ids
from chatsvc.turns import event_id, parse_event_id


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from tiny_model import make_tiny_tokenizer

    from engine.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


def test_system_prefix_is_a_prefix_of_every_conversation(tokenizer) -> None:
    prompt = DEFAULT_PERSONAS["pirate"]["system_prompt"]
    prefix = system_prefix_ids(tokenizer, prompt)
    assert len(prefix) > 10
    for turns in ([{"role": "user", "content": "hi"}],
                  [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}]):
        full = tokenizer.apply_chat_template([{"role": "system", "content": prompt}, *turns])
        assert full[: len(prefix)] == prefix
    other = system_prefix_ids(tokenizer, DEFAULT_PERSONAS["tutor"]["system_prompt"])
    assert other != prefix


def test_defaults_include_the_default_persona() -> None:
    assert DEFAULT_PERSONA in DEFAULT_PERSONAS
    assert all(p["system_prompt"] and p["description"] for p in DEFAULT_PERSONAS.values())


def test_event_ids_round_trip() -> None:
    assert parse_event_id(event_id(3, "17-2")) == (3, "17-2")
    assert parse_event_id("17-2") == (None, "17-2")
    assert parse_event_id(None) == (None, "0")
    assert parse_event_id("4:") == (4, "0")
