"""chatsvc/store/keys.py: the key names Redis holds, each session's under its hash tag (one cluster slot)."""

from __future__ import annotations

from redis.crc import key_slot

from chatsvc.store import keys


def test_a_sessions_keys_carry_its_id_as_a_hash_tag() -> None:
    sid = "abc"
    assert keys.session_key(sid) == "chatsvc:session:{abc}"
    assert keys.messages_key(sid) == "chatsvc:session:{abc}:messages"
    assert keys.lock_key(sid) == "chatsvc:session:{abc}:lock"
    assert keys.stream_key(sid, 3) == "chatsvc:stream:{abc}:3"
    assert keys.readers_key(sid, 3) == "chatsvc:stream:{abc}:3:readers"
    slots = {key_slot(k.encode()) for k in (keys.session_key(sid), keys.messages_key(sid), keys.lock_key(sid),
                                            keys.stream_key(sid, 1), keys.readers_key(sid, 7))}
    assert len(slots) == 1


def test_every_id_is_tagged_whatever_its_length() -> None:
    # Ids of 24 characters once kept untagged keys; a 0.1 store has no such sessions to keep.
    for sid in ("A" * 24, "B" * 28, "x"):
        assert keys.session_key(sid) == "chatsvc:session:{" + sid + "}"


def test_owner_and_instance_keys() -> None:
    assert keys.owner_sessions_key("o") == "chatsvc:owner:o:sessions"
    assert keys.owner_personas_key("o") == "chatsvc:owner:o:personas"
    assert keys.instance_key("h:1") == "chatsvc:instance:h:1"
    assert keys.locks_key("h:1") == "chatsvc:instance:h:1:locks"
    assert keys.control_key("h:1") == "chatsvc:instance:h:1:control"
    assert (keys.PERSONAS, keys.INSTANCES) == ("chatsvc:personas", "chatsvc:instances")
