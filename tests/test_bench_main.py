"""``chatsvc bench`` end to end (``python -m chatsvc.bench``'s main) against the fake server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_fakes import FakeState, fake_server

from chatsvc.bench.__main__ import main

KEYS = ("requests", "duration_s", "output_tok_s", "request_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "errors")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeState]]:
    with fake_server() as s:
        yield s


@pytest.mark.parametrize("mode", ["ws", "sse", "openai"])
def test_report_counts_match_what_was_sent(server: tuple[str, FakeState], mode: str, tmp_path: Path) -> None:
    url, state = server
    sent_before = len(state.chat_bodies) + sum(len(v) for v in state.session_messages.values())
    out = tmp_path / "r.json"
    rc = main(["--url", url, "--mode", mode, "--sessions", "3", "--turns", "2", "--max-tokens", "4",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    for k in KEYS:
        assert k in r
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(r[k]) == {"mean", "p50", "p90", "p99"} and r[k]["p50"] > 0
    sent = len(state.chat_bodies) + sum(len(v) for v in state.session_messages.values()) - sent_before
    assert r["requests"] == r["completed"] == sent == 6
    assert r["errors"] == {} and r["total_output_tokens"] == 24
    assert r["output_tok_s"] == pytest.approx(24 / r["duration_s"])
    assert r["token_count_source"] == {"usage": 6} and r["mode"] == mode
    assert r["client_cpu_s"] > 0  # parsing the streams took CPU (here with the fake server's, same process)


def test_errors_are_counted_by_kind(tmp_path: Path, server: tuple[str, FakeState]) -> None:
    url, _ = server
    data = tmp_path / "d.json"
    data.write_text(json.dumps(["FAIL now", "fine"]))
    out = tmp_path / "r.json"
    # 4 single-turn sessions draw both prompts twice: 2 fail, 2 succeed.
    rc = main(["--url", url, "--mode", "openai", "--sessions", "4", "--turns", "1", "--max-tokens", "2",
               "--dataset", str(data), "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["requests"], r["completed"], r["errors"]) == (4, 2, {"http_500": 2})


def test_unreachable_server_fails_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(["--url", "http://127.0.0.1:9", "--mode", "sse", "--sessions", "2", "--turns", "2",
               "--json", str(out), "--no-progress"])
    assert rc == 1
    r = json.loads(out.read_text())
    assert (r["requests"], r["completed"], r["errors"]) == (2, 0, {"connect": 2})


def test_duration_bounds_the_run_and_counts_cancelled(tmp_path: Path) -> None:
    with fake_server(FakeState(gap_s=0.05)) as (url, _):
        out = tmp_path / "r.json"
        rc = main(["--url", url, "--mode", "ws", "--sessions", "2", "--turns", "5", "--max-tokens", "100",
                   "--duration", "0.3", "--json", str(out), "--no-progress"])
    r = json.loads(out.read_text())
    assert rc == 1  # nothing completed
    assert r["duration_s"] < 1.0 and r["cancelled"] == 2 and r["requests"] == 2


def test_no_usage_falls_back_to_delta_counts_and_says_so(tmp_path: Path) -> None:
    with fake_server(FakeState(usage=False)) as (url, _):
        out = tmp_path / "r.json"
        rc = main(["--url", url, "--mode", "openai", "--sessions", "2", "--turns", "1", "--max-tokens", "3",
                   "--tokenizer", str(tmp_path / "missing"), "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["token_count_source"] == {"deltas": 2} and r["total_output_tokens"] == 6


def test_shared_system_prompt_installed_as_persona_for_ws(tmp_path: Path, server: tuple[str, FakeState]) -> None:
    url, state = server
    rc = main(["--url", url, "--mode", "ws", "--sessions", "2", "--turns", "1", "--max-tokens", "2",
               "--system-prompt-tokens", "50", "--tokenizer", str(tmp_path / "missing"), "--no-progress"])
    assert rc == 0
    assert 150 <= len(state.personas["bench-sp50"]) <= 200  # ~4 chars/token without a tokenizer
    assert state.ws_hellos[-1]["persona"] == "bench-sp50"


def test_sweep_over_two_servers_writes_every_run(tmp_path: Path, server: tuple[str, FakeState]) -> None:
    url, _ = server
    out = tmp_path / "s.json"
    rc = main(["--url", url, "--url", url + "/v1", "--label", "a", "--label", "b", "--mode", "openai",
               "--sessions", "3", "--turns", "1", "--max-tokens", "2", "--sweep-rates", "50,100",
               "--slo", "ttft=1000", "--json", str(out), "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(x["label"], x["rate"]) for x in runs] == [("a", 50.0), ("a", 100.0), ("b", 50.0), ("b", 100.0)]
    assert all(x["completed"] == 3 and x["goodput_req_s"] > 0 for x in runs)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--slo", "nope=1", "--no-progress"]) == 2
    assert main(["--sweep-rates", "1,-2", "--no-progress"]) == 2
    for fmt in ("[1]", "{json"):  # argparse's own exit
        with pytest.raises(SystemExit, match="2"):
            main(["--response-format", fmt, "--no-progress"])
    assert "--response-format: a JSON object is needed" in capsys.readouterr().err
