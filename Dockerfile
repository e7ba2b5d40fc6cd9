# syntax=docker/dockerfile:1.7
#
# Hand-built GPU image with the DAPO rollout (vLLM) and trainer (DeepSpeed) software:
# the same as ROLLOUT_IMAGE / TRAINER_IMAGE / GPU_IMAGE in images/specs.py, for running
# the GPU code outside Flyte (a notebook, a benchmark on a GPU machine). The workflow's
# pods use the ImageSpecs, which `pyflyte run --remote` builds and pushes under tags
# that hash their specs (README, "Running on a cluster"): an image built here does not
# carry those tags, nor the environment (DAPO_IMAGE_REGISTRY) the dynamic workflows
# recompute them from.
#
#   docker build -t ghcr.io/dapo-flyte/dapo-gpu:dev .                         # both roles (default)
#   docker build --build-arg ROLE=rollout -t ghcr.io/dapo-flyte/dapo-rollout:dev .
#   docker build --build-arg ROLE=trainer -t ghcr.io/dapo-flyte/dapo-trainer:dev .
#
# Versions: images/pins.py holds the top-level pins (one source of truth with the
# ImageSpecs) and images/constraints-gpu.txt the full transitive lock, applied as
# constraints. torch 2.13.0 from PyPI is a CUDA 13.0 build, hence the CUDA 13.0
# base; GPU nodes need an NVIDIA driver of the R580 branch or newer.
# tests/test_images.py checks that the base image, uv and Python versions and the
# uid below agree with images/pins.py.
#
# The image runs as uid/gid 1001 (`flytekit`), the same uid that flytekit's
# ImageSpec builder gives its user on Ubuntu 24.04, so the pod templates in k8s/
# (runAsUser: 1001) fit images from either build path. Like ImageSpec images, the
# project sits in /root (the working directory and PYTHONPATH that Flyte's fast
# registration uses), owned by that user.

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9
# rollout | trainer | gpu (both)
ARG ROLE=gpu

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------------------
# base: OS packages, uv, a CPython 3.11 virtualenv and the non-root user.
# `devel` base on purpose: DeepSpeed JIT-builds its CUDA ops (FusedAdam, CPUAdam
# for optimizer offload) with nvcc, FlashInfer JIT-compiles kernels, and Triton
# compiles a small C launcher with gcc at first use.
# ---------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS base

ARG PYTHON_VERSION=3.11
ARG APP_USER=flytekit
ARG APP_UID=1001

ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TOKENIZERS_PARALLELISM=false

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        ca-certificates \
        build-essential \
        libaio-dev \
 && rm -rf /var/lib/apt/lists/*

COPY --from=uv /uv /usr/local/bin/uv

# uv's pinned version fixes which CPython 3.11 build it installs.
RUN uv venv --python "${PYTHON_VERSION}" /opt/venv \
 && python -c "import sys; assert sys.version_info[:2] == (3, 11), sys.version"

# Ubuntu 24.04 ships user `ubuntu` with uid 1000; ours is 1001 (see header).
RUN groupadd --gid "${APP_UID}" "${APP_USER}" \
 && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --shell /bin/bash "${APP_USER}"

# ---------------------------------------------------------------------------
# deps: the pinned Python packages for ROLE, installed under the full lock.
# ---------------------------------------------------------------------------
FROM base AS deps

ARG ROLE

RUN --mount=type=bind,source=images/pins.py,target=/tmp/build/pins.py \
    --mount=type=bind,source=images/constraints-gpu.txt,target=/tmp/build/constraints.txt \
    --mount=type=cache,target=/root/.cache/uv \
    python /tmp/build/pins.py "${ROLE}" > /tmp/requirements.txt \
 && uv pip install --requirement /tmp/requirements.txt --constraint /tmp/build/constraints.txt \
 && uv pip check \
 && rm /tmp/requirements.txt \
 && python -c "import torch; assert (torch.version.cuda or '').startswith('13.'), torch.version.cuda"

# ---------------------------------------------------------------------------
# final: the project code, owned by and run as the non-root user.
# ---------------------------------------------------------------------------
FROM deps AS final

ARG ROLE
ARG APP_USER=flytekit
ARG APP_UID=1001

LABEL org.opencontainers.image.title="dapo-${ROLE}" \
      org.opencontainers.image.description="DAPO on Flyte: ${ROLE} image (CUDA 13.0, torch 2.13.0)" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV HOME=/home/${APP_USER} \
    PYTHONPATH=/root \
    DAPO_IMAGE_ROLE=${ROLE}

WORKDIR /root
COPY --chown=${APP_UID}:${APP_UID} . /root
RUN chown "${APP_UID}:${APP_UID}" /root

# Numeric, so the kubelet can verify runAsNonRoot from the image alone.
USER ${APP_UID}:${APP_UID}
