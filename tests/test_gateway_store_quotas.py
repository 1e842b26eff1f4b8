"""chatsvc/store/quotas.py on a real Redis: places taken atomically against both limits, given back, renewed,
lapsing when not renewed; two store connections (two gateways) share one count."""

from __future__ import annotations

import asyncio

from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import store  # noqa: F401

from chatsvc.store import Store
from chatsvc.store.quotas import QuotaPlace, Refused


async def test_a_place_fits_both_limits_or_is_refused_saying_which(store: Store) -> None:  # noqa: F811
    a = await store.take_place("o", "gen", "a", 8, 3, 16, 60_000)
    b = await store.take_place("o", "gen", "b", 8, 3, 16, 60_000)
    assert isinstance(a, QuotaPlace) and isinstance(b, QuotaPlace)
    full = await store.take_place("o", "gen", "c", 1, 3, 16, 60_000)
    assert isinstance(full, Refused) and full.by_weight and 0 < full.wait_ms <= 60_000
    assert await store.places_held("o", "gen") == (2, 16)
    assert isinstance(await store.take_place("p", "gen", "c", 1, 3, 16, 60_000), QuotaPlace)  # another owner
    await store.give_back_place(a)
    await store.give_back_place(a)  # twice is once
    assert await store.places_held("o", "gen") == (1, 8)
    assert isinstance(await store.take_place("o", "gen", "d", 1, 2, 16, 60_000), QuotaPlace)
    by_count = await store.take_place("o", "gen", "e", 1, 2, 16, 60_000)
    assert isinstance(by_count, Refused) and not by_count.by_weight


async def test_concurrent_takes_from_two_connections_never_pass_the_limit(store: Store,  # noqa: F811
                                                                         redis_url: str) -> None:  # noqa: F811
    other = Store.from_url(redis_url)
    try:
        got = await asyncio.gather(*(s.take_place("o", "gen", f"p{i}-{j}", 1, 8, 100, 60_000)
                                     for i in range(24) for j, s in enumerate((store, other))))
        assert sum(isinstance(g, QuotaPlace) for g in got) == 8
        assert await other.places_held("o", "gen") == (8, 8)
    finally:
        await other.close()


async def test_places_lapse_unless_renewed(store: Store) -> None:  # noqa: F811
    ttl_ms = 1000
    kept = await store.take_place("o", "gen", "kept", 1, 2, 2, ttl_ms)
    lost = await store.take_place("o", "gen", "lost", 1, 2, 2, ttl_ms)
    assert isinstance(kept, QuotaPlace) and isinstance(lost, QuotaPlace)
    for _ in range(5):
        await asyncio.sleep(0.3)
        await store.renew_places([kept], ttl_ms)
    assert await store.places_held("o", "gen") == (1, 1)  # the one its gateway stopped renewing lapsed
    await store.give_back_place(kept)
    await store.renew_places([kept], ttl_ms)  # renewing a place given back does not bring it back
    assert await store.places_held("o", "gen") == (0, 0)
    assert await store.r.pttl(kept.key) > 0  # the set itself expires: a crashed gateway leaves no key behind
