"""chatsvc/keyring.py: the operator's secrets, HKDF-separated keys, and the identity key Redis holds only
wrapped, against a real Redis."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from gateway_fixtures import redis_proc, redis_url  # noqa: F401

from chatsvc.keyring import (
    IDENTITY_KEY,
    LEGACY_SECRET_KEY,
    Keys,
    SecretError,
    Secrets,
    fingerprint,
    hkdf,
    open_keys,
    read_secrets,
)

pytestmark = pytest.mark.integration
OLD, NEW = b"o" * 40, b"n" * 40


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:  # noqa: F811
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def redis_text(r: aioredis.Redis) -> str:
    """Every key, hash field and value in the database, as one text."""
    parts: list[str] = []
    async for key in r.scan_iter():
        parts.append(key)
        kind = await r.type(key)
        if kind == "string":
            parts.append(await r.get(key))
        elif kind == "hash":
            parts.extend(x for kv in (await r.hgetall(key)).items() for x in kv)
    return "\n".join(parts)


def forms(secret: bytes) -> list[str]:
    """The ways a key could be written into Redis in the clear."""
    return [secret.decode("latin-1"), secret.hex(), base64.b64encode(secret).decode()]


def test_secrets_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secrets"
    path.write_text(f"# rotated 2 days ago\n\n  {NEW.decode()}  \n{OLD.decode()}\n{NEW.decode()}\n")
    assert read_secrets(path, {}) == Secrets((NEW, OLD))
    env = {"CHATSVC_SECRET": OLD.decode(), "CHATSVC_SECRET_PREVIOUS": f" {NEW.decode()} ,, "}
    assert read_secrets(None, env) == Secrets((OLD, NEW))
    assert read_secrets(path, env) == Secrets((NEW, OLD))  # the flag names a file: the environment is not read
    assert read_secrets(None, {}) is None and read_secrets(None, {"CHATSVC_SECRET": "  "}) is None
    for text in ("# only a comment\n", "short\n", f"{NEW.decode()}\nshort\n"):
        path.write_text(text)
        with pytest.raises(SecretError):
            read_secrets(path, {})
    with pytest.raises(SecretError, match="cannot read"):
        read_secrets(tmp_path / "missing", {})


def test_each_use_has_its_own_key() -> None:
    keys = Keys.derive(b"i" * 32, (NEW, OLD))
    derived = {keys.salt_key, *keys.token_keys, hkdf(NEW, b"chatsvc/v1 identity-key wrapping")}
    assert len(derived) == 4 and not derived & {NEW, OLD, keys.identity}
    assert keys.token_keys == (hkdf(NEW, b"chatsvc/v1 access-token signing"),
                               hkdf(OLD, b"chatsvc/v1 access-token signing"))


async def test_redis_holds_the_identity_key_only_wrapped(r: aioredis.Redis) -> None:
    keys = await open_keys(r, Secrets((NEW, OLD)))
    again = await open_keys(r, Secrets((NEW,)))  # another gateway, or a restart: the same identity
    assert again.identity == keys.identity and len(keys.identity) == 32
    text = await redis_text(r)
    for secret in (NEW, OLD, keys.identity, keys.salt_key, *keys.token_keys):
        assert not any(form in text for form in forms(secret))
    assert not await r.exists(LEGACY_SECRET_KEY)


async def test_rotation_keeps_the_identity_and_a_dropped_secret_opens_nothing(r: aioredis.Redis) -> None:
    before = await open_keys(r, Secrets((OLD,)))
    assert set(await r.hkeys(IDENTITY_KEY)) == {fingerprint(OLD)}
    # The new secret accepted beside the old one wraps its own copy ...
    during = await open_keys(r, Secrets((OLD, NEW)))
    assert set(await r.hkeys(IDENTITY_KEY)) == {fingerprint(OLD), fingerprint(NEW)}
    # ... which opens the identity key once the old one is gone, and the old copy goes with it.
    after = await open_keys(r, Secrets((NEW,)))
    assert before.identity == during.identity == after.identity
    assert set(await r.hkeys(IDENTITY_KEY)) == {fingerprint(NEW)}
    assert after.token_keys[0] != before.token_keys[0] and after.salt_key == before.salt_key
    with pytest.raises(SecretError, match="opens the identity key"):
        await open_keys(r, Secrets((OLD,)))
    with pytest.raises(SecretError):  # nor does a secret that never was accepted
        await open_keys(r, Secrets((b"x" * 40,)))
    assert (await open_keys(r, Secrets((NEW,)))).identity == before.identity  # and nothing was overwritten


async def test_gateways_starting_together_make_one_identity_key(r: aioredis.Redis) -> None:
    keys = await asyncio.gather(*(open_keys(r, Secrets((NEW,))) for _ in range(8)))
    assert len({k.identity for k in keys}) == 1


async def test_without_an_operator_secret_a_generated_one_stays_in_redis(r: aioredis.Redis) -> None:
    first = await open_keys(r, None)
    generated = await r.get(LEGACY_SECRET_KEY)
    assert generated and len(generated) == 64
    second = await open_keys(r, None)
    assert second == first  # every gateway on the Redis, and a restart, get the same keys


async def test_a_plaintext_secret_becomes_the_identity_key_and_is_then_deleted(r: aioredis.Redis) -> None:
    """A deployment from before wrapped identity keys keyed owner ids with the plaintext secret: it becomes
    the identity key, so every session keeps its owner, and the operator's secret takes over."""
    legacy = "ab" * 32
    await r.set(LEGACY_SECRET_KEY, legacy)
    owner_before = "k" + hmac.new(bytes.fromhex(legacy), b"some-api-key", hashlib.sha256).hexdigest()[:32]
    dev = await open_keys(r, None)
    assert dev.identity == bytes.fromhex(legacy) and await r.get(LEGACY_SECRET_KEY) == legacy
    operator = await open_keys(r, Secrets((NEW,)))
    assert operator.identity == bytes.fromhex(legacy)
    assert "k" + hmac.new(operator.identity, b"some-api-key", hashlib.sha256).hexdigest()[:32] == owner_before
    assert not await r.exists(LEGACY_SECRET_KEY)
    assert set(await r.hkeys(IDENTITY_KEY)) == {fingerprint(NEW)}
    assert legacy not in await redis_text(r)
