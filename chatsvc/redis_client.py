"""How every process reaches Redis: a URL (``redis://``, ``rediss://`` for TLS, ``unix://``) or a set of Redis
Sentinels that name the current master, with the credentials to use, and one way to make the asyncio client
from them, so that the gateway's store, its client of engine workers and ``chatsvc worker`` connect alike.

Through Sentinel, redis-py's ``SentinelConnectionPool`` asks the Sentinels for the master's address whenever it
opens a connection; after a failover the old master answers READONLY (or drops the connection), the connection
is closed and the command's retry reconnects to the promoted replica. Before the old master is demoted it still
takes writes, so connections are also checked against the master the Sentinels name (:class:`_FollowingPool`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    BusyLoadingError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("chatsvc.redis")

# What Redis answers when it refuses a command without applying it: memory pressure (OOM under maxmemory), a
# replica or a Sentinel failover in progress (READONLY, MASTERDOWN), a restart still loading its data
# (LOADING). Any command, idempotent or not, may be sent again after one of these.
REFUSED_ERRORS: tuple[type[Exception], ...] = (OutOfMemoryError, ReadOnlyError, MasterDownError, BusyLoadingError)
# The same for the refusals redis-py has no class for (a plain ResponseError): a master with
# min-replicas-to-write and too few replicas (the moment of a Sentinel failover) answers NOREPLICAS.
REFUSED_CODES = ("NOREPLICAS",)
# Each command rides out a short refusal by itself (about a second): a failover's switch, a moment over
# maxmemory. A longer one is the caller's (a finished reply waits in memory: chatsvc.turns).
COMMAND_RETRIES = 4
DEFAULT_MASTER = "mymaster"
# How often a connection taken for a command asks the Sentinels which master they name (see _FollowingPool).
MASTER_CHECK_S = 0.5
# What a server answers to credentials it does not accept (or to none where it wants some).
CREDENTIAL_ERRORS: tuple[type[Exception], ...] = (AuthenticationError, AuthenticationWrongNumberOfArgsError,
                                                  NoPermissionError)


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a command without applying it, so that it may be sent again."""
    if isinstance(exc, REFUSED_ERRORS):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(REFUSED_CODES)


def command_retry() -> Retry:
    """redis-py's retry of each command, on connection errors and timeouts (its defaults) and refusals."""
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), COMMAND_RETRIES)


@dataclass(frozen=True)
class RedisTarget:
    """Where Redis is: ``url``, or the master ``master`` that the Sentinels at ``sentinels`` name."""

    url: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_MASTER
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    # Through Sentinels only (a URL says it with rediss:// and ?ssl_ca_certs=): the Sentinels and the master they
    # name are reached over TLS, their certificates checked against this CA file.
    sentinel_tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        if (self.url is None) == (not self.sentinels):
            raise ValueError("a Redis target is a URL or a list of Sentinels, exactly one of them")
        if self.url is not None and self.sentinel_tls_ca_file is not None:
            raise ValueError("a Sentinel TLS CA file is for --redis-sentinel; with a URL, use rediss:// and "
                             "?ssl_ca_certs=")

    def describe(self) -> str:
        """For logs and errors: never the password."""
        if self.sentinels:
            where = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            tls = " over TLS" if self.sentinel_tls_ca_file else ""
            return f"master {self.master!r} of the Sentinels at {where}{tls}"
        parts = urlsplit(self.url or "")
        if parts.password is None:
            return self.url or ""
        user = f"{parts.username}:" if parts.username else ":"
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def parse_sentinels(text: str) -> tuple[tuple[str, int], ...]:
    """``host:port[,host:port...]`` (an IPv6 host in brackets) -> ((host, port), ...); ValueError if malformed."""
    out: list[tuple[str, int]] = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not a Sentinel address (host:port): {item!r}")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def read_secret_file(path: Path) -> str:
    """A password kept in a file (a Docker secret, say): its content less the line end an editor adds."""
    secret = path.read_text(encoding="utf-8").rstrip("\r\n")
    if not secret:
        raise ValueError(f"{path} is empty")
    return secret


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The connection flags ``serve`` and ``worker`` share besides ``--redis-url``."""
    env = os.environ.get
    p.add_argument("--redis-sentinel", default=env("REDIS_SENTINEL"), metavar="HOST:PORT[,HOST:PORT...]",
                   help="reach Redis through these Sentinels (instead of --redis-url; default: $REDIS_SENTINEL): "
                        "connections follow the master they name across a failover")
    p.add_argument("--redis-sentinel-master", default=env("REDIS_SENTINEL_MASTER", DEFAULT_MASTER), metavar="NAME",
                   help="the master's name in the Sentinels' configuration (default: $REDIS_SENTINEL_MASTER, "
                        f"else {DEFAULT_MASTER})")
    p.add_argument("--redis-username", default=env("REDIS_USERNAME"),
                   help="Redis ACL user (default: $REDIS_USERNAME; or put it in the URL)")
    p.add_argument("--redis-password-file", type=Path, default=env("REDIS_PASSWORD_FILE"), metavar="PATH",
                   help="file holding the Redis password (default: $REDIS_PASSWORD_FILE); or put it in the URL")
    p.add_argument("--redis-sentinel-password-file", type=Path, default=env("REDIS_SENTINEL_PASSWORD_FILE"),
                   metavar="PATH", help="file holding the Sentinels' own password, where they require one "
                                        "(default: $REDIS_SENTINEL_PASSWORD_FILE)")
    p.add_argument("--redis-sentinel-tls-ca-file", type=Path, default=env("REDIS_SENTINEL_TLS_CA_FILE"),
                   metavar="PATH", help="reach the Sentinels and the master they name over TLS, checking their "
                                        "certificates against this CA file (default: $REDIS_SENTINEL_TLS_CA_FILE; "
                                        "with --redis-url, use rediss:// and ?ssl_ca_certs=)")


def target_from_args(args: argparse.Namespace) -> RedisTarget | None:
    """The Redis the flags name (None: neither --redis-url nor --redis-sentinel); SystemExit, with one line saying
    what is wrong, for flags that do not fit together or a password file that cannot be read."""
    url, sentinels = args.redis_url or None, args.redis_sentinel or None
    if url and sentinels:
        raise SystemExit("give either --redis-url (REDIS_URL) or --redis-sentinel (REDIS_SENTINEL), not both")
    try:
        password = read_secret_file(Path(args.redis_password_file)) if args.redis_password_file else None
        sentinel_password = (read_secret_file(Path(args.redis_sentinel_password_file))
                             if args.redis_sentinel_password_file else None)
        if url and password and urlsplit(url).password is not None:
            raise ValueError("the Redis password is both in the URL and in --redis-password-file: give it once")
        if url and args.redis_username and urlsplit(url).username:
            raise ValueError("the Redis user is both in the URL and in --redis-username: give it once")
        tls_ca = args.redis_sentinel_tls_ca_file
        if not (url or sentinels):
            if password or sentinel_password or args.redis_username:
                raise ValueError("Redis credentials were given without --redis-url or --redis-sentinel")
            if tls_ca:
                raise ValueError("a Sentinel TLS CA file was given without --redis-sentinel")
            return None
        if tls_ca:
            Path(tls_ca).read_bytes()  # unreadable: said now, not as a TLS error on every connection
        return RedisTarget(url=url, sentinels=parse_sentinels(sentinels) if sentinels else (),
                           master=args.redis_sentinel_master, username=args.redis_username or None,
                           password=password, sentinel_password=sentinel_password,
                           sentinel_tls_ca_file=str(tls_ca) if tls_ca else None)
    except (OSError, ValueError) as e:
        raise SystemExit(f"Redis options: {e}") from None


class _FollowingPool(SentinelConnectionPool):
    """Connections to the master the Sentinels name now, not the one they named when the connection opened.

    redis-py moves a connection only when it fails or answers READONLY. After a failover the old master, if it
    is still up, stays a writable master until the Sentinels demote it (seconds later), and whatever is written
    to it meanwhile is dropped when it resyncs from the new one. So a connection taken for a command first
    re-reads the master's address (at most every MASTER_CHECK_S) and is reopened if it points elsewhere."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._checked_at = 0.0

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        now = time.monotonic()
        if now - self._checked_at >= MASTER_CHECK_S:
            self._checked_at = now
            # No Sentinel answering (or none naming a master) is for connect() to report, with its retries; a
            # slow one must not hold the command up for long when the connection it has still works.
            with contextlib.suppress(RedisConnectionError, RedisTimeoutError, TimeoutError):
                # get_master_address() closes the idle connections when the master moved.
                await asyncio.wait_for(self.get_master_address(), MASTER_CHECK_S)  # type: ignore[no-untyped-call]
        address = (getattr(connection, "host", None), getattr(connection, "port", None))
        if connection.is_connected and self.master_address is not None and address != self.master_address:
            await connection.disconnect()  # connect() then asks the Sentinels again
        await super().ensure_connection(connection)


class _SentinelMaster(aioredis.Redis):
    """The master's client; closing it also closes the connections to the Sentinels that name the master."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await _sentinel_of(self).aclose()


def _sentinel_of(client: aioredis.Redis) -> Sentinel:
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool), pool
    sentinel: Sentinel = pool.sentinel_manager
    return sentinel


def connect(target: RedisTarget, socket_timeout: float | None = None) -> aioredis.Redis:
    """The asyncio client for ``target``: strings decoded, connections opened within 2 s and checked when idle,
    each command retried through a short refusal or a lost connection. ``socket_timeout``: how long a reply may
    take (None: unbounded, for blocking stream reads)."""
    options: dict[str, Any] = {"decode_responses": True, "socket_connect_timeout": 2, "socket_timeout": socket_timeout,
                               "health_check_interval": 15, "retry": command_retry(),
                               "retry_on_error": list(REFUSED_ERRORS)}
    if target.username:
        options["username"] = target.username
    if target.password:
        options["password"] = target.password
    if target.url is not None:
        return aioredis.Redis.from_url(target.url, **options)
    # A Sentinel answers at once or is skipped for the next one (no retries: redis-py's default retries a refused
    # connection for seconds), and never waited on as long as a command.
    tls: dict[str, Any] = ({"ssl": True, "ssl_ca_certs": target.sentinel_tls_ca_file}
                           if target.sentinel_tls_ca_file else {})
    options.update(tls)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs={  # type: ignore[no-untyped-call]
        "socket_connect_timeout": 2, "socket_timeout": 2, "retry": Retry(NoBackoff(), 0),
        "password": target.sentinel_password, **tls})
    client: aioredis.Redis = sentinel.master_for(target.master, redis_class=_SentinelMaster,
                                                 connection_pool_class=_FollowingPool, **options)
    return client


async def check_credentials(target: RedisTarget) -> None:
    """SystemExit, with one line, when Redis or a Sentinel refuses the credentials: every request would fail the
    same way. A Redis not reachable yet is only logged: the retries and /ready deal with that."""
    client = connect(target, socket_timeout=5)
    try:
        if target.sentinels:  # the Sentinels' own refusal, which master discovery would report as "no master"
            for sentinel in _sentinel_of(client).sentinels:
                try:
                    await sentinel.ping()
                except CREDENTIAL_ERRORS as e:
                    raise SystemExit(f"the Redis Sentinel at {_address(sentinel)} refused the credentials "
                                     f"(--redis-sentinel-password-file): {e}") from None
                except (RedisError, OSError):
                    continue  # down: the other Sentinels may answer
        await client.ping()
    except CREDENTIAL_ERRORS as e:
        hint = "" if target.password or urlsplit(target.url or "").password else " (none were given)"
        raise SystemExit(f"Redis ({target.describe()}) refused the credentials{hint}: {e}") from None
    except (RedisError, OSError) as e:
        log.warning("Redis (%s) is not reachable yet: %s", target.describe(), e)
    finally:
        await client.aclose()


def _address(client: aioredis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"{kw.get('host')}:{kw.get('port')}"


def from_args(args: argparse.Namespace) -> RedisTarget | None:
    """The Redis the command line names, its credentials checked once (a clear exit rather than a traceback on
    every request); None where it names none."""
    target = target_from_args(args)
    if target is not None:
        asyncio.run(check_credentials(target))
    return target
