# kvscale images. One Dockerfile, three published targets:
#
#   docker build --target operator -t ghcr.io/kvscale/kvscale-operator:0.1.0 .   # kopf only, no torch
#   docker build --target router   -t ghcr.io/kvscale/kvscale-router:0.1.0 .     # the operator's env, no torch
#   docker build --target worker   -t ghcr.io/kvscale/kvscale-worker:0.1.0 .     # engine + server (CUDA torch)
#
# BuildKit is needed (the default builder of current Docker; DOCKER_BUILDKIT=1 on older ones): pip
# keeps its downloads in a cache mount, so a rebuild never downloads torch again.
#
# PYTHON_IMAGE is any Debian-like image with python3 (>= 3.11) and its venv module, e.g. the
# default python:3.11-slim-bookworm, or a local one made without a registry (e2e/images.py:
# debootstrap bookworm + python3, python3-venv, ca-certificates). Everything is installed into
# the venv /opt/kvscale, so both kinds of base work the same (Debian's own python refuses
# `pip install` outside a venv).
#
# Layers, cheapest to change last: the pinned dependencies (requirements/*.txt, generated from
# pyproject.toml's extras) first, then the kvscale wheel with --no-index, so a code change
# rebuilds only the last layer and never reinstalls torch. The build context is the repository
# root; .dockerignore keeps .venv, caches and tests out.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    VIRTUAL_ENV=/opt/kvscale \
    PATH=/opt/kvscale/bin:$PATH

# uid/gid 1000, the same numbers the pods' securityContext (runAsUser/runAsGroup 1000) uses.
RUN groupadd --gid 1000 kvscale \
    && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvscale \
    && python3 -m venv /opt/kvscale

WORKDIR /app

# ---------------------------------------------------------------------------------------------
# Builds the kvscale wheel (pure Python) once for every target. Only the folders the package is
# made of: pyproject.toml maps common/, kernels/, worker/, operator/, router/ to kvscale.common etc.
FROM base AS builder

COPY pyproject.toml README.md ./
COPY common/ common/
COPY kernels/ kernels/
COPY worker/ worker/
COPY operator/ operator/
COPY router/ router/
RUN --mount=type=cache,target=/cache/pip,sharing=locked \
    pip wheel --cache-dir /cache/pip --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# The operator: the wheel with its `operator` extra, so what it needs is exactly what the
# package metadata says (core dependencies + kopf, kubernetes, pyyaml; never torch). The pinned
# set goes in first; the wheel then installs --no-index (a requirement the pins missed fails the
# build instead of being fetched unpinned). The check imports every module of kvscale.operator,
# kvscale.router and kvscale.common (aiohttp, prometheus_client, the kubernetes client, xxhash)
# without torch, and runs the command once (its logging setup too).
FROM base AS operator

COPY requirements/operator.txt /tmp/requirements/
RUN --mount=type=cache,target=/cache/pip,sharing=locked \
    pip install --cache-dir /cache/pip -r /tmp/requirements/operator.txt
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-index "$(echo /tmp/wheels/kvscale-*.whl)[operator]" \
    && rm -rf /tmp/wheels /tmp/requirements \
    && pip check \
    && python -c "import importlib, pkgutil, sys, kvscale.common, kvscale.operator, kvscale.router; \
[importlib.import_module(m.name) for p in (kvscale.common, kvscale.operator, kvscale.router) \
 for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]; \
assert 'torch' not in sys.modules, 'the operator image must not load torch'" \
    && kvscale-operator crd >/dev/null

# /healthz and /readyz (kvscale-operator run --health-port, default 8080).
EXPOSE 8080
# Numeric, so that the kubelet can check runAsNonRoot against the image.
USER 1000:1000
ENTRYPOINT ["kvscale-operator"]
CMD ["run"]

# ---------------------------------------------------------------------------------------------
# The router (kvscale-router, kvscale.router, docs/router.md): a package of its own, cluster-side
# like the operator and made of the same installed environment (the wheel's `operator` extra:
# aiohttp, the kubernetes client, prometheus-client, xxhash, pyzmq, msgspec) plus its `router`
# extra: transformers without torch, the tokenizer of the precise prefix index. Never torch.
FROM operator AS router

USER 0:0
COPY requirements/router.txt /tmp/requirements/
RUN --mount=type=cache,target=/cache/pip,sharing=locked \
    pip install --cache-dir /cache/pip -r /tmp/requirements/router.txt
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-index "$(echo /tmp/wheels/kvscale-*.whl)[operator,router]" \
    && rm -rf /tmp/wheels /tmp/requirements \
    && pip check \
    && python -c "import sys, kvscale.router.main, transformers; \
assert 'torch' not in sys.modules, 'the router image must not load torch'" \
    && kvscale-router --help >/dev/null

# The OpenAI-compatible API, /health, /ready and /metrics.
EXPOSE 8000
USER 1000:1000
ENTRYPOINT ["kvscale-router"]
CMD []

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

# A C and a C++ compiler and Python's headers stay in the runtime image, because both devices
# compile at run time:
# - on CPU, the forward runs through torch.compile (inductor, C++ wrapper: worker/model/
#   compilation.py), which writes C++ against Python.h and torch's headers (in the wheel) and builds
#   it with `g++ -fopenmp` (libgomp comes with gcc) when the worker starts. Without g++ the worker
#   runs its eager forward, 2-3x slower a step (docs/engine.md, "The compiled CPU forward");
# - on a CUDA device, Triton (installed with torch) compiles its launcher stub
#   (triton/backends/nvidia/driver.c, which includes Python.h) with `gcc` the first time it loads
#   (triton/runtime/build.py).
# python:3.11-slim carries Python.h already; a Debian python base gets it from python3-dev.
# Debian's package versions are not pinned: bookworm's security updates replace them and a pinned
# version would disappear from the mirror.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && if [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*

COPY requirements/worker.txt /tmp/requirements/
RUN --mount=type=cache,target=/cache/pip,sharing=locked \
    pip install --cache-dir /cache/pip -r /tmp/requirements/worker.txt
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-index "$(echo /tmp/wheels/kvscale-*.whl)[worker]" \
    && rm -rf /tmp/wheels /tmp/requirements \
    && pip check

# The built-in default model's compiled CPU forward ships in the image (issue 29), so that
# `kvscale-worker serve` / `generate` without --model compiles nothing: an AOTInductor package
# (worker/model/aot_package.py) in the venv's share/kvscale/compiled, where the worker looks after
# its compile cache. It is keyed by the model's shape, torch and this build machine's CPU features: a
# node whose CPU lacks one of them refuses it and builds its own behind the eager forward. Built from
# the model's config alone (the model folder is made and dropped here; pods make their own).
# Measured: ~45-60 s of a 2-core build machine, 5.5 MB (docs/benchmarks.md, "Cold start").
ARG KVSCALE_SHIP_COMPILED=1
RUN if [ "$KVSCALE_SHIP_COMPILED" = 1 ]; then \
        kvscale-worker --log-format text compile \
            --compile-cache-dir "$VIRTUAL_ENV/share/kvscale/compiled" \
        && rm -rf /tmp/* /tmp/.cache; fi

# Every cache goes under /tmp (an emptyDir in the pods; the root filesystem is read-only there).
# TORCHINDUCTOR_CACHE_DIR: inductor's compiled forward (its default, /tmp/torchinductor_USER, named
# by the user); a volume mounted there keeps the compile across restarts.
ENV HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor

# The OpenAI-compatible API, /health, /ready and /metrics.
EXPOSE 8000
# Kubernetes ignores HEALTHCHECK (the operator sets startup, readiness and liveness probes on
# /ready and /health), so the image declares none.
USER 1000:1000
ENTRYPOINT ["kvscale-worker"]
CMD ["serve"]
