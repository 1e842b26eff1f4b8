"""benchmarks/session_return_vs_vllm.py without the servers: the client's TTFT and usage over a real HTTP
stream, the prompts, the sizing and the ratios its record reports."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import session_return as sr  # noqa: E402
import session_return_vs_vllm as bench  # noqa: E402

# SmolLM2-135M-Instruct's config.json, the fields the KV size depends on.
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


class SSEHandler(BaseHTTPRequestHandler):
    """Streams what ``self.server.script`` says, as chunked SSE, the way both servers do."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))  # type: ignore[attr-defined]
        status, events = self.server.script  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for delay, line in events:
            time.sleep(delay)
            data = f"{line}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sse_server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SSEHandler)
    httpd.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(httpd: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def chunk(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj)


def test_ttft_is_the_first_chunk_with_a_token_and_usage_is_read(sse_server: ThreadingHTTPServer) -> None:
    sse_server.script = (200, [  # type: ignore[attr-defined]
        (0.0, ": keep-alive"),
        (0.0, chunk({"choices": []})),  # no token yet: not the first token
        (0.3, chunk({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})),
        (0.2, chunk({"choices": [{"index": 0, "text": " there", "finish_reason": "length"}]})),
        (0.0, chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                              "prompt_tokens_details": {"cached_tokens": 48}}})),
        (0.0, "data: [DONE]"),
    ])
    reply = bench.complete(url(sse_server), "m", [1, 2, 3, 4, 5], 2)
    assert reply.ttft is not None and 0.3 <= reply.ttft < 0.5  # not the choice-less chunk, not the last one
    assert (reply.text, reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens) == ("Hi there", 5, 2, 48)
    body = sse_server.bodies[0]  # type: ignore[attr-defined]
    # Token ids as the prompt (both servers prefill exactly these), greedy, streamed with usage.
    assert body == {"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def test_a_failed_request_or_a_stream_without_a_token_raises(sse_server: ThreadingHTTPServer) -> None:
    sse_server.script = (503, [])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="HTTP 503"):
        bench.complete(url(sse_server), "m", [1], 1)
    sse_server.script = (200, [(0.0, chunk({"choices": []})), (0.0, "data: [DONE]")])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="without a token"):
        bench.complete(url(sse_server), "m", [1], 1)
    sse_server.script = (200, [(0.0, chunk({"error": {"message": "engine died"}}))])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="engine died"):
        bench.complete(url(sse_server), "m", [1], 1)


def test_fold_chunk_ends_at_done_and_keeps_the_first_ttft() -> None:
    reply = bench.Reply()
    assert not bench.fold_chunk(reply, json.dumps({"choices": [{"text": "a"}]}), 0.5)
    assert not bench.fold_chunk(reply, json.dumps({"choices": [{"text": "b"}]}), 0.9)
    assert bench.fold_chunk(reply, "[DONE]", 1.0)
    assert (reply.ttft, reply.text, reply.cached_tokens) == (0.5, "ab", None)


def test_sessions_per_length() -> None:
    assert bench.session_plan("48", [512, 1024]) == {512: 48, 1024: 48}
    assert bench.session_plan(bench.DEFAULT_SESSIONS, [2048, 512]) == {2048: 64, 512: 128}
    with pytest.raises(ValueError, match="4096"):
        bench.session_plan("512:10", [512, 4096])


def test_default_sessions_overflow_a_one_gib_pool_at_every_length() -> None:
    per_token = bench.kv_bytes_per_token(SMOLLM2, "bfloat16")
    assert per_token == 30 * 3 * 64 * 2 * 2 == 23_040
    assert bench.kv_bytes_per_token(SMOLLM2, "float32") == 2 * per_token
    pool = 2**30 // per_token
    plan = bench.session_plan(bench.DEFAULT_SESSIONS, [512, 1024, 2048, 4096])
    # Under LRU and round robin, more than a pool (plus one history) of histories evicts every session.
    assert all(n * length >= 1.4 * pool for length, n in plan.items())
    assert plan[2048] >= 64


def test_the_context_holds_the_longest_history_and_every_later_turn() -> None:
    assert bench.context_length([512, 1024], 2, 4) == 2048  # never below the serving benchmark's
    ctx = bench.context_length([512, 4096], 2, 4)
    assert ctx % 256 == 0 and ctx >= 4096 + 2 * (64 + 4)


def side(ret: float, restart: float | None = None, first: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"return": sr.summary([ret, ret])}
    if restart is not None:
        out.update(restart_return=sr.summary([restart]), restart_first_s=first)
    return out


def test_ratios_goals_and_flatness() -> None:
    long = {"ours_off": side(2.0), "ours": side(0.25, 0.3, 0.5), "vllm": side(1.0, 2.0, 2.5)}
    short = {"ours_off": side(0.5), "ours": side(0.2, 0.2, 0.2), "vllm": side(0.4, 0.5, 0.6)}
    for r in (long, short):
        r["ratios"] = bench.length_ratios(r)
    q = long["ratios"]
    assert q["recompute_over_ours_p50"] == 8.0 and q["vllm_over_ours_p50"] == 4.0
    assert q["vllm_over_recompute_p50"] == 0.5
    assert q["vllm_restart_over_ours_restart_p50"] == pytest.approx(6.67)
    assert q["vllm_restart_first_over_ours_restart_first"] == 5.0
    assert (q["ours_restart_over_ours_p50"], q["ours_restart_first_over_ours_p50"]) == (1.2, 2.0)
    by_length = {2048: long, 512: short}
    assert bench.goals(by_length) == {"recompute_over_ours_p50": {"ratio": 8.0, "target": 5.0, "met": True},
                                      "vllm_over_ours_p50": {"ratio": 4.0, "target": 3.0, "met": True}}
    assert bench.flatness(by_length) == {"ours_off_p50_longest_over_shortest": 4.0,
                                         "ours_p50_longest_over_shortest": 1.25,
                                         "vllm_p50_longest_over_shortest": 2.5}
    table = "\n".join(bench.table({2048: {**long, "sessions": 64, "histories_over_pool": 2.81}}))
    assert "| 2048 | 64 (2.81) | 2.000 / 2.000 | 0.250 / 0.250 | 1.000 / 1.000 |" in table
    assert "8.00x | 4.00x | 6.67x |" in table


def test_a_run_without_vllm_reports_none_for_its_ratios() -> None:
    r = {"ours_off": side(2.0), "ours": side(0.5, 0.5, 0.6)}
    q = bench.length_ratios(r)
    assert q["recompute_over_ours_p50"] == 4.0
    assert q["vllm_over_ours_p50"] is None and q["vllm_restart_first_over_ours_restart_first"] is None
    r["ratios"] = q
    assert bench.goals({1024: r}) == {}  # no goal length: nothing claimed
    assert bench.goals({2048: r})["vllm_over_ours_p50"]["met"] is None
    row = bench.table({1024: {**r, "sessions": 4, "histories_over_pool": 0.1}})[-1]
    assert row == "| 1024 | 4 (0.10) | 2.000 / 2.000 | 0.500 / 0.500 | - | 0.500 / 0.500 (0.600) | - (-) | 4.00x | - | - |"


@pytest.mark.integration
def test_both_servers_get_the_same_chat_rendered_histories_of_the_asked_length() -> None:
    from engine.model_files import load_tokenizer

    tok, _ = load_tokenizer()
    histories = sr.conversations(tok, 3, 512)
    assert [len(h) for h in histories] == [512, 512, 512]
    tail = tok.encode("<|im_start|>assistant\n")
    assert all(h[-len(tail):] == tail for h in histories)  # each asks for the assistant's reply
    assert len({tuple(h) for h in histories}) == 3  # different conversations
    text = tok.decode(histories[0], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n" + sr.SYSTEM)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.long
@pytest.mark.timeout(900)  # three server starts: ~1 min on an idle 2-core machine, several when it is shared
def test_quick_run_serves_every_round_and_restores_after_a_restart(tmp_path: Path) -> None:
    import subprocess

    record = tmp_path / "record.txt"
    # The servers' data dirs stay in the script's own temp dir: the embedded Redis' Unix socket path must be
    # short, and pytest's tmp_path is not.
    proc = subprocess.run([sys.executable, "benchmarks/session_return_vs_vllm.py", "--quick", "--output", str(record),
                           "--log-dir", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = record.read_text()
    assert "machine: " in text and "command: " in text and "uptime (1, 5, 15-min load) before" in text
    last = json.loads(text.strip().splitlines()[-1])
    assert last["quick"] and last["cores"] >= 1 and last["pool_tokens"] > 0
    run = last["lengths"]["256"]
    assert "vllm" not in run  # --quick runs vLLM only when asked
    assert run["ours_off"]["return"]["n"] == run["ours"]["return"]["n"] == 4
    # The restarted server's pool starts empty: its prompts' history came back from the disk tier.
    assert run["ours"]["restart_cached_tokens"]["p50"] >= 256
    assert run["ratios"]["recompute_over_ours_p50"] is not None
