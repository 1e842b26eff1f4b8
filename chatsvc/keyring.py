"""The server secret, and the keys derived from it and from the identity key it unlocks.

The operator gives the secret: ``--secret-file`` (one secret a line, the first current, the rest previous
ones still accepted; blank and ``#`` lines skipped) or ``$CHATSVC_SECRET`` with ``$CHATSVC_SECRET_PREVIOUS``
(comma-separated). Every key is derived with HKDF-SHA256 under its own ``info`` label, so no two uses share
a key:

- per accepted secret: the access-token key (the current secret signs, every accepted one verifies), the key
  that wraps the identity key, and a fingerprint naming that wrapped copy;
- from the identity key: owner ids (``HMAC(identity, api key)``) and the prefix-cache salts' key.

Owner ids and salts must not change when the secret does (every session would lose its owner), so they hang
off a random identity key created once, never off the secret. Redis holds the identity key only wrapped
(AES-GCM), one copy per accepted secret's fingerprint: whoever reads Redis without a secret can compute
neither an owner id nor a token. A secret accepted beside an old one wraps its own copy; a copy whose secret
is no longer accepted is deleted, so a dropped secret opens nothing.

Without an operator secret (a development machine) a generated one is kept in Redis in plaintext under
``LEGACY_SECRET_KEY``, as before wrapped identity keys existed. A deployment that had one keeps its owner
ids: that secret was the owner ids' key, so it becomes the identity key; once an operator secret has wrapped
it, the plaintext secret is deleted.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from chatsvc.store import P

SECRET_ENV = "CHATSVC_SECRET"
PREVIOUS_ENV = "CHATSVC_SECRET_PREVIOUS"
# A guessable secret could be confirmed offline against a wrapped copy: demand what `openssl rand -hex 16`
# gives at least.
MIN_SECRET_CHARS = 32
IDENTITY_KEY = P + "identity_key"  # hash: secret fingerprint -> the identity key wrapped under that secret
LEGACY_SECRET_KEY = P + "server_secret"  # the generated secret without an operator one (plaintext)

_TOKEN_INFO = b"chatsvc/v1 access-token signing"
_WRAP_INFO = b"chatsvc/v1 identity-key wrapping"
_FINGERPRINT_INFO = b"chatsvc/v1 secret fingerprint"
_SALT_INFO = b"chatsvc/v1 cache salts"
_WRAP_AAD = b"chatsvc/v1 identity key"
_NONCE_BYTES = 12

# Wraps the identity key under every accepted secret, only if no process has created one yet: two gateways
# starting together on an empty Redis must not each make their own.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


class SecretError(Exception):
    """A secret source that cannot be used, or secrets that open no identity key in Redis."""


def hkdf(key: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


@dataclass(frozen=True)
class Secrets:
    """The accepted server secrets, the current (signing) one first."""

    accepted: tuple[bytes, ...]
    generated: bool = False  # kept in Redis, not given by the operator

    @property
    def current(self) -> bytes:
        return self.accepted[0]


def _parse(values: Sequence[str], where: str) -> Secrets:
    accepted = tuple(dict.fromkeys(v.encode() for v in values))
    if not accepted:
        raise SecretError(f"{where} holds no secret")
    if short := sum(len(s) < MIN_SECRET_CHARS for s in accepted):
        raise SecretError(f"{where}: {short} secret(s) shorter than {MIN_SECRET_CHARS} characters "
                          "(make one with `openssl rand -hex 32`)")
    return Secrets(accepted)


def read_secrets(path: Path | None, env: Mapping[str, str]) -> Secrets | None:
    """The operator's secrets from ``path`` if given, else from ``env``; None if neither names one."""
    if path is not None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise SecretError(f"cannot read the secret file {path}: {exc.strerror or exc}") from exc
        lines = [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]
        return _parse(lines, f"the secret file {path}")
    current = env.get(SECRET_ENV, "").strip()
    if not current:
        return None
    previous = [v.strip() for v in env.get(PREVIOUS_ENV, "").split(",") if v.strip()]
    return _parse([current, *previous], f"${SECRET_ENV}/${PREVIOUS_ENV}")


def fingerprint(secret: bytes) -> str:
    return hkdf(secret, _FINGERPRINT_INFO, 8).hex()


def wrap(identity: bytes, secret: bytes) -> str:
    nonce = os.urandom(_NONCE_BYTES)
    sealed = AESGCM(hkdf(secret, _WRAP_INFO)).encrypt(nonce, identity, _WRAP_AAD)
    return base64.b64encode(nonce + sealed).decode()


def unwrap(wrapped: str, secret: bytes) -> bytes | None:
    """The identity key in ``wrapped`` if ``secret`` wrapped it, else None."""
    try:
        raw = base64.b64decode(wrapped, validate=True)
        return AESGCM(hkdf(secret, _WRAP_INFO)).decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _WRAP_AAD)
    except (InvalidTag, ValueError):
        return None


@dataclass(frozen=True)
class Keys:
    """What Auth signs and keys with: the identity key (owner ids, salts) and the accepted token keys."""

    identity: bytes
    token_keys: tuple[bytes, ...]  # the first signs, every one verifies

    @classmethod
    def derive(cls, identity: bytes, secrets: Sequence[bytes]) -> Keys:
        return cls(identity, tuple(hkdf(s, _TOKEN_INFO) for s in secrets))

    @property
    def salt_key(self) -> bytes:
        return hkdf(self.identity, _SALT_INFO)


def _open(wrapped: Mapping[str, str], secrets: Sequence[bytes]) -> bytes | None:
    for secret in secrets:
        if (copy := wrapped.get(fingerprint(secret))) and (identity := unwrap(copy, secret)) is not None:
            return identity
    return None


async def open_keys(r: Any, secrets: Secrets | None) -> Keys:
    """The keys for ``secrets`` (None: the generated one in Redis), the identity key read from Redis (or
    created there); the identity key is re-wrapped for every accepted secret and the other copies deleted.
    ``r``: an asyncio Redis client that decodes responses. Raises SecretError if no accepted secret (nor the
    legacy plaintext one) opens the identity key Redis holds."""
    if secrets is None:
        generated = os.urandom(32).hex()
        if not await r.set(LEGACY_SECRET_KEY, generated, nx=True):
            generated = await r.get(LEGACY_SECRET_KEY) or generated
        secrets = Secrets((generated.encode(),), generated=True)
    for _ in range(2):  # a second pass if another process created the identity key meanwhile
        wrapped: dict[str, str] = await r.hgetall(IDENTITY_KEY)
        legacy: str | None = await r.get(LEGACY_SECRET_KEY)
        identity = _open(wrapped, secrets.accepted) or (_open(wrapped, [legacy.encode()]) if legacy else None)
        if identity is None and not wrapped:
            identity = bytes.fromhex(legacy) if legacy else os.urandom(32)
            args = [x for s in secrets.accepted for x in (fingerprint(s), wrap(identity, s))]
            if not await r.eval(_CREATE, 1, IDENTITY_KEY, *args):
                continue
            wrapped = dict(zip(args[::2], args[1::2], strict=True))
        if identity is None:
            raise SecretError(
                f"none of the {len(secrets.accepted)} configured server secrets opens the identity key in Redis "
                f"(it is wrapped for secret fingerprints {sorted(wrapped)}; these are "
                f"{[fingerprint(s) for s in secrets.accepted]}): give this process a secret the others accept; a new "
                "secret must first be accepted beside the old one, which wraps the identity key for it")
        ours = {fingerprint(s): s for s in secrets.accepted}
        async with r.pipeline(transaction=True) as pipe:
            for fp, secret in ours.items():
                if fp not in wrapped:
                    pipe.hsetnx(IDENTITY_KEY, fp, wrap(identity, secret))
            if stale := [fp for fp in wrapped if fp not in ours]:
                pipe.hdel(IDENTITY_KEY, *stale)
            if legacy and not secrets.generated:
                pipe.delete(LEGACY_SECRET_KEY)
            await pipe.execute()
        return Keys.derive(identity, secrets.accepted)
    raise SecretError("the identity key in Redis changed twice while it was being read")
