#!/usr/bin/env bash
# Builds the C++ CPU kernels for each vector ISA named (avx2, avx512, avx512bf16, generic), for machines
# other than this one: the Dockerfile builds them into the image. torch's builder loads what it built; a
# build for an ISA this machine cannot run dies of SIGILL (exit 132) in that load, which comes only after
# the build succeeded (or found itself up to date), so with its library there it counts as built. Where the
# image runs, the engine's load finds the build up to date and only loads it.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python}"
[ $# -gt 0 ] || { echo "usage: $0 ISA..." >&2; exit 2; }
for isa in "$@"; do
    name="chatsvc_cpu_kernels_$isa"
    rc=0
    "$python" -m kernels.cpu_kernels "$isa" || rc=$?
    [ "$rc" -eq 0 ] && continue
    if [ -n "${TORCH_EXTENSIONS_DIR:-}" ]; then
        lib="$TORCH_EXTENSIONS_DIR/$name/$name.so"
    else
        lib=$(compgen -G "$HOME/.cache/torch_extensions/*/$name/$name.so" | head -n 1 || true)
    fi
    if [ "$rc" -eq 132 ] && [ -n "$lib" ] && [ -f "$lib" ]; then
        echo "build_kernels: built $lib (this CPU cannot run $isa, so it was not loaded here)" >&2
    else
        echo "build_kernels: the $isa build failed (exit $rc)" >&2
        exit 1
    fi
done
