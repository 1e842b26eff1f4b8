"""``chatsvc bench``: a load generator for chat servers (ours over ws / sse, or any OpenAI server).

``add_arguments`` only touches argparse so the ``chatsvc`` CLI stays quick to start; ``run`` imports the
rest (aiohttp, rich, matplotlib) when the command actually runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--url", action="append", default=None,
                        help="server base URL (repeat to compare servers in --sweep-rates); default http://127.0.0.1:8000")
    target.add_argument("--label", action="append", default=None, help="name for each --url in tables and plots")
    target.add_argument("--mode", choices=("ws", "sse", "openai"), default="ws",
                        help="ws: our WebSocket; sse: our session API; openai: /v1/chat/completions, history resent")
    target.add_argument("--api-key", default=None, help="sent as a Bearer token (and in the ws hello frame)")
    target.add_argument("--model", default=None, help="model name for --mode openai (default: first of /v1/models)")

    load = parser.add_argument_group("load")
    load.add_argument("--sessions", type=int, default=8, help="chat sessions (concurrent in closed loop)")
    load.add_argument("--turns", type=int, default=3, help="user turns per session; each waits for the reply")
    load.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    load.add_argument("--rate", type=float, default=float("inf"),
                      help="open loop: sessions arriving per second (default: all start at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival times (1 = Poisson, <1 burstier)")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on sessions running at once")
    load.add_argument("--sweep-rates", default=None,
                      help="comma-separated rates: one open-loop run per rate (and per --url); plot with --plot")
    load.add_argument("--duration", type=float, default=3600.0, help="stop after this many seconds (per run)")
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request is an error")

    prompts = parser.add_argument_group("prompts and sampling")
    prompts.add_argument("--dataset", default=None,
                         help="JSON / JSONL prompts (ShareGPT format or strings); default: bundled ShareGPT sample")
    prompts.add_argument("--seed", type=int, default=0, help="seed for the prompt draw and arrival times")
    prompts.add_argument("--max-prompt-chars", type=int, default=None, help="skip longer dataset prompts")
    prompts.add_argument("--input-tokens", type=int, default=None,
                         help="cut or pad every prompt to this many tokens (uses the tokenizer)")
    prompts.add_argument("--persona", default=None, help="server-side persona for ws / sse sessions")
    prompts.add_argument("--system-prompt-tokens", type=int, default=None,
                         help="a deterministic shared system prompt of ~N tokens (openai: sent as the system "
                              "message; ws/sse: installed as persona bench-sp<N>)")
    prompts.add_argument("--max-tokens", type=int, default=128)
    prompts.add_argument("--temperature", type=float, default=0.0)
    prompts.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (fixed output lengths)")
    prompts.add_argument("--response-format", type=_json_object, default=None,
                         help="an OpenAI response_format (JSON) sent with every message: structured-output load")
    prompts.add_argument("--tokenizer", default=None,
                         help="HF dir or .gguf for token counts when the server gives no usage (default: the "
                              "default model's GGUF)")

    out = parser.add_argument_group("output")
    out.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft=500,tpot=50 (also e2e=)")
    out.add_argument("--json", dest="json_path", default=None, help="write the report as JSON here")
    out.add_argument("--plot", default=None, help="write a PNG: latency CDFs and throughput (or the sweep curve)")
    out.add_argument("--no-progress", action="store_true", help="no live progress bar")


def run(args: argparse.Namespace) -> int:
    from chatsvc.bench.main import main

    return main(args)
