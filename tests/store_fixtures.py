"""A :class:`chatsvc.store.Store` on the test Redis, for the store's test modules (``from store_fixtures import
store``), and a one-event writer for tests that lay out a reply stream by hand."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401

from chatsvc.store import Store
from chatsvc.store.keys import stream_key


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:  # noqa: F811
    s = Store.from_url(redis_url, session_ttl_s=60, stream_ttl_s=30)
    yield s
    await s.close()


async def append_event(store: Store, sid: str, turn: int, event: dict[str, Any]) -> str:
    """Store one event of reply ``turn``; its stream id."""
    (eid,) = await store.append_events([(stream_key(sid, turn), json.dumps(event))])
    if isinstance(eid, Exception):
        raise eid
    return eid
