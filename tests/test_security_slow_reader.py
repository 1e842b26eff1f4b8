"""A reader slower than the engine does not make the gateway buffer without bound (engine.client.DeltaQueue):
past a few queued deltas a sample's new deltas are merged into its last queued one (nothing is lost), and
past a hard cap on unread output the request is aborted and the reader gets a clear error event.

The unit tests drive the queue directly; the live tests put a real slow client (a socket that does not read,
with a small receive buffer) in front of the gateway and the tiny model in an engine process."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import LiveServer, redis_proc, wait_personas_pinned  # noqa: F401

from engine.client import DeltaQueue, StreamCounters, StreamLimits, relay_deltas
from engine.protocol import RequestDelta, StreamOverflowError


def delta(index: int, text: str, tid: int, *, finished: bool = False, last: bool = False,
          logprobs: bool = False) -> RequestDelta:
    return RequestDelta("r", index, text, [tid], finished, "length" if finished else None,
                        [{tid: -0.5, tid + 1: -1.5}] if logprobs else None, 3, tid, 0, request_finished=last)


def queue(coalesce_after: int = 4, max_buffered: int = 10_000) -> tuple[DeltaQueue, StreamCounters, list[int]]:
    aborted: list[int] = []
    counters = StreamCounters()
    return DeltaQueue(StreamLimits(coalesce_after, max_buffered), counters, lambda: aborted.append(1)), counters, aborted


def drain(q: DeltaQueue) -> list[RequestDelta | BaseException]:
    async def run() -> list[RequestDelta | BaseException]:
        return [await q.get() for _ in range(len(q))]
    return asyncio.run(run())


def test_a_reader_that_keeps_up_gets_every_delta_as_sent() -> None:
    q, counters, _ = queue()
    sent = [delta(0, "a", 1), delta(1, "b", 2), delta(0, "c", 3)]
    for d in sent:
        q.put_nowait(d)
    assert drain(q) == sent and counters.coalesced == 0


def test_deltas_of_a_slow_reader_are_merged_without_loss() -> None:
    q, counters, aborted = queue(coalesce_after=4)
    sent = []
    for step in range(200):
        for index in (0, 1, 2):
            sent.append(delta(index, f"<{index}:{step}>", step, logprobs=True, finished=step == 199,
                              last=step == 199 and index == 2))
    for d in sent:
        q.put_nowait(d)
        assert len(q) <= 4 + 1  # the bound, plus the request's last delta, never merged
    got = drain(q)
    assert counters.coalesced > 500 and not aborted
    assert all(isinstance(d, RequestDelta) for d in got)
    assert got[-1].request_finished and sum(d.request_finished for d in got) == 1  # type: ignore[union-attr]
    for index in (0, 1, 2):
        mine = [d for d in got if isinstance(d, RequestDelta) and d.index == index]
        want = [d for d in sent if d.index == index]
        assert "".join(d.text for d in mine) == "".join(d.text for d in want)
        assert [t for d in mine for t in d.token_ids] == [t for d in want for t in d.token_ids]
        assert [lp for d in mine for lp in d.logprobs or []] == [lp for d in want for lp in d.logprobs or []]
        assert mine[-1].finished and mine[-1].finish_reason == "length" and mine[-1].completion_tokens == 199
    # Reading released what was buffered: a whole bound's worth of new output fits again.
    q.put_nowait(RequestDelta("r", 0, "", list(range(10_000)), False, None, None, 3, 0, 0))
    assert not aborted and counters.overflowed == 0


def test_merged_deltas_are_joined_once_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Joining on every put would copy the growing text and token list each time: quadratic in the unread output.
    import engine.client as client_module

    joined: list[int] = []
    real = client_module._merge
    def counted(parts: list[RequestDelta]) -> RequestDelta:
        joined.append(len(parts))
        return real(parts)

    monkeypatch.setattr(client_module, "_merge", counted)
    q, counters, _ = queue(coalesce_after=1)
    for step in range(5000):
        q.put_nowait(delta(0, "x", step))
    assert counters.coalesced == 4999 and joined == []  # nothing joined while the reader is away
    (got,) = drain(q)
    assert joined == [5000] and isinstance(got, RequestDelta)
    assert got.text == "x" * 5000 and got.token_ids == list(range(5000))


def test_an_exception_follows_what_was_queued_before_it() -> None:
    q, _, _ = queue(coalesce_after=1)
    q.put_nowait(delta(0, "a", 1))
    q.put_nowait(RuntimeError("engine died"))
    q.put_nowait(delta(0, "b", 2))  # after the error: not merged into what came before it
    got = drain(q)
    assert isinstance(got[0], RequestDelta) and got[0].text == "a"
    assert isinstance(got[1], RuntimeError)


def test_output_past_the_hard_cap_aborts_the_request_once_and_tells_the_reader() -> None:
    q, counters, aborted = queue(coalesce_after=4, max_buffered=300)  # 3 entries per delta with logprobs
    for step in range(150):
        q.put_nowait(delta(0, "x", step, logprobs=True))
    assert aborted == [1] and counters.overflowed == 1
    assert len(q) == 1  # what was buffered is dropped at once: only the error is left

    seen: list[bool] = []

    async def read() -> None:
        with pytest.raises(StreamOverflowError, match="fell more than 300"):
            async for _ in relay_deltas(q, seen.append):
                pass

    asyncio.run(read())
    assert seen == [True]  # already aborted: the stream's exit does not abort it again


# ---- live: a real slow client against the gateway and an engine process -------------------------------

ENGINE_KW: dict[str, Any] = {"dtype": "float32", "attention_backend": "torch", "block_size": 16,
                             "num_kv_blocks": 512, "max_num_seqs": 8, "swap_space_mb": 0}


@pytest.fixture(scope="module")
def live(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any]]:  # noqa: F811
    import redis as sync_redis
    from tiny_model import make_tiny_model_dir

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store
    from engine.engine_process import ProcessEngine

    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    tiny = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-slow"), arch="llama", max_position_embeddings=2048)
    eng = ProcessEngine.from_args(str(tiny), engine_threads=1, **ENGINE_KW)
    # The slow client reads nothing until the engine has finished the whole reply: on a loaded machine that
    # outlasts the default 30 s send timeout, which would cut the stream these tests mean to read whole (the
    # timeout has tests of its own).
    settings = Settings(web_dir=Path("/nonexistent"), sse_send_timeout_s=600.0)
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), settings)
    with LiveServer(app) as server:
        # A persona pinned between the fast and the slow reply would hold blocks the fast one had: the slow one,
        # cut short by the KV pool (8 x 1900 tokens do not fit), would end earlier.
        wait_personas_pinned(app)
        yield server, eng


# 8 x 1900 chunks of ~1.3 KB (20 logprobs each): several times what the kernel's socket buffers hold (4 MiB).
BODY: dict[str, Any] = {"prompt": "Hello! How are you today?", "n": 8, "max_tokens": 1900, "ignore_eos": True,
                        "temperature": 0.0, "stream": True, "logprobs": 20}


def events(raw: bytes) -> list[dict[str, Any] | str]:
    """The data of every SSE event in an HTTP/1.0 response (close-delimited body: no chunked framing)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    out: list[dict[str, Any] | str] = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def texts(evs: list[dict[str, Any] | str]) -> dict[int, str]:
    out: dict[int, str] = {}
    for ev in evs:
        if isinstance(ev, dict) and "choices" in ev:
            for c in ev["choices"]:
                out[c["index"]] = out.get(c["index"], "") + c["text"]
    return out


def token_logprobs(evs: list[dict[str, Any] | str]) -> dict[int, list[tuple[str, float]]]:
    out: dict[int, list[tuple[str, float]]] = {}
    for ev in evs:
        if isinstance(ev, dict) and "choices" in ev:
            for c in ev["choices"]:
                lp = c["logprobs"]
                out.setdefault(c["index"], []).extend(zip(lp["tokens"], lp["token_logprobs"], strict=True))
    return out


class SlowClient:
    """A streaming request over a socket with a 4 KiB receive buffer that nobody reads until ``read_all``."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def read_all(self) -> bytes:
        self.sock.settimeout(60)
        chunks = []
        while chunk := self.sock.recv(1 << 16):
            chunks.append(chunk)
        self.sock.close()
        return b"".join(chunks)


def wait_until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def idle(eng: Any) -> bool:
    s = eng.stats()
    return bool(s.requests_running == 0 and s.requests_waiting == 0)


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_slow_reader_gets_the_whole_reply_from_a_bounded_queue(live: tuple[LiveServer, Any]) -> None:
    server, eng = live
    with httpx.Client(base_url=server.url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=BODY) as r:
        fast = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    reference = [d if d == "[DONE]" else json.loads(d) for d in fast]
    want = texts(reference)
    assert len(want) == BODY["n"] and all(want.values())

    before = eng.stream_counters.coalesced
    limits = eng.stream_limits
    eng.stream_limits = StreamLimits(limits.coalesce_after, max_buffered=10**7)  # this test is about merging
    try:
        slow = SlowClient(server.port, BODY)
        wait_until(lambda: eng.stats().requests_running > 0, 30, "the request to start")
        longest = 0
        deadline = time.monotonic() + 120
        # The engine finishes the whole reply while the client reads nothing; meanwhile its queue stays short.
        while eng._streams and time.monotonic() < deadline:
            longest = max([longest, *(len(q) for q in list(eng._streams.values()))])
            if idle(eng):
                break
            time.sleep(0.005)
    finally:
        eng.stream_limits = limits
    assert idle(eng), "the engine should finish the reply while the client reads nothing"
    assert eng.stream_counters.coalesced - before > 1000  # the reply outran the reader's TCP buffers
    assert longest <= limits.coalesce_after + BODY["n"]
    got = events(slow.read_all())
    assert got[-1] == "[DONE]" and texts(got) == want  # merged, not lost
    # Some chunks carry several tokens (the merged ones), with their logprobs: the same as the fast reader's.
    assert max(len(c["logprobs"]["tokens"]) for ev in got if isinstance(ev, dict) for c in ev["choices"]) > 1
    assert token_logprobs(got) == token_logprobs(reference)
    assert b"chatsvc_stream_deltas_coalesced_total " in httpx.get(server.url + "/metrics").content


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_reader_past_the_hard_cap_is_cut_off_with_an_error_and_its_request_aborted(
        live: tuple[LiveServer, Any]) -> None:
    server, eng = live
    wait_until(lambda: idle(eng), 30, "an idle engine")
    free_at_idle = eng.stats().kv_blocks_free
    limits = eng.stream_limits
    eng.stream_limits = StreamLimits(limits.coalesce_after, max_buffered=20_000)
    try:
        slow = SlowClient(server.port, BODY)  # 8 x 1900 x 21 entries: far past the cap
        wait_until(lambda: eng.stream_counters.overflowed == 1, 120, "the stream to overflow")
        # Aborted at once (the reader has still read nothing): the engine is idle, every block free.
        wait_until(lambda: idle(eng), 10, "the aborted request to leave the engine")
    finally:
        eng.stream_limits = limits
    # Every block back but the default persona's pinned prompt (as before the request).
    wait_until(lambda: eng.stats().kv_blocks_free == free_at_idle, 10, "every block free")
    got = events(slow.read_all())
    assert got[-1] == "[DONE]"
    error = got[-2]
    assert isinstance(error, dict) and error["error"]["code"] == "stream_overflow"
    assert "fell more than 20000" in error["error"]["message"]
    assert sum(len(t) for t in texts(got).values()) < BODY["n"] * BODY["max_tokens"]
    assert b"chatsvc_streams_overflowed_total 1.0" in httpx.get(server.url + "/metrics").content


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_thread_engine_bounds_a_slow_readers_queue_too(tmp_path: Path) -> None:
    """The same queues behind ``--engine thread``: merged while under the cap, aborted past it."""
    from tiny_model import make_tiny_model_dir

    from engine.async_engine import AsyncEngine
    from engine.request import SamplingParams

    tiny = make_tiny_model_dir(tmp_path, arch="llama", max_position_embeddings=2048)
    eng = AsyncEngine.from_args(str(tiny), stream_limits=StreamLimits(coalesce_after=4, max_buffered=3000),
                                **ENGINE_KW)

    async def run() -> None:
        await eng.start()
        try:
            async def engine_idle_after_running() -> None:
                for want_running in (True, False):  # the engine's stats lag its first delta
                    while bool(eng.stats().requests_running) != want_running:
                        await asyncio.sleep(0.005)

            def params(max_tokens: int) -> SamplingParams:
                return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=2, logprobs=2)

            # Under the cap (2 x 300 tokens x 3 entries): the reader waits until the engine is done, then
            # gets everything, in fewer deltas than the engine sent.
            stream = eng.generate("fits", params(300), prompt="Hello")
            first = await anext(stream)
            await engine_idle_after_running()
            rest = [d async for d in stream]
            tokens = {i: [t for d in [first, *rest] if d.index == i for t in d.token_ids] for i in (0, 1)}
            assert all(len(t) == 300 for t in tokens.values()) and len(rest) + 1 < 600
            assert eng.stream_counters.coalesced > 0
            # Past it (2 x 1000 x 3): aborted while the reader sleeps, its blocks freed; the reader gets the error.
            stream = eng.generate("overflows", params(1000), prompt="Hello")
            await anext(stream)
            for _ in range(3000):
                if eng.stream_counters.overflowed and not eng.stats().requests_running:
                    break
                await asyncio.sleep(0.01)
            assert eng.stream_counters.overflowed == 1
            s = eng.stats()
            assert s.requests_running == 0 and s.kv_blocks_free == s.kv_blocks_total
            with pytest.raises(StreamOverflowError):
                async for _ in stream:
                    pass
        finally:
            await eng.stop()

    asyncio.run(run())
