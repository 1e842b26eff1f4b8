"""The slow row band of oneDNN's packed GEMMs, and what padding out of it buys a decode step, side by side.

Two parts, one process, the real model in the dtype ``auto`` resolves to:
  * linears: every packed projection and the LM head once (``LlamaForCausalLM.run_linears``) at each row
    count of ``--rows``, the counts interleaved over ``--rounds`` rounds (five passes each, median); the
    runner's load-time probe (``engine.model.linear.probe_slow_rows``) compares 32 with 33 rows of this;
  * decode: 32 sequences x 128-token prompts x 64 greedy tokens, with the 17-32 band padded to 33 rows and
    without (``runner.slow_rows``), alternated over rounds; the median pure-decode step time of each.

Ratios are what to read: this 2-core VM's speed swings between minutes, hence the interleaving.
Usage: python benchmarks/gemm_row_band.py [--rows 16,17,24,32,33,40] [--rounds 3] [--output FILE]
Last line: one JSON object {"linears_ms": {rows: median}, "band_over_33": ratio of the band's median to 33
rows', "decode_step_ms": {"padded": [...], "exact": [...]}, "decode_padded_over_exact", "probe", "cpu",
"isa", "cores", "commit", "torch", "dtype", "load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import machine  # noqa: E402

from engine.engine import LLMEngine  # noqa: E402
from engine.model.linear import SLOW_ROWS  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def decode_step_ms(engine: LLMEngine, band: range | None, tag: str, rng: random.Random) -> float:
    """Median time of the pure-decode steps of 32 fresh 128-token prompts x 64 tokens."""
    engine.runner.slow_rows = band
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(32):
        engine.add_request(f"{tag}-{i}", params, prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(128)])
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[4:]) * 1e3  # after the prefill steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,17,24,32,33,40")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("gemm_row_band", load_before)
    dtype = machine.resolve_dtype("auto")
    engine = LLMEngine.from_args(dtype=dtype, max_num_seqs=64, max_model_len=2048, kv_cache_mb=2048)
    model, probe = engine.runner.model, engine.runner.slow_rows

    passes: dict[int, list[float]] = {r: [] for r in rows}
    for r in rows:
        model.run_linears(r)  # oneDNN builds a primitive per new row count
    for _ in range(args.rounds):
        for r in rows:
            for _ in range(5):
                start = time.perf_counter()
                model.run_linears(r)
                passes[r].append(time.perf_counter() - start)
    linears = {r: round(statistics.median(t) * 1e3, 2) for r, t in passes.items()}

    rng = random.Random(0)
    decode_step_ms(engine, SLOW_ROWS, "warm-a", rng)
    decode_step_ms(engine, None, "warm-b", rng)
    decode: dict[str, list[float]] = {"padded": [], "exact": []}
    for i in range(args.rounds):
        for name, band in (("padded", SLOW_ROWS), ("exact", None))[:: 1 if i % 2 == 0 else -1]:
            decode[name].append(round(decode_step_ms(engine, band, f"r{i}{name}", rng), 2))

    in_band = [linears[r] for r in rows if r in SLOW_ROWS]
    summary = {
        "linears_ms": linears,
        "band_over_33": round(statistics.median(in_band) / linears[33], 3) if in_band and 33 in linears else None,
        "decode_step_ms": decode,
        "decode_padded_over_exact": round(statistics.median(decode["padded"]) / statistics.median(decode["exact"]), 3),
        "probe": None if probe is None else [probe.start, probe.stop - 1],
        "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
        "dtype": dtype, "load_before": list(load_before), "load_after": list(machine.load_avg()),
    }
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype}; load avg at start {' '.join(map(str, load_before))}",
             "packed linears (all projections + LM head), ms a pass, median: "
             + ", ".join(f"{r} rows {ms}" for r, ms in linears.items()),
             f"decode step of 32 sequences, ms (rounds): padded to 33 {decode['padded']}, exact {decode['exact']}",
             json.dumps(summary)]
    machine.report(lines, args.output)


if __name__ == "__main__":
    main()
