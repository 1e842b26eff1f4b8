"""Integration tests of the gateway with the real default model and a real Redis (one server per module)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import websockets
from gateway_fixtures import LiveServer, default_model_path, redis_proc, wait_personas_pinned  # noqa: F401
from websockets.asyncio.client import connect

from chatsvc.app import create_app
from chatsvc.settings import Settings
from chatsvc.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BLOCK = 16


@pytest.fixture(scope="module")
def server(redis_proc) -> Iterator[LiveServer]:  # noqa: F811
    import redis as sync_redis
    import torch

    from engine.async_engine import AsyncEngine

    torch.set_num_threads(1)
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    # float32: the test compares greedy replies across batch shapes, exact only in float32.
    engine = AsyncEngine.from_args(model=default_model_path(), dtype="float32", num_kv_blocks=384, block_size=BLOCK,
                                   max_num_seqs=32, max_waiting=256)
    settings = Settings(abort_grace_s=2.0, max_n=4)
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), settings)
    with LiveServer(app) as live:
        wait_personas_pinned(app)
        live.gateway = app.state.gateway  # type: ignore[attr-defined]
        yield live


def metric(server: LiveServer, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def wait_idle(server: LiveServer, idle_free: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    free = metric(server, "chatsvc_kv_blocks_free")
    while free != idle_free and time.monotonic() < deadline:
        time.sleep(0.1)
        free = metric(server, "chatsvc_kv_blocks_free")
    return free


async def sse_events(resp: httpx.Response) -> AsyncIterator[tuple[str | None, dict[str, Any]]]:
    """(id, data) of each SSE event of a session reply."""
    eid: str | None = None
    async for line in resp.aiter_lines():
        if line.startswith("id:"):
            eid = line[3:].strip()
        elif line.startswith("data:"):
            yield eid, json.loads(line[5:].strip())


def test_openai_sdk_sync_streaming_and_not(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert chunks[0].choices[0].delta.role == "assistant"
    full = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=8, temperature=0)
    # Greedy: streaming and not give the same reply.
    assert full.choices[0].message.content == text and text
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.prompt_tokens > 0


async def test_openai_sdk_async_n_logprobs_and_completions(server: LiveServer) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
    res = await client.chat.completions.create(
        model=server.gateway.engine.model_name, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6, n=2, temperature=1.0, seed=1, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    assert sorted(c.index for c in res.choices) == [0, 1]
    for choice in res.choices:
        assert choice.logprobs is not None and len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    comp = await client.completions.create(model=server.gateway.engine.model_name, prompt="The capital of France is",
                                           max_tokens=5, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    parts = [c.choices[0].text async for c in comp if c.choices]
    again = await client.completions.create(model=server.gateway.engine.model_name,
                                            prompt="The capital of France is", max_tokens=5, temperature=0,
                                            logprobs=1, extra_body={"ignore_eos": True})
    assert "".join(parts) == again.choices[0].text
    assert again.choices[0].logprobs is not None and len(again.choices[0].logprobs.tokens) == 5


async def test_ws_three_turns_with_persona_reuse_earlier_turns(server: LiveServer) -> None:
    async with connect(server.ws_url + "/v1/ws") as ws:
        await ws.send(json.dumps({"type": "hello", "persona": "pirate"}))
        session = json.loads(await ws.recv())
        assert session["type"] == "session" and session["persona"] == "pirate" and session["messages"] == []
        prompts = ["Hi! Who are you?", "Where is your ship?", "Tell me about your crew."]
        prev_prompt_tokens = 0
        for i, content in enumerate(prompts):
            hits_before = metric(server, "chatsvc_prefix_cache_hit_tokens_total")
            await ws.send(json.dumps({"type": "message", "content": content, "max_tokens": 12, "temperature": 0}))
            text = ""
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "delta":
                    text += frame["text"]
                    assert frame["id"].startswith(f"{i + 1}:")
                else:
                    assert frame["type"] == "done", frame
                    break
            assert frame["message"]["content"] == text
            hits = metric(server, "chatsvc_prefix_cache_hit_tokens_total") - hits_before
            # Every earlier turn's full blocks come back from the prefix cache.
            assert hits >= (prev_prompt_tokens // BLOCK) * BLOCK
            prev_prompt_tokens = frame["usage"]["prompt_tokens"]
    stored = httpx.get(f"{server.url}/v1/sessions/{session['id']}").json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"] * 3
    assert [m["content"] for m in stored["messages"][::2]] == prompts
    assert all(m["finish_reason"] in ("stop", "length") and m["tokens"] > 0 for m in stored["messages"][1::2])


async def test_sessions_of_one_persona_share_its_pinned_blocks(server: LiveServer) -> None:
    pinned = server.gateway.personas.pinned["persona:tutor"]
    assert pinned >= BLOCK
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        sids = [(await http.post("/v1/sessions", json={"persona": "tutor"})).json()["id"] for _ in range(3)]
        snapshots: list[dict[str, Any]] = []

        async def turn(sid: str) -> dict[str, Any]:
            async with http.stream("POST", f"/v1/sessions/{sid}/messages",
                                   json={"content": f"Explain fractions, please ({sid[:4]}).", "max_tokens": 16,
                                         "ignore_eos": True}) as resp:
                async for _eid, ev in sse_events(resp):
                    if ev["type"] == "delta" and len(snapshots) < 20:
                        snapshots.append((await http.get("/v1/kv")).json())
                    if ev["type"] == "done":
                        return ev
            raise AssertionError("no done event")

        dones = await asyncio.gather(*(turn(s) for s in sids))
    assert all(d["usage"]["prompt_tokens_details"]["cached_tokens"] >= pinned for d in dones)
    # While the three replies ran concurrently, their block tables began with the same physical blocks.
    rids = {f"{sid}-1" for sid in sids}
    seen_together = False
    for snap in snapshots:
        tables = [blocks for rid, blocks in snap["requests"].items() if rid in rids]
        if len(tables) >= 2:
            seen_together = True
            shared = set.intersection(*(set(t[: pinned // BLOCK]) for t in tables))
            assert len(shared) == pinned // BLOCK
            assert all(snap["state"][b] == "pinned" for b in shared)
    assert seen_together


async def test_sse_resume_equals_uninterrupted_reply(server: LiveServer) -> None:
    body = {"content": "Write two sentences about the sea.", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        ref_sid = (await http.post("/v1/sessions", json={"persona": "assistant"})).json()["id"]
        async with http.stream("POST", f"/v1/sessions/{ref_sid}/messages", json=body) as resp:
            reference = "".join([ev.get("text", "") async for _, ev in sse_events(resp) if ev["type"] == "delta"])

        finished_before = metric(server, "chatsvc_requests_finished_total", '{reason="length"}')
        sid = (await http.post("/v1/sessions", json={"persona": "assistant"})).json()["id"]
        got, last_id = "", None
        async with http.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as resp:
            async for eid, ev in sse_events(resp):
                got += ev["text"]
                last_id = eid
                if len(got) > 5:
                    break  # drop the connection mid-reply
        assert last_id is not None
        async with http.stream("GET", f"/v1/sessions/{sid}/stream", headers={"Last-Event-ID": last_id}) as resp:
            assert resp.status_code == 200
            async for _eid, ev in sse_events(resp):
                if ev["type"] == "delta":
                    got += ev["text"]
                else:
                    done = ev
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert got == reference == done["message"]["content"]
    # One generation for the interrupted reply (plus the reference one), not two.
    assert metric(server, "chatsvc_requests_finished_total", '{reason="length"}') == finished_before + 1


async def test_ws_resume_after_a_dropped_socket_and_a_second_socket(server: LiveServer) -> None:
    async with connect(server.ws_url + "/v1/ws") as ws:
        await ws.send(json.dumps({"type": "hello", "persona": "assistant"}))
        sid = json.loads(await ws.recv())["id"]
        await ws.send(json.dumps({"type": "message", "content": "Describe a forest.", "max_tokens": 24,
                                  "ignore_eos": True, "temperature": 0}))
        first = [json.loads(await ws.recv()) for _ in range(3)]
        assert all(f["type"] == "delta" for f in first)
        ws.transport.abort()  # the network drops: no close frame, so the reply waits for a resume
    got = "".join(f["text"] for f in first)

    async def read_rest(after: str | None) -> tuple[str, dict[str, Any]]:
        async with connect(server.ws_url + "/v1/ws") as ws2:
            await ws2.send(json.dumps({"type": "hello", "session_id": sid}))
            assert json.loads(await ws2.recv())["busy"] is True
            await ws2.send(json.dumps({"type": "resume", **({"after": after} if after else {})}))
            text = ""
            while (frame := json.loads(await ws2.recv()))["type"] == "delta":
                text += frame["text"]
            return text, frame

    (rest, done), (whole, done2) = await asyncio.gather(read_rest(first[-1]["id"]), read_rest(None))
    assert done["type"] == done2["type"] == "done" and done["finish_reason"] == "length"
    assert got + rest == whole == done["message"]["content"]
    stored = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"]
    assert stored[-1]["content"] == whole and stored[-1]["tokens"] == 24


async def test_fifty_aborted_streams_free_every_block(server: LiveServer) -> None:
    idle_free = wait_idle(server, metric(server, "chatsvc_kv_blocks_free"))
    rng = random.Random(5)
    body = {"max_tokens": 64, "ignore_eos": True}

    async def ws_close(i: int) -> None:
        async with connect(server.ws_url + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "hello", "persona": "pirate"}))
            await ws.recv()
            await ws.send(json.dumps({"type": "message", "content": f"Story number {i}", **body}))
            for _ in range(rng.randint(0, 4)):
                await ws.recv()

    async def ws_cancel(i: int) -> None:
        async with connect(server.ws_url + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "hello"}))
            await ws.recv()
            await ws.send(json.dumps({"type": "message", "content": f"Tale {i}", **body}))
            for _ in range(rng.randint(0, 3)):
                await ws.recv()
            await ws.send(json.dumps({"type": "cancel"}))
            while (frame := json.loads(await ws.recv()))["type"] != "done":
                pass
            assert frame["finish_reason"] == "abort"

    async def sse_disconnect(i: int, http: httpx.AsyncClient) -> None:
        sid = (await http.post("/v1/sessions", json={})).json()["id"]
        async with http.stream("POST", f"/v1/sessions/{sid}/messages", json={"content": f"Poem {i}", **body}) as r:
            n = rng.randint(0, 4)
            async for _ in sse_events(r):
                n -= 1
                if n < 0:
                    break

    async def openai_disconnect(i: int, http: httpx.AsyncClient) -> None:
        req = {"messages": [{"role": "user", "content": f"Joke {i}"}], "stream": True, **body}
        async with http.stream("POST", "/v1/chat/completions", json=req) as r:
            n = rng.randint(0, 4)
            async for _line in r.aiter_lines():
                n -= 1
                if n < 0:
                    break

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        jobs = []
        for i in range(50):
            kind = i % 4
            jobs.append(ws_close(i) if kind == 0 else ws_cancel(i) if kind == 1 else
                        sse_disconnect(i, http) if kind == 2 else openai_disconnect(i, http))
        for start in range(0, 50, 10):
            await asyncio.gather(*jobs[start:start + 10])
    assert wait_idle(server, idle_free) == idle_free
    assert metric(server, "chatsvc_requests_running") == 0
    assert metric(server, "chatsvc_open_streams", '{transport="ws"}') == 0
    assert metric(server, "chatsvc_requests_finished_total", '{reason="abort"}') >= 40


async def test_second_message_while_streaming_is_409_and_partial_reply_is_stored(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        sid = (await http.post("/v1/sessions", json={"persona": "assistant"})).json()["id"]
        async with http.stream("POST", f"/v1/sessions/{sid}/messages",
                               json={"content": "Count to fifty.", "max_tokens": 64, "ignore_eos": True}) as resp:
            async for _eid, ev in sse_events(resp):
                assert ev["type"] == "delta"
                second = await http.post(f"/v1/sessions/{sid}/messages", json={"content": "again"})
                assert second.status_code == 409 and second.json()["error"]["code"] == "session_busy"
                cancel = await http.post(f"/v1/sessions/{sid}/cancel")
                assert cancel.json()["cancelled"] is True
                break
        msgs = (await http.get(f"/v1/sessions/{sid}")).json()["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["finish_reason"] == "abort" and 0 < msgs[1]["tokens"] < 64


def test_health_ready_metrics_and_kv(server: LiveServer) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("chatsvc_kv_blocks_total", "chatsvc_kv_blocks_free", "chatsvc_kv_blocks_cached",
                 "chatsvc_kv_usage_ratio", "chatsvc_cpu_blocks_free", "chatsvc_prefix_cache_queried_tokens_total",
                 "chatsvc_prefix_cache_hit_tokens_total", "chatsvc_requests_running", "chatsvc_requests_waiting",
                 "chatsvc_requests_swapped", 'chatsvc_preemptions_total{mode="swap"}',
                 "chatsvc_time_to_first_token_seconds_bucket", "chatsvc_inter_token_latency_seconds_bucket",
                 "chatsvc_e2e_request_latency_seconds_bucket", 'chatsvc_requests_finished_total{reason="stop"}',
                 'chatsvc_open_streams{transport="sse"}'):
        assert name in text, name
    assert metric(server, "chatsvc_kv_blocks_total") == 384
    snap = httpx.get(server.url + "/v1/kv").json()
    assert snap["num_blocks"] == 384 and len(snap["state"]) == 384 and "kv_blocks_free" in snap
    assert snap["state"].count("pinned") >= 3


async def test_kv_stream_reports_a_sessions_blocks(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        sid = (await http.post("/v1/sessions", json={"persona": "pirate"})).json()["id"]
        seen: list[int] = []
        persona_blocks: list[int] = []

        async def watch() -> None:
            async with http.stream("GET", "/v1/kv/stream", params={"session_id": sid}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        data = json.loads(line[5:])
                        assert data["session"]["id"] == sid and "kv_blocks_free" in data
                        if data["session"]["blocks"]:
                            seen.extend(data["session"]["blocks"])
                            persona_blocks.extend(data["session"]["persona_blocks"])
                            return

        watcher = asyncio.create_task(watch())
        async with http.stream("POST", f"/v1/sessions/{sid}/messages",
                               json={"content": "Hello captain", "max_tokens": 32, "ignore_eos": True}) as resp:
            async for _ in sse_events(resp):
                if watcher.done():
                    break
        await asyncio.wait_for(watcher, 30)
    pinned = server.gateway.personas.pinned["persona:pirate"]
    # The reply's block table starts with the persona's pinned blocks.
    assert len(persona_blocks) == pinned // BLOCK and seen[: len(persona_blocks)] == persona_blocks


def test_ws_invalid_frames_keep_the_socket_usable(server: LiveServer) -> None:
    from websockets.sync.client import connect as sync_connect

    with sync_connect(server.ws_url + "/v1/ws", max_size=None) as ws:
        for bad, code in ((b"\x00\x01", "binary_frame"), ("not json", "invalid_json"), ("[1]", "invalid_frame"),
                          (json.dumps({"type": "message", "content": "hi"}), "no_session"),
                          ("x" * 70_000, "frame_too_large"), (json.dumps({"type": "nope"}), "invalid_frame")):
            ws.send(bad)
            frame = json.loads(ws.recv())
            assert frame["type"] == "error" and frame["code"] == code, (bad[:20], frame)
        ws.send(json.dumps({"type": "hello", "persona": "no-such-persona"}))
        assert json.loads(ws.recv())["code"] == "persona_not_found"
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv())["type"] == "session"


def test_ws_bad_origin_is_refused(server: LiveServer) -> None:
    from websockets.sync.client import connect as sync_connect

    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        sync_connect(server.ws_url + "/v1/ws", origin="https://evil.example")  # type: ignore[arg-type]
    assert e.value.response.status_code == 403
    with sync_connect(server.ws_url + "/v1/ws", origin=server.url) as ws:  # type: ignore[arg-type]
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv())["type"] == "session"


def test_non_streaming_request_is_aborted_when_the_client_hangs_up(server: LiveServer) -> None:
    deadline = time.monotonic() + 20
    while metric(server, "chatsvc_requests_running") != 0:  # earlier tests' replies end (or time out) first
        assert time.monotonic() < deadline
        time.sleep(0.1)
    aborts = metric(server, "chatsvc_requests_finished_total", '{reason="abort"}')
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 6  # far less than the 400 tokens would take (~45 ms each here)
    while metric(server, "chatsvc_requests_finished_total", '{reason="abort"}') == aborts:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.1)
