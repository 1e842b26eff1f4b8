"""Quota places in Redis, shared by every gateway on it: one sorted set per owner and quota, each member a
place (``<id>:<weight>``) scored by the moment it lapses. Taking a place is one script (lapsed places
dropped, the rest counted and weighed, the new one added only if it fits), so concurrent requests on any
number of gateways cannot walk past a limit. A gateway renews the places it holds; a crashed gateway's
lapse by themselves. A place that is never given back and never renewed is a sliding window: the
per-minute quotas are counted that way."""

from __future__ import annotations

from dataclasses import dataclass

from chatsvc.store.base import RedisStore
from chatsvc.store.keys import quota_key

# KEYS: the quota's set; ARGV: member, weight, most places, most weight, lifetime (ms).
# Returns {1, 0, 0} when taken, else {0, ms until the oldest place lapses, 1 (too many places) or 2 (too
# much weight)}. Redis time, not the gateways'
# clocks, so gateways whose clocks differ agree on what has lapsed.
_TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local places, weight, oldest = 0, 0, nil
for i = 1, #members, 2 do
  places = places + 1
  weight = weight + tonumber(string.match(members[i], ':(%d+)$'))
  local lapse = tonumber(members[i + 1])
  if oldest == nil or lapse < oldest then oldest = lapse end
end
local w = tonumber(ARGV[2])
if places + 1 > tonumber(ARGV[3]) then return {0, (oldest or now) - now, 1} end
if weight + w > tonumber(ARGV[4]) then return {0, (oldest or now) - now, 2} end
local ttl = tonumber(ARGV[5])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, 0, 0}
"""

# KEYS: quota sets; ARGV: lifetime (ms), then one member per key. Renews only places still held.
_RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', now + ttl, ARGV[i + 1]) == 1 then
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
return #KEYS
"""


@dataclass(frozen=True)
class QuotaPlace:
    """One place taken in one owner's quota: what gives it back and renews it."""

    key: str
    member: str


@dataclass(frozen=True)
class Refused:
    """No room: ``by_weight`` when the weight limit refused it (else the count of places); ``wait_ms``
    until the oldest place lapses."""

    by_weight: bool
    wait_ms: int


class QuotaStore(RedisStore):
    async def take_place(self, owner: str, kind: str, place_id: str, weight: int, max_places: int,
                         max_weight: int, ttl_ms: int) -> QuotaPlace | Refused:
        """A place of ``weight`` in ``owner``'s ``kind`` quota, or why there is no room for one."""
        key, member = quota_key(owner, kind), f"{place_id}:{weight}"
        taken, wait_ms, full = await self._script(_TAKE_LUA)(
            keys=[key], args=[member, weight, max_places, max_weight, ttl_ms])
        if int(taken):
            return QuotaPlace(key, member)
        return Refused(by_weight=int(full) == 2, wait_ms=int(wait_ms))

    async def give_back_place(self, place: QuotaPlace) -> None:
        await self.r.zrem(place.key, place.member)

    async def renew_places(self, places: list[QuotaPlace], ttl_ms: int) -> None:
        if places:
            await self._script(_RENEW_LUA)(keys=[p.key for p in places],
                                           args=[ttl_ms, *(p.member for p in places)])

    async def places_held(self, owner: str, kind: str) -> tuple[int, int]:
        """(places, their weight) ``owner`` holds in ``kind`` now, lapsed ones left out."""
        key = quota_key(owner, kind)
        (now_s, now_us) = await self.r.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        members = await self.r.zrangebyscore(key, f"({now_ms}", "+inf")
        return len(members), sum(int(m.rsplit(":", 1)[1]) for m in members)
