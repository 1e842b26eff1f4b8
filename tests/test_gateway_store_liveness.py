"""chatsvc/store/liveness.py on a real Redis: heartbeats, whether a lock's holder lives, the control channel."""

from __future__ import annotations

import asyncio

from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import store  # noqa: F401

from chatsvc.store import Store
from chatsvc.store.keys import lock_key
from chatsvc.store.liveness import CONTROL_TTL_S, INSTANCE_TTL_S


async def test_a_heartbeat_names_the_live_process_of_an_instance(store: Store) -> None:  # noqa: F811
    await store.heartbeat()
    assert await store.r.get(f"chatsvc:instance:{store.instance}") == store.nonce
    assert 0 < await store.r.ttl(f"chatsvc:instance:{store.instance}") <= INSTANCE_TTL_S
    assert store.instance in await store.r.smembers("chatsvc:instances")
    assert store.lock_token(4) == f"{store.instance}|{store.nonce}|4"
    assert Store(store.r, instance="a|b").instance == "a_b"  # '|' separates a token's parts


async def test_a_locks_holder_is_alive_while_its_nonce_is_the_instances(store: Store) -> None:  # noqa: F811
    other = Store(store.r, instance="gw")
    assert await store.lock_view("s") == ("", False, None)
    await store.r.set(lock_key("s"), other.lock_token(1))
    assert await store.lock_view("s") == (other.lock_token(1), False, "gw")  # never beat
    await other.heartbeat()
    assert await store.lock_view("s") == (other.lock_token(1), True, "gw")
    await Store(store.r, instance="gw").heartbeat()  # restarted on the same host and port
    assert await store.lock_view("s") == (other.lock_token(1), False, "gw")
    await store.r.set(lock_key("s"), store.lock_token(2))
    assert await store.lock_view("s") == (store.lock_token(2), True, store.instance)  # this process: no read
    await store.r.set(lock_key("s"), "garbage")
    assert await store.lock_view("s") == ("garbage", False, None)


async def test_retire_drops_the_heartbeat_only_when_nothing_is_held(store: Store) -> None:  # noqa: F811
    key = f"chatsvc:instance:{store.instance}"
    await store.heartbeat()
    await store.r.sadd(store.locks_key(), "s")
    await store.retire()
    assert await store.r.exists(key)  # a turn is still held: its lock must stay alive
    await store.r.delete(store.locks_key())
    await store.retire()
    assert not await store.r.exists(key)
    # A successor of the same name beats meanwhile: the retiring process leaves its key alone.
    successor = Store(store.r, instance=store.instance)
    await successor.heartbeat()
    await store.retire()
    assert await store.r.get(key) == successor.nonce


async def test_stepping_down_makes_the_locks_holder_dead_at_once_even_with_locks_held(
        store: Store) -> None:  # noqa: F811
    other = Store(store.r, instance="gw-stepping")
    await other.heartbeat()
    await other.r.sadd(other.locks_key(), "s")
    await store.r.set(lock_key("s"), other.lock_token(1))
    assert (await store.lock_view("s"))[1] is True
    await other.step_down()  # long before its heartbeat's TTL, with the lock still its own
    assert (await store.lock_view("s"))[1] is False
    successor = Store(store.r, instance="gw-stepping")
    await successor.heartbeat()
    await other.step_down()  # a successor of the same name that beats meanwhile stays alive
    assert await store.r.get("chatsvc:instance:gw-stepping") == successor.nonce


async def test_peers_alive_counts_other_instances_with_a_live_heartbeat(store: Store) -> None:  # noqa: F811
    await store.heartbeat()
    assert await store.peers_alive() is False  # itself only
    await store.r.sadd("chatsvc:instances", "gw-gone")  # named, its heartbeat long lapsed
    assert await store.peers_alive() is False
    peer = Store(store.r, instance="gw-peer")
    await peer.heartbeat()
    assert await store.peers_alive() is True
    await peer.step_down()
    assert await store.peers_alive() is False


async def test_control_requests_reach_the_named_instance_in_order(store: Store) -> None:  # noqa: F811
    target = Store(store.r, instance="gw-target")
    await store.send_control("gw-target", {"op": "cancel", "session": "s1"})
    await store.send_control("gw-target", {"op": "detach", "session": "s2"})
    assert 0 < await store.r.ttl("chatsvc:instance:gw-target:control") <= CONTROL_TTL_S
    assert await store.next_control(0.1) is None  # not for this instance
    assert await target.next_control(1) == {"op": "cancel", "session": "s1"}
    assert await target.next_control(1) == {"op": "detach", "session": "s2"}
    waiting = asyncio.create_task(target.next_control(5))
    await asyncio.sleep(0.1)
    await store.send_control("gw-target", {"op": "cancel", "session": "s3"})
    assert await asyncio.wait_for(waiting, 5) == {"op": "cancel", "session": "s3"}
