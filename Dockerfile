# syntax=docker/dockerfile:1
# tserve: the HTTP inference server with the bundled models.
#
#   CPU:   docker build -t tserve:cpu .
#   CUDA:  docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t tserve:cuda .
#   Run:   docker run --rm -p 8000:8000 tserve:cpu
#          docker run --rm --gpus all -p 8000:8000 tserve:cuda
#
# Settings are TSERVE_* environment variables (docker run -e TSERVE_MAX_QUEUE=64 ...); see docs/DEPLOY.md.
# The CUDA builds of torch carry the CUDA runtime libraries as wheels, so both variants use the same
# Python base image; a CUDA host needs only the NVIDIA driver and the NVIDIA Container Toolkit.

# Base image of both stages. The virtual environment is copied from the builder to the final stage,
# so both must have the same Python at the same path.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ------------------------------------------------------------------------------------------------------
# Builder: a virtual environment with torch and tserve installed.
# ------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

# Same version as TORCH_VERSION in the Makefile (tests/test_deploy.py checks it).
ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA build such as https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# The install steps of the Makefile, in the same order: torch first (from TORCH_INDEX_URL, so that
# installing tserve finds its torch requirement met and does not pull another build), then the package.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tserve ./tserve
RUN pip install --no-cache-dir .

# Our CPU kernels (tserve/model/kernels/*.cpp), built here with g++ into the virtual environment, which the final stage
# copies: it imports the build as it is and needs no compiler. Built from / so that the installed package (not
# /src) is the one built, as the final stage will name it.
ENV TORCH_EXTENSIONS_DIR=/opt/venv/torch-extensions
WORKDIR /
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m tserve.model.kernels --require

# The checkpoints, readable by the unprivileged user whatever their modes in the build context.
COPY models /opt/models
RUN chmod -R a+rX,go-w /opt/models

# ------------------------------------------------------------------------------------------------------
# Final image: the virtual environment, the bundled models and an unprivileged user; no build tools.
# ------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

LABEL org.opencontainers.image.title="tserve" \
      org.opencontainers.image.description="HTTP inference server for transformer models" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 tserve \
    && useradd --system --uid 10001 --gid tserve --home-dir /app --no-create-home --shell /usr/sbin/nologin tserve

COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY --from=builder /opt/models ./models

# TSERVE_DEVICE / TSERVE_DTYPE "auto": CUDA with bfloat16 when a GPU is visible, else CPU with float32.
# TSERVE_REQUEST_TIMEOUT_S is also how long a stopping server waits for running requests: give
# `docker stop` a longer time (docker stop -t 330, or stop_grace_period in compose).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TORCH_EXTENSIONS_DIR=/opt/venv/torch-extensions \
    TSERVE_HOST=0.0.0.0 \
    TSERVE_PORT=8000 \
    TSERVE_MODELS_DIR=/app/models \
    TSERVE_DEVICE=auto \
    TSERVE_DTYPE=auto \
    TSERVE_LOG_LEVEL=info \
    TSERVE_REQUEST_TIMEOUT_S=300

USER 10001:10001
EXPOSE 8000
STOPSIGNAL SIGTERM

# Liveness only: the process answers. Readiness (every model loaded and warmed up) is GET /readyz.
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TSERVE_PORT', '8000') + '/healthz', timeout=2)"]

CMD ["tserve", "serve"]
