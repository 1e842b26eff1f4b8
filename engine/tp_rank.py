"""A tensor-parallel rank's process: ``python -m engine.tp_rank``.

An engine with ``tensor_parallel_size=N`` starts ranks 1..N-1 this way on its machine (``engine.tp_group``:
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set); they serve its steps and exit when it stops. Under
torchrun, the same module runs a script on rank 0 while the other ranks serve that script's engine::

    torchrun --nproc-per-node 2 -m engine.tp_rank generate.py [ARGS...]
    torchrun --nproc-per-node 2 -m engine.tp_rank -m package.module [ARGS...]

Rank 0 runs the script (or module) as ``__main__``, as ``python`` would; it builds its engine
(``LLM(tensor_parallel_size=2)``) as it would alone. The script never runs on the other ranks, so its side
effects (output, files) happen once. ``chatsvc serve`` needs none of this: it serves a shard itself on a
rank other than 0.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from engine.distributed import serve_launched_rank
from engine.tp_group import SPAWNED_ENV, launched_rank

USAGE = "usage: torchrun [OPTIONS] -m engine.tp_rank (SCRIPT | -m MODULE) [ARGS...]"


def run_main(argv: list[str]) -> None:
    """Run ``SCRIPT [ARGS...]`` or ``-m MODULE [ARGS...]`` as ``__main__``, with that ``sys.argv``."""
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` puts it first
        runpy.run_path(argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = launched_rank()
    if rank is None:
        print(f"{USAGE}\nengine.tp_rank runs as a launched rank (RANK and WORLD_SIZE > 1 set)", file=sys.stderr)
        return 2
    if rank != 0:
        if os.environ.get(SPAWNED_ENV) == "1":
            # Ctrl-C reaches the whole process group; rank 0 decides when its ranks stop.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        serve_launched_rank()
        return 0
    if not argv or argv == ["-m"]:
        print(USAGE, file=sys.stderr)
        return 2
    run_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
