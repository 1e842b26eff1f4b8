"""chatsvc.redis_client: the connection flags, credentials (a password file, the URL's, a Sentinel's own), TLS
(``rediss://``) and Sentinel, against real redis-server processes: a password-protected master, its replica and a
Sentinel, and a gateway (``chatsvc serve --redis-sentinel``) whose reply runs across a Sentinel failover."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from gateway_fixtures import free_port
from serve_process import LongReply, Serve, assert_alternating, sse_json
from timing import scaled

from chatsvc import redis_client
from chatsvc.cli import add_serve_arguments, add_worker_arguments
from chatsvc.redis_client import RedisTarget, check_credentials, connect, parse_sentinels, target_from_args
from chatsvc.store import Store
from chatsvc.store.keys import lock_key, messages_key

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "data-node-password"
SENTINEL_PASSWORD = "sentinel-password"
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


# -- the flags ---------------------------------------------------------------------------------------------------
def parse(command: str, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    (add_serve_arguments if command == "serve" else add_worker_arguments)(p)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDIS_URL", "REDIS_SENTINEL", "REDIS_SENTINEL_MASTER", "REDIS_USERNAME", "REDIS_PASSWORD_FILE",
                 "REDIS_SENTINEL_PASSWORD_FILE", "REDIS_SENTINEL_TLS_CA_FILE"):
        monkeypatch.delenv(name, raising=False)


def test_parse_sentinels() -> None:
    assert parse_sentinels("10.0.0.1:26379, sentinel-b:26380,[::1]:5000") == (
        ("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 5000))
    for bad in ("host", "host:", ":26379", "host:port", "host:0", "host:70000", "a:1,,b:2"):
        with pytest.raises(ValueError, match="not a Sentinel address"):
            parse_sentinels(bad)


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_sentinel_flags_make_a_sentinel_target(command: str, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "spw").write_text("other\r\n")
    args = parse(command, "--redis-sentinel", "a:26379,b:26380", "--redis-sentinel-master", "prod",
                 "--redis-password-file", str(tmp_path / "pw"), "--redis-sentinel-password-file", str(tmp_path / "spw"))
    assert target_from_args(args) == RedisTarget(sentinels=(("a", 26379), ("b", 26380)), master="prod",
                                                 password="s3cret", sentinel_password="other")
    default = target_from_args(parse(command, "--redis-sentinel", "a:26379"))
    assert default is not None and default.master == "mymaster" and default.password is None
    assert default.sentinel_tls_ca_file is None
    tls = target_from_args(parse(command, "--redis-sentinel", "a:26379", "--redis-sentinel-tls-ca-file",
                                 str(tmp_path / "pw")))
    assert tls is not None and tls.sentinel_tls_ca_file == str(tmp_path / "pw")
    assert tls.describe() == "master 'mymaster' of the Sentinels at a:26379 over TLS"


def test_flags_default_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-env")
    monkeypatch.setenv("REDIS_SENTINEL", "s1:26379")
    monkeypatch.setenv("REDIS_PASSWORD_FILE", str(tmp_path / "pw"))
    target = target_from_args(parse("worker"))
    assert target == RedisTarget(sentinels=(("s1", 26379),), password="from-env")


def test_no_redis_named_is_none_for_the_embedded_one() -> None:
    assert target_from_args(parse("serve")) is None
    assert target_from_args(parse("serve", "--redis-url", "redis://h:6379/0")) == RedisTarget(url="redis://h:6379/0")


@pytest.mark.parametrize(("argv", "message"), [
    (["--redis-url", "redis://h/0", "--redis-sentinel", "s:26379"], "either --redis-url"),
    (["--redis-url", "redis://:inline@h/0", "--redis-password-file", "{pw}"], "give it once"),
    (["--redis-url", "redis://app@h/0", "--redis-username", "app"], "give it once"),
    (["--redis-password-file", "{pw}"], "without --redis-url or --redis-sentinel"),
    (["--redis-url", "redis://h/0", "--redis-password-file", "{missing}"], "No such file"),
    (["--redis-url", "redis://h/0", "--redis-password-file", "{empty}"], "is empty"),
    (["--redis-sentinel", "s"], "not a Sentinel address"),
    (["--redis-sentinel-tls-ca-file", "{pw}"], "without --redis-sentinel"),
    (["--redis-url", "rediss://h/0", "--redis-sentinel-tls-ca-file", "{pw}"], "use rediss:// and ?ssl_ca_certs="),
    (["--redis-sentinel", "s:26379", "--redis-sentinel-tls-ca-file", "{missing}"], "No such file"),
])
def test_bad_options_exit_with_one_line(argv: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("pw")
    (tmp_path / "empty").write_text("\n")
    files = {"pw": tmp_path / "pw", "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    with pytest.raises(SystemExit) as exc:
        target_from_args(parse("serve", *(a.format(**files) for a in argv)))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_describe_never_shows_the_password() -> None:
    assert RedisTarget(url="rediss://app:hunter2@h:6380/1").describe() == "rediss://app:***@h:6380/1"
    assert RedisTarget(url="redis://:hunter2@h/0").describe() == "redis://:***@h/0"
    assert RedisTarget(url="redis://h/0").describe() == "redis://h/0"
    target = RedisTarget(sentinels=(("a", 1), ("b", 2)), master="m", password="hunter2", sentinel_password="pw2")
    assert target.describe() == "master 'm' of the Sentinels at a:1,b:2"
    assert "hunter2" not in repr(target) and "pw2" not in repr(target)


# -- real servers ------------------------------------------------------------------------------------------------
class Server:
    """One redis-server (a data node or, with ``sentinel``, a Sentinel) on a free port, until ``stop()``."""

    def __init__(self, workdir: Path, name: str, *args: str, conf: str = "", sentinel: bool = False) -> None:
        self.port = free_port()
        self.dir = workdir / name
        self.dir.mkdir()
        conf_file = self.dir / "redis.conf"  # a Sentinel rewrites its file: it must be its own, writable
        conf_file.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n{conf}")
        self.proc = subprocess.Popen(["redis-server", str(conf_file), *(["--sentinel"] if sentinel else []), *args],
                                     stdout=(self.dir / "log").open("wb"), stderr=subprocess.STDOUT)
        self.password = SENTINEL_PASSWORD if sentinel else PASSWORD
        deadline = time.monotonic() + scaled(10)
        while True:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError((self.dir / "log").read_text()) from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_connect_timeout=1, decode_responses=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Topology:
    """A master and its replica, both requiring PASSWORD, and a Sentinel (requiring SENTINEL_PASSWORD) watching
    them as ``mymaster``, with timeouts short enough for a test."""

    def __init__(self, workdir: Path, tls: tuple[Path, Path, Path] | None = None) -> None:
        """``tls`` (ca, cert, key): each node also listens on a TLS port (``tls_ports``), the replica replicates
        and the Sentinel talks to both over TLS, so the addresses the Sentinel names are TLS ports; the plain
        ports stay for the test's own looks."""
        # A master waits repl-diskless-sync-delay (5 s) for more replicas before it syncs the first one.
        auth = f"requirepass {PASSWORD}\nmasterauth {PASSWORD}\nsave \"\"\nappendonly no\nrepl-diskless-sync-delay 0\n"
        self.tls_ports = {name: free_port() for name in ("master", "replica", "sentinel")} if tls else {}

        def tls_conf(name: str) -> str:
            if tls is None:
                return ""
            return (f"tls-port {self.tls_ports[name]}\ntls-cert-file {tls[1]}\ntls-key-file {tls[2]}\n"
                    f"tls-ca-cert-file {tls[0]}\ntls-auth-clients no\ntls-replication yes\n")

        self.servers: list[Server] = []
        try:
            self.master = self._add(Server(workdir, "master", conf=auth + tls_conf("master")))
            master_port = self.tls_ports.get("master", self.master.port)
            self.replica = self._add(Server(workdir, "replica", conf=(
                auth + tls_conf("replica") + f"replicaof 127.0.0.1 {master_port}\n")))
            self.sentinel = self._add(Server(workdir, "sentinel", sentinel=True, conf=(
                f"requirepass {SENTINEL_PASSWORD}\n{tls_conf('sentinel')}"
                f"sentinel monitor mymaster 127.0.0.1 {master_port} 1\n"
                f"sentinel auth-pass mymaster {PASSWORD}\n"
                "sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n")))
            self.wait(lambda: self._replica_seen(), "the Sentinel to see the synced replica")
        except BaseException:
            self.stop()
            raise

    def _add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    def _replica_seen(self) -> bool:
        replicas = self.sentinel.client().execute_command("SENTINEL", "REPLICAS", "mymaster")
        return any(r["flags"] == "slave" and r["master-link-status"] == "ok" for r in replicas)

    @staticmethod
    def wait(cond: Any, what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + scaled(timeout_s)
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def master_port(self) -> int:
        return int(self.sentinel.client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")[1])

    def failover(self, how: str) -> None:
        """``failover``: a forced failover (no quorum asked), retried while the Sentinel finds no replica good enough
        yet; ``kill``: the master killed (-9), found down by the Sentinel after down-after-milliseconds."""
        old = self.master_port()
        if how == "kill":
            self.master.stop()
        else:
            self.wait(lambda: self._try_failover(), "the Sentinel to accept the failover")
        self.wait(lambda: self.master_port() != old, "the replica's promotion")
        self.wait(lambda: self.replica.client().info("replication")["role"] == "master", "the new master")

    def _try_failover(self) -> bool:
        try:
            return bool(self.sentinel.client().execute_command("SENTINEL", "FAILOVER", "mymaster"))
        except redis.ResponseError:  # NOGOODSLAVE until the replica's state is fresh; INPROG
            return False

    def target(self, password: str | None = PASSWORD, sentinel_password: str | None = SENTINEL_PASSWORD,
               ) -> RedisTarget:
        return RedisTarget(sentinels=(("127.0.0.1", self.sentinel.port),), password=password,
                           sentinel_password=sentinel_password)

    def flags(self, tmp_path: Path) -> list[str]:
        (tmp_path / "redis-password").write_text(PASSWORD + "\n")
        (tmp_path / "sentinel-password").write_text(SENTINEL_PASSWORD + "\n")
        return ["--redis-sentinel", f"127.0.0.1:{self.sentinel.port}", "--redis-sentinel-master", "mymaster",
                "--redis-password-file", str(tmp_path / "redis-password"),
                "--redis-sentinel-password-file", str(tmp_path / "sentinel-password")]

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    (tmp_path / "redis").mkdir()
    top = Topology(tmp_path / "redis")
    yield top
    top.stop()


@pytest.mark.integration
async def test_sentinel_target_reaches_the_master_with_both_passwords(topology: Topology) -> None:
    client = connect(topology.target())
    try:
        assert await client.set("k", "v")
        assert await client.get("k") == "v"
        assert client.connection_pool.connection_kwargs["socket_connect_timeout"] == 2
    finally:
        await client.aclose()
    assert topology.master.client().get("k") == "v"  # written on the master the Sentinel names
    await check_credentials(topology.target())  # passes: both passwords right


@pytest.mark.integration
async def test_a_master_short_of_replicas_refuses_writes_as_a_refusal(tmp_path: Path) -> None:
    # min-replicas-to-write with no replica: what an old master answers during a Sentinel failover.
    server = Server(tmp_path, "alone", conf=f"requirepass {PASSWORD}\nsave \"\"\nmin-replicas-to-write 1\n")
    client = connect(RedisTarget(url=f"redis://127.0.0.1:{server.port}/0", password=PASSWORD))
    try:
        with pytest.raises(redis.ResponseError) as short:
            await client.set("k", "v")
        assert str(short.value).startswith("NOREPLICAS") and redis_client.refused(short.value)
        assert await client.get("k") is None  # refused, not applied: safe to send again
        await client.config_set("min-replicas-to-write", 0)
        assert await client.set("k", "v")
        with pytest.raises(redis.ResponseError) as wrong:
            await client.lpush("k", "x")  # an error of the command itself is no refusal
        assert not redis_client.refused(wrong.value)
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.integration
async def test_a_sentinel_that_is_down_is_skipped_at_once(topology: Topology) -> None:
    dead = ("127.0.0.1", free_port())  # nothing listens there: connections are refused
    target = RedisTarget(sentinels=(dead, ("127.0.0.1", topology.sentinel.port)), password=PASSWORD,
                         sentinel_password=SENTINEL_PASSWORD)
    client = connect(target)
    try:
        t0 = time.monotonic()
        assert await client.ping()
        assert time.monotonic() - t0 < 2.0  # not redis-py's default retries of the refused one (about 5 s)
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_writes_follow_the_promoted_replica_while_the_old_master_is_still_up(topology: Topology) -> None:
    """After a failover the old master stays a writable master until the Sentinel demotes it (seconds later) and
    then drops what it took meanwhile: a client that kept its connection there would lose those writes."""
    client = connect(topology.target())
    try:
        await client.set("before", "1")  # an open connection to the master of now
        topology.failover("failover")
        assert topology.master.client().info("replication")["role"] == "master"  # not demoted yet
        await asyncio.sleep(redis_client.MASTER_CHECK_S)
        await client.set("after", "1")
        assert topology.master.client().info("replication")["role"] == "master"
        assert topology.replica.client().get("after") == "1"  # on the new master
        assert topology.master.client().get("after") is None  # not on the old one, where it would be lost
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_wrong_credentials_exit_with_one_line(topology: Topology, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{topology.master.port}/0"
    cases = [(RedisTarget(url=url, password="wrong"), "refused the credentials"),
             (RedisTarget(url=url), "refused the credentials"),  # NOAUTH: none given where one is required
             (topology.target(password="wrong"), "refused the credentials"),
             (topology.target(sentinel_password="wrong"), "Sentinel at 127.0.0.1"),
             (topology.target(sentinel_password=None), "Sentinel at 127.0.0.1")]
    for target, message in cases:
        with pytest.raises(SystemExit) as exc:
            await check_credentials(target)
        assert message in str(exc.value) and "\n" not in str(exc.value), (target, exc.value)
        assert "wrong" not in str(exc.value) and PASSWORD not in str(exc.value)
    await check_credentials(RedisTarget(url=f"redis://:{PASSWORD}@127.0.0.1:{topology.master.port}/0"))


@needs_redis
@pytest.mark.integration
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_cli_exits_at_start_on_a_wrong_password(command: str, tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    server = Server(tmp_path / "redis", "master", conf=f"requirepass {PASSWORD}\nsave \"\"\n")
    try:
        (tmp_path / "pw").write_text("not-the-password\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
        res = subprocess.run([sys.executable, "-m", "chatsvc.cli", command, "--redis-url",
                              f"redis://127.0.0.1:{server.port}/0", "--redis-password-file", str(tmp_path / "pw")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(60))
    finally:
        server.stop()
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    assert "refused the credentials" in res.stderr.strip().splitlines()[-1], res.stderr


def make_tls_files(out: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate it signed, for 127.0.0.1: (ca.pem, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("test CA", ca_key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")]), ca_key, True)
    server_cert = cert("127.0.0.1", key, ca_cert.subject, ca_key, False)
    paths = out / "ca.pem", out / "server.pem", out / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@needs_redis
@pytest.mark.integration
async def test_rediss_url_with_a_password_file(tmp_path: Path) -> None:
    ca, cert, key = make_tls_files(tmp_path)
    (tmp_path / "redis").mkdir()
    tls_port = free_port()
    try:
        server = Server(tmp_path / "redis", "tls", "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                        "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                        conf=f"requirepass {PASSWORD}\nsave \"\"\n")
    except RuntimeError as e:
        if "tls" in str(e).lower():
            pytest.skip(f"this redis-server has no TLS: {e}")
        raise
    try:
        (tmp_path / "pw").write_text(PASSWORD + "\n")
        args = parse("serve", "--redis-url", f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}",
                     "--redis-password-file", str(tmp_path / "pw"))
        target = target_from_args(args)
        assert target is not None
        await check_credentials(target)
        store = Store.from_url(target, session_ttl_s=60, stream_ttl_s=30)
        try:
            assert await store.ping()
            await store.r.set("over-tls", "1")
        finally:
            await store.close()
        assert server.client().get("over-tls") == "1"  # the plain port sees what went through TLS
        untrusted = connect(RedisTarget(url=f"rediss://127.0.0.1:{tls_port}/0", password=PASSWORD))
        try:
            with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
                await untrusted.ping()  # the certificate is checked: without the CA it is refused
        finally:
            await untrusted.aclose()
    finally:
        server.stop()


@needs_redis
@pytest.mark.integration
async def test_sentinels_over_tls_name_a_master_reached_over_tls_across_a_failover(tmp_path: Path) -> None:
    ca, cert, key = make_tls_files(tmp_path)
    (tmp_path / "redis").mkdir()
    try:
        topology = Topology(tmp_path / "redis", tls=(ca, cert, key))
    except RuntimeError as e:
        if "tls" in str(e).lower():
            pytest.skip(f"this redis-server has no TLS: {e}")
        raise
    sentinel = ("127.0.0.1", topology.tls_ports["sentinel"])
    target = RedisTarget(sentinels=(sentinel,), password=PASSWORD, sentinel_password=SENTINEL_PASSWORD,
                         sentinel_tls_ca_file=str(ca))
    try:
        assert topology.master_port() == topology.tls_ports["master"]
        await check_credentials(target)
        client = connect(target)
        try:
            await client.set("before", "1")
            assert topology.master.client().get("before") == "1"
            topology.failover("failover")
            assert topology.master_port() == topology.tls_ports["replica"]  # the promoted one's TLS port
            await asyncio.sleep(redis_client.MASTER_CHECK_S)
            await client.set("after", "1")
            assert topology.replica.client().get("after") == "1"
        finally:
            await client.aclose()
        untrusted = connect(dataclasses.replace(target, sentinel_tls_ca_file=None))
        try:
            with pytest.raises(redis.ConnectionError):
                await untrusted.ping()  # plain text to a TLS port: no master is named
        finally:
            await untrusted.aclose()
        other_ca = make_tls_files(tmp_path / "redis")[0]  # a CA that signed none of these certificates
        stranger = connect(dataclasses.replace(target, sentinel_tls_ca_file=str(other_ca)))
        try:
            with pytest.raises(redis.ConnectionError):
                await stranger.ping()
        finally:
            await stranger.aclose()
    finally:
        topology.stop()


# -- a failover under a real gateway -----------------------------------------------------------------------------
MAX_TOKENS = 3000  # long enough that the reply still runs when the failover has completed


@pytest.mark.integration
@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["failover", "kill"])
def test_gateway_reply_across_a_sentinel_failover(how: str, topology: Topology, tmp_path: Path) -> None:
    """A turn streaming while the Sentinel promotes the replica (asked to, or on finding the master killed) is stored
    once, on the new master; sessions written before are read back from it, and turns and sessions made after the
    failover work."""
    from tiny_model import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "tiny", max_position_embeddings=4096)
    srv = Serve(str(model), free_port(), None, *topology.flags(tmp_path), "--max-model-len", "4096",
                "--num-kv-blocks", "320")
    srv.start()
    try:
        before = httpx.post(srv.url + "/v1/sessions", json={}, timeout=10).json()["id"]
        with httpx.stream("POST", f"{srv.url}/v1/sessions/{before}/messages",
                          json={"content": "hi", "max_tokens": 4}, timeout=60) as r:
            assert list(sse_json(r))[-1]["type"] == "done"
        old_master = topology.master_port()
        assert old_master == topology.master.port

        sid = httpx.post(srv.url + "/v1/sessions", json={}, timeout=10).json()["id"]
        reply = LongReply(srv.url, sid, MAX_TOKENS)
        reply.wait_streaming(30)
        topology.failover(how)
        assert reply.still_streaming(), "the reply ended before the failover: nothing was tested"
        reply.join(150, srv.output)
        events = reply.events
        done = events[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        assert done["usage"]["completion_tokens"] == MAX_TOKENS

        assert topology.master_port() == topology.replica.port != old_master
        msgs = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["messages"]
        assert_alternating(msgs)
        assert len(msgs) == 2 and msgs[1] == done["message"]  # stored exactly once, the whole reply
        new_master = topology.replica.client()
        assert new_master.llen(messages_key(sid)) == 2  # on the promoted replica itself
        assert not new_master.exists(lock_key(sid))

        old = httpx.get(f"{srv.url}/v1/sessions/{before}", timeout=10).json()["messages"]
        assert len(old) == 2  # written before the failover, read back from the new master
        for session in (sid, httpx.post(srv.url + "/v1/sessions", json={}, timeout=10).json()["id"]):
            with httpx.stream("POST", f"{srv.url}/v1/sessions/{session}/messages",
                              json={"content": "more", "max_tokens": 3}, timeout=60) as r:
                assert r.status_code == 200, r.read()
                assert list(sse_json(r))[-1]["type"] == "done"
        after = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["messages"]
        assert_alternating(after)
        assert len(after) == 4 and after[1] == done["message"]
    finally:
        srv.stop()


@pytest.mark.integration
@pytest.mark.long
@pytest.mark.timeout(300)
def test_split_form_across_a_sentinel_failover(topology: Topology, tmp_path: Path) -> None:
    """A worker and a gateway (--engine redis), both on --redis-sentinel: a reply the worker streams while the
    Sentinel promotes the replica reaches its reader and is stored once; both follow the new master for the next
    turn (the worker's stream reads and heartbeat, the gateway's dispatch)."""
    from tiny_model import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "tiny", max_position_embeddings=4096)
    flags = topology.flags(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "chatsvc.cli", "worker", "--model", str(model), *flags,
                               "--engine", "thread", "--engine-threads", "1", "--num-kv-blocks", "320",
                               "--max-model-len", "4096", "--heartbeat-ttl", "10", "--log-level", "warning"],
                              cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT)
    srv = Serve(str(model), free_port(), None, *flags, "--engine", "redis", "--max-model-len", "4096")
    try:
        srv.start()
        sid = httpx.post(srv.url + "/v1/sessions", json={}, timeout=10).json()["id"]
        reply = LongReply(srv.url, sid, MAX_TOKENS)
        reply.wait_streaming(30)
        topology.failover("failover")
        assert reply.still_streaming(), "the reply ended before the failover: nothing was tested"
        reply.join(150, srv.output)
        events = reply.events
        done = events[-1]
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == MAX_TOKENS, done
        text = "".join(e["text"] for e in events if e["type"] == "delta")
        assert text == done["message"]["content"]  # every delta once, none lost or repeated
        msgs = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["messages"]
        assert len(msgs) == 2 and msgs[1] == done["message"]
        assert topology.replica.client().llen(messages_key(sid)) == 2
        with httpx.stream("POST", f"{srv.url}/v1/sessions/{sid}/messages",
                          json={"content": "more", "max_tokens": 3}, timeout=60) as r:
            assert r.status_code == 200, r.read()
            assert list(sse_json(r))[-1]["type"] == "done"
        assert len(httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["messages"]) == 4
        assert worker.poll() is None
    finally:
        srv.stop()
        worker.terminate()
        worker.wait(60)
        log.close()


def test_one_module_builds_every_client() -> None:
    """The gateway's store, its client of engine workers and the worker make their clients through connect()."""
    for path in ("chatsvc/cli.py", "chatsvc/remote_engine.py", "chatsvc/store/base.py"):
        source = (REPO / path).read_text()
        assert "Redis.from_url(" not in source and "Sentinel(" not in source, path
