"""chatsvc/store/__init__.py: the Store, every part on one connection, runs only scripts a Redis Cluster
accepts (each part's own behaviour is tested in test_gateway_store_<part>.py)."""

from __future__ import annotations

import json
import re
import threading

import redis
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from redis.crc import key_slot
from store_fixtures import store  # noqa: F401

from chatsvc.store import Store
from chatsvc.store.keys import stream_key


def _monitor(url: str, lines: list[str], started: threading.Event) -> None:
    """Every command Redis runs (scripts' own commands included, marked ``lua``) until ``ECHO monitor-end``."""
    with redis.Redis.from_url(url).monitor() as m:
        started.set()
        while True:
            line = m.connection.read_response()
            line = line.decode() if isinstance(line, bytes) else str(line)
            if "monitor-end" in line:
                return
            lines.append(line)


_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_MULTI_KEY = {"DEL", "UNLINK", "EXISTS"}


def script_slots(lines: list[str]) -> list[tuple[str, set[int]]]:
    """Per script run: its first declared key and the hash slots of every key it declared or touched."""
    runs: list[tuple[str, set[int]]] = []
    for line in lines:
        args = _ARG.findall(line)
        if not args:
            continue
        cmd = args[0].upper()
        if " lua]" not in line:
            if cmd in ("EVALSHA", "EVAL"):
                keys = args[3:3 + int(args[2])]
                runs.append((keys[0] if keys else "", {key_slot(k.encode()) for k in keys}))
            continue
        keys = args[1:] if cmd in _MULTI_KEY else args[1:2]
        runs[-1][1].update(key_slot(k.encode()) for k in keys)
    return runs


async def test_every_script_touches_one_hash_slot(store: Store, redis_url: str) -> None:  # noqa: F811
    """What a Redis Cluster requires of a script: all its keys, declared or not, in one slot."""
    lines: list[str] = []
    started = threading.Event()
    watcher = threading.Thread(target=_monitor, args=(redis_url, lines, started), daemon=True)
    watcher.start()
    assert started.wait(10)
    await store.heartbeat()
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    s1 = await store.create_session("o", "p", "sys")
    s2 = await store.create_session("o", "p", "sys")
    assert await store.begin_turn(s1.id, {"role": "user", "content": "1"}, "o") == 1
    assert await store.begin_turn(s2.id, {"role": "user", "content": "1"}, "o") == 1
    events = [(stream_key(sid, 1), json.dumps({"type": "delta", "text": "x", "tokens": 1}))
              for sid in (s1.id, s2.id, s1.id)]
    assert all(not isinstance(e, Exception) for e in await store.append_events(events))
    assert await store.is_busy(s1.id) and await store.refresh_lock(s1.id, 1)
    assert await store.end_turn(s1.id, 1, {"role": "assistant", "content": "x"}) == 1
    assert await store.begin_turn(s1.id, {"role": "user", "content": "2"}, "o") == 2
    assert await store.rollback_turn(s1.id, 2)
    # s2's turn belongs to a dead instance: recovered by the sweep, then by a new turn's takeover.
    dead = Store(store.r, 60, 30, instance="ghost")
    assert await dead.begin_turn(s1.id, {"role": "user", "content": "3"}, "o") == 2
    await store.r.delete(f"chatsvc:instance:{store.instance}")  # s2's holder (this store) looks dead now
    store.nonce = "other"
    assert s2.id in await store.recover_dead_turns()
    assert await store.begin_turn(s1.id, {"role": "user", "content": "4"}, "o") == 3  # ghost never beat: dead
    assert await store.delete_session(s2.id, "o")
    await store.r.echo("monitor-end")
    watcher.join(10)
    runs = script_slots(lines)
    assert len(runs) >= 12
    crossing = [(first, slots) for first, slots in runs if len(slots) != 1]
    assert not crossing, crossing
