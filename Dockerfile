# kvscale images. One Dockerfile, two published targets and a default:
#
#   docker build --target operator -t ghcr.io/kvscale/kvscale-operator:0.1.0 .   # kopf only, no torch
#   docker build --target worker   -t ghcr.io/kvscale/kvscale-worker:0.1.0 .     # engine + server (CUDA torch)
#   docker build -t kvscale:dev .   # no --target: the last stage, `worker`, which also contains the
#                                   # operator (the package's full dependencies include kopf);
#                                   # e2e/kind/up.sh runs both the operator and the workers from it.
#
# The build context is the repository root; .dockerignore keeps .venv, caches and tests out.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp

# uid/gid 1000, the same numbers the pods' securityContext (runAsUser/runAsGroup 1000) uses.
RUN groupadd --gid 1000 kvscale \
    && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvscale

WORKDIR /app

# ---------------------------------------------------------------------------------------------
# Builds the kvscale wheel (pure Python) once for both targets. Only the folders the package is
# made of: pyproject.toml maps worker/, kernels/, operator/ to kvscale.worker/kernels/operator.
FROM base AS builder

COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY kernels/ kernels/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# The operator: kvscale.operator imports kopf, kubernetes, pydantic and pyyaml only (and
# kvscale.worker.server.json_logging, which is stdlib-only), so the package goes in without its
# dependencies and the four are installed by hand (minimum versions as in pyproject.toml).
FROM base AS operator

COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install "kopf>=1.37" "kubernetes>=30" "pydantic>=2.6" "pyyaml>=6" \
    && pip install --no-deps /tmp/wheels/kvscale-*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import sys, kvscale.operator.main, kvscale.operator.handlers; assert 'torch' not in sys.modules"

# /healthz and /readyz (kvscale-operator run --health-port, default 8080).
EXPOSE 8080
# Numeric, so that the kubelet can check runAsNonRoot against the image.
USER 1000:1000
ENTRYPOINT ["kvscale-operator"]
CMD ["run"]

# ---------------------------------------------------------------------------------------------
# The worker (also the default target). torch comes from PyPI: its default Linux x86_64 wheel is
# the CUDA build (the CUDA runtime libraries come as nvidia-* wheels; the node provides the
# driver), and it runs on CPU-only nodes too.
#
# Models are not in the image and nothing is downloaded from a hub (HF_HUB_OFFLINE=1): mount a
# Hugging Face model folder, e.g. at /models (docker run -v /path/to/model:/models/name:ro ...),
# and pass its path with --model; under the operator, an InferenceDeployment's model.uri names
# the path (`/models/...`) or a PVC (`pvc://CLAIM/SUBPATH`, mounted read-only at /models/CLAIM).
FROM base AS worker

# A C compiler: Triton (installed with torch) compiles its small CUDA launcher stubs with the
# system compiler at run time. Debian's package versions are not pinned: bookworm's security
# updates replace them and a pinned version would disappear from the mirror.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install /tmp/wheels/kvscale-*.whl \
    && rm -rf /tmp/wheels

# Every cache goes under /tmp (an emptyDir in the pods; the root filesystem is read-only there).
ENV HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton

# The OpenAI-compatible API, /health, /ready and /metrics.
EXPOSE 8000
# Kubernetes ignores HEALTHCHECK (the operator sets startup, readiness and liveness probes on
# /ready and /health), so the image declares none.
USER 1000:1000
ENTRYPOINT ["kvscale-worker"]
CMD ["serve"]
