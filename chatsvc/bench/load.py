"""Drives the load: chat sessions of several turns, started all at once (closed loop) or arriving
as a Poisson / gamma process (open loop), each turn waiting for the previous reply plus think time.

Bounded by construction: every session has a fixed number of turns, every request a timeout, and
the whole run a duration after which (or on ``stop``) whatever is in flight is cancelled and
recorded as cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chatsvc.bench.clients import Client, classify_error
from chatsvc.bench.metrics import RequestRecord


@dataclass(frozen=True)
class LoadConfig:
    rate: float = math.inf  # sessions started per second; inf = all at once
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    think_time_s: float = 0.0
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    max_concurrency: int | None = None  # sessions at once (open loop can otherwise grow without bound)
    seed: int = 0


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start time of each of ``n`` sessions, seconds after the run starts. Inter-arrival gaps are
    gamma-distributed with shape ``burstiness`` and mean ``1 / rate`` (vLLM's ``--burstiness``); shape 1 is a
    Poisson process, smaller is burstier. The first session starts at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [0.0, *itertools.accumulate(rng.gammavariate(burstiness, theta) for _ in range(n - 1))]


async def run_load(
    client: Client,
    conversations: list[list[str]],
    cfg: LoadConfig,
    records: list[RequestRecord],
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> tuple[float, float]:
    """Run every conversation against ``client``; records are appended to ``records`` as requests start (so
    a caller can watch progress or report after an interruption). Returns (t0, duration_s)."""
    stop = stop or asyncio.Event()
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    offsets = arrival_offsets(len(conversations), cfg.rate, cfg.burstiness, cfg.seed)
    t0 = time.perf_counter()

    async def session(idx: int, turns: list[str]) -> None:
        await asyncio.sleep(max(0.0, t0 + offsets[idx] - time.perf_counter()))
        async with sem if sem else contextlib.nullcontext():
            chat = await client.open_session()
            try:
                for j, content in enumerate(turns):
                    if j and cfg.think_time_s > 0:
                        await asyncio.sleep(cfg.think_time_s)
                    rec = RequestRecord(session=idx, turn=j, start=time.perf_counter())
                    records.append(rec)
                    try:
                        async with asyncio.timeout(cfg.request_timeout_s):
                            await chat.send(content, rec)
                    except asyncio.CancelledError:
                        rec.cancelled = True
                        raise
                    except Exception as exc:  # every failure is data for the report
                        rec.error, rec.error_detail = classify_error(exc)
                    if on_record:
                        on_record(rec)
                    if rec.error:
                        break  # a person whose chat broke does not carry on with the same conversation
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(chat.close())

    tasks = [asyncio.create_task(session(i, c)) for i, c in enumerate(conversations)]
    all_done: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
    stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({all_done, stopper}, timeout=cfg.duration_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(asyncio.CancelledError):
            await all_done
    duration = time.perf_counter() - t0
    for rec in records:
        if rec.end is None and rec.error is None:
            rec.cancelled = True
    return t0, duration
