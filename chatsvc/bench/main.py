"""``chatsvc bench``: parse the options into runs, drive them, print and write the results."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from chatsvc.bench import dataset
from chatsvc.bench.clients import Client, ClientConfig, classify_error
from chatsvc.bench.load import LoadConfig, run_load
from chatsvc.bench.metrics import RequestRecord, parse_slo, summarize
from chatsvc.bench.report import summary_table, sweep_table, write_json


@dataclass
class LazyTokenizer:
    """Loads the tokenizer on first use only (seconds); remembers a failure instead of retrying."""

    spec: str | None
    _tok: dataset.HFTokenizer | None = None
    _failed: str | None = None

    def get(self, required: bool = False) -> dataset.HFTokenizer | None:
        if self._tok is None and self._failed is None:
            try:
                self._tok = dataset.load_tokenizer(self.spec)
            except Exception as exc:  # a missing model only costs exact counts
                self._failed = f"{type(exc).__name__}: {exc}"
        if self._tok is None and required:
            raise RuntimeError(f"a tokenizer is needed but could not be loaded ({self._failed})")
        return self._tok


def count_missing_tokens(records: list[RequestRecord], tok: LazyTokenizer) -> None:
    """Output tokens for replies the server gave no usage for: tokenize the text, else count deltas."""
    missing = [r for r in records if r.ok and r.output_tokens is None]
    t = tok.get() if missing else None  # loaded only when a count is needed
    for r in missing:
        if t is not None:
            r.output_tokens, r.token_source = len(t.encode(r.text)), "tokenizer"
        else:
            r.output_tokens, r.token_source = len(r.delta_times), "deltas"


def build_conversations(args: argparse.Namespace, tok: LazyTokenizer) -> list[list[str]]:
    prompts = dataset.load_prompts(args.dataset, args.max_prompt_chars)
    convos = dataset.draw_sessions(prompts, args.sessions, args.turns, args.seed)
    if args.input_tokens:
        t = tok.get(required=True)
        assert t is not None
        # Pad with other prompts from the same data set, in a fixed order, so every server gets the same text.
        convos = [[dataset.fit_to_tokens(p, args.input_tokens, t, prompts) for p in c] for c in convos]
    return convos


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's where it is installed (less of the client's CPU per streamed token), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def run_one(
    cfg: ClientConfig, load: LoadConfig, conversations: list[list[str]], progress: bool, console: Console,
    title: str, install_persona: tuple[str, str] | None = None,
) -> tuple[list[RequestRecord], float, float, bool, str | None, float]:
    """One load run against one server. Returns (records, t0, duration, interrupted, model, the CPU seconds this
    process spent while the load ran: on a shared machine, what the load generator took from the server)."""
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    interrupted = False
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        stop.set()

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread: no handler
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    concurrency = load.max_concurrency or len(conversations)
    client = Client(cfg, max_connections=max(10, concurrency + 4))
    total = sum(len(c) for c in conversations)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[stats]}"), console=console, disable=not progress, transient=False)
    try:
        await client.prepare()
        if install_persona:
            name, system_prompt = install_persona
            await client.call("PUT", f"/v1/personas/{name}",
                              {"system_prompt": system_prompt, "description": "chatsvc bench shared prompt"})
        task = bar.add_task(title, total=total, stats="")
        t_start = time.perf_counter()

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.5)
                el = max(time.perf_counter() - t_start, 1e-9)
                toks = sum(r.output_tokens if r.output_tokens is not None else len(r.delta_times) for r in records)
                done = sum(1 for r in records if r.end is not None or r.error)
                errs = sum(1 for r in records if r.error)
                bar.update(task, stats=f"{toks / el:7.1f} tok/s  {done / el:5.2f} req/s  errors {errs}")

        with bar:
            tick = asyncio.create_task(ticker())
            cpu0 = time.process_time()
            try:
                t0, duration = await run_load(client, conversations, load, records, stop,
                                              lambda rec: bar.advance(task))
            finally:
                tick.cancel()
            client_cpu = time.process_time() - cpu0
    finally:
        await client.aclose()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    return records, t0, duration, interrupted, client.model, client_cpu


def main(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    out = Console()
    try:
        slo = parse_slo(args.slo)
        rates = [float(x) for x in args.sweep_rates.split(",") if x.strip()] if args.sweep_rates else [args.rate]
        if any(r <= 0 for r in rates) or args.burstiness <= 0:
            raise ValueError("rates and --burstiness must be > 0")
        if args.sessions < 1 or args.turns < 1 or args.max_tokens < 1:
            raise ValueError("--sessions, --turns and --max-tokens must be >= 1")
    except ValueError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    urls = args.url or ["http://127.0.0.1:8000"]
    labels = list(args.label or [])
    labels += urls[len(labels):]
    tok = LazyTokenizer(args.tokenizer)
    conversations = build_conversations(args, tok)
    system_prompt = None
    if args.system_prompt_tokens:
        system_prompt = dataset.system_prompt(args.system_prompt_tokens, tok.get())
    persona = args.persona
    install = None
    if system_prompt and args.mode != "openai" and not persona:
        persona = f"bench-sp{args.system_prompt_tokens}"
        install = (persona, system_prompt)

    runs: list[dict[str, Any]] = []
    interrupted = False
    for (url, label), rate in itertools.product(zip(urls, labels, strict=True), rates):
        cfg = ClientConfig(url=url, mode=args.mode, api_key=args.api_key, model=args.model,
                           max_tokens=args.max_tokens, temperature=args.temperature,
                           ignore_eos=args.ignore_eos, persona=persona,
                           system_prompt=system_prompt if args.mode == "openai" else None,
                           response_format=args.response_format)
        load = LoadConfig(rate=rate, burstiness=args.burstiness, think_time_s=args.think_time,
                          duration_s=args.duration, request_timeout_s=args.request_timeout,
                          max_concurrency=args.max_concurrency, seed=args.seed)
        title = label if math.isinf(rate) else f"{label} @ {rate:g}/s"
        try:
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                records, t0, duration, interrupted, model, client_cpu = runner.run(
                    run_one(cfg, load, conversations, not args.no_progress, err, title, install))
        except KeyboardInterrupt:
            interrupted = True
            break
        except Exception as exc:  # the server was unusable before any load: say why and stop
            kind, detail = classify_error(exc)
            err.print(f"[red]error:[/red] {label}: {kind} {detail}")
            return 1
        count_missing_tokens(records, tok)
        summary = summarize(records, duration, slo)
        summary.update({"url": url, "label": label, "mode": args.mode, "model": model,
                        "rate": None if math.isinf(rate) else rate, "interrupted": interrupted,
                        "client_cpu_s": round(client_cpu, 3)})
        runs.append(summary)
        if args.sweep_rates is None:
            out.print(summary_table(summary, f"chatsvc bench: {label} ({args.mode})"))
        if args.plot and args.sweep_rates is None and len(urls) == 1:
            from chatsvc.bench.plot import plot_run

            plot_run(records, t0, args.plot, title=f"{label} ({args.mode})")
        if interrupted:
            break

    if args.sweep_rates is not None and runs:
        out.print(sweep_table(runs))
        if args.plot:
            from chatsvc.bench.plot import plot_sweep

            plot_sweep(runs, args.plot)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func", "handler")}
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in config.items()}
    if args.json_path and runs:
        single = len(runs) == 1 and args.sweep_rates is None
        write_json(args.json_path, {**(runs[0] if single else {"runs": runs}), "config": config})
    if interrupted:
        err.print("[yellow]interrupted: reported what had finished[/yellow]")
        return 130
    return 1 if any(r["completed"] == 0 and r["requests"] > 0 for r in runs) else 0
