"""benchmarks/serving_vs_vllm.py's server plumbing, which the other served benchmarks reuse: the commands it
builds parse as the servers' own flags, and a server is given its stop time before it is killed."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serving_vs_vllm as svv  # noqa: E402

from chatsvc.bench.metrics import parse_slo  # noqa: E402
from chatsvc.cli import add_serve_arguments  # noqa: E402


def serve_args(cmd: list[str]) -> argparse.Namespace:
    assert cmd[1:5] == ["-m", "chatsvc.cli", "serve", "--host"]
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(cmd[4:])


def test_our_command_takes_a_context_length_and_a_data_dir_to_restart_on(tmp_path: Path) -> None:
    args = serve_args(svv.ours_command(8123, [], 1, extra=("--kv-host-bytes", "4096"), max_model_len=4608,
                                       data_dir=tmp_path))
    assert (args.port, args.max_model_len, args.kv_cache_mb, args.data_dir) == (8123, 4608, 1024, tmp_path)
    assert args.kv_host_bytes == 4096
    # Without one, each server gets a new data dir, as the serving workloads want.
    first, second = (serve_args(svv.ours_command(8123, [], 1)) for _ in range(2))
    assert first.data_dir != second.data_dir and first.max_model_len == svv.MAX_MODEL_LEN


def test_vllm_command_takes_a_context_length() -> None:
    cmd = svv.vllm_command(Path("/venv/bin/python"), 8123, "bfloat16", max_model_len=4608)
    assert cmd[cmd.index("--max-model-len") + 1] == "4608"
    default = svv.vllm_command(Path("/venv/bin/python"), 8123, "bfloat16")
    assert default[default.index("--max-model-len") + 1] == str(svv.MAX_MODEL_LEN)


# A server that answers /ready and takes ``delay`` seconds to shut down after SIGINT, then writes a marker: as
# ours does while it writes its cached blocks to the disk tier.
SLOW_STOP = textwrap.dedent("""
    import http.server, signal, sys, threading, time
    port, delay, marker = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    httpd = http.server.HTTPServer(("127.0.0.1", port), Ready)
    def stop(*_):
        time.sleep(delay)
        open(marker, "w").write("flushed")
        sys.exit(0)
    signal.signal(signal.SIGINT, stop)
    httpd.serve_forever()
""")


@pytest.mark.slow
@pytest.mark.parametrize(("stop_timeout_s", "flushed"), [(10.0, True), (0.3, False)])
def test_a_server_may_take_its_stop_time_before_it_is_killed(tmp_path: Path, stop_timeout_s: float,
                                                            flushed: bool) -> None:
    script, marker = tmp_path / "slow_stop.py", tmp_path / "marker"
    script.write_text(SLOW_STOP)
    port = svv.free_port()
    cmd = [sys.executable, str(script), str(port), "1.5", str(marker)]
    with svv.server(cmd, {}, f"http://127.0.0.1:{port}/ready", tmp_path / "log", 30, stop_timeout_s=stop_timeout_s):
        pass
    assert marker.exists() is flushed


def test_a_workload_summary_carries_ttft_p50_and_p99_of_both_servers() -> None:
    """The record's summary names the first-token latency at the median and the tail, beside tok/s."""
    def run(tok_s: float, p50: float, p99: float) -> dict[str, object]:
        return {"output_tok_s": tok_s, "ttft_ms": {"mean": p50, "p50": p50, "p99": p99}, "tpot_ms": {"p50": 40.0},
                "itl_ms": {"p50": 38.0}}

    results = {"ours": {"32": run(700.0, 500.0, 900.0)}, "vllm": {"32": run(500.0, 700.0, 1200.0)}}
    summary = svv.workload_summary(results, "32")
    assert summary["ratio"] == 1.4
    assert (summary["ours_ttft_p50"], summary["ours_ttft_p99"]) == (500.0, 900.0)
    assert (summary["vllm_ttft_p50"], summary["vllm_ttft_p99"]) == (700.0, 1200.0)


def test_every_bench_run_is_given_the_chat_slo_and_the_summary_carries_goodput(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Goodput (requests meeting TTFT <= 2 s and TPOT <= 100 ms) sits beside tok/s, for both servers."""
    seen: list[list[str]] = []

    class Done:
        returncode = 0

    def fake_run(cmd: list[str], **_: object) -> Done:
        seen.append(cmd)
        return Done()

    monkeypatch.setattr(svv.subprocess, "run", fake_run)
    svv.bench("http://127.0.0.1:1", "ours", ["--sessions", "4"], None, 0)
    cmd = seen[0]
    assert cmd[cmd.index("--slo") + 1] == svv.GOODPUT_SLO == "ttft=2000,tpot=100"
    assert parse_slo(svv.GOODPUT_SLO) == {"ttft": 2000.0, "tpot": 100.0}

    def run(goodput: float, share: float) -> dict[str, object]:
        return {"output_tok_s": 600.0, "ttft_ms": {"p50": 500.0}, "goodput_req_s": goodput, "slo_attainment": share}

    summary = svv.workload_summary({"ours": {"b": run(6.0, 0.75)}, "vllm": {"b": run(4.0, 0.5)}}, "b")
    assert (summary["ours_goodput"], summary["vllm_goodput"], summary["goodput_ratio"]) == (6.0, 4.0, 1.5)
    assert svv.goodput_cell(summary) == "6.000 / 4.000 (75% / 50%)"
    assert svv.goodput_cell(svv.workload_summary({}, "b")) == "- / - (- / -)"
