"""Compile every Triton kernel for a CUDA target on a machine without a GPU.

The interpreter accepts code a GPU compiler rejects (tile shapes, dot operand sizes, types), so this runs
the real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas bundled in the triton wheel) for the
launch shapes the wrappers use, and reports registers and spills from ``ptxas -v``.

Usage: ``python -m kernels.aot_check [--arch 90]``; exits 1 if any variant fails to compile. It must run
with TRITON_INTERPRET unset (kernels decorated for the interpreter cannot be compiled).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Variant:
    kernel: str
    pointer_types: dict[str, str]  # arg name -> triton type, e.g. "*bf16"
    constexprs: dict[str, Any]
    num_warps: int


def variants(dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32")) -> list[Variant]:
    from kernels import triton_kernels as tk

    out: list[Variant] = []
    for dt in dtypes:
        cast = dt == "fp32"
        for d in (64, 128):
            block_n, warps = tk.DECODE_CONFIG[d]
            for split in (False, True):
                ptrs = dict(q_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}")
                ptrs.update(block_tables_ptr="*i32", context_lens_ptr="*i32", m_ptr="*fp32", l_ptr="*fp32")
                ptrs["out_ptr"] = "*fp32" if split else f"*{dt}"
                consts = dict(
                    KV_BLOCK=16, SPLIT=split, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=d, CAST_FP32=cast
                )
                out.append(Variant("_decode_kernel", ptrs, consts, warps))
            block_m, block_n, warps = tk.PREFILL_CONFIG[d]
            ptrs = dict(q_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}", out_ptr=f"*{dt}")
            ptrs.update(block_tables_ptr="*i32", query_start_loc_ptr="*i32", context_lens_ptr="*i32")
            consts = dict(KV_BLOCK=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d, CAST_FP32=cast)
            out.append(Variant("_prefill_kernel", ptrs, consts, warps))
        ptrs = dict(part_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr=f"*{dt}")
        out.append(Variant("_decode_reduce_kernel", ptrs, dict(BLOCK_S=64, BLOCK_D=128), 4))
        ptrs = dict(
            key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}", slot_ptr="*i64"
        )
        out.append(Variant("_write_kv_kernel", ptrs, dict(BLOCK_H=4, BLOCK_D=64), 4))
        out.append(
            Variant("_copy_blocks_kernel", dict(cache_ptr=f"*{dt}", mapping_ptr="*i64"), dict(BLOCK=1024), 4)
        )
    return out


def compile_variant(v: Variant, arch: int) -> str:
    """Compile one variant; return ptxas's register/spill summary."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_kernels as tk

    fn = getattr(tk, v.kernel)
    signature = {}
    for name in fn.arg_names:
        if name in v.constexprs:
            signature[name] = "constexpr"
        elif name in v.pointer_types:
            signature[name] = v.pointer_types[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    constexprs = {(fn.arg_names.index(k),): val for k, val in v.constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": v.num_warps})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        run = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}{suffix}", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores", run.stderr)
    return f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} bytes spilled"


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Compile the Triton kernels for a CUDA target, no GPU needed"
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32", help="cache dtypes to compile for")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot_check: unset TRITON_INTERPRET; interpreter-decorated kernels cannot be compiled")
        return 2
    failures = 0
    for v in variants(tuple(args.dtypes.split(","))):
        label = f"{v.kernel} {v.pointer_types.get('k_cache_ptr', v.pointer_types.get('cache_ptr'))} {v.constexprs}"
        try:
            print(f"ok   {label} warps={v.num_warps}: {compile_variant(v, args.arch)}")
        except Exception as exc:  # report every failing variant, not just the first
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[-2000:]}")
    print(f"aot_check sm_{args.arch}: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
