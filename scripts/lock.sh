#!/usr/bin/env bash
# Writes the lock files from pyproject.toml (run after changing a dependency; tests/test_lock.py fails until
# they agree): requirements.lock pins what `chatsvc serve` needs (the Dockerfile installs it),
# requirements-dev.lock adds the bench and dev extras at the same versions (scripts/setup.sh installs it).
# Resolved for CPython 3.11 on x86-64 Linux against the CPU build of torch, whose dependencies they list;
# torch itself is left out so that its build (CPU or CUDA) comes from the index a machine is installed from,
# at the version pyproject.toml pins exactly.
# Pins already in the lock files are kept where they still fit; `scripts/lock.sh --upgrade` takes the newest.
# Needs uv (pip install uv). TORCH_WHEELS: where the CPU torch wheels are listed (a URL or a directory).
set -euo pipefail
cd "$(dirname "$0")/.."

uv="${UV:-uv}"
torch_wheels="${TORCH_WHEELS:-https://download.pytorch.org/whl/cpu/torch/}"
common=(--quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links "$torch_wheels"
        --no-emit-package torch --no-emit-package chatsvc --custom-compile-command scripts/lock.sh)
"$uv" pip compile pyproject.toml "${common[@]}" "$@" -o requirements.lock
"$uv" pip compile pyproject.toml "${common[@]}" --extra dev --extra bench --constraint requirements.lock \
    "$@" -o requirements-dev.lock
